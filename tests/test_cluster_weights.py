"""Weights in shared memory: the core writes, other processes read a consistent copy."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

from qwengyre.cluster.weights import (
    BoardShards,
    SharedWeights,
    board_name,
    layout_of,
    model_parameters,
    shard_layout,
)
from qwengyre.engines.base import GenerateRequest, StaleWeights
from qwengyre.engines.embedded import EmbeddedEngine, behaviour_logprobs
from qwengyre.models import cached_tiny_model
from qwengyre.models.saved_form import saved_form
from qwengyre.training.sharding import shard_rows
from qwengyre.types import SamplingParams


def named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(7, 5, generator=g)),
        ("norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("head.bias", torch.randn(3, generator=g)),
    ]


def _read_in_child(name: str, queue: mp.Queue) -> None:
    board = SharedWeights(name, layout_of(named(0)))
    version, tensors = board.read()
    queue.put((version, {k: v.float().sum().item() for k, v in tensors.items()}))
    board.close()


def test_write_then_read_in_another_process() -> None:
    name = f"qg-test-{uuid.uuid4().hex[:12]}"
    board = SharedWeights(name, layout_of(named(0)), create=True)
    try:
        assert board.version == -1
        board.write(named(1), version=3)
        context = mp.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_read_in_child, args=(name, queue))
        child.start()
        version, sums = queue.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0 and version == 3
        for key, tensor in named(1):
            assert sums[key] == pytest.approx(tensor.float().sum().item(), rel=1e-6)
        # The reader's exit did not unlink the segment: the owner can still use it.
        board.write(named(2), version=4)
        version, tensors = board.read()
        assert version == 4 and torch.equal(tensors["embed.weight"], named(2)[0][1])
        assert tensors["norm.weight"].dtype == torch.bfloat16
    finally:
        board.close()


OWNER_AND_READER = """
import multiprocessing as mp, sys
sys.path.insert(0, {tests!r})
from test_cluster_weights import _read_in_child, named
from qwengyre.cluster.weights import SharedWeights, layout_of
if __name__ == "__main__":
    board = SharedWeights({name!r}, layout_of(named(0)), create=True)
    board.write(named(1), version=3)
    context = mp.get_context("spawn")  # as the cells are: the child shares the tracker
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=({name!r}, queue))
    child.start()
    print(queue.get(timeout=60)[0])
    child.join(60)
    board.close()
