"""The ready-group ledger: every rollout group that finished its rollout, durably.

A group is appended (and fsynced) the moment it becomes ready, with its admitted
trajectories and advantages, before it can be assigned to training. A checkpoint
records which groups its version has trained; on resume, the ledger's groups minus
those are the ready groups the scheduler gets back. So a crash loses no finished
group and a resumed run trains none twice (docs/design.md §4: nothing recorded is lost).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from qwengyre.jsonl import JsonlError
from qwengyre.training.buffers import GroupSample

__all__ = ["Ledger", "LedgerError"]


class LedgerError(JsonlError):
    """A ledger line that cannot be read (other than a truncated last line)."""


class Ledger:
    """Append-only JSONL of :class:`GroupSample`, one line per ready group."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, group: GroupSample) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(group.to_json(), separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[GroupSample]:
        """Every recorded group; a truncated last line (a crash mid-write) is skipped."""
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").split("\n")
        groups = []
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                groups.append(GroupSample.from_json(json.loads(text)))
            except (ValueError, KeyError, TypeError) as exc:
                if number == len(lines):  # no newline after it: cut off by a crash
                    break
                raise LedgerError(self.path, f"unreadable group record: {exc}", number) from None
        return groups
