"""A step with no learning signal (nothing packed: every advantage zero) is shown as such
in the live view, the step log, the HTML report, and the run summary warns when a run
learned nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console
from tests.params import make_params

from qwengyre.records.metrics import RunRecord, StepRecord, read_metrics
from qwengyre.report.html import learning_signal_warning, summarize, write_report
from qwengyre.runtime import display
from qwengyre.scheduler.core import Scheduler
from qwengyre.scheduler.events import Start


def _step(step: int, reward: float = 0.0, tokens: int = 0, micro_steps: int = 0) -> StepRecord:
    return StepRecord(
        time_s=5.0 * (step + 1),
        step=step,
        version=step + 1,
        reward_mean=reward,
        reward_std=0.0 if not tokens else 0.2,
        rewards=8,
        loss=0.0,
        clipped_fraction=0.0,
        grad_norm=0.0,
        tokens=tokens,
        micro_steps=micro_steps,
        cells=1,
        train_s=0.5,
        staleness_mean=1.0,
    )


DEAD = [_step(s) for s in range(4)]  # the measured failure: reward 0, nothing trained
LEARNING = [_step(s, 0.1 * s, tokens=900, micro_steps=2) for s in range(4)]


def test_the_step_record_says_whether_it_had_a_learning_signal():
    assert not DEAD[0].learning_signal and LEARNING[0].learning_signal
    assert not _step(0, tokens=10, micro_steps=0).learning_signal
    assert "learning_signal" not in json.loads(DEAD[0].to_json())  # derived, not stored


def test_the_warning_names_how_many_steps_had_none_and_what_to_check():
    dead = learning_signal_warning(DEAD)
    assert dead is not None and "\n" not in dead
    assert dead.startswith("the reward never moved (0.000 in all 4 steps); 4 of 4 steps")
    assert "every advantage was zero" in dead and "warm_start.json" in dead
    assert "warm_start.accuracy" in dead
    assert learning_signal_warning(LEARNING) is None
    assert learning_signal_warning([]) is None
    # Some steps without a signal while the reward moves: no warning.
    assert learning_signal_warning([*LEARNING, _step(4, 0.3)]) is None
    # The reward never moved although steps trained: warned, counting those without.
    flat = [dataclasses.replace(s, reward_mean=0.5) for s in LEARNING] + [_step(4, 0.5)]
    text = learning_signal_warning(flat)
    assert text is not None and "1 of 5 steps had no learning signal (steps 4)" in text
    one = learning_signal_warning(DEAD[:1])
    assert one is not None and one.startswith("no step had a learning signal (none of 1)")


def _controller(records: list[StepRecord]) -> Any:
    # A real scheduler with a standalone pool, started: its executions are launched.
    params = make_params(cells=2, cell_capacity=4, standalone_capacity=2, batch=1, group_size=2)
    scheduler = Scheduler(params)
    scheduler.handle(Start(0.0))
    return SimpleNamespace(
        scheduler=scheduler,
        observer=SimpleNamespace(step_records=records),
        config=SimpleNamespace(run=SimpleNamespace(steps=32)),
        now=lambda: 12.0,
    )


def _text(renderable: Any) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(renderable)
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()


def test_the_live_view_marks_a_step_with_no_learning_signal():
    dead = _text(display.render(_controller([LEARNING[0], DEAD[1]])))
    assert re.search(r"standalone pool\W+2 / 2 running", dead)  # launched there first
    assert "learning signal" in dead
    assert "no learning signal: nothing packed, all advantages zero" in dead
    assert "1 of 2 steps had none so far" in dead
    alive = _text(display.render(_controller(LEARNING[:2])))
    assert "900 tokens, 2 micro-steps (every step so far)" in alive
    assert "no learning signal" not in alive


def test_the_step_log_marks_a_step_with_no_learning_signal():
    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None, force_terminal=False)
    controller = _controller([LEARNING[0], DEAD[1]])

    async def log_for_a_while() -> None:
        task = asyncio.create_task(display.show(controller, console))
        await asyncio.sleep(1.3)
        task.cancel()

    asyncio.run(log_for_a_while())
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "NO LEARNING SIGNAL" not in lines[0]
    assert lines[1].startswith("step 1: reward 0.000")
    assert lines[1].endswith(
        "; NO LEARNING SIGNAL (0 tokens, 0 micro-steps: every advantage was zero)"
    )


def _write(run_dir: Path, steps: list[StepRecord]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [
        RunRecord(
            time_s=0.0,
            policy="elastic",
            mu=1,
            phi=0.0,
            cells=3,
            predicted_staleness=1.0,
            group_size=8,
            batch=4,
        ),
        *steps,
    ]
    (run_dir / "metrics.jsonl").write_text("".join(r.to_json() + "\n" for r in records))


def test_the_report_warns_and_counts_the_steps_with_no_learning_signal(tmp_path: Path):
    _write(tmp_path / "dead", DEAD)
    page = write_report(tmp_path / "dead").read_text()
    assert "id='no-learning-signal'" in page and "the reward never moved" in page
    assert "<th>steps with no learning signal</th><td class='num'>4 of 4</td>" in page
    assert summarize(read_metrics(tmp_path / "dead" / "metrics.jsonl")).no_signal_steps == [
        0,
        1,
        2,
        3,
    ]
    _write(tmp_path / "mixed", [*LEARNING, _step(4, 0.2), _step(5, 0.4, 900, 2)])
    page = write_report(tmp_path / "mixed").read_text()
    assert "id='no-learning-signal'" not in page
    assert "<td class='num'>1 of 6 (steps 4)</td>" in page
    assert (tmp_path / "mixed" / "report" / "reward.png").stat().st_size > 0


def test_the_train_summary_warns_when_the_run_learned_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    from qwengyre.apps import train as train_module
    from qwengyre.cli import main

    steps = list(DEAD)

    async def fake_train(options: train_module.TrainOptions) -> Any:
        _write(options.run_dir, steps)
        return SimpleNamespace(observer=SimpleNamespace(step_records=steps), config=options.config)

    monkeypatch.setattr(train_module, "train", fake_train)
    assert main(["train", "--run-dir", str(tmp_path / "dead"), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert (
        "4 steps in 20 s; reward 0.000 (first step) -> 0.000 (last step) (chance on the "
        "bundled parity task: 0.5); 4 of 4 steps" in out
    )
    assert out.startswith(f"run {tmp_path / 'dead'}: config, metrics")  # said first
    assert err.startswith("qwengyre: warning: the reward never moved (0.000 in all 4 steps)")
    assert len(err.strip().splitlines()) == 1 and str(tmp_path / "dead") in err
    steps[:] = LEARNING
    assert main(["train", "--run-dir", str(tmp_path / "ok"), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "0 of 4 steps had no learning signal" in out and "warning" not in err
