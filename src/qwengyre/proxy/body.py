"""Request bodies that repeat a known prefix are parsed only past it.

A harness resends its whole conversation with every call, so at the 4,000th call of an
execution the body holds ~8,000 messages and parsing it (JSON, validation, conversion)
would cost ~50x the first call. But the same client serialises the same messages to the
same bytes: a body that starts with the bytes of an earlier body, up to the end of that
body's last message, holds those messages and then new ones. :func:`split` finds such a
prefix among an execution's recent bodies (one ``bytes.startswith``, C speed) and
JSON-decodes only what follows it plus the top-level fields, so the caller converts only
the new messages and reuses what it made of the old ones (:class:`KnownBody.state`).
What is decoded obeys :mod:`qwengyre.proxy.jsonsafe`'s rules, as a whole parse would:
bounded depth, no NaN/Infinity, lone surrogates replaced with U+FFFD.

The array of messages is the body's ``messages`` field, or the field the caller names
(the Responses API's ``input``). Anything unusual (a duplicate top-level key, a
messages value that is not an array, an exact repeat with no new message, undecodable
bytes) returns None and the caller parses the whole body as usual, so errors are always
reported by the API parsers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from qwengyre.proxy import jsonsafe

_WHITESPACE = " \t\n\r"
_DECODER = jsonsafe.DECODER


@dataclass(frozen=True)
class KnownBody:
    """The bytes of a body up to the end of its last message, and what they parsed to."""

    data: bytes  # body[: end of the last message element]
    key: str  # the messages field
    head: dict[str, Any]  # the top-level fields before it
    count: int  # message elements in ``data``
    state: Any  # the caller's conversion of those elements


@dataclass(frozen=True)
class SplitBody:
    """A body as a known prefix plus what follows it.

    ``doc`` is the whole top-level object except that ``doc[key]`` (its messages) holds
    only the elements after ``known.count`` (all of them if ``known`` is None).
    ``messages_end`` is the byte offset just after the last message element and
    ``head`` the top-level fields before ``key`` — what :meth:`BodyMemo.remember`
    needs to make this body a known prefix in turn.
    """

    doc: dict[str, Any]
    key: str
    known: KnownBody | None
    messages_end: int
    head: dict[str, Any]


class BodyMemo:
    """The most recent bodies of one execution (a main agent and a few sub-agents
    interleave), as prefixes for :func:`split`."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._known: list[KnownBody] = []  # the most recently used last

    def split(self, body: bytes, key: str = "messages") -> SplitBody | None:
        """``body``, whose messages are its field ``key``, split after the longest
        remembered prefix it starts with, or whole (``known`` None) when none fits; None
        if it is not a body this module can read (the caller parses it whole and reports
        what is wrong)."""
        for known in sorted(self._known, key=lambda k: len(k.data), reverse=True):
            if known.key == key and body.startswith(known.data):
                found = _split_after(body, known)
                if found is not None:
                    self._known.remove(known)
                    self._known.append(known)
                    return found
        return split_whole(body, key)

    def remember(self, body: bytes, split: SplitBody, state: Any) -> None:
        """Make ``body``'s messages (``state``: their conversion) a known prefix."""
        count = len(split.doc[split.key]) + (split.known.count if split.known else 0)
        known = KnownBody(body[: split.messages_end], split.key, split.head, count, state)
        self._known.append(known)
        del self._known[: -self.size]


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


def split_whole(body: bytes, key: str = "messages") -> SplitBody | None:
    """``body`` as a :class:`SplitBody` with no known prefix (``doc`` the whole object),
    or None where :meth:`BodyMemo.split` returns None."""
    try:
        text = body.decode("utf-8")
        at = _skip(text, 0)
        if text[at : at + 1] != "{":
            return None
        jsonsafe.check_depth(text)
        split = _scan(text, at + 1, key, {}, None, _Offsets(body, text, 0))
    except (ValueError, IndexError, RecursionError):
        return None
    return _clean(split, text)


def _split_after(body: bytes, known: KnownBody) -> SplitBody | None:
    try:
        text = body[len(known.data) :].decode("utf-8")
        at = _skip(text, 0)
        if text[at : at + 1] != ",":  # an exact repeat has no new message: parse it whole
            return None
        jsonsafe.check_depth(text, start=2)  # inside the object and its messages array
        doc = dict(known.head)
        offsets = _Offsets(body[len(known.data) :], text, len(known.data))
        split = _scan(text, at, known.key, doc, known, offsets, in_messages=True)
    except (ValueError, IndexError, RecursionError):
        return None
    return _clean(split, text)


def _clean(split: SplitBody | None, text: str) -> SplitBody | None:
    """``split`` with lone surrogates in what was decoded from ``text`` replaced."""
    if split is None:
        return None
    doc = jsonsafe.clean_surrogates(split.doc, text)
    if doc is split.doc:
        return split
    return replace(split, doc=doc, head={key: doc[key] for key in split.head})


class _Offsets:
    """Byte offsets of positions in ``text`` (the decoded ``body[shift:]``); O(1) for
    ASCII bodies (what ``json.dumps`` writes by default), else O(position)."""

    def __init__(self, body: bytes, text: str, shift: int) -> None:
        self.ascii = len(body) == len(text)
        self.text = text
        self.shift = shift

    def __call__(self, at: int) -> int:
        if self.ascii:
            return self.shift + at
        return self.shift + len(self.text[:at].encode("utf-8"))


def _scan(
    text: str,
    at: int,
    messages_key: str,
    doc: dict[str, Any],
    known: KnownBody | None,
    offsets: _Offsets,
    *,
    in_messages: bool = False,
) -> SplitBody | None:
    """Scan the rest of the top-level object from ``at`` (just after ``{``, or, with
    ``in_messages``, inside the messages array ``messages_key`` after its known
    elements)."""
    messages: list[Any] = []
    messages_end = -1
    head: dict[str, Any] = dict(doc)
    if in_messages:
        at, last = _elements(text, at, messages)
        messages_end = offsets(last)
        doc[messages_key] = messages
    expect_key = not in_messages
    while True:
        at = _skip(text, at)
        if not expect_key:  # after a value: "," and a key, or the end
            if text[at] == "}":
                break
            if text[at] != ",":
                return None
            at = _skip(text, at + 1)
        expect_key = False
        key, at = _DECODER.raw_decode(text, at)
        at = _skip(text, at)
        if not isinstance(key, str) or key in doc or text[at] != ":":
            return None
        at = _skip(text, at + 1)
        if key == messages_key:
            if text[at] != "[":
                return None
            head = dict(doc)
            messages, at = _DECODER.raw_decode(text, at)
            last = at - 1  # the closing bracket; the last element ends before it
            while text[last - 1] in _WHITESPACE:
                last -= 1
            messages_end = offsets(last)
            doc[key] = messages
        else:
            doc[key], at = _DECODER.raw_decode(text, at)
    if _skip(text, at + 1) != len(text) or not isinstance(doc.get(messages_key), list):
        return None
    if not doc[messages_key]:
        return None
    return SplitBody(doc, messages_key, known, messages_end, head)


def _elements(text: str, at: int, out: list[Any]) -> tuple[int, int]:
    """Decode the array elements that follow earlier ones (``at`` is at the ``,``
    after them) into ``out`` up to the closing ``]``; (the position after it, the
    position after the last element)."""
    while True:
        at = _skip(text, at)
        if text[at] != ",":
            raise ValueError("expected ','")
        element, at = _DECODER.raw_decode(text, _skip(text, at + 1))
        out.append(element)
        end = at
        at = _skip(text, at)
        if text[at] == "]":
            return at + 1, end
