"""The ``swe`` workload: fix an issue in an existing repository (SWE-bench / DeepSWE style).

A dataset is a JSONL file, one instance a line, in SWE-bench's field names::

    {"instance_id": "calc-median", "repository": "repos/calc.bundle",
     "base_commit": "5d1f...", "problem_statement": "median() is wrong for ...",
     "FAIL_TO_PASS": ["tests/test_stats.py::test_median_even"],
     "PASS_TO_PASS": ["tests/test_stats.py::test_mean"],
     "test_patch": "diff --git a/tests/test_stats.py ...",
     "environment": {"type": "image", "image": "..."}, "metadata": {"difficulty": "easy"}}

- ``instance_id`` (or ``id``): the task's id;
- ``repository``: the repository, on this machine (no network at run time): a git
  repository directory, a git bundle (``*.bundle``), or a tar archive (``.tar``,
  ``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``) whose top level is a git working
  tree; relative to the dataset file's directory;
- ``base_commit``: the commit (7-40 hex digits) the workspace is checked out at;
- ``problem_statement``: the harness's instructions;
- ``FAIL_TO_PASS``: pytest node ids that must pass after the fix (at least one);
  ``PASS_TO_PASS``: node ids that must keep passing (default none). Either may also be
  a JSON-encoded list in a string, as SWE-bench's published files have them;
- ``test_patch``: the hidden tests, a ``git diff`` applied only at grading (optional);
- ``test_command``, ``timeout_s``, ``environment``, ``metadata``: see
  :class:`~qwengyre.rollout.workloads.common.DatasetLine`;
- SWE-bench's other fields (``repo``, ``version``, ``created_at``, ``hints_text``,
  ``environment_setup_commit``) are accepted and carried in the metadata; ``patch`` (the
  reference fix) is accepted and not carried.

Any other field is refused, naming the file, line and field.

The workspace: a ``setup`` command clones the repository (or unpacks the archive) into
the empty workspace and checks out ``base_commit`` detached, the clone's remote removed.

Grading (:func:`grade`, run by the task's command evaluator in the workspace): on a copy
of the workspace, the files the test patch touches are reset to ``base_commit`` (a
new file removed), the patch is applied (``git apply``), and the tests run -- by default
``python -m pytest -rA`` over the files of the listed node ids. The score is 1 when
every FAIL_TO_PASS and every PASS_TO_PASS test passes, else 0 (also when the patch does
not apply or the tests time out). The log kept as the assessment's critique names the
tests that did not pass, then the tail of the test output.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, StrictStr, ValidationInfo, field_validator

from qwengyre.jsonl import resolved
from qwengyre.rollout.tasks import (
    TASK_ID_PATTERN,
    Task,
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

__all__ = ["ARCHIVE_SUFFIXES", "SweInstance", "grade", "load_swe", "setup_command"]

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
"""The archive names a ``repository`` may have (unpacked with ``tar -xf``)."""

_CARRIED = ("repo", "version", "created_at", "hints_text", "environment_setup_commit")
_DIFF_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_GIT_TIMEOUT_S = 120.0


class SweInstance(DatasetLine):
    """One line of a ``swe`` dataset (the module docstring lists the fields)."""

    id: Annotated[
        StrictStr,
        Field(pattern=TASK_ID_PATTERN, validation_alias=AliasChoices("instance_id", "id")),
    ]
    repository: Path
    base_commit: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{7,40}$")]
    problem_statement: StrictStr
    FAIL_TO_PASS: list[StrictStr]
    PASS_TO_PASS: list[StrictStr] = Field(default_factory=list)
    test_patch: StrictStr | None = None
    patch: StrictStr | None = None
    repo: StrictStr | None = None
    version: StrictStr | None = None
    created_at: StrictStr | None = None
    hints_text: StrictStr | None = None
    environment_setup_commit: StrictStr | None = None

    @field_validator("repository", mode="before")
    @classmethod
    def _check_repository_type(cls, value: Any) -> Any:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("repository must be a path (string)")
        return value

    @field_validator("repository")
    @classmethod
    def _resolve_repository(cls, value: Path, info: ValidationInfo) -> Path:
        path = resolved(value, info)
        if not path.exists():
            raise ValueError(f"not found: {path}")
        if path.is_dir():
            if not ((path / ".git").exists() or (path / "HEAD").is_file()):
                raise ValueError(f"directory is no git repository: {path}")
        elif path.suffix != ".bundle" and not path.name.endswith(ARCHIVE_SUFFIXES):
            raise ValueError(
                f"{path.name!r} is neither a git repository directory, a git bundle"
                f" (.bundle) nor a tar archive ({', '.join(ARCHIVE_SUFFIXES)})"
            )
        return path

    @field_validator("problem_statement")
    @classmethod
    def _check_statement(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("problem_statement must not be empty or blank")
        return value

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _decode_list(cls, value: Any) -> Any:
        if isinstance(value, str):  # SWE-bench's files hold JSON-encoded lists
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(
                    "should be a list of test ids (or a JSON list in a string)"
                ) from None
        return value

    @field_validator("FAIL_TO_PASS")
    @classmethod
    def _some_failing(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("needs at least one test that the fix makes pass")
        return value

    def test_files(self) -> list[str]:
        """The files of the listed tests (a node id's part before ``::``), sorted."""
        return sorted({test.split("::", 1)[0] for test in self.FAIL_TO_PASS + self.PASS_TO_PASS})


def setup_command(instance: SweInstance) -> str:
    """The shell command that makes an empty workspace the repository at its base commit."""
    source, base = shlex.quote(str(instance.repository)), shlex.quote(instance.base_commit)
    checkout = f"git -c advice.detachedHead=false checkout --quiet --force --detach {base}"
    if instance.repository.name.endswith(ARCHIVE_SUFFIXES):
        return f"tar -xf {source} && {checkout}"
    return (
        f"git clone --quiet --no-checkout -- {source} . && {checkout} && git remote remove origin"
    )


def _task(instance: SweInstance, path: Path, line: int) -> Task:
    metadata: dict[str, Any] = {
        "format": "swe",
        "repository": str(instance.repository),
        "base_commit": instance.base_commit,
        "FAIL_TO_PASS": instance.FAIL_TO_PASS,
        "PASS_TO_PASS": instance.PASS_TO_PASS,
    }
    metadata.update(
        {key: getattr(instance, key) for key in _CARRIED if getattr(instance, key) is not None}
    )
    metadata.update(instance.metadata)
    return Task(
        id=instance.id,
        instructions=instance.problem_statement,
        setup=setup_command(instance),
        evaluator=grader("swe", instance.timeout_s, path.resolve(), line, instance.id),
        environment=instance.environment,
        metadata=metadata,
    )


def load_swe(path: Path | str) -> list[Task]:
    """Every instance of a ``swe`` dataset as a :class:`Task`.

    Raises :class:`TaskFileError` naming the file, line and field of the first bad line,
    a duplicate id, or a file without instances."""
    return load_dataset(SweInstance, path, _task, "instances")


def _git(copy: Path, *args: str, stdin: str | None = None) -> tuple[int | None, str]:
    """Git in the graded copy, none of the workspace's hooks or fsmonitor run."""
    safe = ["-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false"]
    return run_logged(["git", *safe, *args], copy, _GIT_TIMEOUT_S, stdin=stdin)


def _apply_test_patch(instance: SweInstance, copy: Path) -> str | None:
    """Reset the files the test patch touches to the base commit, apply it; why it
    failed, or None."""
    assert instance.test_patch is not None
    touched = sorted({name for pair in _DIFF_RE.findall(instance.test_patch) for name in pair})
    for name in touched:
        exists, _ = _git(copy, "cat-file", "-e", f"{instance.base_commit}:{name}")
        if exists == 0:
            status, output = _git(copy, "checkout", instance.base_commit, "--", name)
            if status != 0:
                return f"cannot reset {name} to the base commit: {output.strip()}"
        elif (copy / name).is_file() or (copy / name).is_symlink():
            (copy / name).unlink()
    status, output = _git(copy, "apply", "--whitespace=nowarn", "-", stdin=instance.test_patch)
    if status != 0:
        return f"the test patch does not apply: {output.strip()}"
    return None


def grade(instance: SweInstance, workspace: Path) -> tuple[float, str]:
    """``(score, log)`` of ``workspace`` (left unchanged) against ``instance``: 1.0 when
    every FAIL_TO_PASS and PASS_TO_PASS test passes after the test patch, else 0.0."""
    with graded_copy(workspace) as copy:
        if not (copy / ".git").exists():
            return 0.0, "the workspace is no git repository (its .git is gone)"
        if instance.test_patch is not None:
            problem = _apply_test_patch(instance, copy)
            if problem is not None:
                return 0.0, problem
        command = instance.test_command or pytest_command(*instance.test_files())
        status, output = run_logged(command, copy, instance.timeout_s)
    report = TestReport.parse(output)
    fail_to_pass = report.failing(instance.FAIL_TO_PASS)
    pass_to_pass = report.failing(instance.PASS_TO_PASS)
    header = [
        f"FAIL_TO_PASS: {len(instance.FAIL_TO_PASS) - len(fail_to_pass)}"
        f"/{len(instance.FAIL_TO_PASS)} pass",
        *(f"  not passing: {test}" for test in fail_to_pass),
        f"PASS_TO_PASS: {len(instance.PASS_TO_PASS) - len(pass_to_pass)}"
        f"/{len(instance.PASS_TO_PASS)} pass",
        *(f"  not passing: {test}" for test in pass_to_pass),
    ]
    if status is None:
        header.append(f"the tests did not finish within {instance.timeout_s:g} s")
    score = 1.0 if not fail_to_pass and not pass_to_pass else 0.0
    return score, critique(header, output)
