"""Time from a cell's death to the next training step, per kind of cell, on live runs.

Each case starts ``qwengyre train`` (the embedded preset, the tiny test model, the paced
harness: 4 model calls a second apart, so that executions are in flight; a grader that
flips a coin; ``run.restarts=1``), waits until the run has trained
:data:`STEPS_BEFORE` steps, the cells are in the roles the case names and ``--in-flight``
executions run, SIGKILLs the
victim's process, and measures on this process's clock the time from the kill to the
next step record in ``metrics.jsonl``, against the run's cadence (the mean time between
the step records seen before the kill):

- ``rollout cell``: cell 2 serves rollout while cell 1 serves too (3 cells);
- ``only rollout cell``: cell 1 serves alone while the core trains (2 cells);
- ``training satellite``: cell 1 trains (3 cells);
- ``core``: cell 0 trains; the run stops and resumes itself from its checkpoint, the
  path the only rollout cell and a training satellite took before their death became a
  scheduler event (run this script with an older qwengyre on ``PYTHONPATH`` to see it).

With ``--replace`` the runs have ``run.replace_dead_cells=1``: the dead cell, the core
included, is replaced by a new process with no restart.

It also counts the executions whose harnesses ran at the kill and, at the next step,
how many of those harnesses were killed (cancelled, or lost with their daemon): those
executions were thrown away (the run directory's harness daemon's state).

    python benchmarks/bench_cell_death.py            # all four, about 2 min each
    python benchmarks/bench_cell_death.py --cases core "only rollout cell"
    python benchmarks/bench_cell_death.py --cases core --in-flight 4
    python benchmarks/bench_cell_death.py --replace
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _smoke import parse
from qwengyre.cluster.local import actor_processes
from qwengyre.models import cached_tiny_model
from qwengyre.presets import preset_path
from qwengyre.rollout import paced_harness
from qwengyre.rollout.harnessd import recorded_states
from qwengyre.rollout.tasks import CommandEvaluator, Task, dump_tasks

COIN = (
    "import json, random; print(json.dumps({'score': float(random.random() < 0.5), 'valid': True}))"
)


@dataclass(frozen=True)
class Case:
    name: str
    cells: int
    victim: int
    roles: dict[int, str]  # the cells' roles (the victim's included) when it is killed


CASES = [
    Case("rollout cell", 3, 2, {1: "rollout", 2: "rollout"}),
    Case("only rollout cell", 2, 1, {0: "training", 1: "rollout"}),
    Case("training satellite", 3, 1, {1: "training"}),
    Case("core", 3, 0, {0: "training"}),
]
STEPS_BEFORE = 3
"""Steps trained before the kill (the cadence is measured over them)."""


def records(run_dir: Path, kind: str) -> list[dict[str, object]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if record.get("kind") == kind:
            found.append(record)
    return found


def roles_now(run_dir: Path) -> dict[int, str]:
    now: dict[int, str] = {}
    for record in records(run_dir, "role"):
        now[int(record["cell"])] = str(record["role"])  # type: ignore[call-overload]
    return now


@dataclass(frozen=True)
class Death:
    gap_s: float  # from the kill to the next step record
    cadence_s: float  # mean time between step records before the kill
    in_flight: int  # executions whose harnesses ran at the kill
    thrown_away: int  # of those, whose harnesses the run killed


def running_harnesses(run_dir: Path) -> set[str]:
    return {e for e, state in recorded_states(run_dir).items() if state.running}


def killed_harnesses(run_dir: Path) -> set[str]:
    states = recorded_states(run_dir).items()
    return {e for e, state in states if state.cancelled or state.lost}


def run_case(
    case: Case, model: Path, work: Path, steps: int, in_flight: int, replace: bool
) -> Death:
    tasks = work / "tasks.jsonl"
    evaluator = CommandEvaluator(command=[sys.executable, "-c", COIN], timeout_s=30)
    dump_tasks(
        tasks, [Task(id=f"t{i}", instructions=f"Say {i}.", evaluator=evaluator) for i in range(6)]
    )
    run_dir = work / "run"
    command = [sys.executable, "-m", "qwengyre", "train", "--quiet", "--run-dir", str(run_dir)]
    command += [str(preset_path("embedded"))]
    command += [
        f"model.path={model}",
        f"harness.tasks={tasks}",
        f"harness.name={sys.executable} {paced_harness.__file__} {{instructions}}",
        "harness.deadline_s=400",
        "harness.budget_s=500",
        "warm_start.accuracy=null",
        "groups.size=4",
        "groups.batch=2",
        f"run.steps={steps}",
        f"cells.count={case.cells}",
        "run.restarts=1",
        f"run.replace_dead_cells={int(replace)}",
    ]
    stderr = (work / "stderr.log").open("wb")
    process = subprocess.Popen(
        command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr
    )
    seen: list[float] = []  # when each step record appeared
    try:
        killed_at = None
        while process.poll() is None:
            count = len(records(run_dir, "step"))
            now = time.monotonic()
            seen += [now] * (count - len(seen))
            roles = roles_now(run_dir)
            due = len(seen) >= STEPS_BEFORE and killed_at is None
            if due and all(roles.get(c) == r for c, r in case.roles.items()):
                flying = running_harnesses(run_dir)
                if len(flying) < in_flight:  # a death with executions in flight
                    time.sleep(0.02)
                    continue
                os.kill(actor_processes(process.pid)[f"cell-{case.victim}"], signal.SIGKILL)
                killed_at, before = now, len(seen)
            if killed_at is not None and count > before:
                break
            time.sleep(0.02)
        else:
            said = stderr_text(work)[-2000:]
            if killed_at is None:
                raise RuntimeError(
                    f"{case.name}: the run ended before the kill (after {STEPS_BEFORE} steps,"
                    f" with roles {case.roles} and {in_flight} harnesses running): {said}"
                )
            raise RuntimeError(f"{case.name}: the run ended before a step followed: {said}")
        assert killed_at is not None
        gaps = [b - a for a, b in itertools.pairwise(seen[:before])]
        return Death(
            gap_s=seen[before] - killed_at,
            cadence_s=statistics.mean(gaps) if gaps else float("nan"),
            in_flight=len(flying),
            thrown_away=len(flying & killed_harnesses(run_dir)),
        )
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        stderr.close()


def stderr_text(work: Path) -> str:
    return (work / "stderr.log").read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=[c.name for c in CASES])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--in-flight", type=int, default=1, help="kill once this many harnesses run"
    )
    parser.add_argument(
        "--replace", action="store_true", help="run.replace_dead_cells=1: no restart"
    )
    args = parse(parser, cases=["rollout cell"], steps=STEPS_BEFORE + 2)
    model = cached_tiny_model("test")
    print(
        f"{'cell that died':<20} {'death -> next step':>19} {'cadence':>8} {'ratio':>6}"
        f" {'in flight':>9} {'thrown away':>11}"
    )
    for case in CASES:
        if case.name not in args.cases:
            continue
        with tempfile.TemporaryDirectory(prefix="qg-death-") as work:
            d = run_case(case, model, Path(work), args.steps, args.in_flight, args.replace)
        print(
            f"{case.name:<20} {d.gap_s:>17.1f} s {d.cadence_s:>6.1f} s"
            f" {d.gap_s / d.cadence_s:>6.1f} {d.in_flight:>9} {d.thrown_away:>11}"
        )


if __name__ == "__main__":
    main()
