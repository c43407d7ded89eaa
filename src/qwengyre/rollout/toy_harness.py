"""A bundled toy harness: a small multi-turn tool-using agent that talks to the proxy.

It exists so tests and the demo get trajectory trees with every request class without
installing a real agent. The agent speaks the OpenAI Chat Completions API (non-streaming,
over aiohttp; no SDK) and has two tools:

* ``write_file {path, content}`` writes a file inside the workspace (absolute paths and
  ``..`` are refused);
* ``delegate {task}`` runs a sub-agent: a separate conversation with its own system
  prompt, sent with the header ``x-claude-code-agent-id: sub-<n>`` and the tool
  ``write_file``, for up to :data:`SUBAGENT_MAX_TURNS` turns; its final text is the
  tool result.

Once the main conversation holds at least :data:`COMPACT_AFTER` messages after the first
user turn, it compacts exactly once, as Claude Code does: it sends the history plus a
user message starting ``CRITICAL: Respond with TEXT ONLY`` (no tools), then restarts
from ``[system, user: "This session is being continued ... Summary: ..."]``. So one
execution records ``main.task``, ``sub.task`` and ``main.summary`` calls, and a tree
with several roots (main, sub-agent, post-compaction main).

Opt-in critique mode (intermediate assessments, :mod:`qwengyre.rollout.assessments`):
with ``critique="user"`` or ``"assistant"`` (``QWENGYRE_TOY_CRITIQUE`` when run as a
program), after each main-agent turn that used tools the agent asks the proxy to assess
the workspace now (``POST <execution base URL>/assess`` with its own key) and puts the
answer's ``critique`` into its next request, as a message of that role starting
:data:`CRITIQUE_PREFIX`. An assessment that cannot be had (no evaluator registered, an
error) is skipped. The critique is text the harness injects, so the proxy records it as
input, never as a training target.

Run as ``python -m qwengyre.rollout.toy_harness "<instructions>"`` with
``OPENAI_BASE_URL`` (ending in ``/v1``) and ``OPENAI_API_KEY`` set; the workspace is
the current directory. Exit status 0 when the model finished (answered without tool
calls), 1 otherwise (turn limit, or model calls kept failing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

__all__ = [
    "COMPACTION_PROMPT",
    "CRITIQUE_ENV",
    "CRITIQUE_PREFIX",
    "ModelCallError",
    "ModelClient",
    "ToyResult",
    "main",
    "run_episode",
    "run_toy_agent",
    "write_file",
]

SYSTEM_PROMPT = (
    "You are a careful coding agent working in a workspace directory. Use write_file to "
    "create files and delegate to hand a self-contained sub-task to a helper. When the "
    "task is complete, answer with a short final message and no tool calls."
)
SUBAGENT_PROMPT = (
    "You are a helper agent. Complete the sub-task you are given, using write_file if "
    "needed, then reply with a short report and no tool calls."
)
COMPACTION_PROMPT = (
    "CRITICAL: Respond with TEXT ONLY. Summarise the work so far. Do not call any tools."
)
CONTINUATION = (
    "This session is being continued from a previous conversation. "
    "Summary: {summary}\n\nTask: {task}"
)
CRITIQUE_PREFIX = "Reviewer feedback on the current workspace: "
"""How a critique starts in the message that carries it (critique mode)."""
CRITIQUE_ENV = "QWENGYRE_TOY_CRITIQUE"
"""Environment variable turning critique mode on when run as a program: user | assistant."""
CRITIQUE_ROLES = ("user", "assistant")
SUBAGENT_HEADER = "x-claude-code-agent-id"
COMPACT_AFTER = 4
"""Messages after the first user turn that trigger the (single) compaction."""
SUBAGENT_MAX_TURNS = 3
RETRY_FOR_S = 180.0
"""How long one model call is retried after a 5xx, a 429 or a connection error: long
enough to ride out a controller restart (the proxy comes back on the same address with
the same keys), as real clients' retries do."""
MAX_BACKOFF_S = 5.0
"""The longest pause between two attempts (the pause doubles from the first)."""

