"""The model evaluator against a live proxy whose engine is scripted: both APIs, the score
contract, unresolved answers, tests combined, and the judge's calls kept out of the
evaluated execution (docs: src/qwengyre/rollout/model_evaluator.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from transformers import AutoTokenizer

from qwengyre.config import EvaluationConfig
from qwengyre.engines.base import FinishReason, GenerateRequest
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.routing import Router
from qwengyre.proxy.server import ProxyServer
from qwengyre.proxy.store import Store
from qwengyre.rollout.evaluation import artifact_digest, assess, evaluate_once, final
from qwengyre.rollout.model_evaluator import (
    ANSWER_FORMAT,
    SYSTEM_PROMPT,
    GradedTests,
    gather_artifact,
    parse_answer,
)
from qwengyre.rollout.tasks import (
    ArtifactSelection,
    ModelEvaluator,
    TaskFileError,
    dump_tasks,
    load_tasks,
    parse_task_line,
)

APIS = ["openai", "anthropic"]
RUBRIC = "Rubric R-42: the function add must return the sum of its arguments."
KEY_ENV = "QWENGYRE_TEST_JUDGE_KEY"


class RecordingEngine(ScriptedEngine):
    """The scripted engine, keeping the text of every prompt it was asked to answer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[str] = []

    def output_for(self, request: GenerateRequest) -> tuple[list[int], FinishReason]:
        self.prompts.append(self.tokenizer.decode(request.input_ids))
        return super().output_for(request)


@dataclass
class Judge:
    url: str
    server: ProxyServer
    engine: RecordingEngine
    evaluated: str  # an execution standing for the one being evaluated
    judge: str  # the judge's own execution, whose key the evaluator presents

    async def calls(self, execution_id: str) -> int:
        return len((await self.server.tree(execution_id)).nodes)


