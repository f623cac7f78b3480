"""Weights: ``safe_files`` (reading weight, checkpoint and state files without running code),
``hub_field`` (what a hub-able config value is, declared by the model and reward modules) and
``hub`` (hub ids resolved to local folders, on the driver). Below the models and rewards: no
torch model, no registry at load time. This ``__init__`` imports nothing.
"""