WRITE_FILE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write a text file inside the workspace (relative path).",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Relative path in the workspace"},
                "content": {"type": "string"},
            },
            "required": ["path", "content"],
        },
    },
}
DELEGATE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "delegate",
        "description": "Hand a self-contained sub-task to a helper agent; returns its report.",
        "parameters": {
            "type": "object",
            "properties": {"task": {"type": "string"}},
            "required": ["task"],
        },
    },
}


class ModelClient(Protocol):
    """What the agent needs from a model endpoint: one call (the reply message, i.e. an
    OpenAI ``choices[0].message``) and a count of the calls made."""

    calls: int

    async def complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]: ...


class ModelCallError(RuntimeError):
    """A model call failed for good (non-retryable status, or retries exhausted)."""


@dataclass(kw_only=True)
class ToyResult:
    turns: int
    """Task-driving calls of the main agent."""
    calls: int
    """All model calls: main turns, the summary and sub-agent calls."""
    compacted: bool
    subagent_calls: int
    final_text: str
    finished: bool = False
    """True when the model ended with an answer without tool calls (exit status 0)."""
    retries: int = 0
    """Model calls sent again after a 5xx, a 429 or a connection error (HTTP client)."""
    critiques: int = 0
    """Critiques put into a request (critique mode)."""


def write_file(workspace: Path, path: Any, content: Any) -> str:
    """Write ``content`` to ``path`` inside ``workspace``; an error string when refused."""
    if not isinstance(path, str) or not path.strip():
        return "error: write_file needs a non-empty string 'path'"
    if not isinstance(content, str):
        return "error: write_file needs a string 'content'"
    rel = Path(path)
    if rel.is_absolute() or path.startswith(("/", "\\")) or ".." in rel.parts:
        return f"error: refused path {path!r}: use a relative path inside the workspace"
    root = workspace.resolve()
    target = (root / rel).resolve()
    if target != root and root not in target.parents:
        return f"error: refused path {path!r}: it leaves the workspace"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    except OSError as exc:
        return f"error: cannot write {path!r}: {exc}"
    return f"wrote {len(content)} characters to {path}"


class _Client:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        api_key: str,
        model: str,
        backoff_s: float,
        retry_for_s: float,
    ) -> None:
        self.session = session
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key
        self.model = model
        self.backoff_s = backoff_s
        self.retry_for_s = retry_for_s
        self.calls = 0
        self.retries = 0

    async def complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The reply message (``choices[0].message``) of one model call, with retries."""
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if tools:
            body["tools"] = tools
        all_headers = {"authorization": f"Bearer {self.api_key}", **(headers or {})}
        self.calls += 1
        problem = ""
        first_failure: float | None = None
        for attempt in itertools.count():
            if attempt:
                loop = asyncio.get_running_loop()
                first_failure = loop.time() if first_failure is None else first_failure
                if loop.time() - first_failure >= self.retry_for_s:
                    break
                self.retries += 1
                await asyncio.sleep(min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1)))
            try:
                async with self.session.post(self.url, json=body, headers=all_headers) as resp:
                    text = await resp.text()
                    if resp.status == 429 or resp.status >= 500:
                        problem = f"HTTP {resp.status}: {text[:300]}"
                        continue
                    if resp.status != 200:
                        raise ModelCallError(f"model call failed: HTTP {resp.status}: {text[:300]}")
                    try:
                        message = json.loads(text)["choices"][0]["message"]
                    except (ValueError, KeyError, IndexError, TypeError) as exc:
                        raise ModelCallError(f"malformed model reply: {text[:300]}") from exc
                    if not isinstance(message, dict):
                        raise ModelCallError(f"malformed model reply: {text[:300]}")
                    return message
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
        retries = attempt - 1
        raise ModelCallError(f"model call failed after {retries} retries: {problem}")


def _assistant_message(reply: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    return message


def _arguments(call: dict[str, Any]) -> tuple[str, dict[str, Any] | str]:
    """(tool name, arguments) of a tool call; the arguments are an error string when bad."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return "", "error: malformed tool call"
    name = str(function.get("name") or "")
    raw = function.get("arguments")
    if isinstance(raw, dict):
        return name, raw
    try:
        args = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except ValueError as exc:
        return name, f"error: arguments are not valid JSON: {exc}"
    if not isinstance(args, dict):
        return name, "error: arguments must be a JSON object"
    return name, args


