"""Publication and role-switch cost per rollout backend, measured in one run.

For each backend available here (the embedded engine always; vLLM when
``$QWENGYRE_VLLM_PYTHON`` names a vLLM venv; SGLang only where it runs, on GPUs), one
rollout host serves the model, and the core publishes new weights through a weights
board ``--publications`` times: each publication is timed from the board's write to the
server serving the new version (``load_newest``). Then one role switch (``release`` +
``resume``) is timed, with what the host did to free memory. Times are medians; the
last column is the ratio to the embedded engine measured in the same run.

    python benchmarks/bench_publication.py [--size demo] [--publications 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from _smoke import parse
from qwengyre.cluster.engine_host import rollout_host
from qwengyre.cluster.weights import (
    BoardShards,
    SharedWeights,
    board_name,
    model_parameters,
    shard_layout,
)
from qwengyre.models import cached_tiny_model


def measure(backend: str, model: Path, publications: int) -> tuple[float, float, str]:
    """(median publication seconds, switch seconds, how the switch freed memory)."""
    named = model_parameters(model)
    base = f"qg-bench-{uuid.uuid4().hex[:12]}"
    board = SharedWeights(board_name(base, 0), shard_layout(named, 1, 0), create=True)
    boards = BoardShards("shared_memory", base, named, 1, opened={0: board})
    names = {name for name, _ in named}
    weights = {k: v.detach().clone() for k, v in _model_state(model).items() if k in names}
    host = rollout_host(
        backend,  # type: ignore[arg-type]
        str(model),
        name=backend,
        capacity=4,
        device="cpu",
        max_context=512,
        seed=0,
        host="127.0.0.1",
    )
    try:
        board.write(weights.items(), 0)
        host.start()
        host.load_newest(boards)
        times = []
        for version in range(1, publications + 1):
            for tensor in weights.values():
                tensor.add_(1e-3 * torch.randn_like(tensor))
            start = time.perf_counter()
            board.write(weights.items(), version)
            assert host.load_newest(boards) == version
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        how = host.release()
        host.resume(boards)
        return statistics.median(times), time.perf_counter() - start, how
    finally:
        host.close()
        boards.close()
        board.close()


def _model_state(model: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="demo", help="tiny model size (vLLM needs demo+)")
    parser.add_argument("--publications", type=int, default=5)
    args = parse(parser, size="test", publications=1)
    torch.set_num_threads(1)
    model = cached_tiny_model(args.size, cache_dir=Path(tempfile.gettempdir()) / "qg-bench")
    backends = ["embedded"]
    if os.environ.get("QWENGYRE_VLLM_PYTHON"):
        backends.append("vllm")
    else:
        print("vllm: skipped ($QWENGYRE_VLLM_PYTHON is not set: scripts/vllm_venv.sh)")
    print("sglang: skipped (SGLang needs CUDA; see benchmarks/gpu_checks.sh engines)")
    rows = {b: measure(b, model, args.publications) for b in backends}
    embedded = rows["embedded"][0]
    print(
        f"{'backend':10} {'publication s':>14} {'switch s':>9}  {'freed by':10} {'vs embedded':>11}"
    )
    for backend, (publish, switch, how) in rows.items():
        print(f"{backend:10} {publish:14.3f} {switch:9.2f}  {how:10} {publish / embedded:10.1f}x")


if __name__ == "__main__":
    main()
