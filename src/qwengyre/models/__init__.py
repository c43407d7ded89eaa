"""Tiny offline HuggingFace-format causal LMs for tests and demos.

``build_tiny_model`` writes a seeded, randomly initialised Qwen3-architecture model with a
byte-level BPE tokenizer and a Qwen-style chat template (``TEMPLATES``), without any network access;
``cached_tiny_model`` builds one once into a shared cache directory and returns its path.
"""

from qwengyre.models.tiny import (
    SPECIAL_TOKENS,
    TEMPLATES,
    TINY_SIZES,
    TinyModelSpec,
    build_tiny_model,
    cached_tiny_model,
    default_cache_dir,
)

__all__ = [
    "SPECIAL_TOKENS",
    "TEMPLATES",
    "TINY_SIZES",
    "TinyModelSpec",
    "build_tiny_model",
    "cached_tiny_model",
    "default_cache_dir",
]
