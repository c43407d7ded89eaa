"""Tests of the evaluation runner: attempts, retries, digests and the no-zero invariant."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from qwengyre.config import EvaluationConfig
from qwengyre.records.assessments import Assessment
from qwengyre.rollout.evaluation import (
    artifact_digest,
    assess,
    evaluate_once,
    final,
    placeholder,
)
from qwengyre.rollout.tasks import CommandEvaluator, ExactMatchEvaluator, PythonEvaluator

PY = sys.executable


def _workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "answer.txt").write_text("82\n")
    (ws / "sub").mkdir()
    (ws / "sub" / "code.py").write_text("print('hi')\n")
    return ws


def _cmd(script: str, timeout_s: float = 10.0) -> CommandEvaluator:
    return CommandEvaluator(command=[PY, "-c", textwrap.dedent(script)], timeout_s=timeout_s)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --------------------------------------------------------------------------- command


def test_command_valid_reads_last_nonblank_line_in_workspace(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    spec = _cmd(
        """
        import json, pathlib
        print("log line")
        print(json.dumps({"score": 0.25, "valid": False}))  # not the last line
        ok = pathlib.Path("answer.txt").read_text().strip() == "82"  # cwd is the workspace
        print(json.dumps({"score": 0.75 if ok else 0.5, "valid": True}))
        print("   ")
        """
    )
    result = run(evaluate_once(spec, ws))
    assert result.valid and result.score == 0.75
    assert result.artifact == artifact_digest(ws)
    assert result.evaluator == "command" and result.attempt == 1


def test_command_shell_string(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    spec = CommandEvaluator(command='echo noise; echo \'{"score": 1, "valid": true}\'')
    result = run(evaluate_once(spec, ws))
    assert result.valid and result.score == 1.0


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        ('print(\'{"score": 1.0, "valid": false}\')', "valid: false"),
        ("print('{\"score\": 1.0}')", "missing"),
        ("print('{\"valid\": true}')", "missing"),
        ("print('not json at all')", "not JSON"),
        ("print('[1, 2]')", "not a JSON object"),
        ('print(\'{"score": NaN, "valid": true}\')', "not finite"),
        ('print(\'{"score": "1", "valid": true}\')', "not a number"),
        ('print(\'{"score": true, "valid": true}\')', "not a number"),
        ("pass", "no output"),
        (
            'import sys; print(\'{"score": 1.0, "valid": true}\'); sys.exit(3)',
            "status 3",
        ),
    ],
)
def test_command_invalid_outputs(tmp_path: Path, script: str, reason: str) -> None:
    result = run(evaluate_once(_cmd(script), _workspace(tmp_path)))
    assert not result.valid
    assert result.score is None
    assert reason in result.detail


def test_command_missing_program_is_invalid(tmp_path: Path) -> None:
    spec = CommandEvaluator(command=["/nonexistent/grader-xyz"])
    result = run(evaluate_once(spec, _workspace(tmp_path)))
    assert not result.valid and result.score is None
    assert "cannot start" in result.detail


def test_command_timeout_kills_process_group(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    marker = tmp_path / "grandchild-survived"
    # The grandchild would write the marker after 1.5 s unless its group is killed.
    script = f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c",
            "import time, pathlib; time.sleep(1.5); pathlib.Path({str(marker)!r}).write_text('x')"])
        time.sleep(30)
        """
    result = run(evaluate_once(_cmd(script, timeout_s=0.5), ws))
    assert not result.valid and result.score is None
    assert "timeout" in result.detail  # cut at 0.5 s, not the script's 30 s
    time.sleep(1.6)
    assert not marker.exists()


def test_command_timeout_is_cut_by_caller(tmp_path: Path) -> None:
    start = time.monotonic()
    result = run(evaluate_once(_cmd("import time; time.sleep(30)"), tmp_path, timeout_s=0.3))
    assert not result.valid and "timeout" in result.detail
    assert time.monotonic() - start < 5


