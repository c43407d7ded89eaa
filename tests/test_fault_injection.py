"""Seeded fault injection into one live `qwengyre train` run on the tiny model.

Three cells, a harness that makes several model calls per execution
(tests/multi_call_harness.py) under the default sandbox, and an evaluator that fails or
hangs once for about 30% of the executions. At moments drawn from the seed and driven
by the run's own progress (steps trained and executions finished, read from
``metrics.jsonl`` and ``traces.jsonl``), the test SIGKILLs the process groups of random
running harnesses, and, by case:

- ``and-the-core`` (embedded engines: a cell's process is its engine): a training
  satellite (cell 1, once it trains) and a rollout satellite (cell 2, once it serves
  rollout), each lost (the run goes on without it), then the core, once both are dead
  (``run.restarts=1``: its death resumes the run from the newest checkpoint);
- ``replaced``: the satellites and the core as in ``and-the-core``, but with
  ``run.replace_dead_cells=3`` and no restart: each is replaced by a new process and
  the run never stops (no step is trained twice);
- ``servers``: engine servers (the SGLang stand-in, tests/fake_sglang, and a standalone
  pool of its own): cell 2's once it serves rollout, then the pool's; their hosts start
  them again.

The run trains all its steps (without a restart but for the core's death in
``and-the-core``), every trained group is a ready group of the ledger trained exactly
once (a step the core trained but had not checkpointed when it died is redone by the
restart, to the same loss; every group ready at its death is trained), no surviving
harness saw an error, a killed harness's execution is not retried: it ends ``failed``
and is evaluated, or gets the zero placeholder when it had made no model call (an
infrastructure failure), every faulty evaluation is retried until valid (never scored
for the fault), and the measured steady-state staleness is Eq 2's within 0.25.

Replay a failure with its seed: ``QWENGYRE_FAULT_SEED=<seed> pytest tests/test_fault_injection.py``
(the test id shows the seed).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tests.test_runtime_train import (
    children,
    harness_summaries,
    overrides,
    redone_steps,
    running,
)

from qwengyre.cluster.local import actor_processes
from qwengyre.records.assessments import AssessmentRecord, read_assessments
from qwengyre.records.metrics import RunMetrics, read_metrics
from qwengyre.report.html import steady_staleness
from qwengyre.rollout import toy_harness
from qwengyre.rollout.harness import PGID_FILE
from qwengyre.rollout.tasks import CommandEvaluator, Task, dump_tasks
from qwengyre.runtime.ledger import LEDGER_DIR, Ledger
from qwengyre.training.checkpoint import latest_checkpoint, read_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find cells"),
]

SEED = int(os.environ.get("QWENGYRE_FAULT_SEED", "7"))
FAKE_SGLANG = Path(__file__).parent / "fake_sglang"
STEPS = 10
CALLS = 2
"""Model calls per execution (toy harness runs in a row)."""
HARNESS_KILLS = 3
WAIT_S = 900.0
"""Generous bound on the whole run (a loaded machine), only so a hang fails."""

# Fails (exit 1) or hangs past its timeout once for about 30% of the executions, chosen
# by the seed and the execution's workspace; then, and for the others, flips a coin.
EVALUATOR = """\
import json, os, random, sys, time
seed, marks = sys.argv[1], sys.argv[2]
name = os.path.basename(os.getcwd())
rng = random.Random(f"{seed}:{name}")
fault = rng.choices(["none", "fail", "hang"], [0.7, 0.15, 0.15])[0]
mark = os.path.join(marks, name)
if fault != "none" and not os.path.exists(mark):
    with open(mark, "w") as f:
        f.write(fault)
    if fault == "hang":
        time.sleep(3600)
    sys.exit(1)
