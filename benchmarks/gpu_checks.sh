#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (a lent device's `run`, or any GPU machine):
# the engine's CUDA tests (CUDA-graph decode steps keep exact log-probs), then the
# engine's benchmark against HF generate on a Qwen3-0.6B-shaped model in bf16.
# Uses the machine's own python3 with torch and transformers; logs go to $OUT. The parts
# are time-boxed (120 + 300 + 150 s) to fit one 10-minute call; the tables print as
# they go, so a part cut short still reports what it measured.
#
#   bash benchmarks/gpu_checks.sh          # the checks above (one 10-minute call)
#   bash benchmarks/gpu_checks.sh fsdp     # only the FSDP2 trainer section (~8 min)
#   bash benchmarks/gpu_checks.sh engines  # only the real server engines section (< 10 min)
#   bash benchmarks/gpu_checks.sh all      # all three (longer than one 10-minute call)
set -uo pipefail
section="${1:-default}"
case "$section" in
default | fsdp | engines | all) ;;
*) echo "usage: $0 [default|fsdp|engines|all]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu-checks}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
if [[ $section == default || $section == all ]]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_engine_embedded.py -k cuda 2>&1 | tee "$out/cuda-tests.log"
    timeout 300 python3 benchmarks/bench_engine.py --qwen3-0.6b --device cuda --dtype bfloat16 \
        --prompt 512 --new 256 --concurrency 1 8 32 128 --also-eager --repeat 2 2>&1 | tee "$out/bench-engine.log"
    # The trainer benchmark needs pydantic; a bare GPU image may lack it: install its wheels
    # there (pydantic, pydantic-core, annotated-types, typing-inspection for its Python).
    if python3 -c "import pydantic" 2>/dev/null; then
        timeout 150 python3 benchmarks/bench_trainer.py --qwen3-0.6b --device cuda --dtype bfloat16 \
            --tokens 131072 --micro-step-tokens 16384 --long-row 32768 2>&1 | tee "$out/bench-trainer.log"
    else
        echo "bench_trainer skipped: pydantic is not installed here" | tee "$out/bench-trainer.log"
    fi
fi

# ---------------------------------------------------------------------------------------
# The FSDP2-sharded Trainer in bf16 against plain HF + AdamW (autocast bf16) on
# Qwen3-0.6B- and 4B-shaped models built locally with random weights (no download):
# tokens/s at 8 x 2,048 tokens per step, the ratio, MFU (6N over 800 TFLOP/s), and whether
# one 32,768-token row fits through the Trainer (peak memory). Needs pydantic, as above.
# The script starts no new case after 420 s; the timeout is the hard stop.
if [[ $section == fsdp || $section == all ]]; then
    if python3 -c "import pydantic" 2>/dev/null; then
        timeout 480 python3 benchmarks/gpu_fsdp.py --device cuda 2>&1 | tee "$out/gpu-fsdp.log"
    else
        echo "gpu_fsdp skipped: pydantic is not installed here" | tee "$out/gpu-fsdp.log"
    fi
fi

# ---------------------------------------------------------------------------------------
# The real server engines (vLLM, SGLang) launched through qwengyre's own launch code on a
# Qwen3-0.6B-shaped model with random weights: time to healthy, log-probs against an HF
# bf16 forward, a weight update, release/resume with nvidia-smi's memory.used, and
# output tokens/s at 32 and 128 concurrent requests of 256 new tokens against the
# embedded engine and HF generate in the same run. An engine its python cannot import
# prints "vllm: not installed (pip install vllm)" (their wheels cannot be carried to a
# lent machine; $QWENGYRE_VLLM_PYTHON / $QWENGYRE_SGLANG_PYTHON name other environments).
# The script starts no server after 420 s; the timeout is the hard stop.
if [[ $section == engines || $section == all ]]; then
    OUT="$out" timeout 570 python3 benchmarks/gpu_engines.py --device cuda 2>&1 | tee "$out/gpu-engines.log"
fi
