"""Placement backends (docs/design.md §3, cluster): cells as local processes or Ray actors
behind one handle interface; two Ray cells train a step exactly like one trainer; a
dead actor is seen at once, also while a call occupies it."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.test_training_cells import batches, cells_config, train_alone

from qwengyre.cluster.cell import CellSpec
from qwengyre.cluster.client import CellClient
from qwengyre.cluster.local import ActorDied, ActorError, ProcessActor
from qwengyre.cluster.net import free_port
from qwengyre.cluster.placement import start_cells, stop_cells
from qwengyre.cluster.weights import board_name


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
    spec = CellSpec(
        rank=0,
        shard=0,
        init_method="",
        model_dir=str(tiny_model_dir),
        board=_board(),
        config=cells_config(1),
    )
    handles = start_cells("local", [spec], run_dir=tmp_path)
    try:
        assert len(handles) == 1 and isinstance(handles[0].handle, ProcessActor)
        assert handles[0].name == "cell-0"
        assert asyncio.run(handles[0].connect()) == handles[0].handle.pid
    finally:
        stop_cells(handles)


async def ray_liveness(sleeper: Any) -> None:
    """A Ray actor's liveness is answered while a long call occupies it, and its death
    is seen at once."""
    import ray

    waiting = asyncio.ensure_future(sleeper.call("wait", 60))  # threading.Event.wait
    await asyncio.wait_for(sleeper.check_alive(), 30)  # not behind the 60 s call
    assert not waiting.done()
    ray.kill(sleeper.actor, no_restart=True)  # asynchronous: the actor dies soon after
    assert "sleeper died" in await death_seen(sleeper)
    with pytest.raises(ActorDied, match="sleeper died"):
        await waiting


async def death_seen(actor: Any, timeout_s: float = 30.0) -> str:
    """The ``ActorDied`` message ``check_alive`` gives once a killed actor is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await actor.check_alive()
        except ActorDied as exc:
            return str(exc)
        assert time.monotonic() < deadline, f"{actor.name} still looks alive"
        await asyncio.sleep(0.05)


def two_cells_train_a_step(
    tiny_model_dir: Path, tmp_path: Path, shards: int = 1, **placement: Any
) -> tuple[list[CellClient], list[int]]:
    """Two Ray cells (core and satellite) of ``shards`` ranks each train one step,
    exactly as one trainer does.

    Returns the cell handles, still running, and shard 0's process ids.
    """
    import ray

    from qwengyre.cluster.ray import RayActor, RayWeights

    data = batches(tiny_model_dir)[:1]
    (micro_steps, summary) = data[0]
    assert len(micro_steps) >= 2
    alone = train_alone(tiny_model_dir, data)
    address, board = f"tcp://127.0.0.1:{free_port()}", _board()
    specs = [
        CellSpec(
            rank=r,
            shard=s,
            init_method=address,
            model_dir=str(tiny_model_dir),
            board=board,
            config=cells_config(2, shards),
        )
        for r in (1, 0)
        for s in range(shards)
    ]
    handles = start_cells("ray", specs, run_dir=tmp_path, **placement)
    ranks = [rank for h in handles for rank in getattr(h.handle, "ranks", [h.handle])]

    async def train() -> tuple[list[int], list[dict[str, torch.Tensor]]]:
        # An error inside a Ray cell comes back as ActorError, and the cell keeps serving.
        with pytest.raises(ActorError, match=r"connect\(\) first"):
            await CellClient(ranks[-1]).join_training()
        pids = await asyncio.gather(*(h.connect() for h in handles))
        assert await handles[1].join_training() == 0
        for i, ms in enumerate(micro_steps):
            await handles[i % 2].train_micro_step(ms)
        results = await asyncio.gather(*(h.finish_batch(summary, 2) for h in handles))
        assert {r.version for r in results} == {1}
        return list(pids), [await h.parameters() for h in handles]

    try:
        assert [h.name for h in handles] == ["cell-0", "cell-1"]  # rank order
        assert all(isinstance(r, RayActor) for r in ranks) and len(ranks) == 2 * shards
        with pytest.raises(ActorError, match=r"connect\(\) first"):
            asyncio.run(CellClient(ranks[0]).join_training())
        pids, (core, satellite) = asyncio.run(train())
        # The weights boards are Ray's: a named actor per shard holds the newest
        # version's reference.
        for shard in range(shards):
            assert ray.get(ray.get_actor(board_name(board, shard)).get.remote())[0] == 1
        # A reader fetches the whole board, or only the tensors it names.
        reader = RayWeights(board_name(board, shards - 1))
        (version, whole), (_, some) = reader.read(), reader.read(["model.norm.weight"])
        assert version == 1 and len(whole) > 1 and list(some) == ["model.norm.weight"]
        assert torch.equal(some["model.norm.weight"], whole["model.norm.weight"])
        for name, expected in alone.items():
            torch.testing.assert_close(core[name], expected, rtol=0, atol=1e-5)
            torch.testing.assert_close(satellite[name], core[name], rtol=0, atol=0)
    except BaseException:
        stop_cells(handles)
        raise
    return handles, pids


