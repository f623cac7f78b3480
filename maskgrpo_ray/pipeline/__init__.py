"""The pipeline: what a step is made of, the same in one process and on Ray.

``settings`` (the config turned once into frozen settings per role) and ``build`` (settings to
objects: policy, reward, filter); ``messages`` (the typed messages between the phases: chunk ->
rollout -> scored -> filtered -> train) and ``data_plane`` (what travels by reference on Ray);
``phases`` (generate, score, filter, advantages as plain functions); ``learner_loss`` and
``learner_core`` (the one update path, one process or every DeepSpeed rank). No Ray, no loop:
the loop that drives these is :mod:`maskgrpo_ray.loop`. This ``__init__`` imports nothing, so
the actors, the learner ranks and the evaluation load one module alone.
"""
