"""Which executions the proxy knows, and which of them keep their recorders in memory.

Start-up reads every execution's credentials from the store (its key's hash, whether it
was revoked); an execution's recorder (its trajectory tree and what builds the next
prompt) is loaded from the store when a call needs it. At most ``max_resident``
executions keep theirs in memory; one idle for ``idle_s`` seconds, or revoked, leaves
memory (unless a call of it is in flight) and is loaded again when it is next used. An
execution whose stored calls do not load is quarantined: one warning, and each of its
calls answers a ``permission_error``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from qwengyre.proxy.body import BodyMemo
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.store import DamagedRecord, ProxyStore, hash_key
from qwengyre.proxy.tito import ExecutionRecorder
from qwengyre.proxy.types import ApiError
from qwengyre.trajectories.classes import RuleSet
from qwengyre.trajectories.tree import TrajectoryTree

log = logging.getLogger(__name__)
_EXECUTION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(kw_only=True)
class ExecutionState:
    """An execution's credentials and, while it is in use, its recorder."""

    id: str
    key_hash: str
    revoked: bool = False
    recorder: ExecutionRecorder | None = None  # None: not in memory, loaded on demand
    damaged: str | None = None  # why its stored calls do not load (quarantined)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # orders its commits
    busy: int = 0  # calls in flight
    used_s: float = 0.0  # time.monotonic() of its last use
    bodies: BodyMemo = field(default_factory=BodyMemo)  # its recent request bodies


class Residency:
    """The executions by id and by key, their recorders loaded on demand and evicted
    when idle, revoked or crowded out (see the module docstring)."""

    def __init__(
        self,
        store: ProxyStore,
        renderer: ChatRenderer,
        max_context: int,
        *,
        max_resident: int,
        idle_s: float,
        classes: RuleSet | None = None,
    ) -> None:
        """``classes``: the request-class rules every recorder applies (None: the
        default rule set)."""
        self.store = store
        self.renderer = renderer
        self.max_context = max_context
        self.classes = classes
        self.max_resident = max_resident
        self.idle_s = idle_s
        self.executions: dict[str, ExecutionState] = {}
        self._by_key: dict[str, str] = {}
        self._resident: OrderedDict[str, ExecutionState] = OrderedDict()  # least recent first
        for stored in store.executions():  # credentials only: trees load on demand
            self.add(stored.id, stored.key_hash).revoked = stored.revoked

    def add(self, execution_id: str, key_hash: str) -> ExecutionState:
        """Know a new execution (its recorder loads on first use)."""
        state = ExecutionState(id=execution_id, key_hash=key_hash)
        self.executions[execution_id] = state
        self._by_key[key_hash] = execution_id
        return state

    def holder(self, key: str) -> ExecutionState | None:
        """The execution whose key ``key`` is, unless it was revoked; None for any other
        key (empty included)."""
        execution_id = self._by_key.get(hash_key(key)) if key else None
        state = self.executions.get(execution_id) if execution_id else None
        return None if state is None or state.revoked else state

    def named(self, execution_id: str) -> ExecutionState:
        """The execution ``execution_id`` names (revoked ones too); a
        ``not_found_error`` (404) if none."""
        state = self.executions.get(execution_id) if _EXECUTION_ID.match(execution_id) else None
        if state is None:
            raise ApiError("not_found_error", f"no execution {execution_id[:64]!r}")
        return state

    async def recorder(self, state: ExecutionState) -> ExecutionRecorder:
        """``state``'s recorder, loaded from the store (in a worker thread: other
        executions' calls go on meanwhile) if it is not in memory; an execution whose
        records are damaged answers a ``permission_error``."""
        if state.recorder is None and state.damaged is None:
            async with state.lock:  # one load, however many calls wait for it
                if state.recorder is None and state.damaged is None:
                    try:
                        state.recorder = await asyncio.to_thread(self._load, state.id)
                    except DamagedRecord as exc:
                        log.warning("quarantined %s", exc)
                        state.damaged = exc.reason
        if state.recorder is None:
            raise ApiError(
                "permission_error",
                f"execution {state.id} is quarantined: its stored calls are damaged "
                f"({state.damaged}); nothing more is recorded for it",
            )
        recorder = state.recorder
        self._resident.pop(state.id, None)
        self.evict(room=1)  # the others: this one is in use
        state.used_s = time.monotonic()
        self._resident[state.id] = state
        return recorder

    async def tree(self, execution_id: str) -> TrajectoryTree:
        """An execution's trajectory tree (loaded from the store in a worker thread if
        it is not in memory; it is not kept)."""
        state = self.executions[execution_id]
        if state.recorder is not None:
            return state.recorder.tree
        return (await asyncio.to_thread(self._load, execution_id)).tree

    def _load(self, execution_id: str) -> ExecutionRecorder:
        """A recorder with an execution's stored calls; :class:`DamagedRecord` if they
        do not load."""
        recorder = ExecutionRecorder(self.renderer, self.max_context, self.classes)
        for node, turn in self.store.calls(execution_id):
            recorder.add(node, turn)
        return recorder

    def evict(self, room: int = 0) -> None:
        """Drop the recorders of idle or least recently used executions, leaving room
        for ``room`` more."""
        now = time.monotonic()
        for state in list(self._resident.values()):  # least recently used first
            crowded = len(self._resident) + room > self.max_resident
            if not crowded and now - state.used_s <= self.idle_s:
                break  # the rest are newer
            if state.busy == 0:
                self._drop(state)

    def release(self, state: ExecutionState) -> None:
        """A revoked execution leaves memory unless a call of it is in flight (all of it
        is in the store)."""
        if state.busy == 0 and state.id in self._resident:
            self._drop(state)

    def _drop(self, state: ExecutionState) -> None:
        del self._resident[state.id]
        state.recorder, state.bodies = None, BodyMemo()

    async def sweep(self) -> None:
        """Executions idle for ``idle_s`` leave memory even when no other call comes to
        evict them (runs until cancelled)."""
        while True:
            await asyncio.sleep(max(0.05, self.idle_s / 2))
            self.evict()
