"""Metric sinks: TensorBoard event files (read back), W&B (offline), the fan-out."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from qwengyre.config import ConfigError, load_config
from qwengyre.records.metrics import (
    GroupRecord,
    LoadRecord,
    MetricsWriter,
    Record,
    RoleRecord,
    RunRecord,
    StepRecord,
    SwitchRecord,
    UsageRecord,
    read_metrics,
)
from qwengyre.report import sinks as sinks_module
from qwengyre.report.sinks import ScalarStream, check_metrics, open_metrics, wandb_mode


def _run() -> RunRecord:
    return RunRecord(
        time_s=0.0,
        policy="elastic",
        mu=3,
        phi=0.5,
        cells=3,
        predicted_staleness=1.5,
        group_size=8,
        batch=4,
    )


def _step(step: int, time_s: float, reward: float, staleness: float) -> StepRecord:
    return StepRecord(
        time_s=time_s,
        step=step,
        version=step + 1,
        reward_mean=reward,
        reward_std=0.1,
        rewards=8,
        loss=0.25,
        clipped_fraction=0.125,
        grad_norm=2.0,
        tokens=1000,
        micro_steps=2,
        cells=2,
        train_s=4.0,
        staleness_mean=staleness,
        micro_step_s=0.5,
        update_s=0.1,
    )


def _records() -> list[Record]:
    return [
        _run(),
        RoleRecord(0.0, 0, "rollout"),
        RoleRecord(0.0, 1, "rollout"),
        RoleRecord(0.0, 2, "rollout"),
        LoadRecord(time_s=1.0, running=10, queued=5, capacity=16),
        RoleRecord(5.0, 0, "to_training"),
        SwitchRecord(time_s=6.0, cell=0, to="training", seconds=1.0),
        RoleRecord(6.0, 0, "training"),
        _step(0, 10.0, 0.25, 1.0),
        GroupRecord(
            time_s=10.0,
            group_id=0,
            dispatch_version=0,
            step=0,
            staleness=0,
            execution_staleness=0.0,
        ),
        RoleRecord(11.0, 1, "training"),
        _step(1, 15.0, 0.5, 2.0),
        SwitchRecord(time_s=16.0, cell=0, to="rollout", seconds=0.5),
        RoleRecord(16.0, 0, "rollout"),
        UsageRecord(16.0, 0, 12.0, 4.0),
    ]


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def test_tensorboard_event_files_hold_the_run_scalars(tmp_path: Path):
    config = load_config()
    with open_metrics(tmp_path, config) as writer:
        assert [s.name for s in writer.sinks] == ["tensorboard"]
        for record in _records():
            writer.write(record)
    assert len(read_metrics(tmp_path)) == len(_records())
    scalars = _scalars(tmp_path / "tensorboard")

    def values(tag: str) -> list[tuple[int, float]]:
        return [(step, pytest.approx(value)) for step, value, _ in scalars[tag]]

    assert values("step/reward_mean") == [(0, 0.25), (1, 0.5)]
    assert values("step/loss") == [(0, 0.25), (1, 0.25)]
    assert values("step/clipped_fraction") == [(0, 0.125), (1, 0.125)]
    assert values("step/grad_norm") == [(0, 2.0), (1, 2.0)]
    # Staleness against Eq 2's prediction from the run record.
    assert values("staleness/measured") == [(0, 1.0), (1, 2.0)]
    assert values("staleness/predicted") == [(0, 1.5), (1, 1.5)]
    assert values("staleness/excess") == [(0, -0.5), (1, 0.5)]
    # tokens/s: over the wall time since the previous step (the run record at 0 s).
    assert values("throughput/tokens_per_s") == [(0, 100.0), (1, 200.0)]
    assert values("throughput/train_tokens_per_s") == [(0, 250.0), (1, 250.0)]
    # Per-cell roles (1 training, 0.5 switching, 0 rollout) and the counts.
    assert [v for _, v in values("cell/0/role")] == [0.0, 0.5, 1.0, 0.0]
    assert [v for _, v in values("cells/training")] == [0, 0, 0, 0, 1, 2, 1]
    assert values("switch/to_training_s") == [(0, 1.0)]
    assert values("switch/to_rollout_s") == [(1, 0.5)]  # logged at the latest step
    assert values("load/queued") == [(0, 5.0)]
    assert values("group/staleness") == [(0, 0.0)]
    assert values("cell/0/busy_fraction") == [(1, 0.75)]
    assert values("run/predicted_staleness") == [(0, 1.5)]
    # Wall times follow the run's clock: the second step 15 s after the run record.
    (run_wall,) = [wall for _, _, wall in scalars["run/mu"]]
    assert [round(w - run_wall, 3) for _, _, w in scalars["step/reward_mean"]] == [10.0, 15.0]


def test_a_resumed_run_logs_its_first_records_at_the_step_it_resumed_from(tmp_path: Path):
    with open_metrics(tmp_path, load_config(), step=7) as writer:
        writer.write(_run())
        writer.write(RoleRecord(0.0, 1, "rollout"))
        writer.write(_step(7, 3.0, 0.5, 1.0))
    scalars = _scalars(tmp_path / "tensorboard")
    assert [s for s, _, _ in scalars["cell/1/role"]] == [7]
    assert [s for s, _, _ in scalars["step/reward_mean"]] == [7]


def test_scalar_stream_skips_what_is_not_finite_and_names_the_standalone_pool():
    stream = ScalarStream()
    values = stream.scalars(_step(0, 0.0, float("nan"), 1.0))  # no run record yet
    assert "step/reward_mean" not in values and "staleness/predicted" not in values
    assert "throughput/tokens_per_s" not in values  # no previous time
    assert stream.scalars(RoleRecord(1.0, -1, "training"))["cell/standalone/role"] == 1.0
    assert stream.step_of(LoadRecord(time_s=2.0, running=1, queued=1, capacity=1)) == 0


def test_metrics_tensorboard_false_writes_no_event_files(tmp_path: Path):
    with open_metrics(tmp_path, load_config(None, ["metrics.tensorboard=false"])) as writer:
        writer.write(_run())
        assert writer.sinks == ()
    assert not (tmp_path / "tensorboard").exists()


def test_a_live_run_refuses_to_start_without_tensorboard(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sinks_module, "tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        check_metrics(load_config())
    check_metrics(load_config(None, ["metrics.tensorboard=false"]))


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.closed = False

    def write(self, record: Record) -> None:
        raise RuntimeError("disk full")

    def close(self) -> None:
        self.closed = True


def test_a_failing_sink_is_dropped_and_the_log_stays_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    broken = _Broken()
    with MetricsWriter(tmp_path / "m.jsonl", sinks=[broken]) as writer:
        writer.write(_run())
        writer.write(_step(0, 1.0, 0.5, 1.0))
        assert writer.sinks == ()
    assert broken.closed
    assert len(read_metrics(tmp_path / "m.jsonl")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics sink broken failed (RuntimeError: disk full)" in err


def test_wandb_configured_but_not_installed_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    config = load_config(None, ["metrics.wandb_project=qwengyre-test"])
    with pytest.raises(ConfigError, match=r"pip install 'qwengyre\[wandb\]'"):
        open_metrics(tmp_path, config)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_mode_config_then_environment_then_offline():
    settings = load_config().metrics
    assert wandb_mode(settings, {}) == "offline"
    assert wandb_mode(settings, {"WANDB_MODE": "disabled"}) == "disabled"
    online = load_config(None, ["metrics.wandb_mode=online"]).metrics
    assert wandb_mode(online, {"WANDB_MODE": "offline"}) == "online"


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None,
    reason="wandb is an optional extra (pip install 'qwengyre[wandb]') and is not installed",
)
def test_wandb_offline_run_gets_the_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    config = load_config(None, ["metrics.wandb_project=qwengyre-test", "metrics.tensorboard=false"])
    with open_metrics(run_dir, config) as writer:
        (sink,) = writer.sinks
        assert sink.name == "wandb"
        run: Any = sink.run  # type: ignore[attr-defined]
        assert run.name == "run" and run.config["groups"]["size"] == config.groups.size
        for record in _records():
            writer.write(record)
        assert run.config["run"]["predicted_staleness"] == 1.5
        summary = dict(run.summary)  # step 0's row is committed once step 1 began
        assert summary["step/reward_mean"] == 0.25 and summary["staleness/predicted"] == 1.5
    (history,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 10  # wandb's service writes the file out after finish()
    while b"cells/training" not in history.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)
    data = history.read_bytes()
    assert b"staleness/measured" in data and b"cells/training" in data
