"""``maskgrpo plan``'s model: ``cost_model`` (FLOPs, cost profiles, the pipeline ideal),
``checkpoint_cost`` and ``reward_cost``. No torch. This ``__init__`` imports nothing.
"""
