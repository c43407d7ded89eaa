"""A task's environment: the file system its harness and its command evaluator run in.

A task may name one (``"environment"`` in its JSON line, :class:`~qwengyre.rollout.tasks.Task`),
tagged by ``type``:

- ``{"type": "rootfs", "path": "envs/py", "share": ["/usr"]}`` (:class:`RootfsEnvironment`):
  a root file system, a directory or a tar archive (``.tar``, ``.tar.gz``, ``.tgz``,
  e.g. a ``docker export``); a relative path resolves against the JSONL file's
  directory. The harness runs under bubblewrap with it as ``/``
  (:class:`~qwengyre.rollout.sandbox.Rootfs`). ``share``: the machine's directories
  shown read-only at their own paths (absolute paths);
- ``{"type": "image", "image": "python:3.11-slim", "runtime": "auto"}``
  (:class:`ImageEnvironment`): a container image run by ``podman``, ``docker`` or
  ``apptainer`` (``auto``: the first of them on the node's PATH)
  (:class:`~qwengyre.rollout.sandbox.Container`); or ``{"type": "image", "build":
  "env"}``: the image its ``Dockerfile`` builds (``build`` the build context, a
  directory holding it; a relative path resolves as ``rootfs``'s), by podman or docker
  (apptainer builds no Dockerfile).

What a root (or image) must hold: ``/bin/sh`` (checked when it is prepared), and what
the harness's program needs; the Python qwengyre runs on is shown inside at its own
paths (its prefixes and import directories), because the in-namespace proxy relay and
Python harnesses run on it, so the C libraries it links to must be in the root or in
``share``. A Python installed under ``/usr`` shows the machine's whole ``/usr`` over
the root's: run qwengyre from a virtual environment or a prefix of its own (``/opt``,
pyenv) when the root's ``/usr`` matters.

The environment replaces ``harness.sandbox`` for its task, and the task's command
evaluator runs in it too, with the workspace as its working directory and no network.

:func:`prepare_environment` prepares one before each launch, within
``harness.environment_timeout_s``, cached per node under ``harness.environment_cache``
(:class:`EnvironmentOptions`): an archive is unpacked once per content digest (the
digest taken once per process and file version), an image pulled once (the runtime's
own ``image exists`` / ``image inspect`` first), a build context built once per node
and content (the runtime's ``build``, its image tagged ``qwengyre-env:<digest>`` of the
context's files). A preparation that fails raises
:class:`EnvironmentUnavailable` naming the problem, which
:func:`~qwengyre.rollout.execution.run_execution` turns into the zero-reward
placeholder of a complete failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from qwengyre.config import HarnessConfig
from qwengyre.jsonl import resolved
from qwengyre.rollout.sandbox import Container, ContainerRuntime, Rootfs, Sandbox

__all__ = [
    "ENVIRONMENT_TYPES",
    "EnvironmentOptions",
    "EnvironmentSpec",
    "EnvironmentUnavailable",
    "ImageEnvironment",
    "RootfsEnvironment",
    "context_digest",
    "prepare_environment",
]

ENVIRONMENT_TYPES = ("rootfs", "image")
CACHE_NAME = ".qwengyre-environments"
"""The default cache directory's name, beside the run directory."""
RUNTIMES: tuple[ContainerRuntime, ...] = ("podman", "docker", "apptainer")
BUILDERS: tuple[ContainerRuntime, ...] = ("podman", "docker")
"""The runtimes that build a Dockerfile."""
BUILT_IMAGE = "qwengyre-env"
"""The repository a built image is tagged in, its tag the build context's digest."""