# --------------------------------------------------------------------------- python


def _ok_dict(workspace: Path, meta: dict[str, Any]) -> dict[str, Any]:
    text = (workspace / "answer.txt").read_text().strip()
    return {"score": 1.0 if text == meta["expected"] else 0.0, "valid": True}


def _ok_tuple(workspace: Path, meta: dict[str, Any]) -> tuple[float, bool]:
    return 0.5, True


def _ok_float(workspace: Path, meta: dict[str, Any]) -> float:
    return 0.25


def _invalid_tuple(workspace: Path, meta: dict[str, Any]) -> tuple[float, bool]:
    return 0.5, False


def _returns_none(workspace: Path, meta: dict[str, Any]) -> None:
    return None


def _returns_nan(workspace: Path, meta: dict[str, Any]) -> float:
    return math.nan


def _raises(workspace: Path, meta: dict[str, Any]) -> float:
    raise RuntimeError("grader broke")


def _hangs(workspace: Path, meta: dict[str, Any]) -> float:
    time.sleep(2)
    return 1.0


def _py(name: str) -> PythonEvaluator:
    return PythonEvaluator(callable=f"{__name__}:{name}")


@pytest.mark.parametrize(
    ("name", "score"), [("_ok_dict", 1.0), ("_ok_tuple", 0.5), ("_ok_float", 0.25)]
)
def test_python_valid_return_forms(tmp_path: Path, name: str, score: float) -> None:
    ws = _workspace(tmp_path)
    result = run(evaluate_once(_py(name), ws, metadata={"expected": "82"}))
    assert result.valid and result.score == score
    assert result.evaluator == "python" and result.artifact == artifact_digest(ws)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("_invalid_tuple", "valid: false"),
        ("_returns_none", "unsupported type"),
        ("_returns_nan", "not finite"),
        ("_raises", "grader broke"),
        ("_nonexistent_function", "exception"),
    ],
)
def test_python_invalid(tmp_path: Path, name: str, reason: str) -> None:
    result = run(evaluate_once(_py(name), _workspace(tmp_path)))
    assert not result.valid and result.score is None
    assert reason in result.detail


def test_python_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    result = run(evaluate_once(_py("_hangs"), _workspace(tmp_path), timeout_s=0.2))
    assert not result.valid and result.score is None and "timeout" in result.detail
    assert time.monotonic() - start < 1.5


def test_python_tmp_module_on_sys_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    (mod_dir / "eval_mod_xyz.py").write_text(
        "def grade(workspace, meta):\n    return {'score': meta['w'] * 2, 'valid': True}\n"
    )
    monkeypatch.syspath_prepend(str(mod_dir))
    spec = PythonEvaluator(callable="eval_mod_xyz:grade")
    result = run(evaluate_once(spec, _workspace(tmp_path), metadata={"w": 0.2}))
    assert result.valid and result.score == pytest.approx(0.4)


# --------------------------------------------------------------------------- exact match


