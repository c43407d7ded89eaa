"""Supervised warm start of a tiny model on the toy harness's ideal episodes.

RL needs a policy whose reward is neither ~0 nor ~1; a randomly initialised tiny model
scores 0. :func:`warm_start` fine-tunes it (SFT) on *ideal episodes* of the bundled toy
harness (:mod:`qwengyre.rollout.toy_harness`) until the reward it measures on held-out
problems reaches a threshold. Problems are :class:`~qwengyre.rollout.toy_tasks.ToyProblem`:
parity by default (the ideal answer is any two-digit number, so the warm start teaches
the protocol and the measured reward saturates near chance, 0.5: the rule is left to
RL), or addition (measured on two cores: the demo model stays at 0-6% for minutes).

The ideal episode
-----------------
Shown for addition (parity delegates ``an even two-digit number`` and writes its
number). For the task ``Compute a+b and write only the number into answer.txt`` one execution
makes six model calls and records every request class the trainer cares about
(``main.task``, ``sub.task``, ``main.summary``)::

    call  class         reply (exact text; each ends with <|im_end|>)
    1     main.task     <tool_call>{"name": "delegate", "arguments": {"task": "a+b"}}</tool_call>
    2     sub.task      <tool_call>{"name": "write_file",
                            "arguments": {"content": "<a+b>", "path": "answer.txt"}}</tool_call>
    3     sub.task      Done.                 (the sub-agent's report = delegate's result)
    4     main.task     <tool_call>{"name": "write_file",
                            "arguments": {"path": "done.txt", "content": "ok"}}</tool_call>
    5     main.summary  Done.                 (4 messages after the first user turn: compaction)
    6     main.task     Done.                 (after the restart: final answer, exit status 0)

(each ``<tool_call>`` block is ``<tool_call>\\n{json}\\n</tool_call>``, as the chat
template renders one; the answer call puts ``content`` before ``path`` -- JSON key order
is free for the proxy's parser -- so the sum's digits follow the operands closely).
The reward depends on sampled tokens twice: the main agent must
copy ``a+b`` into the delegated task (call 1) and the sub-agent must write the right sum
(call 2, the *answer call*). Call 4 only exists to reach the compaction threshold
(:data:`~qwengyre.rollout.toy_harness.COMPACT_AFTER` = 4 messages) with one short tool
call; it writes ``done.txt``, which the evaluator ignores. The trajectory tree has four
chains (leaves): main 1 -> 4, sub 2 -> 3, summary 5, restarted main 6.

Training data equals what the proxy records
-------------------------------------------
Episodes are not re-implemented: :func:`run_recorded_episode` runs the toy harness's own
loop (:func:`~qwengyre.rollout.toy_harness.run_episode`) over :class:`RecorderClient`, an
in-process stand-in for the HTTP client that sends each request through the proxy's own
pieces -- :func:`~qwengyre.proxy.openai_api.parse_chat_request`, an
:class:`~qwengyre.proxy.tito.ExecutionRecorder` (tree matching, suffix-only encoding),
and :func:`~qwengyre.proxy.openai_api.completion_body` for the reply. A reply is the
tokenised ideal text plus the end-of-turn token, as the scripted engine produces it, and as
a real engine must sample it. ``tests/test_warm_start.py`` checks that the (prompt, reply)
ids equal the nodes a live proxy records for the same episode.

SFT and the stopping rule
-------------------------
AdamW on batches of ideal episodes of random additions from
:func:`~qwengyre.rollout.toy_tasks.warm_start_pairs` (disjoint from the RL tasks and from
the held-out set); the loss is the mean cross-entropy over reply tokens only (the
engine's output ids, end-of-turn token included) of every chain of the tree. Each chain
kind is one forward pass whose shared prompt prefix (the system prompt and tool
definitions) is computed once and broadcast over the batch (gradients flow through it),
which is exact and ~3x cheaper than recomputing it per row.

Every ``eval_every`` steps the accuracy is *measured* as the RL reward sees it: whole
episodes of held-out problems, every call sampled at temperature 1 (the rollout
temperature) through the in-process proxy recorder, scored by the problem's rule on what
the workspace's answer.txt holds. Training stops at the first measurement
``>= target_accuracy`` -- the curve jumps, so a step count is not a stopping rule. It is
bounded by ``max_steps`` updates, never by the clock (a busy machine only makes it slower,
it does not make it stop short): a warm start that has not measured the target after
``max_steps`` updates raises :class:`WarmStartError`, saying what it reached. Measured on
the default (the demo model, parity, target 0.25, one torch thread) it reaches the target
at its 7th evaluation, after 70 steps, on seeds 0, 1 and 2 (measured 0.25, 0.25, 0.41;
0.00 through step 40), in 87-122 s on one quiet core; the default bound,
``warm_start.max_steps`` = 250 in the config tree, leaves a 3.5x margin over that.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from qwengyre.engines.base import GenerateResult
from qwengyre.models.tiny import default_cache_dir, quiet_progress_bars
from qwengyre.proxy import openai_api
from qwengyre.proxy.parsers import TOOL_PARSERS
from qwengyre.proxy.render import ChatRenderer
from qwengyre.proxy.tito import ExecutionRecorder
from qwengyre.rollout.toy_harness import (
    SUBAGENT_HEADER,
    SUBAGENT_PROMPT,
    WRITE_FILE_TOOL,
    ToyResult,
    run_episode,
)
from qwengyre.rollout.toy_tasks import (
    ANSWER_FILE,
    RANGES,
    TOY_KIND,
    Kind,
    Ranges,
    ToyProblem,
    problems,
)

__all__ = [
    "Episode",
    "ModelCall",
    "Policy",
    "RecorderClient",
    "WarmStartError",
    "WarmStartResult",
    "answer_call",
    "ideal_episode",
    "ideal_script",
    "run_recorded_episode",
    "scripted_policy",
    "tool_call_text",
    "warm_start",
    "written_answer",
]


Policy = Callable[[str, int, Sequence[int]], Sequence[int]]
"""(request class, turn within the class, prompt ids) -> output ids (end-of-turn included)."""


def tool_call_text(name: str, **arguments: str) -> str:
    """A tool call as the chat template renders one (and as the model must write it)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def ideal_script(problem: ToyProblem) -> dict[str, list[str]]:
    """The ideal replies by request class, in turn order (a ScriptedEngine script)."""
    answer = tool_call_text("write_file", content=problem.ideal_answer, path=ANSWER_FILE)
    return {
        "main.task": [
            tool_call_text("delegate", task=problem.delegated),
            tool_call_text("write_file", path="done.txt", content="ok"),
            "Done.",
        ],
        "sub.task": [answer, "Done."],
        "main.summary": ["Done."],
    }


