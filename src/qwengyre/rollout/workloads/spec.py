"""The ``spec`` workload: build a repository from a natural-language specification
(NL2RepoBench style), scored by hidden tests.

A dataset is a JSONL file, one task a line::

    {"id": "textstats", "specification_file": "specs/textstats.md",
     "workspace_template": "scaffolds/textstats", "hidden_tests": "hidden/textstats",
     "score": "fraction", "environment": {"type": "image", "image": "python:3.11"},
     "metadata": {"lang": "python"}}

- ``id``: the task's id;
- ``specification`` (the text) or ``specification_file`` (a file holding it), exactly
  one: the harness's instructions;
- ``workspace_template``: a scaffold copied into each fresh workspace (optional; default
  an empty workspace);
- ``hidden_tests``: a directory of tests kept outside the workspace; the harness never
  gets them, the grader copies them in (required unless ``evaluator`` is given);
- ``tests_dest``: where in the workspace the hidden tests go at grading (default
  ``tests``; whatever the workspace has there is replaced);
- ``score``: ``fraction`` (default: the share of hidden tests that pass, as
  NL2RepoBench reports) or ``all`` (1 only when every one passes);
- ``tests``: the hidden tests' pytest node ids (relative to the workspace, e.g.
  ``tests/test_x.py::test_y``), optional: when given, the score is over exactly these (one
  absent from the output did not pass); else over the tests pytest's summary reports --
  where a module that fails to import counts once, and tests that ran past the timeout
  would go uncounted (so a timeout then scores 0);
- ``evaluator``: optional, any task evaluator (:data:`~qwengyre.rollout.tasks.EvaluatorSpec`,
  validated as a task's) used *instead of* the hidden tests -- the way to name a model
  judge; ``hidden_tests``, when given too, is then only carried in the metadata
  (``metadata["hidden_tests"]``) for that evaluator to use;
- ``test_command``, ``timeout_s``, ``environment``, ``metadata``: see
  :class:`~qwengyre.rollout.workloads.common.DatasetLine`.

Paths are relative to the dataset file's directory. Any other field is refused, naming
the file, line and field.

Grading (:func:`grade`): on a copy of the workspace, ``tests_dest`` is replaced by the
hidden tests and the test command runs (default ``python -m pytest -rA TESTS_DEST``);
every test in pytest's summary counts. The log names the tests that did not pass, then
the tail of the test output.
"""

from __future__ import annotations

import shutil
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import StrictStr, ValidationInfo, field_validator, model_validator

from qwengyre.jsonl import resolved
from qwengyre.rollout.tasks import (
    EvaluatorSpec,
    Task,
    TaskFileError,
)
from qwengyre.rollout.workloads.common import (
    DatasetLine,
    TestReport,
    critique,
    graded_copy,
    grader,
    load_dataset,
    pytest_command,
    run_logged,
)

__all__ = ["SpecTask", "grade", "load_spec"]


def _resolve(value: Path, info: ValidationInfo, kind: Literal["file", "dir"]) -> Path:
    path = resolved(value, info)
    if not (path.is_file() if kind == "file" else path.is_dir()):
        what = "a file" if kind == "file" else "a directory"
        raise ValueError(f"not {what}: {path}" if path.exists() else f"not found: {path}")
    return path


