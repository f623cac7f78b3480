"""The DeepSpeed learner actor and weight sync."""
