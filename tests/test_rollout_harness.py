"""The harness launcher: subprocess harnesses and Python harnesses under deadline/cancel."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from qwengyre.rollout.harness import (
    PLACEHOLDERS,
    HarnessRun,
    HarnessSpec,
    claude_code_spec,
    mini_swe_agent_spec,
    prepare_harness,
    render_command,
    supervise,
)
from qwengyre.rollout.limits import Limits

try:
    import resource
except ImportError:  # pragma: no cover - non-POSIX
    resource = None  # type: ignore[assignment]

PY = sys.executable
BASE_URL = "http://127.0.0.1:8123/x/ex_1"
KEY = "sk-test-key"


def _run(spec: HarnessSpec, tmp_path: Path, **kw: object) -> HarnessRun:
    workspace = tmp_path / "ws"
    workspace.mkdir(parents=True, exist_ok=True)
    args: dict = {
        "workspace": workspace,
        "logs_dir": tmp_path / "logs",
        "execution_id": "ex_1",
        "base_url": BASE_URL,
        "api_key": KEY,
        "instructions": "write {hello} to out.txt",
    }
    args.update(kw)
    return asyncio.run(supervise(prepare_harness(spec, **args)))


def _is_gone(pid: int, within_s: float = 60.0) -> bool:
    """True once ``pid`` no longer exists (a zombie awaiting an init that never reaps it
    counts as dead: it runs nothing); it returns as soon as it is, so the bound is generous
    for a loaded machine."""
    end = time.monotonic() + within_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                return True
        except (OSError, IndexError):
            pass
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


def _wait_for_file(path: Path, within_s: float = 5.0) -> str:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} never written")


WRITER = """
import json, os, sys
open("out.txt", "w").write(sys.argv[1])
names = ["ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_KEY",
         "QWENGYRE_EXECUTION_ID", "EXTRA", "HOME", "SECRET_FROM_PARENT"]
