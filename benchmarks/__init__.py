"""Benchmarks of torchinstruments (run from the repository root, e.g.
``python -m benchmarks.faults``)."""
