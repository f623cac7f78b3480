"""Reward functions: ``reward(images uint8 [N, H, W, 3], prompts list[str]) -> float [N]``."""
