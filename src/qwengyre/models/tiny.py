"""Offline builder for tiny, randomly initialised, HuggingFace-format causal LMs.

Nothing here touches the network: the tokenizer is a byte-level BPE trained with the
``tokenizers`` library on ``corpus.txt`` (shipped with the package), the chat template is
one of :data:`TEMPLATES` (also shipped: Qwen3's hermes tool calls, or Qwen3-Coder's XML
tool calls with ``<think>`` reasoning), and the weights are a seeded random init of a Qwen3
(or, on older transformers, Qwen2) architecture, with the output layer tied to the input
embedding (as Qwen3-0.6B) or, on request, a separate one (as Qwen3-8B and larger).

``moe=True`` builds a Qwen3-MoE (``Qwen3MoeForCausalLM``, as Qwen3-30B-A3B) instead: every
decoder layer's MLP is a sparse block of :attr:`TinyModelSpec.num_experts` experts, each
token routed to :attr:`TinyModelSpec.num_experts_per_tok` of them (softmax, top-k, the
chosen weights renormalised: ``norm_topk_prob``). Qwen3-MoE has no shared expert (Qwen2-MoE
had one; Qwen3 dropped it), so neither has the tiny one. The router's auxiliary
load-balancing loss keeps the model's defaults (``output_router_logits=False``,
``router_aux_loss_coef=0.001``); the trainer does not add it (docs/design.md §3, MoE).
Attention, tokenizer and templates are the dense model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, get_args

import tokenizers
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers import GenerationConfig, PreTrainedTokenizerFast

from qwengyre.types import TinySize, TinyTemplate

__all__ = [
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "SPECIAL_TOKENS",
    "TEMPLATES",
    "TINY_SIZES",
    "TinyModelSpec",
    "build_tiny_model",
    "cached_tiny_model",
    "default_cache_dir",
    "quiet_progress_bars",
]


# Bump when the builder's behaviour changes in a way the cache key would not otherwise see.
_BUILDER_VERSION: Final = 1


@dataclass(kw_only=True, frozen=True)
class TinyModelSpec:
    """Shape of one tiny model; ``vocab_size`` counts the special tokens too."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    # The MoE variant (``moe=True``): experts per layer, experts per token, expert width.
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


