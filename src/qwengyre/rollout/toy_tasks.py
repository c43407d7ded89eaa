"""The toy harness's tasks: parity (the default) and addition, each split three ways.

Every toy task is a :class:`ToyProblem`: the task, and what its ideal episode writes
(the warm start imitates it). Two kinds:

* **parity** (:data:`TOY_KIND`, the default): "Write an even two-digit number into
  answer.txt"; the python evaluator :func:`score_even` scores 1 for an even two-digit
  number. The reward depends only on sampled tokens, the rule is learnable from reward
  alone, and chance is ~0.5 once the model speaks the harness protocol.
* **addition**: "Compute a+b and write only the number into answer.txt" (exact match).

Addition pairs:

Every ordered pair ``(a, b)`` with operands in their inclusive ranges (:data:`RANGES`,
by default :data:`TWO_PLUS_ONE`: ``10 <= a <= 99``, ``1 <= b <= 9``, 810 pairs)
belongs to exactly one of three sets, fixed by a seeded shuffle (:data:`SPLIT_SEED`)
so that every process and machine agrees:

* the **RL** set (:func:`rl_pairs`, :func:`rl_tasks`): the tasks ``qwengyre train`` rolls
  out; it always starts with the pairs of the bundled ``example_tasks.jsonl`` that lie
  in the ranges;
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
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

from qwengyre.rollout.tasks import (
    ExactMatchEvaluator,
    PythonEvaluator,
    Task,
    dump_tasks,
    example_tasks_path,
    load_tasks,
)

__all__ = [
    "ANSWER_FILE",
    "HELDOUT_SIZE",
    "RANGES",
    "RL_SIZE",
    "SPLIT_SEED",
    "TOY_KIND",
    "TWO_PLUS_ONE",
    "Kind",
    "Ranges",
    "ToyProblem",
    "addition_problem",
    "addition_task",
    "all_pairs",
    "even_two_digit",
    "heldout_pairs",
    "instructions",
    "parity_problem",
    "problems",
    "rl_pairs",
    "rl_tasks",
    "score_even",
    "toy_tasks_path",
    "warm_start_pairs",
    "write_tasks_jsonl",
]

SPLIT_SEED = 20_240_611
RL_SIZE = 256
HELDOUT_SIZE = 128
ANSWER_FILE = "answer.txt"

Pair = tuple[int, int]
Ranges = tuple[tuple[int, int], tuple[int, int]]
"""Inclusive ``((a_min, a_max), (b_min, b_max))`` operand ranges."""
TWO_PLUS_ONE: Ranges = ((10, 99), (1, 9))
"""Two-digit plus one-digit (810 pairs)."""
RANGES: Ranges = TWO_PLUS_ONE
"""The default operand ranges."""


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


def all_pairs(ranges: Ranges = RANGES) -> list[Pair]:
    """Every ordered pair with ``a`` and ``b`` in their (inclusive) ranges."""
    (a_lo, a_hi), (b_lo, b_hi) = ranges
    return [(a, b) for a in range(a_lo, a_hi + 1) for b in range(b_lo, b_hi + 1)]


@cache
def _split(
    ranges: Ranges = RANGES,
) -> tuple[tuple[Pair, ...], tuple[Pair, ...], tuple[Pair, ...]]:
    pairs = all_pairs(ranges)
    inside = set(pairs)
    examples = tuple(p for p in _example_pairs() if p in inside)
    rest = [p for p in pairs if p not in set(examples)]
    random.Random(SPLIT_SEED).shuffle(rest)
    n_rl = RL_SIZE - len(examples)
    rl = (*examples, *rest[:n_rl])
    heldout = tuple(rest[n_rl : n_rl + HELDOUT_SIZE])
    train = tuple(rest[n_rl + HELDOUT_SIZE :])
    if len(train) < HELDOUT_SIZE:
        raise ValueError(f"operand ranges {ranges} leave only {len(train)} warm-start pairs")
    return rl, heldout, train


def rl_pairs(ranges: Ranges = RANGES) -> list[Pair]:
    """The RL set (:data:`RL_SIZE` pairs, the in-range examples first)."""
    return list(_split(ranges)[0])


def heldout_pairs(ranges: Ranges = RANGES) -> list[Pair]:
    """The warm start's held-out evaluation set (:data:`HELDOUT_SIZE` pairs)."""
    return list(_split(ranges)[1])


