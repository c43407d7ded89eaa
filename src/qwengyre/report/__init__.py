"""A run's report: ``qwengyre report`` (HTML + PNG), runs side by side, metric sinks.

The records it reads live in :mod:`qwengyre.records` (``metrics.jsonl``, traces,
assessments).
"""