seen = dict((n, os.environ.get(n)) for n in names)
seen["cwd"] = os.getcwd()
seen["own_session"] = os.getsid(0) == os.getpid()
json.dump(seen, open("env.json", "w"))
print("hello stdout")
"""  # no braces: the script is itself a command template


def test_harness_writes_in_workspace_and_sees_proxy_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SECRET_FROM_PARENT", "leak")
    spec = HarnessSpec(
        command=(PY, "-c", WRITER, "{instructions}|{execution_id}"),
        env={"EXTRA": "x-{execution_id}"},
        deadline_s=20,
    )
    run = _run(spec, tmp_path)
    assert run.exit_code == 0, run.stderr_path.read_text()
    assert not run.timed_out and not run.cancelled and run.ok
    assert run.ended_s >= run.started_s
    ws = tmp_path / "ws"
    assert (ws / "out.txt").read_text() == "write {hello} to out.txt|ex_1"
    env = json.loads((ws / "env.json").read_text())
    assert env["ANTHROPIC_BASE_URL"] == BASE_URL
    assert env["OPENAI_BASE_URL"] == BASE_URL + "/v1"
    assert env["ANTHROPIC_API_KEY"] == KEY and env["OPENAI_API_KEY"] == KEY
    assert env["QWENGYRE_EXECUTION_ID"] == "ex_1"
    assert env["EXTRA"] == "x-ex_1"
    assert env["HOME"] == os.environ["HOME"]  # inherited since the spec does not set it
    assert env["SECRET_FROM_PARENT"] is None  # minimal environment, not the whole parent's
    assert Path(env["cwd"]).resolve() == ws.resolve()
    assert env["own_session"] is True  # its own session and process group
    assert run.stdout_path == tmp_path / "logs" / "stdout.log"
    assert run.stdout_path.read_text() == "hello stdout\n"


def test_spec_env_overrides_home_but_not_proxy_vars(tmp_path):
    spec = HarnessSpec(
        command=(PY, "-c", WRITER, "x"),
        env={"HOME": "{home_dir}", "OPENAI_BASE_URL": "http://elsewhere"},
        deadline_s=20,
    )
    run = _run(spec, tmp_path)
    assert run.exit_code == 0
    env = json.loads((tmp_path / "ws" / "env.json").read_text())
    assert env["HOME"] == str(tmp_path / "logs" / "home")
    assert (tmp_path / "logs" / "home").is_dir()
    assert env["OPENAI_BASE_URL"] == BASE_URL + "/v1"


HANGER = 'sleep 300 & echo $! > "{workspace}/grandchild.pid"; echo started; wait'


def test_deadline_kills_the_whole_process_group(tmp_path):
    spec = HarnessSpec(command=("sh", "-c", HANGER), deadline_s=1.0, kill_grace_s=1.0)
    t0 = time.monotonic()
    run = _run(spec, tmp_path)
    assert time.monotonic() - t0 < 5
    assert run.timed_out and not run.cancelled and not run.ok
    assert run.exit_code is not None and run.exit_code < 0
    assert 0.9 <= run.duration_s < 4
    grandchild = int((tmp_path / "ws" / "grandchild.pid").read_text())
    assert _is_gone(grandchild), f"grandchild {grandchild} survived"


def test_term_ignoring_harness_is_sigkilled_after_grace(tmp_path):
    code = (
        "import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "pathlib.Path('ready').write_text('1'); time.sleep(300)"
    )
    spec = HarnessSpec(command=(PY, "-c", code), deadline_s=1.0, kill_grace_s=0.5)
    run = _run(spec, tmp_path)
    assert run.timed_out
    assert run.exit_code == -9
    assert run.duration_s < 4


def test_cancel_mid_run(tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    spec = HarnessSpec(command=("sh", "-c", HANGER), deadline_s=60, kill_grace_s=1.0)

    async def main() -> HarnessRun:
        cancel = asyncio.Event()
        job = asyncio.create_task(
            supervise(
                prepare_harness(
                    spec,
                    workspace=workspace,
                    logs_dir=tmp_path / "logs",
                    execution_id="ex_2",
                    base_url=BASE_URL,
                    api_key=KEY,
                    instructions="hang",
                ),
                cancel,
            )
        )
        await asyncio.to_thread(_wait_for_file, workspace / "grandchild.pid")
        assert not job.done()
        cancel.set()
        return await asyncio.wait_for(job, 10)

    t0 = time.monotonic()
    run = asyncio.run(main())
    assert time.monotonic() - t0 < 8
    assert run.cancelled and not run.timed_out
    assert run.exit_code is not None and run.exit_code < 0
    assert _is_gone(int((workspace / "grandchild.pid").read_text()))


def test_cancelling_the_caller_task_still_kills_and_reaps(tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    spec = HarnessSpec(command=("sh", "-c", HANGER), deadline_s=60)

    async def main() -> None:
        job = asyncio.create_task(
            supervise(
                prepare_harness(
                    spec,
                    workspace=workspace,
                    logs_dir=tmp_path / "logs",
                    execution_id="ex_3",
                    base_url=BASE_URL,
                    api_key=KEY,
                    instructions="hang",
                )
            )
        )
        await asyncio.to_thread(_wait_for_file, workspace / "grandchild.pid")
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(main())
    assert _is_gone(int((workspace / "grandchild.pid").read_text()))


def test_crashing_harness_exit_code_and_stderr(tmp_path):
    code = "import sys; sys.stderr.write('boom: it broke\\n'); sys.exit(3)"
    run = _run(HarnessSpec(command=(PY, "-c", code), deadline_s=20), tmp_path)
    assert run.exit_code == 3
    assert not run.timed_out and not run.cancelled and not run.ok
    assert run.stderr_path is not None
    assert "boom: it broke" in run.stderr_path.read_text()


def test_missing_binary_is_reported_not_raised(tmp_path):
    spec = HarnessSpec(command=(str(tmp_path / "no-such-harness"),), deadline_s=5)
    run = _run(spec, tmp_path)
    assert run.exit_code is None and run.error and "could not start" in run.error
    assert "no-such-harness" in run.stderr_path.read_text()


def test_exited_harness_leaves_no_background_processes(tmp_path):
    code = 'sleep 300 & echo $! > "{workspace}/bg.pid"; exit 0'
    run = _run(HarnessSpec(command=("sh", "-c", code), deadline_s=20), tmp_path)
    assert run.exit_code == 0
    assert _is_gone(int((tmp_path / "ws" / "bg.pid").read_text()))


def test_placeholder_substitution():
    spec = HarnessSpec(
        command=(
            "h",
            "{instructions}",
            "--ws={workspace}",
            "{base_url}",
            "{openai_base_url}",
            "{execution_id}",
            "{{literal}}",
            "{home_dir}/x",
        ),
        deadline_s=1,
    )
    values = {
        "instructions": "do {this}",
        "workspace": "/w",
        "base_url": "http://b",
        "openai_base_url": "http://b/v1",
        "execution_id": "ex_9",
        "home_dir": "/h",
    }
    assert render_command(spec, values) == [
        "h",
        "do {this}",
        "--ws=/w",
        "http://b",
        "http://b/v1",
        "ex_9",
        "{literal}",
        "/h/x",
    ]


@pytest.mark.parametrize(
    "command,env",
    [
        (("h", "{model}"), {}),
        (("h", "{}"), {}),
        (("h", "{workspace.parent}"), {}),
        (("h",), {"X": "{api_key}"}),
    ],
)
def test_unknown_placeholder_is_rejected(command, env):
    with pytest.raises(ValueError, match="unknown placeholder") as info:
        HarnessSpec(command=command, env=env, deadline_s=1)
    for name in PLACEHOLDERS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "kw",
    [
        {"deadline_s": 0},
        {"deadline_s": -1},
        {"deadline_s": float("inf")},
    ],
)
def test_bad_limits_are_rejected(kw):
    with pytest.raises(ValueError):
        HarnessSpec(command=("h",), **kw)
    with pytest.raises(ValueError, match="limit memory_mb must be a positive int"):
        Limits(memory_mb=0)
    with pytest.raises(ValueError, match="limit cpu_s must be a positive int"):
        Limits(cpu_s=-5)


def test_claude_code_spec_contents():
    spec = claude_code_spec(deadline_s=600, model="qwen{x}")
    values = {n: f"<{n}>" for n in PLACEHOLDERS} | {"instructions": "fix the bug"}
    argv = render_command(spec, values)
    assert argv[:3] == ["claude", "-p", "fix the bug"]
    for flag in ("--dangerously-skip-permissions", "--verbose"):
        assert flag in argv
    assert argv[argv.index("--output-format") + 1] == "stream-json"
    assert argv[argv.index("--tools") + 1] == "Bash,Read,Edit,Write"
    assert argv[argv.index("--model") + 1] == "qwen{x}"
    assert "--bare" not in argv
    assert spec.deadline_s == 600
    env = {k: v.format_map(values) for k, v in spec.env.items()}
    assert env["HOME"] == "<home_dir>"
    assert env["CLAUDE_CONFIG_DIR"].startswith("<home_dir>")
    assert env["CLAUDE_CODE_TMPDIR"].startswith("<home_dir>")
    assert env["IS_SANDBOX"] == "1"
    for name in ("DISABLE_TELEMETRY", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"):
        assert env[name] == "1"
    assert env["DISABLE_AUTOUPDATER"] == "1"
    bare = render_command(claude_code_spec("/opt/claude", tools=None), values)
    assert bare[0] == "/opt/claude" and "--bare" in bare and "--tools" not in bare


def test_mini_swe_agent_spec_contents():
    spec = mini_swe_agent_spec(model="openai/tiny", deadline_s=300)
    values = {n: f"<{n}>" for n in PLACEHOLDERS} | {"instructions": "do it"}
    argv = render_command(spec, values)
    assert argv[0] == "mini"
    assert argv[argv.index("-m") + 1] == "openai/tiny"
    assert argv[argv.index("-t") + 1] == "do it"
    assert "-y" in argv and "--exit-immediately" in argv
    assert "mini.yaml" in argv
    assert "model.model_kwargs.api_base=<openai_base_url>" in argv
    assert not any(KEY in a or "api_key" in a for a in argv)  # key only in the env
    assert argv[argv.index("-o") + 1].startswith("<home_dir>")
    env = {k: v.format_map(values) for k, v in spec.env.items()}
    assert env["MSWEA_CONFIGURED"] == "true"
    assert env["MSWEA_COST_TRACKING"] == "ignore_errors"
    assert env["MSWEA_GLOBAL_CONFIG_DIR"].startswith("<home_dir>")


ALLOC = "x = bytearray(1024 * 1024 * 1024); print(len(x))"


@pytest.mark.skipif(resource is None, reason="the resource module (rlimits) is POSIX-only")
def test_memory_limit_applied(tmp_path):
    limited = _run(
        HarnessSpec(command=(PY, "-c", ALLOC), deadline_s=20, limits=Limits(memory_mb=256)),
        tmp_path / "a",
    )
    # a memory cgroup kills it (SIGKILL), RLIMIT_AS fails the allocation
    failed = "MemoryError" in limited.stderr_path.read_text()
    assert limited.exit_code == -signal.SIGKILL or (failed and limited.exit_code == 1)
    # The same program without the limit succeeds, so the limit is what failed it.
    free = _run(HarnessSpec(command=(PY, "-c", ALLOC), deadline_s=20), tmp_path / "b")
    assert free.exit_code == 0, free.stderr_path.read_text()


@pytest.mark.skipif(resource is None, reason="the resource module (rlimits) is POSIX-only")
def test_cpu_limit_applied(tmp_path):
    spin = "while True: pass"
    spec = HarnessSpec(command=(PY, "-c", spin), deadline_s=10, limits=Limits(cpu_s=1))
    run = _run(spec, tmp_path)
    assert not run.timed_out
    assert run.exit_code is not None and run.exit_code < 0  # SIGXCPU / SIGKILL
    assert run.duration_s < 5


def test_kill_orphaned_harness_checks_the_execution_before_killing(tmp_path):  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys
    import time

    from qwengyre.rollout.harness import PGID_FILE, kill_orphaned_harness

    env = {**os.environ, "QWENGYRE_EXECUTION_ID": "ex_orphan"}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )
    (tmp_path / PGID_FILE).write_text(f"{proc.pid}\n")
    time.sleep(0.2)
    assert not kill_orphaned_harness(tmp_path, "ex_other")  # not its execution: left alone
    assert proc.poll() is None
    assert kill_orphaned_harness(tmp_path, "ex_orphan")
    assert proc.wait(10) == -9
    assert not kill_orphaned_harness(tmp_path / "missing", "ex_orphan")