@dataclass(frozen=True)
class ModelCall:
    """One recorded call: the full prompt the engine saw and the ids it produced."""

    request_class: str
    turn: int  # within its class
    prompt_ids: tuple[int, ...]
    reply_ids: tuple[int, ...]


@dataclass(kw_only=True, frozen=True)
class Episode:
    task_id: str
    calls: tuple[ModelCall, ...]
    chains: tuple[tuple[tuple[int, ...], tuple[bool, ...]], ...]
    """Per leaf of the tree: its context ids and which of them are sampled (targets)."""
    result: ToyResult
    score: float


class RecorderClient:
    """A :class:`~qwengyre.rollout.toy_harness.ModelClient` that runs each request through
    the proxy's parser and TITO recorder in-process and answers with ``policy``'s ids."""

    def __init__(self, renderer: ChatRenderer, policy: Policy, max_context: int = 1 << 30):
        self.renderer = renderer
        self.policy = policy
        self.recorder = ExecutionRecorder(renderer, max_context)
        self.calls = 0
        self.records: list[ModelCall] = []
        self._turns: dict[str, int] = {}

    async def complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "qwengyre", "messages": messages}
        if tools:
            body["tools"] = tools
        self.calls += 1
        all_headers = {"authorization": "Bearer in-process", **(headers or {})}
        chat = openai_api.parse_chat_request(json.dumps(body).encode(), all_headers)
        call = self.recorder.prepare(chat)
        klass = call.request_class.name
        turn = self._turns.get(klass, 0)
        self._turns[klass] = turn + 1
        prompt = tuple(call.prompt_ids)
        ids = tuple(int(t) for t in self.policy(klass, turn, prompt))
        self.records.append(ModelCall(klass, turn, prompt, ids))
        zeros = (0.0,) * len(ids)
        result = GenerateResult(ids, zeros, (0,) * len(ids), "stop")
        _, completion = self.recorder.record(
            call, result, id_prefix=openai_api.OpenAIChat.id_prefix,
            tool_id_prefix=openai_api.OpenAIChat.tool_id_prefix, model="qwengyre",
            engine="warm-start", started_s=0.0, finished_s=0.0,
        )  # fmt: skip
        message = openai_api.completion_body(completion, 0)["choices"][0]["message"]
        return dict(json.loads(json.dumps(message)))


