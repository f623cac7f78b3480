"""The run's log: ``run_log`` (``metrics.jsonl``, the reward curve, sample grids, ``superseded/``),
``trackers`` (TensorBoard, Weights & Biases, MLflow) and ``monitors`` (the alarms' figures and
rules over the run's rows). No torch model, no config: the config's ``logging`` section
imports ``trackers``. This ``__init__`` imports nothing.
"""
