"""Intermediate assessments: the proxy endpoint, artifact versions, critique provenance, the log."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest
from tests.test_proxy_server import Running, start

from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.records.assessments import (
    Assessment,
    AssessmentLog,
    AssessmentRecord,
    read_assessments,
)
from qwengyre.rollout.assessments import ArtifactVersions, AssessmentUnavailable
from qwengyre.rollout.evaluation import final, placeholder
from qwengyre.rollout.execution import Budgets, ExecutionResult, run_execution
from qwengyre.rollout.harness import harness_spec
from qwengyre.rollout.tasks import PythonEvaluator, Task
from qwengyre.rollout.toy_harness import CRITIQUE_PREFIX
from qwengyre.trajectories.selection import admit_execution

MARK = "CRITIQUE-MARK"


def grade(workspace: Path, metadata: dict[str, Any]) -> dict[str, Any]:
    """Half a point per file; its critique names the files (and carries MARK)."""
    names = sorted(p.name for p in workspace.iterdir())
    return {"score": len(names) / 2, "valid": True, "critique": f"{MARK} files: {names}"}


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SCRIPT = {
    "main.task": [
        call("write_file", path="a.txt", content="alpha"),
        call("write_file", path="b.txt", content="beta"),
        "Done.",
    ],
    "main.summary": ["Summary: wrote a.txt and b.txt."],
}
TASK = Task(
    id="two-files",
    instructions="Write a.txt and b.txt.",
    evaluator=PythonEvaluator(callable="tests.test_rollout_assessments:grade"),
)


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), SCRIPT)
    yield from start(tmp_path / "proxy", tiny_model_dir, engines=[engine], max_context=1_000_000)


def _run(proxy: Running, run_dir: Path, harness: str) -> tuple[dict[str, str], ExecutionResult]:
    ex = proxy.new_execution()
    result = proxy.run(
        run_execution(
            TASK,
            harness_spec(harness, 25),
            Budgets(25, 28),
            execution_id=ex["id"],
            run_dir=run_dir,
            base_url=ex["base_url"],
            api_key=ex["key"],
            hub=proxy.server,
        )
    )
    return ex, result


@pytest.mark.parametrize("role", ["user", "assistant"])
def test_critiques_are_kept_per_version_and_are_never_training_targets(
    proxy: Running, tmp_path: Path, role: str
):
    harness = "toy-critique" if role == "user" else "toy-critique-assistant"
    ex, result = _run(proxy, tmp_path / "run", harness)
    assert result.harness is not None and result.harness.exit_code == 0, result
    # Two tool turns: two intermediate assessments of two workspace versions, then the
    # final one, which alone gives the reward.
    kinds = [a.kind for a in result.assessments]
    assert kinds == ["intermediate", "intermediate", "final"], result.assessments
    first, second, last = result.assessments
    assert (first.version, second.version) == (1, 2)
    assert first.artifact != second.artifact and first.score == 0.5 and second.score == 1.0
    assert "a.txt" in first.critique and "b.txt" not in first.critique  # not overwritten
    assert first.branch is not None and second.branch is not None and first.branch < second.branch
    assert last.version == 2 and last.artifact == second.artifact  # the same state
    assert result.reward == 1.0 and final(result.assessments) is last

    # The critique went into the next request, as recorded input only.
    tokenizer: Any = proxy.tokenizer
    tree = proxy.run(proxy.server.tree(ex["id"]))
    inputs = [tokenizer.decode(list(n.input_ids)) for n in tree.nodes]
    outputs = [tokenizer.decode(list(n.output_ids)) for n in tree.nodes]
    assert sum(MARK in text for text in inputs) >= 2
    assert not any(MARK in text or CRITIQUE_PREFIX in text for text in outputs)
    carrying = next(n for n, text in zip(tree.nodes, inputs, strict=True) if MARK in text)
    provenance = carrying.to_json()["provenance"]
    assert set(provenance[: len(carrying.input_ids)]) == {0}  # injected
    # Admitted trajectories hold the critique in their context, never in their targets.
    admitted = admit_execution(tree, ex["id"], 1.0, j_max=5, rng=random.Random(0))
    with_critique = 0
    for row in admitted:
        targets = [t for t, m in zip(row.input_ids, row.target_mask, strict=True) if m]
        assert MARK not in tokenizer.decode(targets)
        with_critique += MARK in tokenizer.decode(list(row.input_ids))
    assert with_critique >= 1


def test_the_endpoint_refuses_other_keys_unknown_executions_and_idle_ones(proxy: Running):
    mine, other = proxy.new_execution(), proxy.new_execution()

    def post(execution_id: str, key: str) -> httpx2.Response:
        url = f"{proxy.url}/x/{execution_id}/assess"
        return httpx2.post(url, headers={"authorization": f"Bearer {key}"}, timeout=30)

    async def answer(branch: int | None) -> dict[str, Any]:
        return {"score": 1.0, "valid": True, "critique": "ok", "branch": branch}

    async def gone(branch: int | None) -> dict[str, Any]:
        raise AssessmentUnavailable("the execution's harness has ended")

    proxy.server.register_assessor(mine["id"], answer)
    ok = post(mine["id"], mine["key"])
    assert ok.status_code == 200 and ok.json() == {
        "score": 1.0,
        "valid": True,
        "critique": "ok",
        "branch": None,  # no model call recorded yet
    }
    refused = post(mine["id"], other["key"])
    assert refused.status_code == 403
    assert "another execution" in refused.json()["error"]["message"]
    unknown = post("ex_nope", mine["key"])
    assert unknown.status_code == 404 and "no execution" in unknown.json()["error"]["message"]
    assert post(mine["id"], "qg-wrong").status_code == 401
    idle = post(other["id"], other["key"])  # nothing registered: its harness is not running
    assert idle.status_code == 404 and "no evaluator" in idle.json()["error"]["message"]
    proxy.server.register_assessor(mine["id"], gone)
    ended = post(mine["id"], mine["key"])
    assert ended.status_code == 404 and "harness has ended" in ended.json()["error"]["message"]
    proxy.server.unregister_assessor(mine["id"])
    assert post(mine["id"], mine["key"]).status_code == 404
    proxy.admin("DELETE", f"/admin/executions/{mine['id']}")
    assert post(mine["id"], mine["key"]).status_code == 401  # revoked


# --------------------------------------------------------------------------- no proxy


class FakeHub:
    """Stands in for the proxy: holds the registered assessor; a tree of ``calls`` nodes."""

    def __init__(self, calls: int = 0) -> None:
        self.assessors: dict[str, Any] = {}
        self.calls = calls

    def register_assessor(self, execution_id: str, assessor: Any) -> None:
        self.assessors[execution_id] = assessor

    def unregister_assessor(self, execution_id: str) -> None:
        self.assessors.pop(execution_id, None)

    async def tree(self, execution_id: str) -> Any:
        return SimpleNamespace(nodes=list(range(self.calls)))


async def _wait_for(predicate: Any, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < end, "timed out waiting"
        await asyncio.sleep(0.02)


def test_versions_follow_digests_and_later_assessments_overwrite_nothing(tmp_path: Path):
    signals = tmp_path / "signals"
    signals.mkdir()
    code = f"""
