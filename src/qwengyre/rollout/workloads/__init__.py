"""Workload formats: datasets of real agentic benchmarks turned into :class:`Task` s.

Three formats besides qwengyre's own task JSONL (:mod:`qwengyre.rollout.tasks`), one
module each:

- ``swe`` (:mod:`.swe`): fix an issue in an existing repository (SWE-bench / DeepSWE):
  a JSONL of instances, graded by FAIL_TO_PASS / PASS_TO_PASS tests after a hidden
  test patch;
- ``terminal`` (:mod:`.terminal`): a directory of Terminal-Bench task directories,
  graded by each task's verifier script;
- ``spec`` (:mod:`.spec`): build a repository from a specification (NL2RepoBench): a
  JSONL of tasks, graded by hidden tests copied in only at grading.

Which one a dataset is, the value naming it says (``harness.tasks``, ``--tasks``):
``FORMAT:PATH`` -- ``swe:data/swe.jsonl``, ``terminal:terminal-bench/tasks``,
``spec:data/nl2repo.jsonl`` -- and a path without a prefix is a qwengyre task JSONL
(:func:`load_task_source`). Each format bundles a small example built from local files
(:func:`example_path`), named ``FORMAT:example`` on the command line.

Every format's tasks score with a command evaluator running
:mod:`qwengyre.rollout.workloads.grade` on a copy of the workspace (the workspace
itself is never changed by grading), and keep the test log as the assessment's
critique. A dataset's ``environment`` entry is the task's own environment
(:attr:`~qwengyre.rollout.tasks.Task.environment`, :mod:`qwengyre.rollout.environments`):
the harness and the grader run in it, and one that cannot be prepared is the execution's
zero-reward placeholder naming why. The grader there reads its task back from the
dataset (the file, the hidden tests, the task directory) and runs on the Python qwengyre
runs on: the environment must show those paths (a rootfs's ``share``,
``harness.sandbox_expose``), and hold what the tests need (``git`` for ``swe``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from qwengyre.rollout.tasks import Task, load_tasks
from qwengyre.rollout.workloads.spec import load_spec
from qwengyre.rollout.workloads.swe import load_swe
from qwengyre.rollout.workloads.terminal import load_terminal

__all__ = [
    "FORMATS",
    "example_path",
    "load_task_source",
    "resolve_example",
    "split_source",
]

FORMATS: dict[str, Callable[[Path], list[Task]]] = {
    "swe": load_swe,
    "terminal": load_terminal,
    "spec": load_spec,
}
"""Each workload format's loader, by the prefix that names it."""

_EXAMPLES = {"swe": "swe/tasks.jsonl", "terminal": "terminal", "spec": "spec/tasks.jsonl"}
_PREFIX_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_-]*):(.*)$", re.DOTALL)


def split_source(value: str | Path) -> tuple[str | None, Path]:
    """``"swe:data.jsonl"`` -> ``("swe", Path("data.jsonl"))``; a value without a prefix
    -> ``(None, Path(value))`` (a qwengyre task JSONL).

    Raises ``ValueError`` naming the allowed formats for an unknown prefix or a prefix
    without a path (a path holding ``:`` before any ``/`` is written ``./name:...``)."""
    text = str(value)
    found = _PREFIX_RE.match(text)
    if found is None:
        return None, Path(text)
    name, rest = found.groups()
    allowed = ", ".join(FORMATS)
    if name not in FORMATS:
        raise ValueError(
            f"unknown task format {name!r} in {text!r}: expected FORMAT:PATH with FORMAT one"
            f" of {allowed}, or a path to a qwengyre task JSONL (write a path holding ':' as"
            f" ./{text})"
        )
    if not rest.strip():
        raise ValueError(f"{text!r} names no path: expected {name}:PATH")
    return name, Path(rest)


def load_task_source(value: str | Path) -> list[Task]:
    """The tasks ``value`` names: ``FORMAT:PATH`` loaded by that format's loader, a
    plain path by :func:`~qwengyre.rollout.tasks.load_tasks`. Errors are ``ValueError`` s
    naming the file, line and field (:class:`~qwengyre.rollout.tasks.TaskFileError`) or
    the allowed formats."""
    name, path = split_source(value)
    if name is None:
        return load_tasks(path)
    return FORMATS[name](path)


def example_path(name: str) -> Path:
    """The bundled example of format ``name``: a JSONL file (``swe``, ``spec``) or a
    directory of task directories (``terminal``)."""
    if name not in _EXAMPLES:
        raise ValueError(f"no example of format {name!r}: one of {', '.join(_EXAMPLES)}")
    examples = resources.files("qwengyre.rollout.workloads").joinpath("examples")
    return Path(str(examples)) / _EXAMPLES[name]


def resolve_example(value: str) -> str:
    """``FORMAT:example`` -> ``FORMAT:<the bundled example's path>``; other values as
    given (what ``--tasks`` accepts on the command line)."""
    found = _PREFIX_RE.match(value)
    if found is not None and found.group(2) == "example" and found.group(1) in _EXAMPLES:
        return f"{found.group(1)}:{example_path(found.group(1))}"
    return value
