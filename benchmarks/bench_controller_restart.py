"""What a controller death costs: executions and model calls thrown away, and the time
from ``qwengyre train --resume`` to the next training step.

``qwengyre train`` runs the embedded config (tiny model, coin-flip rewards, the paced
harness: 4 model calls a second apart, :mod:`qwengyre.rollout.paced_harness`). Once
it has checkpointed step 1 and ``--in-flight`` executions have made some but not all
of their calls, its whole process group is SIGKILLed (cells included), then the run is
resumed from the command line. Two scenarios, in one run of this script:

- ``adopt``: only the controller's group dies; the harness daemon lives on and the
  resumed run re-adopts what still runs;
- ``lose all``: the harness daemon is killed too, so the resumed run finds none of the
  harnesses (what every controller death cost before the daemon: each in-flight
  execution thrown away and run again).

    python benchmarks/bench_controller_restart.py [--steps 3] [--in-flight 4]
    python benchmarks/bench_controller_restart.py --smoke   # adopt only, 2 steps
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _smoke import parse
from qwengyre.proxy.store import Store
from qwengyre.records.metrics import read_metrics
from qwengyre.rollout import paced_harness
from qwengyre.rollout.harnessd import daemon_pid, recorded_states
from qwengyre.rollout.tasks import CommandEvaluator, Task, dump_tasks
from qwengyre.training.checkpoint import latest_checkpoint, read_checkpoint

COIN = (
    "import json, random; print(json.dumps({'score': float(random.random() < 0.5), 'valid': True}))"
)


SCENARIOS = {"adopt": False, "lose all": True}
"""Each scenario, and whether the harness daemon is killed too."""


def settings(root: Path, steps: int) -> list[str]:
    tasks = root / "tasks.jsonl"
    coin = CommandEvaluator(command=[sys.executable, "-c", COIN], timeout_s=30)
    dump_tasks(
        tasks, [Task(id=f"t{i}", instructions=f"Say {i}.", evaluator=coin) for i in range(6)]
    )
    return [
        f"harness.tasks={tasks}",
        f"harness.name={sys.executable} {paced_harness.__file__} {{instructions}}",
        "model.tiny_size=test",
        "warm_start.accuracy=null",
        "harness.deadline_s=400",
        "harness.budget_s=500",
        "engine.max_context=1024",
        "groups.size=4",
        "groups.batch=2",
        "cells.capacity=4",
        "trainer.micro_step_tokens=512",
        f"run.steps={steps}",
    ]


def calls_made(run_dir: Path, execution_id: str) -> int:
    path = run_dir / "workspaces" / execution_id / "calls"
    return len(path.read_text()) if path.exists() else 0


def in_flight(run_dir: Path) -> list[str]:
    """Executions whose harness runs and has made some but not all of its calls."""
    return [
        eid
        for eid, state in recorded_states(run_dir).items()
        if state.running and 0 < calls_made(run_dir, eid) < 4
    ]


def scenario(root: Path, steps: int, wanted: int, kill_daemon: bool) -> dict[str, float]:
    run_dir = root / "run"
    command = [sys.executable, "-m", "qwengyre", "train", "--quiet"]
    train = subprocess.Popen(
        [*command, "--run-dir", str(run_dir), *settings(root, steps)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while True:
        checkpoint = latest_checkpoint(run_dir / "checkpoints")
        trained = checkpoint is not None and read_checkpoint(checkpoint).state["version"] >= 1
        if trained and len(flying := in_flight(run_dir)) >= wanted:
            break
        if train.poll() is not None:
            raise RuntimeError(f"qwengyre train ended early with {train.returncode}")
        time.sleep(0.05)
    os.killpg(train.pid, signal.SIGKILL)
    train.wait()
    if kill_daemon and (pid := daemon_pid(run_dir)) is not None:
        os.kill(pid, signal.SIGKILL)
    before = read_metrics(run_dir)
    steps_before, runs_before = len(before.steps), len(before.runs)
    store = Store(run_dir / "proxy.sqlite")
    calls_at_kill = {eid: len(store.calls(eid)) for eid in flying}
    store.close()

    started = time.monotonic()
    log = (root / "resume.log").open("w")  # a file: a pipe nobody reads would stall it
    resume = subprocess.Popen(
        [*command, "--resume", str(run_dir)], stdout=log, stderr=subprocess.STDOUT
    )
    first_step = proxy_up = None
    while resume.poll() is None:
        metrics = read_metrics(run_dir)
        if proxy_up is None and len(metrics.runs) > runs_before:
            proxy_up = time.monotonic() - started
        if first_step is None and len(metrics.steps) > steps_before:
            first_step = time.monotonic() - started
        time.sleep(0.2)
    log.close()
    if resume.returncode != 0:
        raise RuntimeError((root / "resume.log").read_text()[-2000:])
    kept = [
        eid for eid, state in recorded_states(run_dir).items() if eid in flying and not state.lost
    ]
    kept = [
        eid
        for eid in kept
        if (run_dir / "workspaces" / eid / "starts").read_text().count("\n") == 1
    ]
    lost = [eid for eid in flying if eid not in kept]
    return {
        "in flight": len(flying),
        "thrown away": len(lost),
        "calls thrown away": sum(calls_at_kill[eid] for eid in lost),
        "resume to proxy s": proxy_up if proxy_up is not None else float("nan"),
        "resume to step s": first_step if first_step is not None else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=4, help="executions in flight at the kill")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each scenario, interleaved")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    args = parse(parser, steps=2, in_flight=1, scenarios=["adopt"])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.scenarios}
    for _ in range(args.repeat):
        for name in args.scenarios:
            with tempfile.TemporaryDirectory() as root:
                killed = SCENARIOS[name]
                runs[name].append(scenario(Path(root), args.steps, args.in_flight, killed))
    rows = {
        name: {c: statistics.median(r[c] for r in rs) for c in rs[0]} for name, rs in runs.items()
    }
    columns = list(next(iter(rows.values())))
    print(f"medians of {args.repeat} run(s) each")
    print(f"{'':10}" + "".join(f"{c:>20}" for c in columns))
    for name, row in rows.items():
        print(f"{name:10}" + "".join(f"{row[c]:>20.1f}" for c in columns))
    if len(rows) < 2:
        return
    a, b = rows["adopt"], rows["lose all"]
    print(
        f"thrown away: {a['thrown away']:.0f} of {a['in flight']:.0f} with adoption against"
        f" {b['thrown away']:.0f} of {b['in flight']:.0f} without; --resume to the next step"
        f" {a['resume to step s']:.1f} s against {b['resume to step s']:.1f} s"
        f" (ratio {a['resume to step s'] / b['resume to step s']:.2f})"
    )


if __name__ == "__main__":
    main()
