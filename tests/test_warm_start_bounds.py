"""The warm start is bounded by steps and measured accuracy, never by the clock, uses the
configured torch threads, and fails loudly when it cannot reach its target."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import qwengyre.models
from qwengyre.apps import warm_start as ws
from qwengyre.apps.train import base_model
from qwengyre.config import ConfigError, WarmStartConfig, load_config

SHORT: dict[str, Any] = {"batch_size": 2, "answer_batch": 4, "eval_size": 2}


def test_config_bounds_the_warm_start_by_steps():
    assert load_config().warm_start.max_steps == 250  # 3.5x what the default needs
    assert not [k for k in WarmStartConfig.model_fields if k.endswith("_s")]
    with pytest.raises(ConfigError, match=r"warm_start\.max_steps=0"):
        load_config(overrides=["warm_start.max_steps=0"])


def test_no_clock_limit_a_slow_machine_only_takes_longer(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Every clock reading is an hour later than the last: it still trains to the target."""
    ticks = iter(range(0, 10**9, 3600))
    clock = SimpleNamespace(monotonic=lambda: float(next(ticks)))
    monkeypatch.setattr(ws, "time", clock)  # warm_start's clock only
    measured = iter([0.0, 0.0, 0.5])
    monkeypatch.setattr(ws, "_episode_score", lambda *args: next(measured))
    result = ws.warm_start(
        tiny_model_dir, tmp_path / "w", target_accuracy=0.5, max_steps=10, eval_every=1, **SHORT
    )
    assert result.reached and result.steps == 3 and result.seconds > 3 * 3600


def test_short_of_the_target_within_its_steps_it_raises_and_saves_no_model(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    threads_seen: list[int] = []

    def score(*args: Any) -> float:
        threads_seen.append(torch.get_num_threads())
        return 0.125

    monkeypatch.setattr(ws, "_episode_score", score)
    before = torch.get_num_threads()
    out = tmp_path / "w"
    with pytest.raises(ws.WarmStartError) as err:
        ws.warm_start(
            tiny_model_dir,
            out,
            target_accuracy=0.25,
            max_steps=3,
            eval_every=2,
            threads=1,
            advice="do X",
            **SHORT,
        )
    message = str(err.value)
    assert "\n" not in message
    assert "target accuracy 0.25 within 3 steps" in message
    assert "measured 0.12 after 3 steps" in message and message.endswith("; do X")
    assert err.value.result.steps == 3 and not err.value.result.reached
    assert [h[0] for h in err.value.result.history] == [2, 3]
    assert threads_seen == [1, 1] and torch.get_num_threads() == before
    assert not (out / "config.json").exists()  # a resumed run must not start from it
    record = json.loads((out / "warm_start.json").read_text())
    assert record["reached"] is False and record["max_steps"] == 3 and record["threads"] == 1


def test_base_model_passes_the_step_bound_and_threads_and_says_what_to_change(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(qwengyre.models, "cached_tiny_model", lambda size: tiny_model_dir)
    calls: list[dict[str, Any]] = []
    real = ws.warm_start

    def spy(model_dir: Path, out_dir: Path, **kw: Any) -> ws.WarmStartResult:
        calls.append(kw)
        return real(model_dir, out_dir, eval_every=1, **{**kw, **SHORT})

    monkeypatch.setattr(ws, "warm_start", spy)
    monkeypatch.setattr(ws, "_episode_score", lambda *args: 0.0)
    config = load_config(
        overrides=[
            "warm_start.max_steps=2",
            "warm_start.accuracy=0.3",
            "run.torch_threads=1",
        ]
    )
    logs: list[str] = []
    with pytest.raises(ws.WarmStartError) as err:
        base_model(config, tmp_path, logs.append)
    assert calls[0]["max_steps"] == 2 and calls[0]["threads"] == 1
    assert "max_seconds" not in calls[0]
    message = str(err.value)
    assert re.search(r"measured 0\.00 after 2 steps", message)
    for hint in ("raise warm_start.max_steps (now 2)", "warm_start.accuracy (now 0.3)"):
        assert hint in message
    assert "model.path=DIR" in message
    assert "at most 2 steps, 1 torch threads" in logs[0]
    assert not (tmp_path / "warm_start" / "config.json").exists()
