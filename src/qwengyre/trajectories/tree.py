"""The trajectory tree of one execution (docs/design.md §1; the paper: TITO, the trajectory tree).

Nodes are model calls. A node's *context* is everything the engine saw and produced on
the path from the root: for each node on it, its incremental ``input_ids`` followed by
its ``output_ids``. A new call that extends a node's recorded context (and response)
becomes its child; a divergence (an edit, a compaction, a sub-agent) makes a branch; a
call that extends nothing hangs from the root. Input tokens are *injected* (written by
the harness or the chat template), output tokens are *sampled* by our engine: only
sampled tokens can ever be training targets.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


@dataclass(kw_only=True, frozen=True)
class NodeMeta:
    """What is known about a call besides its tokens."""

    request_class: str  # e.g. "main.task", "sub.summary"
    agent_id: str
    engine: str
    policy_version: int  # the newest version that produced an output token
    started_s: float
    finished_s: float
    finish_reason: str
    usage: dict[str, int] = field(default_factory=dict)
    # False: recorded but never delivered (the client hung up, the stream was cut, the
    # proxy died before answering). Its sampled tokens are never training targets, and
    # the harness's retry of it is the real call.
    delivered: bool = True


_TYPECODES = {"input_ids": "i", "output_ids": "i", "logprobs": "f", "versions": "i"}


@dataclass(kw_only=True, frozen=True, eq=False)
class Node:
    """One recorded model call. Its token fields are kept as compact arrays (int32 ids
    and versions, float32 log-probs: 4 bytes a token instead of ~36 as a tuple of ints),
    whatever sequence they are given as: an execution of a million tokens holds ~8 MB.
    Log-probs are float32 because engines compute them so and the trainer's objective
    uses them so: a tree reloaded from the proxy's store equals the one recorded.

    ``routing`` (an MoE's, where the engine reported it): for each of its tokens, input
    then output, the experts of the position before it
    (:mod:`qwengyre.trajectories.routed_experts`); None where not reported."""

    id: int
    parent: int | None  # None: hangs from the root
    input_ids: Sequence[int]  # injected tokens after the parent's context
    output_ids: Sequence[int]  # sampled by the engine
    logprobs: Sequence[float]  # behaviour log-prob of each output token
    versions: Sequence[int]  # policy version of the weights that produced each one
    meta: NodeMeta
    routing: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name, code in _TYPECODES.items():
            values = getattr(self, name)
            if not (isinstance(values, array) and values.typecode == code):
                object.__setattr__(self, name, array(code, values))
        for name, values in (("log-probs", self.logprobs), ("versions", self.versions)):
            if len(values) != len(self.output_ids):
                raise ValueError(
                    f"node {self.id}: {len(values)} {name} for {len(self.output_ids)} output tokens"
                )
        tokens = len(self.input_ids) + len(self.output_ids)
        if self.routing is not None and (self.routing.ndim != 3 or len(self.routing) != tokens):
            raise ValueError(
                f"node {self.id}: routed experts of shape {self.routing.shape} for {tokens} tokens"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Node):
            return NotImplemented
        mine, theirs = self.routing, other.routing
        routed = mine is theirs or (
            mine is not None and theirs is not None and np.array_equal(mine, theirs)
        )
        return (self.id, self.parent, self.meta) == (other.id, other.parent, other.meta) and (
            routed and all(getattr(self, name) == getattr(other, name) for name in _TYPECODES)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "parent": self.parent,
            "input_ids": list(self.input_ids),
            "output_ids": list(self.output_ids),
            "logprobs": list(self.logprobs),
            "versions": list(self.versions),
            "provenance": [0] * len(self.input_ids) + [1] * len(self.output_ids),
            "class": self.meta.request_class,
            "agent_id": self.meta.agent_id,
            "engine": self.meta.engine,
            "policy_version": self.meta.policy_version,
            "started_s": self.meta.started_s,
            "finished_s": self.meta.finished_s,
            "finish_reason": self.meta.finish_reason,
            "usage": dict(self.meta.usage),
            "delivered": self.meta.delivered,
        }


class TrajectoryTree:
    """All calls of one execution; append-only."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._children: dict[int | None, list[int]] = {None: []}

    def add(
        self,
        parent: int | None,
        input_ids: Sequence[int],
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        meta: NodeMeta,
        routing: np.ndarray | None = None,
    ) -> Node:
        if parent is not None and not 0 <= parent < len(self.nodes):
            raise ValueError(f"parent {parent} is not a node of this tree")
        node = Node(
            id=len(self.nodes),
            parent=parent,
            input_ids=input_ids,
            output_ids=output_ids,
            logprobs=logprobs,
            versions=versions,
            meta=meta,
            routing=routing,
        )
        self.nodes.append(node)
        self._children.setdefault(parent, []).append(node.id)
        self._children[node.id] = []
        return node

    def set_delivered(self, node_id: int, delivered: bool) -> None:
        """Mark whether the caller received ``node_id``'s answer."""
        node = self.nodes[node_id]
        self.nodes[node_id] = replace(node, meta=replace(node.meta, delivered=delivered))

    def path(self, node_id: int) -> list[Node]:
        """The nodes from the root down to ``node_id``."""
        path = []
        current: int | None = node_id
        while current is not None:
            node = self.nodes[current]
            path.append(node)
            current = node.parent
        return path[::-1]

    def context_ids(self, node_id: int) -> list[int]:
        """Every token on the path, the node's own output included."""
        ids: list[int] = []
        for node in self.path(node_id):
            ids += node.input_ids
            ids += node.output_ids
        return ids

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if not self._children[n.id]]

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [n.to_json() for n in self.nodes]}
