"""Evaluation: generation with fixed seeds on every rollout actor, metrics, GenEval layout and
the base-vs-tuned report (``maskgrpo eval``; the evaluation inside training uses the same code)."""
