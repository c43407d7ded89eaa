"""A training run's metrics log (``metrics.jsonl``) and its HTML report.

The metrics records and writer import nothing heavy, so the training loop can use
them freely; the report (matplotlib) is imported on first use of its names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qwengyre.report.metrics import (
    METRICS_FILE,
    GroupRecord,
    LoadRecord,
    MetricsError,
    MetricsWriter,
    PublicationRecord,
    Record,
    RoleRecord,
    RunMetrics,
    RunRecord,
    StepRecord,
    SwitchRecord,
    UsageRecord,
    parse_record,
    read_metrics,
)

if TYPE_CHECKING:
    from qwengyre.report.html import (
        Summary,
        learning_signal_warning,
        role_spans,
        summarize,
        write_report,
    )

_REPORT_NAMES = ("Summary", "learning_signal_warning", "role_spans", "summarize", "write_report")

__all__ = [
    "METRICS_FILE",
    "GroupRecord",
    "LoadRecord",
    "MetricsError",
    "MetricsWriter",
    "PublicationRecord",
    "Record",
    "RoleRecord",
    "RunMetrics",
    "RunRecord",
    "StepRecord",
    "Summary",
    "SwitchRecord",
    "UsageRecord",
    "learning_signal_warning",
    "parse_record",
    "read_metrics",
    "role_spans",
    "summarize",
    "write_report",
]


def __getattr__(name: str) -> Any:
    if name in _REPORT_NAMES:
        from qwengyre.report import html

        return getattr(html, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
