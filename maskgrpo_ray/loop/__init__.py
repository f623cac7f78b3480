"""The loop: the algorithm's step loop, the same for every backend and every policy lag.

``driver`` runs the steps (``run_step``: collect, advantages, update, sync, log; a lost learner
rolls back to the ``recovery.RunCursor``); ``collect`` owns which groups a step trains on (the
``GroupSource``); ``executor`` the protocol a backend implements and ``local`` the single-process
one (the reference of every distributed run); ``recovery`` checkpoints and learner recovery,
``snapshot`` the asynchronous checkpoint writer; ``staleness`` the groups' policy lag;
``figures`` a step's figures; ``monitoring`` the monitors' phase; ``step_signal_probe`` the
step-signal probe. What a step is made of (the phases, the update) is
:mod:`maskgrpo_ray.pipeline`. Nothing here imports Ray: the Ray backend is
:mod:`maskgrpo_ray.backend`. This ``__init__`` imports nothing.
"""
