"""Bodies that repeat a known prefix are parsed only past it, and read as json.loads reads
the whole body; anything unusual falls back to a whole parse."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from qwengyre.proxy.body import BodyMemo

messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text(max_size=6)}
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(
    msgs=messages,
    ascii_only=st.booleans(),
    indent=st.sampled_from([None, 1, "\n \t"]),
    messages_first=st.booleans(),
)
def test_a_growing_conversation_reads_as_the_whole_body(msgs, ascii_only, indent, messages_first):
    memo = BodyMemo(size=2)
    for n in range(1, len(msgs) + 1):
        fields = {"model": "m", "extra": [1, {"a": None}]}
        doc = (
            {"messages": msgs[:n], **fields} if messages_first else {**fields, "messages": msgs[:n]}
        )
        body = json.dumps(doc, ensure_ascii=ascii_only, indent=indent).encode()
        split = memo.split(body)
        assert split is not None
        before = split.known.state if split.known else []
        assert before + split.doc["messages"] == doc["messages"]
        assert {k: v for k, v in split.doc.items() if k != "messages"} == fields
        if n > 1:  # same serialisation: only the new message is decoded
            assert split.known is not None and len(split.doc["messages"]) == 1
        memo.remember(body, split, before + split.doc["messages"])


def test_anything_unusual_is_left_to_the_whole_parse():
    memo = BodyMemo()
    good = json.dumps({"model": "m", "messages": [{"a": 1}]}).encode()
    split = memo.split(good)
    assert split is not None and split.known is None
    memo.remember(good, split, [{"a": 1}])
    for bad in [
        b'{,"model":"m","messages":[1]}',
        b'{"model":"m","messages":[1],}',
        b'{"model":"m","messages":[1]} x',
        good[:-2] + b",]}",
        good[:-2] + b',{"b":2},]}',
        good[:-2] + b',{"b":NaN}]}',
        good[:-2] + b',{"b":2}] "x"}',
        b'{"messages":[1],"messages":[2]}',  # valid JSON, but which one counts is subtle
        b'{"model":"m","messages":[]}',
        b'{"model":"m","messages":{"a":1}}',
        b"\xff" + good,
        b"[" * 100_000,
    ]:
        assert memo.split(bad) is None, bad[:40]
    assert memo.split(good[:-2] + b',{"b":1e999}]}') is None  # jsonsafe's rules hold
    assert memo.split(good[:-2] + b"," + b"[" * 70 + b"]" * 70 + b"]}") is None
    cleaned = memo.split(good[:-2] + b',{"b":"\\ud800"}], "s": "\\udfff"}')
    assert cleaned is not None and cleaned.doc["messages"] == [{"b": "\ufffd"}]
    assert cleaned.doc["s"] == "\ufffd"
    repeat = memo.split(good)  # no new message: read whole
    assert repeat is not None and repeat.known is None and repeat.doc == json.loads(good)
    longer = good[:-2] + b', {"b": 2}]}'
    split = memo.split(longer)
    assert split is not None and split.known is not None
    assert split.doc == {"model": "m", "messages": [{"b": 2}]}
