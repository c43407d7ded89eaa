"""Stop strings, found in the output as it is sampled, at a constant cost per token.

Semantics (as SGLang's and vLLM's): generation stops, with finish reason ``"stop"``, at
the token whose text completes the first occurrence of a stop string in the decoded
output; the output keeps the tokens up to and including that one and nothing after
(the caller cuts the text itself). The text is decoded as the proxy decodes replies,
without special tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any


class StopStrings:
    """Watches one request's output ids for its stop strings.

    Feed every sampled id to :meth:`add`, in order. Only a tail window of the newest ids
    is decoded: as many as the longest stop string has UTF-8 bytes (every token decodes
    to at least one byte, so that covers any occurrence the newest token completes)
    plus one, so that the occurrence never starts at the window's first token, whose
    text a tokenizer may decode without its context (e.g. a dropped leading space).
    Each call is O(1) in the length of the output.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stop for stop in stops if stop)
        self.window = max((len(stop.encode()) for stop in self.stops), default=0) + 1
        self._tail: deque[int] = deque(maxlen=self.window)

    def add(self, token: int) -> str | None:
        """Record the next output id; the stop string the output now contains, if any."""
        if not self.stops:
            return None
        self._tail.append(token)
        text = self.tokenizer.decode(list(self._tail), skip_special_tokens=True)
        return next((stop for stop in self.stops if stop in text), None)
