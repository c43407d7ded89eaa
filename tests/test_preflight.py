"""Preflight (qwengyre.apps.preflight): a run's mistakes are found before anything
expensive starts, each as one line naming the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qwengyre.apps.preflight import preflight
from qwengyre.config import Config, load_config
from qwengyre.presets import preset_path
from qwengyre.rollout.tasks import ExactMatchEvaluator, Task, dump_tasks


def config(*overrides: str) -> Config:
    return load_config(preset_path("embedded"), ["harness.sandbox=none", *overrides])


def check(*overrides: str) -> str:
    """The one-line error preflight gives ``overrides``."""
    with pytest.raises(ValueError) as raised:
        preflight(config(*overrides), warn=lambda line: None)
    message = str(raised.value)
    assert "\n" not in message, message
    return message


def test_a_good_config_passes_and_gives_what_it_checked(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    evaluator = ExactMatchEvaluator(expected="1", file="answer.txt")
    dump_tasks(tasks, [Task(id="t", instructions="Say 1.", evaluator=evaluator)])
    checked = preflight(config(f"harness.tasks={tasks}"), warn=lambda line: None)
    assert [t.id for t in checked.tasks] == ["t"]
    assert checked.harness.command[0] == sys.executable  # the toy harness


def test_a_bad_tasks_file_is_named_with_its_line(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    task = Task(id="a", instructions="x", evaluator=ExactMatchEvaluator(expected="1", file="a"))
    dump_tasks(tasks, [task])
    tasks.write_text(tasks.read_text() + "{oops\n")
    assert f"{tasks}:2" in check(f"harness.tasks={tasks}")


def test_a_misspelled_harness_names_the_ones_there_are() -> None:
    message = check("harness.name=claud-code")
    assert "'claud-code'" in message and "claude-code" in message


def test_a_harness_program_that_is_not_there_is_named_with_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QWENGYRE_CLAUDE_BIN", "/nonexistent/claude")
    message = check("harness.name=claude-code")
    assert "'/nonexistent/claude'" in message and "npm install -g" in message
    assert "'no-such-agent'" in check("harness.name=no-such-agent {instructions}")


def test_an_engine_that_is_not_installed_says_how_to_make_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QWENGYRE_VLLM_PYTHON", sys.executable)  # a python without vLLM
    message = check("engine.backend=vllm")
    assert "cannot import 'vllm'" in message and "scripts/vllm_venv.sh" in message


def test_a_gpu_that_is_not_there_is_refused() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    message = check("run.device=cuda")
    assert "run.device is 'cuda'" in message and "run.device=cpu" in message


def test_ray_that_is_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray: ImportError
    assert "pip install 'qwengyre[ray]'" in check("run.placement=ray")


def test_train_stops_before_the_warm_start_and_leaves_its_directory_reusable(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "qwengyre", "train", "--quiet", "--run-dir", str(run_dir)]
    done = subprocess.run(
        [*command, "harness.name=claud-code"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("qwengyre: error: harness 'claud-code'"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    # Nothing was started or written: no warm start, no config; the directory takes
    # the corrected run (here, only as far as its own preflight).
    assert {p.name for p in run_dir.iterdir()} <= {".qwengyre.lock"}
    again = subprocess.run(
        [*command, "harness.name=no-such-agent {instructions}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "is not empty" not in again.stderr and "'no-such-agent'" in again.stderr
