"""Rollout routing replay (R3) for an MoE policy: the engine reports the experts of every
position, the proxy records them with the node's tokens and keeps them through the store,
and the trainer's forward routes each recorded position as the engine did."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.test_proxy_server import claude, start
from transformers import AutoModelForCausalLM

from qwengyre.config import TrainerConfig
from qwengyre.engines.base import GenerateRequest, GenerateResult, Joined, TokenDelta
from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.models.experts import RoutingRecorder, RoutingReplay, routers
from qwengyre.training.buffers import (
    BatchSummary,
    ExecutionSample,
    GroupSample,
    PackingBuffer,
    TrajectoryBuffer,
)
from qwengyre.training.distributed import CellComm
from qwengyre.training.trainer import Trainer
from qwengyre.trajectories import routed_experts
from qwengyre.trajectories.selection import materialise
from qwengyre.trajectories.tree import NodeMeta, TrajectoryTree
from qwengyre.types import SamplingParams


def hf_routing(model_dir: Path, ids: list[int]) -> np.ndarray:
    """The experts a plain transformers forward routes each position of ``ids`` to."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    recorder = RoutingRecorder(model)
    recorder.out = torch.zeros(len(ids), recorder.layers, recorder.k, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    return recorder.out.numpy()


def sample(
    model_dir: Path, prompts: list[tuple[int, ...]], max_tokens: int = 10, **engine_kw: bool
) -> list[GenerateResult]:
    """Samples of ``prompts`` from the embedded engine, all in one batch."""
    engine = EmbeddedEngine(model_dir, capacity=len(prompts), max_context=256, **engine_kw)

    async def run() -> list[GenerateResult]:
        return await asyncio.gather(
            *(
                engine.generate(GenerateRequest(f"r{i}", p, SamplingParams(max_tokens=max_tokens)))
                for i, p in enumerate(prompts)
            )
        )

    try:
        return asyncio.run(run())
    finally:
        engine.close()


PROMPTS = [tuple(range(20 + i, 31 + 5 * i)) for i in range(3)]  # 11, 16, 21 tokens


def test_the_embedded_engine_reports_the_experts_of_every_position(
    tiny_moe_model_dir: Path, tiny_model_dir: Path
) -> None:
    # Prompts of three lengths join one batch (left-padded prefill, batched decode).
    for prompt, result in zip(PROMPTS, sample(tiny_moe_model_dir, PROMPTS), strict=True):
        ids = list(prompt) + list(result.output_ids)
        assert result.routing is not None and result.routing.dtype == np.int8
        assert result.routing.shape == (len(ids) - 1, 2, 2)  # the last token was never input
        np.testing.assert_array_equal(result.routing, hf_routing(tiny_moe_model_dir, ids)[:-1])
    assert all(r.routing is None for r in sample(tiny_model_dir, PROMPTS[:1]))
    # engine.return_routed_experts=false: an MoE's engine records nothing.
    unasked = sample(tiny_moe_model_dir, PROMPTS[:1], routed_experts=False)
    assert unasked[0].output_ids and unasked[0].routing is None


def test_deltas_join_their_routing_and_one_without_drops_it() -> None:
    rows = np.arange(12, dtype=np.int8).reshape(6, 1, 2)
    joined = Joined()
    joined.add(TokenDelta((5,), (-0.5,), (0,), None, rows[:4]))  # a 4-token prompt
    joined.add(TokenDelta((6, 7), (-0.1, -0.2), (0, 0), "stop", rows[4:]))
    result = joined.result()
    assert result.output_ids == (5, 6, 7)
    assert result.routing is not None
    np.testing.assert_array_equal(result.routing, rows)
    joined.add(TokenDelta((8,), (-0.3,), (0,), None))  # a token with no routing
    assert joined.result().routing is None


def test_the_proxy_records_routing_before_each_token_and_the_store_keeps_it(
    tmp_path: Path, tiny_moe_model_dir: Path
) -> None:
    engine = EmbeddedEngine(tiny_moe_model_dir, capacity=2, max_context=512)
    gen = start(tmp_path, tiny_moe_model_dir, engines=[engine], max_resident=1)
    proxy = next(gen)
    try:
        ex = proxy.new_execution()
        client = claude(proxy, ex)
        messages: list[dict] = [{"role": "user", "content": "fix the bug"}]
        first = client.messages.create(model="tiny", max_tokens=8, messages=messages)
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": "and the test?"},
        ]
        client.messages.create(model="tiny", max_tokens=8, messages=messages)
        tree = proxy.server.residency.executions[ex["id"]].recorder.tree  # type: ignore[union-attr]
        root, child = tree.nodes
        assert child.parent == root.id  # the second call extends the first
        for node in tree.nodes:
            assert node.routing is not None
            assert node.routing.shape == (len(node.input_ids) + len(node.output_ids), 2, 2)
        assert (root.routing[0] == routed_experts.UNKNOWN).all()  # nothing predicts token 0
        # Along the trajectory the rows are the routing of a plain forward, shifted:
        # the row before token i is position i - 1's.
        trajectory = materialise(tree, child.id, frozenset({0, 1}))
        assert trajectory.routing is not None
        context = list(trajectory.input_ids)
        np.testing.assert_array_equal(
            trajectory.routing[1:], hf_routing(tiny_moe_model_dir, context)[:-1]
        )
        # Another execution crowds this one out of memory; it reloads from the store.
        other = proxy.new_execution()
        claude(proxy, other).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert proxy.server.residency.executions[ex["id"]].recorder is None
        reloaded = proxy.run(proxy.server.residency.tree(ex["id"]))
        assert reloaded.nodes == tree.nodes  # Node equality compares the routing too
        assert all(
            np.array_equal(a.routing, b.routing)  # type: ignore[arg-type]
            for a, b in zip(reloaded.nodes, tree.nodes, strict=True)
        )
        assert proxy.admin("GET", f"/admin/executions/{ex['id']}/tree").status_code == 200
    finally:
        gen.close()
        engine.close()


