"""Evaluation: score an execution's preserved workspace, with retries; every assessment kept.

An evaluator (see :mod:`qwengyre.rollout.tasks`) runs after the harness terminated --
also after a harness timeout -- on the workspace as the harness left it.  One run is an
*attempt* and yields an :class:`Assessment`: a score, whether it is valid, the digest
of the workspace it assessed (:func:`artifact_digest`, "the reference to the assessed
artifact state"), which evaluator made it, when, and its *kind*:

- ``final``: an attempt of the designated task assessment after the harness ended; the
  valid one (:func:`final`) supplies the execution's one reward;
- ``intermediate``: an assessment of the workspace *while the harness runs*
  (:mod:`qwengyre.rollout.assessments`), tagged with its artifact ``version``; it is
  kept with the execution but never supplies the reward;
- ``placeholder``: the zero-reward stand-in for a complete failure (:func:`placeholder`).

Invariants (docs/design.md §4):

- an invalid or missing assessment is never a reward of 0: an invalid
  :class:`Assessment` has ``score=None``, and :func:`final` returns ``None`` (not 0)
  when no final attempt was valid -- the execution has no reward;
- attempts never overwrite each other: :func:`assess` returns every attempt, in order,
  each tagged with its number and the artifact digest it assessed;
- retries are bounded by the execution's overall budget, not by a count (the paper:
  "evaluation may be retried against the same preserved state within the execution's
  overall time budget"): :func:`assess` retries an invalid attempt, after a delay that
  grows geometrically (``retry_delay_s``, times ``retry_backoff`` per retry, at most
  ``max_retry_delay_s``), until one is valid or the deadline comes.  ``max_attempts``
  is an optional extra cap (default ``None``: the budget alone), for users who would
  rather free an execution slot early than keep retrying an evaluator that fails
  deterministically;
- retries assess the same preserved state: :func:`assess` re-digests the workspace
  before each retry and stops if it changed;
- only a complete failure with nothing assessable (the workspace never came up, the
  harness never started: :mod:`qwengyre.rollout.execution`) gets a zero reward, and
  only as an explicit :func:`placeholder` (``kind="placeholder"``), which the caller
  creates deliberately; nothing here turns a failure into one;
- intermediate assessments never supply the reward: :func:`final` ignores them.

Caveat: an evaluator that writes into the workspace (``__pycache__``, ``.pytest_cache``,
a report file) changes its digest, so after an invalid attempt by such an evaluator
:func:`assess` stops retrying (the state is no longer the preserved one).  Evaluators
that are to be retried should write outside the workspace (e.g. run Python with
``PYTHONDONTWRITEBYTECODE=1`` and ``-p no:cacheprovider``).

A result object (a command's last stdout line, a Python evaluator's dict) may carry an
optional ``"critique"`` string: feedback kept in :attr:`Assessment.critique` and, for an
intermediate assessment, returned to the harness that asked for it.
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
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qwengyre.config import EvaluationConfig
from qwengyre.records.assessments import Assessment
from qwengyre.rollout.harness import kill_group
from qwengyre.rollout.model_evaluator import GradedTests, judge
from qwengyre.rollout.sandbox import Sandbox
from qwengyre.rollout.tasks import (
    CommandEvaluator,
    ExactMatchEvaluator,
    ModelEvaluator,
    PythonEvaluator,
)

__all__ = [
    "DEFAULT_PYTHON_TIMEOUT_S",
    "artifact_digest",
    "assess",
    "evaluate_once",
    "evaluator_name",
    "final",
    "placeholder",
]

DEFAULT_PYTHON_TIMEOUT_S = 600.0
"""Timeout of one Python-evaluator attempt (the spec has no timeout field)."""

Evaluator = CommandEvaluator | PythonEvaluator | ExactMatchEvaluator | ModelEvaluator

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


def placeholder(reason: str) -> Assessment:
    """The zero-reward placeholder for a complete failure that left nothing assessable.

    Use it only when there is no artifact at all (the workspace never came up, the
    harness could not start); an execution whose evaluation merely failed has no reward
    instead (:func:`final` returns ``None``).
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
        kind="placeholder",
        time_s=time.time(),
    )


