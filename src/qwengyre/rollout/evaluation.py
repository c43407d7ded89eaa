"""Evaluation: score a terminated execution's preserved workspace, with retries.

An evaluator (see :mod:`qwengyre.rollout.tasks`) runs after the harness terminated --
also after a harness timeout -- on the workspace as the harness left it.  One run is an
*attempt* and yields an :class:`Assessment`: a score, whether it is valid, and the
digest of the workspace it assessed (:func:`artifact_digest`, "the reference to the
assessed artifact state").

Invariants (DESIGN.md §4):

- an invalid or missing assessment is never a reward of 0: an invalid
  :class:`Assessment` has ``score=None``, and :func:`final` returns ``None`` (not 0)
  when no attempt was valid -- the execution has no reward;
- attempts never overwrite each other: :func:`assess` returns every attempt, in order,
  each tagged with its number and the artifact digest it assessed;
- retries assess the same preserved state: :func:`assess` re-digests the workspace
  before each retry and stops if it changed;
- only a complete failure with nothing assessable (the workspace never came up) gets a
  zero reward, and only as an explicit :func:`placeholder` (``placeholder=True``), which
  the caller creates deliberately; nothing here turns a failure into one.

Caveat: an evaluator that writes into the workspace (``__pycache__``, ``.pytest_cache``,
a report file) changes its digest, so after an invalid attempt by such an evaluator
:func:`assess` stops retrying (the state is no longer the preserved one).  Evaluators
that are to be retried should write outside the workspace (e.g. run Python with
``PYTHONDONTWRITEBYTECODE=1`` and ``-p no:cacheprovider``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwengyre.rollout.harness import kill_group
from qwengyre.rollout.tasks import CommandEvaluator, ExactMatchEvaluator, PythonEvaluator

__all__ = [
    "DEFAULT_PYTHON_TIMEOUT_S",
    "Assessment",
    "artifact_digest",
    "assess",
    "evaluate_once",
    "final",
    "placeholder",
]

DEFAULT_PYTHON_TIMEOUT_S = 600.0
"""Timeout of one Python-evaluator attempt (the spec has no timeout field)."""

Evaluator = CommandEvaluator | PythonEvaluator | ExactMatchEvaluator

_CHUNK = 1 << 20
_DETAIL_TAIL = 500  # characters of stderr/stdout quoted in a failure's detail


# --------------------------------------------------------------------------- digest


def _field(hasher: Any, data: bytes) -> None:
    """Hash ``data`` length-prefixed, so concatenations cannot collide."""
    hasher.update(len(data).to_bytes(8, "big"))
    hasher.update(data)


def artifact_digest(workspace: Path | str) -> str:
    """A sha256 (hex) of the workspace's whole tree: the reference to an artifact state.

    Every entry below ``workspace`` is hashed, in sorted order of its relative path
    (bytes, ``/``-separated), with its kind:

    - a regular file: its relative path, whether it is executable by its owner, and its
      contents;
    - a directory: its relative path (so an empty directory counts);
    - a symlink: its relative path and its target text -- it is *not* followed, so a
      link pointing outside the workspace adds nothing of the outside;
    - anything else (fifo, socket, device): its relative path and file type.

    Nothing is skipped (no ignore list, hidden files included).  An entry that cannot
    be read raises ``OSError`` instead of being left out silently; so does a
    ``workspace`` that is not a directory.
    """
    root = Path(workspace)
    if not root.is_dir():
        raise NotADirectoryError(f"workspace is not a directory: {root}")
    hasher = hashlib.sha256()
    hasher.update(b"qwengyre-artifact-v1\0")

    def on_error(error: OSError) -> None:
        raise error

    entries: list[tuple[bytes, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=on_error, followlinks=False):
        base = Path(dirpath)
        # os.walk lists symlinks to directories under dirnames; it does not descend into
        # them (followlinks=False) and they are hashed as links below.
        for name in (*dirnames, *filenames):
            path = base / name
            rel = path.relative_to(root).as_posix()
            entries.append((os.fsencode(rel), path))
    entries.sort(key=lambda item: item[0])
    for rel_bytes, path in entries:
        info = path.lstat()
        mode = info.st_mode
        if stat.S_ISLNK(mode):
            _field(hasher, b"L")
            _field(hasher, rel_bytes)
            _field(hasher, os.fsencode(os.readlink(path)))
        elif stat.S_ISDIR(mode):
            _field(hasher, b"D")
            _field(hasher, rel_bytes)
        elif stat.S_ISREG(mode):
            _field(hasher, b"F")
            _field(hasher, rel_bytes)
            _field(hasher, b"x" if mode & stat.S_IXUSR else b"-")
            content = hashlib.sha256()
            with path.open("rb") as stream:
                while chunk := stream.read(_CHUNK):
                    content.update(chunk)
            _field(hasher, content.digest())
        else:
            _field(hasher, b"O")
            _field(hasher, rel_bytes)
            _field(hasher, str(stat.S_IFMT(mode)).encode())
    return hasher.hexdigest()


# --------------------------------------------------------------------------- assessment


@dataclass(frozen=True)
class Assessment:
    """One evaluation attempt's result.

    - ``score``: a finite float when ``valid``, else ``None`` (an invalid assessment has
      no score -- in particular it is not 0);
    - ``artifact``: the :func:`artifact_digest` of the workspace state assessed (``""``
      only for a placeholder, or an attempt that could not read the workspace at all);
    - ``attempt``: 1-based attempt number (0 for a placeholder);
    - ``evaluator``: the evaluator kind (``command``, ``python``, ``exact_match``,
      ``placeholder``);
    - ``detail``: ``"ok"`` or why the attempt is invalid (timeout, bad output,
      exception, ...), plus why retrying stopped where that applies;
    - ``placeholder``: the zero-reward stand-in for a complete failure (:func:`placeholder`).

    ``__post_init__`` enforces: ``valid`` <=> ``score`` is a finite float (an ``int`` is
    converted, a ``bool`` refused); a valid non-placeholder names its artifact;
    ``placeholder`` => valid, ``score == 0.0`` and ``artifact == ""``.
    """

    score: float | None
    valid: bool
    artifact: str
    attempt: int
    evaluator: str
    detail: str
    placeholder: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.valid, bool) or not isinstance(self.placeholder, bool):
            raise TypeError("valid and placeholder must be bools")
        score = self.score
        if isinstance(score, bool):
            raise TypeError("score must be a float or None, not a bool")
        if isinstance(score, int):
            score = float(score)
            object.__setattr__(self, "score", score)
        if score is not None and not isinstance(score, float):
            raise TypeError(f"score must be a float or None, got {type(score).__name__}")
        finite = score is not None and math.isfinite(score)
        if self.valid and not finite:
            raise ValueError(f"a valid assessment needs a finite score, got {score!r}")
        if not self.valid and score is not None:
            raise ValueError(
                f"an invalid assessment has no score (got {score!r}); it is never a number"
            )
        if not isinstance(self.attempt, int) or isinstance(self.attempt, bool):
            raise TypeError("attempt must be an int")
        if self.attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {self.attempt}")
        if not isinstance(self.artifact, str) or not isinstance(self.detail, str):
            raise TypeError("artifact and detail must be strings")
        if self.placeholder:
            if not self.valid or score != 0.0:
                raise ValueError("a placeholder is valid with score 0.0")
            if self.artifact:
                raise ValueError("a placeholder assesses no artifact (artifact must be '')")
        elif self.valid and not self.artifact:
            raise ValueError("a valid assessment must name the artifact state it assessed")

    def to_dict(self) -> dict[str, Any]:
        """The assessment as a JSON-ready dict (for durable records)."""
        return dataclasses.asdict(self)


def placeholder(reason: str) -> Assessment:
    """The zero-reward placeholder for a complete failure that left nothing assessable.

    Use it only when there is no artifact at all (e.g. the workspace never came up);
    an execution whose evaluation merely failed has no reward instead (:func:`final`
    returns ``None``).
    """
    if not reason.strip():
        raise ValueError("a placeholder needs a reason")
    return Assessment(
        score=0.0,
        valid=True,
        artifact="",
        attempt=0,
        evaluator="placeholder",
        detail=reason,
        placeholder=True,
    )


def final(assessments: Sequence[Assessment]) -> Assessment | None:
    """The valid assessment among ``assessments`` (the last one if several), else ``None``.

    ``None`` means unresolved: the execution has no reward -- never a zero.
    """
    for assessment in reversed(assessments):
        if assessment.valid:
            return assessment
    return None


# --------------------------------------------------------------------------- parsing


def _interpret(value: Any, where: str) -> tuple[float | None, str]:
    """``(score, "ok")`` for a valid result object, else ``(None, reason)``.

    Accepted: a mapping with a ``score`` (a finite number, not a bool) and ``valid``
    (a bool) -- both required; ``valid: false`` is an invalid assessment.
    """
    if not isinstance(value, dict):
        return None, f"{where} is not a JSON object: {type(value).__name__}"
    missing = [key for key in ("score", "valid") if key not in value]
    if missing:
        return None, f"{where} is missing key(s) {', '.join(map(repr, missing))}"
    valid = value["valid"]
    if not isinstance(valid, bool):
        return None, f"{where}: 'valid' is not a bool: {valid!r}"
    if not valid:
        return None, f"{where} says valid: false"
    return _as_score(value["score"], where)


def _as_score(score: Any, where: str) -> tuple[float | None, str]:
    if isinstance(score, bool) or not isinstance(score, int | float):
        return None, f"{where}: score is not a number: {score!r}"
    score = float(score)
    if not math.isfinite(score):
        return None, f"{where}: score is not finite: {score!r}"
    return score, "ok"


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _DETAIL_TAIL else "..." + text[-_DETAIL_TAIL:]


def _parse_command_output(stdout: str) -> tuple[float | None, str]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None, "no output: stdout has no non-blank line"
    last = lines[-1].strip()
    try:
        value = json.loads(last)
    except json.JSONDecodeError:
        return None, f"bad output: last stdout line is not JSON: {_tail(last)!r}"
    return _interpret(value, "last stdout line")


# --------------------------------------------------------------------------- attempts


async def _run_command(
    spec: CommandEvaluator, workspace: Path, timeout_s: float
) -> tuple[float | None, str]:
    try:
        if isinstance(spec.command, str):
            proc = await asyncio.create_subprocess_shell(
                spec.command,
                cwd=workspace,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        else:
            proc = await asyncio.create_subprocess_exec(
                *spec.command,
                cwd=workspace,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
    except OSError as error:
        return None, f"cannot start evaluator command: {error}"
    try:
        try:
            stdout_b, stderr_b = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            kill_group(proc.pid)
            await proc.wait()
            return None, f"timeout: evaluator command killed after {timeout_s:.3g} s"
    finally:
        # Cancellation, or grandchildren left behind by a command that exited: the
        # command leads its own process group (start_new_session), kill all of it.
        kill_group(proc.pid)
        if proc.returncode is None:
            await asyncio.shield(proc.wait())
    stdout = stdout_b.decode("utf-8", errors="replace")
    stderr = stderr_b.decode("utf-8", errors="replace")
    if proc.returncode != 0:
        return None, f"evaluator command exited with status {proc.returncode}: {_tail(stderr)}"
    return _parse_command_output(stdout)


def _interpret_python(value: Any) -> tuple[float | None, str]:
    """Accepted return forms of a Python evaluator.

    - a number (``int``/``float``, not ``bool``): a valid score;
    - a ``(score, valid)`` tuple: ``valid`` a bool, ``score`` a number;
    - a dict ``{"score": ..., "valid": ...}`` (both keys, as for a command evaluator).

    Anything else -- ``None`` included -- is an invalid assessment.
    """
    where = "python evaluator result"
    if isinstance(value, dict):
        return _interpret(value, where)
    if isinstance(value, tuple):
        if len(value) != 2:
            return None, f"{where}: expected a (score, valid) tuple, got {len(value)} items"
        return _interpret({"score": value[0], "valid": value[1]}, where)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None, f"{where} has an unsupported type: {type(value).__name__}"
    return _as_score(value, where)


async def _run_python(
    spec: PythonEvaluator, workspace: Path, metadata: dict[str, Any], timeout_s: float
) -> tuple[float | None, str]:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def deliver(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        result: Any = None
        failure: BaseException | None = None
        try:
            fn = spec.resolve()
            result = fn(workspace, dict(metadata))
        except BaseException as error:  # reported as an invalid attempt
            failure = error
        # An abandoned (timed-out) evaluator may finish after its loop closed.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, result, failure)

    # A dedicated daemon thread: a hung evaluator cannot be killed, but it then holds
    # neither the default executor nor interpreter exit.
    thread = threading.Thread(target=work, name=f"evaluator:{spec.callable}", daemon=True)
    thread.start()
    try:
        result = await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        return None, (
            f"timeout: python evaluator {spec.callable} did not return within "
            f"{timeout_s:.3g} s (its thread is abandoned)"
        )
    except Exception as error:
        return None, f"exception in python evaluator {spec.callable}: {error!r}"
    return _interpret_python(result)


async def evaluate_once(
    spec: Evaluator,
    workspace: Path | str,
    *,
    metadata: dict[str, Any] | None = None,
    timeout_s: float | None = None,
    attempt: int = 1,
    artifact: str | None = None,
) -> Assessment:
    """Run one evaluation attempt of ``spec`` on ``workspace``.

    - command: run in the workspace in its own process group, killed (the whole group)
      after ``min(spec.timeout_s, timeout_s)``; the last non-blank stdout line must be
      ``{"score": <finite number>, "valid": true}``;
    - python: ``fn(workspace: Path, task_metadata: dict)`` called in a thread (the
      working directory is *not* changed; use the path), with timeout ``timeout_s``
      (default :data:`DEFAULT_PYTHON_TIMEOUT_S`); see :func:`_interpret_python` for the
      accepted return forms;
    - exact_match: ``spec.score(workspace)``, always valid.

    Any failure (non-zero exit, timeout, unparsable or incomplete result, non-finite
    score, ``valid: false``, an exception) gives ``valid=False, score=None`` with the
    reason in ``detail``.  ``artifact`` is the digest of the state assessed; when not
    given it is computed before the attempt.
    """
    workspace = Path(workspace)
    if artifact is None:
        try:
            artifact = await asyncio.to_thread(artifact_digest, workspace)
        except OSError as error:
            return Assessment(
                None, False, "", attempt, spec.type, f"workspace cannot be read: {error}"
            )
    if isinstance(spec, CommandEvaluator):
        limit = spec.timeout_s if timeout_s is None else min(spec.timeout_s, timeout_s)
        score, detail = await _run_command(spec, workspace, limit)
    elif isinstance(spec, PythonEvaluator):
        limit = DEFAULT_PYTHON_TIMEOUT_S if timeout_s is None else timeout_s
        score, detail = await _run_python(spec, workspace, metadata or {}, limit)
    elif isinstance(spec, ExactMatchEvaluator):
        score, detail = await asyncio.to_thread(spec.score, workspace), "ok"
    else:  # pragma: no cover - guarded by the type
        raise TypeError(f"unknown evaluator spec: {spec!r}")
    return Assessment(
        score=score,
        valid=score is not None,
        artifact=artifact,
        attempt=attempt,
        evaluator=spec.type,
        detail=detail,
    )


def _note(assessment: Assessment, note: str) -> Assessment:
    return dataclasses.replace(assessment, detail=f"{assessment.detail}; {note}")


async def assess(
    spec: Evaluator,
    workspace: Path | str,
    *,
    deadline: float,
    max_attempts: int = 5,
    retry_delay_s: float = 1.0,
    metadata: dict[str, Any] | None = None,
) -> list[Assessment]:
    """Evaluate ``workspace`` until one attempt is valid; return every attempt, in order.

    ``deadline`` is a :func:`time.monotonic` value, the end of the execution's overall
    budget: no attempt starts at or after it, and each attempt's timeout is cut to the
    time left.  Invalid attempts are retried (after ``retry_delay_s``) up to
    ``max_attempts`` in all, against the same preserved state: the workspace digest is
    taken before the first attempt and checked before each retry; if it changed (or can
    no longer be read), retrying stops and the last attempt's ``detail`` says so.  Why
    retrying stopped at the deadline is also noted there.

    The result is empty when the deadline had passed before the first attempt.  Use
    :func:`final` for the outcome: ``None`` (unresolved) is never a zero reward.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    workspace = Path(workspace)
    attempts: list[Assessment] = []
    if time.monotonic() >= deadline:
        return attempts
    try:
        reference = await asyncio.to_thread(artifact_digest, workspace)
    except OSError as error:
        return [Assessment(None, False, "", 1, spec.type, f"workspace cannot be read: {error}")]
    for number in range(1, max_attempts + 1):
        if number > 1:
            remaining = deadline - time.monotonic()
            if remaining > 0 and retry_delay_s > 0:
                await asyncio.sleep(min(retry_delay_s, remaining))
            if time.monotonic() >= deadline:
                attempts[-1] = _note(attempts[-1], "stopped retrying: overall deadline reached")
                break
            try:
                current = await asyncio.to_thread(artifact_digest, workspace)
            except OSError as error:
                attempts[-1] = _note(
                    attempts[-1], f"stopped retrying: workspace can no longer be read: {error}"
                )
                break
            if current != reference:
                attempts[-1] = _note(
                    attempts[-1],
                    f"stopped retrying: workspace changed since it was preserved "
                    f"(artifact {reference[:12]} -> {current[:12]})",
                )
                break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if attempts:
                attempts[-1] = _note(attempts[-1], "stopped retrying: overall deadline reached")
            break
        result = await evaluate_once(
            spec,
            workspace,
            metadata=metadata,
            timeout_s=remaining,
            attempt=number,
            artifact=reference,
        )
        attempts.append(result)
        if result.valid:
            break
    return attempts
