"""The harness daemon (qwengyre.rollout.harnessd): harnesses that outlive their client."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tests.test_runtime_train import running as alive

from qwengyre.rollout.harness import HarnessLaunch
from qwengyre.rollout.harnessd import DAEMON_DIR, HarnessDaemon, HarnessDaemonError, daemon_pid

SRC = str(Path(__file__).resolve().parents[1] / "src")


def launch(root: Path, execution_id: str, script: str, deadline_s: float = 60) -> HarnessLaunch:
    workspace = root / "workspaces" / execution_id
    workspace.mkdir(parents=True, exist_ok=True)
    return HarnessLaunch(
        execution_id=execution_id,
        argv=(sys.executable, "-c", script),
        env={"PATH": os.environ["PATH"], "QWENGYRE_EXECUTION_ID": execution_id},
        workspace=workspace,
        logs_dir=root / "logs" / execution_id,
        deadline_s=deadline_s,
        kill_grace_s=1,
    )


def prepared(item: HarnessLaunch) -> HarnessLaunch:
    item.logs_dir.mkdir(parents=True, exist_ok=True)
    return item


@pytest.fixture
def daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    client = HarnessDaemon(tmp_path, idle_exit_s=30)
    yield client
    asyncio.run(client.shutdown())


def test_runs_a_harness_and_reports_its_exit_status(daemon: HarnessDaemon, tmp_path: Path):
    item = prepared(launch(tmp_path, "ex_a", "print('hi'); raise SystemExit(3)"))
    run = asyncio.run(daemon.run(item, None))
    assert run.exit_code == 3 and run.spawned and not run.cancelled and not run.timed_out
    assert (item.logs_dir / "stdout.log").read_text() == "hi\n"
    # The state on disk names the harness, never its environment (the key lives there).
    state = json.loads((tmp_path / DAEMON_DIR / "state" / "ex_a.json").read_text())
    assert state["exit_code"] == 3 and state["pid"] > 0 and "env" not in json.dumps(state)
    assert oct((tmp_path / DAEMON_DIR / "token").stat().st_mode & 0o777) == "0o600"


def test_kill_stops_the_harness_and_deadline_times_it_out(daemon: HarnessDaemon, tmp_path: Path):
    async def go() -> None:
        cancel = asyncio.Event()
        item = prepared(launch(tmp_path, "ex_k", "import time; time.sleep(600)"))
        running = asyncio.ensure_future(daemon.run(item, cancel))
        while not (item.logs_dir / "harness.pgid").exists():
            await asyncio.sleep(0.05)
        pid = int((item.logs_dir / "harness.pgid").read_text())
        cancel.set()
        run = await running
        assert run.cancelled and not alive(pid)
        slow = prepared(launch(tmp_path, "ex_t", "import time; time.sleep(600)", deadline_s=0.5))
        assert (await daemon.run(slow, None)).timed_out

    asyncio.run(go())


CLIENT = """
import asyncio, sys
sys.path.insert(0, {src!r})
from pathlib import Path
from qwengyre.rollout.harness import HarnessLaunch
from qwengyre.rollout.harnessd import HarnessDaemon
launch = HarnessLaunch.from_json({launch!r})
asyncio.run(HarnessDaemon(Path({root!r}), idle_exit_s=30).run(launch, None))
"""


def test_a_harness_outlives_its_client_and_is_reattached_once(
    daemon: HarnessDaemon, tmp_path: Path
):
    """The client process is SIGKILLed (with its process group) while its harness runs:
    the harness goes on, another client attaches to it and gets its exit status, and
    starting it again starts nothing."""
    flag = tmp_path / "go"
    script = textwrap.dedent(
        f"""
        import pathlib, time
        with open("starts", "a") as f: f.write("x")
        while not pathlib.Path({str(flag)!r}).exists(): time.sleep(0.05)
        raise SystemExit(7)
        """
    )
    item = prepared(launch(tmp_path, "ex_r", script))
    code = CLIENT.format(src=SRC, launch=item.to_json(), root=str(tmp_path))
    client = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    pgid_file = item.logs_dir / "harness.pgid"
    while not pgid_file.exists():
        assert client.poll() is None
        time.sleep(0.05)
    pid = int(pgid_file.read_text())
    os.killpg(client.pid, signal.SIGKILL)
    client.wait()
    assert alive(pid)

    async def go() -> None:
        states = {s.execution_id: s for s in await daemon.states()}
        assert states["ex_r"].running and states["ex_r"].pid == pid
        again = await daemon.request("start", launch=item.to_json())  # not started twice
        assert again["state"]["pid"] == pid
        waiting = asyncio.ensure_future(daemon.attach("ex_r", None))
        flag.touch()
        run = await waiting
        assert run.exit_code == 7

    asyncio.run(go())
    assert (item.workspace / "starts").read_text() == "x"


def test_a_wrong_token_is_refused(daemon: HarnessDaemon, tmp_path: Path):
    async def go() -> None:
        await daemon.states()  # the daemon runs
        reader, writer = await asyncio.open_unix_connection(tmp_path / DAEMON_DIR / "sock")
        writer.write(json.dumps({"token": "wrong", "op": "list"}).encode() + b"\n")
        answer = json.loads(await reader.readline())
        writer.close()
        assert answer == {"error": "authentication failed"}
        token = tmp_path / DAEMON_DIR / "token"
        real = token.read_text()
        token.write_text("forged")
        with pytest.raises(HarnessDaemonError, match="authentication failed"):
            await daemon.states()
        token.write_text(real)

    asyncio.run(go())


def test_a_new_daemon_marks_what_a_dead_one_ran_lost(daemon: HarnessDaemon, tmp_path: Path):
    item = prepared(launch(tmp_path, "ex_l", "import time; time.sleep(600)"))

    async def go() -> None:
        await daemon.request("start", launch=item.to_json())
        pid = int((item.logs_dir / "harness.pgid").read_text())
        killed = daemon_pid(tmp_path)
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        while daemon_pid(tmp_path) == killed:  # its lock goes with it
            await asyncio.sleep(0.01)
        run = await daemon.attach("ex_l", None)  # a new daemon answers
        assert daemon_pid(tmp_path) not in (None, killed)
        assert run.error is not None and "daemon stopped" in run.error
        assert not alive(pid)

    asyncio.run(go())


def test_clients_that_start_the_daemon_at_once_are_all_answered(tmp_path: Path):
    """Hosts of one machine share a directory: several clients finding no daemon start
    one each at the same moment. One serves; the others wait for it (they used to give
    up before it bound its socket, and their client found none)."""
    clients = [HarnessDaemon(tmp_path, idle_exit_s=30) for _ in range(4)]

    async def all_at_once() -> list[int]:
        return [len(s) for s in await asyncio.gather(*(c.states() for c in clients))]

    try:
        assert asyncio.run(all_at_once()) == [0] * len(clients)
    finally:
        asyncio.run(clients[0].shutdown())


def test_a_daemon_started_while_another_stops_waits_for_its_lock(tmp_path: Path):
    """A daemon that is stopping (idle) has removed its socket but still holds the
    directory's lock: a client finding no socket starts a new daemon, which waits for
    the lock rather than leaving the client with no socket to reach."""
    directory = tmp_path / DAEMON_DIR
    directory.mkdir(mode=0o700)
    lock = directory / "lock"
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # the stopping daemon's
    client = HarnessDaemon(tmp_path, idle_exit_s=30)

    def waiting_for_it() -> bool:
        """A process other than this one has the lock file open: the new daemon."""
        for fd in Path("/proc").glob("[0-9]*/fd/*"):
            with contextlib.suppress(OSError):
                if fd.parts[2] != str(os.getpid()) and fd.resolve() == lock.resolve():
                    return True
        return False

    async def scenario() -> list[object]:
        asking = asyncio.ensure_future(client.states())
        deadline = time.monotonic() + 30
        while not asking.done() and not waiting_for_it():
            assert time.monotonic() < deadline, "no daemon was started"
            await asyncio.sleep(0.05)
        assert not asking.done(), asking  # it gave up while the lock was held
        fcntl.flock(held, fcntl.LOCK_UN)  # the stopping daemon exits
        os.close(held)
        return list(await asking)

    try:
        assert asyncio.run(scenario()) == []
    finally:
        asyncio.run(client.shutdown())
