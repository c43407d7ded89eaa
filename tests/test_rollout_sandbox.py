"""Sandboxed harnesses (``harness.sandbox=bwrap``, :mod:`qwengyre.rollout.sandbox`): a real
harness under bubblewrap writes only to its workspace, home and TMPDIR, cannot see the
run directory or a hidden directory, lives in its own PID namespace (a tool it started
in a session of its own dies with it), and still reaches the proxy's variables; a
sandbox that cannot run is refused in one line before anything starts."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
import uuid
from pathlib import Path

import pytest
from tests.test_rollout_runner import _options

from qwengyre.apps.rollout import rollout
from qwengyre.cli import main
from qwengyre.records.trace import read_trace
from qwengyre.rollout import netns_relay
from qwengyre.rollout.harness import HarnessSpec, harness_spec, prepare_harness, supervise
from qwengyre.rollout.relay import SANDBOX_PORT, SANDBOX_SOCKET
from qwengyre.rollout.sandbox import Bubblewrap, NoSandbox, SandboxUnavailable, sandbox
from qwengyre.rollout.tasks import dump_tasks, example_tasks_path, load_tasks

BWRAP = shutil.which("bwrap")
needs_bwrap = pytest.mark.skipif(
    BWRAP is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)

# Each line of what it prints says what the harness could do; braces doubled: a template.
PROBE = """
try() {{ if sh -c "$2" 2>/dev/null; then echo "$1 yes"; else echo "$1 no"; fi; }}
try workspace 'echo a > in_ws.txt'
try home 'echo a > "$HOME_DIR/in_home.txt"'
try tmpdir 'echo a > "$TMPDIR/x"'
try elsewhere 'echo a > "$ELSEWHERE/x"'
try run_dir 'echo a > "$RUN_DIR/planted.txt"'
try secret 'cat "$RUN_DIR/secret.txt" > /dev/null'
try hidden 'cat "$HIDDEN/key" > /dev/null'
try hidden_file 'grep -q token "$TOKEN"'
try proxy_key 'test -n "$OPENAI_API_KEY"'
echo "pid $$"
"""


def probe(tmp_path: Path, spec: HarnessSpec) -> dict[str, str]:
    run_dir, hidden, elsewhere = tmp_path / "run", tmp_path / "creds", tmp_path / "elsewhere"
    workspace, logs = run_dir / "workspaces" / "ex_1", run_dir / "logs" / "ex_1"
    for path in (workspace, hidden, elsewhere):
        path.mkdir(parents=True)
    (run_dir / "secret.txt").write_text("admin token")
    (hidden / "key").write_text("ssh key")
    (tmp_path / "token").write_text("token")
    env = {"RUN_DIR": str(run_dir), "HIDDEN": str(hidden), "ELSEWHERE": str(elsewhere)}
    env["TOKEN"] = str(tmp_path / "token")
    env["HOME_DIR"] = "{home_dir}"  # the execution's own home (under its logs)
    spec = HarnessSpec(command=("sh", "-c", PROBE), deadline_s=30, env=env, sandbox=spec.sandbox)
    run = asyncio.run(
        supervise(
            prepare_harness(
                spec,
                workspace=workspace,
                logs_dir=logs,
                execution_id="ex_1",
                base_url="http://127.0.0.1:9/x/ex_1",
                api_key="k",
                instructions="probe",
                hidden=(run_dir,),
            )
        )
    )
    assert run.ok, (logs / "stderr.log").read_text()
    assert (run_dir / "secret.txt").read_text() == "admin token"  # hidden, not removed
    lines = (logs / "stdout.log").read_text().split("\n")
    return dict(line.split(" ", 1) for line in lines if line)


@needs_bwrap
def test_a_sandboxed_harness_writes_only_its_workspace_and_home_and_sees_no_run_dir(
    tmp_path: Path,
) -> None:
    hide = (tmp_path / "creds", tmp_path / "token")
    confined = HarnessSpec(command=("true",), deadline_s=1, sandbox=Bubblewrap(hide))
    seen = probe(tmp_path, confined)
    assert seen == {
        "workspace": "yes",
        "home": "yes",
        "tmpdir": "yes",
        "elsewhere": "no",  # the machine's files are read-only
        "run_dir": "no",
        "secret": "no",
        "hidden": "no",
        "hidden_file": "no",
        "proxy_key": "yes",
        "pid": "3",  # bwrap's init is 1, the proxy relay 2: a namespace of its own
    }
    run_dir = tmp_path / "run"
    assert not (run_dir / "planted.txt").exists()
    assert (run_dir / "workspaces" / "ex_1" / "in_ws.txt").exists()


def test_without_a_sandbox_the_same_harness_reaches_everything(tmp_path: Path) -> None:
    seen = probe(tmp_path, HarnessSpec(command=("true",), deadline_s=1))
    reached = ("elsewhere", "run_dir", "secret", "hidden", "hidden_file")
    assert {k: seen[k] for k in reached} == dict.fromkeys(reached, "yes")


@needs_bwrap
def test_a_tool_that_leaves_the_session_dies_with_the_sandbox(tmp_path: Path) -> None:
    marker = f"{uuid.uuid4().int % 10**6 + 10**6}.5"  # a sleep nobody else runs
    escape = f"setsid sleep {marker} & echo started > started; sleep 60"
    spec = HarnessSpec(
        command=("sh", "-c", escape), deadline_s=60, kill_grace_s=0.5, sandbox=Bubblewrap()
    )
    workspace = tmp_path / "ws"
    workspace.mkdir()

    def sleepers() -> list[Path]:
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if marker in proc.joinpath("cmdline").read_text():
                    found.append(proc)
            except OSError:
                continue
        return found

    async def scenario() -> list[Path]:
        cancel = asyncio.Event()
        job = asyncio.ensure_future(
            supervise(
                prepare_harness(
                    spec,
                    workspace=workspace,
                    logs_dir=tmp_path / "logs",
                    execution_id="ex_2",
                    base_url="http://127.0.0.1:9/x/ex_2",
                    api_key="k",
                    instructions="escape",
                ),
                cancel,
            )
        )
        while not (workspace / "started").exists():
            await asyncio.sleep(0.02)
        escaped = sleepers()
        cancel.set()
        assert (await job).cancelled
        return escaped

    assert asyncio.run(scenario())  # it ran, outside the harness's process group
    deadline = time.monotonic() + 5
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sleepers()


@needs_bwrap
def test_a_rollout_of_sandboxed_toy_harnesses_reaches_the_proxy_and_is_graded(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(tasks, load_tasks(example_tasks_path())[:1])
    options = _options(tmp_path, tiny_model_dir, tasks, "harness.sandbox=bwrap")
    rows = asyncio.run(rollout(options))
    assert [outcome for _, _, outcome, _ in rows] == ["completed", "completed"]
    assert all(reward is not None for *_, reward in rows)
    traces = read_trace(options.run_dir / "traces.jsonl")
    assert len(traces) == 2 and all(t.calls for t in traces)  # through the proxy relay


def test_the_config_names_the_sandbox_and_bad_settings_are_refused(tmp_path: Path) -> None:
    assert sandbox("none") == NoSandbox()
    assert sandbox("bwrap", [tmp_path]) == Bubblewrap((tmp_path,))
    assert sandbox("bwrap", [Path("~")]) == Bubblewrap((Path.home(),))
    with pytest.raises(ValueError, match=f"no such file or directory: {tmp_path / 'x'}"):
        sandbox("bwrap", [tmp_path / "x"])
    with pytest.raises(ValueError, match=r"sandbox_expose need a sandbox"):
        sandbox("none", [tmp_path])
    assert harness_spec("toy", 10, Bubblewrap()).sandbox == Bubblewrap()
    assert harness_spec("toy", 10).sandbox == NoSandbox()
    with pytest.raises(SandboxUnavailable, match="no 'no-such-bwrap' on PATH"):
        Bubblewrap(binary="no-such-bwrap").check()
    with pytest.raises(ValueError, match="unknown sandbox 'docker'; allowed: auto, none, bwrap"):
        sandbox("docker")  # type: ignore[arg-type]


@needs_bwrap
def test_auto_is_bubblewrap_where_it_runs_and_else_none_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warnings: list[str] = []
    assert sandbox("auto", [tmp_path], [tmp_path], warn=warnings.append) == Bubblewrap(
        (tmp_path,), (tmp_path,)
    )
    assert warnings == []
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap here
    assert sandbox("auto", [tmp_path], warn=warnings.append) == NoSandbox()
    assert len(warnings) == 1
    assert warnings[0].startswith("harness.sandbox=auto: no 'bwrap' on PATH")
    for says in ("runs unconfined", "apt-get install bubblewrap", "harness.sandbox=none"):
        assert says in warnings[0]


def test_rollout_with_an_unavailable_sandbox_stops_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap here
    args = ["rollout", "--run-dir", str(tmp_path / "run"), "harness.sandbox=bwrap"]
    assert main([*args, "model.path=" + str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qwengyre: error: harness.sandbox=bwrap: no 'bwrap' on PATH"), err
    assert not (tmp_path / "run").exists()  # refused before anything was made


@needs_bwrap
def test_wrapping_keeps_the_command_and_names_every_confinement(tmp_path: Path) -> None:
    ws, home, sock = tmp_path / "ws", tmp_path / "home", tmp_path / "relay.sock"
    tools = tmp_path / "tools"
    tools.mkdir()
    confined = Bubblewrap(expose=(tools,))
    bare = confined.wrap(["claude", "-p", "hi"], workspace=ws, home=home, hidden=[tmp_path])
    assert bare[0] == "bwrap" and bare[-4:] == ["--", "claude", "-p", "hi"]
    joined = " ".join(bare)
    for flag in ("--unshare-user", "--cap-drop ALL", "--disable-userns", "--unshare-net"):
        assert flag in joined
    for hidden in (tmp_path, Path.home(), Path("/root"), Path("/run")):
        assert f"--tmpfs {hidden} " in joined
    assert "--tmpfs /tmp " in joined and "--remount-ro /tmp " not in joined  # private
    # hidden, then shown again inside it, then the writable binds
    assert joined.index(f"--tmpfs {tmp_path} ") < joined.index(f"--ro-bind {tools} {tools}")
    assert joined.index(f"--tmpfs {tmp_path} ") < joined.index(f"--bind {ws} {ws}")
    assert f"--bind {home} {home}" in joined and f"--chdir {ws}" in joined
    relayed = confined.wrap(["claude"], workspace=ws, home=home, hidden=[], proxy_socket=sock)
    assert f"--bind {sock} {SANDBOX_SOCKET}" in " ".join(relayed)
    relay = relayed[relayed.index("--") + 1 :]
    assert relay[:4] == [sys.executable, "-I", "-S", netns_relay.__file__]
    assert relay[4:] == [
        "--listen",
        f"127.0.0.1:{SANDBOX_PORT}",
        "--to",
        str(SANDBOX_SOCKET),
        "--",
        "claude",
    ]
    assert json.dumps(NoSandbox().wrap(["a"], workspace=ws, home=home, hidden=[])) == '["a"]'
