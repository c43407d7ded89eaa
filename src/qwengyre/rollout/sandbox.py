"""Sandboxes: what a harness may touch on the machine that runs it (``harness.sandbox``).

A harness is a black-box agent that runs whatever shell commands the policy being
trained writes, so it must not be able to read what other executions hold (their keys,
the proxy's store, the checkpoints), write outside its workspace, reach the machine's
other services, or undo its confinement. A :class:`Sandbox` turns the harness's command
into one that runs it confined; :func:`supervise <qwengyre.rollout.harness.supervise>`
launches what :meth:`Sandbox.wrap` returns (a pure function of its arguments and the
Python qwengyre runs on), and a new kind (a container runtime, gVisor) is one more class
here.

- :class:`NoSandbox` (``none``): the harness runs as qwengyre's own user with the
  machine's view; only its process group and :mod:`~qwengyre.rollout.limits` bound it.
  It can read the run directory, other executions' keys (``/proc/*/environ``), the
  operator's credentials, and reach any address.
- :class:`Bubblewrap` (``bwrap``, Linux; Debian's ``bubblewrap`` package):

  * **no privilege**: a user namespace of its own (uid 65534 inside when qwengyre runs as
    root), every capability dropped and no further user namespace, so nothing can be
    mounted, remounted or unmounted. The processes keep qwengyre's uid on the machine
    (bubblewrap maps only the caller's), so what that uid owns stays readable where it
    is visible: hence the hiding below;
  * **file system**: the machine read-only, with its workspace and private home writable
    and a private ``/tmp``, ``/var/tmp`` and ``/dev`` (``/dev/shm`` too: not the weight
    boards'); hidden (empty, read-only) are the run directory's parent (this run's and
    its sibling runs' stores, workspaces, logs and checkpoints), the operator's home
    (agent credentials such as ``~/.claude``), ``/root``, ``/home``, ``/run`` (the
    machine's sockets), ``/mnt``, ``/media``, ``/srv``, the password and host-key
    files, and each of ``harness.sandbox_hide``. Shown again read-only inside them: the
    Python environment qwengyre runs on (its harnesses and relay run on it) and each of
    ``harness.sandbox_expose`` (a harness installed there). Mounts go shallow to deep,
    so a hidden directory inside an exposed one stays hidden;
  * **processes**: PID, IPC, UTS and cgroup namespaces of its own and a fresh ``/proc``:
    no other process is visible or can be signalled; the sandbox dies with qwengyre's
    side, and the PID namespace with its first process, so a tool started in a session
    of its own (``setsid``) dies too;
  * **network**: a namespace of its own with only loopback. The execution's proxy is
    the one thing it reaches: :mod:`qwengyre.rollout.netns_relay` runs first and carries
    ``127.0.0.1:SANDBOX_PORT`` to a Unix socket bound in, where
    :mod:`qwengyre.rollout.relay` adds the execution's key.

A task that names an environment (:mod:`qwengyre.rollout.environments`) is confined by
that environment's sandbox instead of ``harness.sandbox``, its harness and its command
evaluator alike:

- :class:`Rootfs`: as :class:`Bubblewrap`, but with the task's root file system as
  ``/`` and nothing of the machine's but its ``share``, the Python qwengyre runs on,
  the workspace, the home and the relay's socket;
- :class:`Container`: a container image run by podman, docker or apptainer with the
  same arrangement (``--network none`` and the relay's socket, the workspace and home
  at their own paths).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Protocol

from qwengyre.config import SandboxKind
from qwengyre.rollout import netns_relay
from qwengyre.rollout.relay import SANDBOX_PORT, SANDBOX_SOCKET

__all__ = [
    "Bubblewrap",
    "Container",
    "ContainerRuntime",
    "NoSandbox",
    "Rootfs",
    "Sandbox",
    "SandboxUnavailable",
    "sandbox",
]

#: Directories every bubblewrap sandbox hides (besides the operator's home).
HIDDEN: tuple[Path, ...] = tuple(
    Path(p)
    for p in (
        "/root",
        "/home",
        "/run",
        "/mnt",
        "/media",
        "/srv",
        "/etc/shadow",
        "/etc/gshadow",
        "/etc/ssh",
        "/etc/ssl/private",
    )
)
#: Directories each sandbox gets empty, private and writable.
SCRATCH: tuple[Path, ...] = (Path("/tmp"), Path("/var/tmp"))
#: The uid and gid a sandbox shows when qwengyre runs as root.
SANDBOX_UID = 65534


class SandboxUnavailable(OSError):
    """The sandbox asked for cannot run here; the message says why and what to do."""


class Sandbox(Protocol):
    """Confines a harness (picklable: it travels to a harness host's node)."""

    @property
    def name(self) -> str:
        """What ``harness.sandbox`` calls it."""
        ...

    @property
    def namespaced(self) -> bool:
        """True when the harness runs in user, PID and network namespaces of its own: it
        reaches the network only through the proxy relay (:func:`supervise
        <qwengyre.rollout.harness.supervise>` then starts one), and ``RLIMIT_NPROC``
        counts its processes only."""
        ...

    def wrap(
        self,
        argv: Sequence[str],
        *,
        workspace: Path,
        home: Path,
        hidden: Sequence[Path],
        proxy_socket: Path | None = None,
        env: Collection[str] = (),
    ) -> list[str]:
        """The command that runs ``argv`` confined: writing only to ``workspace`` (its
        working directory) and ``home``, not seeing ``hidden`` (directories, which
        ``workspace`` and ``home`` may lie inside, or files); with a private network,
        ``proxy_socket`` is the relay's socket (None: no network at all). ``env``: the
        names of the variables the launching process sets for ``argv`` (a process
        sandbox inherits them; a container runtime is told to pass them on)."""
        ...

    def check(self) -> None:
        """Raise :class:`SandboxUnavailable` if this sandbox cannot run here."""
        ...


@dataclass(frozen=True)
class NoSandbox:
    """The harness runs unconfined (``harness.sandbox=none``)."""

    name: ClassVar[str] = "none"
    namespaced: ClassVar[bool] = False

    def wrap(
        self,
        argv: Sequence[str],
        *,
        workspace: Path,
        home: Path,
        hidden: Sequence[Path],
        proxy_socket: Path | None = None,
        env: Collection[str] = (),
    ) -> list[str]:
        return list(argv)

    def check(self) -> None:
        return None


def python_runtime() -> tuple[Path, ...]:
    """The directories the Python qwengyre runs on needs: its prefixes and the
    directories its packages are imported from."""
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)}
    paths.update(Path(p) for p in sys.path if os.path.isabs(p) and os.path.isdir(p))
    return tuple(sorted(paths))