@asynccontextmanager
async def judge_proxy(
    tmp_path: Path, model_dir: Path, replies: list[str], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Judge]:
    """A proxy on 127.0.0.1 answering every call with ``replies`` in turn; the judge's
    key in :data:`KEY_ENV`."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = RecordingEngine(tokenizer, {"default": replies})
    router = Router()
    router.register(engine, preference=0)
    server = ProxyServer(
        ChatRenderer(tokenizer),
        router,
        Store(tmp_path / "proxy.sqlite"),
        model="tiny",
        max_context=4096,
        admin_token="admin-token-for-tests-0123456789",
    )
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.base_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        evaluated = await server.create_execution()
        own = await server.create_execution()
        monkeypatch.setenv(KEY_ENV, own["key"])
        yield Judge(server.base_url, server, engine, evaluated["id"], own["id"])
    finally:
        await runner.cleanup()
        server.store.close()


def _spec(api: str, url: str, **kw: Any) -> ModelEvaluator:
    fields: dict[str, Any] = {
        "api": api,
        "base_url": url + "/v1",
        "model": "tiny",
        "api_key_env": KEY_ENV,
        "rubric": RUBRIC,
        "artifact": {"files": ["src/*.py"], "diff": True},
        "max_tokens": 64,
    }
    return ModelEvaluator.model_validate({**fields, **kw})


def _git(workspace: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=workspace, check=True, capture_output=True)


def _workspace(tmp_path: Path, *, repo: bool = False) -> Path:
    """``src/add.py``; as a git repository: committed, then changed."""
    workspace = tmp_path / "ws"
    (workspace / "src").mkdir(parents=True)
    (workspace / "src" / "add.py").write_text("def add(a, b):\n    return a - b\n")
    if repo:
        _git(workspace, "init", "-q")
        _git(workspace, "add", ".")
        _git(workspace, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    (workspace / "src" / "add.py").write_text("def add(a, b):\n    return a + b  # fixed\n")
    return workspace


def _needs_git() -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")


# --------------------------------------------------------------------------- task file


def _line(evaluator: dict[str, Any]) -> str:
    return json.dumps({"id": "t", "instructions": "do it", "evaluator": evaluator})


BASE = {"type": "model", "api": "openai", "base_url": "http://judge:8000/v1", "model": "j"}


@pytest.mark.parametrize(
    ("evaluator", "message"),
    [
        ({**BASE, "rubric": "r", "api": "gemini"}, "field 'evaluator.api': Input should be"),
        ({**BASE}, "field 'evaluator.rubric': missing (required)"),
        ({**BASE, "rubric": "  "}, "field 'evaluator.rubric': rubric must not be empty"),
        (
            {**BASE, "rubric": "r", "base_url": "http://p:8000/x/ex_1/v1"},
            "field 'evaluator.base_url': 'http://p:8000/x/ex_1/v1' is an execution's proxy URL",
        ),
        ({**BASE, "rubric": "r", "base_url": "judge:8000"}, "field 'evaluator.base_url'"),
        ({**BASE, "rubric": "r", "tests_weight": 0.5}, "'evaluator.tests_weight': is given"),
        (
            {**BASE, "rubric": "r", "tests": {"command": "true"}, "tests_weight": 2},
            "field 'evaluator.tests_weight': Input should be less than or equal to 1",
        ),
        ({**BASE, "rubric": "r", "attempts": 0}, "field 'evaluator.attempts'"),
        ({**BASE, "rubric": "r", "api_key_env": "A-B"}, "'A-B' is not an environment var"),
        (
            {**BASE, "rubric": "r", "artifact": {"files": ["../etc/*"]}},
            "field 'evaluator.artifact.files': '../etc/*' must stay inside the workspace",
        ),
        (
            {**BASE, "rubric": "r", "artifact": {"max_chars": 0}},
            "field 'evaluator.artifact.max_chars': Input should be greater than 0",
        ),
        ({**BASE, "rubric": "r", "artifact": {"diff": "yes", "x": 1}}, "'evaluator.artifact."),
        ({**BASE, "rubric": "r", "tests": {"command": []}}, "'evaluator.tests.command'"),
    ],
)
def test_a_bad_model_evaluator_names_its_field(evaluator: dict[str, Any], message: str) -> None:
    with pytest.raises(TaskFileError) as raised:
        parse_task_line(_line(evaluator))
    assert str(raised.value).startswith("<tasks>: ") and message in str(raised.value)


def test_a_model_evaluator_loads_and_dumps_back(tmp_path: Path) -> None:
    tests = {"command": ["pytest", "-q"], "timeout_s": 60}
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        _line({**BASE, "rubric": "r", "tests": tests, "tests_weight": 0.25})
        + "\n"
        + _line({**BASE, "rubric": "r", "api": "anthropic"}).replace('"t"', '"u"', 1)
        + "\n"
    )
    tasks = load_tasks(path)
    with_tests, plain = (task.evaluator for task in tasks)
    assert isinstance(with_tests, ModelEvaluator) and isinstance(plain, ModelEvaluator)
    assert with_tests.weight_of_tests == 0.25 and plain.weight_of_tests == 0.0
    assert with_tests.tests is not None and with_tests.tests.command == ["pytest", "-q"]
    assert plain.artifact == ArtifactSelection(files=[], diff=True, max_chars=20_000)
    assert (plain.attempts, plain.timeout_s, plain.api_key_env) == (3, 120.0, None)
    dump_tasks(tmp_path / "again.jsonl", tasks)
    assert load_tasks(tmp_path / "again.jsonl") == tasks


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize(
    ("answer", "score", "critique"),
    [
        ("Correct.\nSCORE: 0.7", 0.7, "Correct."),
        ("Fine.\n\n**Score:** 1\n\n", 1.0, "Fine."),
        ("ok\n`score: .25`", 0.25, "ok"),
        ('Reasons.\n{"score": 0, "why": "wrong"}', 0.0, "Reasons."),
    ],
)
def test_a_score_line_is_read(answer: str, score: float, critique: str) -> None:
    assert parse_answer(answer) == (score, critique, "ok")


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("", "the answer is empty"),
        ("SCORE: 0.7\nThat is my verdict.", "no score line: last line 'That is my verdict.'"),
        ("SCORE: 1.5", "the score 1.5 is not a number from 0 to 1"),
        ('{"score": "high"}', "the score is not a number: 'high'"),
        ('{"score": true}', "the score is not a number: True"),
        ("SCORE: seven", "no score line"),
    ],
)
def test_an_answer_off_the_contract_has_no_score(answer: str, reason: str) -> None:
    score, _, why = parse_answer(answer)
    assert score is None and why.startswith(reason)


def test_the_artifact_holds_tests_diff_and_files_within_max_chars(tmp_path: Path) -> None:
    _needs_git()
    workspace = _workspace(tmp_path, repo=True)
    (workspace / "src" / "blob.py").write_bytes(b"\0\1\2")
    (workspace / "src" / "new.py").write_text("NEW = 1\n")
    outside = tmp_path / "secret.py"
    outside.write_text("SECRET = 1\n")
    (workspace / "src" / "link.py").symlink_to(outside)
    before = artifact_digest(workspace)
    tests = GradedTests("pytest -q", 1.0, "ok", "1 passed\n")
    selection = ArtifactSelection(files=["src/*.py"], diff=True)
    text = gather_artifact(selection, workspace, tests)
    assert artifact_digest(workspace) == before  # git read it without writing its index
    assert text.startswith('<tests command="pytest -q" score="1" detail="ok">\n1 passed\n</tests>')
    assert "-    return a - b\n+    return a + b  # fixed" in text
    assert "Untracked files (not in the diff above): src/blob.py, src/link.py, src/new.py" in text
    assert '<file path="src/add.py">\ndef add(a, b):\n    return a + b  # fixed\n</file>' in text
    assert '<file path="src/blob.py">\n(not UTF-8 text: 3 bytes, not shown)\n</file>' in text
    assert '<file path="src/new.py">\nNEW = 1\n</file>' in text
    assert "SECRET" not in text and 'link.py">' not in text  # a symlink is not followed
    small = gather_artifact(
        ArtifactSelection(files=["src/*.py"], diff=False, max_chars=30), workspace, tests
    )
    assert '<file path="src/add.py">\ndef add(a, b):\n    re\n[20 characters cut' in small
    assert (
        '<file path="src/new.py">\n[8 characters cut: the artifact\'s max_chars]\n</file>' in small
    )
    plain = gather_artifact(ArtifactSelection(), _workspace(tmp_path / "plain"), None)
    no_repo = "(no diff: the workspace is not a git repository with its own .git directory)"
    assert plain == f"<diff>\n{no_repo}\n</diff>"


def test_a_large_file_is_read_only_as_far_as_max_chars_needs(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "big.txt").write_text("é" * 1000)  # 2 bytes each: a read cuts one
    selection = ArtifactSelection(files=["*.txt"], diff=False, max_chars=9)
    text = gather_artifact(selection, workspace, None)
    # 36 bytes read: 18 characters and a note of what was read, cut to 9 characters.
    assert text == (
        '<file path="big.txt">\n' + "é" * 9 + "\n[37 characters cut: the artifact's max_chars]"
        "\n</file>"
    )


def test_git_runs_nothing_the_workspace_configured(tmp_path: Path) -> None:
    """The harness wrote .git: a config key that could run a program means no diff."""
    _needs_git()
    workspace = _workspace(tmp_path, repo=True)
    ran = tmp_path / "ran"
    (workspace / ".gitattributes").write_text("*.py filter=evil diff=evil\n")
    _git(workspace, "config", "filter.evil.clean", f"touch {ran}; cat")
    _git(workspace, "config", "diff.evil.textconv", f"touch {ran}; cat")
    text = gather_artifact(ArtifactSelection(), workspace, None)
    assert text == (
        "<diff>\n(no diff: .git/config sets keys not read for safety:"
        " filter.evil.clean, diff.evil.textconv)\n</diff>"
    )
    assert not ran.exists()
    (workspace / ".git").rename(tmp_path / "elsewhere")
    (workspace / ".git").write_text(f"gitdir: {tmp_path / 'elsewhere'}\n")
    text = gather_artifact(ArtifactSelection(), workspace, None)
    assert "(no diff: the workspace is not a git repository with its own .git" in text
    assert not ran.exists()


# --------------------------------------------------------------------------- the judge


@pytest.mark.parametrize("api", APIS)
def test_the_judge_scores_and_its_calls_stay_out_of_the_evaluated_execution(
    api: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _needs_git()
    workspace = _workspace(tmp_path, repo=True)

    async def main() -> None:
        replies = ["The sum is right now.\nSCORE: 0.7"]
        async with judge_proxy(tmp_path, tiny_model_dir, replies, monkeypatch) as judge:
            spec = _spec(api, judge.url)
            result = await evaluate_once(spec, workspace, timeout_s=60)
            assert (result.valid, result.score, result.detail) == (True, 0.7, "ok")
            assert result.critique == "The sum is right now."
            assert result.evaluator == "model"
            assert result.evaluator_name == f"model:tiny@{judge.url}/v1"
            assert result.artifact == artifact_digest(workspace)
            # The rubric, the artifact and the answer format reached the model.
            (prompt,) = judge.engine.prompts
            assert SYSTEM_PROMPT in prompt and RUBRIC in prompt and ANSWER_FORMAT in prompt
            assert "+    return a + b  # fixed" in prompt  # the diff
            assert '<file path="src/add.py">' in prompt
            # Nothing recorded into the evaluated execution: the judge's one call is in
            # its own execution, the only other one in the proxy's store.
            assert await judge.calls(judge.evaluated) == 0
            assert await judge.calls(judge.judge) == 1
            stored = {e.id for e in judge.server.store.executions()}
            assert stored == {judge.evaluated, judge.judge}

    asyncio.run(main())


@pytest.mark.parametrize("api", APIS)
def test_an_answer_without_a_score_is_unresolved_not_zero(
    api: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = _workspace(tmp_path)

    async def main() -> None:
        replies = ["It looks fine to me.", "Hard to say.", "I would rather not grade this."]
        async with judge_proxy(tmp_path, tiny_model_dir, replies, monkeypatch) as judge:
            spec = _spec(api, judge.url, attempts=3)
            options = EvaluationConfig(max_attempts=1)
            attempts = await assess(
                spec, workspace, deadline=time.monotonic() + 60, options=options
            )
            assert final(attempts) is None  # no reward: unresolved, never a zero
            (attempt,) = attempts
            assert attempt.valid is False and attempt.score is None
            assert attempt.detail.startswith("unresolved: no score after 3 judge call(s): ")
            assert (
                "call 3: no score line: last line 'I would rather not grade this.'"
                in attempt.detail
            )
            assert attempt.critique.startswith("unresolved:")
            assert attempt.critique.endswith("I would rather not grade this.")
            assert len(judge.engine.prompts) == 3
            assert await judge.calls(judge.judge) == 3 and await judge.calls(judge.evaluated) == 0

    asyncio.run(main())


def test_an_unparsable_answer_is_asked_again(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = _workspace(tmp_path)

    async def main() -> None:
        replies = ["Good work, I'd say 8/10.", "Good work.\nSCORE: 0.8"]
        async with judge_proxy(tmp_path, tiny_model_dir, replies, monkeypatch) as judge:
            result = await evaluate_once(_spec("anthropic", judge.url), workspace)
            assert (result.valid, result.score, result.critique) == (True, 0.8, "Good work.")
            assert len(judge.engine.prompts) == 2

    asyncio.run(main())


TESTS_SCRIPT = "print('collected 4 items: 4 passed'); print('{\"score\": 1.0, \"valid\": true}')"


@pytest.mark.parametrize("api", APIS)
def test_tests_run_first_and_their_score_is_combined(
    api: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = _workspace(tmp_path)

    async def main() -> None:
        async with judge_proxy(
            tmp_path, tiny_model_dir, ["Plain.\nSCORE: 0.6"], monkeypatch
        ) as judge:
            tests = {"command": [sys.executable, "-c", TESTS_SCRIPT], "timeout_s": 30}
            spec = _spec(api, judge.url, tests=tests, tests_weight=0.25)
            result = await evaluate_once(spec, workspace)
            assert result.valid and result.score == pytest.approx(0.25 * 1.0 + 0.75 * 0.6)
            assert result.critique == "[tests 1 x 0.25 + judge 0.6 x 0.75]\nPlain."
            (prompt,) = judge.engine.prompts
            assert 'score="1" detail="ok">\ncollected 4 items: 4 passed' in prompt

    asyncio.run(main())


def test_tests_without_a_valid_score_leave_the_judge_unasked(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = _workspace(tmp_path)

    async def main() -> None:
        async with judge_proxy(tmp_path, tiny_model_dir, ["SCORE: 1"], monkeypatch) as judge:
            spec = _spec("openai", judge.url, tests={"command": "echo broken >&2; exit 3"})
            result = await evaluate_once(spec, workspace)
            assert (result.valid, result.score) == (False, None)
            assert result.detail.startswith("tests without a valid score, the judge not asked")
            assert "exited with status 3: broken" in result.detail
            assert judge.engine.prompts == []

    asyncio.run(main())


def test_transport_failures_are_invalid_with_their_reason(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = _workspace(tmp_path)

    async def main() -> None:
        async with judge_proxy(tmp_path, tiny_model_dir, ["SCORE: 1"], monkeypatch) as judge:
            url = judge.url
            monkeypatch.setenv(KEY_ENV, "not-a-key-the-proxy-knows")
            refused = await evaluate_once(_spec("anthropic", url, attempts=2), workspace)
            assert (refused.valid, refused.score) == (False, None)
            assert refused.detail.startswith("unresolved: no score after 2 judge call(s)")
            assert refused.detail.count("HTTP 401 from") == 2
            assert judge.engine.prompts == []
        closed = await evaluate_once(_spec("openai", url, attempts=1), workspace)  # gone
        assert (closed.valid, closed.score) == (False, None)
        assert closed.detail.startswith("unresolved: no score after 1 judge call(s): call 1: ")
        monkeypatch.delenv(KEY_ENV)
        unset = await evaluate_once(_spec("openai", url), workspace)
        assert unset.detail == f"the judge's key variable {KEY_ENV} is not set"

    asyncio.run(main())
