"""The proxy's durable store: executions, credentials (hashed) and recorded calls, in SQLite.

SQLite in WAL mode with ``synchronous=NORMAL``: a committed record survives a crash of
the process (not necessarily of the machine's power). The proxy commits a call's node
before it answers the harness (marked undelivered until the answer was written), and a
restarted proxy loads an execution's tree and tool-call cache from here when the
execution is next used. A call stores its increment only: its new input ids, its
output ids, log-probs and versions (int32 / float32 / int32 arrays: engines and the
trainer compute log-probs in fp32, so nothing is lost; ~12 bytes a sampled token, 4 an
injected one, before SQLite's pages), an MoE's routed experts where the engine reported
them (``layers x k`` bytes a token, :mod:`qwengyre.trajectories.routed_experts`) and the
messages it added;
tool definitions are stored once per distinct set (Claude Code sends ~64 KB of them
with every call). Text is stored as JSON with ASCII escapes, so any string a client or
the model produces (lone surrogates included) round-trips exactly.

Loading never fails as a whole: an execution whose records are damaged raises
:class:`DamagedRecord` for that execution only. A write that finds the disk full raises
:class:`~qwengyre.durable.DiskFullError` naming the store; nothing of it is recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import threading
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from qwengyre.durable import disk_full, is_disk_full
from qwengyre.proxy.tito import Turn, toolset_json
from qwengyre.proxy.types import Message, ToolCall, ToolSpec
from qwengyre.trajectories import routed_experts
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
    """An execution's credentials and state, without its calls."""

    id: str
    key_hash: str
    revoked: bool


class DamagedRecord(Exception):
    """An execution's stored calls cannot be loaded; the execution is quarantined."""

    def __init__(self, execution_id: str, reason: str) -> None:
        super().__init__(f"execution {execution_id}: {reason}")
        self.execution_id = execution_id
        self.reason = reason


class ProxyStore(Protocol):
    """What the proxy needs from a durable store; :class:`Store` is the SQLite one.

    A server database (PostgreSQL, say) implements the same methods; each write must
    be durable when it returns, and writes of one execution arrive in node order.
    """

    def add_execution(self, execution_id: str, key_hash: str, created_s: float) -> None: ...

    def revoke(self, execution_id: str) -> None: ...

    def add_call(self, execution_id: str, node: Node, turn: Turn) -> None: ...

    def set_delivered(self, execution_id: str, node_id: int, delivered: bool) -> None: ...

    def executions(self) -> list[StoredExecution]: ...

    def calls(self, execution_id: str) -> list[tuple[Node, Turn]]: ...

    def close(self) -> None: ...


