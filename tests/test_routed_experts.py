"""The routing record's form: compact types, its two alignments, and its bytes."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tests.test_durable import call

from qwengyre.proxy.store import Store
from qwengyre.proxy.tito import Turn
from qwengyre.trajectories import routed_experts as rx
from qwengyre.trajectories.tree import Node


def test_ids_are_kept_in_the_smallest_signed_type_that_holds_them() -> None:
    assert rx.compact(np.array([[[0, 127]]])).dtype == np.int8  # Qwen3-MoE's 128 experts
    assert rx.compact(np.array([[[0, 128]]])).dtype == np.int16  # DeepSeek-V3's 256
    assert rx.compact(np.zeros((0, 2, 2), dtype=np.int64)).dtype == np.int8
    with pytest.raises(ValueError, match=r"\[rows, layers, k\]"):
        rx.compact(np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"\[-1, 32767\]"):
        rx.compact(np.array([[[-2, 0]]]))


def test_a_node_s_rows_are_the_positions_before_its_tokens_copied() -> None:
    positions = np.arange(9, dtype=np.int8).reshape(9, 1, 1)  # a 10-token request
    root = rx.before_each_token(positions, 0, 4)
    assert root[:, 0, 0].tolist() == [rx.UNKNOWN, 0, 1, 2]
    child = rx.before_each_token(positions, 4, 6)  # tokens 4..9: positions 3..8
    assert child[:, 0, 0].tolist() == [3, 4, 5, 6, 7, 8]
    assert child.base is None  # keeps none of the whole request's rows alive
    with pytest.raises(ValueError, match="need 10 routed positions, the engine reported 9"):
        rx.before_each_token(positions, 4, 7)


def test_rows_join_along_a_path_and_back_to_positions() -> None:
    a = np.array([[[rx.UNKNOWN]], [[1]], [[2]]], dtype=np.int8)
    c = np.array([[[300]]], dtype=np.int16)
    joined = rx.join([a, None, c], [3, 2, 1])
    assert joined is not None and joined.dtype == np.int16
    assert joined[:, 0, 0].tolist() == [rx.UNKNOWN, 1, 2, rx.UNKNOWN, rx.UNKNOWN, 300]
    assert rx.join([None, None], [1, 2]) is None
    with pytest.raises(ValueError, match="different shapes"):
        rx.join([a, np.zeros((1, 2, 1), dtype=np.int8)], [3, 1])
    # Position p is the row before token p + 1; the last position has none.
    assert rx.by_position(joined)[:, 0, 0].tolist() == [1, 2, -1, -1, 300, -1]


def test_bytes_round_trip_and_a_wrong_form_is_named() -> None:
    rows = rx.compact(np.random.default_rng(0).integers(-1, 200, size=(7, 3, 2)))
    data, form = rx.encode(rows)
    assert form == "int16:3:2" and len(data) == 7 * 3 * 2 * 2
    np.testing.assert_array_equal(rx.decode(data, form), rows)
    with pytest.raises(ValueError, match="not whole int16:3:2 rows"):
        rx.decode(data[:-1], form)
    with pytest.raises(ValueError, match="allowed"):
        rx.decode(data, "float32:3:2")


def test_the_store_keeps_a_node_s_routing_and_opens_a_store_written_before_it(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(1)

    def routed(i: int) -> tuple[Node, Turn]:
        node, turn = call(i)
        rows = rx.compact(rng.integers(-1, 4, size=(500, 2, 2)))  # 400 + 100 tokens
        return replace(node, routing=rows), turn

    store = Store(tmp_path / "proxy.sqlite")
    store.add_execution("ex", "hash", 0.0)
    written = [routed(0), call(1)]  # a call served without routing keeps None
    for node, turn in written:
        store.add_call("ex", node, turn)
    store.close()
    loaded = [node for node, _ in Store(tmp_path / "proxy.sqlite").calls("ex")]
    assert loaded == [node for node, _ in written]  # Node equality compares the routing
    assert loaded[0].routing is not None and loaded[1].routing is None

    old = tmp_path / "old.sqlite"  # a store written before routing was recorded
    store = Store(old)
    store.add_execution("ex", "hash", 0.0)
    store.add_call("ex", *call(0))
    store.close()
    db = sqlite3.connect(old)
    db.execute("ALTER TABLE nodes DROP COLUMN routing")
    db.execute("ALTER TABLE nodes DROP COLUMN routing_form")
    db.commit()
    db.close()
    store = Store(old)
    later = routed(1)
    store.add_call("ex", *later)
    assert [node for node, _ in store.calls("ex")] == [call(0)[0], later[0]]


def test_a_call_whose_routing_does_not_fit_is_recorded_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    from qwengyre.engines.base import GenerateResult
    from qwengyre.proxy.tito import _node_routing

    call = SimpleNamespace(  # 6 prompt tokens, 2 of them new after the parent's context
        prompt_ids=[1] * 6, input_ids=(1, 1), request_class=SimpleNamespace(name="main.task")
    )
    rows = rx.compact(np.arange(8).reshape(8, 1, 1))  # 6 + 3 - 1 positions
    fits = GenerateResult((5, 6, 7), (-1.0,) * 3, (0,) * 3, "stop", rows)
    node = _node_routing(call, fits)  # type: ignore[arg-type]
    assert node is not None and node[:, 0, 0].tolist() == [3, 4, 5, 6, 7]
    short = GenerateResult((5, 6, 7), (-1.0,) * 3, (0,) * 3, "stop", rows[:-1])
    assert _node_routing(call, short) is None  # type: ignore[arg-type]
    assert "routed experts for 7 positions, the call ran 8; not recorded" in caplog.text
