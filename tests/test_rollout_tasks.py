"""The task dataset: loading, validation errors naming line and field, round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qwengyre.rollout.tasks import (
    CommandEvaluator,
    ExactMatchEvaluator,
    PythonEvaluator,
    Task,
    TaskFileError,
    dump_tasks,
    example_tasks_path,
    load_tasks,
)

PY_EVAL = {"type": "python", "callable": "os.path:join"}


def _task(task_id: str = "t1", **fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"id": task_id, "instructions": "do it", "evaluator": PY_EVAL}
    data.update(fields)
    return data


def _write(path: Path, *lines: str | dict[str, Any]) -> Path:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def valid_file(tmp_path: Path) -> Path:
    (tmp_path / "templates" / "repo").mkdir(parents=True)
    return _write(
        tmp_path / "tasks.jsonl",
        "# a comment line",
        _task(
            "cmd-argv",
            workspace_template="templates/repo",
            evaluator={"type": "command", "command": ["python", "grade.py"], "timeout_s": 30},
            metadata={"difficulty": "hard", "tags": ["a", "b"], "n": None},
        ),
        "",
        _task(
            "cmd.shell_2",
            setup="git init -q && echo hi > x",
            evaluator={"type": "command", "command": "./grade.sh | tail -1"},
        ),
        "   ",
        _task("py", evaluator={"type": "python", "callable": "pkg.mod:Class.method"}),
        _task(
            "exact",
            evaluator={"type": "exact_match", "expected": "82", "file": "out/answer.txt"},
        ),
    )


def test_valid_file_loads_all_kinds(valid_file: Path) -> None:
    tasks = load_tasks(valid_file)
    assert [t.id for t in tasks] == ["cmd-argv", "cmd.shell_2", "py", "exact"]
    argv, shell, py, exact = tasks

    assert isinstance(argv.evaluator, CommandEvaluator)
    assert argv.evaluator.command == ["python", "grade.py"]
    assert argv.evaluator.timeout_s == 30.0
    assert argv.workspace_template == (valid_file.parent / "templates" / "repo").resolve()
    assert argv.setup is None
    assert argv.metadata == {"difficulty": "hard", "tags": ["a", "b"], "n": None}

    assert isinstance(shell.evaluator, CommandEvaluator)
    assert shell.evaluator.command == "./grade.sh | tail -1"
    assert shell.evaluator.timeout_s == 600.0
    assert shell.setup == "git init -q && echo hi > x"
    assert shell.workspace_template is None

    assert isinstance(py.evaluator, PythonEvaluator)
    assert py.evaluator.callable == "pkg.mod:Class.method"  # not imported at load time
    assert py.workspace_template is None and py.setup is None
    assert py.metadata == {}

    assert isinstance(exact.evaluator, ExactMatchEvaluator)
    assert exact.evaluator.expected == "82"
    assert exact.evaluator.file == "out/answer.txt"


def test_relative_template_resolves_against_file_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    (data_dir / "tpl").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the cwd must not matter
    path = _write(data_dir / "tasks.jsonl", _task(workspace_template="tpl"))
    (task,) = load_tasks(Path("..") / "data" / "tasks.jsonl")
    assert task.workspace_template == (data_dir / "tpl").resolve()
    assert task.workspace_template.is_absolute()
    # An absolute template path is kept as it is.
    _write(path, _task(workspace_template=str(elsewhere)))
    assert load_tasks(path)[0].workspace_template == elsewhere.resolve()


@pytest.mark.parametrize(
    ("line", "field", "problem"),
    [
        ('{"id": "x", "instructions": ', None, "invalid JSON"),
        ("[1, 2]", None, "expected a JSON object"),
        (_task(surprise=1), "surprise", "unknown field"),
        ({"id": "x", "evaluator": PY_EVAL}, "instructions", "missing"),
        ({"id": "x", "instructions": "i"}, "evaluator", "missing"),
        (_task(instructions=3), "instructions", "valid string"),
        (_task(instructions="  "), "instructions", "empty"),
        (_task("a/b"), "id", "letters, digits"),
        (_task(""), "id", "letters, digits"),
        (_task("x" * 129), "id", "letters, digits"),
        (_task(".."), "id", "workspace name"),
        ({**_task(), "id": 7}, "id", "valid string"),
        (_task(metadata=[1]), "metadata", "dictionary"),
        (_task(setup=5), "setup", "valid string"),
        (_task(workspace_template="missing"), "workspace_template", "directory not found"),
        (_task(workspace_template=["x"]), "workspace_template", "directory path"),
        (_task(workspace_template="tpl", setup="make"), "setup", "not both"),
        (_task(evaluator={"command": "x"}), "evaluator.type", "missing"),
        (_task(evaluator={"type": "llm"}), "evaluator.type", "unknown evaluator type 'llm'"),
        (_task(evaluator="exact"), "evaluator", "JSON object"),
        (_task(evaluator={"type": "command"}), "evaluator.command", "missing"),
        (_task(evaluator={"type": "command", "command": []}), "evaluator.command", "empty"),
        (_task(evaluator={"type": "command", "command": 3}), "evaluator.command", "list of"),
        (
            _task(evaluator={"type": "command", "command": ["a", 1]}),
            "evaluator.command",
            "list of",
        ),
        (
            _task(evaluator={"type": "command", "command": "x", "timeout_s": 0}),
            "evaluator.timeout_s",
            "greater than 0",
        ),
        (
            _task(evaluator={"type": "command", "command": "x", "timeout_s": "soon"}),
            "evaluator.timeout_s",
            "valid number",
        ),
        (
            _task(evaluator={"type": "command", "command": "x", "cwd": "/"}),
            "evaluator.cwd",
            "unknown field",
        ),
        (_task(evaluator={"type": "python"}), "evaluator.callable", "missing"),
        (
            _task(evaluator={"type": "python", "callable": "pkg.mod.func"}),
            "evaluator.callable",
            "package.module:function",
        ),
        (
            _task(evaluator={"type": "python", "callable": "pkg-x:f"}),
            "evaluator.callable",
            "package.module:function",
        ),
        (
            _task(evaluator={"type": "exact_match", "expected": "1"}),
            "evaluator.file",
            "missing",
        ),
        (
            _task(evaluator={"type": "exact_match", "expected": 1, "file": "a"}),
            "evaluator.expected",
            "valid string",
        ),
        (
            _task(evaluator={"type": "exact_match", "expected": "1", "file": "/etc/passwd"}),
            "evaluator.file",
            "relative",
        ),
        (
            _task(evaluator={"type": "exact_match", "expected": "1", "file": "a/../../b"}),
            "evaluator.file",
            "inside the workspace",
        ),
    ],
)
def test_errors_name_line_and_field(
    tmp_path: Path, line: str | dict[str, Any], field: str | None, problem: str
) -> None:
    (tmp_path / "tpl").mkdir()
    path = _write(tmp_path / "bad.jsonl", "# header", _task("ok-1"), "", line, _task("ok-2"))
    with pytest.raises(TaskFileError) as info:
        load_tasks(path)
    message = str(info.value)
    assert message.startswith(f"{path}:4: "), message
    assert info.value.line == 4
    assert info.value.path == path
    if field is not None:
        assert f"field {field!r}: " in message, message
    assert problem in message, message


def test_template_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "tpl").write_text("not a dir")
    path = _write(tmp_path / "t.jsonl", _task(workspace_template="tpl"))
    with pytest.raises(TaskFileError, match=r"t\.jsonl:1: field 'workspace_template': not a dir"):
        load_tasks(path)


def test_duplicate_ids_name_both_lines(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", _task("a"), "# c", _task("b"), _task("a"))
    with pytest.raises(TaskFileError) as info:
        load_tasks(path)
    assert str(info.value) == f"{path}:4: field 'id': duplicate id 'a' (first on line 1)"


@pytest.mark.parametrize("content", ["", "\n  \n", "# only comments\n\n  # another\n"])
def test_empty_file_is_an_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(TaskFileError, match="empty task file"):
        load_tasks(path)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match=r"nope\.jsonl: cannot open"):
        load_tasks(tmp_path / "nope.jsonl")


def test_task_file_error_is_value_error() -> None:
    assert issubclass(TaskFileError, ValueError)


def test_round_trip(valid_file: Path, tmp_path: Path) -> None:
    tasks = load_tasks(valid_file)
    # Same directory: the template is written relative, so the dataset is relocatable.
    same_dir = valid_file.parent / "copy.jsonl"
    dump_tasks(same_dir, tasks)
    assert load_tasks(same_dir) == tasks
    first = json.loads(same_dir.read_text().splitlines()[0])
    assert first["workspace_template"] == "templates/repo"
    assert "setup" not in first
    second = json.loads(same_dir.read_text().splitlines()[1])
    assert "workspace_template" not in second
    # Elsewhere: the template outside the file's directory is written absolute.
    other = tmp_path / "other" / "copy.jsonl"
    other.parent.mkdir()
    dump_tasks(other, tasks)
    assert load_tasks(other) == tasks
    assert json.loads(other.read_text().splitlines()[0])["workspace_template"] == str(
        (valid_file.parent / "templates" / "repo").resolve()
    )


def test_dump_rejects_duplicate_ids(tmp_path: Path) -> None:
    task = Task.model_validate(_task("same"))
    with pytest.raises(ValueError, match="duplicate task ids: same"):
        dump_tasks(tmp_path / "t.jsonl", [task, task])


def test_bundled_example_loads() -> None:
    path = example_tasks_path()
    assert path.is_file()
    tasks = load_tasks(path)
    assert len(tasks) == 8
    assert len({t.id for t in tasks}) == 8
    for task in tasks:
        assert isinstance(task.evaluator, ExactMatchEvaluator)
        assert task.evaluator.file == "answer.txt"
        assert task.workspace_template is None and task.setup is None
        a, b = task.metadata["a"], task.metadata["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert f"Compute {a}+{b}" in task.instructions
        assert "answer.txt" in task.instructions
        assert task.evaluator.expected == str(a + b)


def test_exact_match_scoring(tmp_path: Path) -> None:
    spec = ExactMatchEvaluator(expected="82", file="answer.txt")
    assert spec.score(tmp_path) == 0.0  # missing file
    (tmp_path / "answer.txt").write_text("  82\n")
    assert spec.score(tmp_path) == 1.0
    (tmp_path / "answer.txt").write_text("83\n")
    assert spec.score(tmp_path) == 0.0
    assert spec.matches("\n82 ") and not spec.matches("8 2")


def test_python_evaluator_resolve() -> None:
    import os.path

    assert PythonEvaluator(callable="os.path:join").resolve() is os.path.join
    with pytest.raises(ModuleNotFoundError):
        PythonEvaluator(callable="no_such_module_xyz:f").resolve()
    with pytest.raises(TypeError, match="not callable"):
        PythonEvaluator(callable="os.path:sep").resolve()