def scripted_policy(tokenizer: Any, script: dict[str, list[str]]) -> Policy:
    """Replies as :class:`~qwengyre.engines.scripted.ScriptedEngine` produces them."""
    eos = int(tokenizer.eos_token_id)

    def policy(klass: str, turn: int, prompt: Sequence[int]) -> list[int]:
        replies = script[klass]
        text = replies[min(turn, len(replies) - 1)]
        return [*tokenizer.encode(text, add_special_tokens=False), eos]

    return policy


def run_recorded_episode(
    renderer: ChatRenderer, problem: ToyProblem, policy: Policy, *, max_turns: int = 8
) -> Episode:
    """One toy-harness execution of ``problem``'s task answered by ``policy``, recorded."""
    task = problem.task
    client = RecorderClient(renderer, policy)
    with tempfile.TemporaryDirectory(prefix="qwengyre-ws-") as tmp:
        workspace = Path(tmp)
        result = asyncio.run(run_episode(client, task.instructions, workspace, max_turns=max_turns))
        try:
            written = (workspace / ANSWER_FILE).read_text()
        except OSError:
            written = None
        score = float(written is not None and problem.correct(written))
    tree = client.recorder.tree
    chains = []
    for leaf in tree.leaves():
        ids: list[int] = []
        mask: list[bool] = []
        for node in tree.path(leaf.id):
            ids += node.input_ids
            mask += [False] * len(node.input_ids)
            ids += node.output_ids
            mask += [True] * len(node.output_ids)
        chains.append((tuple(ids), tuple(mask)))
    return Episode(
        task_id=task.id,
        calls=tuple(client.records),
        chains=tuple(chains),
        result=result,
        score=score,
    )


def ideal_episode(renderer: ChatRenderer, problem: ToyProblem) -> Episode:
    """The ideal episode of ``problem`` (see the module docstring)."""
    return run_recorded_episode(
        renderer, problem, scripted_policy(renderer.tokenizer, ideal_script(problem))
    )


def written_answer(text: str) -> str | None:
    """What a decoded reply's last ``write_file`` to answer.txt writes (None: nothing);
    the reply is in the tiny model's (hermes) tool-call format."""
    _, calls = TOOL_PARSERS["hermes"].parse(text)
    written = [
        args.get("content")
        for name, args in calls
        if name == "write_file" and args.get("path") == ANSWER_FILE
    ]
    return written[-1] if written and isinstance(written[-1], str) else None


# --------------------------------------------------------------------------- model work


