"""Tests for atomic, resumable training checkpoints (qwengyre.training.checkpoint)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from qwengyre.training import checkpoint as ckpt_mod
from qwengyre.training.checkpoint import (
    LATEST_FILE,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStateError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

_IDS = torch.tensor([[5, 17, 300, 42, 9, 800, 3, 77, 1000, 12, 64, 500]])


def _load(model_dir: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    return model


def _adam(model: PreTrainedModel) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _step(model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    loss = model(input_ids=_IDS, labels=_IDS).loss
    loss.backward()
    optimizer.step()


def _assert_same_params(a: PreTrainedModel, b: PreTrainedModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for idx, entry in sa["state"].items():
        for name, value in entry.items():
            other = sb["state"][idx][name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (idx, name)
            else:
                assert value == other, (idx, name)


@pytest.fixture(scope="module")
def _trained_once(tiny_model_dir: Path) -> tuple[PreTrainedModel, dict[str, Any]]:
    model = _load(tiny_model_dir)
    optimizer = _adam(model)
    for _ in range(2):
        _step(model, optimizer)
    return model, optimizer.state_dict()


@pytest.fixture
def trained(
    _trained_once: tuple[PreTrainedModel, dict[str, Any]],
) -> tuple[PreTrainedModel, torch.optim.Optimizer]:
    """A model and AdamW optimizer after two steps (non-trivial moments); a private copy."""
    model = copy.deepcopy(_trained_once[0])  # deepcopy keeps the lm_head/embedding tie
    assert model.lm_head.weight is model.model.embed_tokens.weight
    optimizer = _adam(model)
    optimizer.load_state_dict(copy.deepcopy(_trained_once[1]))
    return model, optimizer


def _save(root: Path, step: int, model: PreTrainedModel, **kw: Any) -> Path:
    kw.setdefault("optimizer", None)
    kw.setdefault("state", {"step": step})
    return save_checkpoint(root, step=step, model=model, **kw)


def test_roundtrip_restores_params_optimizer_and_state(
    tmp_path: Path, tiny_model_dir: Path, trained: tuple[PreTrainedModel, torch.optim.Optimizer]
) -> None:
    model, optimizer = trained
    state = {
        "policy_version": 2,
        "step": 2,
        "scheduler": {"dispatched": 12, "waterlevel": 3, "cells": [0, 1]},
        "lr": 1e-2,
        "note": None,
    }
    path = save_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer, state=state)
    assert path == tmp_path / "step-000002"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "model",
        "optimizer.pt",
        "state.json",
    ]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 2
    assert manifest["qwengyre_version"]
    assert "created" in manifest
    assert {"state.json", "optimizer.pt", "model/model.safetensors"} <= set(manifest["files"])

    fresh = _load(tiny_model_dir)  # the untrained initial weights
    assert not torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)
    fresh_opt = _adam(fresh)
    loaded_state = load_checkpoint(path, fresh, fresh_opt)

    assert loaded_state == state
    _assert_same_params(model, fresh)
    # The tie survives loading in place: lm_head still shares the embedding.
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    _assert_same_optimizer(optimizer, fresh_opt)

    # One more identical step on both keeps them identical (Adam moments restored).
    _step(model, optimizer)
    _step(fresh, fresh_opt)
    _assert_same_params(model, fresh)

    ckpt = read_checkpoint(path)
    assert (ckpt.path, ckpt.step, ckpt.state) == (path, 2, state)
    assert ckpt.model_dir == path / "model"


def test_model_dir_loads_with_from_pretrained(
    tmp_path: Path, tiny_model_dir: Path, trained: tuple[PreTrainedModel, torch.optim.Optimizer]
) -> None:
    model, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = _save(tmp_path, 7, model, tokenizer=tokenizer)
    assert not (path / "optimizer.pt").exists()

    reloaded = AutoModelForCausalLM.from_pretrained(path / "model")
    reloaded.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=_IDS).logits, model(input_ids=_IDS).logits, rtol=0, atol=0
        )
    tok2 = AutoTokenizer.from_pretrained(path / "model")
    text = "def f(x):\n    return x + 1"
    assert tok2(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert tok2.chat_template == tokenizer.chat_template


def test_latest_points_to_newest_and_keep_prunes(
    tmp_path: Path, trained: tuple[PreTrainedModel, torch.optim.Optimizer]
) -> None:
    model, optimizer = trained
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "absent") is None
    for step in (1, 2, 3):
        path = _save(tmp_path, step, model, optimizer=optimizer)
        assert latest_checkpoint(tmp_path) == path
        assert (tmp_path / LATEST_FILE).read_text().strip() == path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002", "step-000003"]
    assert list_checkpoints(tmp_path) == [tmp_path / "step-000002", tmp_path / "step-000003"]

    _save(tmp_path, 4, model, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004"]


def test_latest_falls_back_when_pointer_missing_or_corrupt(
    tmp_path: Path, trained: tuple[PreTrainedModel, torch.optim.Optimizer]
) -> None:
    model, _ = trained
    _save(tmp_path, 1, model)
    newest = _save(tmp_path, 2, model)
    (tmp_path / LATEST_FILE).write_text("garbage/../../etc\n")
    assert latest_checkpoint(tmp_path) == newest
    (tmp_path / LATEST_FILE).unlink()
    assert latest_checkpoint(tmp_path) == newest
    # A step dir whose manifest is broken is not complete: fall back past it.
    (tmp_path / LATEST_FILE).write_text("step-000002\n")
    (newest / "manifest.json").write_text("{not json")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"


def test_crash_on_final_rename_keeps_previous_and_next_save_cleans_up(
    tmp_path: Path,
    tiny_model_dir: Path,
    trained: tuple[PreTrainedModel, torch.optim.Optimizer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, optimizer = trained
    first = _save(tmp_path, 1, model, optimizer=optimizer, state={"v": 1})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, optimizer)

    real_replace = os.replace

    def crashing_replace(src: Any, dst: Any) -> None:
        if Path(dst).name.startswith("step-"):
            raise OSError("simulated crash during rename")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", crashing_replace)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, 2, model, optimizer=optimizer, state={"v": 2})
    monkeypatch.undo()
    # A hard crash would not run the cleanup: leave a half-written temp dir behind too.
    stale = tmp_path / ".tmp-step-000002-dead"
    (stale / "model").mkdir(parents=True)
    (stale / "state.json").write_text('{"v": 2}')
    (tmp_path / ".tmp-latest-dead").write_text("step-000002\n")

    assert latest_checkpoint(tmp_path) == first
    assert list_checkpoints(tmp_path) == [first]
    fresh = _load(tiny_model_dir)
    assert load_checkpoint(first, fresh, _adam(fresh)) == {"v": 1}
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key

    second = _save(tmp_path, 2, model, optimizer=optimizer, state={"v": 2})
    assert latest_checkpoint(tmp_path) == second
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert read_checkpoint(second).state == {"v": 2}


def test_resave_same_step_replaces_it(
    tmp_path: Path, trained: tuple[PreTrainedModel, torch.optim.Optimizer]
) -> None:
    model, _ = trained
    _save(tmp_path, 1, model, state={"v": "old"})
    path = _save(tmp_path, 1, model, state={"v": "new"})
    assert read_checkpoint(path).state == {"v": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]


def test_resuming_from_older_step_drops_abandoned_newer_checkpoints(
    tmp_path: Path, trained: tuple[PreTrainedModel, torch.optim.Optimizer]
) -> None:
    model, _ = trained
    for step in (1, 2, 3):
        _save(tmp_path, step, model, keep=3)
    # Resume from step 1 and save step 2 again: step 3 belongs to the abandoned run.
    path = _save(tmp_path, 2, model, keep=3)
    assert latest_checkpoint(tmp_path) == path
    assert list_checkpoints(tmp_path) == [tmp_path / "step-000001", path]


def test_corrupt_file_is_detected_with_its_name(
    tmp_path: Path, tiny_model_dir: Path, trained: tuple[PreTrainedModel, torch.optim.Optimizer]
) -> None:
    model, optimizer = trained
    path = _save(tmp_path, 3, model, optimizer=optimizer)
    weights = path / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(data))

    fresh = _load(tiny_model_dir)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors.*sha256"):
        load_checkpoint(path, fresh, _adam(fresh))
    with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors"):
        verify_checkpoint(path)
    for key, value in fresh.state_dict().items():  # nothing was loaded
        assert torch.equal(value, before[key]), key

    (path / "optimizer.pt").write_bytes(b"short")
    with pytest.raises(CheckpointCorruptError, match=r"optimizer\.pt.*5 bytes"):
        read_checkpoint(path, verify=False)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"optimizer\.pt is missing"):
        read_checkpoint(path, verify=False)


@pytest.mark.parametrize(
    ("state", "named"),
    [
        (
            {"scheduler": {"groups": [1, {"t": object()}]}},
            r"state\['scheduler'\]\['groups'\]\[1\]\['t'\] is a builtins.object",
        ),
        ({"buffer": torch.zeros(2)}, r"\['buffer'\].*torch.*Tensor"),
        ({"loss": float("nan")}, r"\['loss'\].*NaN"),
        ({"by_version": {3: "x"}}, r"\['by_version'\].*non-string key 3"),
        ({"ids": {1, 2}}, r"\['ids'\].*set"),
    ],
)
def test_non_json_state_is_refused_and_nothing_written(
    tmp_path: Path,
    trained: tuple[PreTrainedModel, torch.optim.Optimizer],
    state: dict[str, Any],
    named: str,
) -> None:
    model, optimizer = trained
    root = tmp_path / "ckpts"
    with pytest.raises(CheckpointStateError, match=named):
        save_checkpoint(root, step=1, model=model, optimizer=optimizer, state=state)
    assert not root.exists()
    # With a previous checkpoint present, it stays latest and nothing else appears.
    first = _save(root, 1, model)
    with pytest.raises(TypeError, match=named):
        save_checkpoint(root, step=2, model=model, optimizer=optimizer, state=state)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert latest_checkpoint(root) == first


def test_load_errors_are_clear(
    tmp_path: Path, tiny_model_dir: Path, trained: tuple[PreTrainedModel, torch.optim.Optimizer]
) -> None:
    model, _ = trained
    path = _save(tmp_path, 1, model)  # no optimizer saved
    fresh = _load(tiny_model_dir)
    with pytest.raises(CheckpointError, match=r"no optimizer\.pt"):
        load_checkpoint(path, fresh, _adam(fresh))
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        load_checkpoint(tmp_path, fresh)
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, step=-1, model=model, optimizer=None, state={})
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, step=2, model=model, optimizer=None, state={}, keep=0)
