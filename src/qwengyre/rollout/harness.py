"""Harness launching: run a black-box agent program for one execution.

A harness reaches the model only through qwengyre's proxy. :func:`prepare_harness` builds
one execution's launch and :func:`supervise` (``supervise(prepare_harness(...))``) starts the
harness as a subprocess in ``workspace`` with the proxy's per-execution URL and key under
both the Anthropic and the OpenAI variable names, sends its output straight to files, and
waits until it exits, its deadline passes, or the caller cancels it. On deadline or cancel
the harness's whole process group is killed (SIGTERM, then SIGKILL after a grace period),
so tools the agent started die with it; the child is always reaped.

Command templates (:class:`HarnessSpec`) are ``str.format`` templates over a fixed set of
names (:data:`PLACEHOLDERS`); the values (e.g. the task instructions) are never themselves
formatted, so braces in them are harmless. A literal brace in a template is written
``{{`` / ``}}``.

Limits of the isolation: the harness gets its own session (``start_new_session=True``),
and a program that deliberately leaves it (``setsid``, double fork into a new session)
escapes the group kill, unless the spec's sandbox (:mod:`qwengyre.rollout.sandbox`)
runs it in a PID namespace of its own, which ends with the harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import string
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from qwengyre.rollout import toy_harness
from qwengyre.rollout.environments import EnvironmentOptions
from qwengyre.rollout.limits import Limits, enforce, release
from qwengyre.rollout.relay import (
    PLACEHOLDER_KEY,
    RelayTarget,
    inside_base_url,
    new_socket_path,
    relay,
)
from qwengyre.rollout.sandbox import NoSandbox, Sandbox
from qwengyre.rollout.toy_harness import CRITIQUE_ENV

__all__ = [
    "BASE_ENV_NAMES",
    "PLACEHOLDERS",
    "HarnessLaunch",
    "HarnessRun",
    "HarnessRunner",
    "HarnessSpec",
    "claude_code_spec",
    "harness_env",
    "mini_swe_agent_spec",
    "opencode_spec",
    "prepare_harness",
    "qwen_code_spec",
    "render_command",
    "supervise",
]

#: Names a command or env template may use.
#: ``home_dir`` is a private per-execution directory (created by :func:`prepare_harness`,
#: default ``logs_dir / "home"``) for the harness's HOME, config and temp files.
PLACEHOLDERS: frozenset[str] = frozenset(
    {"instructions", "workspace", "base_url", "openai_base_url", "execution_id", "home_dir"}
)

#: Variables inherited from qwengyre's own environment (HOME only unless the spec sets it).
BASE_ENV_NAMES: tuple[str, ...] = ("PATH", "LANG", "HOME")

DEFAULT_KILL_GRACE_S = 5.0


def _check_template(template: str, where: str) -> None:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{where}: malformed template {template!r}: {exc}") from exc
    allowed = ", ".join(sorted(PLACEHOLDERS))
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in PLACEHOLDERS:
            raise ValueError(
                f"{where}: unknown placeholder {{{name}}} in {template!r}; allowed: {allowed}"
            )
        if spec or conversion:
            raise ValueError(
                f"{where}: placeholder {{{name}}} in {template!r} must not carry a format "
                "spec or conversion"
            )


@dataclass(kw_only=True, frozen=True)
class HarnessSpec:
    """How to launch one kind of harness.

    ``command`` is an argv template; ``env`` holds extra variables whose values are
    templates too. ``deadline_s`` is the harness deadline (wall clock, from launch);
    ``limits`` bound its processes, memory, open files and CPU time
    (:mod:`qwengyre.rollout.limits`; default: none); ``kill_grace_s`` is the
    SIGTERM-to-SIGKILL grace period; ``sandbox`` confines the harness
    (:mod:`qwengyre.rollout.sandbox`; default: none) of a task without an environment;
    ``environment`` says how a task's environment is prepared, which then confines it
    instead (:mod:`qwengyre.rollout.environments`).
    """

    command: tuple[str, ...]
    deadline_s: float
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    files: Mapping[str, str] = field(default_factory=dict, hash=False)
    limits: Limits = field(default_factory=Limits)
    kill_grace_s: float = DEFAULT_KILL_GRACE_S
    sandbox: Sandbox = field(default_factory=NoSandbox)
    environment: EnvironmentOptions = field(default_factory=EnvironmentOptions)

    def __post_init__(self) -> None:
        command = tuple(self.command)
        if not command:
            raise ValueError("HarnessSpec.command must not be empty")
        for item in command:
            if not isinstance(item, str):
                raise TypeError(f"HarnessSpec.command items must be str, got {item!r}")
            _check_template(item, "HarnessSpec.command")
        object.__setattr__(self, "command", command)
        env = dict(self.env)
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"HarnessSpec.env must map str to str, got {key!r}: {value!r}")
            _check_template(value, f"HarnessSpec.env[{key!r}]")
        object.__setattr__(self, "env", env)
        files = dict(self.files)
        for name, text in files.items():
            if not isinstance(name, str) or not isinstance(text, str):
                raise TypeError(f"HarnessSpec.files must map str to str, got {name!r}: {text!r}")
            parts = Path(name).parts
            if not parts or Path(name).is_absolute() or ".." in parts:
                raise ValueError(
                    f"HarnessSpec.files: {name!r} must be a path inside the home, relative,"
                    " without '..'"
                )
            _check_template(text, f"HarnessSpec.files[{name!r}]")
        object.__setattr__(self, "files", files)
        if not (isinstance(self.deadline_s, int | float) and math.isfinite(self.deadline_s)):
            raise ValueError(f"deadline_s must be a finite number, got {self.deadline_s!r}")
        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s!r}")
        if not (math.isfinite(self.kill_grace_s) and self.kill_grace_s >= 0):
            raise ValueError(f"kill_grace_s must be >= 0, got {self.kill_grace_s!r}")


@dataclass(kw_only=True, frozen=True)
class HarnessRun:
    """How one harness run ended.

    ``exit_code`` is the child's return code (negative: killed by that signal), or None
    when no child was spawned. ``timed_out`` / ``cancelled`` say why qwengyre
    stopped it (never both). Times are ``time.monotonic()`` readings. ``error`` is a short
    reason when the harness could not run or raised. ``spawned`` is False only when the
    harness process could not be created at all (missing binary, exec failure, bad
    working directory): nothing of the harness ever ran.
    """

    exit_code: int | None
    timed_out: bool
    cancelled: bool
    started_s: float
    ended_s: float
    stdout_path: Path | None
    stderr_path: Path | None
    error: str | None = None
    spawned: bool = True

    @property
    def duration_s(self) -> float:
        return self.ended_s - self.started_s

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.cancelled


def _openai_base_url(base_url: str) -> str:
    return base_url.rstrip("/") + "/v1"


def _values(
    *,
    instructions: str,
    workspace: Path,
    base_url: str,
    execution_id: str,
    home_dir: Path,
) -> dict[str, str]:
    return {
        "instructions": instructions,
        "workspace": str(workspace),
        "base_url": base_url.rstrip("/"),
        "openai_base_url": _openai_base_url(base_url),
        "execution_id": execution_id,
        "home_dir": str(home_dir),
    }


def render_command(spec: HarnessSpec, values: Mapping[str, str]) -> list[str]:
    """The argv for ``spec`` with the placeholders filled from ``values``."""
    return [item.format_map(values) for item in spec.command]


def harness_env(
    spec: HarnessSpec,
    values: Mapping[str, str],
    *,
    api_key: str,
    base_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The harness's environment: a minimal inherited base, ``spec.env``, then the proxy
    variables (last, so a spec cannot point the harness past the proxy)."""
    source = os.environ if base_env is None else base_env
    env = {name: source[name] for name in BASE_ENV_NAMES if name in source}
    env.update({key: value.format_map(values) for key, value in spec.env.items()})
    env.update(
        {
            "ANTHROPIC_BASE_URL": values["base_url"],
            "ANTHROPIC_API_KEY": api_key,
            "OPENAI_BASE_URL": values["openai_base_url"],
            "OPENAI_API_KEY": api_key,
            "QWENGYRE_EXECUTION_ID": values["execution_id"],
        }
    )
    return env