import pathlib, time
signals = pathlib.Path({str(signals)!r})
def wait(name):
    while not (signals / name).exists():
        time.sleep(0.01)
open('a.txt', 'w').write('1')
wait('go')
open('b.txt', 'w').write('2')
wait('done')
"""
    harness = harness_spec(f"{sys.executable} -c {{instructions}}", 20)
    task = TASK.model_copy(update={"instructions": code})
    hub = FakeHub()
    ws = tmp_path / "run" / "workspaces" / "ex_v"

    async def scenario() -> tuple[ExecutionResult, list[dict[str, Any]]]:
        running = asyncio.ensure_future(
            run_execution(
                task,
                harness,
                Budgets(20, 25),
                execution_id="ex_v",
                run_dir=tmp_path / "run",
                base_url="http://127.0.0.1:9/x/ex_v",
                api_key="k",
                hub=hub,
            )
        )
        await _wait_for(lambda: "ex_v" in hub.assessors and (ws / "a.txt").exists())
        ask = hub.assessors["ex_v"]
        answers = [await ask(None)]
        (signals / "go").touch()
        await _wait_for(lambda: (ws / "b.txt").exists())
        answers += [await ask(7), await ask(8)]
        (signals / "done").touch()
        return await running, answers

    result, answers = asyncio.run(scenario())
    assert [a["artifact_version"] for a in answers] == [1, 2, 2]
    assert answers[0]["digest"] != answers[1]["digest"] == answers[2]["digest"]
    assert [a["score"] for a in answers] == [0.5, 1.0, 1.0]
    assert "a.txt" in answers[0]["critique"] and "b.txt" in answers[1]["critique"]
    made = result.assessments
    assert [(a.kind, a.version, a.attempt, a.branch) for a in made] == [
        ("intermediate", 1, 1, None),
        ("intermediate", 2, 2, 7),
        ("intermediate", 2, 3, 8),
        ("final", 2, 1, None),
    ]
    assert made[0].score == 0.5 and "b.txt" not in made[0].critique
    assert result.reward == 1.0 and "ex_v" not in hub.assessors  # unregistered at the end


def test_a_scheduled_assessment_runs_while_the_harness_does_and_is_never_the_reward(
    tmp_path: Path,
):
    from qwengyre.config import EvaluationConfig

    code = "import time; open('a.txt','w').write('1'); time.sleep(1.2); open('a.txt','w').write('')"
    harness = harness_spec(f"{sys.executable} -c {{instructions}}", 20)
    task = TASK.model_copy(update={"instructions": code})
    result = asyncio.run(
        run_execution(
            task,
            harness,
            Budgets(20, 25),
            execution_id="ex_s",
            run_dir=tmp_path,
            base_url="http://127.0.0.1:9/x/ex_s",
            api_key="k",
            evaluation=EvaluationConfig(intermediate_every_s=0.2),
        )
    )
    intermediate = [a for a in result.assessments if a.kind == "intermediate"]
    assert intermediate and all(a.version is not None for a in intermediate)
    assert result.assessments[-1].kind == "final" and result.reward == 0.5


def test_artifact_versions_number_distinct_digests():
    versions = ArtifactVersions()
    assert [versions.version_of(d) for d in ("x", "y", "x", "z")] == [1, 2, 1, 3]
    assert len(versions) == 3
    with pytest.raises(ValueError):
        versions.version_of("")


def test_the_log_keeps_every_assessment_durably_and_reads_back(tmp_path: Path):
    path = tmp_path / "assessments.jsonl"
    log = AssessmentLog(path)
    middle = Assessment(
        score=0.5,
        valid=True,
        artifact="d1",
        attempt=1,
        evaluator="python",
        detail="ok",
        kind="intermediate",
        version=1,
        critique="c",
    )
    bad = Assessment(
        score=None,
        valid=False,
        artifact="d2",
        attempt=1,
        evaluator="python",
        detail="timeout",
        version=2,
    )
    good = Assessment(
        score=1.0,
        valid=True,
        artifact="d2",
        attempt=2,
        evaluator="python",
        detail="ok",
        version=2,
        time_s=5.0,
    )
    assert log.write("ex_a", 0, 3, [middle, bad, good], task_id="t") == 3
    assert log.write("ex_b", 1, 0, [placeholder("no harness")]) == 1
    assert log.write("ex_c", 1, 1, []) == 0
    with path.open("a") as stream:
        stream.write('{"execution_id": "ex_torn", "gro')  # a crash mid-write
    records = read_assessments(path)
    assert [r.assessment for r in records[:3]] == [middle, bad, good]
    assert records[0] == AssessmentRecord(
        execution_id="ex_a", task_id="t", group=0, index=3, assessment=middle
    )
    assert records[3].assessment.kind == "placeholder" and records[3].group == 1
    line = json.loads(path.read_text().splitlines()[0])
    assert {"execution_id", "group", "index", "kind", "version", "artifact", "score"} <= set(line)
    assert read_assessments(tmp_path / "missing.jsonl") == []
    path.write_text("not json\n" + path.read_text())
    with pytest.raises(ValueError, match=":1:"):
        read_assessments(path)
