"""Prompts: ``loading`` (a registered prompt set or a file, with metadata, deduplication and a
resumable prompt stream), ``generate`` (``maskgrpo prompts``' generated sets), and GenEval's
prompt metadata: ``geneval_schema`` (its tags, class names and check) and ``geneval_rule`` (its
rule, exact: ``decide``, NumPy only; the worlds import it, so it stays light). This
``__init__`` imports nothing.
"""