@dataclass(frozen=True)
class Bubblewrap:
    """The harness under bubblewrap (``harness.sandbox=bwrap``; see the module docstring).
    ``hide``: more directories or files to hide; ``expose``: directories shown read-only
    even inside a hidden one."""

    hide: tuple[Path, ...] = ()
    expose: tuple[Path, ...] = ()
    binary: str = "bwrap"
    name: ClassVar[str] = "bwrap"
    namespaced: ClassVar[bool] = True

    def wrap(
        self,
        argv: Sequence[str],
        *,
        workspace: Path,
        home: Path,
        hidden: Sequence[Path],
        proxy_socket: Path | None = None,
        env: Collection[str] = (),
    ) -> list[str]:
        args = [
            *_namespaces(self.binary),
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
        ]
        for scratch in SCRATCH:
            args += ["--tmpfs", str(scratch)]
        # a mount point must exist on the read-only root; mounts go shallow to deep
        hide = {Path(p) for p in (*HIDDEN, Path.home(), *hidden, *self.hide) if p.exists()}
        hide = {p for p in hide if p not in SCRATCH and p != Path("/")}
        covered = hide | set(SCRATCH)
        show = {p for p in (*python_runtime(), *self.expose) if _under(p, covered)}
        for path in sorted(hide | show, key=lambda p: len(p.parts)):
            if path in show:
                args += ["--ro-bind", str(path), str(path)]
            elif path.is_dir():
                args += ["--tmpfs", str(path)]
            else:  # a file reads as empty
                args += ["--ro-bind", "/dev/null", str(path)]
        for keep in (str(workspace), str(home)):
            args += ["--bind", keep, keep]
        if proxy_socket is not None:
            args += ["--bind", str(proxy_socket), str(SANDBOX_SOCKET)]
        for path in sorted(hide - show):  # empty and read-only; the binds inside stay
            if path.is_dir():
                args += ["--remount-ro", str(path)]
        args += ["--setenv", "TMPDIR", "/tmp", "--chdir", str(workspace), "--"]
        return [*args, *_relayed(argv, proxy_socket)]

    def check(self) -> None:
        _probe(
            self,
            missing=f"harness.sandbox=bwrap: no {self.binary!r} on PATH (Debian/Ubuntu: "
            "apt-get install bubblewrap), or set harness.sandbox=none",
            failed=f"harness.sandbox=bwrap: {self.binary} cannot make a sandbox here (it "
            "needs user namespaces)",
        )


