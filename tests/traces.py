"""Trace files for tests, written the way a live run writes them (``TraceWriter``)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from qwengyre.records.trace import TraceRecord, TraceWriter


def write_trace(path: Path, records: Iterable[TraceRecord]) -> None:
    """A new trace at ``path`` holding ``records``, one line each."""
    path.unlink(missing_ok=True)
    with TraceWriter(path) as writer:
        for record in records:
            writer.write(record)
