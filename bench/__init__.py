"""The benchmarks and experiments: scripts run from the repository root as
``python -m bench.NAME`` (bench/README.md lists each one's question, its doc and its results).
``bench.toy_lab`` is the library the seeded-run experiments share."""
