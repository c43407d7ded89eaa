"""`qwengyre train` end to end on this machine: real cell processes, the
proxy, the toy harness, the scheduler with the real clock, training and resume.

Rewards come from a grader that flips a coin, so groups have non-zero advantages and
the trainer really trains (the untrained test model cannot solve anything)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from qwengyre.apps.train import TrainOptions, train
from qwengyre.cli import main
from qwengyre.cluster.local import actor_processes
from qwengyre.config import Config, load_config
from qwengyre.presets import preset_path
from qwengyre.proxy.store import Store
from qwengyre.records.assessments import read_assessments
from qwengyre.records.metrics import RunMetrics, read_metrics
from qwengyre.rollout.tasks import CommandEvaluator, Task, dump_tasks
from qwengyre.runtime.controller import HARNESS_START_CHECK, HarnessCannotStart
from qwengyre.runtime.ledger import LEDGER_DIR, Ledger
from qwengyre.training.checkpoint import latest_checkpoint, list_checkpoints, read_checkpoint

pytestmark = pytest.mark.slow

COIN = (
    "import json, random; print(json.dumps({'score': float(random.random() < 0.5), 'valid': True}))"
)


def coin_tasks(path: Path) -> Path:
    evaluator = CommandEvaluator(command=[sys.executable, "-c", COIN], timeout_s=30)
    dump_tasks(
        path,
        [Task(id=f"t{i}", instructions=f"Say {i}.", evaluator=evaluator) for i in range(6)],
    )
    return path


def overrides(tmp_path: Path, model_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"harness.tasks={coin_tasks(tmp_path / 'tasks.jsonl')}",
        "warm_start.accuracy=null",
        "harness.deadline_s=30",
        "harness.budget_s=60",
        "engine.max_context=1024",
        "groups.size=4",
        "groups.batch=2",
        "trainer.lr=1e-3",
        "trainer.micro_step_tokens=512",
        "scheduler.tau_s=0.5",
        *extra,
    ]


def config(tmp_path: Path, model_dir: Path, *extra: str) -> Config:
    return load_config(preset_path("embedded"), overrides(tmp_path, model_dir, *extra))


def run(tmp_path: Path, model_dir: Path, *extra: str) -> Path:
    run_dir = tmp_path / "run"
    options = TrainOptions(
        run_dir=run_dir, config=config(tmp_path, model_dir, *extra), display=False
    )
    asyncio.run(train(options))
    return run_dir


def harness_summaries(run_dir: Path) -> list[str]:
    """The summary line of every toy harness that finished (its calls and retries)."""
    return [
        line
        for log in (run_dir / "logs").glob("*/stderr.log")
        for line in log.read_text().splitlines()
        if line.startswith("toy harness:")
    ]


def test_elastic_run_trains_every_group_once_and_moves_cells(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = run(tmp_path, tiny_model_dir, "run.steps=3", "checkpoint.keep=3")
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1, 2, 3]
    assert sum(s.micro_steps for s in metrics.steps) > 0  # coin rewards: real gradients
    # Each step's time in micro-steps and in its update, as `plan` reads them.
    assert all(0 < s.update_s < s.train_s for s in metrics.steps)
    assert all(s.micro_step_s > 0 for s in metrics.steps if s.micro_steps)
    assert all(s.rewards >= 2 * 2 for s in metrics.steps)  # B=2 groups, >= 2 valid each
    # The importance ratios of what trained: near 1 (E[d] <= 1 step off), KL >= 0.
    for step in (s for s in metrics.steps if s.micro_steps):
        assert 0.5 < step.ratio_mean < 2.0 and 0.0 <= step.kl < 1.0, step
    trained = [g.group_id for g in metrics.groups]
    assert len(trained) == 3 * 2 and len(set(trained)) == len(trained)
    ledger = {g.group_id for g in Ledger(run_dir / LEDGER_DIR).groups()}
    assert set(trained) <= ledger  # a group is durable before it trains
    # Elastic: the core moved from rollout to training, with a measured switch time.
    assert [r.role for r in metrics.roles if r.cell == 0][:3] == [
        "rollout",
        "to_training",
        "training",
    ]
    assert metrics.switches[0].cell == 0 and metrics.switches[0].to == "training"
    assert all(0 < s.seconds < 60 for s in metrics.switches)
    checkpoints = list_checkpoints(run_dir / "checkpoints")  # one per step, three kept
    assert [read_checkpoint(c).state["version"] for c in checkpoints] == [1, 2, 3]
    assert read_checkpoint(checkpoints[-1]).state["trained_groups"] == trained
    traces = [json.loads(t) for t in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert len(traces) >= 3 * 2 * 4
    # Every evaluated execution's assessments are kept with it in the run directory.
    kept = read_assessments(run_dir / "assessments.jsonl")
    assessed = {(r.group, r.index) for r in kept if r.assessment.kind == "final"}
    evaluated = {(t["group"], t["index"]) for t in traces if t["outcome"] == "completed"}
    assert evaluated and evaluated <= assessed
    assert all(r.assessment.evaluator == "command" for r in kept)
    # Executions cancelled when the run ended may not have called the model yet.
    assert all(t["calls"] for t in traces if t["outcome"] == "completed")
    # No harness saw an error while cells moved (docs/design.md §4): every finished toy
    # harness says it sent no call twice.
    summaries = harness_summaries(run_dir)
    assert len(summaries) >= 3 * 2 * 4
    assert all(" retries=0 " in line + " " for line in summaries), summaries
    # `qwengyre plan` replays this run's trace with its own config and costs.
    planned = tmp_path / "plan.yaml"
    assert main(["plan", "--trace", str(run_dir), "sim.steps=3", "--out", str(planned)]) == 0
    recommended = load_config(planned)
    assert (recommended.groups.size, recommended.sim.workload) == (4, "trace")
    publications = [p.seconds for p in metrics.publications]
    assert recommended.sim.publish_s == pytest.approx(sum(publications) / len(publications))
    assert recommended.sim.micro_step_tokens == 512


def test_train_takes_rl_steps_on_the_bundled_swe_example(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`qwengyre train --tasks swe:example`: every execution's workspace is the bundled
    repository at its base commit and is graded by its hidden tests (the toy harness
    fixes no bug: each score is a valid 0, the log naming the failing test)."""
    argv = [o for o in overrides(tmp_path, tiny_model_dir) if not o.startswith("harness.tasks=")]
    run_dir = tmp_path / "run"
    command = ["train", "--quiet", "--run-dir", str(run_dir), "--tasks", "swe:example"]
    code = main([*command, *argv, "run.steps=1", "groups.size=2"])
    assert code == 0, capsys.readouterr().err[-2000:]
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1]  # run.steps=1 below
    traces = [json.loads(t) for t in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert {t["query"] for t in traces} <= {"calc-clamp", "calc-median"}
    finals = [
        r for r in read_assessments(run_dir / "assessments.jsonl") if r.assessment.kind == "final"
    ]
    assert len(finals) >= 2 * 2  # groups.batch=2 groups of groups.size=2
    failing = {
        "calc-clamp": "not passing: tests/test_ranges.py::test_clamp_below",
        "calc-median": "not passing: tests/test_stats.py::test_median_even",
    }
    for record in finals:
        assessment = record.assessment
        assert assessment.valid and assessment.score == 0.0 and assessment.evaluator == "command"
        assert failing[record.task_id] in assessment.critique


def test_async_keeps_the_roles_fixed(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_dir = run(tmp_path, tiny_model_dir, "run.steps=2", "scheduler.policy=async")
    metrics = read_metrics(run_dir)
    assert len(metrics.steps) == 2 and not metrics.switches
    assert all(s.cells == 1 for s in metrics.steps)  # the one fixed training cell
    first = {r.cell: r.role for r in metrics.roles if r.time_s == 0.0}
    assert first == {0: "rollout", 1: "rollout", 2: "rollout"}
    assert {(r.cell, r.role) for r in metrics.roles if r.time_s > 0} <= {(0, "training")}


def sampled_versions(run_dir: Path) -> set[int]:
    """The policy versions of every token the run's engines sampled."""
    store = Store(run_dir / "proxy.sqlite")
    try:
        calls = [call for ex in store.executions() for call in store.calls(ex.id)]
        return {v for node, _ in calls for v in node.versions}
    finally:
        store.close()


def start_train(
    tmp_path: Path, model_dir: Path, steps: int, *extra: str
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "qwengyre", "train", "--quiet"]
    command += ["--run-dir", str(tmp_path / "run"), *overrides(tmp_path, model_dir)]
    command += [f"run.steps={steps}", *extra]
    return subprocess.Popen(
        command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def wait_for_checkpoint(process: subprocess.Popen[bytes], run_dir: Path, version: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        checkpoint = latest_checkpoint(run_dir / "checkpoints")
        if checkpoint is not None and read_checkpoint(checkpoint).state["version"] >= version:
            return
        assert process.poll() is None, process.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        time.sleep(0.2)
    pytest.fail(f"no checkpoint at version {version} within 240 s")


def resume_and_check(run_dir: Path, steps: int) -> None:
    """Resume to ``steps``: nothing trained twice, nothing finished lost."""
    before = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state  # type: ignore[arg-type]
    finished_before = {g.group_id for g in Ledger(run_dir / LEDGER_DIR).groups()}

    asyncio.run(train(TrainOptions(run_dir=run_dir, resume=True, display=False)))

    after = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state  # type: ignore[arg-type]
    assert after["version"] == steps
    trained = after["trained_groups"]
    assert trained[: len(before["trained_groups"])] == before["trained_groups"]
    assert len(set(trained)) == len(trained)  # none twice
    # Every group that had finished before the stop and was not trained is trained now
    # (oldest version first, so they lead the resumed steps).
    waiting = finished_before - set(before["trained_groups"])
    assert waiting <= set(trained)
    # A step trained but not checkpointed when the run stopped is trained again, on the
    # same groups: only the one after the checkpoint resumed from.
    assert redone_steps(read_metrics(run_dir), trained) <= {before["version"] + 1}

    # A complete run is not resumed again: it says so and leaves its records as they are.
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=f"is complete: version {steps} of run.steps={steps}"):
        asyncio.run(train(TrainOptions(run_dir=run_dir, resume=True, display=False)))
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def children(pid: int) -> dict[int, str]:
    """Child processes of ``pid``: their command lines."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid:
            found[int(stat.parent.name)] = cmdline
    return found


def redone_steps(metrics: RunMetrics, trained: Sequence[int]) -> set[int]:
    """The versions trained twice: a step the core trained but had not checkpointed when
    it died is trained again by the restart, on the same groups. Checks that the groups
    recorded are those ``trained``, and only those of such a step more than once."""
    counts = Counter(g.group_id for g in metrics.groups)
    assert set(counts) == set(trained)
    versions = [s.version for s in metrics.steps]
    redone = {v for v in versions if versions.count(v) == 2}
    assert {g for g, n in counts.items() if n > 1} == {
        g.group_id for g in metrics.groups if g.step + 1 in redone
    }, versions
    return redone


def cell_pids(process: subprocess.Popen[bytes]) -> list[int]:
    """The pids of the cells of the run ``process``, in rank order."""
    found = actor_processes(process.pid)
    return [found[f"cell-{c}"] for c in range(len(found)) if f"cell-{c}" in found]


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run's whole process group and wait until every member has exited:
    ``wait()`` reaps the leader only, and a member that has not exited yet may still
    hold an open file such as the run directory's lock (a resume would be refused)."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def test_a_killed_run_resumes_without_losing_or_repeating_a_group(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    process = start_train(tmp_path, tiny_model_dir, steps=6)
    wait_for_checkpoint(process, tmp_path / "run", version=2)
    kill_group(process)
    resume_and_check(tmp_path / "run", steps=6)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find cells")
def test_a_dead_cell_stops_the_run_naming_it_and_the_run_resumes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    process = start_train(tmp_path, tiny_model_dir, steps=4)
    wait_for_checkpoint(process, tmp_path / "run", version=1)
    cells = cell_pids(process)
    assert len(cells) == 3
    os.kill(cells[0], signal.SIGKILL)  # the core: the optimizer dies with it
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    assert f"cell-0 (pid {cells[0]}) died" in stderr.decode()
    assert not any(running(pid) for pid in cells[1:])  # the other cells stopped too
    resume_and_check(tmp_path / "run", steps=4)


def wait_for_rollout(process: subprocess.Popen[bytes], run_dir: Path) -> None:
    """Until executions run and no group has finished yet: every cell serves rollout."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists():
            metrics = read_metrics(run_dir)
            if any(load.running for load in metrics.loads):
                assert not metrics.steps and not metrics.switches, "too late: one moved"
                return
        assert process.poll() is None, process.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        time.sleep(0.05)
    pytest.fail("no execution ran within 240 s")


def lose_cell(
    process: subprocess.Popen[bytes],
    run_dir: Path,
    cell: int,
    steps: int,
) -> tuple[RunMetrics, list[int]]:
    """SIGKILL cell ``cell``: the run goes on without it and trains its ``steps`` steps
    with no restart, no group lost or trained twice, and no harness saw an error (a call
    at the dead engine went on elsewhere, or waited for an engine); its metrics and the
    cells' pids. (Replacements, and the core's death with a restart left:
    tests/test_fault_injection.py.)"""
    cells = cell_pids(process)
    os.kill(cells[cell], signal.SIGKILL)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr.decode()[-2000:]
    said = f"cell-{cell} (pid {cells[cell]}) died (exit code -9); the run goes on without it"
    assert said in stderr.decode(), stderr.decode()[-3000:]
    metrics = read_metrics(run_dir)
    assert len(metrics.runs) == 1
    assert [s.version for s in metrics.steps] == list(range(1, steps + 1))
    trained = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state["trained_groups"]  # type: ignore[arg-type]
    assert len(trained) == steps * 2 and len(set(trained)) == len(trained)
    counts = Counter(g.group_id for g in metrics.groups)
    assert set(counts) == set(trained) and set(counts.values()) == {1}
    summaries = harness_summaries(run_dir)
    assert summaries and all(" retries=0 " in line + " " for line in summaries), summaries
    return metrics, cells


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find cells")
def test_a_run_goes_on_without_a_rollout_cell_that_died(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Cell 1 dies serving rollout, before any cell moved: the run trains every step
    without a restart; the core and cell 2 re-form their groups without it, and cell 2
    trains with the core (training is a prefix of the live cells)."""
    run_dir = tmp_path / "run"
    process = start_train(tmp_path, tiny_model_dir, 4)
    wait_for_rollout(process, run_dir)
    metrics, cells = lose_cell(process, run_dir, 1, 4)
    roles = {cell: [r.role for r in metrics.roles if r.cell == cell] for cell in range(3)}
    assert roles[1] == ["rollout", "lost"]
    assert "training" in roles[0] and "training" in roles[2], roles
    assert any(s.cells == 2 for s in metrics.steps), metrics.steps  # the core and cell 2
    assert not running(cells[1])


def wait_for_role(process: subprocess.Popen[bytes], run_dir: Path, cell: int, role: str) -> None:
    """Until cell ``cell`` entered ``role``."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        metrics = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else None
        if metrics and any(r.cell == cell and r.role == role for r in metrics.roles):
            return
        assert process.poll() is None, process.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        time.sleep(0.05)
    pytest.fail(f"cell {cell} was not in {role} within 240 s")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find cells")
def test_the_only_rollout_cell_dies_and_the_core_comes_back_to_serve_and_train(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two cells: cell 1 serves alone while the core trains, and dies. The core leaves
    its step for rollout (its micro-steps go back on the queue), serves the executions
    cell 1 had, and trains again when rollout allows: every step, no restart."""
    run_dir = tmp_path / "run"
    process = start_train(tmp_path, tiny_model_dir, 3, "cells.count=2")
    wait_for_role(process, run_dir, 0, "training")
    metrics, _ = lose_cell(process, run_dir, 1, 3)
    assert all(s.cells == 1 for s in metrics.steps)  # the core alone
    roles = {cell: [r.role for r in metrics.roles if r.cell == cell] for cell in range(2)}
    assert roles[1][-1] == "lost" and "to_rollout" in roles[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find cells")
def test_a_training_satellite_that_dies_leaves_its_step_to_the_others(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Cell 1 dies once it trains: the micro-steps it claimed go back to the cells that
    stay, the core and cell 2 re-form their groups without it, and the run trains every
    step without a restart, on at most those two."""
    run_dir = tmp_path / "run"
    process = start_train(tmp_path, tiny_model_dir, 4)
    wait_for_role(process, run_dir, 1, "training")
    metrics, _ = lose_cell(process, run_dir, 1, 4)
    lost = next(r.time_s for r in metrics.roles if r.cell == 1 and r.role == "lost")
    assert all(s.cells <= 2 for s in metrics.steps if s.time_s > lost)


def served_calls(run_dir: Path) -> list[tuple[str, int]]:
    """(engine, newest policy version in its output) of every recorded model call."""
    store = Store(run_dir / "proxy.sqlite")
    try:
        return [
            (node.meta.engine, max(node.versions, default=-1))
            for execution in store.executions()
            for node, _ in store.calls(execution.id)
        ]
    finally:
        store.close()


def test_a_standalone_pool_serves_first_and_gets_every_publication(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = run(
        tmp_path,
        tiny_model_dir,
        "run.steps=2",
        "cells.standalone_capacity=3",
        "scheduler.target_staleness=0.5",  # mu = 1: a publication after step 1
    )
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1, 2]
    calls = served_calls(run_dir)
    by_engine = Counter(engine for engine, _ in calls)
    assert by_engine["standalone"] > 0, by_engine  # the scheduler launches there first
    # The core's publication reaches the pool: it serves version 1 after step 1.
    assert max(v for engine, v in calls if engine == "standalone") >= 1, calls
    assert metrics.run is not None and metrics.run.standalone_capacity == 3


def test_cells_of_two_ranks_train_live(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Two cells of two FSDP2 ranks each: every step trains, engines serve the core's
    # sharded weights, and each checkpoint holds one shard file per core rank.
    run_dir = run(
        tmp_path, tiny_model_dir, "run.steps=3", "cells.count=2", "cells.devices_per_cell=2"
    )
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1, 2, 3]
    assert sum(s.micro_steps for s in metrics.steps) > 0
    trained = [g.group_id for g in metrics.groups]
    assert len(trained) == 3 * 2 and len(set(trained)) == len(trained)
    versions = sampled_versions(run_dir)
    assert versions - {0}, versions  # sampled with weights the core published as shards
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and read_checkpoint(checkpoint).state["version"] == 3
    assert len(list((checkpoint / "weights").glob("*.distcp"))) == 2


def test_a_moe_policy_trains_live_in_cells_of_two_ranks_and_its_checkpoint_exports(
    tiny_moe_model_dir: Path, tmp_path: Path
) -> None:
    # The tiny Qwen3-MoE in two cells of two FSDP2 ranks (each rank half the experts):
    # both steps train, and the checkpoint the core's two ranks wrote exports through
    # the CLI into a directory transformers loads with the checkpoint's own weights.
    from transformers import AutoModelForCausalLM

    from qwengyre.config import TrainerConfig
    from qwengyre.training.checkpoint import load_sharded
    from qwengyre.training.distributed import CellComm
    from qwengyre.training.trainer import Trainer

    run_dir = run(
        tmp_path, tiny_moe_model_dir, "run.steps=2", "cells.count=2", "cells.devices_per_cell=2"
    )
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1, 2]
    assert sum(s.micro_steps for s in metrics.steps) > 0
    # The engines' routing reached the ledger and was replayed in the cells' forwards.
    ledger = sorted((run_dir / "ledger").glob("group-*.npz"))
    with np.load(ledger[0]) as group:
        assert group["routing"].shape[1:] == (2, 2) and (group["routing"] >= 0).any()
    # A step with no learning signal (every group's rewards equal) packs nothing: its
    # drift is NaN. Every step that trained replayed routing: a share of its choices.
    drift = [(s.learning_signal, s.routing_drift) for s in metrics.steps]
    assert all(0 <= d <= 1 if trained else math.isnan(d) for trained, d in drift), drift
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and read_checkpoint(checkpoint).state["version"] == 2
    assert len(list((checkpoint / "weights").glob("*.distcp"))) == 2

    out = tmp_path / "exported"
    assert main(["model", "export", str(run_dir), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    # The same checkpoint resumed by one rank holds exactly the exported weights.
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir)
    resumed = Trainer(model, TrainerConfig(), CellComm(0, 1, ""))
    load_sharded(checkpoint, resumed)
    saved = resumed.parameters()
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir).named_parameters())
    for name, tensor in exported.named_parameters():
        assert torch.equal(tensor, saved[name]), name
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(saved[experts], initial[experts])  # the experts were trained
    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir).eval()
    loaded = reference.load_state_dict(saved, strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}  # tied
    ids = torch.tensor([[5, 17, 300, 42, 9, 800, 3, 77]])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_vllm_cells_serve_rollout_and_take_every_publication(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``engine.backend=vllm``: each cell's rollout server is a real vLLM server; the
    core's weights reach it through disk after every update (async: the rollout cell
    never moves, so every step is a publication to a running server)."""
    python = os.environ.get("QWENGYRE_VLLM_PYTHON")
    if not python:
        pytest.skip("QWENGYRE_VLLM_PYTHON is not set (the python of a vLLM venv)")
    from qwengyre.engines.vllm import vllm_available

    if not vllm_available(python):
        pytest.skip(f"QWENGYRE_VLLM_PYTHON={python} cannot import vllm")
    from qwengyre.models import cached_tiny_model

    # The demo model: vLLM's CPU attention has no kernel for the test model's head size.
    demo = cached_tiny_model("demo", cache_dir=tiny_model_dir.parent)
    run_dir = run(
        tmp_path,
        demo,
        "run.steps=3",
        "cells.count=2",
        "engine.backend=vllm",
        "scheduler.policy=async",
        "scheduler.async_training_cells=1",
    )
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1, 2, 3]
    assert sum(s.micro_steps for s in metrics.steps) > 0
    versions = sampled_versions(run_dir)
    assert versions - {0}, versions  # tokens sampled by vLLM after a publication
    trained = [g.group_id for g in metrics.groups]
    assert len(trained) == 3 * 2 and len(set(trained)) == len(trained)


def test_crashed_sglang_servers_are_started_again_and_the_run_goes_on(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cell 1's server and the standalone pool's (the fake SGLang) are killed while they
    serve rollout: the proxy drains them, their hosts start them again at the same
    address, the proxy takes them back, and the run trains every step."""
    fake = Path(__file__).parent / "fake_sglang"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("QWENGYRE_SGLANG_PYTHON", raising=False)
    run_dir, killed = tmp_path / "run", []

    def crash_cell_1_and_the_pool() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            metrics = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else None
            if metrics is not None and any(load.running for load in metrics.loads):
                assert not metrics.switches, "too late: a cell moved"
                spawned = actor_processes(os.getpid())
                for owner in (spawned["cell-1"], spawned["standalone"]):
                    (server,) = [c for c, cmd in children(owner).items() if "sglang" in cmd]
                    os.killpg(server, signal.SIGKILL)
                    killed.append(server)
            time.sleep(0.05)

    crasher = threading.Thread(target=crash_cell_1_and_the_pool)
    crasher.start()
    caplog.set_level(logging.INFO, logger="qwengyre")
    try:
        run(
            tmp_path,
            tiny_model_dir,
            "run.steps=2",
            "cells.count=2",
            "cells.standalone_capacity=2",
            "engine.backend=sglang",
        )
    finally:
        crasher.join()
    assert len(killed) == 2 and not any(running(pid) for pid in killed)
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1, 2]
    said = {r.getMessage() for r in caplog.records}

    def revived(engine: str) -> bool:
        return {
            f"{engine}: its engine crashed and was started again",
            f"engine {engine} is healthy again: it accepts calls",  # either first
        } <= said

    assert revived("standalone")
    # Cell 1 is revived where it serves, or, when it moves to training first (a loaded
    # machine), released as stopped and started again when it returns to rollout (if
    # the run lasts until then).
    moved = [r for r in metrics.roles if r.cell == 1 and r.role == "to_training"]
    assert revived("cell-1") or moved, said


def test_sglang_cells_switch_roles_and_take_every_publication(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``engine.backend=sglang``, with a stand-in for SGLang's launcher that serves
    qwengyre's own engine behind SGLang's HTTP API (tests/fake_sglang: real SGLang needs
    CUDA): each cell launches its server, the core's weights reach it after every
    update, and a cell moving to training releases the server's memory (elastic)."""
    fake = Path(__file__).parent / "fake_sglang"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("QWENGYRE_SGLANG_PYTHON", raising=False)
    run_dir = run(
        tmp_path,
        tiny_model_dir,
        "run.steps=2",
        "cells.count=2",
        "engine.backend=sglang",
        "scheduler.target_staleness=null",
        "scheduler.mu=1",  # a publication after step 1 that step 2's rollout samples with
        "scheduler.phi=0",
    )
    metrics = read_metrics(run_dir)
    assert [s.version for s in metrics.steps] == [1, 2]
    assert metrics.run is not None and metrics.run.engine_backend == "sglang"
    assert sampled_versions(run_dir) - {0}  # tokens the servers sampled after a publication
    moves = [s for s in metrics.switches if s.to == "training"]
    assert moves and {s.engine for s in moves} == {"asleep"}  # SGLang's memory release


def test_a_harness_that_fails_before_any_model_call_stops_the_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Installed but broken (here: it exits 3 at once): the run stops after its first
    executions with the harness's own last words, instead of training on zeros."""
    broken = tmp_path / "broken-agent"
    broken.write_text("#!/bin/sh\necho 'error: no API configuration found' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(HarnessCannotStart) as stopped:
        run(
            tmp_path,
            tiny_model_dir,
            f"harness.name={broken} {{instructions}}",
            "harness.sandbox=none",
            "run.steps=2",
        )
    message = str(stopped.value)
    assert f"harness '{broken}' failed in each of the first {HARNESS_START_CHECK}" in message
    assert "error: no API configuration found" in message
    metrics = read_metrics(tmp_path / "run")
    assert not metrics.steps  # nothing trained on the placeholders' zeros
