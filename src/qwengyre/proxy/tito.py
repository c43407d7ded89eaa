"""Token-in/token-out for one execution: match a call to its tree, build its prompt, record it.

For each call (docs/design.md §3, proxy):

1. restore the payload of tool calls we produced, by call id (a harness that reformats
   tool-call JSON still matches; its ids are kept); the text stays exactly as sent;
2. find the deepest recorded call whose conversation (request + reply) the new one
   extends, message for message, with the same tools, walking down the turn tree and
   comparing each call's increment (from the call an earlier request of the same client
   extended, when the caller knows it: :class:`Reuse`);
3. the prompt is that call's recorded context — the engine's own tokens — plus only
   the newly rendered suffix (:meth:`ChatRenderer.suffix_ids`); a call that extends
   nothing is rendered whole and hangs from the root;
4. after generation, the reply is parsed by the model's parsers into reasoning, text
   and tool calls (the text cut at a stop string) and the node is built with
   incremental input ids, output ids and behaviour log-probs; it joins the tree once
   the caller has committed it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import string
from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from qwengyre.engines.base import GenerateResult
from qwengyre.proxy.classes import default_rule_set
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.types import (
    ChatRequest,
    Completion,
    Message,
    StopReason,
    TokenLogprob,
    ToolCall,
    ToolSpec,
)
from qwengyre.trajectories.classes import (
    Agents,
    RequestClass,
    RequestFacts,
    RuleSet,
    classify,
    identity_key,
    message_key,
)
from qwengyre.trajectories.routed_experts import before_each_token
from qwengyre.trajectories.tree import Node, NodeMeta, TrajectoryTree

log = logging.getLogger(__name__)

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str, length: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(length))


class ContextTooLong(Exception):
    """The prompt does not fit the model's context; nothing was recorded."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"prompt is too long: {tokens} tokens > {limit} maximum")
        self.tokens = tokens
        self.limit = limit


@dataclass(kw_only=True, frozen=True)
class Turn:
    """A recorded call at message level: what it added to its parent's conversation.

    A turn keeps only its increment (the request's messages after the parent's
    conversation, then the reply), so an execution's memory grows with its unique
    messages, not with calls x history. :meth:`ExecutionRecorder.conversation` rebuilds
    a whole conversation.
    """

    node_id: int
    parent: int | None
    new_messages: tuple[Message, ...]  # the last one is the reply
    tools: tuple[ToolSpec, ...]
    toolset: str  # the tool set's key (:func:`toolset_key`)
    length: int  # messages in the whole conversation (the parent's + these)


@dataclass(kw_only=True, frozen=True)
class PreparedCall:
    """A call ready for the engine."""

    parent: int | None
    messages: tuple[Message, ...]  # normalised
    input_ids: tuple[int, ...]  # new tokens after the parent's context
    prompt_ids: array[int]  # the full prompt (an int32 array: cheap to extend and copy)
    request_class: RequestClass
    tools: tuple[ToolSpec, ...]  # interned: the same object for the same tool set
    toolset: str  # the tool set's key (a hash of its JSON)
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reuse:
    """What a caller knows of a request from an earlier one of the same execution (see
    :mod:`qwengyre.proxy.body`): its first ``known`` messages are that request's
    normalised messages, and that request extended the recorded call ``parent``
    (None: the root), so matching starts there instead of at the root."""

    known: int
    parent: int | None


@dataclass(frozen=True)
class Recorded:
    """A call's node and turn, built but not yet part of the tree (see :meth:`add`)."""

    node: Node
    turn: Turn
    completion: Completion


