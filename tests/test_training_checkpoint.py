"""Tests for atomic, resumable, sharded training checkpoints (qwengyre.training.checkpoint).

The save/prune/discovery tests write a small file per checkpoint; the round trip and
the export use one real single-process Trainer, trained two steps and saved once.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from tests.training_data import groups
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from qwengyre.config import TrainerConfig
from qwengyre.training import checkpoint as ckpt_mod
from qwengyre.training.buffers import BatchSummary, MicroStep, PackingBuffer, TrajectoryBuffer
from qwengyre.training.checkpoint import (
    LATEST_FILE,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStateError,
    export_model,
    latest_checkpoint,
    list_checkpoints,
    load_sharded,
    read_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)
from qwengyre.training.distributed import CellComm
from qwengyre.training.trainer import Trainer

_IDS = torch.tensor([[5, 17, 300, 42, 9, 800, 3, 77, 1000, 12, 64, 500]])
_CONFIG = TrainerConfig(lr=1e-2, micro_step_tokens=256)


def _writer(content: str) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        (directory / "weights").mkdir()
        (directory / "weights" / "w.bin").write_text(content)

    return write


def _save(root: Path, step: int, *, state: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """A checkpoint whose only content is ``weights/w.bin`` = ``"step {step}"``."""
    state = {"step": step} if state is None else state
    return save_checkpoint(root, step=step, write=_writer(f"step {step}"), state=state, keep=keep)


# --------------------------------------------------------------------------- save, prune, find


def test_save_writes_state_and_manifest_and_read_returns_them(tmp_path: Path) -> None:
    state = {"version": 2, "scheduler": {"dispatched": 12, "cells": [0, 1]}, "note": None}
    path = _save(tmp_path, 2, state=state)
    assert path == tmp_path / "step-000002"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.json", "weights"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["format"], manifest["step"]) == (2, 2)
    assert manifest["qwengyre_version"] and "created" in manifest
    assert set(manifest["files"]) == {"state.json", "weights/w.bin"}
    ckpt = read_checkpoint(path)  # every file checked against the manifest
    assert (ckpt.path, ckpt.step, ckpt.state) == (path, 2, state)
    assert ckpt.model_dir == path / "model"


def test_latest_points_to_newest_and_keep_prunes(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "absent") is None
    for step in (1, 2, 3):
        path = _save(tmp_path, step)
        assert latest_checkpoint(tmp_path) == path
        assert (tmp_path / LATEST_FILE).read_text().strip() == path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002", "step-000003"]
    assert list_checkpoints(tmp_path) == [tmp_path / "step-000002", tmp_path / "step-000003"]

    _save(tmp_path, 4, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004"]


def test_latest_falls_back_when_pointer_missing_or_corrupt(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    (tmp_path / LATEST_FILE).write_text("garbage/../../etc\n")
    assert latest_checkpoint(tmp_path) == newest
    (tmp_path / LATEST_FILE).unlink()
    assert latest_checkpoint(tmp_path) == newest
    # A step dir whose manifest is broken is not complete: fall back past it.
    (tmp_path / LATEST_FILE).write_text("step-000002\n")
    (newest / "manifest.json").write_text("{not json")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"


def test_crash_on_final_rename_keeps_previous_and_next_save_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _save(tmp_path, 1, state={"v": 1})
    real_replace = os.replace

    def crashing_replace(src: Any, dst: Any) -> None:
        if Path(dst).name.startswith("step-"):
            raise OSError("simulated crash during rename")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", crashing_replace)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, 2, state={"v": 2})
    monkeypatch.undo()
    # A hard crash would not run the cleanup: leave a half-written temp dir behind too.
    stale = tmp_path / ".tmp-step-000002-dead"
    (stale / "weights").mkdir(parents=True)
    (stale / "state.json").write_text('{"v": 2}')
    (tmp_path / ".tmp-latest-dead").write_text("step-000002\n")

    assert latest_checkpoint(tmp_path) == first
    assert list_checkpoints(tmp_path) == [first]
    assert read_checkpoint(first).state == {"v": 1}
    assert (first / "weights" / "w.bin").read_text() == "step 1"

    second = _save(tmp_path, 2, state={"v": 2})
    assert latest_checkpoint(tmp_path) == second
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert read_checkpoint(second).state == {"v": 2}


def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 1, state={"v": "old"})
    path = save_checkpoint(tmp_path, step=1, write=_writer("new"), state={"v": "new"})
    assert read_checkpoint(path).state == {"v": "new"}
    assert (path / "weights" / "w.bin").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]


def test_resuming_from_older_step_drops_abandoned_newer_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=3)
    # Resume from step 1 and save step 2 again: step 3 belongs to the abandoned run.
    path = _save(tmp_path, 2, keep=3)
    assert latest_checkpoint(tmp_path) == path
    assert list_checkpoints(tmp_path) == [tmp_path / "step-000001", path]


def test_corrupt_file_is_detected_with_its_name(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    weights = path / "weights" / "w.bin"
    weights.write_text("step 9")  # same size, different content
    with pytest.raises(CheckpointCorruptError, match=r"w\.bin is corrupt: sha256"):
        read_checkpoint(path)
    read_checkpoint(path, verify=False)  # sizes only: they still match

    weights.write_text("short")
    with pytest.raises(CheckpointCorruptError, match=r"w\.bin is corrupt: 5 bytes"):
        read_checkpoint(path, verify=False)
    weights.unlink()
    with pytest.raises(CheckpointCorruptError, match=r"w\.bin is missing"):
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
    tmp_path: Path, state: dict[str, Any], named: str
) -> None:
    def write(directory: Path) -> None:
        raise AssertionError("write() must not be called for a refused state")

    root = tmp_path / "ckpts"
    with pytest.raises(CheckpointStateError, match=named):
        save_checkpoint(root, step=1, write=write, state=state)
    assert not root.exists()
    # With a previous checkpoint present, it stays latest and nothing else appears.
    first = _save(root, 1)
    with pytest.raises(TypeError, match=named):
        save_checkpoint(root, step=2, write=write, state=state)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert latest_checkpoint(root) == first


def test_bad_arguments_and_non_checkpoints_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        save_checkpoint(tmp_path, step=-1, write=_writer(""), state={})
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        save_checkpoint(tmp_path, step=2, write=_writer(""), state={}, keep=0)
    assert not any(tmp_path.iterdir())
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        read_checkpoint(tmp_path)


# --------------------------------------------------------------------------- sharded trainer


def _trainer(model_dir: Path) -> Trainer:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return Trainer(model, _CONFIG, CellComm(0, 1, ""))


def _full(value: Any) -> Any:
    """A copy of ``value``, whole (a one-rank ``full_tensor()`` may share storage)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in trainer.model.state_dict().items()}


