"""One execution end to end: the two budgets, evaluation, placeholders, cancellation."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from qwengyre.config import EvaluationConfig
from qwengyre.rollout.execution import Budgets, run_execution
from qwengyre.rollout.harness import HarnessSpec
from qwengyre.rollout.tasks import CommandEvaluator, ExactMatchEvaluator, Task
from qwengyre.types import Outcome

ANSWER = ExactMatchEvaluator(type="exact_match", expected="82", file="answer.txt")
DEFAULT_BUDGETS = Budgets(5, 10)


def python_harness(code: str) -> HarnessSpec:
    return HarnessSpec(command=(sys.executable, "-c", code), deadline_s=60, kill_grace_s=0.5)


def run(task: Task, harness: HarnessSpec, tmp_path: Path, budgets=DEFAULT_BUDGETS, **kw):  # type: ignore[no-untyped-def]
    return asyncio.run(
        run_execution(
            task,
            harness,
            budgets,
            execution_id="ex_1",
            run_dir=tmp_path,
            base_url="http://127.0.0.1:9/x/ex_1",
            api_key="k",
            evaluation=kw.pop("evaluation", EvaluationConfig()).model_copy(
                update={"retry_delay_s": 0.05}
            ),
            **kw,
        )
    )


class FakeHub:
    """The proxy's part in an execution: registration, and a tree of ``calls`` nodes."""

    def __init__(self, calls: int) -> None:
        self.calls = calls

    def register_assessor(self, execution_id: str, assessor: object) -> None:
        pass

    def unregister_assessor(self, execution_id: str) -> None:
        pass

    async def tree(self, execution_id: str) -> object:
        return SimpleNamespace(nodes=list(range(self.calls)))


def task(**kw) -> Task:  # type: ignore[no-untyped-def]
    fields = {"id": "add-1", "instructions": "Compute 37+45", "evaluator": ANSWER, **kw}
    return Task(**fields)


def test_a_completed_execution_is_evaluated_on_its_workspace(tmp_path: Path):
    code = "import os; open('answer.txt','w').write('82'); assert os.environ['OPENAI_API_KEY']"
    result = run(task(), python_harness(code), tmp_path)
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0)
    assert (tmp_path / "workspaces" / "ex_1" / "answer.txt").read_text() == "82"


def test_a_harness_timeout_is_still_evaluated(tmp_path: Path):
    code = "import time; open('answer.txt','w').write('82'); time.sleep(60)"
    result = run(task(), python_harness(code), tmp_path, Budgets(1, 10))
    assert result.harness is not None and result.harness.timed_out
    assert (result.outcome, result.reward) == (Outcome.HARNESS_TIMEOUT, 1.0)


def test_a_crashed_harness_is_failed_but_its_work_is_assessed(tmp_path: Path):
    code = "open('answer.txt','w').write('81'); raise SystemExit(3)"
    result = run(task(), python_harness(code), tmp_path)
    assert result.harness is not None and result.harness.exit_code == 3
    assert (result.outcome, result.reward) == (Outcome.FAILED, 0.0)  # a real zero: wrong answer
    assert [a.kind for a in result.assessments] == ["final"]
    assert result.assessments[0].artifact and result.assessments[0].version == 1


def test_a_harness_that_cannot_be_spawned_is_an_infrastructure_failure(tmp_path: Path):
    missing = HarnessSpec(command=(str(tmp_path / "no-such-harness"),), deadline_s=60)
    result = run(task(), missing, tmp_path)
    assert result.harness is not None and not result.harness.spawned
    assert (result.outcome, result.reward) == (Outcome.FAILED, 0.0)
    [stub] = result.assessments
    assert stub.kind == "placeholder" and stub.placeholder and stub.artifact == ""
    assert "infrastructure failure" in result.detail and "could not start" in stub.detail


def test_a_crash_before_touching_anything_is_an_infrastructure_failure(tmp_path: Path):
    template = tmp_path / "tpl"
    template.mkdir()
    (template / "answer.txt").write_text("82")  # an untouched workspace would score 1
    crash = python_harness("raise SystemExit(3)")
    result = run(task(workspace_template=template), crash, tmp_path / "r", hub=FakeHub(0))
    assert (result.outcome, result.reward) == (Outcome.FAILED, 0.0)
    assert [a.kind for a in result.assessments] == ["placeholder"]
    assert "exited with status 3" in result.detail and "no model call" in result.detail


def test_a_crash_after_model_calls_is_assessed_even_if_nothing_changed(tmp_path: Path):
    template = tmp_path / "tpl"
    template.mkdir()
    (template / "answer.txt").write_text("82")
    crash = python_harness("raise SystemExit(3)")
    result = run(task(workspace_template=template), crash, tmp_path / "r", hub=FakeHub(2))
    assert (result.outcome, result.reward) == (Outcome.FAILED, 1.0)
    assert [a.kind for a in result.assessments] == ["final"]


