"""Atomic, resumable, sharded training checkpoints.

Layout under a checkpoint root::

    root/
      latest                  # text file: the name of the newest complete checkpoint
      step-000012/
        weights/              # torch.distributed.checkpoint: the core's model and
                              #   optimizer shards, one file per rank, plus .metadata
        model/                # the architecture: config.json + the tokenizer, no weights
        state.json            # the caller's JSON state (policy version, scheduler, buffers...)
        manifest.json         # format, step, every other file with its size and sha256, time
      .tmp-step-000013-xxxx/  # a save in progress (or one that crashed): ignored by loaders

The core's ``G`` ranks write ``weights/`` together (:func:`save_sharded_checkpoint`); no
rank gathers the whole model. DCP reshards on load, so a checkpoint written with ``G``
ranks per cell resumes with any other ``G`` (:func:`load_sharded`). :func:`export_model`
turns a checkpoint into a plain HuggingFace directory (``from_pretrained`` loads it; an
inference engine can start from it), one tensor at a time (``qwengyre model export``).

``weights/`` holds the parameters under their in-memory names; where transformers keeps
a parameter otherwise than its checkpoints store it (an MoE's experts: one fused
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` in memory,
``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj.weight`` on disk), the export
writes what ``save_pretrained`` would (:func:`qwengyre.models.saved_form.saved_form`),
the layout vLLM and SGLang load.

Crash safety. :func:`save_checkpoint` has everything written into a temporary sibling
directory, fsyncs every file, renames the directory into place with ``os.replace``, then
replaces ``latest`` (written to a temporary file, fsynced, renamed), and only then prunes
older checkpoints. A crash at any point leaves either the previous ``latest`` checkpoint
intact or the new one complete; stale ``.tmp-*`` entries are ignored by the loaders and
removed by the next save. One writer per root is assumed (the core is the sole optimizer
owner). A full disk raises :class:`~qwengyre.durable.DiskFullError` naming the checkpoint
(the partial one removed, the previous one intact), whatever the writer reported.

Scheduler state. :class:`qwengyre.scheduler.core.Scheduler` has no JSON state API, so this
module does not serialise it: the caller passes whatever JSON state it wants restored in
``state``, and the runtime decides what to rebuild from it on resume.
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
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import AutoConfig, AutoTokenizer

from qwengyre import __version__
from qwengyre.durable import disk_full, fsync_dir, guard_disk, is_disk_full
from qwengyre.models.saved_form import saved_form
from qwengyre.models.tiny import quiet_progress_bars

if TYPE_CHECKING:
    from qwengyre.training.trainer import Trainer

__all__ = [
    "FORMAT_VERSION",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MODEL_DIR",
    "STATE_FILE",
    "WEIGHTS_DIR",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointStateError",
    "checkpoint_dir_name",
    "export_model",
    "latest_checkpoint",
    "list_checkpoints",
    "load_sharded",
    "read_checkpoint",
    "save_checkpoint",
    "save_sharded_checkpoint",
]

FORMAT_VERSION: Final = 2  # 1: whole HF weights + optimizer.pt (before sharded cells)
LATEST_FILE: Final = "latest"
MANIFEST_FILE: Final = "manifest.json"
MODEL_DIR: Final = "model"
WEIGHTS_DIR: Final = "weights"
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
        """The architecture: config and tokenizer, no weights (see :func:`export_model`)."""
        return self.path / MODEL_DIR


def checkpoint_dir_name(step: int) -> str:
    """``step-{step:06d}``: the directory name of the checkpoint of ``step``."""
    return f"step-{step:06d}"


# --------------------------------------------------------------------------- helpers


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
    Full checksums are verified by :func:`load_sharded` / :func:`read_checkpoint`.
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
    write: Callable[[Path], None],
    state: Mapping[str, Any],
    keep: int = 2,
) -> Path:
    """Atomically write the checkpoint of ``step`` under ``root`` and return its directory.

    ``write(directory)`` puts the checkpoint's contents (``weights/``, ``model/``) into a
    temporary directory; this adds ``state.json`` and ``manifest.json``, renames it to
    ``root/step-{step:06d}/``, points ``root/latest`` at it, then removes stale ``.tmp-*``
    entries and prunes so that only the new checkpoint and the ``keep - 1`` newest ones
    below its step remain (checkpoints with a *higher* step than the new one belong to an
    abandoned run, since ``latest`` now points below them, and are removed as well).

    ``state`` must be JSON-serialisable as is: a mapping with string keys whose values are
    dicts with string keys, lists/tuples (read back as lists), str, int, finite float, bool
    or None. Otherwise :class:`CheckpointStateError` names the offending key and nothing is
    written (``write`` is not called). Re-saving an existing step replaces that checkpoint.
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
        write(tmp)
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
            fsync_dir(directory)
        if final.exists():
            # Move the old copy aside (loaders ignore .tmp-*), then put the new one in place.
            trash = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}old-{name}-", dir=root))
            os.replace(final, trash / name)
        os.replace(tmp, final)
    except BaseException as exc:
        # Torch's writer loses the errno of a full disk: ask the filesystem, before the
        # partial checkpoint's space is freed. (DCP's CheckpointException is a
        # BaseException.)
        full = not isinstance(exc, KeyboardInterrupt | SystemExit) and is_disk_full(exc, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full(final, f"the checkpoint of step {step}") from exc
        raise
    fsync_dir(root)
    with guard_disk(root / LATEST_FILE, f"the pointer to the checkpoint of step {step}"):
        _write_latest(root, name)
    _prune(root, step, keep)
    return final


def save_sharded_checkpoint(
    root: str | Path,
    *,
    step: int,
    trainer: Trainer,
    state: Mapping[str, Any],
    keep: int,
    model_dir: str | Path,
) -> str:
    """:func:`save_checkpoint` by all ranks of the core together: each writes its shards
    of the model and the optimizer into ``weights/`` (DCP), shard 0 the rest (the
    architecture from ``model_dir``, ``state``). Returns the checkpoint's path on
    every rank, once it is complete."""
    comm = trainer.comm

    def write_shards(directory: str) -> None:
        model, optimizer = get_state_dict(trainer.model, trainer.optimizer or [])
        dcp.save(
            {"model": model, "optimizer": optimizer},
            checkpoint_id=Path(directory) / WEIGHTS_DIR,
            process_group=comm.cell_group,
        )

    if comm.shard != 0:
        directory = comm.cell_object(None)
        if directory is None:  # shard 0 failed before writing (it raises there)
            raise CheckpointError(f"step {step}: the core's shard 0 could not start the save")
        write_shards(str(directory))
        return str(comm.cell_object(None))
    told = False

    def write(directory: Path) -> None:
        nonlocal told
        comm.cell_object(str(directory))
        told = True
        write_shards(str(directory))
        with quiet_progress_bars():
            AutoConfig.from_pretrained(model_dir).save_pretrained(directory / MODEL_DIR)
            AutoTokenizer.from_pretrained(model_dir).save_pretrained(directory / MODEL_DIR)

    try:
        path = save_checkpoint(root, step=step, write=write, state=state, keep=keep)
    except BaseException:
        if not told:
            comm.cell_object(None)
        raise
    comm.cell_object(str(path))
    return str(path)


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
    fsync_dir(root)


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


def _require_weights(path: Path, does: str) -> None:
    if not (path / WEIGHTS_DIR).is_dir():
        raise CheckpointError(
            f"{path} has no {WEIGHTS_DIR}/ (a format-1 checkpoint, written before sharded "
            f"cells?): this version {does} format {FORMAT_VERSION} only"
        )


def load_sharded(path: str | Path, trainer: Trainer) -> dict[str, Any]:
    """Restore the checkpoint at ``path`` into the core's sharded model and optimizer
    (all its ranks call this together; any ``G`` reads any other) and return its state.

    Verifies every file against the manifest first (a corrupt or missing file raises
    :class:`CheckpointCorruptError` naming it, before anything is loaded).
    """
    path = Path(path)
    checkpoint = read_checkpoint(path, verify=True)
    _require_weights(path, "resumes")
    if trainer.optimizer is None:
        raise CheckpointError("only the core (which holds the optimizer) loads a checkpoint")
    model, optimizer = get_state_dict(trainer.model, trainer.optimizer)
    saved: dict[str, Any] = {"model": model, "optimizer": optimizer}
    dcp.load(saved, checkpoint_id=path / WEIGHTS_DIR, process_group=trainer.comm.cell_group)
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=saved["model"],
        optim_state_dict=saved["optimizer"],
    )
    trainer.version = int(checkpoint.state.get("version", trainer.version))
    return checkpoint.state


