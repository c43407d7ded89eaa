"""Local placement's actor processes: named, so that they can be told apart; forked
from a fork server that imported what a cell needs, with the caller's environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from qwengyre.cluster.local import ProcessActor, actor_processes

pytestmark = pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="needs /proc")


class Pid:
    def pid(self) -> int:
        return os.getpid()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def imported(self, module: str) -> bool:
        return module in sys.modules


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


def test_an_actor_has_the_callers_environment_as_it_starts_and_what_a_cell_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fork server started with the first actor; a later one still sees the
    environment its caller has when it starts it (a server it launches inherits it),
    not the fork server's. Both come with torch and the cell's modules imported."""
    first = ProcessActor(Pid, name="first")
    try:
        assert first.call_sync("env", "QWENGYRE_LOCAL_TEST") is None
        monkeypatch.setenv("QWENGYRE_LOCAL_TEST", "later")
        monkeypatch.delenv("HOME", raising=False)
        second = ProcessActor(Pid, name="second")
        try:
            assert second.call_sync("env", "QWENGYRE_LOCAL_TEST") == "later"
            assert second.call_sync("env", "HOME") is None
            assert first.call_sync("env", "QWENGYRE_LOCAL_TEST") is None  # its own, kept
            assert second.call_sync("imported", "torch")
            assert second.call_sync("imported", "qwengyre.cluster.cell")
        finally:
            second.close()
    finally:
        first.close()
