"""Token-in/token-out for one execution: match a call to its tree, build its prompt, record it.

For each call (DESIGN.md §3, proxy):

1. normalise the messages and restore tool-call payloads we produced, by call id (a
   harness that reformats tool-call JSON still matches; its ids are kept);
2. find the deepest recorded call whose conversation (request + reply) the new one
   extends, message for message, with the same tools;
3. the prompt is that call's recorded context — the engine's own tokens — plus only
   the newly rendered suffix (:meth:`ChatRenderer.suffix_ids`); a call that extends
   nothing is rendered whole and hangs from the root;
4. after generation, the reply is parsed into text and tool calls and the node is
   recorded with incremental input ids, output ids and behaviour log-probs.
"""

from __future__ import annotations

import secrets
import string
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from qwengyre.engines.base import GenerateResult
from qwengyre.proxy.render import ChatRenderer, parse_reply
from qwengyre.proxy.types import (
    ChatRequest,
    Completion,
    Message,
    StopReason,
    TokenLogprob,
    ToolCall,
    ToolSpec,
)
from qwengyre.trajectories.classes import RequestClass, RequestFacts, Rule, classify
from qwengyre.trajectories.tree import Node, NodeMeta, TrajectoryTree

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str, length: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(length))


class ContextTooLong(Exception):
    """The prompt does not fit the model's context; nothing was recorded."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"prompt is too long: {tokens} tokens > {limit} maximum")
        self.tokens = tokens
        self.limit = limit


@dataclass(frozen=True)
class Turn:
    """A recorded call at message level: what it was asked and what it answered."""

    node_id: int
    conversation: tuple[Message, ...]  # the request's messages + the reply
    new_messages: tuple[Message, ...]  # what this call added to its parent's conversation
    tools: tuple[ToolSpec, ...]


@dataclass(frozen=True)
class PreparedCall:
    """A call ready for the engine."""

    parent: int | None
    messages: tuple[Message, ...]  # normalised
    input_ids: tuple[int, ...]  # new tokens after the parent's context
    prompt_ids: array[int]  # the full prompt (an int32 array: cheap to extend and copy)
    request_class: RequestClass
    tools: tuple[ToolSpec, ...]


class ExecutionRecorder:
    """The in-memory tree and tool-call cache of one execution."""

    _CONTEXT_CACHE = 4

    def __init__(
        self,
        renderer: ChatRenderer,
        max_context: int,
        rules: tuple[Rule, ...] | None = None,
    ) -> None:
        self.renderer = renderer
        self.max_context = max_context
        self.rules = rules
        self.tree = TrajectoryTree()
        self.turns: list[Turn] = []
        self.tool_calls: dict[str, ToolCall] = {}
        self._contexts: OrderedDict[int, array[int]] = OrderedDict()

    # ------------------------------------------------------------ before the engine

    def prepare(self, request: ChatRequest) -> PreparedCall:
        """Match, classify and build the prompt; raises ContextTooLong, records nothing."""
        messages = tuple(self._normalise(m) for m in request.messages)
        klass = self._classify(request, messages)
        parent, input_ids, prompt = self._match(messages, request.tools)
        if len(prompt) >= self.max_context:  # no room left for a single output token
            raise ContextTooLong(len(prompt), self.max_context)
        return PreparedCall(parent, messages, input_ids, prompt, klass, request.tools)

    def _normalise(self, message: Message) -> Message:
        calls = tuple(
            ToolCall(c.id, *self._restored(c)) if c.id in self.tool_calls else c
            for c in message.tool_calls
        )
        return Message(message.role, message.content.strip(), calls, message.tool_call_id)

    def _restored(self, call: ToolCall) -> tuple[str, dict[str, object]]:
        ours = self.tool_calls[call.id]
        return ours.name, ours.arguments

    def _classify(self, request: ChatRequest, messages: tuple[Message, ...]) -> RequestClass:
        last_user = next((m.content for m in reversed(messages) if m.role == "user"), "")
        facts = RequestFacts(request.headers, bool(request.tools), last_user)
        return classify(facts) if self.rules is None else classify(facts, self.rules)

    def _match(
        self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...]
    ) -> tuple[int | None, tuple[int, ...], array[int]]:
        """The deepest turn this conversation extends; its context plus the new suffix."""
        # Deepest first; among equal conversations (a repeated call) the newest record.
        for turn in sorted(
            self.turns, key=lambda t: (len(t.conversation), t.node_id), reverse=True
        ):
            n = len(turn.conversation)
            if n >= len(messages) or turn.tools != tools or messages[:n] != turn.conversation:
                continue
            node = self.tree.nodes[turn.node_id]
            suffix = self.renderer.suffix_ids(
                turn.conversation, messages[n:], tools, node.output_ids
            )
            if suffix is None:
                continue
            return turn.node_id, tuple(suffix), self._context(turn.node_id) + array("i", suffix)
        prompt = self.renderer.prompt_ids(messages, tools)
        return None, tuple(prompt), array("i", prompt)

    def _context(self, node_id: int) -> array[int]:
        """A node's full context; the newest few are cached (each call extends one)."""
        context = self._contexts.get(node_id)
        if context is None:
            context = array("i", self.tree.context_ids(node_id))
        self._remember(node_id, context)
        return context

    def _remember(self, node_id: int, context: array[int]) -> None:
        self._contexts[node_id] = context
        self._contexts.move_to_end(node_id)
        while len(self._contexts) > self._CONTEXT_CACHE:
            self._contexts.popitem(last=False)

    # ------------------------------------------------------------ after the engine

    def record(
        self,
        call: PreparedCall,
        result: GenerateResult,
        *,
        api: str,
        model: str,
        engine: str,
        started_s: float,
        finished_s: float,
    ) -> tuple[Node, Completion]:
        """Add the node, cache the reply's tool calls, and answer in API-neutral form."""
        eos = self.renderer.tokenizer.eos_token_id
        ids = list(result.output_ids)
        body = ids[:-1] if ids and ids[-1] == eos else ids
        text, parsed = parse_reply(self.renderer.decode(body, skip_special_tokens=True))
        prefix = "toolu_" if api == "anthropic" else "call_"
        calls = tuple(ToolCall(new_id(prefix), name, args) for name, args in parsed)
        stop: StopReason = (
            "tool_use"
            if calls
            else ("max_tokens" if result.finish_reason == "length" else "end_turn")
        )
        usage = {"input_tokens": len(call.prompt_ids), "output_tokens": len(ids)}
        meta = NodeMeta(
            request_class=call.request_class.name,
            agent_id=call.request_class.agent_id,
            engine=engine,
            policy_version=result.policy_version,
            started_s=started_s,
            finished_s=finished_s,
            finish_reason=result.finish_reason,
            usage=usage,
        )
        node = self.tree.add(
            call.parent, call.input_ids, result.output_ids, result.logprobs, result.versions, meta
        )
        self._remember(node.id, call.prompt_ids + array("i", result.output_ids))
        reply = Message("assistant", text, calls)
        parent_len = 0 if call.parent is None else len(self.turns[call.parent].conversation)
        self.add_turn(
            Turn(node.id, (*call.messages, reply), (*call.messages[parent_len:], reply), call.tools)
        )
        tokens = self.renderer.tokenizer.convert_ids_to_tokens(list(ids))
        completion = Completion(
            id=new_id("msg_" if api == "anthropic" else "chatcmpl-"),
            model=model,
            text=text,
            tool_calls=calls,
            stop_reason=stop,
            input_tokens=usage["input_tokens"],
            output_tokens=usage["output_tokens"],
            logprobs=tuple(
                TokenLogprob(str(t), lp) for t, lp in zip(tokens, result.logprobs, strict=True)
            ),
        )
        return node, completion

    def add_turn(self, turn: Turn) -> None:
        """Register a recorded call (also used when a store replays an execution)."""
        if turn.node_id != len(self.turns):
            raise ValueError(f"turn {turn.node_id} out of order (expected {len(self.turns)})")
        self.turns.append(turn)
        for call in turn.conversation[-1].tool_calls:
            self.tool_calls[call.id] = call

    def count_tokens(self, request: ChatRequest) -> int:
        """Prompt length for a request, as the next call would build it (nothing recorded)."""
        messages = tuple(self._normalise(m) for m in request.messages)
        return len(self._match(messages, request.tools)[2])