def _cache_kw(model: Any) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.x deprecation)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _broadcast_cache(kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int) -> Any:
    from transformers import DynamicCache

    return DynamicCache([(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in kv])


def _common_prefix(rows: Sequence[Sequence[int]]) -> int:
    first = rows[0]
    n = min(len(r) for r in rows)
    for row in rows[1:]:
        i = 0
        while i < n and row[i] == first[i]:
            i += 1
        n = i
    return n


def answer_call(renderer: ChatRenderer, problem: ToyProblem) -> ModelCall:
    """The ideal episode's answer call alone, ~6x cheaper than :func:`ideal_episode`:
    the sub-agent's first request (a root of the tree, rendered whole) as the harness
    sends it, recorded with its ideal reply."""
    script = ideal_script(problem)
    client = RecorderClient(renderer, scripted_policy(renderer.tokenizer, script))
    messages = [
        {"role": "system", "content": SUBAGENT_PROMPT},
        {"role": "user", "content": problem.delegated},  # the ideal delegate task
    ]
    asyncio.run(client.complete(messages, [WRITE_FILE_TOOL], {SUBAGENT_HEADER: "sub-1"}))
    return client.records[0]


def _answer_row(
    renderer: ChatRenderer, problem: ToyProblem
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """The answer call as a training row: its prompt, then its reply (the only targets)."""
    call = answer_call(renderer, problem)
    mask = (False,) * len(call.prompt_ids) + (True,) * len(call.reply_ids)
    return call.prompt_ids + call.reply_ids, mask


def _chain_loss(
    model: Any, chains: Sequence[tuple[tuple[int, ...], tuple[bool, ...]]], pad: int
) -> tuple[torch.Tensor, int]:
    """Summed reply-token cross-entropy of same-kind chains (right-padded, no mask needed:
    attention is causal and padding only follows real tokens), and the target count.
    The shared prefix is run once and its KV cache broadcast over the rows."""
    rows = [c[0] for c in chains]
    first_target = min(c[1].index(True) for c in chains)
    prefix = max(0, min(_common_prefix(rows), first_target) - 1)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(chains):
        ids[i, : len(row)] = torch.tensor(row)
        targets = torch.tensor(row)
        targets[~torch.tensor(mask)] = -100
        labels[i, : len(row)] = targets
    cache = None
    if prefix > 0:
        out = model(input_ids=ids[:1, :prefix], use_cache=True)
        cache = _broadcast_cache(_layer_kv(out.past_key_values), len(rows))
    positions = torch.arange(prefix, width).unsqueeze(0).expand(len(rows), -1)
    logits = model(
        input_ids=ids[:, prefix:],
        position_ids=positions,
        use_cache=True,
        **{_cache_kw(model): cache},
    ).logits
    shifted = labels[:, prefix + 1 :]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        shifted.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    return loss, int((shifted != -100).sum())


@torch.no_grad()
def _sample(
    model: Any,
    prompts: Sequence[Sequence[int]],
    eos: int,
    generator: torch.Generator,
    *,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
) -> list[list[int]]:
    """Sample replies for equal-length prompts at ``temperature`` (full distribution),
    each up to and including the end-of-turn token."""
    rows = len(prompts)
    kw = _cache_kw(model)
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
    prefix = max(0, _common_prefix(prompts) - 1)
    cache = None
    if prefix > 0:
        out = model(input_ids=ids[:1, :prefix], use_cache=True)
        cache = _broadcast_cache(
            [(k.contiguous(), v.contiguous()) for k, v in _layer_kv(out.past_key_values)], rows
        )
    pos = ids.shape[1]
    out = model(
        input_ids=ids[:, prefix:],
        position_ids=torch.arange(prefix, pos).unsqueeze(0).expand(rows, -1),
        use_cache=True,
        **{kw: cache},
    )
    replies: list[list[int]] = [[] for _ in range(rows)]
    done = torch.zeros(rows, dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float() / temperature
        token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
        for i in range(rows):
            if not done[i]:
                replies[i].append(int(token[i]))
        done |= token == eos
        if bool(done.all()):
            break
        out = model(
            input_ids=token.unsqueeze(1),
            position_ids=torch.full((rows, 1), pos),
            use_cache=True,
            **{kw: out.past_key_values},
        )
        pos += 1
    return replies


def _episode_score(
    model: Any, renderer: ChatRenderer, chosen: Sequence[ToyProblem], generator: torch.Generator
) -> float:
    """Mean evaluator score of whole episodes, every call sampled at temperature 1."""
    eos = int(renderer.tokenizer.eos_token_id)

    def policy(klass: str, turn: int, prompt: Sequence[int]) -> list[int]:
        return _sample(model, [prompt], eos, generator, max_new_tokens=96)[0]

    was_training = model.training
    model.eval()
    try:
        scores = [run_recorded_episode(renderer, p, policy).score for p in chosen]
    finally:
        model.train(was_training)
    return sum(scores) / len(scores)


# --------------------------------------------------------------------------- warm start


@dataclass(kw_only=True, frozen=True)
class WarmStartResult:
    steps: int
    seconds: float
    accuracy: float
    """The last measured accuracy (of the saved model)."""
    history: tuple[tuple[int, float, float], ...]
    """(step, seconds since the start, measured accuracy) of every evaluation."""
    reached: bool
    """Whether the measured accuracy reached the target (always, once returned)."""
    path: Path
    losses: tuple[float, ...] = ()
    """Mean reply-token loss of every step."""


class WarmStartError(ValueError):
    """The warm start did not measure its target accuracy within its step bound; the
    message says what it reached and what to change. Nothing is saved but the record
    (``warm_start.json`` with ``reached: false``)."""

    def __init__(self, message: str, result: WarmStartResult, target_accuracy: float):
        super().__init__(message)
        self.result = result
        self.target_accuracy = target_accuracy


def cache_path(model_dir: Path, *, target_accuracy: float, max_steps: int, seed: int) -> Path:
    """Where a warm start of ``model_dir`` with these settings is kept for later runs:
    beside the tiny models' cache (``$QWENGYRE_CACHE``'s parent, else
    ``~/.cache/qwengyre``), keyed by the model and everything the result depends on."""
    h = hashlib.sha256()
    settings = {"model": Path(model_dir).name, "accuracy": target_accuracy, "steps": max_steps}
    for part in (json.dumps({**settings, "seed": seed}).encode(), Path(__file__).read_bytes()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    name = f"{Path(model_dir).name}-{h.hexdigest()[:16]}"
    return default_cache_dir().parent / "warm-start" / name


def cached_warm_start(
    model_dir: Path,
    out_dir: Path,
    *,
    target_accuracy: float,
    max_steps: int,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    **options: Any,
) -> WarmStartResult | None:
    """:func:`warm_start`, or a copy of the one an earlier run made with the same model
    and settings (:func:`cache_path`; then None); a new one is kept there for the next."""
    say = log or (lambda _msg: None)
    kept = cache_path(model_dir, target_accuracy=target_accuracy, max_steps=max_steps, seed=seed)
    if (kept / "config.json").is_file():
        shutil.copytree(kept, out_dir, dirs_exist_ok=True)
        say(f"warm start: the one made before with the same settings ({kept})")
        return None
    result = warm_start(
        model_dir,
        out_dir,
        target_accuracy=target_accuracy,
        max_steps=max_steps,
        seed=seed,
        log=log,
        **options,
    )
    kept.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kept.name}.", dir=kept.parent))
    try:
        shutil.copytree(out_dir, tmp, dirs_exist_ok=True)
        tmp.rename(kept)  # whole or not at all; a concurrent run's copy may win
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def warm_start(
    model_dir: Path,
    out_dir: Path,
    *,
    target_accuracy: float,
    max_steps: int,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    batch_size: int = 8,
    answer_batch: int = 128,
    lr: float = 5e-3,
    eval_every: int = 10,
    eval_size: int = 32,
    threads: int = 1,
    kind: Kind = TOY_KIND,
    ranges: Ranges = RANGES,
    advice: str = "raise max_steps, lower target_accuracy, or start from a model that "
    "already does the task",
) -> WarmStartResult:
    """SFT ``model_dir`` on ideal episodes until the measured sampled episode reward
    reaches ``target_accuracy``; save to ``out_dir``. Raises :class:`WarmStartError`
    (ending with ``advice``) when ``max_steps`` updates did not get there. It uses
    ``threads`` torch threads (the previous setting is restored on return).

    Each step trains on ``batch_size`` ideal episodes (every chain of their trees) plus
    the answer call alone (its prompt and reply; cheap, since the long prompt prefix is
    shared) of ``answer_batch - batch_size`` more: the addition is what is hard to learn,
    the rest is fixed text. ``seconds`` counts everything from the call
    (loading, data, training, evaluations); it is reported, never a limit.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if max_steps < 1 or threads < 1:
        raise ValueError(f"max_steps ({max_steps}) and threads ({threads}) must be >= 1")
    start = time.monotonic()
    say = log or (lambda _msg: None)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        renderer = ChatRenderer(tokenizer)
        pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        eval_problems = problems("heldout", kind, ranges)[:eval_size]
        train_problems = problems("train", kind, ranges)
        rng = random.Random(seed)
        generator = torch.Generator().manual_seed(seed)
        episodes: dict[str, Episode] = {}
        answers: dict[str, tuple[tuple[int, ...], tuple[bool, ...]]] = {}
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        history: list[tuple[int, float, float]] = []
        losses: list[float] = []
        step = 0
        accuracy = math.nan
        reached = False

        def evaluate() -> float:
            acc = _episode_score(model, renderer, eval_problems, generator)
            history.append((step, time.monotonic() - start, acc))
            elapsed = time.monotonic() - start
            left = elapsed / step * (max_steps - step) if step else math.nan
            say(
                f"step {step} of at most {max_steps}: {elapsed:.0f} s, loss "
                f"{losses[-1] if losses else math.nan:.3f}, accuracy {acc:.3f} (target "
                f"{target_accuracy:.2f}; at most ~{left:.0f} s left)"
            )
            return acc

        while True:
            if step and step % eval_every == 0:
                accuracy = evaluate()
                if accuracy >= target_accuracy:
                    reached = True
                    break
            if step >= max_steps:
                if not history or history[-1][0] != step:
                    accuracy = evaluate()
                reached = accuracy >= target_accuracy
                if not reached:
                    say(f"stopped at max_steps={max_steps} with accuracy {accuracy:.3f}")
                break
            drawn = rng.sample(train_problems, max(batch_size, answer_batch))
            batch = []
            for problem in drawn[:batch_size]:
                key = problem.task.id
                if key not in episodes:
                    episodes[key] = ideal_episode(renderer, problem)
                batch.append(episodes[key])
            groups = [[e.chains[kind] for e in batch] for kind in range(len(batch[0].chains))]
            extra = []
            for problem in drawn[batch_size:answer_batch]:
                key = problem.task.id
                if key not in answers:
                    answers[key] = _answer_row(renderer, problem)
                extra.append(answers[key])
            groups.append(extra)
            optimizer.zero_grad(set_to_none=True)
            total = sum(sum(m) for group in groups for _, m in group)
            summed = 0.0
            for group in groups:
                if group:
                    loss, _count = _chain_loss(model, group, pad)
                    (loss / total).backward()
                    summed += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(summed / total)
            step += 1
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if reached:
            model.eval()
            with quiet_progress_bars():
                model.save_pretrained(out_dir)
            tokenizer.save_pretrained(out_dir)
        result = WarmStartResult(
            steps=step,
            seconds=time.monotonic() - start,
            accuracy=accuracy,
            history=tuple(history),
            reached=reached,
            path=out_dir,
            losses=tuple(losses),
        )
        record = {
            **asdict(result),
            "path": str(out_dir),
            "target_accuracy": target_accuracy,
            "max_steps": max_steps,
            "threads": threads,
        }
        (out_dir / "warm_start.json").write_text(json.dumps(record, indent=1) + "\n")
        if not reached:
            curve = ", ".join(f"{acc:.2f}@{at}" for at, _, acc in history)
            raise WarmStartError(
                f"the warm start did not reach its target accuracy {target_accuracy:.2f} "
                f"within {max_steps} steps: it measured {accuracy:.2f} after {step} steps "
                f"({result.seconds:.0f} s; accuracy@step {curve}); {advice}",
                result,
                target_accuracy,
            )
        return result
    finally:
        torch.set_num_threads(previous_threads)
