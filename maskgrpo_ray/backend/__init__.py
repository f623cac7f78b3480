"""The Ray backend: the step's executor on a Ray cluster.

``ray_executor`` (``RayExecutor``, the loop's ``Executor`` protocol on Ray: the learner side and
the wiring) with ``fleet`` (the ``RolloutFleet``: the rollout and reward pools, healing, scaling,
prompt metadata and the weight sync's membership, one owner behind one lock), ``chunks``
(pull-based chunk scheduling), ``filter`` (the filter actor seen from the driver), ``control``
(the control actor: ``maskgrpo scale`` and ``status``) and ``checkpoint`` (the learner's part
of a checkpoint). The actors themselves are
``maskgrpo_ray.actors`` and the learner ranks ``maskgrpo_ray.learner``; what they share with this
package (joining the cluster, Ray metrics, the collective weight transfer) is
:mod:`maskgrpo_ray.cluster`, below all three. This ``__init__`` imports nothing.

Named ``backend``, not ``ray``: ``maskgrpo_ray.ray`` would read as Ray itself in imports,
tracebacks and ``from maskgrpo_ray import ray``.
"""
