"""Where a run's checkpoints live: ``storage`` (a local/NFS folder or an object store, manifests,
the ``latest`` pointer, retention) and ``run_store`` (a run's store from ``run.storage``). What
goes into a checkpoint is the loop's (:mod:`maskgrpo_ray.loop.recovery`). This ``__init__``
imports nothing.
"""