class SpecTask(DatasetLine):
    """One line of a ``spec`` dataset (the module docstring lists the fields)."""

    specification: StrictStr | None = None
    specification_file: Path | None = None
    workspace_template: Path | None = None
    hidden_tests: Path | None = None
    tests_dest: StrictStr = "tests"
    score: Literal["fraction", "all"] = "fraction"
    tests: list[StrictStr] | None = None
    evaluator: EvaluatorSpec | None = None

    @field_validator("specification_file", "workspace_template", "hidden_tests", mode="before")
    @classmethod
    def _check_path_type(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError("should be a path (string)")
        return value

    @field_validator("specification_file")
    @classmethod
    def _resolve_file(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return None if value is None else _resolve(value, info, "file")

    @field_validator("workspace_template", "hidden_tests")
    @classmethod
    def _resolve_dir(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return None if value is None else _resolve(value, info, "dir")

    @field_validator("tests_dest")
    @classmethod
    def _check_dest(cls, value: str) -> str:
        path = PurePosixPath(value)
        if not value.strip() or path.is_absolute() or ".." in path.parts or value in (".", "./"):
            raise ValueError(f"{value!r} must be a directory inside the workspace")
        return value

    @field_validator("tests")
    @classmethod
    def _some_tests(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("list at least one test id, or leave tests out")
        return value

    @model_validator(mode="after")
    def _check_sources(self) -> SpecTask:
        if (self.specification is None) == (self.specification_file is None):
            raise ValueError("give exactly one of specification and specification_file")
        if self.specification is not None and not self.specification.strip():
            raise ValueError("specification must not be empty or blank")
        if self.hidden_tests is None and self.evaluator is None:
            raise ValueError("give hidden_tests (or an evaluator that replaces them)")
        return self

    def text(self) -> str:
        """The specification: the given text, or the file's contents."""
        if self.specification is not None:
            return self.specification
        assert self.specification_file is not None
        return self.specification_file.read_text(encoding="utf-8")


def _task(spec: SpecTask, path: Path, line: int) -> Task:
    metadata: dict[str, Any] = {"format": "spec"}
    if spec.hidden_tests is not None:
        metadata["hidden_tests"] = str(spec.hidden_tests)
    metadata.update(spec.metadata)
    try:
        text = spec.text()
    except (OSError, UnicodeDecodeError) as error:
        raise TaskFileError(
            path, f"field 'specification_file': cannot read: {error}", line
        ) from None
    if not text.strip():
        raise TaskFileError(path, "field 'specification_file': the file is empty", line)
    evaluator = spec.evaluator or grader("spec", spec.timeout_s, path.resolve(), line, spec.id)
    return Task(
        id=spec.id,
        instructions=text,
        workspace_template=spec.workspace_template,
        evaluator=evaluator,
        environment=spec.environment,
        metadata=metadata,
    )


def load_spec(path: Path | str) -> list[Task]:
    """Every task of a ``spec`` dataset as a :class:`Task`.

    Raises :class:`TaskFileError` naming the file, line and field of the first bad line,
    a duplicate id, or a file without tasks."""
    return load_dataset(SpecTask, path, _task, "tasks")


def grade(spec: SpecTask, workspace: Path) -> tuple[float, str]:
    """``(score, log)`` of ``workspace`` (left unchanged) by ``spec``'s hidden tests:
    the share of them (``tests``, else those reported) that passes (``score:
    fraction``) or 1.0 only if all do."""
    assert spec.hidden_tests is not None
    with graded_copy(workspace) as copy:
        dest = copy / spec.tests_dest
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        elif dest.exists() or dest.is_symlink():
            dest.unlink()
        shutil.copytree(spec.hidden_tests, dest, symlinks=True)
        command = spec.test_command or pytest_command(spec.tests_dest)
        status, output = run_logged(command, copy, spec.timeout_s)
    report = TestReport.parse(output)
    tests = spec.tests or sorted(report.outcomes)
    failing = report.failing(tests)
    passed = len(tests) - len(failing)
    header = [
        f"hidden tests: {passed}/{len(tests)} pass",
        *(f"  not passing: {test}" for test in failing),
    ]
    if status is None:
        header.append(f"the tests did not finish within {spec.timeout_s:g} s")
        if spec.tests is None:  # the unreported ones would be left out of the share
            return 0.0, critique(header, output)
    if not tests:
        return 0.0, critique([*header, "no test outcome in the output"], output)
    if spec.score == "all":
        return (1.0 if not failing else 0.0), critique(header, output)
    return passed / len(tests), critique(header, output)