def test_two_ray_cells_train_a_step_like_one_trainer(tiny_model_dir: Path, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install qwengyre[ray])")
    from qwengyre.cluster.ray import RayActor, core_address

    assert not ray.is_initialized()
    handles, pids = two_cells_train_a_step(tiny_model_dir, tmp_path)
    try:
        # Multi-node rendezvous helper: the core node's IP and a port free there.
        placement = handles[0].handle.cells.placement
        host, port = core_address(placement).removeprefix("tcp://").split(":")
        assert host == ray.util.get_node_ip_address() and 0 < int(port) < 65536
        asyncio.run(ray_liveness(RayActor(threading.Event, name="sleeper", num_cpus=0)))
    finally:
        stop_cells(handles)
    assert not ray.is_initialized()  # start_cells started Ray, stop_cells shut it down
    assert all(_gone(pid) for pid in pids)


def test_ray_cells_on_two_nodes_train_a_step_like_one_trainer(
    tiny_model_dir: Path, tmp_path: Path, two_ray_nodes: None
) -> None:
    """Two Ray nodes (each its own raylet and object store, on this one machine), two
    cells of two FSDP2 ranks: the ranks spread over both nodes, meet at the core node's
    address, and satellite ranks read their shards of the core's weights from the other
    node's object store."""
    import ray
    from ray.util.placement_group import placement_group_table

    handles, _ = two_cells_train_a_step(
        tiny_model_dir, tmp_path, shards=2, strategy="SPREAD", cpus_per_cell=0.5
    )
    try:
        table = placement_group_table(handles[0].handle.cells.placement)
        assert len(set(table["bundles_to_node_id"].values())) == 2
    finally:
        stop_cells(handles)
    assert ray.is_initialized()  # not started by start_cells: left running


def test_a_local_actor_that_dies_is_seen_at_once_even_during_a_call() -> None:
    sleeper = ProcessActor(threading.Event, name="sleeper")  # .wait(s) blocks for s

    async def watch() -> None:
        waiting = asyncio.ensure_future(sleeper.call("wait", 60))
        await asyncio.sleep(0.5)
        await sleeper.check_alive()
        assert not waiting.done()
        os.kill(sleeper.pid, signal.SIGKILL)  # type: ignore[arg-type]
        message = await death_seen(sleeper)
        assert f"sleeper (pid {sleeper.pid}) died (exit code -9)" in message
        with pytest.raises(ActorDied, match=rf"sleeper \(pid {sleeper.pid}\) died"):
            await waiting

    try:
        asyncio.run(watch())
    finally:
        sleeper.close()


def test_a_full_disk_in_a_ray_actor_reaches_the_caller_as_itself() -> None:
    pytest.importorskip("ray", reason="ray is not installed (pip install qwengyre[ray])")
    from ray.exceptions import RayTaskError

    from qwengyre.cluster.ray import _reraise
    from qwengyre.durable import DiskFullError

    full = DiskFullError("/run/checkpoints/step-000002: the disk is full")
    raised = _reraise("core", RayTaskError("save_checkpoint", "Traceback ...", full))
    assert type(raised) is DiskFullError and str(raised) == str(full)
    other = _reraise("core", RayTaskError("save_checkpoint", "Traceback ...", ValueError("x")))
    assert isinstance(other, ActorError)
