"""Deterministic two-digit addition tasks for the toy harness, split three ways.

Every ordered pair ``(a, b)`` with ``10 <= a, b <= 99`` (8,100 pairs) belongs to exactly
one of three sets, fixed by a seeded shuffle (:data:`SPLIT_SEED`) so that every process
and machine agrees:

* the **RL** set (:func:`rl_pairs`, :func:`rl_tasks`): the tasks ``qwengyre train`` rolls
  out; it always contains the pairs of the bundled ``example_tasks.jsonl``;
* the **held-out** set (:func:`heldout_pairs`): the warm start measures its accuracy on
  these, never trains on them;
* the **warm-start** set (:func:`warm_start_pairs`): everything else, the supervised
  warm start's training problems.

The sets are pairwise disjoint (also as unordered sums: ``a+b`` and ``b+a`` may sit in
different sets, they are different prompts). :func:`write_tasks_jsonl` writes RL tasks in
the task-file format (:mod:`qwengyre.rollout.tasks`) with the same instructions and
evaluator as ``example_tasks.jsonl``; the bundled ``toy_tasks.jsonl`` is
``write_tasks_jsonl(path)`` with the defaults.
"""

from __future__ import annotations

import random
from functools import cache
from importlib import resources
from pathlib import Path

from qwengyre.rollout.tasks import (
    ExactMatchEvaluator,
    Task,
    dump_tasks,
    example_tasks_path,
    load_tasks,
)

__all__ = [
    "ANSWER_FILE",
    "HELDOUT_SIZE",
    "RL_SIZE",
    "SPLIT_SEED",
    "addition_task",
    "all_pairs",
    "heldout_pairs",
    "instructions",
    "rl_pairs",
    "rl_tasks",
    "toy_tasks_path",
    "warm_start_pairs",
    "write_tasks_jsonl",
]

SPLIT_SEED = 20_240_611
RL_SIZE = 512
HELDOUT_SIZE = 256
ANSWER_FILE = "answer.txt"

Pair = tuple[int, int]


@cache
def _example_pairs() -> tuple[Pair, ...]:
    """The pairs of the bundled ``example_tasks.jsonl``: always in the RL set."""
    pairs = []
    for task in load_tasks(example_tasks_path()):
        meta = task.metadata
        pairs.append((int(meta["a"]), int(meta["b"])))
    return tuple(pairs)


def instructions(a: int, b: int) -> str:
    """The task prompt, worded as in ``example_tasks.jsonl``."""
    return f"Compute {a}+{b} and write only the number into {ANSWER_FILE}"


def addition_task(a: int, b: int) -> Task:
    return Task(
        id=f"add-{a}-{b}",
        instructions=instructions(a, b),
        evaluator=ExactMatchEvaluator(expected=str(a + b), file=ANSWER_FILE),
        metadata={"kind": "addition", "a": a, "b": b},
    )


def all_pairs() -> list[Pair]:
    return [(a, b) for a in range(10, 100) for b in range(10, 100)]


@cache
def _split() -> tuple[tuple[Pair, ...], tuple[Pair, ...], tuple[Pair, ...]]:
    examples = set(_example_pairs())
    rest = [p for p in all_pairs() if p not in examples]
    random.Random(SPLIT_SEED).shuffle(rest)
    n_rl = RL_SIZE - len(examples)
    rl = (*_example_pairs(), *rest[:n_rl])
    heldout = tuple(rest[n_rl : n_rl + HELDOUT_SIZE])
    train = tuple(rest[n_rl + HELDOUT_SIZE :])
    return rl, heldout, train


def rl_pairs() -> list[Pair]:
    """The RL set (:data:`RL_SIZE` pairs, the examples first)."""
    return list(_split()[0])


def heldout_pairs() -> list[Pair]:
    """The warm start's held-out evaluation set (:data:`HELDOUT_SIZE` pairs)."""
    return list(_split()[1])


def warm_start_pairs() -> list[Pair]:
    """The warm start's training problems (all pairs in neither other set)."""
    return list(_split()[2])


def rl_tasks(n: int | None = None) -> list[Task]:
    """The first ``n`` RL tasks (all of them by default), in a fixed order."""
    pairs = rl_pairs()
    return [addition_task(a, b) for a, b in pairs[: len(pairs) if n is None else n]]


def write_tasks_jsonl(path: Path | str, n: int | None = None) -> Path:
    """Write :func:`rl_tasks` ``(n)`` as a task file; returns the path."""
    path = Path(path)
    dump_tasks(path, rl_tasks(n))
    return path


def toy_tasks_path() -> Path:
    """The bundled ``toy_tasks.jsonl`` (the whole RL set)."""
    return Path(str(resources.files("qwengyre.rollout").joinpath("toy_tasks.jsonl")))
