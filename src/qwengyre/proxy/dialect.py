"""One API dialect the proxy serves: what the server asks of each API it speaks.

A dialect is one object (Anthropic Messages:
:class:`~qwengyre.proxy.anthropic_api.AnthropicMessages`; OpenAI Chat Completions:
:class:`~qwengyre.proxy.openai_api.OpenAIChat`) that turns its API's request bodies into
the API-neutral :class:`~qwengyre.proxy.types.ChatRequest` and answers back in the API's
shapes: a whole answer, the SSE events of a streamed one, and errors. The server routes
each of a dialect's paths to it and runs every call the same way, whatever the dialect;
serving one more API is one more dialect module registered in
:data:`qwengyre.proxy.server.DIALECTS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from qwengyre.proxy.jsonsafe import has_surrogate
from qwengyre.proxy.types import ApiError, ChatRequest, Completion, KnownMessages, TokenLogprob


class EventStream(Protocol):
    """The SSE events of one streamed answer, made as its text arrives: :meth:`start`
    (the bytes to send before anything else), :meth:`reasoning` with each new piece of
    reasoning, then :meth:`text` with each new piece of text (all reasoning comes
    before any text) and :meth:`ping` at will, then :meth:`finish` once with the
    completion, whose ``reasoning`` and ``text`` are the pieces given to
    :meth:`reasoning` and :meth:`text`, concatenated, or :meth:`error` once when the
    answer failed after the stream started."""

    def start(self) -> bytes: ...

    def reasoning(self, delta: str) -> bytes:
        """The events of the next piece of reasoning (empty: none)."""
        ...

    def ping(self) -> bytes:
        """Keeps the connection busy while nothing else is sent; clients skip it."""
        ...

    def text(self, delta: str, logprobs: Sequence[TokenLogprob] | None = None) -> bytes:
        """The events of the next piece of text (empty text: none); ``logprobs``: those
        of the tokens produced since the last call, for a dialect that carries them."""
        ...

    def finish(self, c: Completion) -> bytes: ...

    def error(self, e: ApiError) -> bytes:
        """``e`` as the event(s) a client reads as the failure of this answer."""
        ...


class ParseWhole(Exception):
    """Raised by :meth:`Dialect.parse_doc` when the elements after ``before`` cannot be
    converted apart from those it was made from: the server then parses the whole body."""


@dataclass(frozen=True)
class ErrorAnswer:
    """An :class:`ApiError` as a dialect answers it: HTTP status, JSON body, headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


class Dialect(ABC):
    """One API: its paths, its request parsing and its answers.

    ``name`` is the API's name in logs and in :attr:`ChatRequest.api`; ``call_path``
    the path of a model call (``POST``); ``count_tokens_path``, when the API has one, the
    path of a token count (``POST``, answered by :meth:`parse_count_tokens` and
    :meth:`count_tokens_body`); ``id_prefix`` starts the id of an answer and
    ``tool_id_prefix`` the id of each tool call in it. Errors on any path holding
    ``path_marker`` answer in this dialect's shape (:meth:`owns_path`).
    ``messages_key`` names the body's array of messages, which a body repeating an
    earlier one's extends (:mod:`qwengyre.proxy.body`).
    """

    name: ClassVar[str]
    call_path: ClassVar[str]
    count_tokens_path: ClassVar[str | None] = None
    id_prefix: ClassVar[str]
    tool_id_prefix: ClassVar[str]
    path_marker: ClassVar[str]
    messages_key: ClassVar[str] = "messages"

    def owns_path(self, path: str) -> bool:
        """Whether errors on ``path`` (a route of this API's, or an unknown one under
        it) answer in this dialect's shape."""
        return self.path_marker in path

    def owns_headers(self, headers: Mapping[str, str]) -> bool:
        """Whether a call on a route every dialect shares (``GET /v1/models``) comes
        from this API's clients, by a header only they send; none by default."""
        return False

    @abstractmethod
    def parse(self, body: bytes, headers: Mapping[str, str]) -> ChatRequest:
        """A model call's raw body as a :class:`ChatRequest`; an ``invalid_request_error``
        naming the offending field when it is not valid. ``headers``: the request's, of
        which the ones request-class rules read are kept."""

    @abstractmethod
    def parse_doc(
        self, doc: dict[str, Any], headers: Mapping[str, str], before: KnownMessages | None
    ) -> ChatRequest:
        """:meth:`parse` of a decoded body. With ``before``, ``doc``'s messages (its
        :attr:`messages_key` array) are the elements that follow those ``before`` was
        made from (an error's path then counts from them: reparse the whole body to
        report it; :class:`ParseWhole` when they cannot be converted apart)."""

    @abstractmethod
    def answer(self, c: Completion, chat: ChatRequest) -> dict[str, Any]:
        """The JSON body of a whole (non-streamed) answer to ``chat``."""

    @abstractmethod
    def events(
        self, completion_id: str, model: str, chat: ChatRequest, *, created: int, input_tokens: int
    ) -> EventStream:
        """The SSE events of a streamed answer to ``chat`` (``created``: Unix seconds)."""

    @abstractmethod
    def error(self, e: ApiError) -> ErrorAnswer:
        """``e`` in this API's error shape."""

    @abstractmethod
    def context_too_long(self, tokens: int, limit: int) -> ApiError:
        """The error this API's clients recognise as a prompt over the context (Claude
        Code compacts its history on it)."""

    @abstractmethod
    def models_body(self, model: str) -> dict[str, Any]:
        """The ``GET /v1/models`` body listing ``model``."""

    def parse_count_tokens(self, body: bytes, headers: Mapping[str, str]) -> ChatRequest:
        """A token-count body as a :class:`ChatRequest` (a dialect with a
        ``count_tokens_path`` only)."""
        raise NotImplementedError(f"{self.name} has no token count")

    def count_tokens_body(self, input_tokens: int) -> dict[str, Any]:
        """The token count's answer (a dialect with a ``count_tokens_path`` only)."""
        raise NotImplementedError(f"{self.name} has no token count")


def select_headers(
    headers: Mapping[str, str],
    *,
    prefixes: tuple[str, ...],
    secret_words: tuple[str, ...],
    not_utf8: str,
) -> dict[str, str]:
    """The headers request-class rules may read, lower-cased: names that start with one
    of ``prefixes`` and hold none of ``secret_words`` (credentials never reach a
    :class:`ChatRequest`). One of them that is not UTF-8 (the HTTP server hands such
    bytes over as lone surrogates) is an ``invalid_request_error`` whose message is
    ``not_utf8`` with ``{name}`` replaced by the header's name, quoted."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        low = name.lower()
        if not low.startswith(prefixes) or any(word in low for word in secret_words):
            continue
        if has_surrogate(low + value):
            raise ApiError("invalid_request_error", not_utf8.format(name=repr(low)))
        out[low] = value
    return out