def _probe(confine: Sandbox, *, missing: str, failed: str, argv: Sequence[str] = ("true",)) -> None:
    """Run ``argv`` under ``confine`` once: :class:`SandboxUnavailable` saying
    ``missing`` when the sandbox's own program is not there, ``failed`` and the error
    when it does not run."""
    with tempfile.TemporaryDirectory(prefix="qwengyre-sandbox-check-") as scratch:
        probe = confine.wrap(argv, workspace=Path(scratch), home=Path(scratch), hidden=())
        try:
            done = subprocess.run(
                probe, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
            )
        except FileNotFoundError:
            raise SandboxUnavailable(missing) from None
        except subprocess.TimeoutExpired:
            raise SandboxUnavailable(f"{failed}: no answer within 60 s") from None
    if done.returncode != 0:
        raise SandboxUnavailable(f"{failed}: {done.stderr.strip() or done.returncode}")


@dataclass(frozen=True)
class Rootfs:
    """The harness under bubblewrap with the directory ``root`` as its ``/`` (a task's
    ``rootfs`` environment, :mod:`qwengyre.rollout.environments`): the confinement of
    :class:`Bubblewrap` (no privilege, namespaces of its own, the network reaching only
    the proxy relay), but the file system is ``root``, read-only, and nothing of the
    machine's but what the harness needs:

    - its workspace and home, writable, at their own paths;
    - a private ``/tmp``, ``/var/tmp``, ``/dev`` and ``/proc``;
    - ``share``: the machine's directories shown read-only at their own paths (a host
      toolchain); a share that is a symbolic link on the machine (``/bin -> usr/bin``)
      is the same link inside;
    - the Python qwengyre runs on (:func:`python_runtime`), read-only at its own paths:
      the in-namespace proxy relay and Python harnesses run on it, so it must run
      inside the root (the C libraries it links to in the root or shared);
    - the relay's socket.

    Those paths replace whatever the root holds there; a root directory holding one of
    them is shown entry by entry, around it. ``hidden`` directories and files inside
    what is shown of the machine are hidden as :class:`Bubblewrap` hides them."""

    root: Path
    share: tuple[Path, ...] = ()
    binary: str = "bwrap"
    name: ClassVar[str] = "rootfs"
    namespaced: ClassVar[bool] = True

    def wrap(
        self,
        argv: Sequence[str],
        *,
        workspace: Path,
        home: Path,
        hidden: Sequence[Path],
        proxy_socket: Path | None = None,
        env: Collection[str] = (),
    ) -> list[str]:
        mounts: dict[Path, list[str]] = {Path("/dev"): ["--dev", "/dev"]}
        mounts[Path("/proc")] = ["--proc", "/proc"]
        for scratch in SCRATCH:
            mounts[scratch] = ["--tmpfs", str(scratch)]
        shown = {p for p in self.share if not p.is_symlink()}
        for path in self.share:
            if path.is_symlink():
                mounts[path] = ["--symlink", os.readlink(path), str(path)]
            else:
                mounts[path] = ["--ro-bind", str(path), str(path)]
        for path in python_runtime():
            if path not in mounts and not _under(path, shown):
                mounts[path] = ["--ro-bind", str(path), str(path)]
                shown.add(path)
        hide = _hidden_within(shown, hidden)
        for path in hide:
            mounts[path] = (
                ["--tmpfs", str(path)] if path.is_dir() else ["--ro-bind", "/dev/null", str(path)]
            )
        for keep in (workspace, home):
            mounts[keep] = ["--bind", str(keep), str(keep)]
        if proxy_socket is not None:
            mounts[SANDBOX_SOCKET] = ["--bind", str(proxy_socket), str(SANDBOX_SOCKET)]
        args = [*_namespaces(self.binary), *_root_entries(self.root, Path("/"), mounts)]
        for path in sorted(mounts, key=lambda p: len(p.parts)):  # shallow to deep
            args += mounts[path]
        for ro in ("/", *(str(p) for p in hide if p.is_dir())):
            args += ["--remount-ro", ro]
        args += ["--setenv", "TMPDIR", "/tmp", "--chdir", str(workspace), "--"]
        return [*args, *_relayed(argv, proxy_socket)]

    def check(self) -> None:
        _probe(
            self,
            missing=f"rootfs environment: no {self.binary!r} on PATH (Debian/Ubuntu: "
            "apt-get install bubblewrap)",
            failed=f"rootfs environment {self.root}: {self.binary} cannot run /bin/sh in it",
            argv=("/bin/sh", "-c", "exit 0"),
        )


