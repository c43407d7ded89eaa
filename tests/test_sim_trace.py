"""The JSONL execution trace: models, reading with located errors, writing, replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.traces import write_trace

from qwengyre.records.trace import (
    TraceCall,
    TraceError,
    TraceRecord,
    TraceWriter,
    read_trace,
)
from qwengyre.sim.replay import TraceWorkload
from qwengyre.sim.workload import ExecutionSpec, paper_122b
from qwengyre.types import Outcome


def record(**overrides: object) -> dict[str, object]:
    line: dict[str, object] = {
        "query": "repo-1",
        "group": 0,
        "index": 0,
        "start_s": 10.0,
        "end_s": 70.0,
        "outcome": "completed",
        "reward": 1.0,
        "train_tokens": 500,
        "calls": [{"start_s": 11.0, "end_s": 12.5, "input_tokens": 100, "output_tokens": 20}],
    }
    line.update(overrides)
    return line


def write_lines(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def sample_records() -> list[TraceRecord]:
    spec = [
        # query, group, index, start, end, outcome, reward, tokens
        ("a", 0, 1, 0.0, 300.0, "completed", 1.0, 10),
        (7, 0, 0, 5.0, 65.0, "failed", 0.0, 0),
        ("a", 0, 0, 0.0, 100.0, "harness_timeout", 0.0, 20),
        ("7", 1, 0, 2.0, 4.0, "overall_timeout", None, 30),
        ("a", 0, 2, 1.0, 51.0, "completed", 0.0, 40),
    ]
    return [
        TraceRecord(
            query=q,
            group=g,
            index=i,
            start_s=s,
            end_s=e,
            outcome=Outcome(o),
            reward=r,
            train_tokens=t,
            calls=[TraceCall(start_s=s, end_s=e, input_tokens=3, output_tokens=4)],
        )
        for q, g, i, s, e, o, r, t in spec
    ]


# -- round trip and replay -----------------------------------------------------------


def test_write_then_read_round_trips(tmp_path: Path):
    records = sample_records()
    path = tmp_path / "trace.jsonl"
    write_trace(path, records)
    assert read_trace(path) == records
    assert isinstance(read_trace(path)[1].query, int)  # 7 stays an int, "7" a string
    assert isinstance(read_trace(path)[3].query, str)


def test_replay_gives_recorded_durations(tmp_path: Path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, sample_records())
    workload = TraceWorkload.from_path(path)
    assert workload.n_queries == 3  # "a", 7 and "7", in order of first appearance
    # query "a": executions ordered by (group, index) -> durations 100, 300, 50
    assert [workload.execution(0, i).duration_s for i in range(3)] == [100.0, 300.0, 50.0]
    assert workload.execution(1, 0).duration_s == 60.0
    assert workload.execution(2, 0).duration_s == 2.0


def test_replay_wraps_query_ids_and_indices(tmp_path: Path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, sample_records())
    workload = TraceWorkload.from_path(path)
    spec = workload.execution(3 + 0, 3 + 1)  # query 3 -> "a", index 4 -> its 2nd execution
    assert (spec.query_id, spec.index, spec.duration_s) == (3, 4, 300.0)
    assert workload.execution(0, 1) == ExecutionSpec(
        query_id=0,
        index=1,
        duration_s=300.0,
        outcome=Outcome.COMPLETED,
        reward=1.0,
        train_tokens=10,
    )


def test_replay_copies_outcome_reward_and_tokens(tmp_path: Path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, sample_records())
    workload = TraceWorkload.from_path(path)
    cut = workload.execution(0, 0)
    assert (cut.outcome, cut.reward, cut.train_tokens) == (Outcome.HARNESS_TIMEOUT, 0.0, 20)
    timed_out = workload.execution(2, 0)
    assert timed_out.outcome is Outcome.OVERALL_TIMEOUT
    assert timed_out.reward is None and not timed_out.valid
    assert timed_out.train_tokens == 0  # discarded from training whatever was recorded


def test_replay_estimates_missing_train_tokens_from_output_tokens():
    calls = [
        TraceCall(start_s=0.0, end_s=1.0, input_tokens=1000, output_tokens=30),
        TraceCall(start_s=1.0, end_s=2.0, input_tokens=2000, output_tokens=12),
    ]
    rec = TraceRecord(
        query=1,
        group=0,
        index=0,
        start_s=0.0,
        end_s=2.0,
        outcome=Outcome.FAILED,
        reward=0.0,
        calls=calls,
    )
    assert rec.train_tokens == 0
    assert TraceWorkload([rec]).execution(0, 0).train_tokens == 42


def test_replay_skips_cancelled_records():
    done = TraceRecord(
        query="q", group=0, index=0, start_s=0, end_s=5, outcome=Outcome.COMPLETED, reward=1.0
    )
    cancelled = TraceRecord(
        query="q", group=0, index=1, start_s=0, end_s=1, outcome=Outcome.CANCELLED, reward=None
    )
    workload = TraceWorkload([cancelled, done])
    assert [workload.execution(0, i).duration_s for i in range(3)] == [5.0, 5.0, 5.0]
    with pytest.raises(ValueError, match="no replayable records"):
        TraceWorkload([cancelled])


def test_parametric_workload_replays_through_a_trace(tmp_path: Path):
    source = paper_122b(5)
    records = []
    for q in range(4):
        for i in range(16):
            spec = source.execution(q, i)
            records.append(
                TraceRecord(
                    query=q,
                    group=q,
                    index=i,
                    start_s=100.0 * q,
                    end_s=100.0 * q + spec.duration_s,
                    outcome=spec.outcome,
                    reward=spec.reward,
                    train_tokens=spec.train_tokens,
                )
            )
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path) as writer:
        for rec in records:
            writer.write(rec)
    replay = TraceWorkload.from_path(path)
    for q in range(4):
        for i in range(16):
            got, want = replay.execution(q, i), source.execution(q, i)
            assert got.duration_s == pytest.approx(want.duration_s, rel=1e-12)
            assert (got.outcome, got.reward, got.train_tokens) == (
                want.outcome,
                want.reward,
                want.train_tokens,
            )


def test_writer_appends_and_flushes_each_line(tmp_path: Path):
    path = tmp_path / "trace.jsonl"
    first, second = sample_records()[:2]
    with TraceWriter(path, fsync=True) as writer:
        writer.write(first)
        assert read_trace(path) == [first]  # visible before close
    with TraceWriter(path) as writer:
        writer.write(second)
    assert read_trace(path) == [first, second]


def test_blank_lines_are_skipped(tmp_path: Path):
    path = write_lines(tmp_path / "t.jsonl", ["", record(), "   ", record(index=1), ""])
    assert [r.index for r in read_trace(path)] == [0, 1]


def test_optional_fields_default(tmp_path: Path):
    line = record()
    del line["train_tokens"], line["calls"]
    rec = read_trace(write_lines(tmp_path / "t.jsonl", [line]))[0]
    assert rec.train_tokens == 0 and rec.calls == [] and rec.version is None
    line["version"] = 3  # the policy version the execution launched with
    assert read_trace(write_lines(tmp_path / "v.jsonl", [line]))[0].version == 3


# -- errors -------------------------------------------------------------------------------


def test_empty_trace_is_a_clear_error(tmp_path: Path):
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(TraceError, match=r"empty\.jsonl: empty trace"):
        read_trace(path)
    with pytest.raises(TraceError, match="empty trace"):
        TraceWorkload.from_path(path)
    assert read_trace(path, allow_empty=True) == []


def test_all_cancelled_trace_names_the_file(tmp_path: Path):
    path = write_lines(tmp_path / "c.jsonl", [record(outcome="cancelled", reward=None)])
    with pytest.raises(TraceError, match=r"c\.jsonl: .*no replayable records"):
        TraceWorkload.from_path(path)


BAD_LINES = [
    ("bad JSON", '{"query": "a", "group": 0,', None, "invalid JSON"),
    ("not an object", "[1, 2, 3]", None, "expected a JSON object"),
    ("missing field", {k: v for k, v in record().items() if k != "end_s"}, "end_s", "missing"),
    ("negative time", record(start_s=-1.0), "start_s", "greater than or equal to 0"),
    (
        "end before start",
        record(start_s=50.0, end_s=40.0),
        "end_s",
        "end_s (40.0) < start_s (50.0)",
    ),
    ("unknown outcome", record(outcome="exploded"), "outcome", "'completed'"),
    ("unknown field", record(colour="red"), "colour", "unknown field"),
    ("negative count", record(train_tokens=-3), "train_tokens", "greater than or equal to 0"),
    (
        "bad call",
        record(calls=[{"start_s": 3, "end_s": 1, "input_tokens": 0, "output_tokens": 0}]),
        "calls[0].end_s",
        "< start_s",
    ),
    (
        "unknown call field",
        record(
            calls=[{"start_s": 0, "end_s": 1, "input_tokens": 0, "output_tokens": 0, "model": "x"}]
        ),
        "calls[0].model",
        "unknown field",
    ),
    (
        "non-finite reward",
        '{"query": "a", "group": 0, "index": 0, "start_s": 0, "end_s": 1, '
        '"outcome": "failed", "reward": NaN}',
        "reward",
        "finite",
    ),
    (
        "reward on overall timeout",
        record(outcome="overall_timeout", reward=0.0),
        "reward",
        "no valid reward",
    ),
    ("completed without reward", record(reward=None), "reward", "valid reward"),
    ("float query id", record(query=1.5), "query", "string or an integer"),
]


@pytest.mark.parametrize(
    ("case", "bad", "field", "message"), BAD_LINES, ids=[b[0] for b in BAD_LINES]
)
def test_bad_line_error_names_file_line_and_field(tmp_path: Path, case, bad, field, message):
    path = write_lines(tmp_path / "trace.jsonl", [record(), "", record(index=1), bad, record()])
    with pytest.raises(TraceError) as info:
        read_trace(path)
    text = str(info.value)
    assert text.startswith(f"{path}:4: "), text
    if field is not None:
        assert f"field '{field}'" in text, text
    assert message in text, text
    assert info.value.line == 4


def test_models_reject_directly_constructed_bad_values():
    with pytest.raises(ValueError):
        TraceCall(start_s=2.0, end_s=1.0, input_tokens=0, output_tokens=0)
    with pytest.raises(ValueError):
        TraceRecord(query="a", group=0, index=0, start_s=0, end_s=1, outcome="done", reward=1.0)
