"""The reply parsers' streaming cost against the reply's length, in one run.

Each reply is fed to :meth:`~qwengyre.proxy.parsers.ReplyFormat.stream` in chunks of
``--chunk`` characters (about a decoded token each), then finished, as the proxy streams
a reply; the streamed reply is checked against the whole reply's parse. A reply of 1x
and one ``--times`` (N) times longer, of the same shape, are timed in alternating rounds
(``--rounds``; each figure is the process's CPU time in the fastest round, the machine
being shared); the last
column is N x's time over 1 x's: about N where the parse is linear in the reply, about
N squared where it is quadratic.

Shapes (1x is about ``--chars`` characters):

- ``hermes, many calls``: text paragraphs, each followed by a ``<tool_call>`` JSON call;
- ``hermes, one long call``: one call whose argument is the whole length (a file's
  content, written in one call);
- ``qwen3_coder, many calls`` and ``qwen3_coder, one long call``: the same in the XML
  format (``<function=...><parameter=...>``);
- ``think (qwen3), long reasoning``: reasoning opened by the prompt
  (``assistant\\n<think>\\n``, as Qwen3 thinking models) for the whole length, then
  ``</think>`` and a short answer.

    python benchmarks/bench_parsers.py [--chars 20000] [--times 8] [--rounds 5]
    python benchmarks/bench_parsers.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable

from _smoke import parse
from qwengyre.proxy.parsers import ReplyFormat, reply_format
from qwengyre.proxy.types import ToolSpec

TOOLS = [
    ToolSpec(
        "write",
        "Write a file",
        {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}},
    )
]
PARAGRAPH = "Let me look at the next file, then write what it needs. " * 3


def hermes_call(text: str) -> str:
    call = {"name": "write", "arguments": {"path": "a.py", "text": text}}
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


def coder_call(text: str) -> str:
    return (
        "<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n"
        f"<parameter=text>\n{text}\n</parameter>\n</function>\n</tool_call>"
    )


def many(call: Callable[[str], str]) -> Callable[[int], str]:
    """Replies of ``n`` characters or so: paragraphs, each with a short call."""
    unit = PARAGRAPH + "\n" + call("print('hello')\n" * 4) + "\n"
    return lambda n: unit * max(1, n // len(unit))


def long(call: Callable[[str], str]) -> Callable[[int], str]:
    """Replies of ``n`` characters or so: one call whose argument is nearly all of them."""
    line = "    total += compute(item, scale=2)  # keep going\n"
    return lambda n: "Writing the file.\n" + call(line * max(1, n // len(line)))


def reasoning(n: int) -> str:
    line = "First I check the file, then the tests, then I decide.\n"
    return line * max(1, n // len(line)) + "</think>\n\nDone: wrote the file."


# (name, the reply format, the prompt's end, replies by length)
SHAPES: list[tuple[str, ReplyFormat, str, Callable[[int], str]]] = [
    ("hermes, many calls", reply_format("hermes", "none", ""), "", many(hermes_call)),
    ("hermes, one long call", reply_format("hermes", "none", ""), "", long(hermes_call)),
    ("qwen3_coder, many calls", reply_format("qwen3_coder", "none", ""), "", many(coder_call)),
    ("qwen3_coder, one long call", reply_format("qwen3_coder", "none", ""), "", long(coder_call)),
    (
        "think (qwen3), long reasoning",
        reply_format("hermes", "qwen3", ""),
        "<|im_start|>assistant\n<think>\n",
        reasoning,
    ),
]


def stream_seconds(replies: ReplyFormat, tail: str, text: str, chunk: int) -> float:
    """The CPU time (this process's, garbage collection off) to stream-parse ``text`` in
    ``chunk``-character pieces and finish; AssertionError if what was streamed is not
    what the whole parse gives."""
    pieces = [text[at : at + chunk] for at in range(0, len(text), chunk)]
    gc.collect()
    gc.disable()
    try:
        started = time.process_time()
        stream = replies.stream((), TOOLS, tail)
        shown = [stream.feed(piece) for piece in pieces]
        last, reply = stream.finish()
        seconds = time.process_time() - started
    finally:
        gc.enable()
    shown.append(last)
    assert reply == replies.parse(text, (), TOOLS, tail), "streamed != whole"
    assert "".join(s.text for s in shown) == reply.text
    assert "".join(s.reasoning for s in shown) == reply.reasoning
    assert reply.calls or reply.reasoning, "the reply parsed to nothing: a shape is wrong"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=20_000, help="1x's length (characters)")
    parser.add_argument("--times", type=int, default=8, help="N: the long reply is N x 1x")
    parser.add_argument("--chunk", type=int, default=4, help="characters fed at a time")
    parser.add_argument("--rounds", type=int, default=5)
    args = parse(parser, chars=2_000, times=4, rounds=1)
    n = args.times
    print(f"{args.chunk}-character chunks; CPU time, fastest of {args.rounds} rounds")
    print(f"| shape | 1x chars | 1x ms | {n}x chars | {n}x ms | {n}x / 1x (linear: ~{n}) |")
    print("|---|---|---|---|---|---|")
    for name, replies, tail, make in SHAPES:
        short, longer = make(args.chars), make(args.chars * n)
        best = [float("inf"), float("inf")]
        for _ in range(args.rounds):
            for i, text in enumerate((short, longer)):
                best[i] = min(best[i], stream_seconds(replies, tail, text, args.chunk))
        print(
            f"| {name} | {len(short)} | {best[0] * 1e3:.1f} | {len(longer)} |"
            f" {best[1] * 1e3:.1f} | {best[1] / best[0]:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
