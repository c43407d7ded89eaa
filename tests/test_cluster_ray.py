"""Placement backends (DESIGN.md §3, cluster): cells as local processes or Ray actors
behind one handle interface; two Ray cells train a step exactly like one trainer."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest
import torch
from tests.test_training_cells import CONFIG, batches, free_port, train_alone

from qwengyre.cluster.cell import CellSpec
from qwengyre.cluster.local import ActorError, ProcessActor
from qwengyre.cluster.placement import start_cells, stop_cells


def _board() -> str:
    return f"qg-test-{uuid.uuid4().hex[:12]}"


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_local_backend_returns_process_actors(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = CellSpec(0, 1, "", str(tiny_model_dir), CONFIG, _board())
    handles = start_cells("local", [spec], run_dir=tmp_path)
    try:
        assert len(handles) == 1 and isinstance(handles[0], ProcessActor)
        assert handles[0].name == "cell-0"
        assert handles[0].call_sync("connect") == handles[0].pid
    finally:
        stop_cells(handles)


def test_two_ray_cells_train_a_step_like_one_trainer(tiny_model_dir: Path, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install qwengyre[ray])")
    from qwengyre.cluster.ray import RayActor, core_address

    assert not ray.is_initialized()
    data = batches(tiny_model_dir)[:1]
    (micro_steps, summary) = data[0]
    assert len(micro_steps) >= 2
    alone = train_alone(tiny_model_dir, data)
    address, board = f"tcp://127.0.0.1:{free_port()}", _board()
    specs = [CellSpec(r, 2, address, str(tiny_model_dir), CONFIG, board) for r in (1, 0)]
    handles = start_cells("ray", specs, run_dir=tmp_path)

    async def train() -> tuple[list[int], list[dict[str, torch.Tensor]]]:
        # An error inside a Ray cell comes back as ActorError, and the cell keeps serving.
        with pytest.raises(ActorError, match=r"connect\(\) first"):
            await handles[1].call("join_training")
        pids = await asyncio.gather(*(h.call("connect") for h in handles))
        assert await handles[1].call("join_training") == 0
        for i, ms in enumerate(micro_steps):
            await handles[i % 2].call("train_micro_step", ms)
        results = await asyncio.gather(*(h.call("finish_batch", summary, 2) for h in handles))
        assert {r.version for r in results} == {1}
        return list(pids), [await h.call("parameters") for h in handles]

    try:
        assert [h.name for h in handles] == ["cell-0", "cell-1"]  # rank order
        group = handles[0].cells if isinstance(handles[0], RayActor) else None
        assert group is not None and all(isinstance(h, RayActor) for h in handles)
        with pytest.raises(ActorError, match=r"connect\(\) first"):
            handles[0].call_sync("join_training")
        pids, (core, satellite) = asyncio.run(train())
        # Multi-node rendezvous helper: the core node's IP and a port free there.
        host, port = core_address(group.placement).removeprefix("tcp://").split(":")
        assert host == ray.util.get_node_ip_address() and 0 < int(port) < 65536
    finally:
        stop_cells(handles)
    assert not ray.is_initialized()  # start_cells started Ray, stop_cells shut it down
    assert all(_gone(pid) for pid in pids)
    for name, expected in alone.items():
        torch.testing.assert_close(core[name], expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(satellite[name], core[name], rtol=0, atol=0)
