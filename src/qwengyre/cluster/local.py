"""Local placement: each cell is an object living in its own process on this machine.

:class:`ProcessActor` is the smallest actor that serves the runtime: the object is
built in a process of its own, and method calls travel over a pipe one at a time,
in order, like calls to a Ray actor. The process is forked from multiprocessing's fork
server, which imported what a cell needs (torch, transformers: about 5 s of CPU) once
and nothing else: an actor starts without paying for that import again, yet inherits
nothing of the caller's state (no threads, no CUDA) but its environment, which it is
handed as it is at the start. ``await actor.call("method", ...)`` does not block
the caller's event loop. An exception inside the process comes back as
:class:`ActorError` with the remote traceback (a full disk as the process's
:class:`~qwengyre.durable.DiskFullError` itself); the process keeps serving.
:meth:`ProcessActor.check_alive` tells, at any time, whether the process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing as mp
import os
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from qwengyre.durable import DiskFullError

__all__ = ["ActorDied", "ActorError", "ProcessActor", "actor_processes"]

COMM_BYTES = 15
"""The longest process name Linux keeps (``/proc/PID/comm``)."""


class ActorError(RuntimeError):
    """A method raised inside the actor's process."""


class ActorDied(RuntimeError):
    """The actor's process is gone (crashed or killed)."""


def _name_process(name: str) -> None:
    """Show ``name`` (its first 15 bytes) in ``ps``, ``top`` and ``/proc/PID/comm``
    instead of ``python``; nothing where the platform has no ``/proc``."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_bytes(name.encode()[:COMM_BYTES])


PRELOAD = ["qwengyre.cluster.cell", "qwengyre.cluster.standalone"]
"""What the fork server imports once for every actor it forks."""


def actor_processes(parent: int) -> dict[str, int]:
    """The live actor processes that process ``parent`` started, by name (Linux): the
    children of its fork server. Names, unlike pids, do not depend on the order the
    kernel hands pids out in (pids wrap around)."""
    processes: list[tuple[int, int, bytes, str]] = []  # pid, parent, command line, name
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
            name = (stat.parent / "comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        processes.append((int(stat.parent.name), ppid, cmdline, name))
    servers = {
        pid for pid, ppid, cmdline, _ in processes if ppid == parent and b"forkserver" in cmdline
    }
    return {name: pid for pid, ppid, _, name in processes if ppid in servers}


def _serve(
    conn: Connection, env: dict[str, str], factory: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    os.environ.clear()  # the fork server's is the caller's when it started
    os.environ.update(env)
    _name_process(mp.current_process().name)
    try:
        obj = factory(*args)
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:  # stop: let the object release what it holds first
            close = getattr(obj, "close", None)
            try:
                if close is not None:
                    close()
            finally:
                conn.send((True, None))
            return
        method, call_args, kwargs = message
        try:
            conn.send((True, getattr(obj, method)(*call_args, **kwargs)))
        except DiskFullError as exc:  # one line that says it all: no traceback
            conn.send((False, exc))
        except BaseException:
            conn.send((False, traceback.format_exc()))


CLOSE_TIMEOUT_S = 60.0
"""How long a polite stop may take: longer than a server's SIGTERM grace
(:func:`qwengyre.engines.launch.stop_server`), so that a server that ignores SIGTERM is
still killed by its host rather than left running when the actor is killed."""


class ProcessActor:
    """``factory(*args)`` built in its own process; call its methods with :meth:`call`."""

    def __init__(self, factory: Callable[..., Any], *args: Any, name: str = "actor") -> None:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)  # read when the fork server starts
        self.name = name
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child, dict(os.environ), factory, args), name=name, daemon=True
        )
        self._process.start()
        child.close()
        self._lock = threading.Lock()
        self._caller = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._started = False

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _receive(self) -> Any:
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            # A broken pipe, or the pipe closed under this call (EBADF) by close() once
            # the process had died.
            if isinstance(exc, EOFError | ConnectionError) or not self._process.is_alive():
                raise self._died() from exc
            raise
        if not ok:
            raise value if isinstance(value, DiskFullError) else ActorError(f"{self.name}: {value}")
        return value

    def call_sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` in the actor's process and return its result (blocking)."""
        with self._lock:
            if self._conn.closed:  # closed after it died (the runtime replaced it)
                raise self._died()
            if not self._started:
                self._receive()  # construction result
                self._started = True
            try:
                self._conn.send((method, args, kwargs))
            except (BrokenPipeError, ConnectionError) as exc:
                raise self._died() from exc
            return self._receive()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """:meth:`call_sync` without blocking the event loop, on the actor's own thread:
        calls run in the order they were made, and a slow call of one actor never
        holds up another's behind it in a shared thread pool."""
        loop = asyncio.get_running_loop()
        call = functools.partial(self.call_sync, method, *args, **kwargs)
        try:
            return await loop.run_in_executor(self._caller, call)
        except RuntimeError as exc:  # closed: after it died (the runtime replaced it)
            if self._conn.closed:
                raise self._died() from exc
            raise

    async def check_alive(self) -> None:
        """Raise :class:`ActorDied` if the process has ended (also during a call)."""
        if not self._process.is_alive():
            raise self._died()

    def _died(self) -> ActorDied:
        """The error for a process that ended, with its exit code however it was noticed
        (a broken pipe can come before the process is reaped: wait for it briefly)."""
        self._process.join(5.0)
        code = self._process.exitcode
        suffix = "" if code is None else f" (exit code {code})"
        return ActorDied(f"{self.name} (pid {self.pid}) died{suffix}")

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the process: politely (the object closes what it holds, e.g. stops its
        server, SIGKILL included), then by force. A call still running after
        ``timeout_s`` (a hung one) does not hold the stop back."""
        if self._process.is_alive() and self._lock.acquire(timeout=timeout_s):
            try:
                self._conn.send(None)
            except (BrokenPipeError, ConnectionError, OSError):
                pass
            finally:
                self._lock.release()
            self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout_s)
        self._conn.close()
        self._caller.shutdown(wait=False)
