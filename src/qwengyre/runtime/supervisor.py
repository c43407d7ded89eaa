"""Supervision of a live run's cells: seen dead at once, lost or the run stops; crashed
engine servers started again.

:class:`Supervisor` checks every cell (and the standalone pool) each
:data:`CELL_WATCH_S`. A cell other than the core that died, in any role, is lost: the
proxy stops routing to it, the open training step goes on without it (``leave``: the
micro-steps it claimed go back to the cells that stay) and the scheduler hears
:class:`~qwengyre.scheduler.events.CellLost`, so the run goes on without it. The core's
death, or one the scheduler refuses (:meth:`~qwengyre.scheduler.core.Scheduler.why_not_lose`),
stops the run. An engine the proxy drained for failing, on a rollout cell or the
standalone pool, is asked to start its server again if it crashed (a publication that
found its server dead drains it so: nothing calls a dead server, and it serves again
with the newest weights).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from qwengyre.cluster.client import CellClient, EngineClient
from qwengyre.cluster.local import ActorDied
from qwengyre.cluster.placement import engine_name
from qwengyre.proxy.routing import Router
from qwengyre.scheduler.core import Scheduler
from qwengyre.scheduler.events import STANDALONE, CellLost, Event, Role

__all__ = ["CELL_WATCH_S", "Supervisor"]

log = logging.getLogger(__name__)

CELL_WATCH_S = 1.0
"""How often every cell's liveness is checked."""


class Supervisor:
    """Watches ``cells`` and ``standalone`` for the controller: ``spawn`` runs a
    background task of the controller's, ``emit`` puts an event on its queue."""

    def __init__(
        self,
        cells: Sequence[CellClient],
        standalone: EngineClient | None,
        scheduler: Scheduler,
        router: Router,
        *,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
        emit: Callable[[Callable[[float], Event]], None],
        leave: Callable[[int], Awaitable[None]],
    ) -> None:
        self.cells = list(cells)
        self.standalone = standalone
        self.scheduler = scheduler
        self.router = router
        self._spawn = spawn
        self._emit = emit
        self._leave = leave  # the cell leaves the open training step, at once
        self.lost: dict[int, ActorDied] = {}  # cells given up for dead: why
        self._reviving: set[int] = set()  # cells starting a crashed engine again

    async def watch(self) -> None:
        """A cell that dies is seen at once, not at the next call it gets (a rollout
        cell gets none from the controller until its next move or publication): a cell
        other than the core is lost, the core's death stops the run (this raises)."""
        while True:
            for cell, actor in self._watched():
                try:
                    await actor.check_alive()
                except ActorDied as died:
                    await self.lose(cell, died)
            if self.standalone is not None:
                await self.standalone.check_alive()
            self._revive_failed_engines()
            await asyncio.sleep(CELL_WATCH_S)

    def _watched(self) -> list[tuple[int, CellClient]]:
        """The cells not lost, by index."""
        return [(cell, actor) for cell, actor in enumerate(self.cells) if cell not in self.lost]

    def _revive_failed_engines(self) -> None:
        """A rollout cell (or the standalone pool) whose engine the proxy drained for
        failing asks its host to start the server again if it crashed; the proxy takes
        it back once healthy."""
        engines = {engine_name(c): c for c in range(len(self.cells))}
        if self.standalone is not None:
            engines[engine_name(STANDALONE)] = STANDALONE
        for name in self.router.failed():
            engine = engines.get(name)
            if engine is None or engine in self.lost or engine in self._reviving:
                continue
            if engine == STANDALONE or self.scheduler.roles[engine] is Role.ROLLOUT:
                self._reviving.add(engine)
                self._spawn(self._revive(engine))

    async def _revive(self, engine: int) -> None:
        actor = self.standalone if engine == STANDALONE else self.cells[engine]
        assert actor is not None
        try:
            if await actor.revive_engine():
                log.warning("%s: its engine crashed and was started again", engine_name(engine))
        except ActorDied as died:
            if engine == STANDALONE:
                raise
            await self.lose(engine, died)
        finally:
            self._reviving.discard(engine)

    async def lose(self, cell: int, died: ActorDied) -> None:
        """Go on without ``cell``, which ``died``; re-raise it if the run cannot."""
        if cell in self.lost:
            return
        if self.scheduler.why_not_lose(cell) is not None:
            raise died
        self.lost[cell] = died
        log.warning("%s; the run goes on without it", died)
        await self._leave(cell)
        await self.router.drain(engine_name(cell), wait=False)
        await asyncio.to_thread(self.cells[cell].close)  # its other ranks, if any
        self._emit(lambda t: CellLost(t, cell))

    async def _check_cells(self) -> None:
        """Raise ``ActorDied`` for the first cell (or the standalone pool) that is gone,
        of those not already lost."""
        for _, actor in self._watched():
            await actor.check_alive()
        if self.standalone is not None:
            await self.standalone.check_alive()

    async def root_cause(self, failure: BaseException) -> BaseException:
        """A dead cell, if any: it explains the failure of the calls to it and of its
        peers' collectives, whichever was seen first. A check that itself fails leaves
        ``failure`` as it is."""
        try:
            await self._check_cells()
        except ActorDied as died:
            return died
        except Exception:
            pass
        return failure