PGID_FILE = "harness.pgid"


def kill_orphaned_harness(logs_dir: Path, execution_id: str) -> bool:
    """Kill the process group a dead runner left for ``execution_id``; True if it did.

    The group id comes from ``logs_dir/harness.pgid``; it is killed only if its leader
    still carries ``QWENGYRE_EXECUTION_ID=<execution_id>`` (Linux ``/proc``), so a
    recycled pid is never hit. The execution's cgroups go too, with whatever is in them
    (:func:`~qwengyre.rollout.limits.release`).
    """
    killed = _kill_orphaned_group(logs_dir, execution_id)
    release(execution_id)
    return killed


def _kill_orphaned_group(logs_dir: Path, execution_id: str) -> bool:
    try:
        pgid = int((logs_dir / PGID_FILE).read_text())
        environ = Path(f"/proc/{pgid}/environ").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return False
    if f"QWENGYRE_EXECUTION_ID={execution_id}".encode() not in environ:
        return False
    kill_group(pgid, signal.SIGKILL)
    return True


def kill_orphaned_harnesses(run_dir: Path, keep: Collection[str] = ()) -> int:
    """Kill every harness process group a dead runner left under ``run_dir/logs`` (one
    directory per execution, as :func:`prepare_harness` lays them out) but those of the
    executions in ``keep``; how many."""
    logs = run_dir / "logs"
    found = [d for d in logs.glob("*") if d.name not in keep] if logs.exists() else []
    return sum(kill_orphaned_harness(d, d.name) for d in found)


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a whole process group; one that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _terminate_group(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM the group, wait up to ``grace_s`` for the leader, SIGKILL the group, reap."""
    pgid = proc.pid  # start_new_session: the child leads its own group.
    kill_group(pgid, signal.SIGTERM)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(proc.wait(), timeout=grace_s)
    kill_group(pgid, signal.SIGKILL)  # stragglers in the group, or a leader ignoring TERM
    await proc.wait()


@dataclass(kw_only=True, frozen=True)
class HarnessLaunch:
    """One harness process ready to start (:func:`prepare_harness`): what
    :func:`supervise` starts, in this process or in a harness daemon
    (:mod:`qwengyre.rollout.harnessd`). ``env`` holds the execution's key: it travels
    to whoever starts the process and is never written to disk."""

    execution_id: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    workspace: Path
    logs_dir: Path
    deadline_s: float
    kill_grace_s: float = DEFAULT_KILL_GRACE_S
    limits: Limits = field(default_factory=Limits)
    user_namespace: bool = False  # the sandbox gives the harness a user namespace
    relay: RelayTarget | None = None  # the proxy relay its private network reaches

    def to_json(self) -> dict[str, Any]:
        return {
            "execution_id": self.execution_id,
            "argv": list(self.argv),
            "env": dict(self.env),
            "workspace": str(self.workspace),
            "logs_dir": str(self.logs_dir),
            "deadline_s": self.deadline_s,
            "kill_grace_s": self.kill_grace_s,
            "limits": asdict(self.limits),
            "user_namespace": self.user_namespace,
            "relay": self.relay.to_json() if self.relay is not None else None,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HarnessLaunch:
        return cls(
            execution_id=str(data["execution_id"]),
            argv=tuple(str(a) for a in data["argv"]),
            env={str(k): str(v) for k, v in data["env"].items()},
            workspace=Path(data["workspace"]),
            logs_dir=Path(data["logs_dir"]),
            deadline_s=float(data["deadline_s"]),
            kill_grace_s=float(data["kill_grace_s"]),
            limits=Limits(**data["limits"]),
            user_namespace=bool(data["user_namespace"]),
            relay=RelayTarget.from_json(data["relay"]) if data["relay"] is not None else None,
        )


HarnessRunner = Callable[[HarnessLaunch, "asyncio.Event | None"], Awaitable[HarnessRun]]
"""Starts a prepared harness and waits until it ends (cancelled when the event is
set): :func:`supervise` in this process, or a harness daemon's client."""


def prepare_harness(
    spec: HarnessSpec,
    *,
    workspace: Path,
    logs_dir: Path,
    execution_id: str,
    base_url: str,
    api_key: str,
    instructions: str,
    home_dir: Path | None = None,
    hidden: Sequence[Path] = (),
) -> HarnessLaunch:
    """The launch of ``spec`` for one execution; creates the logs directory and the
    private home (``home_dir``, else ``logs_dir/home``) and writes ``spec.files``
    there. Run it with :func:`supervise`.

    ``hidden``: directories the spec's sandbox keeps from the harness (the run
    directory, which holds every execution's workspace and logs).

    ``base_url`` is the proxy's per-execution prefix URL (``http://127.0.0.1:P/x/ex_1``);
    the harness sees it as ``ANTHROPIC_BASE_URL`` and, with ``/v1`` appended, as
    ``OPENAI_BASE_URL``, and ``api_key`` as the API keys. A sandbox with namespaces of its
    own gets instead its in-sandbox relay's URL and a placeholder key: the proxy relay
    (:mod:`qwengyre.rollout.relay`), which :func:`supervise` runs for the harness's
    lifetime, adds the key."""
    workspace = Path(workspace)
    logs_dir = Path(logs_dir)
    logs_dir.mkdir(parents=True, exist_ok=True)
    home = Path(home_dir) if home_dir is not None else logs_dir / "home"
    home.mkdir(parents=True, exist_ok=True)
    confine = spec.sandbox
    target = None
    if confine.namespaced:  # the relay holds the key; the harness gets a placeholder
        target = RelayTarget(base_url=base_url, api_key=api_key, socket=new_socket_path())
        base_url, api_key = inside_base_url(base_url), PLACEHOLDER_KEY
    values = _values(
        instructions=instructions,
        workspace=workspace,
        base_url=base_url,
        execution_id=execution_id,
        home_dir=home,
    )
    for name, text in spec.files.items():
        _write_home_file(home, name, text.format_map(values))
    env = harness_env(spec, values, api_key=api_key)
    if confine.namespaced and "HOME" not in spec.env:
        env["HOME"] = str(home)  # the operator's is hidden
    argv = confine.wrap(
        render_command(spec, values),
        workspace=workspace,
        home=home,
        hidden=hidden,
        proxy_socket=target.socket if target is not None else None,
        env=env.keys(),
    )
    return HarnessLaunch(
        execution_id=execution_id,
        argv=tuple(argv),
        env=env,
        workspace=workspace,
        logs_dir=logs_dir,
        deadline_s=spec.deadline_s,
        kill_grace_s=spec.kill_grace_s,
        limits=spec.limits,
        user_namespace=confine.namespaced,
        relay=target,
    )


def _write_home_file(home: Path, name: str, text: str) -> None:
    """Write ``text`` to ``home/name``, replacing a link a harness left on the way (an
    earlier attempt of the execution may have run in this home): never through one."""
    at = home
    parts = Path(name).parts
    for part in parts[:-1]:
        at = at / part
        if at.is_symlink():
            at.unlink()
        at.mkdir(exist_ok=True)
    path = at / parts[-1]
    if path.is_symlink():
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    with os.fdopen(os.open(path, flags, 0o644), "w") as out:
        out.write(text)


async def supervise(
    launch: HarnessLaunch,
    cancel: asyncio.Event | None = None,
    on_spawn: Callable[[int], None] | None = None,
) -> HarnessRun:
    """Start ``launch`` (:func:`prepare_harness`) and wait until it ends, serving its
    proxy relay meanwhile; ``on_spawn`` is told the harness's pid (its process group)
    once it runs.

    The launch's limits hold for the harness and everything it starts
    (:mod:`qwengyre.rollout.limits`; its cgroup is removed when it ends).
    stdout/stderr go to ``logs_dir/stdout.log`` / ``stderr.log``. Returns when the
    harness exits, its deadline passes (``timed_out``) or ``cancel`` is set
    (``cancelled``); in the latter two cases the whole process group is killed. If the
    calling task itself is cancelled, the group is killed and reaped before the
    CancelledError propagates. After the harness ends, any process it left in its group
    is killed too, so no orphans survive a run."""
    async with contextlib.AsyncExitStack() as stack:
        if launch.relay is not None:
            await stack.enter_async_context(relay(launch.relay))
        limits = enforce(launch.execution_id, launch.limits, user_namespace=launch.user_namespace)
        stack.push_async_callback(asyncio.to_thread, limits.close)  # it may wait
        return await _run(launch, limits.preexec(), cancel, on_spawn)
    raise AssertionError("unreachable")  # mypy: the stack never swallows an exception


async def _run(
    launch: HarnessLaunch,
    preexec: Callable[[], None] | None,
    cancel: asyncio.Event | None,
    on_spawn: Callable[[int], None] | None,
) -> HarnessRun:
    """Start the harness in a session of its own and wait (see :func:`supervise`)."""
    logs_dir = launch.logs_dir
    stdout_path, stderr_path = logs_dir / "stdout.log", logs_dir / "stderr.log"
    argv = list(launch.argv)
    kwargs: dict[str, Any] = {}
    if preexec is not None:
        kwargs["preexec_fn"] = preexec
    started = time.monotonic()
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=launch.workspace,
                env=dict(launch.env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
                **kwargs,
            )
        except OSError as exc:  # missing binary, bad cwd, exec failure
            err.write(f"qwengyre: could not start harness {argv[0]!r}: {exc}\n".encode())
            return HarnessRun(
                exit_code=None,
                timed_out=False,
                cancelled=False,
                started_s=started,
                ended_s=time.monotonic(),
                stdout_path=stdout_path,
                stderr_path=stderr_path,
                error=f"could not start harness: {exc}",
                spawned=False,
            )

    # The process group's id, so a restarted runner can stop a harness it orphaned.
    (logs_dir / PGID_FILE).write_text(f"{proc.pid}\n")
    if on_spawn is not None:
        on_spawn(proc.pid)
    timed_out = cancelled = False
    wait_task: asyncio.Task[int] = asyncio.ensure_future(proc.wait())
    cancel_task: asyncio.Task[bool] | None = (
        asyncio.ensure_future(cancel.wait()) if cancel is not None else None
    )
    try:
        waiting: set[asyncio.Future[Any]] = {wait_task}
        if cancel_task is not None:
            waiting.add(cancel_task)
        remaining = launch.deadline_s - (time.monotonic() - started)
        done, _ = await asyncio.wait(
            waiting, timeout=max(0.0, remaining), return_when=asyncio.FIRST_COMPLETED
        )
        if wait_task not in done:
            if cancel_task is not None and cancel_task in done:
                cancelled = True
            else:
                timed_out = True
            await _terminate_group(proc, launch.kill_grace_s)
        else:
            kill_group(proc.pid, signal.SIGKILL)  # leftovers of a harness that exited
    except BaseException:
        # Our caller was cancelled (or something broke): never leave the harness behind.
        kill_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(BaseException):
            await asyncio.shield(proc.wait())
        raise
    finally:
        for task in (wait_task, cancel_task):
            if task is not None and not task.done():
                task.cancel()
    return HarnessRun(
        exit_code=proc.returncode,
        timed_out=timed_out,
        cancelled=cancelled,
        started_s=started,
        ended_s=time.monotonic(),
        stdout_path=stdout_path,
        stderr_path=stderr_path,
    )


# --- presets --------------------------------------------------------------------------


def claude_code_spec(
    binary: str = "claude",
    tools: str | None = "Bash,Read,Edit,Write",
    *,
    deadline_s: float = 1800.0,
    model: str | None = None,
    limits: Limits | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> HarnessSpec:
    """Claude Code in print mode, as measured in docs/harnesses.md.

    ``tools=None`` runs ``--bare`` (3 tools, small requests) instead of ``--tools``.
    HOME, CLAUDE_CONFIG_DIR and CLAUDE_CODE_TMPDIR live in the per-execution
    ``{home_dir}``; IS_SANDBOX=1 lets ``--dangerously-skip-permissions`` run as root.
    The proxy URL/key arrive as ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY.
    """
    command: list[str] = [
        binary,
        "-p",
        "{instructions}",
        "--dangerously-skip-permissions",
        "--output-format",
        "stream-json",
        "--verbose",
    ]
    if model is not None:
        command += ["--model", _escape(model)]
    command += ["--bare"] if tools is None else ["--tools", _escape(tools)]
    env = {
        "HOME": "{home_dir}",
        "CLAUDE_CONFIG_DIR": "{home_dir}/.claude",
        "CLAUDE_CODE_TMPDIR": "{home_dir}",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",
    }
    env.update(extra_env or {})
    return HarnessSpec(
        command=tuple(command),
        env=env,
        deadline_s=deadline_s,
        limits=limits or Limits(),
    )


def mini_swe_agent_spec(
    binary: str = "mini",
    model: str = "openai/qwengyre",
    config: str = "mini.yaml",
    *,
    deadline_s: float = 1800.0,
    limits: Limits | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> HarnessSpec:
    """mini-swe-agent (litellm, OpenAI chat completions), as measured in docs/harnesses.md.

    The API base is passed on the command line (``{openai_base_url}``); the key travels
    only in OPENAI_API_KEY (which litellm reads for ``openai/`` models), so it never
    shows in the process list. The trajectory is written to ``{home_dir}/traj.json``.
    """
    command = (
        binary,
        "-m",
        _escape(model),
        "-t",
        "{instructions}",
        "-y",
        "--exit-immediately",
        "-c",
        _escape(config),
        "-c",
        "model.model_kwargs.api_base={openai_base_url}",
        "-o",
        "{home_dir}/traj.json",
    )
    env = {
        "HOME": "{home_dir}",
        "MSWEA_CONFIGURED": "true",
        "MSWEA_GLOBAL_CONFIG_DIR": "{home_dir}/mini-swe-agent",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "MSWEA_SILENT_STARTUP": "1",
    }
    env.update(extra_env or {})
    return HarnessSpec(
        command=command,
        env=env,
        deadline_s=deadline_s,
        limits=limits or Limits(),
    )


#: Qwen Code's ``~/.qwen/settings.json``: the OpenAI-compatible provider (the proxy,
#: from OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL), no usage statistics, telemetry
#: or auto-update, no background memory agents (auto-memory, dream, auto-skill), every
#: tool approved, and its own sandbox off (qwengyre's ``harness.sandbox`` confines it).
QWEN_CODE_SETTINGS: dict[str, Any] = {
    "security": {"auth": {"selectedType": "openai"}},
    "privacy": {"usageStatisticsEnabled": False},
    "general": {"enableAutoUpdate": False},
    "telemetry": {"enabled": False},
    "memory": {
        "enableManagedAutoMemory": False,
        "enableManagedAutoDream": False,
        "enableAutoSkill": False,
    },
    "tools": {"approvalMode": "yolo", "sandbox": False},
}


def qwen_code_spec(
    binary: str = "qwen",
    model: str = "qwengyre",
    *,
    deadline_s: float = 1800.0,
    limits: Limits | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> HarnessSpec:
    """Qwen Code one-shot (``qwen --yolo -o json -- TASK``), as measured in
    docs/harnesses.md, with :data:`QWEN_CODE_SETTINGS` in ``{home_dir}/.qwen``.

    The proxy URL/key arrive as OPENAI_BASE_URL / OPENAI_API_KEY; ``model`` is the name
    it asks for (OPENAI_MODEL; the proxy serves its one model whatever the name).
    stdout is a JSON array of events, the last one's ``result`` the final answer.
    """
    command = (binary, "--yolo", "--output-format", "json", "--prompt={instructions}")
    env = {
        "HOME": "{home_dir}",
        "OPENAI_MODEL": _escape(model),
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    }
    env.update(extra_env or {})
    settings = _escape(json.dumps(QWEN_CODE_SETTINGS, indent=2))
    return HarnessSpec(
        command=command,
        env=env,
        files={".qwen/settings.json": settings},
        deadline_s=deadline_s,
        limits=limits or Limits(),
    )


#: The provider OpenCode's config names (``qwengyre/<model>``).
OPENCODE_PROVIDER = "qwengyre"


def opencode_config(model: str) -> dict[str, Any]:
    """OpenCode's global ``opencode.json``: one ``@ai-sdk/openai-compatible`` provider
    whose URL and key OpenCode reads from OPENAI_BASE_URL / OPENAI_API_KEY when it starts
    (``{env:...}``: the key is never written to disk), ``model`` as both its model and
    its small model (title generation), no auto-update, no sharing."""
    return {
        "provider": {
            OPENCODE_PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": OPENCODE_PROVIDER,
                "options": {"baseURL": "{env:OPENAI_BASE_URL}", "apiKey": "{env:OPENAI_API_KEY}"},
                "models": {model: {}},
            }
        },
        "model": f"{OPENCODE_PROVIDER}/{model}",
        "small_model": f"{OPENCODE_PROVIDER}/{model}",
        "autoupdate": False,
        "share": "disabled",
    }


def opencode_spec(
    binary: str = "opencode",
    model: str = "qwengyre",
    *,
    deadline_s: float = 1800.0,
    limits: Limits | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> HarnessSpec:
    """OpenCode one-shot (``opencode run --auto --pure --format json -- TASK``), as
    measured in docs/harnesses.md, with :func:`opencode_config` as its global config in
    ``{home_dir}/.config/opencode``.

    ``--auto`` approves every permission OpenCode would ask for (those it denies stay
    denied); ``--pure`` loads no external plugin. The environment turns off its update
    check, models.dev fetch, sharing, LSP downloads, default plugins and a workspace's
    own ``opencode.json`` (the run is the same whatever the task's repository holds).
    stdout is JSON events, one a line.
    """
    command = (binary, "run", "--auto", "--pure", "--format", "json", "--", "{instructions}")
    env = {
        "HOME": "{home_dir}",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
        "npm_config_offline": "true",
    }
    env.update(extra_env or {})
    config = _escape(json.dumps(opencode_config(model), indent=2))
    return HarnessSpec(
        command=command,
        env=env,
        files={".config/opencode/opencode.json": config},
        deadline_s=deadline_s,
        limits=limits or Limits(),
    )


def codex_config(model: str, extra: str = "") -> str:
    """Codex's ``config.toml`` (a template: ``{openai_base_url}`` is the execution's):
    one ``responses`` model provider at the proxy, its key read from OPENAI_API_KEY,
    no update check, analytics or feedback; ``extra``: more top-level TOML lines (e.g.
    ``model_auto_compact_token_limit = 100000``), literal."""
    return (
        _escape(extra)
        + f"""model = "{_escape(model)}"
model_provider = "qwengyre"
check_for_update_on_startup = false

[model_providers.qwengyre]
name = "qwengyre"
base_url = "{{openai_base_url}}"
wire_api = "responses"
env_key = "OPENAI_API_KEY"

[analytics]
enabled = false

[feedback]
enabled = false
"""
    )


def codex_spec(
    binary: str = "codex",
    model: str = "qwengyre",
    *,
    extra_config: str = "",
    deadline_s: float = 1800.0,
    limits: Limits | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> HarnessSpec:
    """Codex CLI one-shot (``codex exec ... --json -- TASK``), as measured in
    docs/harnesses.md: the OpenAI Responses API only, with :func:`codex_config` in its
    private ``CODEX_HOME`` (``{home_dir}/.codex``).

    ``--strict-config`` fails a run whose config this version does not know (a drifted
    preset shows at once); ``--dangerously-bypass-approvals-and-sandbox``: no approval
    prompts and none of Codex's own sandbox, which would nest inside ``run.sandbox``
    (the harness's confinement is qwengyre's). stdout is JSON events, one a line.
    """
    command = (
        binary,
        "exec",
        "--strict-config",
        "--dangerously-bypass-approvals-and-sandbox",
        "--skip-git-repo-check",
        "--json",
        "--",
        "{instructions}",
    )
    env = {"HOME": "{home_dir}", "CODEX_HOME": "{home_dir}/.codex"}
    env.update(extra_env or {})
    return HarnessSpec(
        command=command,
        env=env,
        files={".codex/config.toml": codex_config(model, extra_config)},
        deadline_s=deadline_s,
        limits=limits or Limits(),
    )


def _escape(literal: str) -> str:
    """A literal value made safe to embed in a template."""
    return literal.replace("{", "{{").replace("}", "}}")


#: Environment variable naming the Claude Code binary (default: ``claude`` on PATH).
CLAUDE_BIN_ENV = "QWENGYRE_CLAUDE_BIN"
#: Environment variable naming the Qwen Code binary (default: ``qwen`` on PATH).
QWEN_BIN_ENV = "QWENGYRE_QWEN_BIN"
#: Environment variable naming the OpenCode binary (default: ``opencode`` on PATH).
OPENCODE_BIN_ENV = "QWENGYRE_OPENCODE_BIN"
#: Environment variable naming the Codex CLI binary (default: ``codex`` on PATH).
CODEX_BIN_ENV = "QWENGYRE_CODEX_BIN"


def harness_spec(
    name: str,
    deadline_s: float,
    sandbox: Sandbox | None = None,
    limits: Limits | None = None,
    environment: EnvironmentOptions | None = None,
) -> HarnessSpec:
    """A named harness, or a command template (``{instructions}`` etc.; see HarnessSpec),
    confined by ``sandbox`` and bounded by ``limits`` (default: none), its tasks'
    environments prepared as ``environment`` says (default: :class:`EnvironmentOptions`).

    ``toy-critique`` / ``toy-critique-assistant`` run the toy harness in critique mode
    (it asks for an intermediate assessment after each tool turn and feeds the critique
    back as a user / assistant message: :mod:`qwengyre.rollout.toy_harness`).

    ``claude-code`` runs Claude Code with ``--tools Bash,Read,Edit,Write``;
    ``claude-code-bare`` runs it with ``--bare`` (3 tools, a far shorter prompt: the one
    that fits a tiny model's window); ``qwen-code`` runs Qwen Code, ``opencode``
    OpenCode and ``codex`` Codex CLI (:func:`qwen_code_spec`, :func:`opencode_spec`,
    :func:`codex_spec`). Each one's binary is ``$QWENGYRE_CLAUDE_BIN`` /
    ``$QWENGYRE_QWEN_BIN`` / ``$QWENGYRE_OPENCODE_BIN`` / ``$QWENGYRE_CODEX_BIN`` if set,
    else ``claude`` / ``qwen`` / ``opencode`` / ``codex`` looked up on the PATH the
    harness inherits.
    """
    named = _named_spec(name, deadline_s)
    return replace(
        named,
        sandbox=sandbox or NoSandbox(),
        limits=limits or Limits(),
        environment=environment or EnvironmentOptions(),
    )


def _binary(variable: str, default: str) -> str:
    """``$variable`` if set, else ``default``, as a literal for a command template."""
    return _escape(os.environ.get(variable) or default)


def _named_spec(name: str, deadline_s: float) -> HarnessSpec:
    if name in ("toy", "toy-critique", "toy-critique-assistant"):
        # by its path: it needs only aiohttp, whatever the harness's Python can import
        command = (sys.executable, _escape(toy_harness.__file__), "{instructions}")
        role = {"toy-critique": "user", "toy-critique-assistant": "assistant"}.get(name)
        env = {CRITIQUE_ENV: role} if role else {}
        return HarnessSpec(command=command, deadline_s=deadline_s, env=env)
    if name in ("claude-code", "claude-code-bare"):
        binary = _binary(CLAUDE_BIN_ENV, "claude")
        if name == "claude-code-bare":
            return claude_code_spec(binary, tools=None, deadline_s=deadline_s)
        return claude_code_spec(binary, deadline_s=deadline_s)
    if name == "qwen-code":
        return qwen_code_spec(_binary(QWEN_BIN_ENV, "qwen"), deadline_s=deadline_s)
    if name == "opencode":
        return opencode_spec(_binary(OPENCODE_BIN_ENV, "opencode"), deadline_s=deadline_s)
    if name == "codex":
        return codex_spec(_binary(CODEX_BIN_ENV, "codex"), deadline_s=deadline_s)
    if name == "mini-swe-agent":
        return mini_swe_agent_spec(deadline_s=deadline_s)
    if "{instructions}" not in name:
        raise ValueError(
            f"harness {name!r}: use toy, toy-critique, toy-critique-assistant, claude-code,"
            " claude-code-bare, qwen-code, opencode, codex, mini-swe-agent or a command template"
            " containing {instructions}"
        )
    return HarnessSpec(command=tuple(name.split()), deadline_s=deadline_s)