def _optimizer(trainer: Trainer) -> dict[str, Any]:
    """The optimizer's state by parameter name (full tensors) and its param groups."""
    assert trainer.optimizer is not None
    optim: Any = get_state_dict(trainer.model, trainer.optimizer)[1]
    state = {name: {k: _full(v) for k, v in s.items()} for name, s in optim["state"].items()}
    return {"state": state, "param_groups": copy.deepcopy(optim["param_groups"])}


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _step(trainer: Trainer, micro: list[MicroStep], summary: BatchSummary) -> None:
    for ms in micro:
        trainer.train_micro_step(ms)
    trainer.finish_batch(summary, 1)


@dataclass(frozen=True)
class Trained:
    """A trainer after two steps, saved at step 2; what it held then and after a third."""

    path: Path
    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    next_micro: list[MicroStep]
    next_summary: BatchSummary
    params_after_next: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trajectories = TrajectoryBuffer()
    for group in groups(model, count=6, size=2, seed=7):
        trajectories.add(group)
    packing = PackingBuffer(trajectories, _CONFIG.micro_step_tokens)
    batches = []
    for step in range(3):
        micro = packing.assign(step, trajectories.ready_ids()[:2], closes_batch=True)
        batches.append((micro, packing.summary(step)))

    trainer = _trainer(tiny_model_dir)
    for micro, summary in batches[:2]:
        _step(trainer, micro, summary)
    assert trainer.version == 2
    root = tmp_path_factory.mktemp("trained")
    path = save_sharded_checkpoint(
        root, step=2, trainer=trainer, state={"version": 2}, keep=2, model_dir=tiny_model_dir
    )
    params, optimizer = _params(trainer), _optimizer(trainer)
    _step(trainer, *batches[2])
    return Trained(Path(path), params, optimizer, *batches[2], _params(trainer))


def test_sharded_round_trip_restores_params_and_optimizer_and_continues_identically(
    tiny_model_dir: Path, trained: Trained
) -> None:
    path = trained.path
    assert path.name == "step-000002"
    assert {"weights", "model"} <= {p.name for p in path.iterdir()}
    assert (path / "model" / "config.json").is_file()
    assert not list((path / "model").glob("*.safetensors"))  # weights live in weights/ only
    read_checkpoint(path)  # every file checked against the manifest
    manifest = json.loads((path / "manifest.json").read_text())
    assert any(name.startswith("weights/") for name in manifest["files"])

    fresh = _trainer(tiny_model_dir)
    embed = "model.embed_tokens.weight"
    assert not torch.equal(_params(fresh)[embed], trained.params[embed])  # untrained
    assert load_sharded(path, fresh) == {"version": 2}
    assert fresh.version == 2
    _assert_same(_params(fresh), trained.params)
    optimizer = _optimizer(fresh)
    _assert_same(optimizer, trained.optimizer)
    assert optimizer["state"][embed]["exp_avg_sq"].abs().sum() > 0  # real moments restored

    # One more identical step keeps them identical (Adam moments and step counts restored).
    _step(fresh, trained.next_micro, trained.next_summary)
    assert fresh.version == 3
    _assert_same(_params(fresh), trained.params_after_next)


