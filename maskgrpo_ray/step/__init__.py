"""The step: the algorithm's loop, the same for every backend and every policy lag.

``driver`` runs the steps (``run_step``: collect, advantages, update, sync, log; a lost learner
rolls back to the ``recovery.RunCursor``); ``collect`` owns which groups a step trains on (the
``GroupSource``); ``phases`` are generate, score, filter and advantages as plain functions;
``learner_core`` and ``learner_loss`` the one update path (one process or every DeepSpeed
rank); ``executor`` the protocol a backend implements and ``local`` the single-process one (the
reference of every distributed run); ``recovery`` checkpoints and learner recovery; ``figures``
a step's figures. Nothing here imports Ray: the Ray backend is :mod:`maskgrpo_ray.backend`.
This ``__init__`` imports nothing: the actors, the learner ranks and the evaluation load
``phases`` or ``learner_core`` alone.
"""