def _hidden_within(shown: set[Path], hidden: Sequence[Path]) -> list[Path]:
    """What :class:`Bubblewrap` hides (and ``hidden``) that lies inside the machine's
    directories ``shown`` in a sandbox of its own root."""
    hide = {p for p in (*HIDDEN, Path.home(), *hidden) if p.exists() and _under(p, shown)}
    return sorted(hide)


def _root_entries(root: Path, at: Path, mounts: Collection[Path]) -> list[str]:
    """bubblewrap's arguments showing the directory ``at`` of ``root`` (a path inside)
    read-only, entry by entry, but for ``mounts``: an entry holding one of them is made
    anew (an empty directory) and, if it is a directory of the root, filled the same
    way."""
    try:
        names = sorted(os.listdir(root / at.relative_to("/")))
    except OSError:
        names = []
    args: list[str] = []
    for name in names:
        inside = at / name
        source = root / inside.relative_to("/")
        if inside in mounts:
            continue
        if any(_under(path, {inside}) for path in mounts):
            args += ["--dir", str(inside)]
            if source.is_dir() and not source.is_symlink():
                args += _root_entries(root, inside, mounts)
        elif source.is_symlink():
            args += ["--symlink", os.readlink(source), str(inside)]
        else:
            args += ["--ro-bind", str(source), str(inside)]
    return args


ContainerRuntime = Literal["podman", "docker", "apptainer"]
"""The container runtimes a task's ``image`` environment may run on."""