print(json.dumps({"score": float(rng.random() < 0.5), "valid": True}))
"""
EVALUATOR_TIMEOUT_S = 5.0


KINDS = ["and-the-core", "replaced", "servers"]
CORE_DIES = {"and-the-core", "replaced"}
SERVERS = ["cell-2", "standalone"]


@dataclass
class Plan:
    """When each fault is due (drawn from the seed); what was done, for the report."""

    kind: str  # one of KINDS
    satellite_training_at: int  # before cell 1 is killed once it trains
    satellite_rollout_at: int  # before cell 2 (or its server) is killed once it serves
    harnesses_at: list[int]  # executions finished before each harness kill
    harness_picks: random.Random
    core_after: int | None = None  # steps after cell 2's death before the core is killed
    killed_servers: dict[str, int] = field(default_factory=dict)  # engine -> server pid
    server_steps: dict[str, int] = field(default_factory=dict)  # engine -> steps before
    done: list[str] = field(default_factory=list)
    killed_harnesses: list[str] = field(default_factory=list)  # execution ids
    killed_cells: dict[int, int] = field(default_factory=dict)  # cell -> pid
    ready_at_core_death: set[str] = field(default_factory=set)  # the ledger's groups
    steps_at: dict[int, int] = field(default_factory=dict)  # cell -> steps before its death

    @classmethod
    def draw(cls, seed: int, kind: str) -> Plan:
        """The same satellite (or server) and harness faults for a seed, whatever the
        case (the core's comes on top)."""
        rng = random.Random(seed)
        return cls(
            kind=kind,
            satellite_training_at=rng.randint(1, 3),
            satellite_rollout_at=rng.randint(4, 6),
            harnesses_at=sorted(rng.sample(range(2, 40), HARNESS_KILLS)),
            harness_picks=random.Random(seed + 1),
            core_after=random.Random(seed + 2).randint(0, 1) if kind in CORE_DIES else None,
        )

    def core_due(self, steps: int) -> bool:
        """The core's turn: both satellites died (the cells' pids change on resume)."""
        if self.core_after is None or 0 in self.killed_cells or len(self.killed_cells) < 2:
            return False
        return steps >= max(self.steps_at.values()) + self.core_after

    def complete(self) -> bool:
        if len(self.killed_harnesses) != HARNESS_KILLS:
            return False
        if self.kind == "servers":
            return set(self.killed_servers) == set(SERVERS)
        return set(self.killed_cells) == {0, 1, 2}


def fault_tasks(tmp_path: Path, seed: int) -> Path:
    script, marks = tmp_path / "evaluator.py", tmp_path / "evaluator-faults"
    script.write_text(EVALUATOR)
    marks.mkdir()
    command = [sys.executable, str(script), str(seed), str(marks)]
    evaluator = CommandEvaluator(command=command, timeout_s=EVALUATOR_TIMEOUT_S)
    tasks = [Task(id=f"t{i}", instructions=f"Say {i}.", evaluator=evaluator) for i in range(6)]
    path = tmp_path / "fault-tasks.jsonl"
    dump_tasks(path, tasks)
    return path


class Run:
    """The live run in a subprocess and what the test reads of its progress."""

    def __init__(self, tmp_path: Path, model_dir: Path, seed: int, steps: int, kind: str) -> None:
        self.dir = tmp_path / "run"
        self._cells: list[int] = []
        self._spawned = 4 if kind == "servers" else 3  # the cells, then the pool's host
        harness = f"{sys.executable} {Path(__file__).parent / 'multi_call_harness.py'}"
        harness += f" {toy_harness.__file__} {CALLS} {{instructions}}"
        command = [sys.executable, "-m", "qwengyre", "train", "--quiet", "--run-dir", str(self.dir)]
        command += overrides(tmp_path, model_dir)
        command += [
            f"harness.tasks={fault_tasks(tmp_path, seed)}",
            f"harness.name={harness}",
            f"run.steps={steps}",
            "run.restarts=1",  # used only when the core dies
            "cells.count=3",
            "cells.capacity=4",  # 12 executions at once: a 2-core machine keeps up
            f"seed={seed}",
        ]
        if kind == "replaced":
            command += ["run.restarts=0", "run.replace_dead_cells=3"]
        env = dict(os.environ)
        if kind == "servers":
            command += ["engine.backend=sglang", "cells.standalone_capacity=2"]
            env["PYTHONPATH"] = os.pathsep.join([str(FAKE_SGLANG), env.get("PYTHONPATH", "")])
            env.pop("QWENGYRE_SGLANG_PYTHON", None)
        self.output = tmp_path / "train.out"
        with self.output.open("wb") as output:
            self.process = subprocess.Popen(
                command, start_new_session=True, stdout=output, stderr=subprocess.STDOUT, env=env
            )

    def said(self) -> str:
        """What the run printed (stdout and stderr)."""
        return self.output.read_text(errors="replace")

    def metrics(self) -> RunMetrics | None:
        return read_metrics(self.dir) if (self.dir / "metrics.jsonl").exists() else None

    def finished(self) -> int:
        """Executions finished so far (lines of ``traces.jsonl``)."""
        traces = self.dir / "traces.jsonl"
        return traces.read_bytes().count(b"\n") if traces.exists() else 0

    def cells(self) -> list[int]:
        """The cells' pids, in rank order (the standalone pool's host last), as first
        seen all alive."""
        if not self._cells:
            found = actor_processes(self.process.pid)
            names = [f"cell-{c}" for c in range(3)] + ["standalone"][: self._spawned - 3]
            self._cells = [found[name] for name in names if name in found]
        assert len(self._cells) == self._spawned, self._cells
        return self._cells

    def server(self, engine: str) -> int | None:
        """The pid of ``engine``'s SGLang server now (None while there is none)."""
        owner = self.cells()[2 if engine == "cell-2" else 3]
        found = [pid for pid, cmd in children(owner).items() if "sglang" in cmd]
        return found[0] if found else None

    def running_harnesses(self) -> dict[str, int]:
        """Execution id -> process group of each harness running now (not finished)."""
        found = {}
        for pgid_file in sorted((self.dir / "logs").glob(f"*/{PGID_FILE}")):
            try:
                pgid = int(pgid_file.read_text())
            except (OSError, ValueError):
                continue  # being written
            if running(pgid):  # its leader: a harness ends with it
                found[pgid_file.parent.name] = pgid
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def roles_now(metrics: RunMetrics) -> dict[int, str]:
    return {r.cell: r.role for r in metrics.roles}


def inject(run: Run, plan: Plan, metrics: RunMetrics) -> None:
    """Do every fault that is due now."""
    steps, roles = len(metrics.steps), roles_now(metrics)
    if plan.kind == "servers":
        due_at = {"cell-2": plan.satellite_training_at, "standalone": plan.satellite_rollout_at}
        for engine, at in due_at.items():
            serving = engine == "standalone" or roles.get(2) == "rollout"
            if engine not in plan.killed_servers and steps >= at and serving:
                kill_server(run, plan, engine, steps)
        victims = []
    else:
        victims = [(1, plan.satellite_training_at, "training")]
        victims += [(2, plan.satellite_rollout_at, "rollout")]
    for cell, at, role in victims:
        if cell not in plan.killed_cells and steps >= at and roles.get(cell) == role:
            kill_cell(run, plan, cell, steps, role)
    if plan.core_due(steps) and roles.get(0) == "training":
        plan.ready_at_core_death = {g.group_id for g in Ledger(run.dir / LEDGER_DIR).groups()}
        kill_cell(run, plan, 0, steps, "training")
    finished = run.finished()
    due = plan.harnesses_at[len(plan.killed_harnesses) :]
    if due and finished >= due[0]:
        harnesses = run.running_harnesses()
        if harnesses:
            victim = plan.harness_picks.choice(sorted(harnesses))
            os.killpg(harnesses[victim], signal.SIGKILL)
            plan.killed_harnesses.append(victim)
            plan.done.append(f"{finished} finished: harness of {victim}")


def kill_cell(run: Run, plan: Plan, cell: int, steps: int, role: str) -> None:
    pid = run.cells()[cell]
    os.kill(pid, signal.SIGKILL)
    plan.killed_cells[cell], plan.steps_at[cell] = pid, steps
    plan.done.append(f"step {steps}: cell {cell} in {role} (pid {pid})")


def kill_server(run: Run, plan: Plan, engine: str, steps: int) -> None:
    pid = run.server(engine)
    if pid is None:
        return  # being started again: later
    os.killpg(pid, signal.SIGKILL)  # the server and what it started
    plan.killed_servers[engine] = pid
    plan.server_steps[engine] = steps
    plan.done.append(f"step {steps}: the SGLang server of {engine} (pid {pid})")


def drive(run: Run, plan: Plan) -> None:
    """Inject the plan's faults as the run progresses, until it ends."""
    deadline = time.monotonic() + WAIT_S
    while run.process.poll() is None:
        assert time.monotonic() < deadline, f"the run did not end within {WAIT_S} s"
        metrics = run.metrics()
        if metrics is not None:
            inject(run, plan, metrics)
        time.sleep(0.05)


@pytest.mark.parametrize("seed", [SEED], ids=lambda s: f"seed={s}")
@pytest.mark.parametrize("kind", KINDS)
def test_a_run_under_seeded_faults_trains_every_ready_group_once(
    seed: int, kind: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``and-the-core``: the core dies too, after both satellites (``run.restarts=1``
    resumes the run: that death is not yet an elastic event); two more steps, so that
    every group ready at its death is trained before the end."""
    print(f"fault injection seed {seed} (replay: QWENGYRE_FAULT_SEED={seed})")
    core = kind == "and-the-core"  # a restart
    replaced = kind == "replaced"
    plan = Plan.draw(seed, kind)
    steps = STEPS + 2 if kind in CORE_DIES else STEPS
    run = Run(tmp_path, tiny_model_dir, seed, steps, kind)
    try:
        drive(run, plan)
    finally:
        run.stop()
        print("faults injected:", *plan.done, sep="\n  ")
    said = run.said()
    assert run.process.returncode == 0, said[-3000:]
    assert plan.complete(), plan.done  # every fault was injected before the run ended

    # A satellite's death was an elastic event: the run went on without it (or with its
    # replacement). The core's resumed the run, or its replacement took over.
    for cell, pid in plan.killed_cells.items():
        died = f"cell-{cell} (pid {pid}) died (exit code -9); "
        if replaced:
            then = f"a new cell-{cell} takes its place"
        else:
            then = "restart 1 of 1: resuming the run" if cell == 0 else "the run goes on without it"
        assert died + then in said, said[-3000:]
        assert not running(pid)
    # A server's death: its host started it again (or, had its cell begun a move to
    # training first, released it as stopped, to start it on the way back).
    metrics = read_metrics(run.dir)
    for engine, pid in plan.killed_servers.items():
        killed_after = metrics.steps[plan.server_steps[engine] - 1].time_s
        moved_dead = engine == "cell-2" and any(  # to training instead: no revival
            r.cell == 2 and r.role == "to_training" and r.time_s >= killed_after
            for r in metrics.roles
        )
        engines_said = [line for line in said.splitlines() if "server" in line or "engine" in line]
        revived = f"{engine}: its engine crashed and was started again" in said
        assert revived or moved_dead, engines_said
        assert not running(pid)
    assert len(metrics.runs) == (2 if core else 1)
    versions = [s.version for s in metrics.steps]
    assert sorted(set(versions)) == list(range(1, steps + 1))
    assert core or versions == list(range(1, steps + 1))

    # Every trained group is a ready group of the ledger, trained exactly once; with the
    # core's death, every group ready when it died is trained (none lost).
    checkpoint = latest_checkpoint(run.dir / "checkpoints")
    assert checkpoint is not None
    state = read_checkpoint(checkpoint).state
    trained = state["trained_groups"]
    assert state["version"] == steps
    assert len(trained) == steps * 2 and len(set(trained)) == len(trained)
    assert set(trained) <= {g.group_id for g in Ledger(run.dir / LEDGER_DIR).groups()}
    assert plan.ready_at_core_death <= set(trained)
    redone = redone_steps(metrics, trained)
    if core:
        # A step the core trained but did not checkpoint died with it: the resumed run
        # trains it again, from the same checkpoint on the same groups, to the same loss.
        resumed = re.search(r"resume: version (\d+),", said)
        assert resumed is not None, said[-3000:]
        assert all(v > int(resumed[1]) for v in redone), (redone, resumed[0])
        for version in redone:
            first, again = [s.loss for s in metrics.steps if s.version == version]
            assert again == pytest.approx(first, rel=1e-4, abs=1e-6), version
    assert core or not redone

    # No surviving harness saw an error: each toy harness run sent no call twice.
    summaries = harness_summaries(run.dir)
    assert summaries and all(" retries=0 " in line + " " for line in summaries), summaries

    # A killed harness's execution ended failed: evaluated, or the placeholder when it had
    # made no model call (an infrastructure failure).
    by_execution: dict[str, list[AssessmentRecord]] = {}
    for record in read_assessments(run.dir / "assessments.jsonl"):
        by_execution.setdefault(record.execution_id, []).append(record)
    traces = [json.loads(t) for t in (run.dir / "traces.jsonl").read_text().splitlines()]
    outcome = {(t["group"], t["index"]): t for t in traces}

    def trace_of(execution: str) -> dict[str, Any] | None:
        records = by_execution.get(execution)
        return outcome.get((records[0].group, records[0].index)) if records else None

    for victim in plan.killed_harnesses:
        trace = trace_of(victim)
        assert trace is not None and trace["outcome"] in ("failed", "cancelled"), (victim, trace)
        if trace["outcome"] == "failed":
            final = by_execution[victim][-1].assessment
            if final.placeholder:
                assert not trace["calls"] and trace["reward"] == 0.0
            else:
                assert final.valid and trace["reward"] == final.score, (victim, final)

    # A faulty evaluation was retried until valid: the reward is the valid attempt's (an
    # execution still being evaluated when the run ended, or the core died, has none).
    faulty = [p.name for p in (tmp_path / "evaluator-faults").iterdir()]
    evaluated = [e for e in faulty if (trace_of(e) or {}).get("outcome") not in (None, "cancelled")]
    assert evaluated, f"no evaluation fault was injected and seen through: {faulty}"
    for execution in evaluated:
        finals = [r.assessment for r in by_execution[execution] if r.assessment.kind == "final"]
        assert not finals[0].valid and finals[-1].valid, (execution, finals)
        assert trace_of(execution)["reward"] == finals[-1].score, execution  # type: ignore[index]

    # Eq 2 holds through the replacements and the servers' deaths (a resume is measured,
    # not asserted).
    measured, predicted = steady_staleness(metrics), metrics.runs[0].predicted_staleness
    print(f"staleness: measured {measured:.3f} in steady state, Eq 2 {predicted:.3f}")
    assert core or abs(measured - predicted) <= 0.25, (measured, predicted)