class ExecutionRecorder:
    """The in-memory tree, turns and tool-call cache of one execution.

    Per call: :meth:`prepare` (match and build the prompt; nothing changes), then
    :meth:`build` (the node and turn for the engine's answer; nothing changes), then,
    once the store has committed them, :meth:`add`. :meth:`record` does the last two
    at once (for in-process use without a store). A caller that records concurrent
    calls of one execution must serialise build + commit + add (node ids are
    ``len(tree.nodes)`` at build time).
    """

    _CACHED = 4  # recent contexts and conversations kept whole (each call extends one)

    def __init__(
        self,
        renderer: ChatRenderer,
        max_context: int,
        rules: RuleSet | None = None,
    ) -> None:
        """``rules``: the harness's request-class rules (None: the default rule set)."""
        self.renderer = renderer
        self.max_context = max_context
        self.rules = rules or default_rule_set()
        self.agents = Agents()  # what the recorded task calls taught (fed by add)
        self.tree = TrajectoryTree()
        self.turns: list[Turn] = []
        self.tool_calls: dict[str, ToolCall] = {}
        self._children: dict[int | None, list[int]] = {None: []}
        self._toolsets: dict[str, tuple[ToolSpec, ...]] = {}
        self._contexts: OrderedDict[int, array[int]] = OrderedDict()
        self._conversations: OrderedDict[int, tuple[Message, ...]] = OrderedDict()

    # ------------------------------------------------------------ before the engine

    def prepare(self, request: ChatRequest, reuse: Reuse | None = None) -> PreparedCall:
        """Match, classify and build the prompt; raises ContextTooLong, records nothing.

        With ``reuse`` only the messages after ``reuse.known`` are normalised and
        matching walks down from ``reuse.parent``: the cost follows the new messages,
        not the history."""
        known = 0 if reuse is None else reuse.known
        sent = request.messages
        new = tuple(self._normalise(m) for m in sent[known:])
        unchanged = all(a is b for a, b in zip(new, sent[known:], strict=True))
        messages = sent if unchanged else sent[:known] + new
        toolset, tools = self.intern_tools(request.tools)
        klass = self._classify(request, messages, toolset)
        start = None if reuse is None else reuse.parent
        parent, input_ids, prompt = self._match(messages, tools, start)
        if len(prompt) >= self.max_context:  # no room left for a single output token
            raise ContextTooLong(len(prompt), self.max_context)
        return PreparedCall(
            parent=parent,
            messages=messages,
            input_ids=input_ids,
            prompt_ids=prompt,
            request_class=klass,
            tools=tools,
            toolset=toolset,
            stop=request.sampling.stop,
        )

    def intern_tools(self, tools: tuple[ToolSpec, ...]) -> tuple[str, tuple[ToolSpec, ...]]:
        """(key, the execution's one copy of this tool set): Claude Code repeats ~64 KB of
        tool definitions with every call; a turn keeps a reference, not a copy."""
        key = toolset_key(tools)
        return key, self._toolsets.setdefault(key, tools)

    def _normalise(self, message: Message) -> Message:
        """Restore the payload of tool calls we produced (by id); the text stays as sent."""
        if not any(c.id in self.tool_calls for c in message.tool_calls):
            return message
        calls = tuple(self.tool_calls.get(c.id, c) for c in message.tool_calls)
        return replace(message, tool_calls=calls)

    def _classify(
        self, request: ChatRequest, messages: tuple[Message, ...], toolset: str
    ) -> RequestClass:
        texts = request.last_user_texts
        if texts is None:  # not given by a parser: a walk back (it can be long)
            texts = (next((m.content for m in reversed(messages) if m.role == "user"), ""),)
        system, opening = _system_and_opening(messages)
        facts = RequestFacts(
            request.headers,
            bool(request.tools),
            texts,
            system,
            identity_key(system, toolset),
            opening,
        )
        return classify(facts, self.rules, self.agents)

    def _match(
        self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...], start: int | None = None
    ) -> tuple[int | None, tuple[int, ...], array[int]]:
        """The deepest turn this conversation extends (below ``start``, a turn it is
        known to extend); that turn's context plus the new suffix."""
        for turn in self._extended(messages, tools, start):
            node = self.tree.nodes[turn.node_id]
            # A local template needs only the first message of the history.
            history = messages[:1] if self.renderer.local else self.conversation(turn.node_id)
            suffix = self.renderer.suffix_ids(
                history, messages[turn.length :], tools, node.output_ids
            )
            if suffix is not None:
                return turn.node_id, tuple(suffix), self._context(turn.node_id) + array("i", suffix)
        prompt = self.renderer.prompt_ids(messages, tools)
        return None, tuple(prompt), array("i", prompt)

    def _extended(
        self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...], start: int | None
    ) -> list[Turn]:
        """Turns below ``start`` whose conversation ``messages`` strictly extends, with
        the same tools: deepest first, the newest first among equals (``start`` itself
        last). Walks down the turn tree comparing each turn's increment only."""
        found: list[Turn] = []
        if start is not None and self.turns[start].length < len(messages):
            found.append(self.turns[start])
        stack: list[tuple[int | None, int]] = [
            (start, 0 if start is None else self.turns[start].length)
        ]
        while stack:
            parent, offset = stack.pop()
            for child in self._children[parent]:
                turn = self.turns[child]
                if (
                    turn.length < len(messages)
                    and messages[offset : turn.length] == turn.new_messages
                ):
                    stack.append((child, turn.length))
                    if turn.tools is tools:
                        found.append(turn)
        found.sort(key=lambda t: (t.length, t.node_id), reverse=True)
        return [t for t in found if t.tools is tools]

    def conversation(self, node_id: int) -> tuple[Message, ...]:
        """The messages of a recorded call's request and its reply."""
        pending: list[Turn] = []  # up to the nearest cached ancestor
        at: int | None = node_id
        while at is not None and at not in self._conversations:
            pending.append(self.turns[at])
            at = self.turns[at].parent
        conversation = () if at is None else self._conversations[at]
        for turn in reversed(pending):
            conversation += turn.new_messages
        _remember(self._conversations, node_id, conversation, self._CACHED)
        return conversation

    def _context(self, node_id: int) -> array[int]:
        """A node's full context; the newest few are cached (each call extends one)."""
        context = self._contexts.get(node_id)
        if context is None:
            context = array("i", self.tree.context_ids(node_id))
        _remember(self._contexts, node_id, context, self._CACHED)
        return context

    # ------------------------------------------------------------ after the engine

    def build(
        self,
        call: PreparedCall,
        result: GenerateResult,
        *,
        id_prefix: str,
        tool_id_prefix: str,
        model: str,
        engine: str,
        started_s: float,
        finished_s: float,
        delivered: bool = True,
        completion_id: str | None = None,
    ) -> Recorded:
        """The node and turn of ``call`` answered by ``result``, and the API-neutral
        answer (``completion_id``: its id, if already announced to a streaming client,
        else a new one starting ``id_prefix``; its tool calls' ids start
        ``tool_id_prefix``, as the caller's API names them); the node gets the next id.
        Nothing changes until :meth:`add`."""
        eos = self.renderer.tokenizer.eos_token_id
        ids = list(result.output_ids)
        body = ids[:-1] if ids and ids[-1] == eos else ids
        decoded = self.renderer.decode(body, skip_special_tokens=True)
        tail = self.renderer.prompt_tail(call.prompt_ids)
        parsed = self.renderer.replies.parse(decoded, call.stop, call.tools, tail)
        text, stop_sequence = parsed.text, parsed.stop
        calls = tuple(ToolCall(new_id(tool_id_prefix), name, args) for name, args in parsed.calls)
        stop: StopReason
        if calls:
            stop = "tool_use"
        elif stop_sequence is not None:
            stop = "stop_sequence"
        elif result.finish_reason == "length":
            stop = "max_tokens"
        else:
            stop = "end_turn"
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
            delivered=delivered,
        )
        node = Node(
            id=len(self.tree.nodes),
            parent=call.parent,
            input_ids=call.input_ids,
            output_ids=result.output_ids,
            logprobs=result.logprobs,
            versions=result.versions,
            meta=meta,
            routing=_node_routing(call, result),
        )
        reply = Message("assistant", text, calls, reasoning=parsed.reasoning)
        before = 0 if call.parent is None else self.turns[call.parent].length
        increment = (*call.messages[before:], reply)
        turn = Turn(
            node_id=node.id,
            parent=call.parent,
            new_messages=increment,
            tools=call.tools,
            toolset=call.toolset,
            length=len(call.messages) + 1,
        )
        tokens = self.renderer.tokenizer.convert_ids_to_tokens(ids)
        completion = Completion(
            id=completion_id or new_id(id_prefix),
            model=model,
            text=text,
            tool_calls=calls,
            stop_reason=stop,
            input_tokens=usage["input_tokens"],
            output_tokens=usage["output_tokens"],
            stop_sequence=stop_sequence,
            reasoning=parsed.reasoning,
            logprobs=tuple(
                TokenLogprob(str(t), lp) for t, lp in zip(tokens, result.logprobs, strict=True)
            ),
        )
        return Recorded(node, turn, completion)

    def add(self, node: Node, turn: Turn, prompt_ids: array[int] | None = None) -> None:
        """Make a built (and, in the proxy, committed) call part of the tree; also used
        when an execution is loaded from the store. ``prompt_ids``: its full prompt, if
        at hand (caches its context for the next call)."""
        if node.id != len(self.tree.nodes) or turn.node_id != node.id:
            raise ValueError(f"node {node.id} out of order (expected {len(self.tree.nodes)})")
        self.tree.add(
            node.parent,
            node.input_ids,
            node.output_ids,
            node.logprobs,
            node.versions,
            node.meta,
            node.routing,
        )
        self.turns.append(turn)
        if turn.parent is None:  # a conversation of its own: it may name an agent
            system, opening = _system_and_opening(turn.new_messages[:-1])
            klass = RequestClass.named(node.meta.request_class, node.meta.agent_id)
            self.agents.learn(identity_key(system, turn.toolset), opening, klass)
        self._children[turn.parent].append(node.id)
        self._children[node.id] = []
        self._toolsets.setdefault(turn.toolset, turn.tools)
        for call in turn.new_messages[-1].tool_calls:
            self.tool_calls[call.id] = call
        if prompt_ids is not None:
            _remember(
                self._contexts, node.id, prompt_ids + array("i", node.output_ids), self._CACHED
            )

    def record(
        self,
        call: PreparedCall,
        result: GenerateResult,
        *,
        id_prefix: str,
        tool_id_prefix: str,
        model: str,
        engine: str,
        started_s: float,
        finished_s: float,
    ) -> tuple[Node, Completion]:
        """:meth:`build` and :meth:`add` at once (in-process use, nothing to commit)."""
        recorded = self.build(
            call,
            result,
            id_prefix=id_prefix,
            tool_id_prefix=tool_id_prefix,
            model=model,
            engine=engine,
            started_s=started_s,
            finished_s=finished_s,
        )
        self.add(recorded.node, recorded.turn, call.prompt_ids)
        return recorded.node, recorded.completion

    def mark_delivered(self, node_id: int, delivered: bool) -> None:
        """Whether the caller received the answer of ``node_id`` (see NodeMeta)."""
        self.tree.set_delivered(node_id, delivered)

    def count_tokens(self, request: ChatRequest) -> int:
        """Prompt length for a request, as the next call would build it (nothing recorded)."""
        messages = tuple(self._normalise(m) for m in request.messages)
        return len(self._match(messages, self.intern_tools(request.tools)[1])[2])


