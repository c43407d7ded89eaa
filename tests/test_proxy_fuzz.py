"""Property-based fuzzing of the proxy's HTTP surface: both APIs and the admin API.

One live proxy (``start()`` from tests/test_proxy_server.py: aiohttp on 127.0.0.1, a
ScriptedEngine, the tiny model's tokenizer) answers generated requests over real HTTP:

- arbitrary JSON bodies (deep, wide, wrong types, lone surrogates, huge numbers) and
  mutations of valid requests of both APIs (fields dropped, replaced or inserted at
  random paths), sent as ASCII, UTF-8 or invalid UTF-8, sometimes with their bytes
  truncated, salted with non-UTF-8 bytes, or given a ``NaN``/``Infinity``/``1e999``;
- random credentials and headers: the key or ``Authorization`` right, wrong, in any
  case or with non-UTF-8 bytes, forwarded headers with non-UTF-8 bytes, and a
  ``Content-Encoding`` right, wrong, corrupt or unknown;
- random admin calls (method, path, token);
- scripted model replies: arbitrary text with ``<tool_call>`` blocks holding ``NaN``,
  ``Infinity``, lone-surrogate escapes, huge numbers or deep JSON.

Properties: never a 5xx; every error is JSON in the path's API error shape (the admin
API's is Anthropic's); every 200 is valid UTF-8 JSON, or an SSE stream whose data lines
are (and which ends as the API ends it); a refused call records nothing and a
completed model call records one node; nothing is logged with a traceback; tool calls
reach the client exactly as the hermes parser reads them.

The searches are derandomized (no example database) so CI sees the same examples every
run; each cause the issue measured also has an explicit regression test at the end of
tests/test_proxy_server.py.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from qwengyre.engines.scripted import ScriptedEngine
from qwengyre.proxy import jsonsafe
from qwengyre.proxy.parsers import TOOL_PARSERS
from test_proxy_server import ADMIN, TOOLS_ANTHROPIC, TOOLS_OPENAI, Running, start

pytestmark = pytest.mark.slow

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------------------
# the live proxy


@dataclass
class Fuzzed:
    """The proxy, its engine, an execution to call with, and the logged tracebacks."""

    running: Running
    engine: ScriptedEngine
    execution: dict[str, str]
    http: httpx2.Client
    tracebacks: list[logging.LogRecord] = field(default_factory=list)

    def nodes(self, execution_id: str | None = None) -> int:
        path = f"/admin/executions/{execution_id or self.execution['id']}/tree"
        response = self.http.get(path, headers={"authorization": f"Bearer {ADMIN}"})
        assert response.status_code == 200, response.text
        return len(response.json()["nodes"])


class _Tracebacks(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.into.append(record)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Fuzzed]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tokenizer, {"default": ["ok"]})
    for running in start(
        tmp_path_factory.mktemp("fuzz"), tiny_model_dir, engines=[engine], max_context=65536
    ):
        with httpx2.Client(base_url=running.url, timeout=60) as http:
            fuzzed = Fuzzed(running, engine, running.new_execution(), http)
            handler = _Tracebacks(fuzzed.tracebacks)
            logging.getLogger().addHandler(handler)
            try:
                yield fuzzed
            finally:
                logging.getLogger().removeHandler(handler)


# --------------------------------------------------------------------------------------
# what every answer must look like


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} in a response")


def _strict_json(data: bytes) -> Any:
    """``data`` as UTF-8 JSON without NaN/Infinity (json.loads alone accepts them)."""
    return json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)


def _sse_data(body: bytes) -> list[Any]:
    """The JSON of every ``data:`` line of an SSE body ("[DONE]" stays a string)."""
    out: list[Any] = []
    for event in body.decode("utf-8").split("\n\n"):
        for line in event.split("\n"):
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else _strict_json(data.encode()))
            else:
                assert line == "" or line.startswith(("event: ", ":")), line
    return out


def check_answer(response: httpx2.Response, api: str) -> Any:
    """The properties every answer has; returns the JSON (a list of SSE data for a
    stream, None for HEAD)."""
    status = response.status_code
    assert status < 500, (status, response.content[:500])
    if response.request.method == "HEAD":
        return None
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert status == 200
        data = _sse_data(response.content)
        if api == "anthropic":
            assert data[-1] == {"type": "message_stop"}, data[-3:]
        elif api == "responses":
            assert data[-1]["type"] in ("response.completed", "response.incomplete"), data[-3:]
        else:
            assert data[-1] == "[DONE]", data[-3:]
        return data
    body = _strict_json(response.content)
    if status >= 400:
        if api == "anthropic":
            assert body["type"] == "error", body
            assert isinstance(body["error"]["type"], str), body
            assert isinstance(body["error"]["message"], str), body
        else:
            assert isinstance(body["error"]["message"], str), body
            assert isinstance(body["error"]["type"], str), body
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body


def _api(path: str) -> str:
    if "/responses" in path:
        return "responses"
    return "openai" if "/chat/" in path else "anthropic"


def _model_call(path: str) -> bool:
    return path.endswith(("/v1/messages", "/v1/chat/completions", "/v1/responses"))


def call_and_check(
    fuzzed: Fuzzed,
    method: str,
    path: str,
    content: bytes | None,
    headers: dict[str, Any],
    api: str | None = None,
) -> httpx2.Response:
    """Send one request; check its answer (in ``api``'s shape, by default the path's),
    that a refused call recorded nothing and a completed model call one node, and that
    nothing logged a traceback."""
    before = fuzzed.nodes()
    fuzzed.tracebacks.clear()
    response = fuzzed.http.request(method, path, content=content, headers=headers)
    check_answer(response, api or _api(path))
    hypothesis.event(f"{path.rsplit('/v1', 1)[-1]} {response.status_code}")
    grown = fuzzed.nodes() - before
    assert grown == (1 if response.status_code == 200 and _model_call(path) else 0), (
        response.status_code,
        response.content[:300],
    )
    assert not fuzzed.tracebacks, [r.getMessage() for r in fuzzed.tracebacks]
    return response


# --------------------------------------------------------------------------------------
# strategies

FIELDS = [
    "model", "messages", "role", "content", "type", "text", "tools", "input_schema",
    "max_tokens", "stream", "system", "tool_use", "tool_result", "tool_use_id", "input",
    "id", "name", "tool_calls", "function", "arguments", "tool_call_id", "stop",
    "stop_sequences", "temperature", "top_p", "top_k", "logprobs", "top_logprobs", "n",
    "stream_options", "include_usage", "parameters", "user", "assistant", "tool",
    "instructions", "function_call", "function_call_output", "call_id", "namespace", "output",
    "input_text", "output_text", "reasoning", "developer", "max_output_tokens", "include",
]  # fmt: skip
SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"])
TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(FIELDS),
    st.tuples(st.text(max_size=4), SURROGATES, st.text(max_size=4)).map("".join),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(0, 4000).map(lambda digits: -(10**digits)),  # json.dumps stops at 4300
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=16,
)


def _deep(depth: int, inner: str) -> str:
    opens = "".join('{"a":' if i % 3 else "[" for i in range(depth))
    return opens + inner + "".join("}" if i % 3 else "]" for i in reversed(range(depth)))


ANTHROPIC_BASES: list[dict[str, Any]] = [
    {"model": "tiny", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]},
    {
        "model": "tiny",
        "max_tokens": 20,
        "stream": True,
        "system": [{"type": "text", "text": "You are a coder."}],
        "tools": TOOLS_ANTHROPIC,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "a.txt"}],
                    }
                ],
            },
        ],
    },
]
OPENAI_BASES: list[dict[str, Any]] = [
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20},
    {
        "model": "tiny",
        "max_completion_tokens": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "tools": TOOLS_OPENAI,
        "messages": [
            {"role": "system", "content": "You are a coder."},
            {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        ],
    },
]
TOOLS_RESPONSES: list[dict[str, Any]] = [
    {"type": "function", **tool["function"]} for tool in TOOLS_OPENAI
]
RESPONSES_BASES: list[dict[str, Any]] = [
    {"model": "tiny", "input": "hi", "max_output_tokens": 20},
    {
        "model": "tiny",
        "max_output_tokens": 20,
        "stream": True,
        "store": False,
        "include": ["message.output_text.logprobs"],
        "instructions": "You are a coder.",
        "tools": [
            *TOOLS_RESPONSES,
            {"type": "namespace", "name": "agents", "tools": TOOLS_RESPONSES},
            {"type": "web_search"},
        ],
        "tool_choice": "auto",
        "input": [
            {"type": "message", "role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "bash",
                "arguments": '{"cmd": "ls"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "bash", "namespace": "agents"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "b"}],
            },
        ],
    },
]
ROUTES = ["/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions", "/v1/responses"]
BASES = {"anthropic": ANTHROPIC_BASES, "openai": OPENAI_BASES, "responses": RESPONSES_BASES}


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*at, i))


@st.composite
def mutated(draw: st.DrawFn, bases: list[dict[str, Any]]) -> Any:
    """A valid request with 0-3 fields dropped, replaced or inserted at random paths, or
    a lone surrogate put into one of its strings."""
    value: Any = json.loads(json.dumps(draw(st.sampled_from(bases))))
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 3]))):
        path = draw(st.sampled_from(list(_paths(value))))
        if not path:
            value = draw(JSON)
            continue
        parent = value
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        operation = draw(st.sampled_from(["drop", "replace", "insert", "surrogate", "surrogate"]))
        if operation == "drop":
            del parent[last]
        elif operation == "replace":
            parent[last] = draw(JSON)
        elif operation == "surrogate":
            if isinstance(parent[last], str):
                parent[last] += draw(SURROGATES)
            elif isinstance(parent, dict):
                parent[last + draw(SURROGATES)] = parent.pop(last)
        elif isinstance(parent, dict):
            parent[draw(TEXT)] = draw(JSON)
        else:
            parent.insert(last, draw(JSON))
    return value


BAD_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" + b"0" * 5000]


@st.composite
def encoded(draw: st.DrawFn, value: Any) -> bytes:
    """``value`` as JSON bytes, maybe damaged."""
    # Raw: UTF-8, where a lone surrogate becomes bytes that are not UTF-8.
    ascii_ = draw(st.booleans())
    data = json.dumps(value, ensure_ascii=ascii_).encode("utf-8", "surrogatepass")
    damage = draw(st.sampled_from(["none", "none", "none", "number", "truncate", "bytes"]))
    if damage == "number":
        digits = [i for i, b in enumerate(data) if 0x30 <= b <= 0x39]
        at = draw(st.sampled_from(digits)) if digits else len(data) - 1
        data = data[:at] + draw(st.sampled_from(BAD_NUMBERS)) + data[at + 1 :]
    elif damage == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif damage == "bytes":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=3)) + data[at:]
    return data


@st.composite
def bodies(draw: st.DrawFn, api: str) -> bytes:
    """A request body for ``api``: arbitrary JSON, deep JSON, a valid request with a deep
    value (a message or a tool schema), or a mutated valid request."""
    bases = BASES[api]
    kind = draw(st.sampled_from(["json", "deep", "deep-field", "mutated", "mutated", "mutated"]))
    if kind == "deep":
        return _deep(draw(st.integers(1, 3000)), "1").encode()
    if kind == "deep-field":
        body = json.dumps(draw(st.sampled_from(bases)))
        spot = draw(st.sampled_from([s for s in DEEP_SPOTS if s in body]))
        return body.replace(spot, _deep(draw(st.integers(40, 600)), spot), 1).encode()
    if kind == "json":
        return draw(encoded(draw(JSON)))
    return draw(encoded(draw(mutated(bases))))


DEEP_SPOTS = ['"hi"', '"a.txt"', '{"type": "string"}']


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data)


@st.composite
def body_encodings(draw: st.DrawFn, body: bytes) -> tuple[bytes, dict[str, Any]]:
    """``body`` as sent: plain, or under a Content-Encoding, right or wrong."""
    choice = draw(
        st.sampled_from(
            ["none", "none", "gzip", "deflate", "gzip-corrupt", "gzip-truncated", "other"]
        )
    )
    if choice == "none":
        return body, {}
    if choice == "gzip":
        return _gzip(body), {"content-encoding": draw(st.sampled_from(["gzip", "GZip", "x-gzip"]))}
    if choice == "deflate":
        return zlib.compress(body), {"content-encoding": "deflate"}
    if choice == "gzip-corrupt":
        return body, {"content-encoding": "gzip"}
    if choice == "gzip-truncated":
        packed = _gzip(body)
        return packed[: draw(st.integers(0, len(packed) - 1))], {"content-encoding": "gzip"}
    name = draw(
        st.sampled_from(["br", "zstd", "compress", "gzip, gzip", "identity", "", b"q\xe9"])
        | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=8)
    )
    return body, {"content-encoding": name}


@st.composite
def credentials(draw: st.DrawFn, key: str) -> tuple[dict[str, Any], bool]:
    """Headers presenting ``key`` (or not), and whether they should authenticate."""
    choice = draw(
        st.sampled_from(["x-api-key", "bearer", "bearer", "wrong", "non-utf8", "scheme", "none"])
    )
    if choice == "x-api-key":
        return {"x-api-key": key}, True
    if choice == "bearer":
        scheme = draw(st.sampled_from(["Bearer", "bearer", "BEARER", "bEaReR"]))
        return {"authorization": f"{scheme} {key}"}, True
    if choice == "wrong":
        return {"x-api-key": key[:-1] + ("A" if key[-1] != "A" else "B")}, False
    if choice == "non-utf8":
        # obs-text: bytes 0x80-0xFF are legal in a header value, and are not UTF-8 here
        junk = b"\xff" + bytes(draw(st.lists(st.integers(0x80, 0xFF), max_size=5)))
        name = draw(st.sampled_from(["x-api-key", "authorization"]))
        prefix = b"Bearer " if name == "authorization" else b""
        return {name: prefix + key.encode()[:8] + junk}, False
    if choice == "scheme":
        return {"authorization": f"Basic {key}"}, False
    return {}, False


# --------------------------------------------------------------------------------------
# the properties


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_bad_bodies_answer_api_shaped_4xx_and_record_nothing(
    fuzzed: Fuzzed, data: st.DataObject
) -> None:
    route = data.draw(st.sampled_from(ROUTES))
    api = _api(route)
    body = data.draw(bodies(api))
    prefix = data.draw(st.sampled_from(["", f"/x/{fuzzed.execution['id']}"]))
    headers = {"x-api-key": fuzzed.execution["key"], "content-type": "application/json"}
    call_and_check(fuzzed, "POST", prefix + route, body, headers)


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_headers_and_encodings_answer_api_shaped_errors(
    fuzzed: Fuzzed, data: st.DataObject
) -> None:
    route = data.draw(st.sampled_from([*ROUTES, "/v1/models"]))
    api = _api(route)
    valid = BASES[api][0]
    body, headers = data.draw(body_encodings(json.dumps(valid).encode()))
    auth, authentic = data.draw(credentials(fuzzed.execution["key"]))
    headers.update(auth)
    forwarded = data.draw(
        st.sampled_from(["x-claude-code-agent-id", "x-agent-id", "anthropic-beta", "user-agent"])
    )
    if data.draw(st.booleans()):
        headers[forwarded] = b"agent-\xff\xfe"
    if route == "/v1/models":  # its shape follows the anthropic-version header
        api = "anthropic" if "anthropic-beta" in headers else "openai"
        if api == "anthropic":
            headers["anthropic-version"] = "2023-06-01"
        response = call_and_check(fuzzed, "GET", route, None, headers, api)
    else:
        response = call_and_check(fuzzed, "POST", route, body, headers)
    assert (response.status_code == 401) == (not authentic), response.content[:300]


ADMIN_PATHS = [
    "/admin/executions",
    "/admin/executions/{id}",
    "/admin/executions/{id}/tree",
    "/admin/executions/{id}/nothing",
    "/admin",
    "/admin/executions/",
]


@st.composite
def admin_tokens(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    choice = draw(st.sampled_from(["right", "right", "wrong", "non-utf8", "x-api-key", "none"]))
    if choice == "right":
        scheme = draw(st.sampled_from(["Bearer", "bearer", "BEARER"]))
        return {"authorization": f"{scheme} {ADMIN}"}, True
    if choice == "wrong":
        token = draw(st.text(st.characters(exclude_categories=["Cc", "Cs"]), max_size=40))
        return {"authorization": f"Bearer {token}".encode().strip()}, False
    if choice == "non-utf8":
        return {"authorization": b"Bearer " + ADMIN.encode()[:10] + b"\xff\xfe"}, False
    if choice == "x-api-key":
        return {"x-api-key": ADMIN}, False
    return {}, False


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_the_admin_api_answers_json_errors_and_needs_its_token(
    fuzzed: Fuzzed, data: st.DataObject
) -> None:
    method = data.draw(st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD"]))
    some_id = data.draw(
        st.sampled_from([fuzzed.execution["id"], "ex_nope", "..%2F..%2Fetc", "%FF%FE", "x" * 80])
        | st.text(
            st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/?#%"),
            min_size=1,
            max_size=10,
        )
    )
    if method == "DELETE" and some_id == fuzzed.execution["id"]:
        some_id = "ex_nope"  # the fuzz's own execution stays live
    path = data.draw(st.sampled_from(ADMIN_PATHS)).format(id=some_id)
    headers, authentic = data.draw(admin_tokens())
    fuzzed.tracebacks.clear()
    response = fuzzed.http.request(method, path, headers=headers)
    check_answer(response, "anthropic")
    assert not fuzzed.tracebacks, [r.getMessage() for r in fuzzed.tracebacks]
    if authentic:
        assert response.status_code != 401
    elif response.status_code != 404:  # no such route: 404 before the token is looked at
        assert response.status_code == 401


# Reply texts: tool-call blocks the model might write, valid or not.
ARGUMENTS = st.one_of(
    st.just('{"cmd": "ls"}'),
    st.just('{"s": "a\\ud800b", "\\udc00": "\\ud83d\\ude00"}'),  # lone-surrogate escapes
    st.sampled_from(BAD_NUMBERS).map(lambda n: '{"x": ' + n.decode() + "}"),
    st.integers(1, 400).map(lambda d: '{"deep": ' + _deep(d, "1") + "}"),
    st.just('"{\\"x\\": [1, 2]}"'),  # arguments encoded twice
    JSON.map(lambda v: json.dumps(v, ensure_ascii=True)),
)
BLOCKS = st.one_of(
    st.builds(
        lambda name, args: (
            f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>'
        ),
        st.sampled_from(["bash", "Read"]) | st.text(max_size=5),
        ARGUMENTS,
    ),
    st.just("<tool_call>\n{not json}\n</tool_call>"),
    st.just("<tool_call>"),
    st.just("</tool_call>"),
    st.text(st.characters(exclude_categories=["Cs"]), max_size=30),
)
REPLIES = st.lists(BLOCKS, max_size=4).map("\n".join)


@settings(FUZZ, max_examples=100)
@given(reply=REPLIES, api=st.sampled_from(list(BASES)), stream=st.booleans())
def test_any_model_reply_is_answered_with_valid_json_and_lossless_tool_calls(
    fuzzed: Fuzzed, reply: str, api: str, stream: bool
) -> None:
    fuzzed.engine.script = {"default": [reply]}
    messages = [{"role": "user", "content": "go"}]
    if api == "anthropic":
        route = "/v1/messages"
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 30000, "messages": messages}
        body["tools"] = TOOLS_ANTHROPIC
    elif api == "responses":
        route = "/v1/responses"
        body = {"model": "tiny", "input": messages, "tools": TOOLS_RESPONSES}
    else:
        route = "/v1/chat/completions"
        body = {"model": "tiny", "max_tokens": 30000, "messages": messages, "tools": TOOLS_OPENAI}
    body["stream"] = stream
    headers = {"x-api-key": fuzzed.execution["key"]}
    response = call_and_check(fuzzed, "POST", route, json.dumps(body).encode(), headers)
    assert response.status_code == 200, response.content[:300]
    answered = check_answer(response, api)
    tokenizer = fuzzed.engine.tokenizer
    decoded = tokenizer.decode(
        tokenizer.encode(reply, add_special_tokens=False), skip_special_tokens=True
    )
    expected = [arguments for _, arguments in TOOL_PARSERS["hermes"].parse(decoded)[1]]
    assert _tool_arguments(answered, api, stream) == expected


def _tool_arguments(answered: Any, api: str, stream: bool) -> list[Any]:
    """The tool calls' arguments a client reads from an answer."""
    if api == "anthropic" and not stream:
        return [b["input"] for b in answered["content"] if b["type"] == "tool_use"]
    if api == "openai" and not stream:
        calls = answered["choices"][0]["message"].get("tool_calls") or []
        return [json.loads(c["function"]["arguments"]) for c in calls]
    if api == "responses" and not stream:
        return [json.loads(i["arguments"]) for i in answered["output"] if i.get("arguments")]
    parts: dict[int, str] = {}
    for event in answered:
        if api == "responses" and event["type"] == "response.function_call_arguments.delta":
            parts[event["output_index"]] = parts.get(event["output_index"], "") + event["delta"]
        if api == "anthropic" and event.get("type") == "content_block_delta":
            if event["delta"]["type"] == "input_json_delta":
                parts[event["index"]] = (
                    parts.get(event["index"], "") + event["delta"]["partial_json"]
                )
        elif api == "openai" and event != "[DONE]" and event["choices"]:
            for call in event["choices"][0]["delta"].get("tool_calls") or []:
                parts[call["index"]] = parts.get(call["index"], "") + call["function"]["arguments"]
    return [json.loads(parts[i]) for i in sorted(parts)]


# --------------------------------------------------------------------------------------
# the JSON reader and writer the adapters share


@settings(FUZZ, max_examples=300)
@given(value=JSON, ascii_=st.booleans())
def test_jsonsafe_reads_what_json_reads_and_writes_losslessly(value: Any, ascii_: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_)
    assert jsonsafe.loads(text) == json.loads(text)
    written = jsonsafe.dumps(value)
    assert json.loads(written.decode("utf-8")) == value  # valid UTF-8, same value


@settings(FUZZ, max_examples=100)
@given(depth=st.integers(1, 200), inner=st.sampled_from(['"[[{"', "1", "[]", '"\\\\"']))
def test_jsonsafe_depth_is_exact(depth: int, inner: str) -> None:
    text = _deep(depth, inner)
    real = depth + (1 if inner == "[]" else 0)
    if real <= jsonsafe.MAX_DEPTH:
        jsonsafe.loads(text)
    else:
        with pytest.raises(jsonsafe.TooDeep):
            jsonsafe.loads(text)
