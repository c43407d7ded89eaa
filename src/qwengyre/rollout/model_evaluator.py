"""The model evaluator: a judge model scores a workspace by a rubric (:class:`ModelEvaluator`).

One evaluation attempt (:func:`judge`, called by
:func:`qwengyre.rollout.evaluation.evaluate_once` after the spec's tests, if any, ran):

1. the *artifact* is gathered (:func:`gather_artifact`): the tests' command, score and
   output, the workspace's ``git diff HEAD`` (when it is a git repository), the files
   the spec's globs select -- at most ``artifact.max_chars`` characters of them;
2. the prompt (:func:`build_prompt`) is the rubric, the artifact between ``<artifact>``
   tags and :data:`ANSWER_FORMAT`: reasons first, then a last line
   ``SCORE: <number from 0 to 1>``;
3. it is sent to the judge with the API's documented request shape, over aiohttp
   (OpenAI Chat Completions ``POST {base_url}/chat/completions``; Anthropic Messages
   ``POST {base_url}/messages``, ``anthropic-version: 2023-06-01``), one call at a time;
4. the answer's score is read (:func:`parse_answer`): its last non-blank line is
   ``SCORE: x`` (case-insensitive, Markdown emphasis around it tolerated) or a JSON
   object ``{"score": x}``, with ``x`` a number in [0, 1]; the text before that line
   is the critique.  An answer without one, or a failed call (HTTP error, timeout,
   refused connection, a body of the wrong shape), is asked again, up to
   ``spec.attempts`` calls within the time given; then the attempt is *unresolved*:
   invalid -- no score, never 0 -- its detail and critique saying why.
5. with tests, the score is ``w * tests + (1 - w) * judge``
   (:attr:`ModelEvaluator.weight_of_tests`); tests without a valid score make the
   attempt invalid before the judge is asked.

The judge's calls are never training data: they go to ``base_url``, which cannot be an
execution's proxy URL (``/x/<id>``, refused when the task file is loaded), with the key
of ``api_key_env``, never an execution's.  Note that the qwengyre proxy records *every*
model call into the execution whose key it presents -- it has no unrecorded route --
so a judge served by a qwengyre proxy needs an execution of its own (``POST
/admin/executions``), one that no group holds and no trainer reads; a judge that is
another server (vLLM, SGLang, a hosted API) records nothing anywhere.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from qwengyre.rollout.tasks import ArtifactSelection, ModelEvaluator

__all__ = [
    "ANSWER_FORMAT",
    "ANTHROPIC_VERSION",
    "SYSTEM_PROMPT",
    "GradedTests",
    "build_prompt",
    "gather_artifact",
    "judge",
    "parse_answer",
]

SYSTEM_PROMPT = (
    "You are an evaluator. You judge the work of a software agent by the rubric you are"
    " given and grade it with a score from 0 (worst) to 1 (best)."
)
"""The system prompt of every judge call."""

ANSWER_FORMAT = (
    "Judge the artifact by the rubric. Give your reasons first; then end your answer with"
    " one line of exactly this form, and nothing after it:\n"
    "SCORE: <a number from 0 (worst) to 1 (best)>"
)
"""The answer contract the prompt ends with (:func:`parse_answer` reads it)."""

ANTHROPIC_VERSION = "2023-06-01"
"""The ``anthropic-version`` header sent to an Anthropic Messages endpoint."""

_GIT_TIMEOUT_S = 30.0
_CRITIQUE_CHARS = 4000  # longest critique kept, as for the other evaluators
_REASON_CHARS = 300  # characters of an answer or error body quoted in a reason
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_SCORE_LINE = re.compile(rf"^[\s*_`]*score\s*:\s*[*_`]*\s*({_NUMBER})[\s*_`.]*$", re.IGNORECASE)


@dataclass(frozen=True)
class GradedTests:
    """What a model evaluator's tests gave: their command (:func:`evaluator_name
    <qwengyre.rollout.evaluation.evaluator_name>`), score (``None``: no valid score),
    detail (``"ok"`` or why invalid) and output (stdout then stderr, as decoded)."""

    command: str
    score: float | None
    detail: str
    output: str


# --------------------------------------------------------------------------- artifact


_SAFE_GIT_KEYS = re.compile(
    r"^(core\.(repositoryformatversion|filemode|bare|logallrefupdates|ignorecase"
    r"|precomposeunicode|symlinks|autocrlf|eol|safecrlf)"
    r"|extensions\.objectformat|init\.defaultbranch|user\.(name|email)"
    r"|remote\..+\.(url|fetch)|branch\..+\.(remote|merge))$",
    re.IGNORECASE,
)
"""The keys of a workspace's ``.git/config`` that :func:`_diff` accepts: none can make
git run a program (a filter, a textconv or external diff, an fsmonitor hook) or read
another file (``include``).  The harness wrote that config; git runs outside its
sandbox."""


_GIT = ("git", "--no-optional-locks", "-c", "core.quotepath=off", "-c", "core.fsmonitor=false")


def _git(workspace: Path, *args: str) -> str:
    """``git args`` in the workspace's own repository (no ``GIT_*`` variable of this
    process, no discovery above it); raises on failure.  Read-only:
    ``--no-optional-locks`` keeps git from refreshing the index (which would change the
    workspace's digest, and so end its evaluation's retries)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("GIT_")}
    env.update(GIT_CEILING_DIRECTORIES=str(workspace.parent), LC_ALL="C")
    done = subprocess.run(
        [*_GIT, *args],
        cwd=workspace,
        env=env,
        capture_output=True,
        timeout=_GIT_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode("utf-8", errors="replace").strip()[-_REASON_CHARS:])
    return done.stdout.decode("utf-8", errors="replace")


def _diff(workspace: Path) -> str:
    """The workspace's changes against its git HEAD, or why there are none to show.

    Only a ``.git`` directory of the workspace's own (not a link, not a ``gitdir:``
    file, no ``commondir``) whose config holds only :data:`_SAFE_GIT_KEYS` is read, and
    git is told to run no external diff, textconv or fsmonitor.  Caveat: the check and
    git's reading are not one step, so a harness still running (an intermediate
    assessment) could change the config between them."""
    dot_git = workspace / ".git"
    if dot_git.is_symlink() or not dot_git.is_dir() or (dot_git / "commondir").exists():
        return "(no diff: the workspace is not a git repository with its own .git directory)"
    try:
        keys = _git(workspace, "config", "--file", ".git/config", "--list", "--name-only")
        unsafe = [key for key in keys.split("\n") if key and not _SAFE_GIT_KEYS.match(key)]
        if unsafe:
            return f"(no diff: .git/config sets keys not read for safety: {', '.join(unsafe)})"
        diff = _git(workspace, "diff", "HEAD", "--no-color", "--no-ext-diff", "--no-textconv")
        untracked = _git(workspace, "ls-files", "--others", "--exclude-standard").split("\n")
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        return f"(no diff: git failed: {error})"
    names = [name for name in untracked if name]
    if names:
        diff += "\nUntracked files (not in the diff above): " + ", ".join(names) + "\n"
    return diff or "(no changes against HEAD)"


def _selected_files(workspace: Path, patterns: list[str]) -> list[Path]:
    """The regular files the globs match, inside the workspace (no symlink followed out)."""
    root = workspace.resolve()
    found: set[Path] = set()
    for pattern in patterns:
        for path in workspace.glob(pattern):
            if path.is_symlink() or not path.is_file():
                continue
            if path.resolve().is_relative_to(root):
                found.add(path)
    return sorted(found, key=lambda path: path.relative_to(workspace).as_posix())


def _file_text(path: Path, max_chars: int) -> str:
    """The file's text, read no further than ``max_chars`` characters could need (a note
    ends a file read in part), or why it is not shown."""
    limit = 4 * max_chars  # UTF-8: at most 4 bytes a character
    try:
        size = path.stat().st_size
        with path.open("rb") as stream:
            data = stream.read(limit)
    except OSError as error:
        return f"(cannot be read: {error.strerror or error})"
    if b"\0" in data:
        return f"(not UTF-8 text: {size} bytes, not shown)"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        # A character cut by the read limit is not an encoding error.
        if size <= limit or error.start < len(data) - 3:
            return f"(not UTF-8 text: {size} bytes, not shown)"
        text = data[: error.start].decode("utf-8")
    if size > limit:
        text += f"\n[read {limit} of its {size} bytes]"
    return text


def _attribute(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")


def gather_artifact(
    selection: ArtifactSelection, workspace: Path | str, tests: GradedTests | None
) -> str:
    """The artifact's text: ``<tests>``, ``<diff>`` and one ``<file path=...>`` section
    each, in that order (a section only where the spec asks for it).

    Their contents together hold at most ``selection.max_chars`` characters: a section
    that does not fit is cut (the tests' output keeps its end, the others their start)
    with a note saying how much was cut, and the sections after it are named, empty.
    """
    workspace = Path(workspace)
    sections: list[tuple[str, str, str, bool]] = []  # (tag, attributes, content, keep end)
    if tests is not None:
        score = "none (invalid)" if tests.score is None else f"{tests.score:.6g}"
        attributes = (
            f' command="{_attribute(tests.command)}" score="{score}"'
            f' detail="{_attribute(tests.detail)}"'
        )
        sections.append(("tests", attributes, tests.output, True))
    if selection.diff:
        sections.append(("diff", "", _diff(workspace), False))
    for path in _selected_files(workspace, selection.files):
        rel = path.relative_to(workspace).as_posix()
        sections.append(
            ("file", f' path="{_attribute(rel)}"', _file_text(path, selection.max_chars), False)
        )
    room = selection.max_chars
    parts: list[str] = []
    for tag, attributes, content, keep_end in sections:
        if len(content) > room:
            cut = len(content) - room
            note = f"[{cut} characters cut: the artifact's max_chars]"
            if room == 0:
                content = note
            elif keep_end:
                content = note + "\n" + content[cut:]
            else:
                content = content[:room] + "\n" + note
            room = 0
        else:
            room -= len(content)
        parts.append(f"<{tag}{attributes}>\n{content.rstrip()}\n</{tag}>")
    return "\n".join(parts)


def build_prompt(rubric: str, artifact: str) -> str:
    """The judge's user message: the rubric, the artifact, the answer format."""
    return f"{rubric.strip()}\n\n<artifact>\n{artifact}\n</artifact>\n\n{ANSWER_FORMAT}"


# --------------------------------------------------------------------------- answers


def parse_answer(answer: str) -> tuple[float | None, str, str]:
    """``(score, critique, reason)`` of a judge's answer text (the module's contract).

    ``score`` is ``None`` when the answer breaks the contract, ``reason`` then saying
    how (else ``"ok"``); ``critique`` is the text before the score line (cut to 4000
    characters), or the whole answer when there is no score line.
    """
    lines = answer.rstrip().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return None, "", "the answer is empty"
    last = lines[-1].strip()
    critique = "\n".join(lines[:-1]).strip()[:_CRITIQUE_CHARS]
    value: Any
    if match := _SCORE_LINE.match(last):
        value = float(match.group(1))
    else:
        try:
            parsed = json.loads(last)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict) or "score" not in parsed:
            quoted = last[-_REASON_CHARS:]
            return None, answer.strip()[:_CRITIQUE_CHARS], f"no score line: last line {quoted!r}"
        value = parsed["score"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None, critique, f"the score is not a number: {value!r}"
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        return None, critique, f"the score {value!r} is not a number from 0 to 1"
    return float(value), critique, "ok"


class _CallFailed(Exception):
    """A judge call that gave no answer text; the message says why."""


def _request(
    spec: ModelEvaluator, prompt: str, key: str | None
) -> tuple[str, dict[str, str], dict[str, Any]]:
    """``(url, headers, body)`` of one call, as the spec's API documents it."""
    headers = {"content-type": "application/json"}
    body: dict[str, Any] = {"model": spec.model}
    if spec.api == "openai":
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        body["messages"] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": prompt},
        ]
        body["max_completion_tokens"] = spec.max_tokens
        return f"{spec.base_url}/chat/completions", headers, body
    if key is not None:
        headers["x-api-key"] = key
    headers["anthropic-version"] = ANTHROPIC_VERSION
    body["max_tokens"] = spec.max_tokens
    body["system"] = SYSTEM_PROMPT
    body["messages"] = [{"role": "user", "content": prompt}]
    return f"{spec.base_url}/messages", headers, body


def _answer_text(api: str, payload: Any) -> str:
    """The answer's text: ``choices[0].message.content`` (openai), the ``text`` blocks
    of ``content`` joined (anthropic); raises :class:`_CallFailed` for another shape."""
    try:
        if api == "openai":
            content = payload["choices"][0]["message"]["content"]
            if isinstance(content, str):
                return content
        elif isinstance(payload["content"], list):
            blocks = [b for b in payload["content"] if isinstance(b, dict)]
            texts = [b["text"] for b in blocks if b.get("type") == "text"]
            if all(isinstance(text, str) for text in texts):
                return "".join(texts)
    except (KeyError, IndexError, TypeError):
        pass
    raise _CallFailed(f"the answer has no text where the {api} API puts it")


async def _call(
    session: aiohttp.ClientSession, spec: ModelEvaluator, prompt: str, key: str | None
) -> str:
    url, headers, body = _request(spec, prompt, key)
    async with session.post(url, json=body, headers=headers) as response:
        text = await response.text(errors="replace")
        if response.status != 200:
            raise _CallFailed(f"HTTP {response.status} from {url}: {text[-_REASON_CHARS:]}")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        raise _CallFailed(f"the answer is not JSON: {text[:_REASON_CHARS]!r}") from None
    return _answer_text(spec.api, payload)


def _unresolved(calls: int, reasons: list[str], last_answer: str) -> tuple[None, str, str]:
    detail = f"unresolved: no score after {calls} judge call(s): " + "; ".join(reasons)
    critique = detail if not last_answer else f"{detail}\nThe last answer:\n{last_answer}"
    return None, detail, critique[:_CRITIQUE_CHARS]


async def judge(
    spec: ModelEvaluator,
    workspace: Path | str,
    *,
    tests: GradedTests | None,
    timeout_s: float | None,
) -> tuple[float | None, str, str]:
    """One evaluation attempt of ``spec`` (the module's steps 1-5): ``(score, detail,
    critique)``, ``score`` ``None`` for an invalid attempt, ``detail`` ``"ok"`` or why.

    ``tests``: what the spec's tests gave (required when it has tests, else ``None``).
    ``timeout_s``: the time this attempt has (``None``: no limit beyond each call's
    ``spec.timeout_s``); no call starts after it and each is cut to what is left.
    """
    if (tests is None) != (spec.tests is None):
        raise ValueError("tests must be reported exactly when the spec has tests")
    if tests is not None and tests.score is None:
        return None, f"tests without a valid score, the judge not asked: {tests.detail}", ""
    key: str | None = None
    if spec.api_key_env is not None:
        key = os.environ.get(spec.api_key_env)
        if key is None:
            return None, f"the judge's key variable {spec.api_key_env} is not set", ""
    tests_score = None if tests is None else tests.score
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    artifact = await asyncio.to_thread(gather_artifact, spec.artifact, workspace, tests)
    prompt = build_prompt(spec.rubric, artifact)
    reasons: list[str] = []
    last_answer = ""
    calls = 0
    # Each call's time is bounded by wait_for, not by aiohttp's default 5 minutes.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        while calls < spec.attempts:
            limit = spec.timeout_s
            if deadline is not None:
                limit = min(limit, deadline - time.monotonic())
                if limit <= 0:
                    reasons.append("no time left for another call")
                    break
            calls += 1
            try:
                answer = await asyncio.wait_for(_call(session, spec, prompt, key), limit)
            except TimeoutError:
                reasons.append(f"call {calls}: no answer within {limit:.3g} s")
                continue
            except (aiohttp.ClientError, OSError, _CallFailed) as error:
                reasons.append(f"call {calls}: {str(error) or type(error).__name__}")
                continue
            score, critique, reason = parse_answer(answer)
            if score is None:
                reasons.append(f"call {calls}: {reason}")
                last_answer = answer.strip()[-_REASON_CHARS * 4 :]
                continue
            if tests_score is None:
                return score, "ok", critique
            weight = spec.weight_of_tests
            combined = weight * tests_score + (1.0 - weight) * score
            head = (
                f"[tests {tests_score:.6g} x {weight:.6g} + judge {score:.6g} x {1 - weight:.6g}]"
            )
            return combined, "ok", f"{head}\n{critique}"[:_CRITIQUE_CHARS]
    return _unresolved(calls, reasons, last_answer)