def _node_routing(call: PreparedCall, result: GenerateResult) -> np.ndarray | None:
    """The routed experts before each of the node's tokens, from the call's (by position);
    None if the engine reported none, or rows that do not fit the call (logged)."""
    if result.routing is None or not result.output_ids:
        return None
    start = len(call.prompt_ids) - len(call.input_ids)
    count = len(call.input_ids) + len(result.output_ids)
    if len(result.routing) != start + count - 1:  # an engine's bug: keep the call
        log.warning(
            "%s: the engine reported routed experts for %d positions, the call ran %d;"
            " not recorded",
            call.request_class.name,
            len(result.routing),
            start + count - 1,
        )
        return None
    return before_each_token(result.routing, start, count)


def _system_and_opening(messages: tuple[Message, ...]) -> tuple[str, str]:
    """A request's leading system prompt (its system messages before any other, joined)
    and the key of its first other message ("" if none)."""
    lead = 0
    while lead < len(messages) and messages[lead].role == "system":
        lead += 1
    system = "\n\n".join(m.content for m in messages[:lead])
    rest = messages[lead] if lead < len(messages) else None
    return system, "" if rest is None else message_key(rest.role, rest.content)


def toolset_key(tools: tuple[ToolSpec, ...]) -> str:
    """A tool set's identity: the SHA-256 of its canonical JSON."""
    return hashlib.sha256(toolset_json(tools).encode()).hexdigest()


def toolset_json(tools: tuple[ToolSpec, ...]) -> str:
    """Canonical JSON of a tool set (ASCII escapes: lossless for any string)."""
    return json.dumps([asdict(t) for t in tools], sort_keys=True)


def _remember(cache: OrderedDict[int, Any], key: int, value: Any, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)
