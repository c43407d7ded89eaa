"""Trajectory admission from the trajectory tree (docs/design.md §2, Eq 7)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwengyre.trajectories.selection import (
    DEFAULT_PRIORITY,
    AdmittedTrajectory,
    admit_execution,
    select_trajectories,
)
from qwengyre.trajectories.tree import NodeMeta, TrajectoryTree


def meta(request_class: str = "main.task") -> NodeMeta:
    return NodeMeta(
        request_class=request_class,
        agent_id="main",
        engine="e",
        policy_version=0,
        started_s=0.0,
        finished_s=1.0,
        finish_reason="stop",
    )


def add(
    tree: TrajectoryTree, parent: int | None, n_in: int, n_out: int, cls: str = "main.task"
) -> int:
    """A node whose tokens, log-probs and versions encode (node id, offset); log-probs
    in 1/1024ths: a node keeps them as float32, as engines compute them."""
    nid = len(tree.nodes)
    ins = tuple(10_000 * nid + k for k in range(n_in))
    outs = tuple(10_000 * nid + 5_000 + k for k in range(n_out))
    logprobs = tuple(-(nid * 100 + k + 1) / 1024 for k in range(n_out))
    versions = tuple(nid + k for k in range(n_out))
    return tree.add(parent, ins, outs, logprobs, versions, meta(cls)).id


def target_ids(t: AdmittedTrajectory) -> list[int]:
    return [tok for tok, m in zip(t.input_ids, t.target_mask, strict=True) if m]


def test_a_chain_gives_one_trajectory_with_every_sampled_token_a_target():
    tree = TrajectoryTree()
    a = add(tree, None, 2, 1)
    b = add(tree, a, 1, 2)
    c = add(tree, b, 3, 1)
    (t,) = select_trajectories(tree, j_max=5, rng=random.Random(0))
    assert t.leaf == c and t.nodes == (a, b, c) and t.request_class == "main.task"
    assert list(t.input_ids) == tree.context_ids(c)
    sampled = [tok for n in tree.nodes for tok in n.output_ids]
    assert target_ids(t) == sampled
    assert t.target_mask == (False, False, True, False, True, True, False, False, False, True)
    assert t.behaviour_logprobs == tuple(x / 1024 for x in (0, 0, -1, 0, -101, -102, 0, 0, 0, -201))
    assert t.versions == (-1, -1, 0, -1, 1, 2, -1, -1, -1, 2)
    assert t.num_targets == 4


def test_a_branch_makes_the_shared_prefix_a_target_only_in_the_first():
    tree = TrajectoryTree()
    a = add(tree, None, 1, 3)
    b = add(tree, a, 1, 2)
    c = add(tree, a, 1, 1)
    first, second = select_trajectories(tree, j_max=5, rng=random.Random(1))
    assert {first.leaf, second.leaf} == {b, c}
    prefix = list(tree.nodes[a].output_ids)
    assert target_ids(first) == prefix + list(tree.nodes[first.leaf].output_ids)
    assert target_ids(second) == list(tree.nodes[second.leaf].output_ids)
    # both rows keep the whole recorded context, shared prefix included
    assert list(second.input_ids) == tree.context_ids(second.leaf)
    assert second.input_ids[:4] == first.input_ids[:4]


def test_priority_follows_eq_7_and_unlisted_classes_come_last():
    tree = TrajectoryTree()
    order = ["main.side", "sub.summary", "sub.task", "main.summary", "main.task"]
    leaves = {cls: add(tree, None, 1, 50 if cls == "main.side" else 1, cls) for cls in order}
    chosen = select_trajectories(tree, j_max=10, rng=random.Random(0))
    assert [t.request_class for t in chosen] == [*DEFAULT_PRIORITY, "main.side"]
    assert [t.leaf for t in chosen] == [leaves[c] for c in [*DEFAULT_PRIORITY, "main.side"]]
    # configurable: a reversed priority reverses the order
    chosen = select_trajectories(
        tree, j_max=10, priority=tuple(reversed(DEFAULT_PRIORITY)), rng=random.Random(0)
    )
    assert [t.request_class for t in chosen] == [*reversed(DEFAULT_PRIORITY), "main.side"]
    # unlisted classes can be excluded altogether
    chosen = select_trajectories(tree, j_max=10, rng=random.Random(0), admit_unlisted=False)
    assert [t.request_class for t in chosen] == list(DEFAULT_PRIORITY)


def test_a_lower_class_leaf_is_drawn_once_the_higher_class_is_masked():
    # sub.task leaf below a main.task node: its own tokens stay trainable
    tree = TrajectoryTree()
    a = add(tree, None, 1, 2, "main.task")
    sub = add(tree, a, 1, 3, "sub.task")
    main = add(tree, a, 1, 1, "main.task")
    first, second = select_trajectories(tree, j_max=5, rng=random.Random(0))
    assert (first.leaf, second.leaf) == (main, sub)
    assert target_ids(second) == list(tree.nodes[sub].output_ids)


def test_j_max_caps_the_number_admitted():
    tree = TrajectoryTree()
    for _ in range(8):
        add(tree, None, 1, 2)
    assert len(select_trajectories(tree, j_max=3, rng=random.Random(0))) == 3
    assert len(select_trajectories(tree, j_max=0, rng=random.Random(0))) == 0
    assert len(select_trajectories(tree, j_max=100, rng=random.Random(0))) == 8
    with pytest.raises(ValueError, match="j_max"):
        select_trajectories(tree, j_max=-1, rng=random.Random(0))


def test_leaves_with_nothing_trainable_are_never_admitted():
    tree = TrajectoryTree()
    a = add(tree, None, 2, 2)
    b = add(tree, a, 1, 0)  # a leaf with no sampled tokens of its own
    c = add(tree, a, 1, 1)
    add(tree, None, 3, 0)  # nothing sampled at all
    chosen = select_trajectories(tree, j_max=10, rng=random.Random(3))
    # whichever of b, c comes first takes a's tokens; b alone then has none left
    assert c in {t.leaf for t in chosen}
    assert all(t.num_targets > 0 for t in chosen)
    if chosen[0].leaf == c:
        assert [t.leaf for t in chosen] == [c]
    else:
        assert [t.leaf for t in chosen] == [b, c]


@pytest.mark.parametrize("make_rng", [random.Random, np.random.default_rng])
def test_the_draw_is_proportional_to_unmasked_counts(make_rng):
    tree = TrajectoryTree()
    add(tree, None, 5, 1)  # 1 sampled token
    big = add(tree, None, 1, 3)
    add(tree, None, 1, 100, "sub.task")  # a lower class never competes
    runs = 4000
    hits = sum(
        select_trajectories(tree, j_max=1, rng=make_rng(seed))[0].leaf == big
        for seed in range(runs)
    )
    # expected 3/4; binomial sd ~ 0.007, so 0.03 is > 4 sd; 1/2 (uniform) would fail
    assert abs(hits / runs - 0.75) < 0.03


def test_the_draw_counts_unmasked_tokens_after_masking():
    # x (main.task) is always first and masks the shared a; then b : c is 1 : 3,
    # not 2 : 4 as it would be if a's masked token still counted
    tree = TrajectoryTree()
    a = add(tree, None, 1, 1)
    x = add(tree, a, 1, 30, "main.task")
    add(tree, a, 1, 1, "main.summary")
    c = add(tree, a, 1, 3, "main.summary")
    runs, hits = 3000, 0
    for seed in range(runs):
        first, second = select_trajectories(tree, j_max=2, rng=random.Random(seed))
        assert first.leaf == x
        hits += second.leaf == c
    assert abs(hits / runs - 0.75) < 0.03


def test_admit_execution_carries_id_and_advantage():
    tree = TrajectoryTree()
    a = add(tree, None, 1, 2)
    add(tree, a, 1, 1)
    add(tree, a, 1, 1)
    plain = select_trajectories(tree, j_max=5, rng=random.Random(7))
    chosen = admit_execution(tree, "exec-3", -0.5, j_max=5, rng=random.Random(7))
    assert [(t.execution_id, t.advantage) for t in chosen] == [("exec-3", -0.5)] * 2
    assert [t.target_mask for t in chosen] == [t.target_mask for t in plain]
    assert [t.leaf for t in chosen] == [t.leaf for t in plain]


CLASSES = ["main.task", "main.summary", "sub.task", "sub.summary", "main.side"]


@st.composite
def trees(draw: st.DrawFn) -> TrajectoryTree:
    tree = TrajectoryTree()
    for i in range(draw(st.integers(1, 12))):
        parent = draw(st.integers(-1, i - 1))
        add(
            tree,
            None if parent < 0 else parent,
            draw(st.integers(0, 3)),
            draw(st.integers(0, 3)),
            draw(st.sampled_from(CLASSES)),
        )
    return tree


@settings(max_examples=150, deadline=None)
@given(tree=trees(), j_max=st.integers(0, 8), seed=st.integers(0, 2**16))
def test_random_trees_keep_the_admission_invariants(tree, j_max, seed):
    chosen = select_trajectories(tree, j_max=j_max, rng=random.Random(seed))
    assert len(chosen) <= j_max
    seen: set[tuple[int, int]] = set()
    for t in chosen:
        assert list(t.input_ids) == tree.context_ids(t.leaf)
        assert t.nodes == tuple(n.id for n in tree.path(t.leaf))
        assert t.num_targets > 0
        lengths = {len(t.input_ids), len(t.target_mask), len(t.behaviour_logprobs)}
        assert lengths == {len(t.versions)}
        pos = 0
        for nid in t.nodes:
            node = tree.nodes[nid]
            for _ in node.input_ids:
                assert not t.target_mask[pos]  # injected tokens are never targets
                pos += 1
            for k in range(len(node.output_ids)):
                assert t.behaviour_logprobs[pos] == node.logprobs[k]
                assert t.versions[pos] == node.versions[k]
                if t.target_mask[pos]:
                    assert (nid, k) not in seen  # a target at most once
                    seen.add((nid, k))
                pos += 1
    # with room to spare nothing trainable is left behind: every sampled token of the
    # tree (all classes are admitted by default) is a target exactly once
    if len(chosen) < j_max:
        every = {(n.id, k) for n in tree.nodes for k in range(len(n.output_ids))}
        assert seen == every