def final(assessments: Sequence[Assessment]) -> Assessment | None:
    """The valid final (or placeholder) assessment, the last one if several; else ``None``.

    Intermediate assessments are skipped: they never supply the reward.  ``None`` means
    unresolved: the execution has no reward -- never a zero.
    """
    for assessment in reversed(assessments):
        if assessment.valid and assessment.kind != "intermediate":
            return assessment
    return None


def evaluator_name(spec: Evaluator) -> str:
    """A short human-readable name of an evaluator: its command (at most 200 characters),
    its callable, ``model:<model>@<base_url>``, or ``exact_match:<file>``."""
    if isinstance(spec, CommandEvaluator):
        text = spec.command if isinstance(spec.command, str) else " ".join(spec.command)
        return text if len(text) <= 200 else text[:197] + "..."
    if isinstance(spec, PythonEvaluator):
        return spec.callable
    if isinstance(spec, ModelEvaluator):
        return f"model:{spec.model}@{spec.base_url}"
    return f"exact_match:{spec.file}"


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


_CRITIQUE_CHARS = 4000  # longest critique kept


def _critique(value: Any) -> str:
    """The optional ``"critique"`` string of a result object (cut to 4000 characters)."""
    if isinstance(value, dict) and isinstance(value.get("critique"), str):
        return value["critique"][:_CRITIQUE_CHARS]
    return ""


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _DETAIL_TAIL else "..." + text[-_DETAIL_TAIL:]


def _parse_command_output(stdout: str) -> tuple[float | None, str, str]:
    """(score, detail, critique) of a command evaluator's stdout."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None, "no output: stdout has no non-blank line", ""
    last = lines[-1].strip()
    try:
        value = json.loads(last)
    except json.JSONDecodeError:
        return None, f"bad output: last stdout line is not JSON: {_tail(last)!r}", ""
    return (*_interpret(value, "last stdout line"), _critique(value))


# --------------------------------------------------------------------------- attempts


async def _run_command(
    spec: CommandEvaluator,
    workspace: Path,
    timeout_s: float,
    output: list[str] | None = None,
    sandbox: Sandbox | None = None,
) -> tuple[float | None, str, str]:
    """(score, detail, critique) of one run of ``spec`` (a string by ``/bin/sh -c``), in
    ``sandbox`` (the task's environment, with a private home and no network) when given;
    ``output``, when given, receives the command's stdout and then its stderr once it
    has exited."""
    argv = ["/bin/sh", "-c", spec.command] if isinstance(spec.command, str) else spec.command
    if sandbox is None:
        return await _spawn(argv, workspace, None, timeout_s, output, "evaluator command")
    with tempfile.TemporaryDirectory(prefix="qwengyre-evaluator-") as home:
        wrapped = sandbox.wrap(argv, workspace=workspace, home=Path(home), hidden=(), env=("HOME",))
        env = {**os.environ, "HOME": home}
        what = "evaluator command in its environment"
        return await _spawn(wrapped, workspace, env, timeout_s, output, what)


async def _spawn(
    argv: Sequence[str],
    workspace: Path,
    env: dict[str, str] | None,
    timeout_s: float,
    output: list[str] | None,
    what: str,
) -> tuple[float | None, str, str]:
    """Run ``argv`` in ``workspace`` in a session of its own, as :func:`_communicate` says."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workspace,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as error:
        return None, f"cannot start {what}: {error}", ""
    return await _communicate(proc, timeout_s, output)


async def _communicate(
    proc: asyncio.subprocess.Process, timeout_s: float, output: list[str] | None
) -> tuple[float | None, str, str]:
    """Wait for an evaluator command (its group killed after ``timeout_s``) and parse
    what it printed; ``output`` receives its stdout and stderr."""
    try:
        try:
            stdout_b, stderr_b = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            kill_group(proc.pid)
            await proc.wait()
            return None, f"timeout: evaluator command killed after {timeout_s:.3g} s", ""
    finally:
        # Cancellation, or grandchildren left behind by a command that exited: the
        # command leads its own process group (start_new_session), kill all of it.
        kill_group(proc.pid)
        if proc.returncode is None:
            await asyncio.shield(proc.wait())
    stdout = stdout_b.decode("utf-8", errors="replace")
    stderr = stderr_b.decode("utf-8", errors="replace")
    if output is not None:
        output += [stdout, stderr]
    if proc.returncode != 0:
        status = f"evaluator command exited with status {proc.returncode}: {_tail(stderr)}"
        return None, status, ""
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
) -> tuple[float | None, str, str]:
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
        return (
            None,
            f"timeout: python evaluator {spec.callable} did not return within "
            f"{timeout_s:.3g} s (its thread is abandoned)",
            "",
        )
    except Exception as error:
        return None, f"exception in python evaluator {spec.callable}: {error!r}", ""
    return (*_interpret_python(result), _critique(result))


