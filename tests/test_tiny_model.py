"""Tests for the offline tiny model builder (qwengyre.models)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from qwengyre.models import (
    SPECIAL_TOKENS,
    TINY_SIZES,
    build_tiny_model,
    cached_tiny_model,
    default_cache_dir,
)

TOOL_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
WEATHER_ARGS: dict[str, Any] = {"city": "Zürich", "unit": "celsius", "days": [1, 2]}


@pytest.fixture(scope="module")
def offline_env() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield mp


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path, offline_env: pytest.MonkeyPatch) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path, offline_env: pytest.MonkeyPatch) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    out = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(out, str)
    return out


# --------------------------------------------------------------------------- loading


def test_model_config_matches_spec(model: Any, tokenizer: Any) -> None:
    spec = TINY_SIZES["test"]
    cfg = model.config
    assert cfg.model_type in ("qwen3", "qwen2")
    assert cfg.num_hidden_layers == spec.num_hidden_layers
    assert cfg.hidden_size == spec.hidden_size
    assert cfg.num_attention_heads == spec.num_attention_heads
    assert cfg.num_key_value_heads == spec.num_key_value_heads
    assert cfg.head_dim == spec.hidden_size // spec.num_attention_heads
    assert cfg.max_position_embeddings == spec.max_position_embeddings
    assert cfg.tie_word_embeddings is True
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert cfg.vocab_size == len(tokenizer) == spec.vocab_size


def test_special_token_ids_are_consistent(model: Any, tokenizer: Any, tiny_model_dir: Path) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == im_end == model.config.eos_token_id
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id == endoftext == model.config.pad_token_id
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    assert gen.eos_token_id == im_end
    assert gen.pad_token_id == endoftext
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert all(0 <= i < len(tokenizer) for i in ids)
    for token, token_id in zip(SPECIAL_TOKENS, ids, strict=True):
        assert tokenizer.encode(token, add_special_tokens=True) == [token_id]
    # Nothing (no BOS) is prepended or appended when encoding plain text.
    assert not set(tokenizer.encode("hello world")) & set(ids)


def test_forward_and_generate(model: Any, tokenizer: Any) -> None:
    ids = tokenizer("def add(a, b):\n    return a + b  # 37+45=82", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    out = model.generate(
        **ids,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert out.shape == (1, ids["input_ids"].shape[1] + 4)


# --------------------------------------------------------------------------- tokenizer

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  \n\n\ttabs\r\nwindows newline",
    "Zürich café naïve — “quotes” ‘x’ ±3 × 4 ÷ 2 ≤ 7",
    "模型读取文件 エージェント Температура 🚀✅❌ 👩‍💻",
    "37+45=82; 1234567890; 3.14159; -0.5e-10; 0x1F",
    'def f(x):\n    return {"a": [1, 2, 3]}\n',
    '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls -la"}}\n</tool_call>',
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=80))
def test_round_trip_arbitrary_text(tokenizer: Any, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_digits_are_single_tokens(tokenizer: Any) -> None:
    text = "x = 2024 + 17*305; 9876543210"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    digit_pieces = [p for p in pieces if any(ch.isdigit() for ch in p)]
    assert digit_pieces == list(re.sub(r"\D", "", text))
    # No learned token anywhere in the vocabulary holds a digit next to anything else.
    for token in tokenizer.get_vocab():
        if any(ch in "0123456789" for ch in token):
            assert len(token) == 1, token


def test_markup_tokens_survive_skip_special_tokens(tokenizer: Any) -> None:
    text = '<think>hm</think><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == text.removesuffix("<|im_end|>")


# --------------------------------------------------------------------------- chat template


def conversation(arguments: dict[str, Any] | str, *, openai_shape: bool) -> list[dict[str, Any]]:
    call: dict[str, Any] = {"name": "get_weather", "arguments": arguments}
    if openai_shape:
        call = {"id": "call_0", "type": "function", "function": call}
    return [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 °C.", "reasoning_content": "SECRET-REASONING"},
    ]


EXPECTED_RENDER = (
    "<|im_start|>system\nYou are a terse assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER_TOOL, ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "get_weather", "arguments": '
    + json.dumps(WEATHER_ARGS, ensure_ascii=False)
    + "}\n</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n21 °C.<|im_end|>\n"
)


@pytest.mark.parametrize("openai_shape", [True, False], ids=["openai", "bare"])
@pytest.mark.parametrize("as_json_string", [False, True], ids=["dict-args", "string-args"])
def test_tool_conversation_renders(
    tokenizer: Any, openai_shape: bool, as_json_string: bool
) -> None:
    arguments = json.dumps(WEATHER_ARGS) if as_json_string else WEATHER_ARGS
    messages = conversation(arguments, openai_shape=openai_shape)
    text = render(tokenizer, messages, tools=[WEATHER_TOOL])
    placeholder, *found = TOOL_CALL_RE.findall(text)
    # The first match is the format example in the system turn's tool instructions.
    assert "<function-name>" in placeholder
    assert [json.loads(m) for m in found] == [{"name": "get_weather", "arguments": WEATHER_ARGS}]
    assert "SECRET-REASONING" not in text
    if not as_json_string:
        assert text == EXPECTED_RENDER
    # The rendered text tokenizes with each control/markup token as a single id.
    ids = tokenizer.encode(text, add_special_tokens=False)
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "<tool_response>"):
        assert ids.count(tokenizer.convert_tokens_to_ids(token)) == text.count(token)


def test_without_tools_or_system(tokenizer: Any) -> None:
    text = render(tokenizer, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    text = render(tokenizer, [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"


def test_tools_without_system_message(tokenizer: Any) -> None:
    text = render(tokenizer, [{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")


def test_generation_prompt(tokenizer: Any) -> None:
    messages = conversation(WEATHER_ARGS, openai_shape=True)
    with_prompt = render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    without = render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=False)
    assert with_prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert without.endswith("<|im_end|>\n")
    assert with_prompt == without + "<|im_start|>assistant\n"


def test_mid_conversation_system_message(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "First system."},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "<system-reminder>Later system.</system-reminder>"},
        {"role": "user", "content": "u2"},
    ]
    text = render(tokenizer, messages, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nFirst system.\n\n# Tools")
    assert text.count("First system.") == 1
    assert text.endswith(
        "<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>system\n<system-reminder>Later system.</system-reminder><|im_end|>\n"
        "<|im_start|>user\nu2<|im_end|>\n"
    )


def test_list_of_parts_content(tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "Sys part."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "part one"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
                {"type": "text", "text": "part two"},
            ],
        },
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "calling"}],
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}],
        },
        {"role": "tool", "content": [{"type": "text", "text": "rainy"}]},
    ]
    text = render(tokenizer, messages)
    assert text == (
        "<|im_start|>system\nSys part.<|im_end|>\n"
        "<|im_start|>user\npart one\npart two<|im_end|>\n"
        "<|im_start|>assistant\ncalling\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nrainy\n</tool_response><|im_end|>\n"
    )


def test_consecutive_tool_results_grouped(tokenizer: Any) -> None:
    calls = [
        {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}},
        {"type": "function", "function": {"name": "b", "arguments": "{}"}},
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "A"},
        {"role": "tool", "content": "B"},
        {"role": "assistant", "content": "done"},
    ]
    text = render(tokenizer, messages)
    assert [json.loads(m) for m in TOOL_CALL_RE.findall(text)] == [
        {"name": "a", "arguments": {"x": 1}},
        {"name": "b", "arguments": {}},
    ]
    assert (
        "<|im_start|>user\n<tool_response>\nA\n</tool_response>\n"
        "<tool_response>\nB\n</tool_response><|im_end|>\n<|im_start|>assistant\ndone"
    ) in text
    assert text.count("<|im_start|>user") == 2


# --------------------------------------------------------------------------- building


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in MODEL_FILES}


def test_build_is_deterministic_and_seeded(tmp_path: Path) -> None:
    rng_before = torch.get_rng_state()
    a = build_tiny_model(tmp_path / "a", "test", seed=0)
    b = build_tiny_model(tmp_path / "b", "test", seed=0)
    c = build_tiny_model(tmp_path / "c", "test", seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before)
    fa, fb, fc = _file_bytes(a), _file_bytes(b), _file_bytes(c)
    assert fa == fb
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    assert fc["model.safetensors"] != fa["model.safetensors"]
    assert fc["tokenizer.json"] == fa["tokenizer.json"]
    assert fc["config.json"] == fa["config.json"]


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    bad_size: Any = "huge"
    with pytest.raises(ValueError, match=r"'huge'.*'test'.*'demo'"):
        build_tiny_model(tmp_path / "m", bad_size)
    with pytest.raises(ValueError, match="'huge'"):
        cached_tiny_model(bad_size, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "m").exists()


def test_non_empty_out_dir_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    build_tiny_model(out)  # an existing empty directory is fine
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_tiny_model(out, seed=1)
    assert (out / "model.safetensors").read_bytes() == before
    build_tiny_model(out, seed=1, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != before


def test_cached_model_is_built_once_and_shared(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: cached_tiny_model("test", 0, cache), range(3)))
    assert len(set(paths)) == 1
    path = paths[0]
    assert path.parent == cache
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temp dirs left behind
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert cached_tiny_model("test", 0, cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert _file_bytes(path) == _file_bytes(build_tiny_model(tmp_path / "direct", "test", 0))
    other = cached_tiny_model("test", 1, cache)
    assert other != path
    assert (other / "model.safetensors").read_bytes() != (path / "model.safetensors").read_bytes()


def test_untied_model_has_its_own_lm_head_and_stays_untied(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "untied", "test", tie_embeddings=False)
    saved = safetensors.torch.load_file(str(path / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(path)
    head, embed = model.lm_head.weight, model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings is False
    assert head.untyped_storage().data_ptr() != embed.untyped_storage().data_ptr()
    assert not torch.allclose(head, embed, atol=1e-3)  # initialised independently
    assert torch.equal(head, saved["lm_head.weight"])
    assert torch.equal(embed, saved["model.embed_tokens.weight"])
    with torch.no_grad():
        head.mul_(2)
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert again.config.tie_word_embeddings is False
    assert torch.equal(again.lm_head.weight, 2 * saved["lm_head.weight"])
    assert torch.equal(again.get_input_embeddings().weight, saved["model.embed_tokens.weight"])
    tied = build_tiny_model(tmp_path / "tied", "test")
    assert "lm_head.weight" not in safetensors.torch.load_file(str(tied / "model.safetensors"))
    with pytest.raises(TypeError, match="tie_embeddings must be a bool"):
        build_tiny_model(tmp_path / "bad", "test", tie_embeddings=cast(Any, "no"))


def test_unknown_template_is_rejected_naming_the_known_ones(tmp_path: Path) -> None:
    bad: Any = "llama"
    with pytest.raises(ValueError, match=r"'llama'.*'qwen3'.*'qwen3-coder'"):
        build_tiny_model(tmp_path / "m", "test", template=bad)
    with pytest.raises(ValueError, match="'llama'"):
        cached_tiny_model("test", cache_dir=tmp_path / "cache", template=bad)
    assert not (tmp_path / "m").exists()


def test_a_template_model_is_cached_apart_and_differs_only_in_its_template(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    plain = cached_tiny_model("test", 0, cache)
    coder = cached_tiny_model("test", 0, cache, template="qwen3-coder")
    assert coder != plain and "qwen3-coder" in coder.name and "coder" not in plain.name
    assert _file_bytes(coder) == _file_bytes(plain)  # weights and tokenizer
    template = (coder / "chat_template.jinja").read_text()
    assert template != (plain / "chat_template.jinja").read_text() and "<function=" in template


def test_untied_model_is_cached_apart_from_the_tied_one(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    tied = cached_tiny_model("test", 0, cache)
    untied = cached_tiny_model("test", 0, cache, tie_embeddings=False)
    assert untied != tied and "untied" in untied.name and "untied" not in tied.name
    assert cached_tiny_model("test", 0, cache, tie_embeddings=False) == untied
    direct = build_tiny_model(tmp_path / "direct", "test", tie_embeddings=False)
    assert _file_bytes(untied) == _file_bytes(direct)
    assert json.loads((untied / "config.json").read_text())["tie_word_embeddings"] is False


def test_moe_model_is_a_seeded_qwen3_moe_that_transformers_loads(tmp_path: Path) -> None:
    spec = TINY_SIZES["test"]
    a = build_tiny_model(tmp_path / "a", "test", seed=0, moe=True)
    b = build_tiny_model(tmp_path / "b", "test", seed=0, moe=True)
    c = build_tiny_model(tmp_path / "c", "test", seed=1, moe=True)
    assert _file_bytes(a) == _file_bytes(b)
    assert _file_bytes(c)["model.safetensors"] != _file_bytes(a)["model.safetensors"]
    dense = build_tiny_model(tmp_path / "dense", "test", seed=0)
    assert _file_bytes(a)["tokenizer.json"] == _file_bytes(dense)["tokenizer.json"]
    template = "chat_template.jinja"
    assert (a / template).read_bytes() == (dense / template).read_bytes()

    config = AutoConfig.from_pretrained(a)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert config.num_experts == spec.num_experts == 4  # "num_local_experts" in the file
    assert config.num_experts_per_tok == spec.num_experts_per_tok == 2
    assert config.moe_intermediate_size == spec.moe_intermediate_size
    assert config.decoder_sparse_step == 1 and config.mlp_only_layers == []
    assert config.norm_topk_prob is True
    # The checkpoint keeps Qwen's layout: each expert's projections apart, no shared expert.
    saved = safetensors.torch.load_file(str(a / "model.safetensors"))
    layer = "model.layers.1.mlp"
    assert saved[f"{layer}.experts.3.gate_proj.weight"].shape == (
        spec.moe_intermediate_size,
        spec.hidden_size,
    )
    assert saved[f"{layer}.experts.3.down_proj.weight"].shape == (
        spec.hidden_size,
        spec.moe_intermediate_size,
    )
    assert saved[f"{layer}.gate.weight"].shape == (spec.num_experts, spec.hidden_size)
    assert not [k for k in saved if "shared_expert" in k]
    experts = {k for k in saved if ".experts." in k}
    assert len(experts) == spec.num_hidden_layers * spec.num_experts * 3

    model = AutoModelForCausalLM.from_pretrained(a).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers)
    fused = model.model.layers[1].mlp.experts  # transformers fuses the experts on load
    gate, up = (
        saved[f"{layer}.experts.3.gate_proj.weight"],
        saved[f"{layer}.experts.3.up_proj.weight"],
    )
    assert torch.equal(fused.gate_up_proj[3], torch.cat([gate, up]))
    tokenizer = AutoTokenizer.from_pretrained(a)
    ids = tokenizer("def f(x):\n    return x", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    assert out.logits.shape == (1, ids.shape[1], spec.vocab_size)
    assert torch.isfinite(out.logits).all()
    assert [r.shape for r in out.router_logits] == [(ids.shape[1], spec.num_experts)] * 2
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 5)

    cached = cached_tiny_model("test", 0, tmp_path / "cache", moe=True)
    assert "-moe-" in cached.name and _file_bytes(cached) == _file_bytes(a)
    assert cached_tiny_model("test", 0, tmp_path / "cache") != cached
    with pytest.raises(TypeError, match="moe must be a bool"):
        build_tiny_model(tmp_path / "bad", "test", moe=cast(Any, 1))


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QWENGYRE_CACHE", str(tmp_path / "qc"))
    assert default_cache_dir() == tmp_path / "qc"
    monkeypatch.delenv("QWENGYRE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "qwengyre" / "models"