@dataclass(frozen=True)
class Container:
    """The harness in a container of ``image`` run by ``runtime`` (a task's ``image``
    environment, :mod:`qwengyre.rollout.environments`), arranged as :class:`Rootfs`
    arranges a root: the image's file system read-only, the workspace and home writable
    at their own paths, a private ``/tmp``, no network but the proxy relay's socket
    (``--network none``; the relay runs inside first, on the Python qwengyre runs on,
    bound in read-only at its own paths with each of ``share``), no capabilities.

    - podman, docker: ``run --rm --pull never`` (the image was pulled when the
      environment was prepared), ``--read-only``, ``--cap-drop ALL``,
      ``--security-opt no-new-privileges``, as qwengyre's uid and gid (podman without
      root: ``--userns keep-id``), ``--pids-limit`` and ``--memory`` from
      ``max_processes`` / ``max_memory_mb`` (the container's processes are the
      runtime's children, not qwengyre's, so the harness's own limits cannot reach
      them); the variables named in ``env`` are passed on (``--env NAME``), but
      ``PATH``: the image's holds. ``hidden`` inside what is shown of the machine is
      covered (an empty tmpfs, or ``/dev/null`` for a file);
    - apptainer: ``exec --contain --pid --ipc --no-privs --net --network none``,
      ``image`` the prepared SIF file, the home as ``--home``; the launching
      environment passes through (apptainer's default), the processes are its
      children; ``hidden`` is not covered there (share no directory that holds
      one).

    A harness killed at its deadline is signalled through the runtime's client
    (podman and docker pass SIGTERM on to the container, whose first process, the
    relay, passes it to the harness); SIGKILL ends the client only, and a container
    that outlives it is the runtime's to remove (``--rm`` when it ends)."""

    runtime: ContainerRuntime
    image: str
    share: tuple[Path, ...] = ()
    max_processes: int | None = None
    max_memory_mb: int | None = None
    namespaced: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return self.runtime

    def wrap(
        self,
        argv: Sequence[str],
        *,
        workspace: Path,
        home: Path,
        hidden: Sequence[Path],
        proxy_socket: Path | None = None,
        env: Collection[str] = (),
    ) -> list[str]:
        shown = sorted({*python_runtime(), *self.share})
        if self.runtime == "apptainer":
            args = [self.runtime, "exec", "--contain", "--pid", "--ipc", "--no-privs"]
            args += ["--net", "--network", "none", "--home", str(home)]
            args += ["--bind", f"{workspace}:{workspace}"]
            args += [arg for path in shown for arg in ("--bind", f"{path}:{path}:ro")]
            if proxy_socket is not None:
                args += ["--bind", f"{proxy_socket}:{SANDBOX_SOCKET}"]
            args += ["--pwd", str(workspace), self.image]
            return [*args, *_relayed(argv, proxy_socket)]
        args = [self.runtime, "run", "--rm", "--pull", "never", "--network", "none"]
        args += ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
        if self.runtime == "podman" and os.geteuid() != 0:
            args += ["--userns", "keep-id"]
        else:
            args += ["--user", f"{os.geteuid()}:{os.getegid()}"]
        if self.max_processes is not None:
            args += ["--pids-limit", str(self.max_processes)]
        if self.max_memory_mb is not None:
            args += ["--memory", f"{self.max_memory_mb}m"]
        for scratch in SCRATCH:
            args += ["--tmpfs", str(scratch)]
        for keep in (workspace, home):
            args += ["--volume", f"{keep}:{keep}"]
        args += [arg for path in shown for arg in ("--volume", f"{path}:{path}:ro")]
        for path in _hidden_within(set(shown), hidden):
            args += (
                ["--tmpfs", str(path)] if path.is_dir() else ["--volume", f"/dev/null:{path}:ro"]
            )
        if proxy_socket is not None:
            args += ["--volume", f"{proxy_socket}:{SANDBOX_SOCKET}"]
        args += ["--workdir", str(workspace), "--env", "TMPDIR=/tmp"]
        args += [arg for name in sorted(env) if name != "PATH" for arg in ("--env", name)]
        return [*args, self.image, *_relayed(argv, proxy_socket)]

    def check(self) -> None:
        _probe(
            self,
            missing=f"image environment: no {self.runtime!r} on PATH",
            failed=f"image environment {self.image}: {self.runtime} cannot start it",
        )


