"""Which device each process of a cell uses, and how a child process names it."""

from __future__ import annotations

import os

__all__ = ["physical_gpu", "rank_device", "require_device", "visible_gpus"]


def rank_device(device: str, index: int) -> str:
    """The device of process ``index`` (``cell * G + shard``) on its node: ``"cuda"``
    spreads the ranks over the visible GPUs, anything else (``"cpu"``, ``"cuda:1"``)
    is used as it is."""
    if device != "cuda":
        return device
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("run.device is 'cuda' but no CUDA device is visible")
    return f"cuda:{index % count}"


def require_device(device: str) -> None:
    """Raise ``ValueError`` unless this machine has ``device`` (``cpu``, ``cuda``,
    ``cuda:i``), naming what it has instead."""
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        have = f"{count} CUDA devices" if count else "no CUDA device"
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(
            f"run.device is {device!r} but this machine has {have} (torch {torch.__version__},"
            f" {build}): set run.device=cpu, or run where the GPUs are"
        )


def physical_gpu(device: str) -> str | None:
    """The GPU of ``device`` as ``CUDA_VISIBLE_DEVICES`` names it for a child process
    started with this process's environment (Ray narrows each actor's view to its own
    GPUs, so ``cuda:0`` there is whichever GPU Ray gave it); None off CUDA."""
    if not device.startswith("cuda"):
        return None
    index = int(device.partition(":")[2] or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def visible_gpus(device: str) -> tuple[str, ...]:
    """The GPUs a server launched for ``device`` spans: every visible one for
    ``"cuda"``, the one named by ``"cuda:i"``, none off CUDA."""
    if device != "cuda":
        gpu = physical_gpu(device)
        return (gpu,) if gpu is not None else ()
    import torch

    return tuple(str(physical_gpu(f"cuda:{i}")) for i in range(torch.cuda.device_count()))
