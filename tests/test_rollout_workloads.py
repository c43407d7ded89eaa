"""The workload formats (swe, terminal, spec): their bundled examples load, their
workspaces come up as the format says, and their graders grade for real -- an untouched
workspace scores 0 with the failing test named in the log, the fixed one 1 -- through
the command evaluator a run uses, without changing the workspace they grade. A dataset's
``environment`` is the task's own: its harness and its grader's tests run in the root it
names (they see a file only that root has), and a broken one is the placeholder naming
it."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.test_rollout_environments import SHARE, execute, make_root

from qwengyre.records.assessments import Assessment
from qwengyre.rollout.environments import (
    EnvironmentOptions,
    ImageEnvironment,
    RootfsEnvironment,
)
from qwengyre.rollout.evaluation import artifact_digest, evaluate_once
from qwengyre.rollout.harness import HarnessSpec
from qwengyre.rollout.sandbox import SandboxUnavailable, sandbox
from qwengyre.rollout.tasks import CommandEvaluator, ExactMatchEvaluator, Task, TaskFileError
from qwengyre.rollout.workloads import (
    example_path,
    load_task_source,
    resolve_example,
    split_source,
)
from qwengyre.rollout.workloads.common import CRITIQUE_CHARS, TestReport
from qwengyre.rollout.workloads.grade import main as grade_main
from qwengyre.types import Outcome

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def workspace_of(task: Task, root: Path) -> Path:
    """The fresh workspace a run gives ``task``: its template copied, or its setup run."""
    workspace = root / task.id
    if task.workspace_template is not None:
        shutil.copytree(task.workspace_template, workspace, symlinks=True)
        return workspace
    workspace.mkdir(parents=True)
    if task.setup is not None:
        subprocess.run(task.setup, shell=True, cwd=workspace, check=True, capture_output=True)
    return workspace


def graded(task: Task, workspace: Path) -> Assessment:
    """One evaluation attempt of ``task`` on ``workspace``, the way a run makes it; the
    workspace is the same before and after."""
    before = artifact_digest(workspace)
    assessment = asyncio.run(evaluate_once(task.evaluator, workspace))
    assert artifact_digest(workspace) == before, "grading changed the workspace"
    assert assessment.valid, assessment.detail
    assert len(assessment.critique) <= CRITIQUE_CHARS
    return assessment


def by_id(tasks: list[Task]) -> dict[str, Task]:
    return {task.id: task for task in tasks}


def swe_lines() -> dict[str, dict[str, Any]]:
    lines = example_path("swe").read_text().splitlines()
    return {record["instance_id"]: record for record in map(json.loads, lines)}


def git_apply(workspace: Path, patch: str) -> None:
    subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=workspace, check=True)


# --------------------------------------------------------------------------- selection


def test_a_format_is_named_by_a_prefix_and_an_unknown_one_names_the_allowed():
    assert split_source("swe:data/x.jsonl") == ("swe", Path("data/x.jsonl"))
    assert split_source("terminal:/tb/tasks") == ("terminal", Path("/tb/tasks"))
    assert split_source("tasks.jsonl") == (None, Path("tasks.jsonl"))
    assert split_source("./odd:name.jsonl") == (None, Path("./odd:name.jsonl"))
    with pytest.raises(ValueError, match=r"unknown task format 'swebench'.*swe, terminal, spec"):
        split_source("swebench:x.jsonl")
    with pytest.raises(ValueError, match="names no path: expected spec:PATH"):
        split_source("spec:")
    assert resolve_example("spec:example") == f"spec:{example_path('spec')}"
    assert resolve_example("spec:mine.jsonl") == "spec:mine.jsonl"


def test_each_bundled_example_loads_as_its_format_says():
    swe = by_id(load_task_source(resolve_example("swe:example")))
    assert set(swe) == {"calc-clamp", "calc-median"}
    median = swe["calc-median"]
    assert median.metadata["FAIL_TO_PASS"] == ["tests/test_stats.py::test_median_even"]
    assert "median([4, 1, 3, 2]) should be 2.5" in median.instructions
    assert median.setup is not None and median.metadata["base_commit"] in median.setup
    assert "test_patch" not in median.metadata and "patch" not in median.metadata

    terminal = by_id(load_task_source(resolve_example("terminal:example")))
    assert set(terminal) == {"count-lines", "hello-file"}
    assert terminal["hello-file"].instructions.startswith("Create a file named hello.txt")
    assert terminal["hello-file"].workspace_template is None
    assert "environment" not in terminal["hello-file"].metadata
    count = terminal["count-lines"]
    assert count.workspace_template == example_path("terminal") / "count-lines" / "workspace"
    assert all(task.environment is None for task in terminal.values())  # run on the host
    assert count.metadata["terminal"]["difficulty"] == "easy"
    assert isinstance(count.evaluator, CommandEvaluator) and count.evaluator.timeout_s > 60

    spec = by_id(load_task_source(resolve_example("spec:example")))
    assert set(spec) == {"textstats", "roman"}
    assert spec["textstats"].instructions.startswith("# textstats")
    assert all(task.environment is None for task in [*spec.values(), *swe.values()])


# --------------------------------------------------------------------------- swe


def test_swe_workspace_is_the_repository_at_its_base_commit(tmp_path: Path):
    tasks = by_id(load_task_source(resolve_example("swe:example")))
    for task in tasks.values():
        workspace = workspace_of(task, tmp_path)
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=workspace, capture_output=True, text=True
        )
        assert head.stdout.strip() == task.metadata["base_commit"]
        remotes = subprocess.run(["git", "remote"], cwd=workspace, capture_output=True, text=True)
        assert remotes.stdout == ""  # no way back to where the repository came from
    # The clamp task's base commit predates median(); the hidden tests are not there.
    assert "median" not in (tmp_path / "calc-clamp" / "calc" / "stats.py").read_text()
    stats_tests = (tmp_path / "calc-median" / "tests" / "test_stats.py").read_text()
    assert "test_median_odd" in stats_tests and "test_median_even" not in stats_tests


@pytest.mark.parametrize("kind", ["mirror", "working-tree", "archive"])
def test_swe_repository_may_be_a_directory_or_an_archive(tmp_path: Path, kind: str):
    bundle = example_path("swe").parent / "calc.bundle"
    if kind == "mirror":
        repository = tmp_path / "calc.git"
        subprocess.run(["git", "clone", "-q", "--mirror", str(bundle), str(repository)], check=True)
    else:
        repository = tmp_path / "calc"
        subprocess.run(["git", "clone", "-q", str(bundle), str(repository)], check=True)
        if kind == "archive":
            archive = tmp_path / "calc.tar.gz"
            subprocess.run(["tar", "-czf", str(archive), "-C", str(repository), "."], check=True)
            repository = archive
    line = dict(swe_lines()["calc-median"], repository=str(repository))
    path = tmp_path / "swe.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (task,) = load_task_source(f"swe:{path}")
    workspace = workspace_of(task, tmp_path / "workspaces")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=workspace, capture_output=True)
    assert head.stdout.decode().strip() == line["base_commit"]
    assert "test_median_odd" in (workspace / "tests" / "test_stats.py").read_text()


@pytest.mark.parametrize(
    ("task_id", "failing"),
    [
        ("calc-median", "tests/test_stats.py::test_median_even"),
        ("calc-clamp", "tests/test_ranges.py::test_clamp_below"),
    ],
)
def test_swe_grading_is_zero_untouched_and_one_with_the_fix(
    tmp_path: Path, task_id: str, failing: str
):
    task = by_id(load_task_source(resolve_example("swe:example")))[task_id]
    workspace = workspace_of(task, tmp_path)
    untouched = graded(task, workspace)
    assert untouched.score == 0.0
    assert f"not passing: {failing}" in untouched.critique
    assert "FAIL_TO_PASS: 0/1 pass" in untouched.critique
    assert "AssertionError" in untouched.critique  # the test output's tail is kept
    git_apply(workspace, swe_lines()[task_id]["patch"])
    fixed = graded(task, workspace)
    assert fixed.score == 1.0, fixed.critique
    assert "FAIL_TO_PASS: 1/1 pass" in fixed.critique and "not passing" not in fixed.critique


def test_swe_grading_needs_the_old_tests_to_keep_passing_and_its_own_hidden_tests(
    tmp_path: Path,
):
    task = by_id(load_task_source(resolve_example("swe:example")))["calc-median"]
    workspace = workspace_of(task, tmp_path)
    # A "fix" that rewrites the hidden test to pass: the test patch's files are reset,
    # so the real hidden test runs and still fails.
    tests = workspace / "tests" / "test_stats.py"
    tests.write_text(tests.read_text() + "\n\ndef test_median_even():\n    pass\n")
    cheat = graded(task, workspace)
    assert cheat.score == 0.0 and "test_median_even" in cheat.critique
    git_apply(workspace, swe_lines()["calc-median"]["patch"])
    assert graded(task, workspace).score == 1.0  # the real hidden test ran, and passes
    # Breaking mean() breaks a PASS_TO_PASS test: 0, and the log says which.
    stats = workspace / "calc" / "stats.py"
    stats.write_text(stats.read_text().replace("sum(values) / len(values)", "0"))
    broken = graded(task, workspace)
    assert broken.score == 0.0
    assert "PASS_TO_PASS: 1/2 pass" in broken.critique
    assert "not passing: tests/test_stats.py::test_mean" in broken.critique


def test_swe_validation_names_the_file_line_and_field(tmp_path: Path):
    line = swe_lines()["calc-median"]
    line["repository"] = str(example_path("swe").parent / "calc.bundle")
    bad = dict(line, FAIL_TO_PASS=[])
    path = tmp_path / "swe.jsonl"
    path.write_text("# instances\n" + json.dumps(line) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TaskFileError, match=r"swe\.jsonl:3: field 'FAIL_TO_PASS': .*at least one"):
        load_task_source(f"swe:{path}")
    missing = {k: v for k, v in line.items() if k != "base_commit"}
    path.write_text(json.dumps(dict(missing, repository="nowhere.bundle", colour="red")) + "\n")
    with pytest.raises(TaskFileError) as error:
        load_task_source(f"swe:{path}")
    message = str(error.value)
    assert message.startswith(f"{path}:1: ")
    assert "field 'base_commit': missing (required)" in message
    assert "field 'repository': not found" in message
    assert "field 'colour': unknown field" in message
    # SWE-bench's files hold the test lists as JSON strings: accepted.
    encoded = dict(line, FAIL_TO_PASS=json.dumps(line["FAIL_TO_PASS"]), PASS_TO_PASS="[]")
    path.write_text(json.dumps(encoded) + "\n")
    (task,) = load_task_source(f"swe:{path}")
    assert task.metadata["FAIL_TO_PASS"] == line["FAIL_TO_PASS"]
    assert task.metadata["PASS_TO_PASS"] == []


def test_a_grader_whose_line_changed_gives_no_valid_assessment(tmp_path: Path):
    line = swe_lines()["calc-median"]
    line["repository"] = str(example_path("swe").parent / "calc.bundle")
    path = tmp_path / "swe.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (task,) = load_task_source(f"swe:{path}")
    path.write_text(json.dumps(dict(line, instance_id="other")) + "\n")
    workspace = workspace_of(task, tmp_path)
    attempt = asyncio.run(evaluate_once(task.evaluator, workspace))
    assert not attempt.valid and attempt.score is None  # never a zero
    assert "no longer holds task 'calc-median'" in attempt.critique


# --------------------------------------------------------------------------- terminal


def test_terminal_verifiers_grade_what_the_harness_left(tmp_path: Path):
    tasks = by_id(load_task_source(resolve_example("terminal:example")))
    hello = tasks["hello-file"]
    workspace = workspace_of(hello, tmp_path)
    assert list(workspace.iterdir()) == []
    missing = graded(hello, workspace)
    assert missing.score == 0.0
    assert "exited with status 1" in missing.critique
    assert "hello.txt does not exist" in missing.critique
    (workspace / "hello.txt").write_text("Hello, world!\n")
    assert graded(hello, workspace).score == 1.0

    count = tasks["count-lines"]  # Terminal-Bench 1: task.yaml, run-tests.sh, pytest
    workspace = workspace_of(count, tmp_path)
    assert sorted(p.name for p in workspace.iterdir()) == ["data.csv"]  # no tests in it
    (workspace / "count.txt").write_text("5\n")
    wrong = graded(count, workspace)
    assert wrong.score == 0.0
    assert "FAILED" in wrong.critique and "test_count_is_the_number_of_records" in wrong.critique
    (workspace / "count.txt").write_text("4\n")
    assert graded(count, workspace).score == 1.0


def test_terminal_validation_names_the_file_line_and_field(tmp_path: Path):
    task = tmp_path / "tasks" / "broken"
    (task / "tests").mkdir(parents=True)
    (task / "tests" / "test.sh").write_text("exit 0\n")
    (task / "task.yaml").write_text("instruction: do it\nmax_test_timeout_sec: -5\n")
    with pytest.raises(TaskFileError) as error:
        load_task_source(f"terminal:{tmp_path / 'tasks'}")
    assert str(error.value) == (
        f"{task / 'task.yaml'}:2: field 'max_test_timeout_sec': should be a positive number"
    )
    (task / "task.yaml").write_text("difficulty: easy\n")
    with pytest.raises(TaskFileError, match=r"no instructions: expected instruction\.md"):
        load_task_source(f"terminal:{tmp_path / 'tasks'}")
    (task / "instruction.md").write_text("Do it.\n")
    (task / "tests" / "test.sh").unlink()
    with pytest.raises(TaskFileError, match=r"no verifier: expected tests/test\.sh or run-tests"):
        load_task_source(f"terminal:{tmp_path / 'tasks'}")


# --------------------------------------------------------------------------- spec

TEXTSTATS = """import re
from collections import Counter


