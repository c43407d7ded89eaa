"""Kernel-enforced limits on one harness: processes, memory, open files, CPU time.

A harness runs whatever the policy writes, so a fork bomb or a runaway allocation must
hit a wall the kernel keeps, not one the harness could lift. :class:`Limits` says how
much; :func:`enforce` makes it so for one execution, with the strongest mechanism this
machine offers:

- processes: ``pids.max`` of a cgroup of the execution's own (cgroup v1 ``pids`` or a v2
  hierarchy with the ``pids`` controller), else ``RLIMIT_NPROC`` in a sandbox's user
  namespace (there it counts the harness's own processes);
- memory: ``memory.limit_in_bytes`` (v1, and the memory+swap limit where swap is
  accounted) or ``memory.max`` (v2) of that cgroup, else ``RLIMIT_AS`` (per process and
  counting address space, not resident memory: too tight for Node's reservations);
- open files: ``RLIMIT_NOFILE`` (per process; capped by qwengyre's own hard limit);
- CPU time: ``RLIMIT_CPU`` (per process).

Measured (Linux 6.18, cgroup v1 writable, as root): ``pids.max`` binds (fork fails with
EAGAIN) and so does the memory limit (an allocation past it is OOM-killed).
``RLIMIT_NPROC`` at 20 binds for a non-root uid in bubblewrap's user namespace (17
forks; two sandboxes at once got 16 and 14: counted per namespace), but not for uid 0,
outside a user namespace or inside one bubblewrap made (100 of 100 forks): so unsandboxed
or as root without a writable cgroup hierarchy processes are unbounded
(:attr:`Enforcement.unbound`, said once in the log). Outside a user namespace it would
count every process and thread of qwengyre's user, so it is not set there.

The cgroup is made under the one qwengyre itself is in (``/proc/self/cgroup``), named
``qwengyre-<execution id>``; the harness joins it between fork and exec, so no process of
its escapes it, and :meth:`Enforcement.close` kills whatever is left in it and removes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qwengyre.config import HarnessLimitsConfig

__all__ = ["CGROUP_ROOT", "Enforcement", "Limits", "enforce", "release"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
_MB = 1024 * 1024
log = logging.getLogger(__name__)
_warned: set[str] = set()  # the limits said once to be unenforceable here


@dataclass(frozen=True)
class Limits:
    """How much one harness (with everything it starts) may use; None: no limit.
    ``processes`` counts threads too (the kernel's tasks)."""

    processes: int | None = None
    memory_mb: int | None = None
    open_files: int | None = None
    cpu_s: int | None = None

    def __post_init__(self) -> None:
        for name in ("processes", "memory_mb", "open_files", "cpu_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"limit {name} must be a positive int or None, got {value!r}")

    @classmethod
    def of(cls, config: HarnessLimitsConfig) -> Limits:
        """The limits the config's ``harness.limits`` section sets."""
        return cls(config.max_processes, config.max_memory_mb, config.max_open_files)


@dataclass
class Enforcement:
    """The limits of one running harness: ``preexec`` (for ``subprocess``'s
    ``preexec_fn``: join the cgroups, set the rlimits) and :meth:`close`.
    ``unbound``: the limits nothing here could enforce (e.g. ``processes`` as root
    without a writable cgroup)."""

    cgroups: list[Path] = field(default_factory=list)
    rlimits: list[tuple[int, int]] = field(default_factory=list)
    unbound: list[str] = field(default_factory=list)

    def preexec(self) -> Callable[[], None] | None:
        """Run in the child between fork and exec: only ``open``/``write``/``setrlimit``
        system calls on values prepared here. CPython calls ``preexec_fn`` unsafe when the
        parent has threads (a lock another thread held at fork stays held); plain system
        calls on prepared values take none, which is the accepted narrow use. Joining or
        limiting the child after it started would race with its first forks."""
        if not self.cgroups and not self.rlimits:
            return None
        procs = [str(cgroup / "cgroup.procs") for cgroup in self.cgroups]
        rlimits = list(self.rlimits)

        def join_and_limit() -> None:
            for path in procs:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, b"0")  # 0: the writer itself
                finally:
                    os.close(fd)
            for which, value in rlimits:
                resource.setrlimit(which, (value, value))

        return join_and_limit

    def close(self) -> None:
        """Kill what is left in the cgroups and remove them (a dying process may hold
        one for a moment: tried again until it is empty)."""
        for cgroup in self.cgroups:
            for _ in range(500):
                for pid in _pids(cgroup):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                try:
                    cgroup.rmdir()
                except FileNotFoundError:
                    break
                except OSError:  # busy: its processes are still exiting
                    time.sleep(0.01)
                else:
                    break
        self.cgroups = []


def _pids(cgroup: Path) -> list[int]:
    try:
        return [int(line) for line in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _own_cgroups(root: Path) -> dict[str, Path]:
    """Controller -> the directory of this process's cgroup there, for the controllers
    :func:`enforce` uses that are mounted under ``root`` and writable."""
    found: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",") if controllers else []
        relative = path.lstrip("/")
        if not names:  # cgroup v2: pids and memory where its subtree offers them
            for mount in (root, root / "unified"):
                offered = mount / relative / "cgroup.subtree_control"
                if not offered.exists():
                    continue
                enabled = offered.read_text().split()
                for name in ("pids", "memory"):
                    if name in enabled:
                        found.setdefault(name, mount / relative)
                break
        for name in ("pids", "memory"):
            if name in names and (root / name / relative).is_dir():
                found.setdefault(name, root / name / relative)
    return {name: path for name, path in found.items() if os.access(path, os.W_OK)}


def _limit_files(controller: str, own: Path, limits: Limits) -> tuple[tuple[str, int], ...]:
    v2 = (own / "cgroup.controllers").exists()
    if controller == "pids" and limits.processes is not None:
        return (("pids.max", limits.processes),)
    if controller == "memory" and limits.memory_mb is not None:
        size = limits.memory_mb * _MB
        if v2:
            return (("memory.max", size), ("memory.swap.max", 0))
        # memory+swap no lower than memory, so set memory first
        return (("memory.limit_in_bytes", size), ("memory.memsw.limit_in_bytes", size))
    return ()


def enforce(
    execution_id: str,
    limits: Limits,
    *,
    user_namespace: bool,
    cgroup_root: Path = CGROUP_ROOT,
) -> Enforcement:
    """Prepare ``limits`` for the harness of ``execution_id``: its cgroups made (one per
    hierarchy that has a controller a limit needs), rlimits for the rest. A cgroup that
    cannot be made falls back to the rlimit, as if there were no cgroups.

    ``user_namespace``: the harness runs in a user namespace of its own, where
    ``RLIMIT_NPROC`` counts its processes only (outside one it counts every process of
    qwengyre's user, qwengyre's own threads included, so it is not set there)."""
    enforcement = Enforcement()
    bound: set[str] = set()
    for controller, own in _own_cgroups(cgroup_root).items():
        files = _limit_files(controller, own, limits)
        if not files:
            continue
        cgroup = own / f"qwengyre-{execution_id}"
        try:
            cgroup.mkdir(exist_ok=True)
            for name, value in files:
                if (cgroup / name).exists():
                    (cgroup / name).write_text(str(value))
        except OSError:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
            continue
        if cgroup not in enforcement.cgroups:
            enforcement.cgroups.append(cgroup)
        bound.add(controller)
    if limits.processes is not None and "pids" not in bound:
        if user_namespace and os.geteuid() != 0:
            enforcement.rlimits.append((resource.RLIMIT_NPROC, limits.processes))
        else:
            enforcement.unbound.append("processes")
    if limits.memory_mb is not None and "memory" not in bound:
        enforcement.rlimits.append((resource.RLIMIT_AS, limits.memory_mb * _MB))
    if limits.open_files is not None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        most = limits.open_files if hard == resource.RLIM_INFINITY else min(limits.open_files, hard)
        enforcement.rlimits.append((resource.RLIMIT_NOFILE, most))
    if limits.cpu_s is not None:
        enforcement.rlimits.append((resource.RLIMIT_CPU, limits.cpu_s))
    for limit in set(enforcement.unbound) - _warned:
        _warned.add(limit)
        log.warning(
            "harness limit %s cannot be enforced here: no writable cgroup hierarchy with its"
            " controller, and its rlimit does not bind (root, or no user namespace)",
            limit,
        )
    return enforcement


def release(execution_id: str, *, cgroup_root: Path = CGROUP_ROOT) -> bool:
    """Kill what the harness of ``execution_id`` left in its cgroups and remove them, for
    a runner that died before it could; whether there were any."""
    mine = {own / f"qwengyre-{execution_id}" for own in _own_cgroups(cgroup_root).values()}
    left = Enforcement(cgroups=[cgroup for cgroup in mine if cgroup.is_dir()])
    found = bool(left.cgroups)
    left.close()
    return found