def warm_start_pairs(ranges: Ranges = RANGES) -> list[Pair]:
    """The warm start's training problems (all pairs in neither other set)."""
    return list(_split(ranges)[2])


@dataclass(frozen=True)
class ToyProblem:
    """A toy task and its ideal episode: the main agent delegates ``delegated`` to the
    sub-agent, which writes ``ideal_answer`` into answer.txt; ``correct`` is the reward
    rule on what was written (the task's evaluator applies the same rule)."""

    task: Task
    delegated: str
    ideal_answer: str
    rule: Literal["exact", "even"]

    def correct(self, content: str) -> bool:
        if self.rule == "exact":
            return content.strip() == self.ideal_answer
        return even_two_digit(content)


def addition_problem(a: int, b: int) -> ToyProblem:
    return ToyProblem(addition_task(a, b), f"{a}+{b}", str(a + b), "exact")


EVEN_INSTRUCTIONS = f"Write an even two-digit number into {ANSWER_FILE}, only the number"
EVEN_DELEGATED = "an even two-digit number"


def even_two_digit(content: str) -> bool:
    text = content.strip()
    return len(text) == 2 and text.isdigit() and text[0] != "0" and int(text) % 2 == 0


def score_even(workspace: Path, metadata: dict[str, object]) -> float:
    """The parity task's evaluator: 1.0 if answer.txt holds an even two-digit number."""
    try:
        content = (Path(workspace) / ANSWER_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        return 0.0
    return float(even_two_digit(content))


def parity_problem(i: int) -> ToyProblem:
    """Parity task ``i``. Its ideal answer is *any* two-digit number (spread over 10..99,
    even or odd): the warm start teaches the harness protocol, the rule is left to RL."""
    task = Task(
        id=f"even-{i:04d}",
        instructions=EVEN_INSTRUCTIONS,
        evaluator=PythonEvaluator(callable="qwengyre.rollout.toy_tasks:score_even"),
        metadata={"kind": "parity"},
    )
    return ToyProblem(task, EVEN_DELEGATED, str(10 + (37 * i) % 90), "even")


Kind = Literal["parity", "addition"]
TOY_KIND: Kind = "parity"
"""The default toy task. Addition is the harder one: on two CPU cores the 0.9M-parameter
demo model's sampled accuracy stayed at 0-6% after 2-3 minutes of warm start (it does
not learn to read the operands in time), so the embedded default uses parity, whose
reward the model reaches by chance (~0.5) once it speaks the harness protocol."""
Split = Literal["rl", "heldout", "train"]
PARITY_TRAIN_SIZE = 1024


def problems(split: Split, kind: Kind = TOY_KIND, ranges: Ranges = RANGES) -> list[ToyProblem]:
    """The toy problems of one split (RL tasks, the warm start's held-out evaluation
    set, the warm start's training set), disjoint and deterministic."""
    if kind == "addition":
        pairs = {"rl": rl_pairs, "heldout": heldout_pairs, "train": warm_start_pairs}[split]
        return [addition_problem(a, b) for a, b in pairs(ranges)]
    start, size = {
        "rl": (0, RL_SIZE),
        "heldout": (RL_SIZE, HELDOUT_SIZE),
        "train": (RL_SIZE + HELDOUT_SIZE, PARITY_TRAIN_SIZE),
    }[split]
    return [parity_problem(i) for i in range(start, start + size)]


def rl_tasks(n: int | None = None, ranges: Ranges = RANGES, kind: Kind = TOY_KIND) -> list[Task]:
    """The first ``n`` RL tasks (all of them by default), in a fixed order."""
    tasks = [p.task for p in problems("rl", kind, ranges)]
    return tasks[: len(tasks) if n is None else n]


def write_tasks_jsonl(
    path: Path | str, n: int | None = None, ranges: Ranges = RANGES, kind: Kind = TOY_KIND
) -> Path:
    """Write :func:`rl_tasks` ``(n, ranges, kind)`` as a task file; returns the path."""
    path = Path(path)
    dump_tasks(path, rl_tasks(n, ranges, kind))
    return path


def toy_tasks_path() -> Path:
    """The bundled ``toy_tasks.jsonl`` (the whole RL set)."""
    return Path(str(resources.files("qwengyre.rollout").joinpath("toy_tasks.jsonl")))
