"""The embedded worlds: small text-to-image worlds that need no download, each with its grammar
(prompts and their GenEval metadata), renderer, judge, rewards and the pre-training of its base
model, registered as a model kind and reward kinds.

* ``toy`` (:mod:`maskgrpo_ray.worlds.toy`): palette dots on a 4 x 4 grid; a token is a whole
  object. The default of ``make run``: it learns in a minute.
* ``shapes`` (:mod:`maskgrpo_ray.worlds.shapes`): GenEval-shaped scenes in pixels (shapes of
  several colours and sizes, one to four of them), a tokenizer learned from the renders so that an
  object spans many tokens, a detector that judges GenEval's six tags, and a reward model that is
  not the judge (a small contrastive image-text model). The world the paper's ablations are
  checked on (docs/shapes_world.md).

This package imports nothing: each world's modules load on their own (the registries import them
on first use of their kinds).
"""