class _Agent:
    def __init__(self, client: ModelClient, workspace: Path) -> None:
        self.client = client
        self.workspace = workspace
        self.subagents = 0
        self.subagent_calls = 0

    async def run_tool(self, call: dict[str, Any], *, allow_delegate: bool) -> str:
        name, args = _arguments(call)
        if isinstance(args, str):
            return args
        if name == "write_file":
            return write_file(self.workspace, args.get("path"), args.get("content"))
        if name == "delegate" and allow_delegate:
            task = args.get("task")
            if not isinstance(task, str) or not task.strip():
                return "error: delegate needs a non-empty string 'task'"
            return await self.delegate(task)
        return f"error: unknown tool {name!r}"

    async def tool_results(
        self, reply: dict[str, Any], *, allow_delegate: bool
    ) -> list[dict[str, Any]]:
        results = []
        for i, call in enumerate(reply.get("tool_calls") or ()):
            output = await self.run_tool(call, allow_delegate=allow_delegate)
            call_id = call.get("id") if isinstance(call, dict) else None
            results.append(
                {"role": "tool", "tool_call_id": str(call_id or f"call_{i}"), "content": output}
            )
        return results

    async def delegate(self, task: str) -> str:
        self.subagents += 1
        headers = {SUBAGENT_HEADER: f"sub-{self.subagents}"}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SUBAGENT_PROMPT},
            {"role": "user", "content": task},
        ]
        last = ""
        for _ in range(SUBAGENT_MAX_TURNS):
            reply = await self.client.complete(messages, [WRITE_FILE_TOOL], headers)
            self.subagent_calls += 1
            last = str(reply.get("content") or "")
            if not reply.get("tool_calls"):
                return last or "(the sub-agent gave no report)"
            messages.append(_assistant_message(reply))
            messages += await self.tool_results(reply, allow_delegate=False)
        return f"(the sub-agent stopped after {SUBAGENT_MAX_TURNS} turns) {last}".rstrip()


def assess_url(base_url: str) -> str:
    """The proxy's assessment endpoint for an execution's OpenAI base URL
    (``http://host/x/ex_1/v1`` -> ``http://host/x/ex_1/assess``)."""
    return base_url.rstrip("/").removesuffix("/v1") + "/assess"


def _assess_caller(
    session: aiohttp.ClientSession, url: str, api_key: str
) -> Callable[[], Awaitable[str | None]]:
    async def ask() -> str | None:
        headers = {"authorization": f"Bearer {api_key}"}
        try:
            async with session.post(url, json={}, headers=headers) as resp:
                text = await resp.text()
                if resp.status != 200:
                    print(f"toy harness: no assessment: HTTP {resp.status}", file=sys.stderr)
                    return None
                critique = json.loads(text).get("critique")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            print(f"toy harness: no assessment: {exc!r}", file=sys.stderr)
            return None
        return critique if isinstance(critique, str) and critique.strip() else None

    return ask


