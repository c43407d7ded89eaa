"""The ``terminal`` workload: terminal tasks checked by a verifier (Terminal-Bench layout).

A dataset is a directory of task directories (a Terminal-Bench checkout's ``tasks/``);
each task directory, its name the task's id, holds:

- its instructions: ``instruction.md`` (Terminal-Bench 2 / Harbor), else the
  ``instruction`` key of ``task.yaml`` (Terminal-Bench 1);
- optional settings: ``task.yaml``'s ``max_test_timeout_sec`` or ``task.toml``'s
  ``[verifier] timeout_sec`` (the verifier's timeout; default 600 s); the other keys of
  ``task.yaml`` but ``instruction`` and ``environment`` are carried in the task's
  ``metadata["terminal"]``;
- its verifier: ``tests/test.sh``, else ``run-tests.sh`` next to ``tests/`` (run with
  ``bash``, after the harness ended);
- optionally ``workspace/``: the files the harness starts with (copied into each fresh
  workspace; default an empty workspace);
- optionally its environment (:attr:`Task.environment`, where the harness and the
  verifier run): ``task.yaml``'s ``environment`` key, validated as a task's
  (:data:`~qwengyre.rollout.environments.EnvironmentSpec`; a relative ``path`` or
  ``build`` resolves against the task directory); else an ``environment/`` directory
  holding a ``Dockerfile`` (Terminal-Bench 2), else a ``Dockerfile`` beside the task's
  files (Terminal-Bench 1): the image that Dockerfile builds, its directory the build
  context (``{"type": "image", "build": ...}``, built once per node and content by
  podman or docker; a build that fails is the task's zero-reward placeholder). A
  ``docker-compose.yaml`` is not read: its services, volumes and networks are not
  reproduced.

Dot-directories are skipped; any other directory without instructions or verifier is
refused, naming it (and for a bad ``task.yaml``, its line and field).

Grading (:func:`grade`): the verifier runs with a copy of the workspace as its working
directory and ``TEST_DIR`` naming a copy of ``tests/`` (with ``run-tests.sh``) outside
it, the interpreter running qwengyre first on ``PATH``. Exit status 0 scores 1, any
other status (or running past the timeout) 0. The log is the tail of its output.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from qwengyre.jsonl import describe
from qwengyre.rollout.environments import EnvironmentSpec, ImageEnvironment, RootfsEnvironment
from qwengyre.rollout.tasks import Task, TaskFileError, _rewrite
from qwengyre.rollout.workloads.common import (
    critique,
    graded_copy,
    grader,
    run_logged,
)

__all__ = ["DEFAULT_TIMEOUT_S", "TerminalTask", "grade", "load_terminal", "read_task_dir"]

DEFAULT_TIMEOUT_S = 600.0
"""The verifier's timeout when the task names none."""


@dataclass(frozen=True)
class TerminalTask:
    """A task directory read: what the task and its grader need."""

    directory: Path
    instructions: str
    verifier: Path
    timeout_s: float = DEFAULT_TIMEOUT_S
    settings: dict[str, Any] = field(default_factory=dict)
    environment: RootfsEnvironment | ImageEnvironment | None = None

    @property
    def id(self) -> str:
        return self.directory.name


def _key_line(text: str, key: str) -> int | None:
    """The 1-based line of a top-level YAML ``key``, where it can be found."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    if isinstance(node, yaml.MappingNode):
        for key_node, _ in node.value:
            if getattr(key_node, "value", None) == key:
                return int(key_node.start_mark.line) + 1
    return None


def _positive(value: Any, path: Path, where: str, line: int | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise TaskFileError(path, f"field {where!r}: should be a positive number", line)
    return float(value)


def _read_yaml(path: Path) -> tuple[dict[str, Any], str]:
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = None if mark is None else int(mark.line) + 1
        raise TaskFileError(path, f"invalid YAML: {error}", line) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TaskFileError(path, f"expected a mapping, got {type(data).__name__}")
    return data, text


class _Environment(BaseModel):
    """``task.yaml``'s ``environment`` key, validated as a task's."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    environment: EnvironmentSpec


def _environment(
    directory: Path, settings: dict[str, Any], task_yaml: Path, text: str
) -> RootfsEnvironment | ImageEnvironment | None:
    """The task's environment: ``task.yaml``'s ``environment`` (errors naming its line
    and field), else the image ``environment/Dockerfile`` or ``Dockerfile`` builds."""
    if settings.get("environment") is not None:
        try:
            return _Environment.model_validate(
                {"environment": settings["environment"]}, context={"base_dir": directory}
            ).environment
        except ValidationError as error:
            line = _key_line(text, "environment")
            raise TaskFileError(task_yaml, describe(error, _rewrite), line) from None
    if (directory / "environment").is_dir():
        if not (directory / "environment" / "Dockerfile").is_file():
            raise TaskFileError(
                directory / "environment",
                "no Dockerfile: give one, or task.yaml's environment (an image or a rootfs)",
            )
        return ImageEnvironment(build=directory / "environment")
    if (directory / "Dockerfile").is_file():
        return ImageEnvironment(build=directory)
    return None


