"""Supervision of a live run's cells: seen dead at once, replaced, lost or the run stops;
crashed engine servers started again.

:class:`Supervisor` checks every cell (and the standalone pool) each
:data:`CELL_WATCH_S`. A cell that died, in any role, leaves the open training step at
once (``leave``: the micro-steps it claimed, and those of the cells past it, go back to
the cells that stay) and the proxy stops routing to it. Then:

- with a replacement left (``run.replace_dead_cells``), a new process takes its place
  (``start``), the core's included: the live cells re-form their groups with it
  (:meth:`~qwengyre.cluster.cell.Cell.regroup`) and the controller puts it in the dead
  cell's role (``adopt``). The core's replacement takes over the newest published
  weights and the newest checkpoint's optimizer state. The scheduler never hears of it.
- else a cell other than the core is lost: the scheduler hears
  :class:`~qwengyre.scheduler.events.CellLost` and the survivors re-form their groups
  without it, so that the cells past it train again. The core's death, or one the
  scheduler refuses (:meth:`~qwengyre.scheduler.core.Scheduler.why_not_lose`), stops
  the run.

The groups are re-formed under :attr:`Supervisor.groups`, which an update's collectives
hold too: a regroup never interleaves with one. Deaths may overlap (the core dies while
a satellite's replacement starts): one formation connects every replacement started so
far, and a member found dead while the groups form is handled first (its replacement
joins the next formation, or the groups form without it); the others stop waiting for it
at once (``call_off``). An engine the proxy drained for failing,
on a rollout cell or the standalone pool, is asked to start its server again if it
crashed (a publication that found its server dead drains it so: nothing calls a dead
server, and it serves again with the newest weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, cast

from qwengyre.cluster.client import CellClient, EngineClient
from qwengyre.cluster.local import ActorDied
from qwengyre.cluster.placement import engine_name
from qwengyre.proxy.routing import Router
from qwengyre.scheduler.core import Scheduler
from qwengyre.scheduler.events import STANDALONE, CellLost, Event, Role

__all__ = ["CELL_WATCH_S", "Cluster", "Supervisor"]

log = logging.getLogger(__name__)

CELL_WATCH_S = 1.0
"""How often every cell's liveness is checked."""


class Cluster(Protocol):
    """What the supervisor asks of the cluster the cells run on."""

    async def replacement(self, cell: int) -> CellClient:
        """New processes for the ranks of ``cell``, its model loaded, not connected."""
        ...

    def call_off(self, generation: int) -> None:
        """The cells forming ``generation``'s groups stop waiting for each other (see
        :func:`qwengyre.training.distributed.call_off`)."""
        ...


