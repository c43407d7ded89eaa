"""The harness daemon: a per-node supervisor of harness processes that outlives the
controller and the proxy, so a restarted controller re-adopts the harnesses that still run.

One daemon serves one directory (``train``'s run directory, or ``harness.dir`` on a Ray
node). Its files, under ``DIR/harnessd/`` (mode 0700)::

    lock      held (flock) by the live daemon, which writes its pid there: at most one
              per directory (:func:`daemon_pid`)
    token     the clients' secret (0600), new for each daemon, written before the socket
    sock      the Unix socket (0600)
    log       the daemon's own log
    state/    one JSON file per harness: pid, start, end, exit status (never its key)

The first client that needs it starts it (:meth:`HarnessDaemon.request`): a detached
process (its own session, forked once more so no one has to reap it) that the
controller's death does not touch. It starts each harness exactly as a harness host in
the controller would (:func:`~qwengyre.rollout.harness.supervise`: process group,
deadline, rlimits, stdout/stderr files), keeps its state on disk, answers when it ends,
kills it on request. It stops when told (the run ended: every harness is killed first)
or by itself once nothing has run and no client has asked anything for
``idle_exit_s``: with the controller gone and every harness ended, nothing is left to
supervise (the ended states stay on disk for the next daemon).

Protocol: one request per connection, one JSON line each way. A request carries the
token (anything else is answered ``{"error": "authentication failed"}``) and an
``op``:

- ``start`` (a :class:`~qwengyre.rollout.harness.HarnessLaunch`): starts it, answers its
  state once it runs (or failed to spawn); an execution id the daemon knows is never
  started again, its state is the answer;
- ``wait``: answers the execution's state once its harness ended;
- ``kill``: stops it (SIGTERM to its group, SIGKILL after the grace) and answers the
  ended state (``cancelled``);
- ``list``: every state; ``shutdown``: kills every running harness, answers, exits.

A daemon that starts and finds states a previous daemon left unended cannot wait on
those processes (they are not its children): it kills their groups (only a leader that
still carries the execution's id, :func:`~qwengyre.rollout.harness.kill_orphaned_harness`)
and marks them ``lost``. A per-execution relay that must outlive the controller would
start and stop with its harness in :meth:`Daemon._supervise`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qwengyre.rollout.harness import HarnessLaunch, HarnessRun, kill_orphaned_harness, supervise

__all__ = [
    "DAEMON_DIR",
    "HarnessDaemon",
    "HarnessDaemonError",
    "HarnessState",
    "daemon_pid",
    "main",
    "recorded_states",
]

log = logging.getLogger(__name__)

DAEMON_DIR = "harnessd"
IDLE_EXIT_S = 120.0
"""A daemon with nothing running and no request for this long stops itself."""
START_WAIT_S = 30.0
"""How long a daemon being started waits for another that holds the directory: one
starting (until its socket is bound) or stopping (until it lets the lock go)."""
_MAX_LINE = 16 * 1024 * 1024  # a launch carries the instructions: long, but bounded


class HarnessDaemonError(RuntimeError):
    """The daemon refused a request or could not be reached/started."""


@dataclass(kw_only=True)
class HarnessState:
    """What the daemon knows of one harness (the JSON of its state file; wall-clock
    times). ``lost``: it was running under a daemon that stopped, which killed it."""

    execution_id: str
    pid: int | None = None
    started: float = 0.0
    ended: float | None = None
    exit_code: int | None = None
    timed_out: bool = False
    cancelled: bool = False
    error: str | None = None
    spawned: bool = True
    lost: bool = False
    stdout: str = ""
    stderr: str = ""

    @property
    def running(self) -> bool:
        return self.ended is None

    def harness_run(self) -> HarnessRun:
        """How the harness ended, on this process's monotonic clock."""
        if self.ended is None:
            raise ValueError(f"harness of {self.execution_id} is still running")
        offset = time.monotonic() - time.time()
        return HarnessRun(
            exit_code=self.exit_code,
            timed_out=self.timed_out,
            cancelled=self.cancelled,
            started_s=self.started + offset,
            ended_s=self.ended + offset,
            stdout_path=Path(self.stdout) if self.stdout else None,
            stderr_path=Path(self.stderr) if self.stderr else None,
            error=self.error,
            spawned=self.spawned,
        )


