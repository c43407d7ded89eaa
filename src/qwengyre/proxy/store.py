"""The proxy's durable store: executions, credentials (hashed) and recorded calls, in SQLite.

SQLite in WAL mode with ``synchronous=NORMAL``: a committed record survives a crash of
the process (not necessarily of the machine's power). The proxy commits a call's node
before it answers the harness, and a restarted proxy rebuilds every execution's tree
and tool-call cache from here. Token ids are stored as int32 arrays, log-probs as
float64 arrays; tool definitions once per distinct set (Claude Code sends ~64 KB of
them with every call).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from qwengyre.proxy.tito import Turn
from qwengyre.proxy.types import Message, ToolCall, ToolSpec
from qwengyre.trajectories.tree import Node, NodeMeta

_SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    id TEXT PRIMARY KEY, key_hash TEXT NOT NULL UNIQUE, created_s REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS toolsets (hash TEXT PRIMARY KEY, tools TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    execution TEXT NOT NULL REFERENCES executions(id), node INTEGER NOT NULL,
    parent INTEGER, input_ids BLOB NOT NULL, output_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL, versions BLOB NOT NULL, meta TEXT NOT NULL,
    new_messages TEXT NOT NULL,
    toolset TEXT NOT NULL REFERENCES toolsets(hash), PRIMARY KEY (execution, node));
"""


@dataclass(frozen=True)
class StoredExecution:
    id: str
    key_hash: str
    revoked: bool
    calls: list[tuple[Node, Turn]]


class ProxyStore(Protocol):
    """What the proxy needs from a durable store; :class:`Store` is the SQLite one.

    A server database (PostgreSQL, say) implements the same five methods; each write
    must be durable when it returns.
    """

    def add_execution(self, execution_id: str, key_hash: str, created_s: float) -> None: ...

    def revoke(self, execution_id: str) -> None: ...

    def add_call(self, execution_id: str, node: Node, turn: Turn) -> None: ...

    def load(self) -> list[StoredExecution]: ...

    def close(self) -> None: ...


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Store:
    """One SQLite file; safe to call from several threads (one writer at a time)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add_execution(self, execution_id: str, key_hash: str, created_s: float) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO executions (id, key_hash, created_s) VALUES (?, ?, ?)",
                (execution_id, key_hash, created_s),
            )

    def revoke(self, execution_id: str) -> None:
        with self._lock:
            self._db.execute("UPDATE executions SET revoked = 1 WHERE id = ?", (execution_id,))

    def add_call(self, execution_id: str, node: Node, turn: Turn) -> None:
        """Commit one recorded call; returns once it is durable."""
        tools = json.dumps([asdict(t) for t in turn.tools], sort_keys=True)
        toolset = hashlib.sha256(tools.encode()).hexdigest()
        messages = json.dumps([asdict(m) for m in turn.new_messages], ensure_ascii=False)
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "INSERT OR IGNORE INTO toolsets (hash, tools) VALUES (?, ?)", (toolset, tools)
                )
                self._db.execute(
                    "INSERT INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        execution_id,
                        node.id,
                        node.parent,
                        array("i", node.input_ids).tobytes(),
                        array("i", node.output_ids).tobytes(),
                        array("d", node.logprobs).tobytes(),
                        array("i", node.versions).tobytes(),
                        json.dumps(asdict(node.meta)),
                        messages,
                        toolset,
                    ),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def load(self) -> list[StoredExecution]:
        """Every execution with its calls in node order (for a restarted proxy)."""
        with self._lock:
            executions = self._db.execute(
                "SELECT id, key_hash, revoked FROM executions ORDER BY created_s, id"
            ).fetchall()
            toolsets = dict(self._db.execute("SELECT hash, tools FROM toolsets").fetchall())
            rows = self._db.execute("SELECT * FROM nodes ORDER BY execution, node").fetchall()
        by_execution: dict[str, list[tuple[Node, Turn]]] = {e[0]: [] for e in executions}
        conversations: dict[tuple[str, int], tuple[Message, ...]] = {}
        for execution, node_id, parent, inp, out, lps, vers, meta, new, toolset in rows:
            node = Node(
                node_id,
                parent,
                tuple(array("i", inp)),
                tuple(array("i", out)),
                tuple(array("d", lps)),
                tuple(array("i", vers)),
                NodeMeta(**json.loads(meta)),
            )
            new_messages = tuple(_message(m) for m in json.loads(new))
            before = () if parent is None else conversations[(execution, parent)]
            conversation = (*before, *new_messages)
            conversations[(execution, node_id)] = conversation
            tools = tuple(ToolSpec(**t) for t in json.loads(toolsets[toolset]))
            by_execution[execution].append((node, Turn(node_id, conversation, new_messages, tools)))
        return [
            StoredExecution(eid, key_hash, bool(revoked), by_execution[eid])
            for eid, key_hash, revoked in executions
        ]


def _message(data: dict[str, Any]) -> Message:
    calls = tuple(ToolCall(**c) for c in data.pop("tool_calls"))
    return Message(tool_calls=calls, **data)