def test_exact_match(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    hit = run(evaluate_once(ExactMatchEvaluator(expected="82", file="answer.txt"), ws))
    miss = run(evaluate_once(ExactMatchEvaluator(expected="81", file="answer.txt"), ws))
    missing = run(evaluate_once(ExactMatchEvaluator(expected="82", file="nope.txt"), ws))
    assert (hit.valid, hit.score) == (True, 1.0)
    assert (miss.valid, miss.score) == (True, 0.0)
    assert (missing.valid, missing.score) == (True, 0.0)
    assert hit.evaluator == "exact_match"


# --------------------------------------------------------------------------- retries


def _flaky(counter: Path, failures: int) -> CommandEvaluator:
    """Fails ``failures`` times (counted in a file outside the workspace), then succeeds."""
    return _cmd(
        f"""
        import json, pathlib, sys
        counter = pathlib.Path({str(counter)!r})
        n = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(n + 1))
        if n < {failures}:
            sys.exit(1)
        print(json.dumps({{"score": 0.5, "valid": True}}))
        """
    )


def test_retries_until_valid(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    spec = _flaky(tmp_path / "counter", failures=2)
    results = run(
        assess(
            spec,
            ws,
            deadline=time.monotonic() + 30,
            metadata={},
            options=EvaluationConfig(retry_delay_s=0.01),
        )
    )
    assert [a.attempt for a in results] == [1, 2, 3]
    assert [a.valid for a in results] == [False, False, True]
    assert results[0].score is None and results[1].score is None
    assert len({a.artifact for a in results}) == 1
    assert results[0].artifact == artifact_digest(ws)
    chosen = final(results)
    assert chosen is results[2] and chosen.score == 0.5


def test_never_valid_is_unresolved_not_zero(tmp_path: Path) -> None:
    spec = _flaky(tmp_path / "counter", failures=100)
    results = run(
        assess(
            spec,
            _workspace(tmp_path),
            deadline=time.monotonic() + 30,
            options=EvaluationConfig(retry_delay_s=0.0, max_attempts=3),
        )
    )
    assert len(results) == 3
    assert final(results) is None
    assert all(a.score is None and not a.valid for a in results)
    assert all(a.score != 0 for a in results)
    assert (tmp_path / "counter").read_text() == "3"


def test_deadline_stops_retries(tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    spec = _flaky(counter, failures=100)
    start = time.monotonic()
    results = run(
        assess(
            spec,
            _workspace(tmp_path),
            deadline=start + 0.6,
            options=EvaluationConfig(retry_delay_s=0.4, max_attempts=50),
        )
    )
    assert len(results) in (1, 2)  # 50 allowed, but none may start after the deadline
    assert final(results) is None
    assert "deadline" in results[-1].detail
    # An attempt cut to the last moments may be killed before its first line runs.
    started = int(counter.read_text())
    assert started >= 1 and started <= len(results)


def test_no_attempt_after_deadline(tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    results = run(assess(_flaky(counter, 0), _workspace(tmp_path), deadline=time.monotonic()))
    assert results == []
    assert final(results) is None
    assert not counter.exists()


def test_deadline_cuts_attempt_timeout(tmp_path: Path) -> None:
    spec = _cmd("import time; time.sleep(30)", timeout_s=60)
    start = time.monotonic()
    results = run(
        assess(
            spec,
            _workspace(tmp_path),
            deadline=start + 0.5,
            options=EvaluationConfig(retry_delay_s=0.0),
        )
    )
    assert time.monotonic() - start < 4
    assert len(results) == 1 and "timeout" in results[0].detail
    assert final(results) is None


def test_workspace_mutation_between_attempts_stops_retries(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    counter = tmp_path / "counter"
    # Fails, and (behind the runner's back) changes the preserved workspace.
    spec = _cmd(
        f"""
        import pathlib, sys
        counter = pathlib.Path({str(counter)!r})
        n = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(n + 1))
        pathlib.Path("answer.txt").write_text("changed")
        sys.exit(1)
        """
    )
    before = artifact_digest(ws)
    results = run(
        assess(
            spec, ws, deadline=time.monotonic() + 30, options=EvaluationConfig(retry_delay_s=0.0)
        )
    )
    assert len(results) == 1
    assert counter.read_text() == "1"
    assert "workspace changed" in results[0].detail
    assert results[0].artifact == before != artifact_digest(ws)
    assert final(results) is None


def test_unreadable_workspace_is_invalid_not_zero(tmp_path: Path) -> None:
    results = run(
        assess(
            ExactMatchEvaluator(expected="x", file="a"),
            tmp_path / "missing",
            deadline=time.monotonic() + 5,
        )
    )
    assert len(results) == 1 and not results[0].valid and results[0].score is None
    assert final(results) is None


# --------------------------------------------------------------------------- digest


def test_digest_stable_and_sensitive(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    first = artifact_digest(ws)
    assert artifact_digest(ws) == first
    os.utime(ws / "answer.txt", (1, 1))  # metadata only: same artifact
    assert artifact_digest(ws) == first

    (ws / "answer.txt").write_text("83\n")
    changed = artifact_digest(ws)
    assert changed != first
    (ws / "answer.txt").write_text("82\n")
    assert artifact_digest(ws) == first

    (ws / "sub" / "code.py").rename(ws / "sub" / "code2.py")
    assert artifact_digest(ws) != first
    (ws / "sub" / "code2.py").rename(ws / "sub" / "code.py")
    assert artifact_digest(ws) == first

    (ws / "empty").mkdir()
    assert artifact_digest(ws) != first
    (ws / "empty").rmdir()
    (ws / ".hidden").write_text("")
    assert artifact_digest(ws) != first
    (ws / ".hidden").unlink()
    assert artifact_digest(ws) == first


def test_digest_does_not_follow_symlinks(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("a")
    (ws / "link").symlink_to(outside)
    with_link = artifact_digest(ws)
    outside.write_text("b")  # the target changed, the link did not
    assert artifact_digest(ws) == with_link
    (ws / "link").unlink()
    (ws / "link").symlink_to(tmp_path / "elsewhere")
    assert artifact_digest(ws) != with_link

    outside_dir = tmp_path / "outside_dir"
    outside_dir.mkdir()
    (ws / "dirlink").symlink_to(outside_dir, target_is_directory=True)
    with_dir_link = artifact_digest(ws)
    (outside_dir / "new.txt").write_text("not part of the workspace")
    assert artifact_digest(ws) == with_dir_link


def test_digest_rejects_non_directory(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        artifact_digest(tmp_path / "missing")


def test_digest_independent_of_location(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _workspace(tmp_path / "a")
    b = _workspace(tmp_path / "b")
    assert artifact_digest(a) == artifact_digest(b)  # same tree, different location
    (b / "answer.txt").chmod(0o755)  # the executable bit is part of the artifact
    assert artifact_digest(a) != artifact_digest(b)


# --------------------------------------------------------------------------- invariants


@pytest.mark.parametrize(
    "kwargs",
    [
        {"score": None, "valid": True},
        {"score": math.nan, "valid": True},
        {"score": math.inf, "valid": True},
        {"score": 0.0, "valid": False},
        {"score": 1.0, "valid": False},
        {"score": 1.0, "valid": True, "artifact": ""},
        {"score": 1.0, "valid": True, "placeholder": True, "artifact": ""},
        {"score": None, "valid": False, "placeholder": True, "artifact": ""},
        {"score": 0.0, "valid": True, "placeholder": True, "artifact": "abc"},
        {"score": 1.0, "valid": True, "attempt": -1},
    ],
)
def test_assessment_refuses_inconsistent_values(kwargs: dict[str, Any]) -> None:
    base: dict[str, Any] = {
        "artifact": "abc",
        "attempt": 1,
        "evaluator": "command",
        "detail": "x",
    }
    with pytest.raises(ValueError):
        Assessment(**{**base, **kwargs})


def test_assessment_refuses_bool_score_and_converts_int() -> None:
    with pytest.raises(TypeError):
        Assessment(
            score=True, valid=True, artifact="abc", attempt=1, evaluator="command", detail="ok"
        )  # type: ignore[arg-type]
    converted = Assessment(
        score=1, valid=True, artifact="abc", attempt=1, evaluator="command", detail="ok"
    )  # type: ignore[arg-type]
    assert isinstance(converted.score, float) and converted.score == 1.0
    assert json.loads(json.dumps(converted.to_dict()))["score"] == 1.0


def test_placeholder() -> None:
    stub = placeholder("workspace never came up")
    assert stub.placeholder and stub.valid and stub.score == 0.0
    assert stub.artifact == "" and stub.attempt == 0
    assert stub.detail == "workspace never came up"
    assert final([stub]) is stub
    with pytest.raises(ValueError):
        placeholder("  ")


def _assessed(**fields: Any) -> Assessment:
    """A valid command assessment of artifact ``abc`` (score 1.0), ``fields`` changed."""
    ok = {"score": 1.0, "valid": True, "artifact": "abc", "attempt": 1, "evaluator": "command"}
    return Assessment(**{**ok, "detail": "ok", **fields})


def test_final_prefers_valid_and_never_invents_zero() -> None:
    bad = _assessed(score=None, valid=False, detail="timeout")
    good = _assessed(score=0.0, attempt=2)
    assert final([]) is None
    assert final([bad]) is None
    assert final([bad, good]) is good


# --------------------------------------------------------------------------- retries and budgets


def test_retries_are_bounded_by_the_budget_not_by_five_attempts(tmp_path: Path) -> None:
    spec = _flaky(tmp_path / "counter", failures=7)
    results = run(
        assess(
            spec,
            _workspace(tmp_path),
            deadline=time.monotonic() + 30,
            options=EvaluationConfig(retry_delay_s=0.0),
        )
    )
    assert [a.attempt for a in results] == list(range(1, 9))
    chosen = final(results)
    assert chosen is results[-1] and chosen.score == 0.5


def test_the_optional_cap_says_why_retrying_stopped(tmp_path: Path) -> None:
    spec = _flaky(tmp_path / "counter", failures=100)
    results = run(
        assess(
            spec,
            _workspace(tmp_path),
            deadline=time.monotonic() + 30,
            options=EvaluationConfig(retry_delay_s=0.0, max_attempts=2),
        )
    )
    assert len(results) == 2 and "max_attempts" in results[-1].detail


def test_retry_delays_back_off_up_to_a_ceiling() -> None:
    options = EvaluationConfig(retry_delay_s=1.0, retry_backoff=2.0, max_retry_delay_s=5.0)
    assert [options.delay(r) for r in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert EvaluationConfig(retry_backoff=1.0).delay(9) == 1.0
    bad_values = (
        {"retry_backoff": 0.5},
        {"max_attempts": 0},
        {"intermediate_every_s": 0.0},
        {"retry_delay_s": float("inf")},
    )
    for bad in bad_values:
        with pytest.raises(ValueError):
            EvaluationConfig(**bad)  # type: ignore[arg-type]


def test_an_assessment_names_its_evaluator_time_and_critique(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    spec = _cmd('import json; print(json.dumps({"score": 1, "valid": True, "critique": "fine"}))')
    before = time.time()
    result = run(evaluate_once(spec, ws, version=3, branch=5))
    assert result.valid and result.critique == "fine" and result.kind == "final"
    assert (result.version, result.branch) == (3, 5)
    assert result.evaluator == "command" and result.evaluator_name.startswith(PY)
    assert before <= result.time_s <= time.time() and result.duration_s > 0
    assert Assessment.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_kinds_are_consistent_and_intermediate_ones_never_give_the_reward() -> None:
    middle = _assessed(kind="intermediate", version=1)
    assert final([middle]) is None  # an intermediate assessment is never the reward
    later = _assessed(score=0.0, artifact="abd", version=2)
    assert final([later, middle]) is later
    assert placeholder("x").kind == "placeholder"
    stub = _assessed(score=0.0, artifact="", attempt=0, evaluator="placeholder", placeholder=True)
    assert stub.kind == "placeholder"
    with pytest.raises(ValueError, match="version"):
        _assessed(kind="intermediate")
    with pytest.raises(ValueError, match="kind"):
        _assessed(kind="draft")
    with pytest.raises(ValueError, match="placeholder"):
        _assessed(
            score=0.0, artifact="", attempt=0, placeholder=True, kind="intermediate", version=1
        )