def read_task_dir(directory: Path) -> TerminalTask:
    """Read one task directory (the module docstring says what it holds).

    Raises :class:`TaskFileError` naming the file (and line and field) that is wrong."""
    directory = directory.resolve()
    settings: dict[str, Any] = {}
    text = ""
    timeout_s = DEFAULT_TIMEOUT_S
    task_yaml = directory / "task.yaml"
    if task_yaml.is_file():
        settings, text = _read_yaml(task_yaml)
        if "max_test_timeout_sec" in settings:
            line = _key_line(text, "max_test_timeout_sec")
            value = settings["max_test_timeout_sec"]
            timeout_s = _positive(value, task_yaml, "max_test_timeout_sec", line)
    task_toml = directory / "task.toml"
    if task_toml.is_file():
        try:
            toml = tomllib.loads(task_toml.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as error:
            raise TaskFileError(task_toml, f"invalid TOML: {error}") from None
        verifier = toml.get("verifier", {})
        if isinstance(verifier, dict) and "timeout_sec" in verifier:
            timeout_s = _positive(verifier["timeout_sec"], task_toml, "verifier.timeout_sec", None)
    instruction_md = directory / "instruction.md"
    if instruction_md.is_file():
        instructions = instruction_md.read_text(encoding="utf-8")
        if not instructions.strip():
            raise TaskFileError(instruction_md, "empty instructions")
    elif "instruction" in settings:
        instructions = settings["instruction"]
        if not isinstance(instructions, str) or not instructions.strip():
            line = _key_line(text, "instruction")
            raise TaskFileError(task_yaml, "field 'instruction': should be non-empty text", line)
    else:
        raise TaskFileError(
            directory, "no instructions: expected instruction.md or task.yaml's 'instruction'"
        )
    verifier_path = directory / "tests" / "test.sh"
    if not verifier_path.is_file():
        verifier_path = directory / "run-tests.sh"
    if not verifier_path.is_file():
        raise TaskFileError(directory, "no verifier: expected tests/test.sh or run-tests.sh")
    environment = _environment(directory, settings, task_yaml, text)
    carried = {k: v for k, v in settings.items() if k not in ("instruction", "environment")}
    return TerminalTask(
        directory=directory,
        instructions=instructions,
        verifier=verifier_path,
        timeout_s=timeout_s,
        settings=carried,
        environment=environment,
    )


def _task(terminal: TerminalTask) -> Task:
    metadata: dict[str, Any] = {"format": "terminal", "task_dir": str(terminal.directory)}
    if terminal.settings:
        metadata["terminal"] = terminal.settings
    workspace = terminal.directory / "workspace"
    try:
        return Task(
            id=terminal.id,
            instructions=terminal.instructions,
            workspace_template=workspace if workspace.is_dir() else None,
            evaluator=grader("terminal", terminal.timeout_s, terminal.directory),
            environment=terminal.environment,
            metadata=metadata,
        )
    except ValueError as error:  # the id: the directory's name
        raise TaskFileError(terminal.directory, f"not a usable task: {error}") from None


def load_terminal(directory: Path | str) -> list[Task]:
    """Every task directory under ``directory`` (sorted by name) as a :class:`Task`.

    Raises :class:`TaskFileError` for a missing directory, one without task
    directories, or the first task directory that is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TaskFileError(directory, "not a directory of task directories")
    children = sorted(
        child for child in directory.iterdir() if child.is_dir() and not child.name.startswith(".")
    )
    tasks = [_task(read_task_dir(child)) for child in children]
    if not tasks:
        raise TaskFileError(directory, "no task directories")
    return tasks


def grade(terminal: TerminalTask, workspace: Path) -> tuple[float, str]:
    """``(score, log)``: run the verifier on a copy of ``workspace`` (left unchanged);
    1.0 when it exits with status 0, else 0.0."""
    with graded_copy(workspace) as copy, tempfile.TemporaryDirectory() as scratch:
        tests = Path(scratch) / "tests"
        source = terminal.directory / "tests"
        if source.is_dir():
            shutil.copytree(source, tests, symlinks=True)
        else:
            tests.mkdir()
        script = tests / terminal.verifier.name
        if terminal.verifier.parent != source:
            shutil.copy2(terminal.verifier, script)
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        status, output = run_logged(
            ["bash", str(script)],
            copy,
            terminal.timeout_s,
            env={"TEST_DIR": str(tests), "PATH": path},
        )
    verifier = terminal.verifier.relative_to(terminal.directory).as_posix()
    if status is None:
        header = f"verifier {verifier} did not finish within {terminal.timeout_s:g} s"
    else:
        header = f"verifier {verifier} exited with status {status}"
    return (1.0 if status == 0 else 0.0), critique([header], output)
