"""Hypothesis: whatever a harness does to its history, TITO records exactly what the engine saw.

Random interleavings of a main agent and a sub-agent that extend their conversations,
echo tool calls back reformatted, edit earlier turns and compact their history. After
every call: the node's output ids are the engine's, the engine's prompt is the parent's
recorded context plus the node's input ids (so earlier outputs are reused verbatim,
never re-tokenised), injected tokens are never marked sampled, and a pure extension
hangs from the agent's previous call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from qwengyre.engines.base import GenerateResult
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.tito import ExecutionRecorder, PreparedCall, Reuse
from qwengyre.proxy.types import ChatRequest, Message, SamplingParams, ToolCall, ToolSpec

TOOLS = (ToolSpec("bash", "run", {"type": "object", "properties": {"cmd": {"type": "string"}}}),)
WORDS = ["ls", "cat a.py", "fix it", "ok", "12+7=19", "naïve café", "résumé ✓", "done"]


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


@dataclass
class Agent:
    system: str
    headers: dict[str, str]
    messages: list[Message] = field(default_factory=list)
    last_node: int | None = None
    last_call: PreparedCall | None = None


replies = st.tuples(st.sampled_from(WORDS), st.booleans(), st.sampled_from(WORDS), st.booleans())
moves = st.lists(
    st.tuples(
        st.sampled_from(["main", "sub"]),
        st.sampled_from(["extend", "extend", "extend", "edit", "compact"]),
        st.sampled_from(WORDS),
        replies,
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(moves=moves)
def test_recorded_tokens_are_exactly_what_the_engine_saw(renderer: ChatRenderer, moves) -> None:
    tok = renderer.tokenizer
    recorder = ExecutionRecorder(renderer, max_context=1_000_000)
    agents = {
        "main": Agent("You are the main agent.", {}),
        "sub": Agent("You are a sub-agent.", {"x-claude-code-agent-id": "a1"}),
    }
    for who, move, word, (text, with_tool, arg, reformat) in moves:
        agent = agents[who]
        expected_parent = agent.last_node
        if move == "edit" and len(agent.messages) > 1:
            first = agent.messages[0]
            agent.messages[0] = Message("user", first.content + " (edited)")
            expected_parent = None  # the very first turn changed: nothing extends
        elif move == "compact" and agent.messages:
            agent.messages = [Message("user", "CRITICAL: Respond with TEXT ONLY. " + word)]
            expected_parent = None
        if not agent.messages or agent.messages[-1].role == "assistant":
            last_call = agent.messages[-1].tool_calls if agent.messages else ()
            if last_call:
                agent.messages.append(Message("tool", word, tool_call_id=last_call[0].id))
            else:
                agent.messages.append(Message("user", word))
        request = ChatRequest(
            api="anthropic",
            model="m",
            messages=(Message("system", agent.system), *agent.messages),
            sampling=SamplingParams(max_tokens=64),
            tools=TOOLS,
            headers=agent.headers,
        )
        call = recorder.prepare(request)
        # Reusing what the previous request of this agent parsed to gives the same call.
        before = agent.last_call
        if before is not None and request.messages[: len(before.messages)] == before.messages:
            reused = replace(
                request, messages=(*before.messages, *request.messages[len(before.messages) :])
            )
            again = recorder.prepare(reused, Reuse(len(before.messages), before.parent))
            assert (again.parent, again.input_ids, again.prompt_ids) == (
                call.parent,
                call.input_ids,
                call.prompt_ids,
            )
        agent.last_call = call
        reply = text + (
            f'\n<tool_call>\n{{"name": "bash", "arguments": {{"cmd": "{arg}"}}}}\n</tool_call>'
            if with_tool
            else ""
        )
        out = (*tok.encode(reply, add_special_tokens=False), tok.eos_token_id)
        result = GenerateResult(out, tuple(-0.5 for _ in out), tuple(3 for _ in out), "stop")
        node, completion = recorder.record(
            call,
            result,
            id_prefix="msg_",
            tool_id_prefix="toolu_",
            model="m",
            engine="e",
            started_s=0,
            finished_s=1,
        )
        # The engine's tokens, exactly; the prompt is the recorded context plus new input.
        assert tuple(node.output_ids) == out and tuple(node.versions) == (3,) * len(out)
        context = [] if node.parent is None else recorder.tree.context_ids(node.parent)
        assert list(call.prompt_ids) == context + list(node.input_ids)
        assert node.to_json()["provenance"] == [0] * len(node.input_ids) + [1] * len(out)
        # Every earlier output on the path sits verbatim in the prompt.
        offset = 0
        for ancestor in recorder.tree.path(node.id)[:-1]:
            offset += len(ancestor.input_ids)
            assert list(call.prompt_ids[offset : offset + len(ancestor.output_ids)]) == list(
                ancestor.output_ids
            )
            offset += len(ancestor.output_ids)
        assert tok.decode(call.prompt_ids).endswith("<|im_start|>assistant\n")
        assert node.parent == expected_parent
        # The harness echoes the reply back, tool arguments possibly reformatted.
        calls = tuple(
            ToolCall(c.id, c.name, {"cmd": c.arguments["cmd"] + " "} if reformat else c.arguments)
            for c in completion.tool_calls
        )
        agent.messages.append(Message("assistant", completion.text, calls))
        agent.last_node = node.id
