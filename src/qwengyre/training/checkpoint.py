"""Atomic, resumable training checkpoints.

Layout under a checkpoint root::

    root/
      latest                  # text file: the name of the newest complete checkpoint
      step-000012/
        model/                # save_pretrained (safetensors) + the tokenizer, if given
        optimizer.pt          # torch.save(optimizer.state_dict()), if an optimizer was given
        state.json            # the caller's JSON state (policy version, scheduler, buffers...)
        manifest.json         # step, every other file with its size and sha256, time, version
      .tmp-step-000013-xxxx/  # a save in progress (or one that crashed): ignored by loaders

``model/`` is a plain HuggingFace directory: ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load it directly (an inference engine can start from it).

Crash safety. :func:`save_checkpoint` writes everything into a temporary sibling directory,
fsyncs every file, renames the directory into place with ``os.replace``, then replaces
``latest`` (written to a temporary file, fsynced, renamed), and only then prunes older
checkpoints. A crash at any point leaves either the previous ``latest`` checkpoint intact or
the new one complete; stale ``.tmp-*`` entries are ignored by the loaders and removed by the
next save. One writer per root is assumed (the core cell is the sole optimizer owner).

Scheduler state. :class:`qwengyre.scheduler.core.Scheduler` has no JSON state API (it is an
in-memory event-driven state machine over groups, executions and cells), so this module
does not serialise it: the caller passes whatever JSON state it wants restored (policy
version, step, dispatch counters, buffer state...) in ``state``, and the runtime decides
what to rebuild from it on resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import safetensors.torch
import torch
from transformers import PreTrainedModel

from qwengyre import __version__
from qwengyre.models.tiny import quiet_progress_bars

__all__ = [
    "FORMAT_VERSION",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MODEL_DIR",
    "OPTIMIZER_FILE",
    "STATE_FILE",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointStateError",
    "checkpoint_dir_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

FORMAT_VERSION: Final = 1
LATEST_FILE: Final = "latest"
MANIFEST_FILE: Final = "manifest.json"
MODEL_DIR: Final = "model"
OPTIMIZER_FILE: Final = "optimizer.pt"
STATE_FILE: Final = "state.json"
_TMP_PREFIX: Final = ".tmp-"
_STEP_RE: Final = re.compile(r"step-(\d+)")


class CheckpointError(Exception):
    """A checkpoint could not be written, found or read."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest (missing, truncated, altered)."""


class CheckpointStateError(CheckpointError, TypeError):
    """The caller's ``state`` is not JSON-serialisable; the message names the offending key."""


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint directory: its path, training step and the caller's state."""

    path: Path
    step: int
    state: dict[str, Any]

    @property
    def model_dir(self) -> Path:
        """The ``save_pretrained`` directory (``from_pretrained`` loads it)."""
        return self.path / MODEL_DIR


def checkpoint_dir_name(step: int) -> str:
    """``step-{step:06d}``: the directory name of the checkpoint of ``step``."""
    return f"step-{step:06d}"