# ------------------------------------------------------------------ the daemon


class Daemon:
    """The server side (runs in the daemon process; see the module docstring)."""

    def __init__(self, directory: Path, token: str, idle_exit_s: float) -> None:
        self.directory = directory
        self.token = token
        self.idle_exit_s = idle_exit_s
        self.states: dict[str, HarnessState] = {}
        self._cancel: dict[str, asyncio.Event] = {}
        self._ended: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}  # supervising each harness
        self._busy = 0  # requests being answered
        self._last = time.monotonic()
        self._stop = asyncio.Event()
        (directory / "state").mkdir(exist_ok=True)
        for state in recorded_states(directory.parent).values():
            if state.running:  # a previous daemon's child: it cannot be waited on
                kill_orphaned_harness(Path(state.stdout).parent, state.execution_id)
                state.ended, state.lost = time.time(), True
                state.error = "the harness daemon stopped while it ran"
                self._save(state)
                log.info("%s: left running by a stopped daemon: killed", state.execution_id)
            self.states[state.execution_id] = state

    def _save(self, state: HarnessState) -> None:
        path = self.directory / "state" / f"{state.execution_id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state)))
        tmp.replace(path)

    async def serve(self) -> None:
        """Answer requests until told to stop or idle (module docstring)."""
        server = await asyncio.start_unix_server(self._answer, path="sock", limit=_MAX_LINE)
        async with server:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=1.0)
                running = any(s.running for s in self.states.values())
                if not running and not self._busy and self._idle() > self.idle_exit_s:
                    log.info("idle for %.0f s with nothing running: stopping", self._idle())
                    break
        with contextlib.suppress(FileNotFoundError):
            os.unlink("sock")

    def _idle(self) -> float:
        return time.monotonic() - self._last

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._busy += 1
        self._last = time.monotonic()
        try:
            request = json.loads(await reader.readline())
            given = str(request.get("token", "")).encode()
            if not secrets.compare_digest(given, self.token.encode()):
                answer: dict[str, Any] = {"error": "authentication failed"}
            else:
                answer = await self._do(request)
        except Exception as exc:  # a malformed request: answered, the daemon goes on
            log.exception("request failed")
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self._busy -= 1
            self._last = time.monotonic()
        with contextlib.suppress(ConnectionError):
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
            writer.close()

    async def _do(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "start":
            launch = HarnessLaunch.from_json(request["launch"])
            return {"state": asdict(await self._start(launch))}
        if op == "wait":
            return {"state": asdict(await self._wait(str(request["id"])))}
        if op == "kill":
            execution_id = str(request["id"])
            if execution_id in self._cancel:
                self._cancel[execution_id].set()
            return {"state": asdict(await self._wait(execution_id))}
        if op == "list":
            return {"states": [asdict(s) for s in self.states.values()]}
        if op == "shutdown":
            for cancel in self._cancel.values():
                cancel.set()
            for execution_id in list(self._ended):
                await self._wait(execution_id)
            self._stop.set()
            return {"stopped": True}
        raise HarnessDaemonError(f"unknown op {op!r}; allowed: start, wait, kill, list, shutdown")

    async def _start(self, launch: HarnessLaunch) -> HarnessState:
        known = self.states.get(launch.execution_id)
        if known is not None:
            return known  # never started twice
        state = HarnessState(
            execution_id=launch.execution_id,
            started=time.time(),
            stdout=str(launch.logs_dir / "stdout.log"),
            stderr=str(launch.logs_dir / "stderr.log"),
        )
        self.states[state.execution_id] = state
        self._cancel[state.execution_id] = asyncio.Event()
        self._ended[state.execution_id] = asyncio.Event()
        spawned = asyncio.Event()
        self._tasks[state.execution_id] = asyncio.ensure_future(
            self._supervise(launch, state, spawned)
        )
        await spawned.wait()
        return state

    async def _supervise(
        self, launch: HarnessLaunch, state: HarnessState, spawned: asyncio.Event
    ) -> None:
        def on_spawn(pid: int) -> None:
            state.pid = pid
            self._save(state)
            spawned.set()

        try:
            run = await supervise(launch, self._cancel[state.execution_id], on_spawn)
            state.exit_code, state.error, state.spawned = run.exit_code, run.error, run.spawned
            state.timed_out, state.cancelled = run.timed_out, run.cancelled
        except Exception as exc:
            log.exception("%s: supervision failed", state.execution_id)
            state.error = f"the harness daemon failed: {exc}"
        state.ended = time.time()
        self._save(state)
        log.info("%s: ended %s", state.execution_id, state.exit_code)
        spawned.set()
        self._ended[state.execution_id].set()

    async def _wait(self, execution_id: str) -> HarnessState:
        state = self.states.get(execution_id)
        if state is None:
            raise HarnessDaemonError(f"no harness of execution {execution_id!r} here")
        if state.running:
            await self._ended[execution_id].wait()
        return state


def recorded_states(root: Path) -> dict[str, HarnessState]:
    """The state of every harness the daemons of ``root`` ran, by execution id, read from
    their files (no daemon needed; a state file is replaced whole, never torn)."""
    found = {}
    for path in sorted((Path(root) / DAEMON_DIR / "state").glob("*.json")):
        state = HarnessState(**json.loads(path.read_text()))
        found[state.execution_id] = state
    return found


def daemon_pid(root: Path) -> int | None:
    """The pid of the daemon serving ``root`` now (None when none does)."""
    path = Path(root) / DAEMON_DIR / "lock"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # held: a daemon serves, and wrote its pid
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _daemonize(directory: Path) -> bool:
    """Fork; the parent returns False once the child serves (or found another daemon
    serving, waiting for one that starts or stops: :data:`START_WAIT_S`), the child
    returns True holding the lock. Called in a process of its own
    session (the client starts it so), whose parent is the client."""
    ready_r, ready_w = os.pipe()
    if os.fork():
        os.close(ready_w)
        os.read(ready_r, 1)  # the child serves, or gave up: either way, done here
        return False
    os.close(ready_r)
    lock = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + START_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            # Another daemon holds the directory. Serving (its socket is there): done.
            # Starting (not yet bound) or stopping (socket gone, lock not yet): wait,
            # or the client that started this one would find no socket.
            if (directory / "sock").exists() or time.monotonic() > deadline:
                os._exit(0)
            time.sleep(0.02)
    os.ftruncate(lock, 0)
    os.write(lock, str(os.getpid()).encode())
    os.environ["_QWENGYRE_HARNESSD_READY_FD"] = str(ready_w)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m qwengyre.rollout.harnessd DIR [IDLE_EXIT_S]``: serve ``DIR``."""
    args = sys.argv[1:] if argv is None else argv
    directory = Path(args[0]).resolve() / DAEMON_DIR
    idle_exit_s = float(args[1]) if len(args) > 1 else IDLE_EXIT_S
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _daemonize(directory):
        return 0
    os.umask(0o077)
    os.chdir(directory)  # the socket is bound by a relative name: any path length works
    logfile = os.open("log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((0, null), (1, logfile), (2, logfile)):
        os.dup2(to, fd)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s harnessd[{os.getpid()}] %(message)s"
    )
    token = secrets.token_urlsafe(32)
    with contextlib.suppress(FileNotFoundError):
        os.unlink("sock")
    fd = os.open("token.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, token.encode())
    os.close(fd)
    os.replace("token.tmp", "token")

    async def run() -> None:
        daemon = Daemon(directory, token, idle_exit_s)
        serving = asyncio.ensure_future(daemon.serve())
        while not Path("sock").exists() and not serving.done():
            await asyncio.sleep(0.01)
        ready = int(os.environ.pop("_QWENGYRE_HARNESSD_READY_FD"))
        os.write(ready, b"1")
        os.close(ready)
        await serving

    log.info("serving %s (idle exit after %.0f s)", directory, idle_exit_s)
    asyncio.run(run())
    log.info("stopped")
    return 0


# ------------------------------------------------------------------ the client


class HarnessDaemon:
    """A client of the daemon serving ``root`` (started when none serves it): runs,
    re-attaches to and kills harnesses there. It holds no connection between requests,
    so the client process may die and another attach later."""

    def __init__(self, root: Path, *, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.root = Path(root).resolve()
        self.directory = self.root / DAEMON_DIR
        self.idle_exit_s = idle_exit_s

    async def run(self, launch: HarnessLaunch, cancel: asyncio.Event | None) -> HarnessRun:
        """Start ``launch`` under the daemon and wait until it ends (killed when
        ``cancel`` is set): a :data:`~qwengyre.rollout.harness.HarnessRunner`."""
        await self.request("start", launch=launch.to_json())
        return await self.attach(launch.execution_id, cancel)

    async def attach(self, execution_id: str, cancel: asyncio.Event | None) -> HarnessRun:
        """Wait until the harness of ``execution_id`` ends (started by anyone, this
        process or a dead one); ``cancel`` kills it. A daemon that stopped meanwhile is
        started again and answers ``lost``."""
        waiting = asyncio.ensure_future(self.state("wait", execution_id))
        cancelled = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
        try:
            watched = {waiting, *([cancelled] if cancelled else [])}
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                state = await self.state("kill", execution_id)
            else:
                state = waiting.result()
        finally:
            for task in (waiting, cancelled):
                if task is not None and not task.done():
                    task.cancel()
        return state.harness_run()

    async def state(self, op: str, execution_id: str) -> HarnessState:
        """``wait`` or ``kill`` (module docstring); a connection the daemon dropped (it
        died) is asked once more, of a new daemon."""
        try:
            answer = await self.request(op, id=execution_id)
        except (ConnectionError, asyncio.IncompleteReadError, json.JSONDecodeError):
            answer = await self.request(op, id=execution_id)
        return HarnessState(**answer["state"])

    async def states(self) -> list[HarnessState]:
        """Every harness the daemon knows (running, ended, lost)."""
        return [HarnessState(**s) for s in (await self.request("list"))["states"]]

    async def shutdown(self) -> None:
        """Kill every harness here and stop the daemon (none serving: nothing to do)."""
        if (self.directory / "sock").exists():
            with contextlib.suppress(OSError):
                await self.request("shutdown", start=False)

    async def request(self, op: str, *, start: bool = True, **fields: Any) -> dict[str, Any]:
        """One request, answered; the daemon is started first when none serves (and
        ``start``). Raises :class:`HarnessDaemonError` on a refusal."""
        try:
            reader, writer = await self._connect()
        except (FileNotFoundError, ConnectionRefusedError):
            if not start:
                raise
            await self._start_daemon()
            reader, writer = await self._connect()
        try:
            token = (self.directory / "token").read_text()
            writer.write(json.dumps({"token": token, "op": op, **fields}).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        finally:
            writer.close()
        if not line:
            raise ConnectionResetError(f"the harness daemon of {self.root} hung up")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise HarnessDaemonError(f"harness daemon of {self.root}: {answer['error']}")
        return answer

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        path = self.directory / "sock"
        if len(os.fsencode(path)) < 100:
            return await asyncio.open_unix_connection(path, limit=_MAX_LINE)
        # AF_UNIX paths are short (108 bytes): reach a deep one through its directory.
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return await asyncio.open_unix_connection(f"/proc/self/fd/{fd}/sock", limit=_MAX_LINE)
        finally:
            os.close(fd)

    async def _start_daemon(self) -> None:
        command = [sys.executable, "-m", "qwengyre.rollout.harnessd", str(self.root)]
        command.append(str(self.idle_exit_s))
        await asyncio.to_thread(
            subprocess.run,
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            check=False,
        )


if __name__ == "__main__":
    sys.exit(main())
