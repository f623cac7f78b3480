"""Thin Ray actors: rollout, reward, filter."""