class RootfsEnvironment(BaseModel):
    """A root file system: ``path`` a directory or a tar archive (resolved against the
    validation context's ``base_dir`` when relative; it need not exist until it is
    prepared, on the node that runs the task), ``share`` absolute host directories."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["rootfs"] = "rootfs"
    path: Path
    share: tuple[Path, ...] = ()

    @field_validator("path", mode="before")
    @classmethod
    def _check_path_type(cls, value: Any) -> Any:
        if isinstance(value, Path):
            return value
        if not isinstance(value, str) or not value.strip():
            raise ValueError("path must be a non-empty path (string) of a directory or archive")
        return value

    @field_validator("path")
    @classmethod
    def _resolve_path(cls, value: Path, info: ValidationInfo) -> Path:
        return resolved(value, info)

    @field_validator("share", mode="before")
    @classmethod
    def _check_share(cls, value: Any) -> Any:
        if not isinstance(value, list | tuple) or not all(isinstance(p, str | Path) for p in value):
            raise ValueError("share must be a list of absolute directory paths")
        for path in value:
            if not PurePosixPath(path).is_absolute():
                raise ValueError(f"{str(path)!r} is not an absolute path")
        return tuple(Path(p) for p in value)

    def to_json_dict(self, base_dir: Path | None = None) -> dict[str, Any]:
        """As JSON; ``path`` relative to ``base_dir`` when it lies inside it."""
        path = self.path
        if base_dir is not None and path.is_relative_to(base_dir.resolve()):
            path = path.relative_to(base_dir.resolve())
        data: dict[str, Any] = {"type": self.type, "path": path.as_posix()}
        if self.share:
            data["share"] = [p.as_posix() for p in self.share]
        return data


class ImageEnvironment(BaseModel):
    """A container image, run by ``runtime`` (``auto``: the first of podman, docker,
    apptainer on the node's PATH): exactly one of ``image``, an image name (for
    apptainer one without a scheme is a ``docker://`` one), and ``build``, a build
    context directory holding a ``Dockerfile`` (resolved as
    :class:`RootfsEnvironment`'s ``path``; checked when prepared), built by podman or
    docker (``auto``: the first of them on PATH)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["image"] = "image"
    image: StrictStr | None = None
    build: Path | None = None
    runtime: Literal["auto", "podman", "docker", "apptainer"] = "auto"

    @field_validator("image")
    @classmethod
    def _check_image(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip() or any(c.isspace() for c in value) or value.startswith("-"):
            raise ValueError(
                f"image {value!r} must be an image name (no spaces, not starting with '-')"
            )
        return value

    @field_validator("build", mode="before")
    @classmethod
    def _check_build_type(cls, value: Any) -> Any:
        if value is None or isinstance(value, Path):
            return value
        if not isinstance(value, str) or not value.strip():
            raise ValueError("build must be a non-empty path (string) of a build context")
        return value

    @field_validator("build")
    @classmethod
    def _resolve_build(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return None if value is None else resolved(value, info)

    @model_validator(mode="after")
    def _one_source(self) -> ImageEnvironment:
        if (self.image is None) == (self.build is None):
            raise ValueError("give exactly one of image (a name) and build (a build context)")
        if self.build is not None and self.runtime == "apptainer":
            raise ValueError("apptainer builds no Dockerfile: give an image, or podman or docker")
        return self

    def to_json_dict(self, base_dir: Path | None = None) -> dict[str, Any]:
        """As JSON; ``build`` relative to ``base_dir`` when it lies inside it."""
        data: dict[str, Any] = {"type": self.type}
        if self.image is not None:
            data["image"] = self.image
        if self.build is not None:
            build = self.build
            if base_dir is not None and build.is_relative_to(base_dir.resolve()):
                build = build.relative_to(base_dir.resolve())
            data["build"] = build.as_posix()
        data["runtime"] = self.runtime
        return data


EnvironmentSpec = Annotated[RootfsEnvironment | ImageEnvironment, Field(discriminator="type")]
"""Where a task runs: one of the environment models, tagged by ``type``."""


class EnvironmentUnavailable(Exception):
    """A task's environment cannot be prepared; the message says why."""


@dataclass(frozen=True)
class EnvironmentOptions:
    """How environments are prepared on a node (picklable: it travels with the harness
    spec): ``timeout_s`` bounds one preparation (``harness.environment_timeout_s``),
    ``cache`` holds unpacked archives and pulled SIF files (``harness.environment_cache``;
    None: ``.qwengyre-environments`` beside the run directory), ``share``: directories
    every environment shows read-only besides its own (``harness.sandbox_expose``: where
    the harness is installed), ``max_processes`` / ``max_memory_mb`` the harness limits a
    container runtime is given."""

    timeout_s: float = 600.0
    cache: Path | None = None
    share: tuple[Path, ...] = ()
    max_processes: int | None = None
    max_memory_mb: int | None = None

    @classmethod
    def of(cls, config: HarnessConfig) -> EnvironmentOptions:
        """The options the config's ``harness`` section sets."""
        cache = config.environment_cache
        return cls(
            timeout_s=config.environment_timeout_s,
            cache=cache.expanduser() if cache is not None else None,
            share=tuple(Path(p).expanduser() for p in config.sandbox_expose),
            max_processes=config.limits.max_processes,
            max_memory_mb=config.limits.max_memory_mb,
        )

    def cache_dir(self, run_dir: Path) -> Path:
        """Where this node's prepared environments live for a run in ``run_dir``."""
        return self.cache if self.cache is not None else run_dir.parent / CACHE_NAME


async def prepare_environment(
    spec: RootfsEnvironment | ImageEnvironment, options: EnvironmentOptions, cache_dir: Path
) -> Sandbox:
    """The sandbox that runs a harness (or an evaluator) in ``spec``, prepared within
    ``options.timeout_s``; raises :class:`EnvironmentUnavailable` naming the problem
    (a missing or unreadable path, an archive that is not one, a root without
    ``/bin/sh``, no container runtime, an image that cannot be pulled, the timeout).
    An unpacking cut short by the timeout goes on in the background, and its result is
    kept for the next preparation."""
    deadline = time.monotonic() + options.timeout_s
    try:
        return await asyncio.wait_for(
            asyncio.to_thread(_prepare, spec, options, cache_dir, deadline), options.timeout_s
        )
    except TimeoutError:
        raise EnvironmentUnavailable(
            f"{_describe(spec)}: not prepared within {options.timeout_s:g} s"
            " (harness.environment_timeout_s)"
        ) from None


def _describe(spec: RootfsEnvironment | ImageEnvironment) -> str:
    if isinstance(spec, RootfsEnvironment):
        return f"environment rootfs {spec.path}"
    if spec.build is not None:
        return f"environment image built from {spec.build}"
    return f"environment image {spec.image}"


def _prepare(
    spec: RootfsEnvironment | ImageEnvironment,
    options: EnvironmentOptions,
    cache_dir: Path,
    deadline: float,
) -> Sandbox:
    what = _describe(spec)
    if isinstance(spec, RootfsEnvironment):
        share = (*spec.share, *options.share)
        if missing := [str(p) for p in share if not p.exists()]:
            raise EnvironmentUnavailable(f"{what}: share: no such directory: {', '.join(missing)}")
        root = _cache(cache_dir).root(spec.path, what)
        if not _resolves(root, share, "/bin/sh"):
            raise EnvironmentUnavailable(f"{what}: the root has no /bin/sh (nor has share)")
        return Rootfs(root, share)
    runtime = _runtime(spec, what)
    if spec.build is not None:
        image = _cache(cache_dir).built(runtime, spec.build, what, deadline)
    else:
        assert spec.image is not None
        image = _cache(cache_dir).image(runtime, spec.image, what, deadline)
    return Container(
        runtime,
        image,
        options.share,
        max_processes=options.max_processes,
        max_memory_mb=options.max_memory_mb,
    )


def _runtime(spec: ImageEnvironment, what: str) -> ContainerRuntime:
    if spec.runtime != "auto":
        if shutil.which(spec.runtime) is None:
            raise EnvironmentUnavailable(f"{what}: no {spec.runtime!r} on PATH")
        return spec.runtime
    runtimes = BUILDERS if spec.build is not None else RUNTIMES
    for runtime in runtimes:
        if shutil.which(runtime) is not None:
            return runtime
    raise EnvironmentUnavailable(f"{what}: no container runtime ({', '.join(runtimes)}) on PATH")


def _resolves(root: Path, share: Sequence[Path], path: str) -> bool:
    """Whether ``path`` names a file inside the sandbox made of ``root`` and ``share``
    (symbolic links followed as the sandbox would: absolute ones from its ``/``)."""
    shared = {Path(p) for p in share}
    parts = list(PurePosixPath(path).parts[1:])
    at = PurePosixPath("/")
    for _ in range(64):  # symbolic links followed at most
        if not parts:
            break
        name = parts.pop(0)
        here = at.parent if name == ".." else at / name
        host = Path(here) if any(Path(here).is_relative_to(s) for s in shared) else None
        source = host if host is not None else root / here.relative_to("/")
        if source.is_symlink():
            target = PurePosixPath(os.readlink(source))
            parts = [*target.parts[1:], *parts] if target.is_absolute() else [*target.parts, *parts]
            at = PurePosixPath("/") if target.is_absolute() else at
            continue
        at = here
    else:
        return False
    host = Path(at) if any(Path(at).is_relative_to(s) for s in shared) else None
    return (host if host is not None else root / at.relative_to("/")).is_file()


class _Cache:
    """One node's prepared environments under one directory: unpacked roots keyed by
    their archive's digest, pulled images, images built from a context; each prepared
    once at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._keys: dict[str, threading.Lock] = {}
        self._digests: dict[tuple[str, int, int, int, int], str] = {}
        self._pulled: dict[tuple[str, str], str] = {}

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._keys.setdefault(key, threading.Lock())

    def root(self, path: Path, what: str) -> Path:
        """The root directory ``path`` is or unpacks to."""
        try:
            info = path.stat()
        except OSError as error:
            raise EnvironmentUnavailable(f"{what}: {error.strerror or error}") from None
        if path.is_dir():
            return path
        digest = self._digest(path, info, what)
        target = self.directory / "rootfs" / digest
        with self._key_lock(target.name):
            if not target.is_dir():
                self._unpack(path, target, what)
        return target

    def _digest(self, path: Path, info: os.stat_result, what: str) -> str:
        version = (str(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        with self._lock:
            known = self._digests.get(version)
        if known is not None:
            return known
        sha = hashlib.sha256()
        try:
            with path.open("rb") as stream:
                while chunk := stream.read(1 << 20):
                    sha.update(chunk)
        except OSError as error:
            raise EnvironmentUnavailable(f"{what}: cannot be read: {error}") from None
        digest = sha.hexdigest()
        with self._lock:
            self._digests[version] = digest
        return digest

    @staticmethod
    def _unpack(archive: Path, target: Path, what: str) -> None:
        """Unpack into a fresh directory beside ``target``, then rename it there."""
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name[:16]}-", dir=target.parent))
        try:
            try:
                with tarfile.open(archive) as tar:
                    tar.extractall(scratch, filter=_rootfs_member)
            except (tarfile.TarError, OSError, EOFError) as error:
                raise EnvironmentUnavailable(
                    f"{what}: not a usable tar archive (.tar, .tar.gz, .tgz) nor a directory:"
                    f" {error}"
                ) from None
            with contextlib.suppress(OSError):  # another process was first: theirs stays
                scratch.rename(target)
        finally:
            if scratch.exists():
                shutil.rmtree(scratch, ignore_errors=True)

    def image(self, runtime: ContainerRuntime, image: str, what: str, deadline: float) -> str:
        """The image as ``runtime`` runs it, pulled on this node if it has not got it:
        the name (podman, docker) or the SIF file under the cache (apptainer)."""
        key = (runtime, image)
        with self._key_lock(f"{runtime}:{image}"):
            if key in self._pulled:
                return self._pulled[key]
            if runtime == "apptainer":
                source = image if "://" in image else f"docker://{image}"
                name = hashlib.sha256(source.encode()).hexdigest()[:32]
                sif = self.directory / "images" / f"{name}.sif"
                if not sif.is_file():
                    sif.parent.mkdir(parents=True, exist_ok=True)
                    partial = sif.parent / f".{name}.{os.getpid()}.sif"
                    _run([runtime, "pull", "--force", str(partial), source], what, deadline)
                    partial.rename(sif)
                ready = str(sif)
            else:
                exists = [runtime, "image", "exists" if runtime == "podman" else "inspect", image]
                if _run(exists, what, deadline, check=False) != 0:
                    _run([runtime, "pull", image], what, deadline)
                ready = image
            self._pulled[key] = ready
            return ready

    def built(self, runtime: ContainerRuntime, context: Path, what: str, deadline: float) -> str:
        """The image ``context``'s Dockerfile builds, built on this node by ``runtime``
        unless it has it: ``qwengyre-env:<digest of the context's files>``."""
        dockerfile = context / "Dockerfile"
        if not dockerfile.is_file():
            raise EnvironmentUnavailable(f"{what}: no Dockerfile in the build context")
        tag = f"{BUILT_IMAGE}:{context_digest(context, what)[:32]}"
        key = (runtime, tag)
        with self._key_lock(f"{runtime}:{tag}"):
            if key in self._pulled:
                return self._pulled[key]
            exists = [runtime, "image", "exists" if runtime == "podman" else "inspect", tag]
            if _run(exists, what, deadline, check=False) != 0:
                build = [runtime, "build", "--tag", tag, "--file", str(dockerfile), str(context)]
                _run(build, what, deadline)
            self._pulled[key] = tag
            return tag


def context_digest(context: Path, what: str = "build context") -> str:
    """The SHA-256 of a build context: every entry's path relative to it, kind,
    executable bit, and contents (a symbolic link's target), in sorted order; raises
    :class:`EnvironmentUnavailable` when it cannot be read."""
    sha = hashlib.sha256()
    try:
        entries = sorted(context.rglob("*"))
        for entry in entries:
            name = entry.relative_to(context).as_posix().encode()
            if entry.is_symlink():
                sha.update(b"L\0" + name + b"\0" + os.readlink(entry).encode() + b"\0")
            elif entry.is_dir():
                sha.update(b"D\0" + name + b"\0")
            else:
                executable = b"x" if entry.stat().st_mode & 0o111 else b"-"
                sha.update(b"F\0" + name + b"\0" + executable)
                with entry.open("rb") as stream:
                    while chunk := stream.read(1 << 20):
                        sha.update(chunk)
                sha.update(b"\0")
    except OSError as error:
        raise EnvironmentUnavailable(f"{what}: cannot be read: {error}") from None
    return sha.hexdigest()


def _run(argv: list[str], what: str, deadline: float, *, check: bool = True) -> int:
    """Run a runtime's command until ``deadline``; its status (``check``: a failure is
    :class:`EnvironmentUnavailable` with its error output)."""
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=max(0.0, deadline - time.monotonic()),
        )
    except subprocess.TimeoutExpired:
        raise EnvironmentUnavailable(
            f"{what}: {' '.join(argv[:3])} did not finish in time"
        ) from None
    except OSError as error:
        raise EnvironmentUnavailable(f"{what}: cannot run {argv[0]}: {error}") from None
    if check and done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip())[-300:]
        raise EnvironmentUnavailable(
            f"{what}: {' '.join(argv[:3])} failed with status {done.returncode}: {tail}"
        )
    return done.returncode


def _rootfs_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """The ``tar`` extraction filter (no absolute paths, nothing outside the root, no
    setuid bits), device files left out (the sandbox has a ``/dev`` of its own)."""
    if member.ischr() or member.isblk():
        return None
    return tarfile.tar_filter(member, dest)


_caches: dict[Path, _Cache] = {}
_caches_lock = threading.Lock()


def _cache(directory: Path) -> _Cache:
    with _caches_lock:
        return _caches.setdefault(directory, _Cache(directory))
