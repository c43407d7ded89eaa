"""The trajectory tree (request classes: tests/test_request_classes.py)."""

from __future__ import annotations

import pytest

from qwengyre.trajectories.tree import NodeMeta, TrajectoryTree

META = NodeMeta(
    request_class="main.task",
    agent_id="main",
    engine="e",
    policy_version=0,
    started_s=0.0,
    finished_s=1.0,
    finish_reason="stop",
)


def test_paths_contexts_and_leaves():
    tree = TrajectoryTree()
    a = tree.add(None, (1, 2), (3,), (-0.1,), (0,), META)
    b = tree.add(a.id, (4,), (5, 6), (-0.2, -0.3), (0, 1), META)
    c = tree.add(a.id, (7,), (8,), (-0.4,), (1,), META)  # a branch: an edited follow-up
    d = tree.add(None, (9,), (10,), (-0.5,), (1,), META)  # a sub-agent or a compaction
    assert [n.id for n in tree.path(b.id)] == [a.id, b.id]
    assert tree.context_ids(b.id) == [1, 2, 3, 4, 5, 6]
    assert tree.context_ids(c.id) == [1, 2, 3, 7, 8]
    assert {n.id for n in tree.leaves()} == {b.id, c.id, d.id}
    assert [n.id for n in tree.nodes if n.parent == a.id] == [b.id, c.id]
    assert [n.id for n in tree.nodes if n.parent is None] == [a.id, d.id]
    assert b.to_json()["provenance"] == [0, 1, 1]


def test_inconsistent_nodes_are_refused():
    tree = TrajectoryTree()
    with pytest.raises(ValueError, match="parent 3 is not a node"):
        tree.add(3, (1,), (2,), (-0.1,), (0,), META)
    with pytest.raises(ValueError, match="1 log-probs for 2 output tokens"):
        tree.add(None, (1,), (2, 3), (-0.1,), (0, 0), META)
    with pytest.raises(ValueError, match="1 versions for 2 output tokens"):
        tree.add(None, (1,), (2, 3), (-0.1, -0.2), (0,), META)