# --------------------------------------------------------------------------- helpers


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (best effort where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _describe(path: str) -> str:
    """``state['scheduler']['groups'][3]``: where a value sits in the caller's state."""
    return f"state{path}"


def _check_json(value: Any, path: str) -> None:
    """Raise :class:`CheckpointStateError` naming the first value JSON cannot round-trip."""
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointStateError(
                f"checkpoint state is not JSON-serialisable: {_describe(path)} is {value!r} "
                "(NaN and infinities are not JSON)"
            )
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointStateError(
                    f"checkpoint state is not JSON-serialisable: {_describe(path)} has "
                    f"non-string key {key!r} ({type(key).__name__}); JSON keys are strings"
                )
            _check_json(item, f"{path}[{key!r}]")
        return
    raise CheckpointStateError(
        f"checkpoint state is not JSON-serialisable: {_describe(path)} is a "
        f"{type(value).__module__}.{type(value).__qualname__} ({value!r:.80}); "
        "pass plain JSON values (dict with str keys, list, str, int, finite float, bool, None)"
    )


def _encode_state(state: Mapping[str, Any]) -> bytes:
    if not isinstance(state, Mapping):
        raise CheckpointStateError(
            f"checkpoint state must be a mapping, got {type(state).__qualname__}"
        )
    _check_json(state, "")
    return (json.dumps(dict(state), indent=2, allow_nan=False) + "\n").encode("utf-8")


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _hash_and_sync(path: Path) -> dict[str, Any]:
    """sha256 and size of ``path``; fsyncs it on the way (it was just written)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
    return {"size": size, "sha256": digest}


def _files_under(directory: Path) -> Iterator[Path]:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            yield path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _step_of(name: str) -> int | None:
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: {MANIFEST_FILE} is missing"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"{manifest_path} is unreadable: {exc}") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(manifest, dict)
        or not isinstance(manifest.get("step"), int)
        or not isinstance(manifest.get("format", FORMAT_VERSION), int)
        or not isinstance(files, dict)
        or STATE_FILE not in files
        or not all(
            isinstance(v, dict)
            and isinstance(v.get("size"), int)
            and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
    ):
        raise CheckpointCorruptError(f"{manifest_path} is malformed")
    if manifest.get("format", FORMAT_VERSION) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {manifest['format']}; this qwengyre reads "
            f"format {FORMAT_VERSION} or older"
        )
    return manifest


def _check_files(path: Path, manifest: Mapping[str, Any], *, checksums: bool) -> None:
    """Every manifest file exists with its size (and, if ``checksums``, its sha256)."""
    for rel, meta in manifest["files"].items():
        file = path / rel
        if not file.resolve().is_relative_to(path.resolve()):
            raise CheckpointCorruptError(f"{path / MANIFEST_FILE} lists a file outside: {rel}")
        if not file.is_file():
            raise CheckpointCorruptError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != meta["size"]:
            raise CheckpointCorruptError(
                f"checkpoint file {file} is corrupt: {size} bytes, manifest says {meta['size']}"
            )
        if checksums:
            with open(file, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            if digest != meta["sha256"]:
                raise CheckpointCorruptError(
                    f"checkpoint file {file} is corrupt: sha256 {digest} does not match "
                    f"the manifest's {meta['sha256']}"
                )


def _is_complete(path: Path) -> bool:
    """Cheap validation for discovery: manifest parses, step matches, files have their sizes."""
    try:
        manifest = _read_manifest(path)
        _check_files(path, manifest, checksums=False)
    except CheckpointError:
        return False
    return manifest["step"] == _step_of(path.name)


# --------------------------------------------------------------------------- discovery


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest step first.

    ``.tmp-*`` entries and directories whose manifest does not validate (sizes only) are
    skipped. An absent ``root`` has none.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = _step_of(child.name)
        if step is not None and child.is_dir() and _is_complete(child):
            found.append((step, child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None`` if there is none.

    Reads ``root/latest``; if it is missing, corrupt, or names a directory that is not a
    complete checkpoint (its manifest must parse, name the directory's step and list files
    of the right sizes), falls back to the highest-step complete ``step-*`` directory.
    Full checksums are verified by :func:`load_checkpoint` / :func:`verify_checkpoint`.
    """
    root = Path(root)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        name = (root / LATEST_FILE).read_text(encoding="utf-8").strip()
        if _step_of(name) is not None:
            candidate = root / name
            if candidate.is_dir() and _is_complete(candidate):
                return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


# --------------------------------------------------------------------------- saving


def save_checkpoint(
    root: str | Path,
    *,
    step: int,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer | None,
    state: Mapping[str, Any],
    tokenizer: Any = None,
    keep: int = 2,
) -> Path:
    """Atomically write the checkpoint of ``step`` under ``root`` and return its directory.

    Writes ``root/step-{step:06d}/`` with ``model/`` (``model.save_pretrained`` in
    safetensors, plus ``tokenizer.save_pretrained`` if a tokenizer is given),
    ``optimizer.pt`` (if an optimizer is given), ``state.json`` and ``manifest.json``; then
    points ``root/latest`` at it; then removes stale ``.tmp-*`` entries and prunes so that
    only the new checkpoint and the ``keep - 1`` newest ones below its step remain
    (checkpoints with a *higher* step than the new one belong to an abandoned run, since
    ``latest`` now points below them, and are removed as well).

    ``state`` must be JSON-serialisable as is: a mapping with string keys whose values are
    dicts with string keys, lists/tuples (read back as lists), str, int, finite float, bool
    or None. Otherwise :class:`CheckpointStateError` names the offending key and nothing is
    written. Re-saving an existing step replaces that checkpoint.

    ``model`` is the unwrapped ``PreTrainedModel`` (not a DDP/FSDP wrapper); it is saved
    from whatever device it is on.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    state_bytes = _encode_state(state)  # before touching the filesystem

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root)
    name = checkpoint_dir_name(step)
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}-", dir=root))
    try:
        with quiet_progress_bars():
            model.save_pretrained(tmp / MODEL_DIR, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / MODEL_DIR)
        if optimizer is not None:
            with open(tmp / OPTIMIZER_FILE, "wb") as f:
                torch.save(optimizer.state_dict(), f)
        _write_bytes(tmp / STATE_FILE, state_bytes)
        files = {
            path.relative_to(tmp).as_posix(): _hash_and_sync(path) for path in _files_under(tmp)
        }
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "qwengyre_version": __version__,
            "files": files,
        }
        _write_bytes(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())
        for directory in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
            _fsync_dir(directory)
        if final.exists():
            # Move the old copy aside (loaders ignore .tmp-*), then put the new one in place.
            trash = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}old-{name}-", dir=root))
            os.replace(final, trash / name)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _write_latest(root, name)
    _prune(root, step, keep)
    return final


def _write_latest(root: Path, name: str) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{LATEST_FILE}-", dir=root)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(f"{name}\n".encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, root / LATEST_FILE)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(root)


def _remove_stale_tmp(root: Path) -> None:
    for child in root.iterdir():
        if child.name.startswith(_TMP_PREFIX):
            _remove(child)


def _prune(root: Path, step: int, keep: int) -> None:
    _remove_stale_tmp(root)
    older: list[tuple[int, Path]] = []
    for child in root.iterdir():
        other = _step_of(child.name)
        if other is None or other == step or not child.is_dir():
            continue
        if other > step:
            _remove(child)
        else:
            older.append((other, child))
    older.sort(reverse=True)
    for _, path in older[keep - 1 :]:
        _remove(path)


# --------------------------------------------------------------------------- loading


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file of the checkpoint at ``path`` against its manifest; return the manifest.

    Raises :class:`CheckpointCorruptError` naming the first missing or altered file, and
    :class:`CheckpointError` if ``path`` is not a checkpoint directory.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    _check_files(path, manifest, checksums=True)
    return manifest


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"{path / STATE_FILE} is unreadable: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"{path / STATE_FILE} does not hold a JSON object")
    return state


def read_checkpoint(path: str | Path, *, verify: bool = True) -> Checkpoint:
    """Read the step and state of the checkpoint at ``path`` without touching any model.

    With ``verify`` (the default) every file's sha256 is checked first; without it only the
    manifest and the file sizes are.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    _check_files(path, manifest, checksums=verify)
    return Checkpoint(path=path, step=manifest["step"], state=_read_state(path))


def _load_model_weights(model_dir: Path, model: PreTrainedModel) -> None:
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    elif (model_dir / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise CheckpointError(f"{model_dir} has no safetensors weights")
    # Check names and shapes of every tensor before copying any, so a mismatch never
    # leaves the model half-loaded.
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        with safetensors.safe_open(str(model_dir / shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                shapes[key] = tuple(f.get_slice(key).get_shape())
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(k for k in shapes if k in expected and shapes[k] != expected[k])
    # Tied parameters (e.g. lm_head.weight sharing embed_tokens.weight) are written once;
    # a missing key is fine only if a parameter it shares storage with is in the files.
    missing = sorted(k for k in set(expected) - set(shapes) if not _tie_loaded(model, k, shapes))
    if unexpected or wrong or missing:
        raise CheckpointError(
            f"weights in {model_dir} do not match the model ({type(model).__qualname__}): "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}, wrong shape {wrong[:8]}"
        )
    for shard in shards:
        tensors = safetensors.torch.load_file(model_dir / shard, device="cpu")
        with torch.no_grad():
            model.load_state_dict(tensors, strict=False)


def _tie_loaded(model: PreTrainedModel, key: str, seen: Mapping[str, Any]) -> bool:
    """``key`` is a parameter sharing its storage with another parameter found in ``seen``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(key)
    return target is not None and any(
        other != key and other in seen and param is target for other, param in params.items()
    )


def load_checkpoint(
    path: str | Path,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Restore the checkpoint at ``path`` into ``model`` (in place) and return its state.

    Verifies every file against the manifest first (a corrupt or missing file raises
    :class:`CheckpointCorruptError` naming it, before anything is loaded), copies the
    safetensors weights of ``model/`` into ``model``'s existing parameters and buffers
    (keeping their device and dtype; tied weights written once by ``save_pretrained`` are
    restored through the tie; a key mismatch raises :class:`CheckpointError`), loads the
    optimizer state if ``optimizer`` is given (the checkpoint must then have one), and
    returns the caller's ``state`` as saved (tuples come back as lists).
    """
    path = Path(path)
    checkpoint = read_checkpoint(path, verify=True)
    if optimizer is not None and not (path / OPTIMIZER_FILE).is_file():
        raise CheckpointError(f"{path} has no {OPTIMIZER_FILE} to restore the optimizer from")
    _load_model_weights(path / MODEL_DIR, model)
    if optimizer is not None:
        optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(optimizer_state)
    return checkpoint.state