def test_load_refuses_corrupt_and_format_1_checkpoints_before_loading(
    tmp_path: Path, tiny_model_dir: Path, trained: Trained
) -> None:
    fresh = _trainer(tiny_model_dir)
    before = _params(fresh)

    corrupt = shutil.copytree(trained.path, tmp_path / "step-000002")
    (shard,) = (corrupt / "weights").glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=rf"{shard.name} is corrupt: sha256"):
        load_sharded(corrupt, fresh)

    # Format 1 (whole HF weights + optimizer.pt, no weights/): named, not resumed.
    def format_1(directory: Path) -> None:
        (directory / "model").mkdir()
        (directory / "model" / "model.safetensors").write_bytes(b"old")
        (directory / "optimizer.pt").write_bytes(b"old")

    old = save_checkpoint(tmp_path / "old", step=1, write=format_1, state={"version": 1})
    with pytest.raises(CheckpointError, match=r"has no weights/ \(a format-1 checkpoint"):
        load_sharded(old, fresh)
    with pytest.raises(CheckpointError, match=r"has no weights/"):
        export_model(old, tmp_path / "export")

    _assert_same(_params(fresh), before)  # nothing was loaded
    assert fresh.version == 0


# --------------------------------------------------------------------------- export


def _hf_model(model_dir: Path, params: dict[str, torch.Tensor]) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(params, strict=True)
    return model.eval()


def _logits(model: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_IDS).logits.float()


def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(
    tmp_path: Path, tiny_model_dir: Path, trained: Trained
) -> None:
    out = export_model(trained.path, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.dtype == torch.float32
    # The tie survives: one tensor serves as embedding and lm_head, stored once.
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert set(index["weight_map"]) == set(trained.params) - {"lm_head.weight"}
    _assert_same({k: v.detach() for k, v in exported.state_dict().items()}, trained.params)
    torch.testing.assert_close(
        _logits(exported), _logits(_hf_model(tiny_model_dir, trained.params)), rtol=0, atol=0
    )

    tokenizer, reloaded = (
        AutoTokenizer.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(out),
    )
    text = "def f(x):\n    return x + 1"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.chat_template == tokenizer.chat_template

    # A non-empty directory is refused: a stale model.safetensors would win over the index.
    with pytest.raises(CheckpointError, match="must be empty or absent"):
        export_model(trained.path, out)


def test_bfloat16_export_in_several_files_with_a_correct_index(
    tmp_path: Path, trained: Trained
) -> None:
    shard_bytes = 100_000
    out = export_model(trained.path, tmp_path / "hf", dtype="bfloat16", shard_bytes=shard_bytes)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    total = 0
    for name in files:
        with safetensors.safe_open(out / name, framework="pt") as f:
            keys = set(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
        assert keys == {k for k, v in index["weight_map"].items() if v == name}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert nbytes <= shard_bytes or len(keys) == 1
        for key, tensor in tensors.items():
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, trained.params[key].to(torch.bfloat16)), key
        total += nbytes
    assert index["metadata"]["total_size"] == total

    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16"):
        export_model(trained.path, tmp_path / "other", dtype="int8")


def test_a_moe_export_stores_each_expert_as_qwen_does_and_gives_the_trained_logits(
    tmp_path: Path, tiny_moe_model_dir: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32)
    trajectories = TrajectoryBuffer()
    for group in groups(model, count=2, size=2, seed=3):
        trajectories.add(group)
    packing = PackingBuffer(trajectories, _CONFIG.micro_step_tokens)
    trainer = _trainer(tiny_moe_model_dir)
    _step(trainer, packing.assign(0, [0, 1], closes_batch=True), packing.summary(0))
    trained = _params(trainer)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert trained[fused].dim() == 3  # in memory (and in weights/): one tensor per layer
    root = tmp_path / "ckpt"
    state = {"version": 1}
    path = save_sharded_checkpoint(
        root, step=1, trainer=trainer, state=state, keep=1, model_dir=tiny_moe_model_dir
    )

    # Several files, so an expert tensor's file holds all it splits into.
    out = export_model(path, tmp_path / "hf", shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    with safetensors.safe_open(tiny_moe_model_dir / "model.safetensors", framework="pt") as f:
        built = set(f.keys())
    assert set(index["weight_map"]) == built  # the keys save_pretrained wrote: per expert
    up = "model.layers.0.mlp.experts.3.up_proj.weight"  # the second half of [gate; up]
    with safetensors.safe_open(out / index["weight_map"][up], framework="pt") as f:
        half = trained[fused].shape[1] // 2
        assert torch.equal(f.get_tensor(up), trained[fused][3, half:])
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    _assert_same({k: v.detach() for k, v in exported.state_dict().items()}, trained)
    torch.testing.assert_close(
        _logits(exported), _logits(_hf_model(tiny_moe_model_dir, trained)), rtol=0, atol=0
    )
    untrained = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir).eval()
    assert not torch.equal(_logits(exported), _logits(untrained))
