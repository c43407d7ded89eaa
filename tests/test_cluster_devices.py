"""Which GPUs a cell's engine server is given (tensor parallel over the cell's devices)."""

from __future__ import annotations

import pytest

from qwengyre.cluster.devices import physical_gpu, rank_device, visible_gpus


def test_physical_gpu_reads_through_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert physical_gpu("cuda:1") == "1" and physical_gpu("cuda") == "0"
    # A Ray actor given GPUs 6 and 3 sees them as cuda:0 and cuda:1; a server it
    # starts must be told 6 and 3.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6, 3")
    assert physical_gpu("cuda:0") == "6" and physical_gpu("cuda:1") == "3"
    assert physical_gpu("cpu") is None and visible_gpus("cpu") == ()
    assert visible_gpus("cuda:1") == ("3",)


def test_rank_device_spreads_ranks_only_for_plain_cuda() -> None:
    assert rank_device("cpu", 5) == "cpu" and rank_device("cuda:1", 5) == "cuda:1"