"""


def test_a_board_read_in_a_spawned_process_ends_without_a_trace(tmp_path: Path) -> None:
    """The owner and a reader it spawned share one resource tracker: the segment is
    unlinked once, by the owner, and the tracker prints nothing (it printed a KeyError
    traceback at the end of every run)."""
    name = f"qg-test-{uuid.uuid4().hex[:12]}"
    script = OWNER_AND_READER.format(tests=str(Path(__file__).parent), name=name)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.split() == ["3"], done.stderr
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr, done.stderr
    assert not (Path("/dev/shm") / name).exists()


def test_an_incomplete_write_and_a_wrong_architecture_are_refused() -> None:
    name = f"qg-test-{uuid.uuid4().hex[:12]}"
    board = SharedWeights(name, layout_of(named(0)), create=True)
    try:
        board.write(named(1), version=1)
        with pytest.raises(ValueError, match="missing tensors"):
            board.write(named(2)[:2], version=2)
        version, tensors = board.read(timeout_s=1.0)  # the refused write changed nothing
        assert version == 1 and torch.equal(tensors["head.bias"], named(1)[2][1])
        bigger = [("embed.weight", torch.zeros(70, 50))]
        with pytest.raises(ValueError, match="same architecture"):
            SharedWeights(name, layout_of(bigger))
    finally:
        board.close()


@contextlib.contextmanager
def published(full: Sequence[tuple[str, torch.Tensor]], version: int) -> Iterator[BoardShards]:
    """The core's two ranks each write their dim-0 chunk of ``full`` to their board; yields
    the boards read as one model, opened as the core's own (attaching in the creating
    process would unregister them)."""
    base = f"qg-test-{uuid.uuid4().hex[:12]}"
    written: list[SharedWeights] = []
    try:
        for r in range(2):
            board = SharedWeights(board_name(base, r), shard_layout(full, 2, r), create=True)
            chunk = [(n, t.narrow(0, *shard_rows(t.shape[0], 2, r))) for n, t in full]
            board.write(chunk, version=version)
            written.append(board)
        yield BoardShards("shared_memory", base, full, 2, opened=dict(enumerate(written)))
    finally:
        for board in written:
            board.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_boards_write_one_safetensors_file_shard_by_shard(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    full = named(3)
    with published(full, version=4) as boards:
        path = tmp_path / "model.safetensors"
        boards.write_safetensors(4, path, dtype)
        loaded = safetensors.torch.load_file(str(path))
        assert list(loaded) == [n for n, _ in full]
        for name, tensor in full:
            assert loaded[name].dtype == dtype
            torch.testing.assert_close(loaded[name], tensor.to(dtype), rtol=0, atol=0)
        with pytest.raises(StaleWeights, match="not 5"):
            boards.write_safetensors(5, path, dtype)


class Recorded:
    """A board that notes which names each read asked for."""

    def __init__(self, board: SharedWeights, shard: int, reads: list[tuple[int, list[str]]]):
        self.board, self.shard, self.reads = board, shard, reads

    def read(self, names: Sequence[str] | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        self.reads.append((self.shard, sorted(names or [])))
        return self.board.read(names)

    def __getattr__(self, attr: str) -> object:
        return getattr(self.board, attr)


def test_sharded_boards_give_whole_tensors_a_few_names_at_a_time() -> None:
    full = named(3)
    with published(full, version=4) as boards:
        source = boards.by_name(4)
        assert {n: (m.shape, m.dtype, m.device.type) for n, m in source.meta.items()} == {
            n: (t.shape, t.dtype, "meta") for n, t in full
        }
        # Only what is named is read: one board read each, a bucket's worth of rows.
        reads: list[tuple[int, list[str]]] = []
        boards.boards = [Recorded(board, r, reads) for r, board in enumerate(boards.boards)]
        whole = source.read(["head.bias", "norm.weight"])
        assert reads == [(0, ["head.bias", "norm.weight"]), (1, ["head.bias", "norm.weight"])]
        assert list(whole) == ["head.bias", "norm.weight"]
        for name, tensor in full[1:]:
            assert torch.equal(whole[name], tensor) and whole[name].dtype == tensor.dtype
        assert torch.equal(source.read(["embed.weight"])["embed.weight"], full[0][1])
        with pytest.raises(ValueError, match=r"hold no tensor \['lm_head.weight'\]"):
            source.read(["lm_head.weight"])
        boards.boards[1].board.write(
            [(n, t.narrow(0, *shard_rows(t.shape[0], 2, 1))) for n, t in full], 5
        )
        with pytest.raises(StaleWeights, match="shard 1 holds version 5, not 4"):
            source.read(["head.bias"])


def test_an_untied_lm_head_goes_through_the_boards_to_the_engine_and_to_disk(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The boards hold ``lm_head.weight`` only for an untied model (a tied one lists the
    shared matrix once, as the embedding); both the embedded engine and the safetensors
    file a server engine loads take the new head."""
    assert "lm_head.weight" not in dict(model_parameters(tiny_model_dir))
    model_dir = cached_tiny_model("test", cache_dir=tiny_model_dir.parent, tie_embeddings=False)
    engine = EmbeddedEngine(model_dir, capacity=2, max_context=128)
    try:
        new = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        layout = {n: t.shape for n, t in model_parameters(model_dir)}  # what a cell publishes
        assert layout == {n: t.shape for n, t in new.items()} and "lm_head.weight" in layout
        head = torch.randn(new["lm_head.weight"].shape, generator=torch.Generator().manual_seed(5))
        new["lm_head.weight"] = head * 0.1  # only the output layer changes
        on_disk = tmp_path / "v1"
        shutil.copytree(model_dir, on_disk, ignore=shutil.ignore_patterns("*.safetensors"))
        with published(list(new.items()), version=1) as boards:
            asyncio.run(engine.update_weights(boards.source(1), version=1))
            boards.write_safetensors(1, on_disk / "model.safetensors", torch.float32)
        embed = engine.model.get_input_embeddings().weight
        assert torch.equal(engine.model.lm_head.weight, new["lm_head.weight"])
        assert torch.equal(embed, new["model.embed_tokens.weight"])
        reference = AutoModelForCausalLM.from_pretrained(on_disk).eval()
        assert torch.equal(reference.lm_head.weight, new["lm_head.weight"])

        prompt = [5, 17, 300, 42, 7]
        request = GenerateRequest("untied", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        result = asyncio.run(engine.generate(request))
        assert result.versions == (1,) * 8
        ids = torch.tensor([[*prompt, *result.output_ids]])
        output = ids[0, len(prompt) :]
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1 : -1]
            old_logits = AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits[0]
        served = torch.tensor(result.logprobs)
        expected = behaviour_logprobs(logits, output, 1.0)
        torch.testing.assert_close(served, expected, rtol=0, atol=1e-4)
        old = behaviour_logprobs(old_logits[len(prompt) - 1 : -1], output, 1.0)
        assert (served - old).abs().max() > 0.1  # the new head is what changed them
    finally:
        engine.close()


def test_an_moe_goes_to_disk_from_the_boards_with_its_experts_one_by_one(
    tmp_path: Path, tiny_moe_model_dir: Path
) -> None:
    """A server engine's weights file of an MoE holds each expert apart under the names
    Qwen's checkpoints use (what vLLM and SGLang load), with the boards' weights; a dense
    model needs no conversion."""
    assert saved_form(cached_tiny_model("test", cache_dir=tiny_moe_model_dir.parent)) is None
    to_saved = saved_form(tiny_moe_model_dir)
    assert to_saved is not None
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir)
    g = torch.Generator().manual_seed(2)
    new = {
        n: p.detach() + 0.01 * torch.randn(p.shape, generator=g)
        for n, p in model.named_parameters()
    }
    layout = {n: t.shape for n, t in model_parameters(tiny_moe_model_dir)}  # what a cell publishes
    assert layout == {n: t.shape for n, t in new.items()}
    on_disk = tmp_path / "v1"
    shutil.copytree(tiny_moe_model_dir, on_disk, ignore=shutil.ignore_patterns("*.safetensors"))
    with published(list(new.items()), version=1) as boards:
        boards.write_safetensors(1, on_disk / "model.safetensors", torch.float32, to_saved)
        with pytest.raises(StaleWeights, match="not 2"):
            boards.write_safetensors(2, tmp_path / "stale.safetensors", torch.float32, to_saved)
    written = safetensors.torch.load_file(str(on_disk / "model.safetensors"))
    built = safetensors.torch.load_file(str(tiny_moe_model_dir / "model.safetensors"))
    assert written.keys() == built.keys()  # per expert, as save_pretrained wrote them
    fused = new["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(written["model.layers.1.mlp.experts.2.down_proj.weight"], fused[2])
    reloaded = AutoModelForCausalLM.from_pretrained(on_disk)
    for name, tensor in reloaded.named_parameters():
        assert torch.equal(tensor, new[name]), name
