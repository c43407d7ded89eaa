"""Kernel limits on a harness (:mod:`qwengyre.rollout.limits`): a cgroup of its own bounds
its processes and memory where one can be made (and takes whatever it left behind when it
ends), rlimits do otherwise, and a limit nothing here can enforce is said to be so."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qwengyre.rollout import limits as limits_module
from qwengyre.rollout.harness import (
    HarnessRun,
    HarnessSpec,
    kill_orphaned_harness,
    prepare_harness,
    supervise,
)
from qwengyre.rollout.limits import CGROUP_ROOT, Limits, enforce

needs_cgroups = pytest.mark.skipif(
    not os.access(CGROUP_ROOT / "pids", os.W_OK) or not os.access(CGROUP_ROOT, os.R_OK),
    reason="no writable cgroup v1 pids hierarchy here (the rlimit fallback is tested below)",
)


def _run(tmp_path: Path, code: str, limits: Limits, execution_id: str = "ex_lim") -> HarnessRun:
    spec = HarnessSpec(command=(sys.executable, "-c", code), deadline_s=60, limits=limits)
    return asyncio.run(
        supervise(
            prepare_harness(
                spec,
                workspace=tmp_path,
                logs_dir=tmp_path / "logs",
                execution_id=execution_id,
                base_url="http://127.0.0.1:9/x/ex_lim",
                api_key="k",
                instructions="limits",
            )
        )
    )


# forks as many children as it can (up to 200), then says how many and in which cgroups
FORKS = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import hostile_harness;"
    " print(hostile_harness.forks(200), open('/proc/self/cgroup').read().replace(chr(10), ';'))"
)


@needs_cgroups
def test_a_fork_bomb_stops_at_the_cgroups_process_limit_and_nothing_outlives_it(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path, FORKS, Limits(processes=16), "ex_forks")
    assert run.exit_code == 0, run.stderr_path.read_text() if run.stderr_path else ""
    made, cgroups = (tmp_path / "logs" / "stdout.log").read_text().split(" ", 1)
    assert 0 < int(made) < 16  # the harness itself counts
    assert "pids:" in cgroups and "qwengyre-ex_forks" in cgroups
    # its children (sleeping 30 s) died with it, and its cgroup is gone
    assert not list(CGROUP_ROOT.glob("pids/**/qwengyre-ex_forks"))


OPEN_FILES = """
import os
handles = []
try:
    for _ in range(500):
        handles.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print(len(handles))
"""


def test_open_files_stop_at_the_limit(tmp_path: Path) -> None:
    run = _run(tmp_path, OPEN_FILES, Limits(open_files=64))
    assert run.exit_code == 0
    assert int((tmp_path / "logs" / "stdout.log").read_text()) < 64


def test_without_cgroups_memory_falls_back_to_an_address_space_rlimit(tmp_path: Path) -> None:
    limits = Limits(processes=50, memory_mb=300, open_files=64, cpu_s=7)
    none_here = tmp_path / "no-cgroups"
    unshared = enforce("ex_1", limits, user_namespace=False, cgroup_root=none_here)
    assert unshared.cgroups == []
    assert (resource.RLIMIT_AS, 300 * 2**20) in unshared.rlimits
    assert (resource.RLIMIT_CPU, 7) in unshared.rlimits
    assert resource.RLIMIT_NOFILE in dict(unshared.rlimits)
    # outside a user namespace RLIMIT_NPROC would count qwengyre's own threads
    assert resource.RLIMIT_NPROC not in dict(unshared.rlimits)
    assert unshared.unbound == ["processes"]


def test_in_a_user_namespace_processes_fall_back_to_rlimit_nproc_unless_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    none_here = tmp_path / "no-cgroups"
    monkeypatch.setattr(limits_module.os, "geteuid", lambda: 1000)
    user = enforce("ex_1", Limits(processes=50), user_namespace=True, cgroup_root=none_here)
    assert user.rlimits == [(resource.RLIMIT_NPROC, 50)] and user.unbound == []
    # measured: RLIMIT_NPROC does not bind uid 0, not even in bubblewrap's user namespace
    monkeypatch.setattr(limits_module.os, "geteuid", lambda: 0)
    root = enforce("ex_1", Limits(processes=50), user_namespace=True, cgroup_root=none_here)
    assert root.rlimits == [] and root.unbound == ["processes"]


@needs_cgroups
def test_a_resumed_run_kills_what_a_dead_runners_harness_left_in_its_cgroup(
    tmp_path: Path,
) -> None:
    left = enforce("ex_orphan", Limits(processes=16), user_namespace=False)
    assert left.cgroups
    # a harness tool in a session of its own, its runner gone: no group to kill
    orphan = subprocess.Popen(["sleep", "600"], preexec_fn=left.preexec(), start_new_session=True)
    assert not kill_orphaned_harness(tmp_path, "ex_orphan")  # no process group recorded
    assert orphan.wait() == -signal.SIGKILL
    assert not any(cgroup.exists() for cgroup in left.cgroups)