def hash_key(key: str) -> str:
    """The SHA-256 (hex) of ``key``'s UTF-8 bytes, for any string: surrogates (a header's
    non-UTF-8 bytes, as the HTTP server decodes them) are encoded as they stand, so such
    a key hashes, and matches no issued key (those are ASCII), instead of raising."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class Store:
    """One SQLite file; safe to call from several threads (one writer at a time)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(nodes)")}
        if "delivered" not in columns:  # a store written before delivery was recorded
            self._db.execute("ALTER TABLE nodes ADD COLUMN delivered INTEGER NOT NULL DEFAULT 1")
        if "routing" not in columns:  # ... or before routed experts were
            self._db.execute("ALTER TABLE nodes ADD COLUMN routing BLOB")
            self._db.execute("ALTER TABLE nodes ADD COLUMN routing_form TEXT")
        self._lock = threading.Lock()
        self._toolsets: set[str] = set()  # written already

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """Hold the lock; a full disk inside raises :class:`DiskFullError`."""
        with self._lock:
            try:
                yield
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode == sqlite3.SQLITE_FULL or is_disk_full(exc, self.path):
                    raise disk_full(self.path, what) from exc
                raise

    def add_execution(self, execution_id: str, key_hash: str, created_s: float) -> None:
        with self._writing(f"execution {execution_id}"):
            self._db.execute(
                "INSERT INTO executions (id, key_hash, created_s) VALUES (?, ?, ?)",
                (execution_id, key_hash, created_s),
            )

    def revoke(self, execution_id: str) -> None:
        with self._writing(f"the revocation of execution {execution_id}"):
            self._db.execute("UPDATE executions SET revoked = 1 WHERE id = ?", (execution_id,))

    def add_call(self, execution_id: str, node: Node, turn: Turn) -> None:
        """Commit one recorded call; returns once it is durable. Nothing is written if
        it raises."""
        toolset = turn.toolset
        tools = None if toolset in self._toolsets else toolset_json(turn.tools)
        messages = json.dumps([asdict(m) for m in turn.new_messages])
        meta = asdict(node.meta)
        delivered = meta.pop("delivered")
        routing, form = (
            (None, None) if node.routing is None else routed_experts.encode(node.routing)
        )
        row = (
            execution_id,
            node.id,
            node.parent,
            array("i", node.input_ids).tobytes(),
            array("i", node.output_ids).tobytes(),
            array("f", node.logprobs).tobytes(),
            array("i", node.versions).tobytes(),
            json.dumps(meta),
            messages,
            toolset,
            int(delivered),
            routing,
            form,
        )
        with self._writing(f"call {node.id} of execution {execution_id}"):
            self._db.execute("BEGIN")
            try:
                if tools is not None:
                    self._db.execute(
                        "INSERT OR IGNORE INTO toolsets (hash, tools) VALUES (?, ?)",
                        (toolset, tools),
                    )
                self._db.execute(
                    "INSERT INTO nodes (execution, node, parent, input_ids, output_ids,"
                    " logprobs, versions, meta, new_messages, toolset, delivered, routing,"
                    " routing_form) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    row,
                )
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # SQLite rolled back itself on a full disk
                    self._db.execute("ROLLBACK")
                raise
            self._toolsets.add(toolset)

    def set_delivered(self, execution_id: str, node_id: int, delivered: bool) -> None:
        with self._writing(f"the delivery of call {node_id} of execution {execution_id}"):
            self._db.execute(
                "UPDATE nodes SET delivered = ? WHERE execution = ? AND node = ?",
                (int(delivered), execution_id, node_id),
            )

    def executions(self) -> list[StoredExecution]:
        """Every execution's credentials and state (cheap: no calls are read)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, key_hash, revoked FROM executions ORDER BY created_s, id"
            ).fetchall()
        return [StoredExecution(eid, key_hash, bool(revoked)) for eid, key_hash, revoked in rows]

    def calls(self, execution_id: str) -> list[tuple[Node, Turn]]:
        """One execution's calls in node order; :class:`DamagedRecord` if they cannot
        be loaded exactly (a gap, a missing parent or tool set, an undecodable field)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT node, parent, input_ids, output_ids, logprobs, versions, meta,"
                " new_messages, toolset, delivered, routing, routing_form FROM nodes"
                " WHERE execution = ?"
                " ORDER BY node",
                (execution_id,),
            ).fetchall()
            hashes = sorted({row[8] for row in rows})
            marks = ",".join("?" * len(hashes))
            toolsets = dict(
                self._db.execute(
                    f"SELECT hash, tools FROM toolsets WHERE hash IN ({marks})", hashes
                ).fetchall()
            )
        out: list[tuple[Node, Turn]] = []
        lengths: list[int] = []
        tools_by_hash: dict[str, tuple[ToolSpec, ...]] = {}
        for expected, row in enumerate(rows):
            try:
                node, turn = _decode(row, lengths, toolsets, tools_by_hash)
            except Exception as exc:  # any damage quarantines this execution only
                raise DamagedRecord(execution_id, f"call {row[0]}: {exc!r}") from exc
            if node.id != expected:
                raise DamagedRecord(execution_id, f"call {expected} is missing")
            out.append((node, turn))
            lengths.append(turn.length)
        return out


def _decode(
    row: tuple[Any, ...],
    lengths: list[int],
    toolsets: dict[str, str],
    tools_by_hash: dict[str, tuple[ToolSpec, ...]],
) -> tuple[Node, Turn]:
    node_id, parent, inp, out, lps, vers, meta, new, toolset, delivered, routing, form = row
    if parent is not None and not 0 <= parent < len(lengths):
        raise ValueError(f"parent {parent} is not an earlier call")
    node = Node(
        id=node_id,
        parent=parent,
        input_ids=array("i", inp),
        output_ids=array("i", out),
        logprobs=array("f", lps),
        versions=array("i", vers),
        meta=NodeMeta(**json.loads(meta), delivered=bool(delivered)),
        routing=None if routing is None else routed_experts.decode(routing, form),
    )
    tools = tools_by_hash.get(toolset)
    if tools is None:
        tools = tuple(ToolSpec(**t) for t in json.loads(toolsets[toolset]))
        tools_by_hash[toolset] = tools
    new_messages = tuple(_message(m) for m in json.loads(new))
    if not new_messages or new_messages[-1].role != "assistant":
        raise ValueError("the call's messages do not end with its reply")
    length = (0 if parent is None else lengths[parent]) + len(new_messages)
    return node, Turn(
        node_id=node_id,
        parent=parent,
        new_messages=new_messages,
        tools=tools,
        toolset=toolset,
        length=length,
    )


def _message(data: dict[str, Any]) -> Message:
    calls = tuple(ToolCall(**c) for c in data.pop("tool_calls"))
    return Message(tool_calls=calls, **data)