async def run_toy_agent(
    base_url: str,
    api_key: str,
    instructions: str,
    workspace: Path,
    *,
    max_turns: int = 8,
    model: str = "qwengyre",
    retry_backoff_s: float = 0.5,
    retry_for_s: float = RETRY_FOR_S,
    timeout_s: float = 300.0,
    critique: str | None = None,
) -> ToyResult:
    """Run the toy agent against an OpenAI-compatible ``base_url`` (ending in ``/v1``).

    ``critique`` (``"user"`` or ``"assistant"``) turns critique mode on (module
    docstring). A failed call is retried for ``retry_for_s`` seconds. Raises
    :class:`ModelCallError` when a model call fails for good.
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = _Client(session, base_url, api_key, model, retry_backoff_s, retry_for_s)
        ask = _assess_caller(session, assess_url(base_url), api_key) if critique else None
        result = await run_episode(
            client,
            instructions,
            Path(workspace),
            max_turns=max_turns,
            assess=ask,
            critique_role=critique or "user",
        )
        return dataclasses.replace(result, retries=client.retries)


async def run_episode(
    client: ModelClient,
    instructions: str,
    workspace: Path,
    *,
    max_turns: int = 8,
    assess: Callable[[], Awaitable[str | None]] | None = None,
    critique_role: str = "user",
) -> ToyResult:
    """The agent's loop over any :class:`ModelClient` (the HTTP one, or an in-process
    stand-in such as :mod:`qwengyre.apps.warm_start`'s, which drives the proxy's
    recorder directly and must see exactly the requests the HTTP client would send).

    ``assess`` (critique mode): called after each main-agent tool turn; the critique it
    returns (None: none) goes into the next request as a ``critique_role`` message."""
    if critique_role not in CRITIQUE_ROLES:
        raise ValueError(f"critique_role must be one of {CRITIQUE_ROLES}, got {critique_role!r}")
    agent = _Agent(client, workspace)
    tools = [WRITE_FILE_TOOL, DELEGATE_TOOL]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": instructions},
    ]
    compacted = finished = False
    turns = critiques = 0
    final = ""
    while turns < max_turns:
        if not compacted and len(messages) - 2 >= COMPACT_AFTER:
            summary_reply = await client.complete(
                [*messages, {"role": "user", "content": COMPACTION_PROMPT}], None
            )
            summary = str(summary_reply.get("content") or "").strip()
            messages = [
                messages[0],
                {
                    "role": "user",
                    "content": CONTINUATION.format(summary=summary, task=instructions),
                },
            ]
            compacted = True
        reply = await client.complete(messages, tools)
        turns += 1
        final = str(reply.get("content") or "")
        if not reply.get("tool_calls"):
            finished = True
            break
        messages.append(_assistant_message(reply))
        messages += await agent.tool_results(reply, allow_delegate=True)
        critique = await assess() if assess is not None else None
        if critique is not None:
            messages.append({"role": critique_role, "content": CRITIQUE_PREFIX + critique})
            critiques += 1
    return ToyResult(
        turns=turns,
        calls=client.calls,
        compacted=compacted,
        subagent_calls=agent.subagent_calls,
        final_text=final,
        finished=finished,
        critiques=critiques,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    base_url = os.environ.get("OPENAI_BASE_URL", "")
    api_key = os.environ.get("OPENAI_API_KEY", "")
    critique = os.environ.get(CRITIQUE_ENV, "").strip() or None
    if critique is not None and critique not in CRITIQUE_ROLES:
        print(f"{CRITIQUE_ENV} must be one of {', '.join(CRITIQUE_ROLES)}", file=sys.stderr)
        return 1
    if not args or not base_url or not api_key:
        print(
            "usage: OPENAI_BASE_URL=... OPENAI_API_KEY=... "
            "python -m qwengyre.rollout.toy_harness INSTRUCTIONS",
            file=sys.stderr,
        )
        return 1
    try:
        result = asyncio.run(
            run_toy_agent(base_url, api_key, args[0], Path.cwd(), critique=critique)
        )
    except ModelCallError as exc:
        print(f"toy harness: giving up: {exc}", file=sys.stderr)
        return 1
    print(result.final_text)
    print(
        f"toy harness: turns={result.turns} calls={result.calls} compacted={result.compacted} "
        f"subagent_calls={result.subagent_calls} finished={result.finished} "
        f"retries={result.retries} critiques={result.critiques}",
        file=sys.stderr,
    )
    return 0 if result.finished else 1


if __name__ == "__main__":
    sys.exit(main())
