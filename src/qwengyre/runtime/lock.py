"""The run-directory lock: one run (``train``, ``train --resume``, ``rollout``) at a time.

A run holds an OS lock (``fcntl.flock``, exclusive) on ``RUN_DIR/.qwengyre.lock`` for as
long as it uses the directory (:func:`lock_run_dir`), and writes who it is into that file
(pid, host, command, since when). A second run on the directory refuses with one line
naming the holder (:class:`RunDirLocked`). The lock belongs to the open file, so it dies
with the process that holds it: a run killed with SIGKILL leaves no stale lock (the file
stays, unlocked, with the dead holder's details; the next run simply takes it). The file
is opened close-on-exec, and cells are spawned (fork + exec), so no child inherits it.

The lock is taken once per run: ``train()`` holds it across its in-process restarts,
``rollout()`` for the whole rollout. It is not re-entrant (``flock`` conflicts between
two open files even within one process).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

__all__ = ["LOCK_FILE", "RunDirLocked", "lock_holder", "lock_run_dir"]

LOCK_FILE = ".qwengyre.lock"


class RunDirLocked(ValueError):
    """Another process holds the run directory's lock; the message is one line."""


def lock_holder(run_dir: Path) -> dict[str, Any] | None:
    """The details the lock file holds (its holder's, or a dead holder's), if any."""
    try:
        info = json.loads((Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _describe(run_dir: Path) -> str:
    info = None
    for _ in range(20):  # the holder may be between taking the lock and writing its details
        info = lock_holder(run_dir)
        if info is not None:
            break
        time.sleep(0.01)
    if info is None:
        return f"run directory {run_dir} is in use by another process (no details in {LOCK_FILE})"
    message = (
        f"run directory {run_dir} is in use by pid {info.get('pid')} on {info.get('host')} "
        f"({info.get('command')}) since {info.get('since')}; wait for it to end or stop it"
    )
    pid = info.get("pid")
    if info.get("host") == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        # The holder died, but a process that inherited its open lock file lives on.
        held = ", ".join(f"pid {p} ({cmd})" for p, cmd in _openers(Path(run_dir) / LOCK_FILE))
        message += f" -- pid {pid} has exited; still holding the lock: {held or 'unknown'}"
    return message


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _openers(path: Path) -> list[tuple[int, str]]:
    """Other processes (pid, command line) with ``path`` open, as far as /proc shows."""
    target = os.path.realpath(path)
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        if fd_dir.parent.name == str(os.getpid()):
            continue  # we opened it to ask
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                cmdline = (fd_dir.parent / "cmdline").read_bytes().decode(errors="replace")
                words = " ".join(cmdline.replace("\0", " ").split())  # the message is one line
                found.append((int(fd_dir.parent.name), words[:200]))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def _has_contents(run_dir: Path) -> bool:
    return run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir())


@contextmanager
def lock_run_dir(run_dir: Path, *, new: bool = False, command: str | None = None) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for the ``with`` block (creating the directory and the lock
    file; yields the lock file's path), or raise :class:`RunDirLocked` naming the process
    that holds it. Never waits.

    ``new``: a run about to start, whose directory must hold nothing but the lock file,
    else ``ValueError`` -- checked before anything is created when there is no lock file
    (a directory no run used is left as it was), and again once locked (a directory in
    use is refused naming its holder, not as non-empty). ``command`` is what the
    holder's details name (default: this process's argv)."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    not_empty = f"{run_dir} is not empty; pick a new --run-dir or pass --resume"
    if new and not path.exists() and _has_contents(run_dir):
        raise ValueError(not_empty)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:  # closing the file releases the lock
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirLocked(_describe(run_dir)) from None
        if new and _has_contents(run_dir):
            raise ValueError(not_empty)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": command or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        try:
            yield path
        finally:
            with suppress(OSError):
                os.ftruncate(fd, 0)  # no stale details once nobody holds it
    finally:
        os.close(fd)
