"""Streaming training buffers: trajectory buffer, packing into micro-steps, claim queue."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from qwengyre.training.buffers import (
    BatchSummary,
    ExecutionSample,
    GroupSample,
    MicroStep,
    MicroStepQueue,
    PackingBuffer,
    TrajectoryBuffer,
)
from qwengyre.trajectories.selection import AdmittedTrajectory, admit_execution
from qwengyre.trajectories.tree import NodeMeta, TrajectoryTree

_tokens = itertools.count(1)


def trajectory(
    n_in: int, n_out: int, execution_id: str = "", *, first_target: bool = False
) -> AdmittedTrajectory:
    """A row of ``n_in`` injected then ``n_out`` sampled tokens, all ids unique."""
    ids = tuple(next(_tokens) for _ in range(n_in + n_out))
    mask = (first_target,) * min(n_in, 1) + (False,) * (n_in - 1) + (True,) * n_out
    logprobs = tuple(-(i % 97 + 1) / 100 if m else 0.0 for i, m in zip(ids, mask, strict=True))
    return AdmittedTrajectory(
        leaf=0,
        request_class="main.task",
        nodes=(0,),
        input_ids=ids,
        target_mask=mask,
        behaviour_logprobs=logprobs,
        versions=tuple(0 if m else -1 for m in mask),
        execution_id=execution_id,
    )


def execution(eid: str, lengths: list[int], advantage: float = 1.0) -> ExecutionSample:
    """An execution whose trajectories have the given lengths (a quarter injected)."""
    trajs = tuple(trajectory(max(1, n // 4), n - max(1, n // 4), eid) for n in lengths)
    return ExecutionSample(eid, advantage, trajs)


def group(gid: int, version: int, executions: list[ExecutionSample]) -> GroupSample:
    return GroupSample(gid, version, tuple(executions))


def unpack(ms: MicroStep) -> list[dict[str, list]]:
    """Split a packed row into its trajectories at the position_ids resets."""
    pos = ms.position_ids[0].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    assert pos == [p for a, b in itertools.pairwise(starts) for p in range(b - a)]
    rows = []
    for a, b in itertools.pairwise(starts):
        traj = set(ms.trajectory_index[0, a:b].tolist())
        execs = set(ms.execution_index[0, a:b].tolist())
        assert len(traj) == 1 and len(execs) == 1
        rows.append(
            {
                "input_ids": ms.input_ids[0, a:b].tolist(),
                "target_mask": ms.target_mask[0, a:b].tolist(),
                "behaviour_logprobs": ms.behaviour_logprobs[0, a:b],
                "execution_id": ms.execution_ids[execs.pop()],
            }
        )
    assert len(set(ms.trajectory_index[0].tolist())) == len(rows)
    return rows


def check_micro_steps(micro_steps: list[MicroStep], groups: list[GroupSample], budget: int) -> None:
    """Rows reproduce every trajectory with gradient exactly once, executions unsplit."""
    expected = {
        e.execution_id: e for g in groups for e in g.executions if e.advantage and e.num_targets
    }
    group_of = {e.execution_id: g.group_id for g in groups for e in g.executions}
    seen: dict[str, int] = {}
    targets: Counter[int] = Counter()
    for ms in micro_steps:
        assert ms.input_ids.shape == ms.target_mask.shape == (1, ms.num_tokens)
        assert ms.input_ids.dtype == ms.position_ids.dtype == torch.long
        assert ms.target_mask.dtype == torch.bool
        assert ms.behaviour_logprobs.dtype == ms.advantages.dtype == torch.float32
        assert ms.advantages.shape == (len(ms.execution_ids),)
        assert ms.group_ids == tuple(dict.fromkeys(group_of[e] for e in ms.execution_ids))
        if ms.num_tokens > budget:
            assert len(ms.execution_ids) == 1
        rows = unpack(ms)
        for k, eid in enumerate(ms.execution_ids):
            assert eid not in seen, f"execution {eid} split across micro-steps"
            seen[eid] = ms.index
            assert ms.advantages[k].item() == pytest.approx(expected[eid].advantage)
            mine = [r for r in rows if r["execution_id"] == eid]
            assert len(mine) == len(expected[eid].trajectories)
            for row, t in zip(mine, expected[eid].trajectories, strict=True):
                assert row["input_ids"] == list(t.input_ids)
                assert row["target_mask"] == [False, *t.target_mask[1:]]
                logprobs = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
                assert torch.equal(row["behaviour_logprobs"], logprobs)
                mask = row["target_mask"]
                targets.update(tok for tok, m in zip(t.input_ids, mask, strict=True) if m)
        all_targets = ms.input_ids[ms.target_mask].tolist()
        assert ms.num_targets == len(all_targets)
    assert set(seen) == set(expected)
    sampled = {
        tok
        for e in expected.values()
        for t in e.trajectories
        for tok, m in zip(t.input_ids[1:], t.target_mask[1:], strict=True)
        if m
    }
    assert set(targets) == sampled and set(targets.values()) <= {1}


def run_batch(
    packer: PackingBuffer, step: int, group_ids: list[int], per_call: int = 1
) -> list[MicroStep]:
    out: list[MicroStep] = []
    chunks = [group_ids[i : i + per_call] for i in range(0, len(group_ids), per_call)]
    for k, chunk in enumerate(chunks):
        out += packer.assign(step, chunk, closes_batch=k == len(chunks) - 1)
    assert [ms.index for ms in out] == list(range(len(out)))
    return out


# --- packing ---------------------------------------------------------------------------


def _meta(cls: str = "main.task") -> NodeMeta:
    return NodeMeta(
        request_class=cls,
        agent_id="main",
        engine="e",
        policy_version=0,
        started_s=0.0,
        finished_s=1.0,
        finish_reason="stop",
    )


def _tree_execution(eid: str, advantage: float, seed: int) -> ExecutionSample:
    """A branching tree (shared prefix, a sub-agent, a compaction) admitted as in rollout."""
    tree = TrajectoryTree()

    def node(parent: int | None, n_in: int, n_out: int, cls: str = "main.task") -> int:
        ins = tuple(next(_tokens) for _ in range(n_in))
        outs = tuple(next(_tokens) for _ in range(n_out))
        logprobs = tuple(-(k + 1) / 50 for k in range(n_out))
        return tree.add(parent, ins, outs, logprobs, (3,) * n_out, _meta(cls)).id

    a = node(None, 5, 4)
    b = node(a, 2, 3)
    node(b, 1, 6)
    node(a, 3, 2)
    node(None, 7, 3, "sub.task")
    trajs = admit_execution(tree, eid, advantage, j_max=5, rng=random.Random(seed))
    return ExecutionSample(eid, advantage, tuple(trajs))


def test_tree_executions_pack_into_rows_that_unpack_exactly():
    groups = [
        group(g, 0, [_tree_execution(f"g{g}e{i}", (-1) ** i * (i + 1) / 4, i) for i in range(4)])
        for g in range(3)
    ]
    tb = TrajectoryBuffer()
    for g in groups:
        tb.add(g)
    packer = PackingBuffer(tb, tokens_per_micro_step=64)
    micro_steps = run_batch(packer, 0, [0, 1, 2])
    check_micro_steps(micro_steps, groups, 64)
    # a token shared by two admitted trajectories is a target once (selection's rule)
    summary = packer.summary(0)
    assert summary.num_target_tokens == sum(e.num_targets for g in groups for e in g.executions)
    assert summary.num_tokens == sum(ms.num_tokens for ms in micro_steps)
    assert summary.num_micro_steps == len(micro_steps)
    assert summary.num_executions == 12 and summary.group_ids == (0, 1, 2)


def test_a_first_token_marked_target_is_dropped():
    t = trajectory(0, 5, "e", first_target=True)
    assert t.target_mask[0]
    ex = ExecutionSample("e", 1.0, (t, trajectory(2, 3, "e")))
    assert ex.num_targets == 4 + 3
    tb = TrajectoryBuffer()
    tb.add(group(0, 0, [ex]))
    (ms,) = PackingBuffer(tb, 100).assign(0, [0], closes_batch=True)
    expected = [False, True, True, True, True, False, False, True, True, True]
    assert ms.target_mask[0].tolist() == expected
    assert ms.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert ms.trajectory_index[0].tolist() == [0] * 5 + [1] * 5
    assert ms.num_targets == 7


def _realistic_groups(seed: int, n_groups: int = 32, n_exec: int = 8) -> list[GroupSample]:
    """Lognormal trajectory lengths with a long tail, 1-5 trajectories per execution."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        executions = []
        for e in range(n_exec):
            lengths = rng.lognormal(np.log(100), 1.0, size=int(rng.integers(1, 6)))
            lengths = np.clip(lengths, 8, 2000).astype(int).tolist()
            advantage = float(rng.normal()) if rng.random() > 0.1 else 0.0
            executions.append(execution(f"s{seed}g{g}e{e}", lengths, advantage))
        groups.append(group(g, version=g // 8, executions=executions))
    return groups


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_streaming_packing_keeps_95_percent_real_tokens(seed):
    """Real tokens / (micro-steps x budget) >= 95%, every micro-step counted.

    The last partial micro-step of the step is included. An over-budget micro-step
    (an execution longer than the budget) costs its own length, not the budget: the
    asserted ratio is real tokens / sum(max(budget, length)), the stricter one.
    """
    budget = 2048
    groups = _realistic_groups(seed)
    tb = TrajectoryBuffer()
    for g in groups:
        tb.add(g)
    packer = PackingBuffer(tb, budget)
    micro_steps = run_batch(packer, 5, tb.ready_ids(), per_call=1)
    check_micro_steps(micro_steps, groups, budget)
    summary = packer.summary(5)
    cost = sum(max(budget, ms.num_tokens) for ms in micro_steps)
    fraction = summary.num_tokens / cost
    plain = summary.num_tokens / (len(micro_steps) * budget)
    over = summary.num_over_budget
    print(f"seed {seed}: {len(micro_steps)} micro-steps, {over} over budget, ", end="")
    print(f"real tokens / cost {fraction:.4f}, / (micro-steps x budget) {plain:.4f}")
    assert fraction >= 0.95
    assert summary.num_executions == 32 * 8
    assert summary.num_zero_gradient == sum(
        1 for g in groups for e in g.executions if e.advantage == 0.0
    )
    assert set(summary.group_ids) == set(range(32)) and len(tb) == 0


def test_micro_steps_emitted_before_close_are_filled_to_the_threshold():
    budget = 1024
    groups = _realistic_groups(7, n_groups=8)
    tb = TrajectoryBuffer()
    for g in groups:
        tb.add(g)
    packer = PackingBuffer(tb, budget)
    streamed = []
    for gid in tb.ready_ids()[:-1]:
        streamed += packer.assign(0, [gid], closes_batch=False)
    assert streamed, "streaming emits micro-steps before the batch closes"
    assert all(ms.num_tokens >= 0.75 * budget for ms in streamed)
    assert sum(ms.num_tokens for ms in streamed) >= 0.9 * budget * len(streamed)


def test_executions_large_against_the_budget_stream_at_three_quarters():
    # Eight executions of ~27% of T: three fill 81%, and the rest cannot join them.
    # Waiting for 95% would hold every micro-step until the batch closes.
    tb = TrajectoryBuffer()
    tb.add(group(0, 0, [execution(f"e{i}", [270 + i]) for i in range(8)]))
    packer = PackingBuffer(tb, 1000)
    streamed = packer.assign(0, [0], closes_batch=False)
    assert [ms.execution_ids for ms in streamed] == [("e7", "e6", "e5"), ("e4", "e3", "e2")]
    # Two left (54%) all fit in one micro-step: they wait for the next group.
    tb.add(group(1, 0, [execution("f", [400])]))
    assert packer.assign(0, [1], closes_batch=True)[0].execution_ids == ("f", "e1", "e0")


def test_an_over_budget_execution_gets_a_micro_step_of_its_own():
    big = execution("big", [300, 200])
    small = [execution(f"s{i}", [30]) for i in range(5)]
    tb = TrajectoryBuffer()
    tb.add(group(0, 0, [small[0], big, *small[1:]]))
    packer = PackingBuffer(tb, 256)
    micro_steps = packer.assign(0, [0], closes_batch=True)
    assert micro_steps[0].execution_ids == ("big",) and micro_steps[0].num_tokens == 500
    assert [ms.execution_ids for ms in micro_steps[1:]] == [tuple(f"s{i}" for i in range(5))]
    assert packer.summary(0).num_over_budget == 1


def test_zero_advantage_executions_are_skipped_but_counted():
    tb = TrajectoryBuffer()
    tb.add(group(0, 0, [execution(f"z{i}", [40], 0.0) for i in range(4)]))
    tb.add(group(1, 0, [execution("a", [40], 0.5), execution("b", [40], 0.0)]))
    packer = PackingBuffer(tb, 100)
    micro_steps = packer.assign(0, [0, 1], closes_batch=True)
    assert [ms.execution_ids for ms in micro_steps] == [("a",)]
    assert micro_steps[0].group_ids == (1,)
    s = packer.summary(0)
    assert (s.num_executions, s.num_zero_gradient, s.num_micro_steps) == (6, 5, 1)
    assert s.group_ids == (0, 1) and s.num_target_tokens == micro_steps[0].num_targets


def test_groups_assigned_across_calls_are_each_consumed_once():
    groups = [
        group(g, 0, [execution(f"g{g}e{i}", [20, 25], 1.0) for i in range(3)]) for g in range(6)
    ]
    tb = TrajectoryBuffer()
    for g in groups:
        tb.add(g)
    packer = PackingBuffer(tb, 128)
    micro_steps = run_batch(packer, 0, list(range(6)), per_call=2)
    check_micro_steps(micro_steps, groups, 128)
    assert tb.taken == set(range(6)) and len(tb) == 0
    with pytest.raises(ValueError, match="group 3 was already taken"):
        tb.take(3)
    with pytest.raises(ValueError, match="group 3 was already taken"):
        packer.assign(1, [3], closes_batch=True)
    with pytest.raises(ValueError, match="group 3 was already taken"):
        tb.add(groups[3])
    with pytest.raises(KeyError, match="group 9 is not ready"):
        packer.assign(1, [9], closes_batch=True)
    assert packer._step is None  # a refused assign opens nothing


def test_step_errors():
    tb = TrajectoryBuffer()
    for g in range(4):
        tb.add(group(g, 0, [execution(f"g{g}", [30])]))
    with pytest.raises(ValueError, match="tokens_per_micro_step must be > 0"):
        PackingBuffer(tb, 0)
    packer = PackingBuffer(tb, 1000)
    packer.assign(0, [0], closes_batch=False)
    with pytest.raises(ValueError, match="step 0 is open; cannot assign to step 1"):
        packer.assign(1, [1], closes_batch=False)
    with pytest.raises(KeyError, match="step 0 is not closed"):
        packer.summary(0)
    packer.assign(0, [1], closes_batch=True)
    with pytest.raises(ValueError, match="step 0 is already closed"):
        packer.assign(0, [2], closes_batch=True)
    with pytest.raises(ValueError, match="assigned twice"):
        packer.assign(1, [2, 2], closes_batch=True)
    assert [ms.execution_ids for ms in packer.assign(1, [2, 3], closes_batch=True)] == [
        ("g2", "g3")
    ]
    tb2 = TrajectoryBuffer()
    tb2.add(group(2, 0, []))
    with pytest.raises(ValueError, match="group 2 is already in the trajectory buffer"):
        tb2.add(group(2, 1, []))
    with pytest.raises(ValueError, match="trajectory of execution 'x'"):
        ExecutionSample("y", 1.0, (trajectory(1, 1, "x"),))


def test_trajectory_buffer_is_oldest_version_first():
    tb = TrajectoryBuffer()
    for gid, version in [(5, 2), (1, 3), (7, 0), (2, 2), (9, 0)]:
        tb.add(group(gid, version, []))
    assert tb.ready_ids() == [7, 9, 2, 5, 1]
    assert tb.take(9).version == 0
    assert tb.ready_ids() == [7, 2, 5, 1] and len(tb) == 4


def test_state_dicts_round_trip_through_json_and_resume_the_same_stream():
    groups = _realistic_groups(11, n_groups=6, n_exec=4)

    def fresh() -> tuple[TrajectoryBuffer, PackingBuffer]:
        tb = TrajectoryBuffer()
        for g in groups:
            tb.add(g)
        return tb, PackingBuffer(tb, 2048)

    tb, straight_packer = fresh()
    straight = run_batch(straight_packer, 0, tb.ready_ids(), per_call=2)

    tb, packer = fresh()
    ids = tb.ready_ids()
    before = packer.assign(0, ids[:2], closes_batch=False)
    before += packer.assign(0, ids[2:4], closes_batch=False)
    state = json.loads(json.dumps({"tb": tb.state_dict(), "pb": packer.state_dict()}))
    tb2 = TrajectoryBuffer()
    tb2.load_state_dict(state["tb"])
    packer2 = PackingBuffer(tb2, 2048)
    packer2.load_state_dict(state["pb"])
    assert tb2.taken == set(ids[:4]) and tb2.ready_ids() == ids[4:]
    assert tb2.state_dict() == tb.state_dict() and packer2.state_dict() == packer.state_dict()
    after = packer2.assign(0, ids[4:], closes_batch=True)
    resumed = before + after

    def key(ms: MicroStep) -> tuple:
        return (ms.index, ms.execution_ids, ms.input_ids.tolist(), ms.target_mask.tolist())

    assert [key(m) for m in resumed] == [key(m) for m in straight]
    assert packer2.summary(0) == straight_packer.summary(0)


# --- the claim queue -------------------------------------------------------------------


def _micro_steps(step: int, n: int) -> tuple[list[MicroStep], BatchSummary]:
    tb = TrajectoryBuffer()
    for g in range(n):
        tb.add(group(g, 0, [execution(f"e{g}", [50])]))
    packer = PackingBuffer(tb, 50)
    micro_steps = packer.assign(step, list(range(n)), closes_batch=True)
    assert len(micro_steps) == n
    return micro_steps, packer.summary(step)


def test_concurrent_claimers_get_disjoint_micro_steps_covering_all():
    micro_steps, summary = _micro_steps(3, 12)

    async def main() -> dict[int, list[int]]:
        queue = MicroStepQueue()
        queue.open(3)
        got: dict[int, list[int]] = {c: [] for c in range(3)}

        async def cell(c: int) -> None:
            while (ms := await queue.claim(c)) is not None:
                got[c].append(ms.index)
                await asyncio.sleep(0)

        cells = [asyncio.create_task(cell(c)) for c in range(3)]
        for ms in micro_steps:
            await queue.put(ms)
            await asyncio.sleep(0)
        await queue.close(summary)
        assert await queue.wait_drained() == summary
        await asyncio.gather(*cells)
        assert queue.claims == {i: c for c, idx in got.items() for i in idx}
        return got

    got = asyncio.run(main())
    claimed = sorted(i for idx in got.values() for i in idx)
    assert claimed == list(range(12))


def test_claim_waits_for_put_and_returns_none_after_close_and_drain():
    micro_steps, summary = _micro_steps(0, 2)

    async def main() -> None:
        queue = MicroStepQueue()
        queue.open(0)
        waiting = asyncio.create_task(queue.claim(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing queued, step open: it waits
        await queue.put(micro_steps[0])
        assert (await waiting) is micro_steps[0]
        await queue.put(micro_steps[1])
        assert queue.queued == 1
        with pytest.raises(ValueError, match="summary counts 1 micro-steps, 2 were put"):
            await queue.close(
                BatchSummary(
                    step=0,
                    group_ids=(),
                    num_executions=0,
                    num_target_tokens=0,
                    num_micro_steps=1,
                    num_tokens=0,
                )
            )
        late = asyncio.create_task(queue.claim(2))
        await queue.close(summary)
        assert (await late) is micro_steps[1]
        assert await queue.claim(0) is None and queue.drained
        with pytest.raises(ValueError, match="step 0 is closed"):
            await queue.put(micro_steps[0])
        # the next step; a step with no micro-steps closes claimers straight away
        queue.open(1)
        with pytest.raises(ValueError, match="micro-step of step 0; open step is 1"):
            await queue.put(micro_steps[0])
        blocked = asyncio.create_task(queue.claim(0))
        await asyncio.sleep(0)
        assert not blocked.done()
        await queue.close(
            BatchSummary(
                step=1,
                group_ids=(),
                num_executions=0,
                num_target_tokens=0,
                num_micro_steps=0,
                num_tokens=0,
            )
        )
        assert await blocked is None
        with pytest.raises(ValueError, match="step 1 does not follow step 1"):
            queue.open(1)

    asyncio.run(main())


def test_queue_refuses_a_new_step_before_the_open_one_drains():
    micro_steps, _ = _micro_steps(0, 1)

    async def main() -> None:
        queue = MicroStepQueue()
        queue.open(0)
        await queue.put(micro_steps[0])
        with pytest.raises(ValueError, match="step 0 is not closed and drained"):
            queue.open(1)
        with pytest.raises(ValueError, match="summary of step 1; open step is 0"):
            await queue.close(
                BatchSummary(
                    step=1,
                    group_ids=(),
                    num_executions=0,
                    num_target_tokens=0,
                    num_micro_steps=1,
                    num_tokens=0,
                )
            )

    asyncio.run(main())


def test_a_cell_that_leaves_gives_its_claims_back_in_order_and_the_step_is_not_drained():
    micro_steps, summary = _micro_steps(0, 4)

    async def main() -> None:
        queue = MicroStepQueue()
        queue.open(0)
        for ms in micro_steps:
            await queue.put(ms)
        await queue.close(summary)
        assert [(await queue.claim(c)).index for c in (0, 1, 1, 0)] == [0, 1, 2, 3]  # type: ignore[union-attr]
        assert queue.drained
        assert await queue.give_back(1) == 2
        assert not queue.drained and queue.claims == {0: 0, 3: 0}
        assert await queue.give_back(1) == 0  # nothing claimed any more
        waiting = asyncio.create_task(queue.wait_drained())
        assert [(await queue.claim(0)).index for _ in range(2)] == [1, 2]  # type: ignore[union-attr]
        assert await waiting == summary and queue.claims == dict.fromkeys(range(4), 0)

    asyncio.run(main())