async def _run_model(
    spec: ModelEvaluator, workspace: Path, timeout_s: float | None, sandbox: Sandbox | None
) -> tuple[float | None, str, str]:
    """The spec's tests (if any, cut to ``timeout_s``; in ``sandbox``, the task's
    environment, when given), then the judge in the time left."""
    began_s = time.monotonic()
    tests: GradedTests | None = None
    if spec.tests is not None:
        limit = spec.tests.timeout_s if timeout_s is None else min(spec.tests.timeout_s, timeout_s)
        output: list[str] = []
        score, detail, _ = await _run_command(spec.tests, workspace, limit, output, sandbox)
        tests = GradedTests(evaluator_name(spec.tests), score, detail, "".join(output))
    left = None if timeout_s is None else timeout_s - (time.monotonic() - began_s)
    return await judge(spec, workspace, tests=tests, timeout_s=left)


async def evaluate_once(
    spec: Evaluator,
    workspace: Path | str,
    *,
    metadata: dict[str, Any] | None = None,
    timeout_s: float | None = None,
    attempt: int = 1,
    artifact: str | None = None,
    kind: str = "final",
    version: int | None = None,
    branch: int | None = None,
    sandbox: Sandbox | None = None,
) -> Assessment:
    """Run one evaluation attempt of ``spec`` on ``workspace``.

    - command: run in the workspace in its own process group, killed (the whole group)
      after ``min(spec.timeout_s, timeout_s)``; the last non-blank stdout line must be
      ``{"score": <finite number>, "valid": true}`` (an optional ``"critique"`` string
      is kept). With ``sandbox`` (the task's environment,
      :mod:`qwengyre.rollout.environments`) it runs confined by it: in the task's root
      or image, the workspace its working directory, a private home, no network;
    - python: ``fn(workspace: Path, task_metadata: dict)`` called in a thread (the
      working directory is *not* changed; use the path), with timeout ``timeout_s``
      (default :data:`DEFAULT_PYTHON_TIMEOUT_S`); see :func:`_interpret_python` for the
      accepted return forms;
    - exact_match: ``spec.score(workspace)``, always valid;
    - model: its ``tests`` command (as a command evaluator), then the judge model
      (:func:`qwengyre.rollout.model_evaluator.judge`), all within ``timeout_s``
      (default: no limit beyond each call's and the tests' own); an answer without a
      score after ``spec.attempts`` calls is an invalid attempt (unresolved).

    Any failure (non-zero exit, timeout, unparsable or incomplete result, non-finite
    score, ``valid: false``, an exception) gives ``valid=False, score=None`` with the
    reason in ``detail``.  ``artifact`` is the digest of the state assessed; when not
    given it is computed before the attempt.  ``kind``, ``version`` and ``branch`` are
    recorded as given (see :class:`Assessment`).
    """
    workspace = Path(workspace)
    began_s = time.monotonic()
    tags: dict[str, Any] = {
        "kind": kind,
        "version": version,
        "branch": branch,
        "evaluator_name": evaluator_name(spec),
    }
    if artifact is None:
        try:
            artifact = await asyncio.to_thread(artifact_digest, workspace)
        except OSError as error:
            return Assessment(
                score=None,
                valid=False,
                artifact="",
                attempt=attempt,
                evaluator=spec.type,
                detail=f"workspace cannot be read: {error}",
                time_s=time.time(),
                duration_s=time.monotonic() - began_s,
                **tags,
            )
    critique = ""
    if isinstance(spec, CommandEvaluator):
        limit = spec.timeout_s if timeout_s is None else min(spec.timeout_s, timeout_s)
        score, detail, critique = await _run_command(spec, workspace, limit, sandbox=sandbox)
    elif isinstance(spec, PythonEvaluator):
        limit = DEFAULT_PYTHON_TIMEOUT_S if timeout_s is None else timeout_s
        score, detail, critique = await _run_python(spec, workspace, metadata or {}, limit)
    elif isinstance(spec, ExactMatchEvaluator):
        score, detail = await asyncio.to_thread(spec.score, workspace), "ok"
    elif isinstance(spec, ModelEvaluator):
        score, detail, critique = await _run_model(spec, workspace, timeout_s, sandbox)
    else:  # pragma: no cover - guarded by the type
        raise TypeError(f"unknown evaluator spec: {spec!r}")
    return Assessment(
        score=score,
        valid=score is not None,
        artifact=artifact,
        attempt=attempt,
        evaluator=spec.type,
        detail=detail,
        critique=critique,
        time_s=time.time(),
        duration_s=time.monotonic() - began_s,
        **tags,
    )