def _words(text):
    return [w.lower() for w in re.findall(r"[A-Za-z0-9']+", text)]


def word_count(text):
    return len(_words(text))


def top_words(text, n):
    counts = Counter(_words(text))
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:n]
"""


def test_spec_hidden_tests_score_the_share_that_passes(tmp_path: Path):
    tasks = by_id(load_task_source(resolve_example("spec:example")))
    task = tasks["textstats"]
    workspace = workspace_of(task, tmp_path)
    assert not list(workspace.rglob("test_*.py"))  # the hidden tests stay hidden
    scaffold = graded(task, workspace)
    assert scaffold.score == 0.0
    assert "hidden tests: 0/4 pass" in scaffold.critique
    assert "NotImplementedError" in scaffold.critique
    package = workspace / "textstats" / "__init__.py"
    package.write_text(TEXTSTATS.replace("len(_words(text))", "len(_words(text)) + 1"))
    half = graded(task, workspace)  # word_count wrong, top_words right
    assert half.score == 0.5
    assert "not passing: tests/test_textstats.py::test_word_count_counts_words" in half.critique
    package.write_text(TEXTSTATS)
    assert graded(task, workspace).score == 1.0

    roman = tasks["roman"]  # score: all, its tests listed, an empty workspace
    workspace = workspace_of(roman, tmp_path)
    nothing = graded(roman, workspace)
    assert nothing.score == 0.0 and "ModuleNotFoundError" in nothing.critique
    # The module fails to import (one ERROR line): both listed tests count as failing.
    assert "hidden tests: 0/2 pass" in nothing.critique
    assert "not passing: tests/test_roman.py::test_round_trip" in nothing.critique


def test_spec_passes_an_evaluator_through_and_validates_it_as_a_task_s(tmp_path: Path):
    (tmp_path / "hidden").mkdir()
    judge = {"type": "exact_match", "expected": "ok", "file": "out.txt"}
    line = {"id": "s", "specification": "Write ok into out.txt.", "evaluator": judge}
    path = tmp_path / "spec.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (task,) = load_task_source(f"spec:{path}")
    assert task.evaluator == ExactMatchEvaluator(expected="ok", file="out.txt")
    path.write_text(json.dumps(dict(line, evaluator={"type": "judge"})) + "\n")
    with pytest.raises(TaskFileError, match=r"spec\.jsonl:1: field 'evaluator\.type': unknown"):
        load_task_source(f"spec:{path}")
    path.write_text(json.dumps({"id": "s", "specification": "x"}) + "\n")
    with pytest.raises(TaskFileError, match="give hidden_tests"):
        load_task_source(f"spec:{path}")
    both = {"id": "s", "specification": "x", "specification_file": "spec.md", "hidden_tests": "."}
    (tmp_path / "spec.md").write_text("y")
    path.write_text(json.dumps(both) + "\n")
    with pytest.raises(TaskFileError, match="exactly one of specification and specification_file"):
        load_task_source(f"spec:{path}")


def test_tests_that_cannot_start_give_no_assessment_not_a_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    (tmp_path / "hidden").mkdir()
    line = {"id": "s", "specification": "x", "hidden_tests": "hidden"}
    path = tmp_path / "spec.jsonl"
    path.write_text(json.dumps(dict(line, test_command=[str(tmp_path / "no-such-runner")])))
    (task,) = load_task_source(f"spec:{path}")
    attempt = asyncio.run(evaluate_once(task.evaluator, workspace_of(task, tmp_path / "ws")))
    assert not attempt.valid and attempt.score is None
    assert "cannot grade:" in attempt.critique and "no-such-runner" in attempt.critique
    assert grade_main(["sweep", "x"]) == 2 and "usage:" in capsys.readouterr().err


def test_the_test_report_reads_pytest_s_summary():
    report = TestReport.parse(
        "PASSED t.py::a\nFAILED t.py::b - AssertionError: 3 != 2\nERROR t.py::c - boom\n"
        "XFAIL t.py::d - reason\nPASSED t.py::e[x - y]\n"
    )
    assert report.failing(["t.py::a", "t.py::b", "t.py::c", "t.py::d", "t.py::z"]) == [
        "t.py::b",
        "t.py::c",
        "t.py::z",
    ]
    assert report.passed("t.py::e[x - y]")


# --------------------------------------------------------------------------- environments

#: The harness: copies what only the task's root holds into the workspace.
SEES_THE_ROOT = "import shutil; shutil.copy('/marker', 'seen.txt')"

#: Hidden tests that pass only inside the task's root, after the harness saw it there.
ROOT_TESTS = """def test_in_the_root():
    assert open("/marker").read() == "only-in-the-root\\n"