TINY_SIZES: Final[MappingProxyType[str, TinyModelSpec]] = MappingProxyType(
    {
        # Just big enough to be a real model; keeps the whole test suite fast.
        "test": TinyModelSpec(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=1024,
            max_position_embeddings=4096,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        # The "mini" model of docs/design.md section 6 (~0.9M parameters).
        "demo": TinyModelSpec(
            num_hidden_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=384,
            vocab_size=4096,
            max_position_embeddings=8192,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=96,
        ),
    }
)
assert set(TINY_SIZES) == set(get_args(TinySize))

ENDOFTEXT: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
# Control tokens: special=True, so ``decode(..., skip_special_tokens=True)`` drops them.
_CONTROL_TOKENS: Final = (ENDOFTEXT, IM_START, IM_END)
# Markup tokens: single ids, but special=False (as in Qwen3), so they survive
# ``skip_special_tokens=True`` and tool calls can be parsed from decoded text.
_MARKUP_TOKENS: Final = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
SPECIAL_TOKENS: Final = _CONTROL_TOKENS + _MARKUP_TOKENS

_PACKAGE: Final = "qwengyre.models"
_CORPUS_FILE: Final = "corpus.txt"
TEMPLATES: Final[MappingProxyType[str, str]] = MappingProxyType(
    {
        # ChatML with hermes tool calls (<tool_call>{json}</tool_call>), as Qwen2.5 / Qwen3.
        "qwen3": "chat_template.jinja",
        # Qwen3-Coder's XML tool calls (<function=NAME><parameter=ARG>) and <think> reasoning.
        "qwen3-coder": "chat_template_qwen3_coder.jinja",
        # chat_template.jinja with the reasoning opened by the generation prompt
        # (<|im_start|>assistant\n<think>\n), as Qwen3 thinking models; reasoning kept.
        "qwen3-thinking": "chat_template_qwen3_thinking.jinja",
    }
)
"""The chat templates a tiny model may have, by name: the package resource of each."""
_DONE_MARKER: Final = ".qwengyre-tiny-model.json"

# The weight init draws from torch's global RNG (transformers offers no generator argument),
# so seeded construction is serialised across threads of this process.
_SEEDED_INIT_LOCK: Final = threading.Lock()


def _resource_bytes(name: str) -> bytes:
    return resources.files(_PACKAGE).joinpath(name).read_bytes()


def _template(name: str) -> bytes:
    try:
        return _resource_bytes(TEMPLATES[name])
    except (KeyError, TypeError):
        allowed = ", ".join(repr(t) for t in TEMPLATES)
        raise ValueError(
            f"unknown tiny model template {name!r}; expected one of {allowed}"
        ) from None


def _spec(size: str) -> TinyModelSpec:
    try:
        return TINY_SIZES[size]
    except (KeyError, TypeError):
        allowed = ", ".join(repr(s) for s in TINY_SIZES)
        raise ValueError(f"unknown tiny model size {size!r}; expected one of {allowed}") from None


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE on the shipped corpus (deterministic, ~0.1 s).

    The tokenizer depends only on the vocabulary size, not on the weight seed.
    """
    num_learned = vocab_size - len(SPECIAL_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if num_learned < len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the byte alphabet + specials")
    tok = Tokenizer(models.BPE())
    # No normalizer: byte-level BPE round-trips any text exactly.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=num_learned,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=alphabet,
        special_tokens=[],
    )
    corpus = _resource_bytes(_CORPUS_FILE).decode("utf-8")
    # Paragraphs keep "\n" and indentation inside training sequences.
    chunks = [c for c in re.split(r"(?<=\n)\n", corpus) if c]
    tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    learned = tok.get_vocab_size(with_added_tokens=True)
    if learned != num_learned:
        raise RuntimeError(
            f"BPE training produced {learned} tokens, wanted {num_learned}: corpus too small"
        )
    # Appended after the learned vocabulary, in this order, like Qwen's added tokens.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _MARKUP_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def _make_tokenizer(spec: TinyModelSpec, template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec.vocab_size),
        bos_token=None,  # Qwen style: nothing is prepended when encoding
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
        padding_side="right",
        chat_template=_template(template).decode("utf-8"),
    )


def _arch(moe: bool) -> tuple[type[Any], type[Any]]:
    """(config class, model class): Qwen3-MoE for ``moe``; else Qwen3 when this
    transformers has it, else Qwen2."""
    if moe:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeConfig, Qwen3MoeForCausalLM
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3Config, Qwen3ForCausalLM
    except ImportError:  # pragma: no cover - transformers < 4.51
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2Config, Qwen2ForCausalLM


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' tqdm bars (e.g. "Writing model shards") for a moment."""
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def build_tiny_model(
    out_dir: str | Path,
    size: TinySize = "test",
    seed: int = 0,
    *,
    tie_embeddings: bool = True,
    overwrite: bool = False,
    template: TinyTemplate = "qwen3",
    moe: bool = False,
) -> Path:
    """Build a tiny random causal LM (weights, tokenizer, chat template) into ``out_dir``.

    No network is used. Building twice with the same ``size`` and ``seed`` writes
    byte-identical files; the global torch RNG state is left as it was.

    Args:
        out_dir: target directory; created if missing. If it exists and is not empty the
            build is refused unless ``overwrite`` is true, in which case the builder's files
            are written over the existing ones (other files are left in place).
        size: a key of :data:`TINY_SIZES`.
        seed: seed of the random weight init.
        tie_embeddings: share one matrix between the input embedding and ``lm_head``
            (``tie_word_embeddings``); false gives ``lm_head`` its own, independently
            initialised weight, saved as ``lm_head.weight``.
        overwrite: allow building into a non-empty directory.
        template: a key of :data:`TEMPLATES`, the tokenizer's chat template.
        moe: build a Qwen3-MoE (module docstring) of the same size instead of a dense
            Qwen3; its checkpoint stores each expert's ``gate_proj`` / ``up_proj`` /
            ``down_proj`` apart, as Qwen's (transformers fuses them on load).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`, loadable with ``from_pretrained``.
    """
    spec = _spec(size)
    _template(template)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not isinstance(tie_embeddings, bool):
        raise TypeError(f"tie_embeddings must be a bool, got {tie_embeddings!r}")
    if not isinstance(moe, bool):
        raise TypeError(f"moe must be a bool, got {moe!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a directory")
    if _is_nonempty_dir(out) and not overwrite:
        raise FileExistsError(
            f"refusing to build a tiny model into non-empty directory {out}; "
            "pass overwrite=True to write over it"
        )
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _make_tokenizer(spec, template)
    vocab = tokenizer.get_vocab()
    eos_id, pad_id = vocab[IM_END], vocab[ENDOFTEXT]
    assert len(tokenizer) == spec.vocab_size

    config_cls, model_cls = _arch(moe)
    experts = (
        {
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "decoder_sparse_step": 1,  # every layer sparse, as Qwen3-30B-A3B
            "mlp_only_layers": [],
            "norm_topk_prob": True,  # as Qwen3-30B-A3B (the config class defaults to False)
        }
        if moe
        else {}
    )
    config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,  # Qwen3Config defaults to 128 otherwise
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=tie_embeddings,
        use_sliding_window=False,
        bos_token_id=pad_id,  # as Qwen: <|endoftext|>; the tokenizer prepends no BOS
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **experts,
    )
    with _SEEDED_INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    with quiet_progress_bars():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def default_cache_dir() -> Path:
    """``$QWENGYRE_CACHE`` if set, else ``~/.cache/qwengyre/models``."""
    env = os.environ.get("QWENGYRE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "qwengyre" / "models"


def _cache_key(size: str, seed: int, tie_embeddings: bool, template: str, moe: bool) -> str:
    h = hashlib.sha256()
    parts: list[bytes] = [
        str(_BUILDER_VERSION).encode(),
        json.dumps(dataclasses.asdict(_spec(size)), sort_keys=True).encode(),
        str(seed).encode(),
        str(tie_embeddings).encode(),
        str(moe).encode(),
        _resource_bytes(_CORPUS_FILE),
        template.encode(),
        _template(template),
        Path(__file__).read_bytes(),
        transformers.__version__.encode(),
        tokenizers.__version__.encode(),
        torch.__version__.encode(),
    ]
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def cached_tiny_model(
    size: TinySize = "test",
    seed: int = 0,
    cache_dir: str | Path | None = None,
    *,
    tie_embeddings: bool = True,
    template: TinyTemplate = "qwen3",
    moe: bool = False,
) -> Path:
    """Return the directory of a tiny model, building it into a cache on first use.

    The cache entry is keyed by size, seed, ``tie_embeddings``, ``template`` and ``moe``
    (see :func:`build_tiny_model`; an untied entry's name says ``untied``, one with another
    template than ``qwen3`` names it, an MoE one says ``moe``) and a hash of everything
    the build depends on (sizes table, corpus, template, builder source, library
    versions). It is built in a temporary directory and renamed into place, so
    concurrent callers (pytest-xdist workers) never see a half-written model; a loser of
    the race discards its copy.
    """
    _spec(size)
    _template(template)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    untied = "" if tie_embeddings else "-untied"
    named = "" if template == "qwen3" else f"-{template}"
    sparse = "-moe" if moe else ""
    key = _cache_key(size, seed, tie_embeddings, template, moe)
    final = root / f"{size}{sparse}-seed{seed}{untied}{named}-{key}"
    if (final / _DONE_MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        build_tiny_model(
            tmp,
            size,
            seed,
            tie_embeddings=tie_embeddings,
            overwrite=True,
            template=template,
            moe=moe,
        )
        marker = {
            "template": template,
            "size": size,
            "seed": seed,
            "tie_embeddings": tie_embeddings,
            "moe": moe,
            "key": final.name.rsplit("-", 1)[-1],
        }
        (tmp / _DONE_MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process got there first (ENOTEMPTY/EEXIST), or a stale incomplete
            # entry is in the way: keep a complete one, replace an incomplete one.
            if not (final / _DONE_MARKER).is_file():
                shutil.rmtree(final, ignore_errors=True)
                try:
                    os.rename(tmp, final)
                except OSError:
                    if not (final / _DONE_MARKER).is_file():
                        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return final