def export_model(
    path: str | Path, out: str | Path, *, dtype: str = "float32", shard_bytes: int = 2 << 30
) -> Path:
    """Write the checkpoint at ``path`` as a HuggingFace model directory ``out`` (which
    must be empty or absent): safetensors files of at most ``shard_bytes`` each plus
    their index, the config and the tokenizer, in ``dtype``. Reads the sharded weights
    one file's worth of tensors at a time, so any model exports on one machine with
    memory for that much."""
    path, out = Path(path), Path(out)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # A stale model.safetensors there would win over the new index in from_pretrained.
        raise CheckpointError(f"export directory {out} must be empty or absent")
    read_checkpoint(path, verify=True)
    _require_weights(path, "exports")
    target = getattr(torch, dtype)
    reader = dcp.FileSystemReader(path / WEIGHTS_DIR)
    prefix = "model."
    sizes = {
        key[len(prefix) :]: meta.size
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, dcp.TensorStorageMetadata)
    }
    names = sorted(sizes)
    if not names:
        raise CheckpointError(f"{path / WEIGHTS_DIR} holds no model weights")
    out.mkdir(parents=True, exist_ok=True)
    with quiet_progress_bars():
        config = AutoConfig.from_pretrained(path / MODEL_DIR)
        config.dtype = target
        config.save_pretrained(out)
        AutoTokenizer.from_pretrained(path / MODEL_DIR).save_pretrained(out)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    to_saved = saved_form(config)
    files: list[list[str]] = [[]]
    size = 0
    for name in names:
        if tied and name == "lm_head.weight":
            continue  # save_pretrained writes a tied weight once
        nbytes = math.prod(sizes[name]) * target.itemsize
        if files[-1] and size + nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(files):
        file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {name: torch.empty(sizes[name], dtype=torch.float32) for name in group}
        with warnings.catch_warnings():  # no_dist=True warns that it assumes one process
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(
                {f"{prefix}{n}": t for n, t in tensors.items()}, storage_reader=reader, no_dist=True
            )
        saved = tensors if to_saved is None else to_saved(tensors)  # converts tensor by tensor
        safetensors.torch.save_file(
            {n: t.to(target).contiguous() for n, t in saved.items()},
            str(out / file),
            metadata={"format": "pt"},
        )
        weight_map.update(dict.fromkeys(saved, file))
        total += sum(t.numel() for t in saved.values()) * target.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
