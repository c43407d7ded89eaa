"""Request classes from rule sets: each built-in set on requests shaped exactly as its
client sends them (``tests/harness_requests.json``, recorded from the real clients), a
user's own rule set, and the errors a bad one gets."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from qwengyre.config import ConfigError, load_config
from qwengyre.engines.base import GenerateResult
from qwengyre.proxy.classes import RuleSetError, load_rule_set
from qwengyre.proxy.openai_api import parse_chat_request
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.tito import ExecutionRecorder
from qwengyre.proxy.types import ChatRequest, Message, SamplingParams, ToolSpec
from qwengyre.trajectories.classes import Agents, RequestClass, RequestFacts, classify

CAPTURED = json.loads((Path(__file__).parent / "harness_requests.json").read_text())
QWEN = {entry["what"]: entry for entry in CAPTURED["qwen-code 0.24.4"]}
OPENCODE = {entry["what"]: entry for entry in CAPTURED["opencode 1.18.33"]}
CODEX = {entry["what"]: entry for entry in CAPTURED["codex 0.171.0"]}

COMPACTION_PREFIX = "CRITICAL: Respond with TEXT ONLY"
SUBAGENT_HEADER = "x-claude-code-agent-id"


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


def chat(entry: dict) -> ChatRequest:
    """A captured Chat Completions request as the proxy parses it."""
    return parse_chat_request(json.dumps(entry["body"]).encode(), entry["headers"])


def codex_chat(entry: dict) -> ChatRequest:
    """A captured Responses request (Codex) as an API-neutral request: developer
    messages as system prompts, input texts as messages, its headers as sent."""
    messages = []
    for item in entry["body"]["input"]:
        if item["type"] == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append(Message(role, "\n".join(p["text"] for p in item["content"])))
    last_user = next(m.content for m in reversed(messages) if m.role == "user")
    tools = tuple(ToolSpec(t["name"] or t["type"]) for t in entry["body"]["tools"])
    return ChatRequest(
        api="responses",
        model="tiny",
        messages=tuple(messages),
        sampling=SamplingParams(max_tokens=64),
        tools=tools,
        headers=entry["headers"],
        last_user_texts=(last_user,),
    )


def record(recorder: ExecutionRecorder, request: ChatRequest) -> RequestClass:
    """Classify ``request`` and record it with a short reply; its class."""
    call = recorder.prepare(request)
    ids = tuple(recorder.renderer.tokenizer.encode("ok", add_special_tokens=False))
    result = GenerateResult(ids, (-0.5,) * len(ids), (0,) * len(ids), "stop")
    recorder.record(
        call,
        result,
        id_prefix="msg_",
        tool_id_prefix="call_",
        model="tiny",
        engine="e",
        started_s=0.0,
        finished_s=1.0,
    )
    return call.request_class


def classes(renderer: ChatRenderer, rules: str, requests: list[ChatRequest]) -> list[tuple]:
    recorder = ExecutionRecorder(renderer, 1_000_000, load_rule_set(rules))
    return [(c.name, c.agent_id) for c in (record(recorder, r) for r in requests)]


# ------------------------------------------------------------------ Claude Code


@pytest.mark.parametrize(
    ("headers", "has_tools", "last_user", "expected"),
    [
        ({}, True, ("fix the bug",), RequestClass("main", "task", "main")),
        ({SUBAGENT_HEADER: "a7"}, True, ("look",), RequestClass("sub", "task", "a7")),
        ({}, True, (COMPACTION_PREFIX + ". Go",), RequestClass("main", "summary", "main")),
        ({SUBAGENT_HEADER: "a7"}, True, (COMPACTION_PREFIX,), RequestClass("sub", "summary", "a7")),
        # After a user text turn Claude Code appends the instruction as a second block.
        ({}, True, ("go on", COMPACTION_PREFIX), RequestClass("main", "summary", "main")),
        (
            {SUBAGENT_HEADER: "a7"},
            True,
            ("x", COMPACTION_PREFIX),
            RequestClass("sub", "summary", "a7"),
        ),
        ({}, True, ("quote: " + COMPACTION_PREFIX,), RequestClass("main", "task", "main")),
        ({}, False, ("a title please",), RequestClass("main", "side", "main")),
    ],
)
def test_claude_code_rules(headers, has_tools, last_user, expected):
    rules = load_rule_set("claude-code")
    assert classify(RequestFacts(headers, has_tools, last_user), rules) == expected


def test_claude_codes_session_header_keeps_a_resumed_main_agent_main():
    # `--continue` sends another system prompt; its session header says it is the main
    # agent's, where identity alone would make it a sub-agent.
    rules = load_rule_set("claude-code")
    agents = Agents()
    agents.learn("first-prompt", "opening", RequestClass("main", "task"))
    resumed = RequestFacts({}, True, ("say bye",), "another prompt", "resumed-prompt")
    assert classify(resumed, rules, agents) == RequestClass("sub", "task", "sub-resumed-prom")
    with_session = replace(resumed, headers={"x-claude-code-session-id": "s1"})
    assert classify(with_session, rules, agents) == RequestClass("main", "task")


# ------------------------------------------------------------------ Qwen Code

QWEN_SESSION = [
    "main agent, first call",
    "main agent, after launching a background sub-agent",
    "sub-agent (general-purpose), first call",
    "main agent, after the sub-agent's notification",
    "auto-memory extraction helper (default settings)",
    "/compress --continue: the main agent's own request (prompt cache shared)",
    "/compress --continue: the summariser's request (its fallback)",
]


def test_qwen_code_requests_are_classified_by_identity_and_directive(renderer: ChatRenderer):
    sub = QWEN["sub-agent (general-purpose), first call"]["body"]
    assert sub["messages"][0]["content"].startswith("You are a general-purpose subagent")
    assert len(sub["tools"]) == 17
    found = classes(renderer, "qwen-code", [chat(QWEN[what]) for what in QWEN_SESSION])
    sub_id = found[2][1]
    assert sub_id.startswith("sub-") and len(sub_id) == 16
    assert found == [
        ("main.task", "main"),
        ("main.task", "main"),
        ("sub.task", sub_id),
        ("main.task", "main"),
        ("main.side", "main"),  # a helper on the main agent's history, with tools of its own
        ("main.summary", "main"),  # the main agent's identity, the <state_snapshot> directive
        ("main.summary", "main"),  # the summariser's own prompt: main's, by default
    ]
    # The id comes from the sub-agent's identity: the same in another execution.
    again = classes(renderer, "qwen-code", [chat(QWEN[what]) for what in QWEN_SESSION[:3]])
    assert again[2] == ("sub.task", sub_id)


@pytest.mark.parametrize("rules", ["claude-code", "codex", "opencode", "qwen-code"])
def test_a_call_of_another_identity_is_never_the_main_agents_task(
    renderer: ChatRenderer, rules: str
):
    # Qwen Code names no agents: under any rule set, identity tells its sub-agent apart.
    requests = [chat(QWEN["main agent, first call"]), chat(QWEN[QWEN_SESSION[2]])]
    [main, sub] = classes(renderer, rules, requests)
    assert main == ("main.task", "main")
    assert sub[0] == "sub.task" and sub[1].startswith("sub-")


def test_a_summary_of_unknown_identity_belongs_to_the_agent_whose_conversation_it_opens(
    renderer: ChatRenderer,
):
    # A sub-agent compacting through the summariser (its own prompt, no tools): the
    # summary opens with the sub-agent's first message, so it is the sub-agent's.
    sub = chat(QWEN[QWEN_SESSION[2]])
    cold = chat(QWEN[QWEN_SESSION[6]])
    summary = replace(cold, messages=(cold.messages[0], *sub.messages[1:], cold.messages[-1]))
    found = classes(renderer, "qwen-code", [chat(QWEN[QWEN_SESSION[0]]), sub, summary])
    assert found[2] == ("sub.summary", found[1][1])


def test_a_reloaded_execution_knows_its_agents(renderer: ChatRenderer):
    rules = load_rule_set("qwen-code")
    live = ExecutionRecorder(renderer, 1_000_000, rules)
    for what in QWEN_SESSION[:3]:
        record(live, chat(QWEN[what]))
    loaded = ExecutionRecorder(renderer, 1_000_000, rules)  # as the proxy's store loads it
    for node, turn in zip(live.tree.nodes, live.turns, strict=True):
        loaded.add(node, turn)
    sub = live.tree.nodes[2].meta.agent_id
    assert record(loaded, chat(QWEN[QWEN_SESSION[2]])) == RequestClass("sub", "task", sub)
    assert record(loaded, chat(QWEN[QWEN_SESSION[3]])) == RequestClass("main", "task")


# ------------------------------------------------------------------ OpenCode


def test_opencode_title_call_main_agent_and_sub_agent_session(renderer: ChatRenderer):
    session = [
        "title generation",
        "main agent (build), first call",
        "sub-agent (general), first call",
        "main agent, after the task tool's result",
    ]
    sub = OPENCODE["sub-agent (general), first call"]["headers"]["x-session-id"]
    assert classes(renderer, "opencode", [chat(OPENCODE[what]) for what in session]) == [
        ("main.side", "main"),
        ("main.task", "main"),
        ("sub.task", sub),
        ("main.task", "main"),
    ]


def test_opencode_compaction_is_the_summary_of_the_session_it_compacts(renderer: ChatRenderer):
    # The compaction agent's request: its own system prompt, no tools (not a side call,
    # as side_without_tools alone would make it), the session's headers. A sub-agent's
    # session compacts under its own headers (x-parent-session-id): its summary.
    compaction = OPENCODE["auto-compaction (limit.output 1000): the compaction agent's request"]
    sub = OPENCODE["sub-agent (general), first call"]["headers"]
    in_sub = {**compaction, "headers": sub}
    requests = [OPENCODE["main agent (build), first call"], compaction, in_sub]
    assert classes(renderer, "opencode", [chat(entry) for entry in requests]) == [
        ("main.task", "main"),
        ("main.summary", "main"),
        ("sub.summary", sub["x-session-id"]),
    ]


# ------------------------------------------------------------------ Codex


def test_codex_turn_metadata_names_sub_agents_and_compactions(renderer: ChatRenderer):
    session = ["main agent, first call", "sub-agent (spawn_agent), first call", "auto-compaction"]
    sub = json.loads(CODEX[session[1]]["headers"]["x-codex-turn-metadata"])
    assert sub["agent_name"] == "/root"  # as sent: only thread_source says "sub-agent"
    assert classes(renderer, "codex", [codex_chat(CODEX[what]) for what in session]) == [
        ("main.task", "main"),
        ("sub.task", sub["thread_id"]),
        ("main.summary", "main"),
    ]


# ------------------------------------------------------------------ a rule set of one's own

OWN = """
name: my-harness
agents:
  - sub: {header: X-My-Agent}