def _namespaces(binary: str) -> list[str]:
    """bubblewrap's arguments for a process without privilege in namespaces of its own
    (uid 65534 inside when qwengyre runs as root), dying with qwengyre's side."""
    uid = SANDBOX_UID if os.geteuid() == 0 else os.geteuid()
    gid = SANDBOX_UID if os.geteuid() == 0 else os.getegid()
    args = [binary, "--unshare-user", "--uid", str(uid), "--gid", str(gid)]
    args += ["--cap-drop", "ALL", "--disable-userns"]
    args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    return [*args, "--unshare-net", "--die-with-parent"]


def _relayed(argv: Sequence[str], proxy_socket: Path | None) -> list[str]:
    """``argv`` behind the in-namespace relay (:mod:`~qwengyre.rollout.netns_relay`,
    on the Python qwengyre runs on) when there is a proxy socket, else as it is."""
    if proxy_socket is None:
        return list(argv)
    listen = f"127.0.0.1:{SANDBOX_PORT}"
    relay = [sys.executable, "-I", "-S", netns_relay.__file__, "--listen", listen]
    return [*relay, "--to", str(SANDBOX_SOCKET), "--", *argv]


def _under(path: Path, directories: set[Path]) -> bool:
    """Whether ``path`` lies strictly inside one of ``directories``."""
    return any(path != d and path.is_relative_to(d) for d in directories)


UNCONFINED = (
    "every harness runs unconfined: it can read the run directory (the proxy's store,"
    " other executions' workspaces, the checkpoints), other executions' keys in"
    " /proc/*/environ, the operator's home and credentials, write the weight boards in"
    " /dev/shm, signal qwengyre's processes and reach any address. Install bubblewrap"
    " (Debian/Ubuntu: apt-get install bubblewrap), or set harness.sandbox=none to say"
    " this is meant"
)


def warn_on_stderr(message: str) -> None:
    """A warning, one line on stderr (the default of :func:`sandbox`)."""
    print(f"qwengyre: warning: {message}", file=sys.stderr)


def sandbox(
    kind: SandboxKind,
    hide: Sequence[Path] = (),
    expose: Sequence[Path] = (),
    *,
    warn: Callable[[str], None] = warn_on_stderr,
) -> Sandbox:
    """The sandbox ``harness.sandbox`` names, hiding ``hide`` and showing ``expose``
    (``harness.sandbox_hide`` / ``sandbox_expose``: ``~`` expanded; each must exist, so
    that a misspelt path changes nothing silently). ``auto``: bubblewrap where it can run
    here, else none, with one ``warn`` saying what that leaves open and how to fix it."""
    if kind == "none":
        if hide or expose:
            raise ValueError(
                "harness.sandbox_hide and harness.sandbox_expose need a sandbox: set"
                " harness.sandbox=bwrap or auto"
            )
        return NoSandbox()
    if kind not in ("bwrap", "auto"):
        raise ValueError(f"unknown sandbox {kind!r}; allowed: auto, none, bwrap")
    paths = {}
    for key, given in (("sandbox_hide", hide), ("sandbox_expose", expose)):
        paths[key] = tuple(Path(p).expanduser() for p in given)
        if missing := [str(p) for p in paths[key] if not p.exists()]:
            raise ValueError(f"harness.{key}: no such file or directory: {', '.join(missing)}")
    confined = Bubblewrap(paths["sandbox_hide"], paths["sandbox_expose"])
    if kind == "bwrap":
        return confined
    try:
        confined.check()
    except SandboxUnavailable as exc:
        why = str(exc).removeprefix("harness.sandbox=bwrap: ")
        warn(f"harness.sandbox=auto: {why}; {UNCONFINED}")
        return NoSandbox()
    return confined
