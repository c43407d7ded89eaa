"""On-disk record formats a run writes and every reader shares: the metrics log
(``metrics.jsonl``), the execution trace (``traces.jsonl``) and the assessment log
(``assessments.jsonl``). A leaf: it imports only the pure layers below it, so the
simulator, the report and the runtime all read the same definitions.
"""
