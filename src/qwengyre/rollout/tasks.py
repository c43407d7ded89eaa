"""The task dataset: one query per JSON line, validated with errors naming line and field.

A line::

    {"id": "repo-17", "instructions": "Fix the failing test in tests/test_io.py",
     "workspace_template": "templates/repo-17",
     "evaluator": {"type": "command", "command": ["python", "grade.py"], "timeout_s": 300},
     "metadata": {"difficulty": "hard"}}

- ``id``: 1-128 characters of ``[A-Za-z0-9_.-]`` (not ``.`` or ``..``); it names the
  task's workspaces, so it holds no path separator.  Ids are unique within a file.
- ``instructions``: the prompt given to the harness (non-empty).
- the workspace, at most one of:

  - ``workspace_template``: a directory copied into each fresh workspace; a relative
    path resolves against the JSONL file's directory, and the directory must exist when
    the file is loaded (it is stored resolved, as an absolute path);
  - ``setup``: a shell command run in an empty workspace before the harness starts;
  - neither: the harness starts in an empty workspace.

- ``evaluator``: an :data:`EvaluatorSpec`, tagged by ``type``:

  - ``{"type": "command", "command": [argv...] | "shell string", "timeout_s": 600}``
    (:class:`CommandEvaluator`);
  - ``{"type": "python", "callable": "package.module:function"}``
    (:class:`PythonEvaluator`);
  - ``{"type": "exact_match", "expected": "82", "file": "answer.txt"}``
    (:class:`ExactMatchEvaluator`);
  - ``{"type": "model", "api": "openai", "base_url": "http://judge:8000/v1",
    "model": "judge", "api_key_env": "JUDGE_API_KEY", "rubric": "...",
    "artifact": {"files": ["src/**/*.py"], "diff": true, "max_chars": 20000},
    "tests": {"command": "pytest -q"}, "tests_weight": 0.5}``: a judge model over
    HTTP (:class:`ModelEvaluator`, :class:`ArtifactSelection`).

- ``environment`` (optional): where the harness and a command evaluator run, an
  :data:`~qwengyre.rollout.environments.EnvironmentSpec` tagged by ``type``
  (:mod:`qwengyre.rollout.environments`):

  - ``{"type": "rootfs", "path": "envs/py.tar.gz", "share": ["/usr"]}``: a root file
    system, a directory or a tar archive (a relative path resolves against the JSONL
    file's directory; it is checked when prepared, on the node that runs the task);
  - ``{"type": "image", "image": "python:3.11-slim", "runtime": "auto"}``: a container
    image (podman, docker or apptainer); ``{"type": "image", "build": "envs/py"}``: the
    image a build context's ``Dockerfile`` builds (podman or docker).

  Without one the harness runs under ``harness.sandbox`` and the evaluator on the
  machine.
- ``metadata`` (optional, default ``{}``): free-form JSON object, carried along.

Blank lines and lines whose first non-blank character is ``#`` are skipped.  Unknown
fields are rejected.  :func:`load_tasks` reports the file, line and field of the first
bad line, e.g. ``tasks.jsonl:7: field 'evaluator.timeout_s': Input should be greater
than 0``, and a duplicate id names both lines.  :func:`dump_tasks` writes tasks back.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictStr,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails

from qwengyre.jsonl import JsonlError, parse_line, resolved
from qwengyre.rollout.environments import ENVIRONMENT_TYPES, EnvironmentSpec

__all__ = [
    "ArtifactSelection",
    "CommandEvaluator",
    "EvaluatorSpec",
    "ExactMatchEvaluator",
    "ModelEvaluator",
    "PythonEvaluator",
    "Task",
    "TaskFileError",
    "dump_tasks",
    "example_tasks_path",
    "load_tasks",
    "parse_task_line",
    "read_record",
    "read_records",
]

TASK_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"
M = TypeVar("M", bound=BaseModel)
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_CALLABLE_RE = re.compile(rf"^{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*$")
_EVALUATOR_TYPES = ("command", "python", "exact_match", "model")


def _non_blank(value: str, what: str) -> str:
    if not value.strip():
        raise ValueError(f"{what} must not be empty or blank")
    return value


def _inside_workspace(value: str, what: str) -> str:
    """``value`` if it is a non-blank relative path (or glob) that stays in the workspace."""
    _non_blank(value, what)
    path = PurePosixPath(value)
    if path.is_absolute() or value.startswith("\\") or re.match(r"^[A-Za-z]:", value):
        raise ValueError(f"{value!r} must be a path relative to the workspace")
    if ".." in path.parts:
        raise ValueError(f"{value!r} must stay inside the workspace (no '..')")
    return value


class CommandEvaluator(BaseModel):
    """Score a workspace by running a command in it.

    Contract: the command runs with the workspace as its working directory -- a list is
    an argv run directly, a string is run by the shell -- and is killed after
    ``timeout_s`` seconds.  The last non-blank line of its stdout is a JSON object
    ``{"score": <float>, "valid": <bool>}``; ``valid: false`` means "no valid
    assessment" (e.g. the grader itself broke), which is different from a score of 0.
    A non-zero exit, a timeout, or a last line that is not such an object also counts as
    no valid assessment.  Anything else on stdout/stderr is free-form log output.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["command"] = "command"
    command: list[StrictStr] | StrictStr
    timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 600.0

    @field_validator("command", mode="before")
    @classmethod
    def _check_command(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _non_blank(value, "command")
        if isinstance(value, list):
            if not value:
                raise ValueError("command must not be an empty list")
            if not all(isinstance(arg, str) for arg in value):
                raise ValueError("command must be a list of strings or a string")
            _non_blank(value[0], "command[0] (the program)")
            return value
        raise ValueError("command must be a list of strings or a string")


class PythonEvaluator(BaseModel):
    """Score a workspace with a Python callable named ``package.module:function``.

    Only the syntax is checked when tasks are loaded; :meth:`resolve` imports it.  The
    evaluation runner defines how it is called and what it returns.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["python"] = "python"
    callable: StrictStr

    @field_validator("callable")
    @classmethod
    def _check_callable(cls, value: str) -> str:
        if not _CALLABLE_RE.match(value):
            raise ValueError(
                f"{value!r} is not of the form 'package.module:function' "
                "(dotted identifiers, one colon)"
            )
        return value

    def resolve(self) -> Callable[..., Any]:
        """Import the module and return the named attribute (which must be callable)."""
        module_name, _, attr_path = self.callable.partition(":")
        target: Any = importlib.import_module(module_name)
        for part in attr_path.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{self.callable} is not callable")
        return target


class ExactMatchEvaluator(BaseModel):
    """Score 1 if ``file`` (relative to the workspace), stripped, equals ``expected``.

    Any other content scores 0, and so does a missing or unreadable file; the assessment
    is always valid.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["exact_match"] = "exact_match"
    expected: StrictStr
    file: StrictStr

    @field_validator("file")
    @classmethod
    def _check_file(cls, value: str) -> str:
        return _inside_workspace(value, "file")

    def matches(self, content: str) -> bool:
        """Whether the file content ``content`` is a match."""
        return content.strip() == self.expected

    def score(self, workspace: Path | str) -> float:
        """1.0 if the workspace's file matches, else 0.0 (also when it is missing)."""
        try:
            content = (Path(workspace) / self.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return 0.0
        return 1.0 if self.matches(content) else 0.0


class ArtifactSelection(BaseModel):
    """What of the workspace a :class:`ModelEvaluator` shows its judge.

    - ``files``: glob patterns relative to the workspace (``**`` spans directories,
      e.g. ``"src/**/*.py"``); every regular file they match, in path order, is shown
      whole (symlinks are not followed; a file that is not UTF-8 text is named only);
    - ``diff``: show the workspace's changes as ``git diff HEAD`` (plus the names of
      untracked files) when the workspace is a git repository; otherwise the artifact
      says there is no diff;
    - ``max_chars``: the most characters of artifact sent (tests output, then diff,
      then files; what does not fit is cut, and the cut is said in the text).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    files: list[StrictStr] = Field(default_factory=list)
    diff: bool = True
    max_chars: Annotated[int, Field(gt=0)] = 20_000

    @field_validator("files")
    @classmethod
    def _check_files(cls, value: list[str]) -> list[str]:
        return [_inside_workspace(pattern, "a files pattern") for pattern in value]


_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ModelEvaluator(BaseModel):
    """Score a workspace by asking a judge model (an LLM over HTTP) with a rubric.

    Contract (:mod:`qwengyre.rollout.model_evaluator` runs it):

    - ``api``: ``"openai"`` (Chat Completions: ``POST {base_url}/chat/completions``) or
      ``"anthropic"`` (Messages: ``POST {base_url}/messages``); ``base_url`` is the API
      root with its version, e.g. ``https://api.openai.com/v1``,
      ``https://api.anthropic.com/v1``, ``http://127.0.0.1:8000/v1``.  It must not be an
      execution's proxy URL (a path with ``/x/<id>``): the judge's calls are never an
      execution's calls, so never training data;
    - ``model``: the model name sent; ``api_key_env``: the environment variable (of the
      process that evaluates) holding the key, sent as ``Authorization: Bearer``
      (openai) or ``x-api-key`` (anthropic); ``None`` sends no key;
    - ``rubric``: what to judge; it is sent with the artifact (:class:`ArtifactSelection`)
      and an instruction to end the answer with a line ``SCORE: <number from 0 to 1>``
      (a last line ``{"score": <number>}`` is accepted too); the text before it is kept
      as the critique;
    - ``tests``: an optional :class:`CommandEvaluator` run first, in the workspace; its
      score and output join the artifact, and the assessment's score is
      ``w * tests_score + (1 - w) * model_score`` with ``w`` = ``tests_weight`` (0 to 1,
      default 0.5; given only with ``tests``: :attr:`weight_of_tests`).  Tests without
      a valid score make the whole attempt invalid (the judge is not asked);
    - ``attempts``: judge calls per evaluation attempt: an answer without a parsable
      score in [0, 1], or a failed call, is asked again up to this many calls; then the
      attempt is *unresolved*: invalid (no score, never 0), with the reason;
    - ``timeout_s``: the longest one call may take (also cut to the evaluation's time
      left); ``max_tokens``: the answer's length limit sent with each call.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["model"] = "model"
    api: Literal["openai", "anthropic"]
    base_url: StrictStr
    model: StrictStr
    api_key_env: StrictStr | None = None
    rubric: StrictStr
    artifact: ArtifactSelection = Field(default_factory=ArtifactSelection)
    tests: CommandEvaluator | None = None
    tests_weight: Annotated[float | None, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = None
    attempts: Annotated[int, Field(ge=1)] = 3
    timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 120.0
    max_tokens: Annotated[int, Field(ge=1)] = 1024

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        url = urlsplit(value.strip())
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"{value!r} is not an http:// or https:// URL with a host")
        if url.query or url.fragment:
            raise ValueError(f"{value!r} must not have a query or a fragment")
        parts = [part for part in url.path.split("/") if part]
        if "x" in parts[:-1]:  # /x/<id>: the proxy's per-execution prefix
            raise ValueError(
                f"{value!r} is an execution's proxy URL (/x/<id>): the judge's calls would"
                " be recorded as that execution's; use the server's own /v1"
            )
        return value.strip().rstrip("/")

    @field_validator("model", "rubric")
    @classmethod
    def _check_text(cls, value: str, info: ValidationInfo) -> str:
        return _non_blank(value, str(info.field_name))

    @field_validator("api_key_env")
    @classmethod
    def _check_env(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME_RE.match(value):
            raise ValueError(f"{value!r} is not an environment variable name")
        return value

    @field_validator("tests_weight")
    @classmethod
    def _weight_needs_tests(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and "tests" in info.data and info.data["tests"] is None:
            raise ValueError("is given without tests (it weighs the tests' score)")
        return value

    @property
    def weight_of_tests(self) -> float:
        """The tests' share of the score: ``tests_weight`` (default 0.5), 0 without tests."""
        if self.tests is None:
            return 0.0
        return 0.5 if self.tests_weight is None else self.tests_weight


EvaluatorSpec = Annotated[
    CommandEvaluator | PythonEvaluator | ExactMatchEvaluator | ModelEvaluator,
    Field(discriminator="type"),
]
"""How a task's result is scored: one of the evaluator models, tagged by ``type``."""


class Task(BaseModel):
    """One training query: instructions, its workspace, and how to evaluate the result.

    When validated with ``context={"base_dir": ...}`` (as :func:`load_tasks` does), a
    relative ``workspace_template`` resolves against ``base_dir``; otherwise against
    the current directory.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[StrictStr, Field(pattern=TASK_ID_PATTERN)]
    instructions: StrictStr
    workspace_template: Path | None = None
    setup: StrictStr | None = None
    evaluator: EvaluatorSpec
    environment: EnvironmentSpec | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("id", mode="before")
    @classmethod
    def _check_id(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value in (".", ".."):
                raise ValueError(f"id {value!r} is not a usable workspace name")
            if not re.match(TASK_ID_PATTERN, value):
                raise ValueError(
                    f"id {value!r} must be 1-128 characters of letters, digits, '_', '.', '-'"
                )
        return value

    @field_validator("instructions")
    @classmethod
    def _check_instructions(cls, value: str) -> str:
        return _non_blank(value, "instructions")

    @field_validator("workspace_template", mode="before")
    @classmethod
    def _check_template_type(cls, value: Any) -> Any:
        if value is None or isinstance(value, Path):
            return value
        if not isinstance(value, str):
            raise ValueError("workspace_template must be a directory path (string)")
        return _non_blank(value, "workspace_template")

    @field_validator("workspace_template")
    @classmethod
    def _resolve_template(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is None:
            return None
        path = resolved(value, info)
        if not path.is_dir():
            kind = "not a directory" if path.exists() else "directory not found"
            raise ValueError(f"{kind}: {path}")
        return path

    @field_validator("setup")
    @classmethod
    def _check_setup(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        _non_blank(value, "setup")
        if info.data.get("workspace_template") is not None:
            raise ValueError("give either workspace_template or setup, not both")
        return value

    def to_json_dict(self, base_dir: Path | str | None = None) -> dict[str, Any]:
        """The task as a JSON-ready dict, omitting absent workspace fields.

        ``workspace_template`` is written relative to ``base_dir`` when it lies inside
        it (so a dataset stays relocatable with its templates), else absolute.
        """
        data: dict[str, Any] = {"id": self.id, "instructions": self.instructions}
        if self.workspace_template is not None:
            template = self.workspace_template
            if base_dir is not None:
                base = Path(base_dir).resolve()
                if template.is_relative_to(base):
                    template = template.relative_to(base)
            data["workspace_template"] = template.as_posix()
        if self.setup is not None:
            data["setup"] = self.setup
        data["evaluator"] = self.evaluator.model_dump(mode="json")
        if self.environment is not None:
            data["environment"] = self.environment.to_json_dict(
                Path(base_dir) if base_dir is not None else None
            )
        data["metadata"] = self.metadata
        return data


class TaskFileError(JsonlError):
    """A task file that cannot be loaded; the message names the file, line and field."""


def _rewrite(
    loc: tuple[int | str, ...], item: ErrorDetails, message: str
) -> tuple[tuple[int | str, ...], str]:
    kind = item["type"]
    union = loc[0] if loc and loc[0] in ("evaluator", "environment") else None
    if union is None:
        return loc, message
    types = _EVALUATOR_TYPES if union == "evaluator" else ENVIRONMENT_TYPES
    # A discriminated union puts the tag into the location; drop it.
    if len(loc) > 1 and loc[1] in types:
        loc = (loc[0], *loc[2:])
    allowed = ", ".join(map(repr, types))
    if kind == "union_tag_not_found":
        return (*loc, "type"), f"missing (required; one of {allowed})"
    if kind == "union_tag_invalid":
        tag = item.get("ctx", {}).get("tag", item.get("input"))
        return (*loc, "type"), f"unknown {union} type {tag!r}; expected one of {allowed}"
    if kind == "model_attributes_type" and loc == (union,):
        return loc, "should be a JSON object with a 'type'"
    return loc, message


def parse_task_line(
    text: str,
    path: Path | str = "<tasks>",
    line: int | None = None,
    *,
    base_dir: Path | str | None = None,
) -> Task:
    """Parse one task line; errors are :class:`TaskFileError` naming ``path:line`` and field.

    A relative ``workspace_template`` resolves against ``base_dir`` (default: the
    directory of ``path``).
    """
    return read_record(Task, text, Path(path), line, base_dir=base_dir)


def read_record(
    model: type[M],
    text: str,
    path: Path,
    line: int | None = None,
    *,
    base_dir: Path | str | None = None,
) -> M:
    """One JSON line of ``path`` validated as ``model`` (a task, or a workload format's
    dataset line); errors are :class:`TaskFileError` naming ``path:line`` and the field
    (an ``evaluator`` or ``environment`` field as a task's). Relative paths in it resolve
    against ``base_dir`` (default: ``path``'s directory)."""
    base = Path(base_dir) if base_dir is not None else path.parent.resolve()

    def validate(data: dict[str, Any]) -> M:
        return model.model_validate(data, context={"base_dir": base})

    return parse_line(text, path, line, validate, TaskFileError, _rewrite)


def read_records(model: type[M], path: Path) -> Iterator[tuple[int, M]]:
    """Every ``(line number, record)`` of a JSONL file of ``model`` records (each with
    an ``id``), blank and ``#`` lines skipped. Raises :class:`TaskFileError` for an
    unreadable file, the first bad line, or a duplicate id (naming both lines); an empty
    file is refused by the caller."""
    seen: dict[str, int] = {}
    try:
        stream = path.open(encoding="utf-8")
    except OSError as error:
        raise TaskFileError(path, f"cannot open: {error.strerror or error}") from None
    with stream:
        for number, text in enumerate(stream, start=1):
            stripped = text.strip()
            if not stripped or stripped.startswith("#"):
                continue
            record = read_record(model, text, path, number)
            record_id = str(getattr(record, "id", ""))
            if record_id in seen:
                raise TaskFileError(
                    path,
                    f"field 'id': duplicate id {record_id!r} (first on line {seen[record_id]})",
                    number,
                )
            seen[record_id] = number
            yield number, record


def load_tasks(path: Path | str) -> list[Task]:
    """Read every task of a JSONL task file.

    Blank lines and ``#`` comment lines are skipped.  Raises :class:`TaskFileError` for
    the first bad line, a duplicate id (naming both lines), or a file without tasks.
    """
    path = Path(path)
    tasks = [task for _, task in read_records(Task, path)]
    if not tasks:
        raise TaskFileError(path, "empty task file: no tasks")
    return tasks


def dump_tasks(path: Path | str, tasks: Iterable[Task]) -> None:
    """Write ``tasks`` to ``path`` (replacing it), one JSON line each.

    Templates inside the file's directory are written relative to it, others absolute,
    so :func:`load_tasks` reads back equal tasks.  Raises ``ValueError`` for duplicate
    ids, which :func:`load_tasks` would reject.
    """
    path = Path(path)
    tasks = list(tasks)
    ids = [task.id for task in tasks]
    duplicates = sorted({task_id for task_id in ids if ids.count(task_id) > 1})
    if duplicates:
        raise ValueError(f"duplicate task ids: {', '.join(duplicates)}")
    base_dir = path.parent.resolve()
    with path.open("w", encoding="utf-8") as stream:
        for task in tasks:
            stream.write(json.dumps(task.to_json_dict(base_dir), ensure_ascii=False) + "\n")


def example_tasks_path() -> Path:
    """The bundled example dataset: eight two-digit additions answered in answer.txt."""
    return Path(str(resources.files("qwengyre.rollout").joinpath("example_tasks.jsonl")))