def strong_moe(source: Path, target: Path) -> Path:
    """The tiny MoE with experts that matter: its experts' weights scaled up so that
    which experts a token goes to changes its log-probs by more than rounding."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.mul_(12.0)
            elif name.endswith("mlp.gate.weight"):
                param.mul_(4.0)
    model.save_pretrained(target)
    for file in source.iterdir():
        if file.suffix in {".json", ".jinja", ".txt"} and not (target / file.name).exists():
            (target / file.name).write_bytes(file.read_bytes())
    return target


def micro_step(prompts: list[tuple[int, ...]], results: list[GenerateResult]):  # type: ignore[no-untyped-def]
    """One packed micro-step of one execution per sample, each a one-call tree."""
    executions = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        tree = TrajectoryTree()
        assert result.routing is not None
        routing = routed_experts.before_each_token(
            result.routing, 0, len(prompt) + len(result.output_ids)
        )
        meta = NodeMeta(
            request_class="main.task",
            agent_id="main",
            engine="e",
            policy_version=0,
            started_s=0.0,
            finished_s=0.0,
            finish_reason=result.finish_reason,
        )
        tree.add(None, prompt, result.output_ids, result.logprobs, result.versions, meta, routing)
        row = materialise(tree, 0, frozenset({0}))
        executions.append(ExecutionSample(f"e{i}", 1.0 if i % 2 else -1.0, (row,)))
    buffer = TrajectoryBuffer()
    buffer.add(GroupSample(0, 0, tuple(executions)))
    (micro,) = PackingBuffer(buffer, 4096).assign(0, [0], closes_batch=True)
    return micro


def routed(trainer: Trainer, micro) -> tuple[torch.Tensor, np.ndarray]:  # type: ignore[no-untyped-def]
    """(the current log-probs of ``micro``'s targets, the experts its forward used at
    each real position, by position)."""
    recorder = RoutingRecorder(trainer.model)  # hooked after the replay: sees its choice
    spans = [(s, e) for s, e in _spans(micro.position_ids)]
    longest = max(e - s for s, e in spans)
    recorder.out = torch.full((len(spans) * longest, recorder.layers, recorder.k), -1)
    try:
        with torch.no_grad():
            logprobs = trainer.current_logprobs(micro)
    finally:
        recorder.remove()
    batch = recorder.out.view(len(spans), longest, recorder.layers, recorder.k)
    used = torch.cat([batch[d, : e - s] for d, (s, e) in enumerate(spans)])
    return logprobs, used.numpy()


def _spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    from qwengyre.training.packed import document_spans

    return document_spans(position_ids)


def test_replay_routes_every_recorded_position_as_the_engine_did_after_the_weights_moved(
    tmp_path: Path, tiny_moe_model_dir: Path
) -> None:
    model_dir = strong_moe(tiny_moe_model_dir, tmp_path / "moe")
    results = sample(model_dir, PROMPTS, max_tokens=12)
    micro = micro_step(PROMPTS, results)
    assert micro.routing is not None and micro.routing.shape[1] == micro.num_tokens
    recorded = micro.routing[0].numpy()
    known = (recorded >= 0).all(-1)  # [positions, layers]: all but each document's last
    behaviour = micro.behaviour_logprobs[:, 1:][micro.target_mask[:, 1:]]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Trainer(model, TrainerConfig(lr=3e-2), CellComm(0, 1, ""))  # replay: on
    unrecorded = replace(micro, routing=None)  # as with trainer.routing_replay=false

    # At the engine's weights both forwards reproduce its log-probs and routing.
    for ms in (micro, unrecorded):
        logprobs, used = routed(trainer, ms)
        torch.testing.assert_close(logprobs, behaviour, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(np.sort(used, -1)[known], np.sort(recorded, -1)[known])

    # The weights move: three updates on these samples.
    summary = BatchSummary(
        step=0,
        group_ids=(0,),
        num_executions=3,
        num_target_tokens=micro.num_targets,
        num_micro_steps=1,
        num_tokens=micro.num_tokens,
    )
    first = trainer.train_micro_step(micro)
    assert first.routed == known.sum() and first.drifted == 0  # replayed, the same choice
    trainer.finish_batch(summary, 1)
    for _ in range(2):
        trainer.train_micro_step(micro)
        trainer.finish_batch(summary, 1)

    replayed, used_replay = routed(trainer, micro)
    free, used_free = routed(trainer, unrecorded)
    same = lambda used: (np.sort(used, -1) == np.sort(recorded, -1)).all(-1)[known]  # noqa: E731
    assert same(used_replay).all()  # every recorded position: the engine's experts
    moved = 1 - same(used_free).mean()
    assert moved > 0.05, moved  # the current router chooses otherwise for some
    assert trainer.scorer.replay is not None  # ... and the replay counts them
    trainer.current_logprobs(micro)
    routed_count, drifted = trainer.scorer.replay.counts()
    # Layer 0 sees the same input either way: its drift is exactly the free forward's
    # (a later layer's choice depends on the routing before it).
    differs = (np.sort(used_free, -1) != np.sort(recorded, -1)).any(-1) & known
    assert routed_count == known.sum() and differs[:, 0].sum() <= drifted <= routed_count
    assert drifted - differs[:, 0].sum() > 0

    # Replay off: the scorer has no replay, and a recorded micro-step scores as one
    # without (everything as for a dense model).
    off = Trainer(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        TrainerConfig(routing_replay=False),
        CellComm(0, 1, ""),
    )
    assert off.scorer.replay is None
    with torch.no_grad():
        torch.testing.assert_close(
            off.current_logprobs(micro), off.current_logprobs(unrecorded), rtol=0, atol=0
        )
    # Where routing differs, so do the log-probs: replay changed what the trainer scores.
    assert (replayed - free).abs().max() > 1e-3
    assert (replayed - behaviour).abs().max() > 0  # the weights did move


def test_replay_weights_the_recorded_experts_by_the_router_so_it_keeps_its_gradient(
    tiny_moe_model_dir: Path,
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32)
    (router, *_) = routers(model)
    replay = RoutingReplay(model)
    hidden = torch.randn(5, model.config.hidden_size)
    logits, scores, indices = router(hidden)
    recorded = torch.tensor([[0, 1], [2, 3], [3, 0], [-1, -1], [1, 2]])
    replay.routing = torch.stack([recorded, recorded], dim=1)  # both layers
    _, weights, chosen = router(hidden)
    assert chosen[:3].tolist() == recorded[:3].tolist() and chosen[4].tolist() == [1, 2]
    assert chosen[3].tolist() == indices[3].tolist()  # unknown: the router's own
    torch.testing.assert_close(weights[3], scores[3])
    probs = torch.softmax(logits, -1).gather(-1, chosen)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))
    weights.sum().backward()  # the renormalised weights' sum is 1: use a weighted one
    router.weight.grad = None
    _, weights, _ = router(hidden)
    (weights[:, 0] * torch.arange(5.0)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    replay.routing = None
    assert router(hidden)[2].tolist() == indices.tolist()
    replay.remove()


def test_a_dense_model_has_no_router_and_a_foreign_router_is_named() -> None:
    assert routers(torch.nn.Linear(2, 2)) == []

    class DeepseekV3TopkRouter(torch.nn.Module):
        pass

    holder = torch.nn.Sequential(DeepseekV3TopkRouter())
    with pytest.raises(ValueError, match="DeepseekV3TopkRouter"):
        routers(holder)