def test_a_harness_that_changed_nothing_but_exited_0_is_a_real_result(tmp_path: Path):
    result = run(task(), python_harness("pass"), tmp_path, hub=FakeHub(0))
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 0.0)
    assert [a.kind for a in result.assessments] == ["final"]


def test_evaluation_retries_past_five_attempts_within_the_budget(tmp_path: Path):
    counter = tmp_path / "counter"
    flaky = CommandEvaluator(
        type="command",
        command=[
            sys.executable,
            "-c",
            f"import pathlib, sys; c = pathlib.Path({str(counter)!r}); "
            "n = int(c.read_text()) if c.exists() else 0; c.write_text(str(n + 1)); "
            'sys.exit(1) if n < 7 else print(\'{"score": 0.5, "valid": true}\')',
        ],
        timeout_s=10,
    )
    pacing = EvaluationConfig(retry_backoff=1.5, max_retry_delay_s=0.1)
    result = run(
        task(evaluator=flaky),
        python_harness("pass"),
        tmp_path / "r",
        Budgets(5, 30),
        evaluation=pacing,
    )
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 0.5)
    assert [a.attempt for a in result.assessments] == list(range(1, 9))
    assert len({a.artifact for a in result.assessments}) == 1  # the same preserved state


def test_an_evaluator_that_never_succeeds_leaves_no_reward_not_a_zero(tmp_path: Path):
    broken = CommandEvaluator(type="command", command="exit 1", timeout_s=5)
    result = run(
        task(evaluator=broken),
        python_harness("pass"),
        tmp_path,
        evaluation=EvaluationConfig(max_attempts=3),
    )
    assert result.reward is None and result.outcome is Outcome.FAILED
    assert len(result.assessments) == 3 and all(a.score is None for a in result.assessments)
    assert "max_attempts" in result.detail


def test_an_evaluator_that_never_succeeds_is_retried_until_the_overall_budget(tmp_path: Path):
    # No backoff, and a budget with room for many attempts even on a busy machine (an
    # attempt here takes ~0.05 s quiet, and well under 0.5 s with every core contended).
    broken = CommandEvaluator(type="command", command="exit 1", timeout_s=5)
    steady = EvaluationConfig(retry_backoff=1.0)
    result = run(
        task(evaluator=broken), python_harness("pass"), tmp_path, Budgets(1, 6), evaluation=steady
    )
    assert (result.outcome, result.reward) == (Outcome.OVERALL_TIMEOUT, None)
    assert len(result.assessments) > 5 and all(not a.valid for a in result.assessments)


def test_the_overall_budget_ending_means_overall_timeout(tmp_path: Path):
    slow = CommandEvaluator(type="command", command="sleep 5", timeout_s=30)
    result = run(task(evaluator=slow), python_harness("pass"), tmp_path, Budgets(1, 1.5))
    assert (result.outcome, result.reward) == (Outcome.OVERALL_TIMEOUT, None)
    assert result.ended_s - result.started_s < 4


def test_a_workspace_that_never_comes_up_gets_the_zero_placeholder(tmp_path: Path):
    result = run(task(setup="exit 7"), python_harness("pass"), tmp_path)
    assert (result.outcome, result.reward) == (Outcome.FAILED, 0.0)
    assert result.harness is None and result.assessments[0].placeholder
    assert "setup exited with 7" in result.detail


def test_a_template_is_copied_and_setup_runs(tmp_path: Path):
    template = tmp_path / "tpl"
    template.mkdir()
    (template / "answer.txt").write_text("82")
    result = run(task(workspace_template=template), python_harness("pass"), tmp_path / "r1")
    assert result.reward == 1.0
    setup = task(setup="printf 82 > answer.txt")
    assert run(setup, python_harness("pass"), tmp_path / "r2").reward == 1.0


def test_a_cancelled_execution_is_not_evaluated(tmp_path: Path):
    async def scenario():  # type: ignore[no-untyped-def]
        cancel = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, cancel.set)
        return await run_execution(
            task(),
            python_harness("import time; time.sleep(60)"),
            Budgets(30, 60),
            execution_id="ex_2",
            run_dir=tmp_path,
            base_url="http://x",
            api_key="k",
            cancel=cancel,
        )

    result = asyncio.run(scenario())
    assert (result.outcome, result.reward, result.assessments) == (Outcome.CANCELLED, None, ())


def test_budgets_are_checked():
    with pytest.raises(ValueError, match="harness_s"):
        Budgets(10, 5)