class Supervisor:
    """Watches ``cells`` and ``standalone`` for the controller: ``spawn`` runs a
    background task of the controller's, ``emit`` puts an event on its queue, ``leave``
    takes a cell (and those past it) out of the open step, ``rejoin`` lets the training
    cells take part again once a death is handled; ``cluster`` starts a cell's
    replacement (``replacements`` of them in all), which ``adopt`` gives its cell's
    role, and calls off the forming of groups a member died in (without it, the
    others wait for the dead one until the rendezvous times out).
    ``cells`` is the controller's list: a replacement takes its cell's place in it."""

    def __init__(
        self,
        cells: list[CellClient],
        standalone: EngineClient | None,
        scheduler: Scheduler,
        router: Router,
        *,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
        emit: Callable[[Callable[[float], Event]], None],
        leave: Callable[[int], Awaitable[None]],
        cluster: Cluster | None = None,
        adopt: Callable[[int, CellClient], Awaitable[None]] | None = None,
        rejoin: Callable[[], None] = lambda: None,
        replacements: int = 0,
    ) -> None:
        self.cells = cells
        self.standalone = standalone
        self.scheduler = scheduler
        self.router = router
        self._spawn = spawn
        self._emit = emit
        self._leave = leave  # the cell leaves the open training step, at once
        self._cluster = cluster
        self._adopt = adopt
        self._rejoin = rejoin  # the training cells take part in the open step again
        self.replacements = replacements if cluster is not None and adopt is not None else 0
        self.replaced = 0  # replacements started so far
        self.lost: dict[int, ActorDied] = {}  # cells given up for dead: why
        self.members: tuple[int, ...] = tuple(range(len(cells)))  # of the groups now
        self.generation = 0  # of the groups now (or being formed)
        self.groups = asyncio.Lock()  # the cells' groups: held by an update, or a regroup
        # What the next groups are to be: their members, the replacements to connect
        # (started, not yet in the groups), and how many changes they reflect.
        self._wanted = self.members
        self._joining: dict[int, CellClient] = {}
        self._changes = self._formed = 0
        self._handling: dict[int, asyncio.Task[None]] = {}  # deaths being handled
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

    def gone(self, cell: int) -> bool:
        """``cell`` is lost, or its death is being handled (it may be replaced)."""
        return cell in self.lost or cell in self._handling

    def _watched(self) -> list[tuple[int, CellClient]]:
        """The cells not lost nor being replaced, by index."""
        return [(cell, actor) for cell, actor in enumerate(self.cells) if not self.gone(cell)]

    def _revive_failed_engines(self) -> None:
        """A rollout cell (or the standalone pool) whose engine the proxy drained for
        failing asks its host to start the server again if it crashed; the proxy takes
        it back as soon as it is started (or at its next check, if it was not down)."""
        engines = {engine_name(c): c for c in range(len(self.cells))}
        if self.standalone is not None:
            engines[engine_name(STANDALONE)] = STANDALONE
        for name in self.router.failed():
            engine = engines.get(name)
            if engine is None or self.gone(engine) or engine in self._reviving:
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
                await self.router.recover()  # serving now, not at the proxy's next check
        except ActorDied as died:
            if engine == STANDALONE:
                raise
            await self.lose(engine, died)
        finally:
            self._reviving.discard(engine)

    async def lose(self, cell: int, died: ActorDied) -> None:
        """Go on without the process of ``cell``, which ``died``: replace it, or leave
        the cell behind (see the module docstring); re-raise ``died`` if the run cannot
        go on. A death seen again, or seen only now of a process already replaced, is
        ignored once it is handled."""
        if cell in self.lost:
            return
        handling = self._handling.get(cell)
        if handling is None:
            # The controller's task: its failure stops the run even if no caller waits.
            handling = cast(asyncio.Task[None], self._spawn(self._handle(cell, died)))
            self._handling[cell] = handling
            handling.add_done_callback(lambda _: self._handled(cell))
        await asyncio.shield(handling)  # a caller cancelled (a worker) leaves it be

    def _handled(self, cell: int) -> None:
        del self._handling[cell]
        self._rejoin()  # a replacement in training claims micro-steps now

    async def _handle(self, cell: int, died: ActorDied) -> None:
        with contextlib.suppress(ActorDied):
            await self.cells[cell].check_alive()
            return  # ``died`` was its predecessor's: replaced since
        if self.replaced < self.replacements:
            await self._replace(cell, died)
            return
        if self.scheduler.why_not_lose(cell) is not None:
            raise died
        self.lost[cell] = died
        want = self._change(members=tuple(c for c in self._wanted if c != cell))
        log.warning("%s; the run goes on without it", died)
        await self._leave(cell)
        await self.router.drain(engine_name(cell), wait=False)
        await asyncio.to_thread(self.cells[cell].close)  # its other ranks, if any
        self._emit(lambda t: CellLost(t, cell))
        await self._form(want)

    async def _replace(self, cell: int, died: ActorDied) -> None:
        """A new process takes the place of ``cell``'s dead one; ``died`` if it cannot."""
        assert self._cluster is not None and self._adopt is not None
        self.replaced += 1
        log.warning(
            "%s; a new %s takes its place (replacement %d of %d)",
            died,
            engine_name(cell),
            self.replaced,
            self.replacements,
        )
        await self._leave(cell)
        await self.router.drain(engine_name(cell), wait=False)
        await asyncio.to_thread(self.cells[cell].close)  # its other ranks, if any
        try:
            new = await self._cluster.replacement(cell)
            await new.pid()  # built, its model loaded: the others wait for it no longer
        except Exception as exc:
            raise died from exc  # the run stops (or restarts: run.restarts)
        self._joining[cell] = new
        await self._form(self._change())
        try:
            await self._adopt(cell, new)
        except Exception as exc:
            raise died from exc

    def _change(self, members: tuple[int, ...] | None = None) -> int:
        """Note a change the groups are to reflect (new ``members``, or a replacement
        to connect); its number, for :meth:`_form`."""
        if members is not None:
            self._wanted = members
        self._changes += 1
        return self._changes

    async def _form(self, change: int) -> None:
        """Form the groups among the wanted members, connecting every replacement
        started, unless a formation since ``change`` did. A member dying meanwhile is
        handled first: its replacement joins the next formation, or that one goes
        without it. Raise what stops the run (a death the run cannot go on after)."""
        while self._formed < change:
            async with self.groups:
                if self._formed >= change:
                    return
                changes, members, joining = self._changes, self._wanted, dict(self._joining)
                # A member whose death is being handled and whose replacement has not
                # started yet cannot be in the groups: its handling forms them.
                starting = [c for c in members if c in self._handling and c not in joining]
                dead = None if starting else await self._meet(members, joining)
                if not starting and dead is None:
                    self.members, self._formed = members, changes
                    for c in joining:
                        del self._joining[c]
                    return
            if starting:
                await asyncio.shield(self._handling[starting[0]])
            else:
                assert dead is not None
                cell, died = dead
                if cell in joining:
                    raise died  # a replacement that died joining
                await self.lose(cell, died)

    async def _meet(
        self, members: tuple[int, ...], joining: dict[int, CellClient]
    ) -> tuple[int, ActorDied] | None:
        """One formation, of a new generation: the ``joining`` replacements connect,
        the other ``members`` regroup. A member found dead calls it off; returns it,
        or None once formed."""
        self.generation += 1
        generation = self.generation
        calls = {
            asyncio.ensure_future(
                joining[c].connect(members, generation, takeover=c == 0)
                if c in joining
                else self.cells[c].regroup(members, generation)
            ): c
            for c in members
        }
        waiting: set[asyncio.Future[Any]] = set(calls)
        while waiting:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_EXCEPTION)
            if self._cluster is not None and any(t.exception() is not None for t in done):
                self._cluster.call_off(generation)  # the others stop waiting for it
        failed = {calls[t]: exc for t in calls if (exc := t.exception()) is not None}
        for cell, exc in failed.items():
            if isinstance(exc, ActorDied):
                return cell, exc
        for exc in failed.values():
            raise exc  # no member died: a bug
        return None

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
            log.warning("%s, after which: %r", died, failure)
            return died
        except Exception:
            pass
        return failure
