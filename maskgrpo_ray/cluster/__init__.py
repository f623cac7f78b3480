"""What every Ray process of a run shares (the driver, the actors, the learner ranks): ``attach``
(joining a Ray cluster, or starting a local one bound to loopback), ``ray_metrics`` (the run's
figures as Ray metrics, for the dashboard) and ``weight_transfer`` (the collective weight sync
both sides speak). Below :mod:`maskgrpo_ray.backend`, ``maskgrpo_ray.actors`` and
``maskgrpo_ray.learner``, which all import it. This ``__init__`` imports nothing.
"""
