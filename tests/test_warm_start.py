"""Warm start: the ideal episode is what the proxy records; tasks split; SFT stops on accuracy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.test_proxy_server import Running, start

from qwengyre.apps import warm_start as ws
from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy.render import ChatRenderer
from qwengyre.rollout import toy_tasks
from qwengyre.rollout.tasks import load_tasks
from qwengyre.rollout.toy_harness import run_toy_agent

PROBLEM = toy_tasks.addition_problem(37, 45)
TWO_DIGIT: toy_tasks.Ranges = ((10, 99), (10, 99))
"""Two-digit plus two-digit (8,100 pairs): operand ranges other than the default."""


@pytest.fixture
def ideal_proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), ws.ideal_script(PROBLEM))
    yield from start(tmp_path, tiny_model_dir, engines=[engine], max_context=1_000_000)


ANSWER_CALL = ("sub.task", 0)
"""(request class, turn within that class) of the call that writes answer.txt."""


def answer_correct(text: str, problem: toy_tasks.ToyProblem) -> bool:
    """Does a decoded reply write a correct answer for ``problem``?"""
    content = ws.written_answer(text)
    return content is not None and problem.correct(content)


def test_ideal_episode_equals_what_the_proxy_records(ideal_proxy: Running, tmp_path: Path):
    task = PROBLEM.task
    ex = ideal_proxy.new_execution()
    workspace = tmp_path / "ws"
    workspace.mkdir()
    result = asyncio.run(
        run_toy_agent(ex["openai_base_url"], ex["key"], task.instructions, workspace)
    )
    assert result.finished and result.compacted and result.calls == 6
    assert task.evaluator.score(workspace) == 1.0  # type: ignore[union-attr]
    nodes = ideal_proxy.tree(ex["id"])
    by_id = {n["id"]: n for n in nodes}

    def context(node: dict) -> list[int]:
        ids: list[int] = []
        path = [node]
        while path[-1]["parent"] is not None:
            path.append(by_id[path[-1]["parent"]])
        for n in reversed(path):
            ids += n["input_ids"] + n["output_ids"]
        return ids

    recorded = [(n["class"], context(n)[: -len(n["output_ids"])], n["output_ids"]) for n in nodes]
    episode = ws.ideal_episode(ChatRenderer(ideal_proxy.tokenizer), PROBLEM)  # type: ignore[arg-type]
    ours = [(c.request_class, list(c.prompt_ids), list(c.reply_ids)) for c in episode.calls]
    assert ours == recorded
    assert [c for c, _, _ in recorded] == [
        "main.task",
        "sub.task",
        "sub.task",
        "main.task",
        "main.summary",
        "main.task",
    ]
    assert episode.score == 1.0 and episode.result == result
    # The chains are the tree's leaves with the sampled tokens as targets.
    leaves = [n for n in nodes if not any(m["parent"] == n["id"] for m in nodes)]
    assert [list(ids) for ids, _ in episode.chains] == [context(n) for n in leaves]
    for (ids, mask), leaf in zip(episode.chains, leaves, strict=True):
        assert [t for t, m in zip(ids, mask, strict=True) if m][-len(leaf["output_ids"]) :] == (
            leaf["output_ids"]
        )
    # The answer call's reply is the sum, parsed as the proxy parses it.
    answer = next(c for c in episode.calls if (c.request_class, c.turn) == ANSWER_CALL)
    text = ideal_proxy.tokenizer.decode(answer.reply_ids[:-1])  # type: ignore[attr-defined]
    assert answer_correct(text, PROBLEM)
    assert not answer_correct(text, toy_tasks.addition_problem(37, 46))
    # The cheap answer-call-only rows are that same call.
    assert ws.answer_call(ChatRenderer(ideal_proxy.tokenizer), PROBLEM) == answer  # type: ignore[arg-type]


def test_answer_parsing_and_the_parity_rule():
    call = ws.tool_call_text
    sum82 = toy_tasks.addition_problem(40, 42)
    assert answer_correct(call("write_file", path="answer.txt", content=" 82\n"), sum82)
    assert not answer_correct(call("write_file", path="other.txt", content="82"), sum82)
    assert not answer_correct("82", sum82)
    two = call("write_file", path="answer.txt", content="82") + call(
        "write_file", path="answer.txt", content="8"
    )
    assert not answer_correct(two, sum82)  # the last write wins, as in the workspace
    parity = toy_tasks.parity_problem(3)
    assert [parity.correct(x) for x in ("42", " 18\n", "43", "08", "4", "100")] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


def test_parity_tasks_score_the_workspace_and_split_disjointly(tmp_path: Path):
    splits = [toy_tasks.problems(s) for s in ("rl", "heldout", "train")]
    ids = [p.task.id for split in splits for p in split]
    assert len(ids) == len(set(ids)) and len(splits[0]) == toy_tasks.RL_SIZE
    answers = {p.ideal_answer for p in splits[2]}
    assert any(int(a) % 2 for a in answers) and any(int(a) % 2 == 0 for a in answers)
    assert toy_tasks.score_even(tmp_path, {}) == 0.0  # no answer.txt: a valid zero
    (tmp_path / "answer.txt").write_text("64\n")
    assert toy_tasks.score_even(tmp_path, {}) == 1.0
    (tmp_path / "answer.txt").write_text("65")
    assert toy_tasks.score_even(tmp_path, {}) == 0.0


@pytest.mark.parametrize("ranges", [toy_tasks.RANGES, TWO_DIGIT])
def test_tasks_are_deterministic_and_disjoint(ranges: toy_tasks.Ranges):
    rl, held, train = (
        toy_tasks.rl_pairs(ranges),
        toy_tasks.heldout_pairs(ranges),
        toy_tasks.warm_start_pairs(ranges),
    )
    assert len(rl) == toy_tasks.RL_SIZE and len(held) == toy_tasks.HELDOUT_SIZE
    assert len(set(rl)) == len(rl) and len(set(held)) == len(held)
    assert not set(rl) & set(held) and not set(rl) & set(train) and not set(held) & set(train)
    everything = toy_tasks.all_pairs(ranges)
    assert set(rl) | set(held) | set(train) == set(everything)
    assert len(rl) + len(held) + len(train) == len(everything)
    (a_lo, a_hi), (b_lo, b_hi) = ranges
    assert all(a_lo <= a <= a_hi and b_lo <= b <= b_hi for a, b in everything)
    examples = load_tasks(Path(toy_tasks.__file__).with_name("example_tasks.jsonl"))
    in_range = [(t.metadata["a"], t.metadata["b"]) for t in examples]
    in_range = [p for p in in_range if p in set(everything)]
    assert rl[: len(in_range)] == in_range  # the in-range examples come first
    # The same split in a fresh computation (no hidden state).
    toy_tasks._split.cache_clear()
    toy_tasks._example_pairs.cache_clear()
    assert toy_tasks.rl_pairs(ranges) == rl and toy_tasks.warm_start_pairs(ranges) == train


def test_default_tasks_are_parity_and_bundled():
    assert toy_tasks.RANGES == toy_tasks.TWO_PLUS_ONE == ((10, 99), (1, 9))
    assert len(toy_tasks.all_pairs()) == 810
    assert len(toy_tasks.all_pairs(TWO_DIGIT)) == 8100
    bundled = load_tasks(toy_tasks.toy_tasks_path())
    assert toy_tasks.TOY_KIND == "parity" and bundled == toy_tasks.rl_tasks()
    assert bundled[0].instructions == toy_tasks.EVEN_INSTRUCTIONS
    examples = load_tasks(Path(toy_tasks.__file__).with_name("example_tasks.jsonl"))
    addition = toy_tasks.rl_tasks(kind="addition")
    a, b = addition[0].metadata["a"], addition[0].metadata["b"]
    assert addition[0].instructions == examples[0].instructions.replace("37+45", f"{a}+{b}")
    assert addition[0].evaluator.expected == str(a + b)  # type: ignore[union-attr]


def test_short_warm_start_lowers_loss_and_saves_a_loadable_model(
    tiny_model_dir: Path, tmp_path: Path
):
    from transformers import AutoModelForCausalLM

    from qwengyre.engines.embedded import EmbeddedEngine

    logs: list[str] = []
    out = tmp_path / "warm"
    short = {"batch_size": 4, "answer_batch": 16, "eval_every": 12, "eval_size": 4}
    # Any measurement reaches target 0: it stops at its first evaluation, after 12 steps
    # (seeded: the same losses on any machine, however loaded).
    result = ws.warm_start(
        tiny_model_dir, out, target_accuracy=0.0, max_steps=50, log=logs.append, **short
    )
    assert result.reached and result.path == out and result.steps == 12
    assert result.history and result.history[-1][0] == result.steps
    assert result.accuracy == result.history[-1][2] and 0.0 <= result.accuracy <= 1.0
    assert len(result.losses) == 12 and result.losses[-1] < result.losses[0] * 0.8
    assert any(line.startswith("step 12 of at most 50: ") and "s left" in line for line in logs)
    record = json.loads((out / "warm_start.json").read_text())
    assert record["reached"] is True and record["steps"] == result.steps
    AutoModelForCausalLM.from_pretrained(out)
    EmbeddedEngine(out, capacity=2).close()


def test_stops_at_the_first_evaluation_meeting_the_target(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    measured = iter([0.1, 0.3, 0.5, 0.9])
    monkeypatch.setattr(ws, "_episode_score", lambda *args: next(measured))
    result = ws.warm_start(
        tiny_model_dir,
        tmp_path / "warm",
        target_accuracy=0.45,
        max_steps=60,
        batch_size=2,
        answer_batch=4,
        eval_every=2,
        eval_size=2,
    )
    assert result.reached and result.accuracy == 0.5 and result.steps == 6
    assert [(s, a) for s, _, a in result.history] == [(2, 0.1), (4, 0.3), (6, 0.5)]


def test_a_warm_start_is_kept_and_reused_by_a_run_with_the_same_settings(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("QWENGYRE_CACHE", str(tmp_path / "cache" / "models"))
    made: list[Path] = []

    def fake(model_dir: Path, out_dir: Path, **kw: object) -> str:
        made.append(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"made": len(made)}))
        return "result"

    monkeypatch.setattr(ws, "warm_start", fake)
    settings = {"target_accuracy": 0.4, "max_steps": 300, "seed": 0}
    said: list[str] = []
    first = ws.cached_warm_start(tiny_model_dir, tmp_path / "run1" / "warm_start", **settings)
    again = ws.cached_warm_start(
        tiny_model_dir, tmp_path / "run2" / "warm_start", log=said.append, **settings
    )
    assert first == "result" and again is None and len(made) == 1
    assert json.loads((tmp_path / "run2" / "warm_start" / "config.json").read_text()) == {"made": 1}
    assert "the one made before with the same settings" in said[0]
    other = {**settings, "target_accuracy": 0.5}  # other settings: a warm start of its own
    ws.cached_warm_start(tiny_model_dir, tmp_path / "run3" / "warm_start", **other)
    assert len(made) == 2