def test_the_harness_saw_it():
    assert open("seen.txt").read() == "only-in-the-root\\n"
"""
ROOT_TEST_IDS = [
    "tests/test_root.py::test_in_the_root",
    "tests/test_root.py::test_the_harness_saw_it",
]


def _root_patch() -> str:
    lines = ROOT_TESTS.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return (
        "diff --git a/tests/test_root.py b/tests/test_root.py\nnew file mode 100644\n"
        f"--- /dev/null\n+++ b/tests/test_root.py\n@@ -0,0 +1,{len(lines)} @@\n{body}"
    )


def environment_dataset(kind: str, data: Path, root: str) -> str:
    """A one-task dataset of format ``kind`` under ``data`` whose environment is the
    rootfs ``root`` (relative: to the dataset file, or the task directory), sharing the
    machine's toolchain and ``data`` (the grader reads its task back from there); the
    ``FORMAT:PATH`` naming it."""
    share = [*SHARE, str(data)]
    environment = {"type": "rootfs", "path": root, "share": share}
    if kind == "swe":
        line = swe_lines()["calc-median"]
        line.update(
            repository=str(example_path("swe").parent / "calc.bundle"),
            FAIL_TO_PASS=ROOT_TEST_IDS,
            PASS_TO_PASS=["tests/test_stats.py::test_mean"],
            test_patch=_root_patch(),
            environment=environment,
        )
        (data / "swe.jsonl").write_text(json.dumps(line) + "\n")
        return f"swe:{data / 'swe.jsonl'}"
    if kind == "spec":
        (data / "hidden").mkdir(exist_ok=True)
        (data / "hidden" / "test_root.py").write_text(ROOT_TESTS)
        line = {
            "id": "in-root",
            "specification": "Copy /marker into seen.txt.",
            "hidden_tests": "hidden",
            "tests": ROOT_TEST_IDS,
            "score": "all",
            "environment": environment,
        }
        (data / "spec.jsonl").write_text(json.dumps(line) + "\n")
        return f"spec:{data / 'spec.jsonl'}"
    assert kind == "terminal"
    task = data / "tasks" / "in-root"
    (task / "tests").mkdir(parents=True, exist_ok=True)
    (task / "instruction.md").write_text("Copy /marker into seen.txt.\n")
    (task / "tests" / "test.sh").write_text(
        'test "$(cat /marker)" = only-in-the-root || { echo "no marker"; exit 1; }\n'
        'test "$(cat seen.txt)" = only-in-the-root || { echo "not seen"; exit 1; }\n'
        "echo 'PASS: in the root'\n"
    )
    (task / "task.yaml").write_text(yaml.safe_dump({"environment": environment}))
    return f"terminal:{data / 'tasks'}"


def root_harness(tmp_path: Path) -> HarnessSpec:
    return HarnessSpec(
        command=(sys.executable, "-c", SEES_THE_ROOT),
        deadline_s=60,
        environment=EnvironmentOptions(cache=tmp_path / "cache"),
    )


@pytest.mark.parametrize(
    ("kind", "root"), [("swe", "root"), ("spec", "root"), ("terminal", "../../root")]
)
def test_each_format_runs_its_harness_and_its_tests_in_the_tasks_root(
    tmp_path: Path, kind: str, root: str
):
    try:
        sandbox("bwrap").check()
    except SandboxUnavailable as error:
        pytest.skip(str(error))
    data = tmp_path / "data"
    data.mkdir()
    make_root(data / "root")
    (task,) = load_task_source(environment_dataset(kind, data, root))
    assert task.environment == RootfsEnvironment(
        path=data / "root", share=(*SHARE, str(data))
    )  # the relative path resolved against the dataset file (the task directory)
    assert "environment" not in task.metadata
    result = execute(task, root_harness(tmp_path), tmp_path / "run")
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result
    workspace = tmp_path / "run" / "workspaces" / "ex_1"
    assert (workspace / "seen.txt").read_text() == "only-in-the-root\n"  # the harness saw it
    # The same grader on the machine, where there is no /marker: its tests fail.
    outside = graded(task, workspace)
    assert outside.score == 0.0
    logged = "no marker" if kind == "terminal" else "not passing: " + ROOT_TEST_IDS[0]
    assert logged in outside.critique


@pytest.mark.parametrize("kind", ["swe", "spec", "terminal"])
def test_a_broken_environment_of_each_format_is_a_placeholder_naming_it(tmp_path: Path, kind: str):
    data = tmp_path / "data"
    data.mkdir()
    (task,) = load_task_source(environment_dataset(kind, data, str(data / "gone")))
    result = execute(task, root_harness(tmp_path), tmp_path / "run")
    assert (result.outcome, result.reward, result.harness) == (Outcome.FAILED, 0.0, None)
    (placeholder,) = result.assessments
    assert placeholder.placeholder and placeholder.score == 0.0
    assert result.detail.startswith(f"environment rootfs {data / 'gone'}: ")
    assert "No such file or directory" in result.detail
    assert not (tmp_path / "run" / "workspaces").exists()  # nothing ran on the machine


def test_a_dataset_s_environment_is_validated_as_a_task_s(tmp_path: Path):
    line = swe_lines()["calc-median"]
    line["repository"] = str(example_path("swe").parent / "calc.bundle")
    path = tmp_path / "swe.jsonl"
    path.write_text(json.dumps(dict(line, environment={"image": "python:3.11-slim"})) + "\n")
    with pytest.raises(TaskFileError) as error:
        load_task_source(f"swe:{path}")
    assert str(error.value) == (
        f"{path}:1: field 'environment.type': missing (required; one of 'rootfs', 'image')"
    )
    spec = tmp_path / "spec.jsonl"
    spec.write_text(json.dumps({"id": "s", "specification": "x", "environment": "py"}) + "\n")
    with pytest.raises(
        TaskFileError, match=r"spec\.jsonl:1: field 'environment': should be a JSON"
    ):
        load_task_source(f"spec:{spec}")
    task = tmp_path / "tasks" / "t"
    (task / "tests").mkdir(parents=True)
    (task / "tests" / "test.sh").write_text("exit 0\n")
    (task / "task.yaml").write_text(
        "instruction: do it\nenvironment:\n  type: rootfs\n  path: root\n  share: [usr]\n"
    )
    with pytest.raises(TaskFileError) as error:
        load_task_source(f"terminal:{tmp_path / 'tasks'}")
    assert str(error.value) == (
        f"{task / 'task.yaml'}:2: field 'environment.share': 'usr' is not an absolute path"
    )
    # Terminal-Bench's own layouts: the image their Dockerfile builds.
    (task / "task.yaml").write_text("instruction: do it\n")
    (task / "Dockerfile").write_text("FROM ubuntu:24.04\n")  # Terminal-Bench 1
    (loaded,) = load_task_source(f"terminal:{tmp_path / 'tasks'}")
    assert loaded.environment == ImageEnvironment(build=task)
    (task / "environment").mkdir()  # Terminal-Bench 2: environment/Dockerfile
    with pytest.raises(TaskFileError, match=r"environment: no Dockerfile: give one, or task"):
        load_task_source(f"terminal:{tmp_path / 'tasks'}")
    (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\n")
    (loaded,) = load_task_source(f"terminal:{tmp_path / 'tasks'}")
    assert loaded.environment == ImageEnvironment(build=task / "environment")
    assert "environment" not in loaded.metadata