def _note(assessment: Assessment, note: str) -> Assessment:
    return dataclasses.replace(assessment, detail=f"{assessment.detail}; {note}")


async def assess(
    spec: Evaluator,
    workspace: Path | str,
    *,
    deadline: float,
    options: EvaluationConfig | None = None,
    metadata: dict[str, Any] | None = None,
    reference: str | None = None,
    version: int | None = None,
    sandbox: Sandbox | None = None,
) -> list[Assessment]:
    """Evaluate ``workspace`` until one attempt is valid; return every attempt, in order.

    ``deadline`` is a :func:`time.monotonic` value, the end of the execution's overall
    budget: no attempt starts at or after it, and each attempt's timeout is cut to the
    time left.  Invalid attempts are retried until the deadline (the paper: "within the
    execution's overall time budget"), paced by ``options`` (the config's
    ``evaluation`` section; default: its defaults): the wait before retry ``r`` is
    :meth:`~qwengyre.config.EvaluationConfig.delay` (cut to the time left), and ``max_attempts``
    (default ``None``: no cap) optionally caps the attempts too.  Every retry assesses
    the same preserved state: the workspace digest is taken before the first attempt
    (or given as ``reference``, when the caller has just taken it) and checked before
    each retry; if it changed (or can no longer be read), retrying stops and the last
    attempt's ``detail`` says so.  Why retrying stopped at the deadline or the cap is
    also noted there.  ``version`` is recorded on every attempt (the artifact version of
    the preserved state); ``sandbox``: the task's environment (:func:`evaluate_once`).

    The result is empty when the deadline had passed before the first attempt.  Use
    :func:`final` for the outcome: ``None`` (unresolved) is never a zero reward.
    """
    pacing = options or EvaluationConfig()
    max_attempts = pacing.max_attempts
    workspace = Path(workspace)
    attempts: list[Assessment] = []
    if time.monotonic() >= deadline:
        return attempts
    if reference is None:
        try:
            reference = await asyncio.to_thread(artifact_digest, workspace)
        except OSError as error:
            unreadable = f"workspace cannot be read: {error}"
            return [
                Assessment(
                    score=None,
                    valid=False,
                    artifact="",
                    attempt=1,
                    evaluator=spec.type,
                    detail=unreadable,
                    evaluator_name=evaluator_name(spec),
                    time_s=time.time(),
                )
            ]
    number = 0
    while True:
        number += 1
        if number > 1:
            if max_attempts is not None and number > max_attempts:
                attempts[-1] = _note(
                    attempts[-1], f"stopped retrying: {max_attempts} attempts (max_attempts)"
                )
                break
            remaining = deadline - time.monotonic()
            wait = pacing.delay(number - 1)
            if remaining > 0 and wait > 0:
                await asyncio.sleep(min(wait, remaining))
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
            version=version,
            sandbox=sandbox,
        )
        attempts.append(result)
        if result.valid:
            break
    return attempts
