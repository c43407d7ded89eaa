"""Streaming a reply's text: IncrementalDecoder (proxy/render.py) and the hermes parser's
ToolCallStream (proxy/parsers/base.py)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from qwengyre.proxy.parsers import TOOL_PARSERS, cut_at_stop
from qwengyre.proxy.render import IncrementalDecoder

HERMES = TOOL_PARSERS["hermes"]

T = TypeVar("T")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chunked(data: st.DataObject, items: Sequence[T]) -> list[Sequence[T]]:
    """``items`` split at random points (empty chunks included)."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(items)), max_size=12)))
    bounds = [0, *cuts, len(items)]
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


# --------------------------------------------------------------------- IncrementalDecoder


def decode_incrementally(tokenizer: Any, chunks: Sequence[Sequence[int]]) -> list[str]:
    decoder = IncrementalDecoder(tokenizer)
    return [decoder.push(chunk) for chunk in chunks] + [decoder.flush()]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_decoder_concatenates_to_decode_of_random_ids(
    tokenizer: PreTrainedTokenizerBase, data: st.DataObject
) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))
    pieces = decode_incrementally(tokenizer, chunked(data, ids))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=40), data=st.data())
def test_decoder_concatenates_to_decode_of_encoded_text(
    tokenizer: PreTrainedTokenizerBase, text: str, data: st.DataObject
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = decode_incrementally(tokenizer, chunked(data, ids))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in text


def test_decoder_holds_an_incomplete_character_and_skips_special_tokens(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = tokenizer.encode("a🎉b", add_special_tokens=False)
    one_by_one = decode_incrementally(tokenizer, [[t] for t in ids])
    assert "".join(one_by_one) == "a🎉b"
    assert all("\ufffd" not in p for p in one_by_one)
    eos = tokenizer.eos_token_id
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push([*ids, eos]) == "a🎉b"
    assert decoder.push([eos]) == "" and decoder.flush() == ""


def test_decoder_window_stays_small(tokenizer: PreTrainedTokenizerBase) -> None:
    decoder = IncrementalDecoder(tokenizer)
    ids = tokenizer.encode("word " * 200, add_special_tokens=False)
    out = "".join(decoder.push([t]) for t in ids)
    assert out == "word " * 200
    assert len(decoder._window) <= 2


# ------------------------------------------------------------------------ ToolCallStream

CALL = '{"name": "f", "arguments": {"x": 1}}'
CALL2 = '{"name": "g", "arguments": "{\\"y\\": [1, 2]}"}'  # arguments encoded twice
FRAGMENTS = [
    f"<tool_call>{CALL}</tool_call>",
    f"<tool_call>\n{CALL2}\n</tool_call>",
    f"\n<tool_call> {CALL} </tool_call>\n",
    "<tool_call>{oops}</tool_call>",
    '<tool_call>{"name": "h", "arguments": {"z": NaN}}</tool_call>',
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "call>",
    "</tool",
    "<",
    ">",
    "/",
    CALL,
    CALL2,
    '{"name": 1}',
    '{"name": "h", "arguments": {"z": NaN}}',
    "{oops",
    " ",
    "  ",
    "\n",
    "\t",
    "a",
    "Hello",
    " world",
    "é🎉",
    "STOP",
    "#",
]
texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=24).map("".join)


def reference(full: str, stops: Sequence[str]) -> tuple[str, list[Any], str | None]:
    """What a whole reply gives (the recorder's rule): the hermes parser's parse of ``full`` cut
    before its first stop string (earliest, then listed)."""
    cut, stop = cut_at_stop(full, stops)
    text, calls = HERMES.parse(cut)
    return text, calls, stop


def stream(full_chunks: Sequence[str], stops: Sequence[str]) -> tuple[list[str], Any]:
    reply = HERMES.stream(stops)
    shown = [reply.feed(chunk) for chunk in full_chunks]
    return shown, reply.finish()


@st.composite
def stop_strings(draw: st.DrawFn, full: str) -> list[str]:
    """Stop strings that often occur in ``full`` (its substrings) or nearly do."""
    one = st.sampled_from(["", "STOP", "</tool_call>", "call>", "<tool", "\n\n", " w", "#"])
    if full:
        start = draw(st.integers(0, len(full) - 1))
        end = draw(st.integers(start, min(len(full), start + 14)))
        one |= st.just(full[start:end])
    return draw(st.lists(one | st.text(max_size=4), max_size=4))


@settings(max_examples=1500, deadline=None)
@given(full=texts, data=st.data())
def test_reply_stream_shows_exactly_the_parsed_text(full: str, data: st.DataObject) -> None:
    stops = data.draw(stop_strings(full))
    shown, (last, text, calls, stop) = stream(chunked(data, full), stops)  # type: ignore[arg-type]
    assert "".join(shown) + last == text
    assert (text, calls, stop) == reference(full, stops)


@settings(max_examples=300, deadline=None)
@given(full=texts.filter(lambda t: "<" not in t), data=st.data())
def test_reply_stream_holds_back_nothing_else(full: str, data: st.DataObject) -> None:
    shown, (last, text, _, _) = stream(chunked(data, full), ())  # type: ignore[arg-type]
    assert "".join(shown) == full.strip() == text and last == ""


def test_text_before_a_call_is_shown_before_the_call_closes() -> None:
    reply = HERMES.stream(())
    assert reply.feed("  Let me look.") == "Let me look."
    assert reply.feed("\n<tool") == ""
    assert reply.feed("_call>\n" + CALL[:10]) == ""
    assert reply.feed(CALL[10:] + "\n</tool_call>") == ""
    assert reply.feed("\n") == ""
    assert reply.finish() == ("", "Let me look.", [("f", {"x": 1})], None)


def test_a_held_tag_prefix_is_released_when_it_is_not_a_tag() -> None:
    reply = HERMES.stream(())
    assert reply.feed("a <too") == "a"
    assert reply.feed("th") == " <tooth"
    assert reply.feed("<tool_call>{bad}") == ""
    assert reply.feed("</tool_call> z") == "<tool_call>{bad}</tool_call> z"
    assert reply.finish()[1:] == ("a <tooth<tool_call>{bad}</tool_call> z", [], None)


def test_trailing_whitespace_waits_for_text() -> None:
    reply = HERMES.stream(())
    assert [reply.feed(t) for t in ["\n", "one", " \n", "two", "\n\n"]] == [
        "",
        "one",
        "",
        " \ntwo",
        "",
    ]
    assert reply.finish() == ("", "one \ntwo", [], None)


def test_stop_strings_cut_and_hold_only_what_may_match() -> None:
    reply = HERMES.stream(["\nUser:", "END"])
    assert reply.feed("Hi there\nUs") == "Hi there"
    assert reply.feed("ually fine. EN") == "\nUsually fine."
    assert reply.feed("D and more <tool_call>" + CALL + "</tool_call>") == ""
    assert reply.finish() == ("", "Hi there\nUsually fine.", [], "END")


def test_the_first_listed_stop_string_wins_at_one_position() -> None:
    reply = HERMES.stream(["abc", "ab"])
    assert reply.feed("x ab") == "x"
    assert reply.feed("c") == ""
    assert reply.finish() == ("", "x", [], "abc")
    assert HERMES.stream(["abc", "ab"]).finish() == ("", "", [], None)


def test_a_stop_string_inside_a_call_cuts_it_into_text() -> None:
    reply = HERMES.stream(['"x"'])
    assert reply.feed("ok <tool_call>" + CALL + "</tool_call>") == "ok"
    assert reply.finish() == (
        ' <tool_call>{"name": "f", "arguments": {',
        'ok <tool_call>{"name": "f", "arguments": {',
        [],
        '"x"',
    )


@pytest.mark.parametrize(
    "stops",
    [(), ("</tool_call>",), ('"}}\n</tool_call> END',), ("zz", "\n</tool"), ("x" * 40,)],
)
def test_a_long_block_fed_a_character_at_a_time_streams_as_it_parses_whole(
    stops: tuple[str, ...],
) -> None:
    # While a block waits for its close tag, a feed that can neither close it nor hit a
    # stop string is put aside (linear time); the close tag or a stop string straddling
    # two feeds is still found.
    body = json.dumps({"name": "f", "arguments": {"text": "line\n" * 300 + "x" * 39}})
    full = "Writing.\n<tool_call>\n" + body + "\n</tool_call> END and after"
    shown, (last, text, calls, stop) = stream(list(full), stops)
    assert "".join(shown) + last == text
    assert (text, calls, stop) == reference(full, stops)
    if calls:  # the block closed as it was fed: what follows it showed at once
        assert last == "" and text.endswith("END and after")
