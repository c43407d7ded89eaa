"""Sandboxes: what a harness may touch on the machine that runs it (``harness.sandbox``).

A harness is a black-box agent that runs whatever shell commands the policy being
trained writes, so a run must be able to keep it in its workspace. A :class:`Sandbox`
turns the harness's command into one that runs it confined; :func:`run_harness
<qwengyre.rollout.harness.run_harness>` launches what :meth:`Sandbox.wrap` returns,
and a new kind (a container runtime, gVisor) is one more class here.

- :class:`NoSandbox` (``none``, the default): the harness runs as qwengyre's own user
  with the machine's view: only its process group and rlimits bound it.
- :class:`Bubblewrap` (``bwrap``, Linux; Debian's ``bubblewrap`` package): the harness
  sees the machine's file system read-only, with its workspace and its private home
  writable, ``TMPDIR`` in that home, and the run directory (every other execution's
  workspace and logs, the proxy's store and tokens) and each of ``harness.sandbox_hide``
  (credentials, say) replaced by empty read-only directories. It gets a fresh ``/dev`` and
  ``/proc``, its own PID, IPC and UTS namespaces, and dies with qwengyre's side: the
  PID namespace ends when its first process does, so a tool the agent started in a
  session of its own (``setsid``), which escapes a process-group kill, dies too.
  The network is shared: the harness must reach the proxy; keep egress away with the
  machine's firewall.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from qwengyre.config import SandboxKind

__all__ = ["Bubblewrap", "NoSandbox", "Sandbox", "SandboxUnavailable", "sandbox"]


class SandboxUnavailable(OSError):
    """The sandbox asked for cannot run here; the message says why and what to do."""


class Sandbox(Protocol):
    """Confines a harness (picklable: it travels to a harness host's node)."""

    @property
    def name(self) -> str:
        """What ``harness.sandbox`` calls it."""
        ...

    def wrap(
        self, argv: Sequence[str], *, workspace: Path, home: Path, hidden: Sequence[Path]
    ) -> list[str]:
        """The command that runs ``argv`` confined: writing only to ``workspace`` (its
        working directory) and ``home``, not seeing ``hidden`` (directories, which
        ``workspace`` and ``home`` may lie inside, or files)."""
        ...

    def check(self) -> None:
        """Raise :class:`SandboxUnavailable` if this sandbox cannot run here."""
        ...


@dataclass(frozen=True)
class NoSandbox:
    """The harness runs unconfined (``harness.sandbox=none``)."""

    name: ClassVar[str] = "none"

    def wrap(
        self, argv: Sequence[str], *, workspace: Path, home: Path, hidden: Sequence[Path]
    ) -> list[str]:
        return list(argv)

    def check(self) -> None:
        return None


@dataclass(frozen=True)
class Bubblewrap:
    """The harness under bubblewrap (``harness.sandbox=bwrap``; see the module docstring).
    ``hide``: directories or files hidden besides the ones :meth:`wrap` is given."""

    hide: tuple[Path, ...] = ()
    binary: str = "bwrap"
    name: ClassVar[str] = "bwrap"

    def wrap(
        self, argv: Sequence[str], *, workspace: Path, home: Path, hidden: Sequence[Path]
    ) -> list[str]:
        args = [self.binary, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        # a mount point must exist on the read-only root
        present = [Path(p) for p in (*hidden, *self.hide) if Path(p).exists()]
        covered = [str(p) for p in present if p.is_dir()]
        for hide in covered:
            args += ["--tmpfs", hide]
        for hide in (str(p) for p in present if not p.is_dir()):  # a file reads as empty
            args += ["--ro-bind", "/dev/null", hide]
        for keep in (str(workspace), str(home)):
            args += ["--bind", keep, keep]
        for hide in covered:  # empty and read-only; the binds inside stay writable
            args += ["--remount-ro", hide]
        tmp = str(Path(home) / "tmp")
        args += ["--dir", tmp, "--setenv", "TMPDIR", tmp]
        args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent"]
        return [*args, "--chdir", str(workspace), "--", *argv]

    def check(self) -> None:
        probe = [self.binary, "--ro-bind", "/", "/", "--unshare-pid", "--", "true"]
        try:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise SandboxUnavailable(
                f"harness.sandbox=bwrap: no {self.binary!r} on PATH (Debian/Ubuntu: apt-get "
                "install bubblewrap), or set harness.sandbox=none"
            ) from None
        if done.returncode != 0:
            raise SandboxUnavailable(
                f"harness.sandbox=bwrap: {self.binary} cannot make a sandbox here (it needs "
                f"user namespaces, or root): {done.stderr.strip() or done.returncode}"
            )


def sandbox(kind: SandboxKind, hide: Sequence[Path] = ()) -> Sandbox:
    """The sandbox ``harness.sandbox`` names, hiding ``hide`` (``harness.sandbox_hide``: ``~``
    expanded; each must exist, so that a misspelt path hides nothing silently)."""
    if kind == "bwrap":
        paths = tuple(Path(p).expanduser() for p in hide)
        if missing := [str(p) for p in paths if not p.exists()]:
            raise ValueError(
                f"harness.sandbox_hide: no such file or directory: {', '.join(missing)}"
            )
        return Bubblewrap(paths)
    if kind == "none":
        if hide:
            raise ValueError("harness.sandbox_hide needs a sandbox: set harness.sandbox=bwrap")
        return NoSandbox()
    raise ValueError(f"unknown sandbox {kind!r}; allowed: none, bwrap")