summary:
  - last_user: {starts_with: "Summarise the session"}
side:
  - {header: x-my-purpose, values: [title, probe]}
"""


def test_a_users_own_rule_set_loads_from_yaml(tmp_path: Path):
    path = tmp_path / "mine.yaml"
    path.write_text(OWN)
    rules = load_rule_set(str(path))
    assert rules.name == "my-harness"
    sub = RequestFacts({"x-my-agent": "helper-1"}, True, ("Summarise the session now",))
    assert classify(sub, rules) == RequestClass("sub", "summary", "helper-1")
    title = RequestFacts({"x-my-purpose": "title"}, True, ("go",))
    assert classify(title, rules) == RequestClass("main", "side")
    other = RequestFacts({"x-my-purpose": "work"}, True, ("go",))
    assert classify(other, rules) == RequestClass("main", "task")


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ("- a list", "must hold a mapping at the top level"),
        ("name: x\nsumary: []", "unknown rule key 'sumary'.*allowed keys at the top level: name,"),
        ("summary: []", "invalid rule.*name.*Field required"),
        (
            "name: x\nsummary: [{last_user: {}}]",
            r"summary\.0\.last_user.*exactly one of starts_with",
        ),
        (
            "name: x\nside: [{system: {starts_with: a}, header: x-a}]",
            r"\(side\.0\): give exactly one of system, last_user or header",
        ),
        ("name: x\nside: [{system: {begins: a}}]", r"unknown rule key 'side\.0\.system\.begins'"),
        ("name: x\nagents: [{main: {header: x-s}}]", r"agents\.0\.sub.*Field required"),
        (
            "name: x\nagents: [{sub: {header: x-a, feild: b}}]",
            r"'agents\.0\.sub\.feild'.*allowed keys at agents\.0\.sub: header, field, values",
        ),
        ("name: x\nidentity: maybe", r"identity='maybe'.*valid boolean"),
        ("name: x\nside: [{field: a}]", "exactly one of system, last_user or header"),
    ],
)
def test_a_bad_rule_set_is_refused_naming_the_key(tmp_path: Path, doc: str, error: str):
    path = tmp_path / "bad.yaml"
    path.write_text(doc)
    with pytest.raises(RuleSetError, match=error) as caught:
        load_rule_set(str(path))
    assert str(path) in str(caught.value)


def test_unknown_or_unreadable_rule_sets_are_refused(tmp_path: Path):
    with pytest.raises(RuleSetError, match=r"'qwen' is neither a built-in rule set \(claude-code,"):
        load_rule_set("qwen")
    with pytest.raises(RuleSetError, match=r"cannot read rule set .*missing\.yaml"):
        load_rule_set(str(tmp_path / "missing.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [")
    with pytest.raises(RuleSetError, match=r"broken\.yaml is not valid YAML"):
        load_rule_set(str(broken))


def test_proxy_classes_names_a_built_in_rule_set_or_a_yaml_file():
    assert load_config(None, ["proxy.classes=qwen-code"]).proxy.classes == "qwen-code"
    assert load_config(None, ["proxy.classes=rules/mine.yml"]).proxy.classes == "rules/mine.yml"
    with pytest.raises(
        ConfigError,
        match=r"proxy\.classes='qwen': neither a built-in rule set \(claude-code, codex,",
    ):
        load_config(None, ["proxy.classes=qwen"])


def test_the_proxy_is_built_with_the_rule_set_proxy_classes_names(tmp_path: Path, tiny_model_dir):
    from qwengyre.config import ProxyConfig
    from qwengyre.proxy.build import build_proxy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def build(classes: str):  # type: ignore[no-untyped-def]
        settings = ProxyConfig(classes=classes)
        return build_proxy(
            settings, tiny_model_dir, tokenizer, tmp_path, max_context=4096, temperature=1.0
        )

    server = build("qwen-code")
    try:
        assert server.residency.classes == load_rule_set("qwen-code")
    finally:
        server.store.close()
    with pytest.raises(ConfigError, match=r"^proxy\.classes: cannot read rule set .*gone\.yaml"):
        build(str(tmp_path / "gone.yaml"))
