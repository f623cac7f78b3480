"""The Ray backend: the step's executor on a Ray cluster.

``executor`` (``RayExecutor``: the learner side and the wiring) with ``fleet`` (the
``RolloutFleet``: the rollout and reward pools, healing, scaling, prompt metadata and the weight
sync's membership, one owner behind one lock), ``chunks`` (pull-based chunk scheduling),
``filter`` (the filter actor seen from the driver), ``cluster`` (joining or starting a
cluster), ``metrics`` (the run's figures as Ray metrics) and ``weight_transfer`` (the
collective weight sync both sides speak). The actors themselves are ``maskgrpo_ray.actors`` and
the learner ranks ``maskgrpo_ray.learner``; those import only this package's leaves
(``cluster``, ``metrics``, ``weight_transfer``), so this ``__init__`` imports nothing (else
loading a leaf would load the executor, which imports the actors: a circle).

Named ``backend``, not ``ray``: ``maskgrpo_ray.ray`` would read as Ray itself in imports,
tracebacks and ``from maskgrpo_ray import ray``.
"""
