"""Local placement's actor processes: named, so that they can be told apart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qwengyre.cluster.local import ProcessActor, actor_processes

pytestmark = pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="needs /proc")


class Pid:
    def pid(self) -> int:
        return os.getpid()


def test_an_actor_process_goes_by_its_name_not_its_pid_order() -> None:
    """``ps`` shows each actor's name, and :func:`actor_processes` finds each by it
    (pids wrap around: spawn order is not pid order)."""
    actors = {name: ProcessActor(Pid, name=name) for name in ("cell-2", "standalone", "cell-0")}
    try:
        pids = {name: actor.call_sync("pid") for name, actor in actors.items()}
        assert actor_processes(os.getpid()) == pids
        assert Path(f"/proc/{pids['standalone']}/comm").read_text() == "standalone\n"
    finally:
        for actor in actors.values():
            actor.close()
    assert actor_processes(os.getpid()) == {}


def test_a_long_name_keeps_its_first_15_bytes() -> None:
    actor = ProcessActor(Pid, name="cell-12.3-with-a-long-suffix")
    try:
        pid = actor.call_sync("pid")
        assert actor_processes(os.getpid()) == {"cell-12.3-with-": pid}
    finally:
        actor.close()
