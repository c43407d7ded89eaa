"""Trajectory admission from an execution's trajectory tree (docs/design.md §2, Eq 7).

Candidates are the tree's leaves; a leaf's trajectory is its root-to-leaf path. The
provenance mask makes only engine-sampled tokens (``output_ids``) trainable; injected
tokens (``input_ids``) are never targets. Each leaf's class is its node's
``meta.request_class``, ranked by ``priority`` (Eq 7 by default: main-agent
task-driving > main-agent summary > sub-agent task-driving > sub-agent summary).

Admission draws one trajectory at a time, until nothing trainable remains or ``j_max``
are admitted:

1. take the highest-priority class that still has a leaf whose path holds unmasked
   sampled tokens;
2. draw one of its leaves with probability proportional to that unmasked count;
3. fix the path's still-unmasked sampled tokens as the trajectory's targets;
4. mask the whole root-to-leaf path (every sampled token of every node on it).

So a token shared by several admitted trajectories is a target exactly once (in the
first that includes it), while each trajectory keeps its full recorded context.

A call the harness never received (``meta.delivered`` False: it hung up, or the
proxy died first) is never a candidate and its sampled tokens are never targets.

Classes missing from ``priority`` (e.g. ``"main.side"``): by default they form one
tier *below* every listed class, so they are admitted only once the listed classes
have nothing trainable left (the issue asks for admission "until nothing trainable
remains", and leftover budget is better spent than wasted). Pass
``admit_unlisted=False`` to never admit them at all.

Pure: no I/O; randomness only from the passed ``random.Random`` or
``numpy.random.Generator``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from qwengyre.trajectories import routed_experts
from qwengyre.trajectories.tree import TrajectoryTree

DEFAULT_PRIORITY: tuple[str, ...] = ("main.task", "main.summary", "sub.task", "sub.summary")
"""Eq 7: main task-driving > main summary > sub task-driving > sub summary."""

Rng = random.Random | np.random.Generator


@dataclass(kw_only=True, frozen=True)
class AdmittedTrajectory:
    """One admitted root-to-leaf path, materialised as a token row.

    All row fields are aligned with ``input_ids`` (the recorded context: for each node
    on the path its ``input_ids`` then its ``output_ids``). ``target_mask`` is True only
    at the sampled tokens fixed as targets when this trajectory was admitted;
    ``behaviour_logprobs`` is 0.0 and ``versions`` is -1 where a token was not sampled.
    ``routing`` (an MoE's): the routed experts before each token, its nodes' joined
    (:mod:`qwengyre.trajectories.routed_experts`; -1 rows where a node has none); None
    if no node has any. Not compared by ``==``: compare it with ``numpy``.
    """

    leaf: int
    request_class: str
    nodes: tuple[int, ...]
    input_ids: tuple[int, ...]
    target_mask: tuple[bool, ...]
    behaviour_logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    execution_id: str = ""
    advantage: float = 0.0
    routing: np.ndarray | None = field(default=None, compare=False)

    @property
    def num_targets(self) -> int:
        return sum(self.target_mask)


def class_rank(
    request_class: str, priority: Sequence[str], *, admit_unlisted: bool = True
) -> int | None:
    """0 is the highest priority; unlisted classes share the lowest rank (or None)."""
    if request_class in priority:
        return list(priority).index(request_class)
    return len(priority) if admit_unlisted else None


def materialise(
    tree: TrajectoryTree, leaf: int, targets: frozenset[int], request_class: str = ""
) -> AdmittedTrajectory:
    """The token row of ``leaf``'s path; sampled tokens of nodes in ``targets`` are targets."""
    path = tree.path(leaf)
    ids: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for node in path:
        n_in = len(node.input_ids)
        ids += node.input_ids
        mask += [False] * n_in
        logprobs += [0.0] * n_in
        versions += [-1] * n_in
        ids += node.output_ids
        mask += [node.id in targets] * len(node.output_ids)
        logprobs += node.logprobs
        versions += node.versions
    return AdmittedTrajectory(
        leaf=leaf,
        request_class=request_class or tree.nodes[leaf].meta.request_class,
        nodes=tuple(n.id for n in path),
        input_ids=tuple(ids),
        target_mask=tuple(mask),
        behaviour_logprobs=tuple(logprobs),
        versions=tuple(versions),
        routing=routed_experts.join(
            [n.routing for n in path], [len(n.input_ids) + len(n.output_ids) for n in path]
        ),
    )


def _draw(weights: Sequence[int], rng: Rng) -> int:
    """An index drawn with probability proportional to ``weights`` (all > 0)."""
    if isinstance(rng, np.random.Generator):
        p = np.asarray(weights, dtype=np.float64)
        return int(rng.choice(len(weights), p=p / p.sum()))
    return rng.choices(range(len(weights)), weights=weights, k=1)[0]


def select_trajectories(
    tree: TrajectoryTree,
    *,
    j_max: int,
    priority: Sequence[str] = DEFAULT_PRIORITY,
    rng: Rng,
    admit_unlisted: bool = True,
) -> list[AdmittedTrajectory]:
    """Admit up to ``j_max`` trajectories by the draw in this module's docstring."""
    if j_max < 0:
        raise ValueError(f"j_max must be >= 0, got {j_max}")
    candidates: list[tuple[int, int, list[int]]] = []  # (rank, leaf, path node ids)
    for node in tree.leaves():
        rank = class_rank(node.meta.request_class, priority, admit_unlisted=admit_unlisted)
        if rank is not None and node.meta.delivered:
            candidates.append((rank, node.id, [n.id for n in tree.path(node.id)]))
    # Nodes whose sampled tokens are masked; an undelivered call's never are targets.
    masked: set[int] = {n.id for n in tree.nodes if not n.meta.delivered}

    def unmasked(path: list[int]) -> int:
        return sum(len(tree.nodes[i].output_ids) for i in path if i not in masked)

    admitted: list[AdmittedTrajectory] = []
    while len(admitted) < j_max:
        live = [(rank, leaf, path, unmasked(path)) for rank, leaf, path in candidates]
        live = [c for c in live if c[3] > 0]
        if not live:
            break
        top = min(c[0] for c in live)
        tier = [c for c in live if c[0] == top]
        _, leaf, path, _ = tier[_draw([c[3] for c in tier], rng)]
        targets = frozenset(i for i in path if i not in masked and tree.nodes[i].output_ids)
        admitted.append(materialise(tree, leaf, targets))
        masked.update(path)
    return admitted


def admit_execution(
    tree: TrajectoryTree,
    execution_id: str,
    advantage: float,
    *,
    j_max: int,
    priority: Sequence[str] = DEFAULT_PRIORITY,
    rng: Rng,
    admit_unlisted: bool = True,
) -> list[AdmittedTrajectory]:
    """``select_trajectories`` with each trajectory carrying its execution's id and advantage."""
    chosen = select_trajectories(
        tree, j_max=j_max, priority=priority, rng=rng, admit_unlisted=admit_unlisted
    )
    return [replace(t, execution_id=execution_id, advantage=float(advantage)) for t in chosen]
