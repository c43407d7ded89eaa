"""Bundled configuration presets: ``<name>.yaml`` beside this file."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def preset_names() -> list[str]:
    files = resources.files(__name__)
    return sorted(p.name.removesuffix(".yaml") for p in files.iterdir() if p.name.endswith(".yaml"))


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name``; ValueError naming the allowed ones otherwise."""
    if name not in preset_names():
        raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(preset_names())}")
    return Path(str(resources.files(__name__).joinpath(f"{name}.yaml")))
