"""A task's environment (:mod:`qwengyre.rollout.environments`): the harness runs with a
root file system (a directory, or an archive unpacked once per node) as ``/``, sees
what only that root holds and none of the machine's files outside ``share``, still
reaches its proxy; the command evaluator runs in the same root; a broken environment is
the zero-reward placeholder naming the problem; the container runtimes' command lines."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from tests.test_rollout_relay import Upstream, with_upstream
from tests.test_rollout_runner import _options

from qwengyre.apps.rollout import rollout
from qwengyre.config import Config
from qwengyre.records.trace import read_trace
from qwengyre.rollout import environments, sandbox
from qwengyre.rollout.environments import (
    EnvironmentOptions,
    ImageEnvironment,
    RootfsEnvironment,
    prepare_environment,
)
from qwengyre.rollout.evaluation import evaluate_once
from qwengyre.rollout.execution import Budgets, ExecutionResult, run_execution
from qwengyre.rollout.harness import HarnessSpec, prepare_harness, supervise
from qwengyre.rollout.netns_relay import __file__ as NETNS_RELAY
from qwengyre.rollout.relay import PLACEHOLDER_KEY, SANDBOX_PORT
from qwengyre.rollout.sandbox import Container, Rootfs, SandboxUnavailable
from qwengyre.rollout.tasks import (
    CommandEvaluator,
    Task,
    TaskFileError,
    dump_tasks,
    example_tasks_path,
    load_tasks,
    parse_task_line,
)
from qwengyre.types import Outcome

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap is not installed (apt-get install bubblewrap)",
)

#: What a root made in a test needs of the machine: its shell and C libraries (the
#: Python qwengyre runs on is shown by the sandbox itself).
SHARE = [p for p in ("/usr", "/bin", "/lib", "/lib64") if os.path.lexists(p)]

# The harness: what it can see, and one call through the proxy relay. Braces doubled:
# a command template.
PROBE = """
import json, os, urllib.request
seen = {{
    "marker": open("/marker").read().strip() if os.path.exists("/marker") else None,
    "host_file": os.path.exists(os.environ["HOST_FILE"]),
    "etc_passwd": os.path.exists("/etc/passwd"),
}}
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
call = urllib.request.Request(base + "/echo", data=b"hi", headers={{"x-api-key": key}})
with urllib.request.urlopen(call) as answer:
    seen["proxy"] = json.load(answer)["body"]
seen["key"] = key
open("seen.json", "w").write(json.dumps(seen))
"""

#: Scores 1 exactly where the root's marker is visible (on the machine it is not).
IN_ROOT = CommandEvaluator(
    command='test "$(cat /marker)" = only-in-the-root && echo \'{"score": 1, "valid": true}\''
)


def make_root(at: Path) -> Path:
    """A root holding nothing but a marker file (its shell and libraries: ``SHARE``)."""
    at.mkdir(parents=True)
    (at / "marker").write_text("only-in-the-root\n")
    return at


def archive(root: Path, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(root, arcname=".")
    return path


def probe_spec(host_file: Path, options: EnvironmentOptions) -> HarnessSpec:
    return HarnessSpec(
        command=(sys.executable, "-c", PROBE),
        deadline_s=60,
        env={"HOST_FILE": str(host_file)},
        environment=options,
    )


def execute(
    task: Task, spec: HarnessSpec, run_dir: Path, *, proxy: bool = False, execution_id: str = "ex_1"
) -> ExecutionResult:
    """``task`` run once with ``spec``; ``proxy``: against a stand-in proxy (else the
    harness finds none)."""
    results: list[ExecutionResult] = []

    async def scenario(upstream: Upstream | None) -> None:
        base_url = upstream.url if upstream is not None else "http://127.0.0.1:9/x/ex_1"
        result = await run_execution(
            task,
            spec,
            Budgets(60, 90),
            execution_id=execution_id,
            run_dir=run_dir,
            base_url=base_url,
            api_key="qg-real",
        )
        results.append(result)

    if proxy:
        with_upstream(scenario)
    else:
        asyncio.run(scenario(None))
    return results[0]


def seen(run_dir: Path, execution_id: str = "ex_1") -> dict[str, object]:
    result: dict[str, object] = json.loads(
        (run_dir / "workspaces" / execution_id / "seen.json").read_text()
    )
    return result


@needs_bwrap
def test_a_rootfs_directory_is_the_harness_root_and_the_proxy_is_reached(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    host_file = tmp_path / "on-the-machine-only.txt"
    host_file.write_text("x")
    task = Task(
        id="t",
        instructions="look around",
        evaluator=IN_ROOT,
        environment=RootfsEnvironment(path=root, share=SHARE),
    )
    upstreams: list[Upstream] = []

    async def scenario(proxy: Upstream) -> None:
        upstreams.append(proxy)
        result = await run_execution(
            task,
            probe_spec(host_file, EnvironmentOptions(cache=tmp_path / "cache")),
            Budgets(60, 90),
            execution_id="ex_1",
            run_dir=tmp_path / "run",
            base_url=proxy.url,
            api_key="qg-real",
        )
        log = (tmp_path / "run" / "logs" / "ex_1" / "stderr.log").read_text()
        assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), (result, log)

    with_upstream(scenario)
    assert seen(tmp_path / "run") == {
        "marker": "only-in-the-root",
        "host_file": False,  # the machine's file, outside share
        "etc_passwd": False,  # the root has no /etc, and the machine's is not shared
        "proxy": "hi",
        "key": PLACEHOLDER_KEY,
    }
    assert [s["x-api-key"] for s in upstreams[0].seen] == ["qg-real"]  # the relay's key


@needs_bwrap
def test_an_archive_is_unpacked_once_and_its_path_resolves_against_the_task_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive(make_root(tmp_path / "root"), tmp_path / "data" / "envs" / "root.tar.gz")
    tasks = tmp_path / "data" / "tasks.jsonl"
    line = {
        "id": "t",
        "instructions": "look around",
        "evaluator": IN_ROOT.model_dump(),
        "environment": {"type": "rootfs", "path": "envs/root.tar.gz", "share": SHARE},
    }
    tasks.write_text(json.dumps(line) + "\n")
    (task,) = load_tasks(tasks)
    assert isinstance(task.environment, RootfsEnvironment)
    assert task.environment.path == tmp_path / "data" / "envs" / "root.tar.gz"
    unpacked: list[Path] = []
    unpack = environments._Cache._unpack

    def counted(archive: Path, target: Path, what: str) -> None:
        unpacked.append(target)
        unpack(archive, target, what)

    monkeypatch.setattr(environments._Cache, "_unpack", staticmethod(counted))
    host_file = tmp_path / "on-the-machine-only.txt"
    host_file.write_text("x")
    spec = probe_spec(host_file, EnvironmentOptions())  # cache beside the run directory
    for execution_id in ("ex_1", "ex_2"):
        result = execute(
            task, spec, tmp_path / "runs" / "r1", proxy=True, execution_id=execution_id
        )
        assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result
        assert seen(tmp_path / "runs" / "r1", execution_id)["marker"] == "only-in-the-root"
    cache = tmp_path / "runs" / environments.CACHE_NAME / "rootfs"
    assert len(unpacked) == 1 and [p.name for p in cache.iterdir()] == [unpacked[0].name]


@needs_bwrap
def test_the_command_evaluator_runs_in_the_tasks_root(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    (tmp_path / "ws").mkdir()
    confine = Rootfs(root, tuple(Path(p) for p in SHARE))
    inside = asyncio.run(evaluate_once(IN_ROOT, tmp_path / "ws", sandbox=confine))
    outside = asyncio.run(evaluate_once(IN_ROOT, tmp_path / "ws"))
    assert (inside.valid, inside.score) == (True, 1.0)
    assert (outside.valid, outside.score) == (False, None)  # the machine has no /marker


def _broken(tmp_path: Path, kind: str) -> tuple[RootfsEnvironment, str]:
    envs = tmp_path / "envs"
    envs.mkdir()
    if kind == "missing":
        return RootfsEnvironment(path=envs / "nope"), "No such file or directory"
    if kind == "not an archive":
        (envs / "bad.tar.gz").write_text("not a tar archive\n")
        return RootfsEnvironment(path=envs / "bad.tar.gz"), "not a usable tar archive"
    if kind == "no shell":
        return RootfsEnvironment(path=make_root(envs / "bare")), "the root has no /bin/sh"
    assert kind == "missing share"
    gone = RootfsEnvironment(path=make_root(envs / "r"), share=[str(tmp_path / "gone")])
    return gone, f"share: no such directory: {tmp_path / 'gone'}"


@pytest.mark.parametrize("kind", ["missing", "not an archive", "no shell", "missing share"])
def test_a_broken_environment_is_a_placeholder_naming_the_problem(
    tmp_path: Path, kind: str
) -> None:
    environment, problem = _broken(tmp_path, kind)
    task = Task(id="t", instructions="x", evaluator=IN_ROOT, environment=environment)
    spec = probe_spec(tmp_path / "f", EnvironmentOptions(cache=tmp_path / "cache"))
    result = execute(task, spec, tmp_path / "run")
    assert (result.outcome, result.reward, result.harness) == (Outcome.FAILED, 0.0, None)
    (only,) = result.assessments
    assert only.placeholder and only.score == 0.0
    assert problem in result.detail and str(environment.path) in result.detail
    assert not (tmp_path / "run" / "workspaces").exists()  # nothing was launched


def test_a_preparation_past_its_time_and_a_missing_runtime_are_placeholders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def hangs(self: object, path: Path, what: str) -> Path:
        import time

        time.sleep(2)
        return path

    monkeypatch.setattr(environments._Cache, "root", hangs)
    task = Task(id="t", instructions="x", evaluator=IN_ROOT)
    slow = task.model_copy(update={"environment": RootfsEnvironment(path=tmp_path)})
    options = EnvironmentOptions(timeout_s=0.05, cache=tmp_path / "cache")
    result = execute(slow, probe_spec(tmp_path / "f", options), tmp_path / "r1")
    assert (result.outcome, result.reward) == (Outcome.FAILED, 0.0)
    assert "not prepared within 0.05 s (harness.environment_timeout_s)" in result.detail
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    image = ImageEnvironment(image="python:3.11-slim", runtime="podman")
    result = execute(
        task.model_copy(update={"environment": image}),
        probe_spec(tmp_path / "f", EnvironmentOptions(cache=tmp_path / "cache")),
        tmp_path / "r2",
    )
    assert result.assessments[0].placeholder
    assert result.detail == "environment image python:3.11-slim: no 'podman' on PATH"
    auto = ImageEnvironment(image="python:3.11-slim")
    with pytest.raises(environments.EnvironmentUnavailable, match="no container runtime"):
        asyncio.run(prepare_environment(auto, EnvironmentOptions(), tmp_path))


FAKE_RUNTIME = """#!/bin/sh
echo "${{0##*/}} $*" >> "{log}"
case "$1 $2" in
  "image exists"|"image inspect") exit 1 ;;  # not on this node yet
esac
if [ "$1" = pull ]; then
  [ -n "$FAIL_PULL" ] && {{ echo "manifest unknown: $2" >&2; exit 125; }}
  [ "${{0##*/}}" = apptainer ] && echo sif > "$3"
fi
exit 0
"""


@pytest.mark.parametrize("runtime", ["podman", "docker", "apptainer"])
def test_an_image_is_pulled_once_per_node_with_the_runtimes_own_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: str
) -> None:
    """A stand-in runtime on PATH records what it is asked: whether the node has the
    image, then a pull, once for any number of preparations; a failed pull names the
    runtime's error."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / runtime).write_text(FAKE_RUNTIME.format(log=log))
    (bin_dir / runtime).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # the stand-in alone
    spec = ImageEnvironment(image="python:3.11-slim")  # auto: the only one on PATH
    options = EnvironmentOptions(cache=tmp_path / "cache", max_processes=64)
    prepared = [asyncio.run(prepare_environment(spec, options, tmp_path / "cache")) for _ in "ab"]
    calls = log.read_text().splitlines()
    if runtime == "apptainer":
        (sif,) = (tmp_path / "cache" / "images").iterdir()
        assert sif.suffix == ".sif" and sif.read_text() == "sif\n"
        assert len(calls) == 1 and calls[0].startswith("apptainer pull --force ")
        assert calls[0].endswith(" docker://python:3.11-slim")
        assert prepared == [Container("apptainer", str(sif), max_processes=64)] * 2
    else:
        exists = "image exists" if runtime == "podman" else "image inspect"
        assert calls == [
            f"{runtime} {exists} python:3.11-slim",
            f"{runtime} pull python:3.11-slim",
        ]
        assert prepared == [Container(runtime, "python:3.11-slim", max_processes=64)] * 2  # type: ignore[arg-type]
    monkeypatch.setenv("FAIL_PULL", "1")
    task = Task(id="t", instructions="x", evaluator=IN_ROOT, environment=spec)
    fresh = EnvironmentOptions(cache=tmp_path / "other-cache")
    result = execute(task, probe_spec(tmp_path / "f", fresh), tmp_path / "run")
    assert (result.outcome, result.reward, result.harness) == (Outcome.FAILED, 0.0, None)
    assert result.detail.startswith(f"environment image python:3.11-slim: {runtime} pull")
    assert "failed with status 125: manifest unknown: " in result.detail


FAKE_BUILDER = """#!/bin/sh
echo "${{0##*/}} $*" >> "{log}"
case "$1 $2" in
  "image exists"|"image inspect")  # only what it built (the shell alone: PATH is bare)
    while IFS= read -r line; do [ "$line" = "built $3" ] && exit 0; done < "{log}"
    exit 1 ;;
esac
if [ "$1" = build ]; then
  [ -n "$FAIL_BUILD" ] && {{ echo "Step 2/3 : RUN make: exit code 2" >&2; exit 1; }}
  echo "built $3" >> "{log}"
fi
exit 0
"""


@pytest.mark.parametrize("runtime", ["podman", "docker"])
def test_a_build_context_is_built_once_per_node_and_content_by_the_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: str
) -> None:
    """A stand-in runtime records what it is asked: whether the node has the image the
    context's digest names, then ``build --tag TAG --file CONTEXT/Dockerfile CONTEXT``
    (podman's and docker's documented flags), once; a changed context is another image;
    apptainer is never asked to build; a failed build is the placeholder with its
    error."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in (runtime, "apptainer"):
        (bin_dir / name).write_text(FAKE_BUILDER.format(log=log))
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    context = tmp_path / "env"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM ubuntu:24.04\nCOPY setup.sh /\n")
    (context / "setup.sh").write_text("make\n")
    spec = ImageEnvironment(build=context)  # auto: apptainer is on PATH too, and skipped
    options = EnvironmentOptions(cache=tmp_path / "cache")
    tag = f"qwengyre-env:{environments.context_digest(context)[:32]}"
    prepared = [asyncio.run(prepare_environment(spec, options, tmp_path / "cache")) for _ in "ab"]
    assert prepared == [Container(runtime, tag)] * 2  # type: ignore[arg-type]
    exists = "image exists" if runtime == "podman" else "image inspect"
    build = f"{runtime} build --tag {tag} --file {context}/Dockerfile {context}"
    assert log.read_text().splitlines() == [f"{runtime} {exists} {tag}", build, f"built {tag}"]
    # Another process on the node (a fresh cache) finds the image built.
    again = asyncio.run(prepare_environment(spec, options, tmp_path / "cache-2"))
    assert again == Container(runtime, tag)  # type: ignore[arg-type]
    assert log.read_text().splitlines()[3:] == [f"{runtime} {exists} {tag}"]
    (context / "setup.sh").chmod(0o755)  # the executable bit is content too
    changed = f"qwengyre-env:{environments.context_digest(context)[:32]}"
    assert changed != tag
    with pytest.raises(ValueError, match="apptainer builds no Dockerfile"):
        ImageEnvironment(build=context, runtime="apptainer")
    with pytest.raises(ValueError, match="exactly one of image"):
        ImageEnvironment(image="python:3.11-slim", build=context)
    monkeypatch.setenv("FAIL_BUILD", "1")
    task = Task(id="t", instructions="x", evaluator=IN_ROOT, environment=spec)
    result = execute(task, probe_spec(tmp_path / "f", options), tmp_path / "run")
    assert (result.outcome, result.reward, result.harness) == (Outcome.FAILED, 0.0, None)
    assert result.detail.startswith(f"environment image built from {context}: {runtime} build")
    assert result.detail.endswith("failed with status 1: Step 2/3 : RUN make: exit code 2")
    (context / "Dockerfile").unlink()
    result = execute(task, probe_spec(tmp_path / "f", options), tmp_path / "run2")
    assert (
        result.detail
        == f"environment image built from {context}: no Dockerfile in the build context"
    )


def test_environments_load_dump_and_name_the_bad_field(tmp_path: Path) -> None:
    base = {"id": "t", "instructions": "x", "evaluator": IN_ROOT.model_dump()}
    rootfs = {"type": "rootfs", "path": "envs/py.tgz", "share": ["/usr"]}
    image = {"type": "image", "image": "python:3.11-slim", "runtime": "docker"}
    built = {"type": "image", "build": "envs/py", "runtime": "auto"}
    tasks = [
        parse_task_line(json.dumps({**base, "id": f"t{i}", "environment": env}), tmp_path / "a")
        for i, env in enumerate((rootfs, image, built))
    ]
    assert tasks[0].environment == RootfsEnvironment(path=tmp_path / "envs/py.tgz", share=["/usr"])
    assert tasks[2].environment == ImageEnvironment(build=tmp_path / "envs/py")
    dump_tasks(tmp_path / "tasks.jsonl", tasks)
    written = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert [w["environment"] for w in written] == [rootfs, image, built]  # paths stay relative
    assert load_tasks(tmp_path / "tasks.jsonl") == tasks
    bad = {
        "vm": (
            "environment.type",
            "unknown environment type 'vm'; expected one of 'rootfs', 'image'",
        ),
        "share": ("environment.share", "'usr' is not an absolute path"),
        "runtime": ("environment.runtime", "'podman', 'docker' or 'apptainer'"),
        "image": ("environment.image", "must be an image name"),
        "neither": ("environment", "give exactly one of image (a name) and build"),
    }
    lines = {
        "vm": {"type": "vm"},
        "share": {"type": "rootfs", "path": "r", "share": ["usr"]},
        "runtime": {"type": "image", "image": "x", "runtime": "lxc"},
        "image": {"type": "image", "image": "two words"},
        "neither": {"type": "image", "runtime": "docker"},
    }
    for name, environment in lines.items():
        field, message = bad[name]
        with pytest.raises(TaskFileError) as caught:
            parse_task_line(json.dumps({**base, "environment": environment}), "t.jsonl", 3)
        assert f"t.jsonl:3: field '{field}'" in str(caught.value) and message in str(caught.value)


def test_the_config_keys_set_how_environments_are_prepared(tmp_path: Path) -> None:
    harness = Config.model_validate(
        {
            "harness": {
                "environment_timeout_s": 30,
                "environment_cache": str(tmp_path / "c"),
                "sandbox_expose": [str(tmp_path)],
                "limits": {"max_processes": 64, "max_memory_mb": 512},
            }
        }
    ).harness
    assert EnvironmentOptions.of(harness) == EnvironmentOptions(
        30.0, tmp_path / "c", (tmp_path,), 64, 512
    )
    assert EnvironmentOptions().cache_dir(tmp_path / "runs" / "r1") == (
        tmp_path / "runs" / environments.CACHE_NAME
    )
    with pytest.raises(ValueError, match="environment_timeout_s"):
        Config.model_validate({"harness": {"environment_timeout_s": 0}})


RELAY = [sys.executable, "-I", "-S", NETNS_RELAY, "--listen", f"127.0.0.1:{SANDBOX_PORT}"]
RELAY += ["--to", "/run/qwengyre/proxy.sock", "--"]


@pytest.mark.parametrize("uid", [1000, 0])
def test_each_runtime_gets_its_documented_command_line(
    monkeypatch: pytest.MonkeyPatch, uid: int
) -> None:
    monkeypatch.setattr(sandbox, "python_runtime", lambda: (Path("/opt/py"),))
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    monkeypatch.setattr(os, "getegid", lambda: uid)
    where = {"workspace": Path("/w"), "home": Path("/h"), "hidden": ()}
    share = (Path("/opt/tool"),)
    limited = {"max_processes": 64, "max_memory_mb": 512}
    env = ("HOME", "OPENAI_API_KEY", "PATH")
    sock = Path("/s.sock")
    volumes = ["--volume", "/w:/w", "--volume", "/h:/h"]
    volumes += ["--volume", "/opt/py:/opt/py:ro", "--volume", "/opt/tool:/opt/tool:ro"]
    volumes += ["--volume", "/s.sock:/run/qwengyre/proxy.sock", "--workdir", "/w"]
    volumes += ["--env", "TMPDIR=/tmp", "--env", "HOME", "--env", "OPENAI_API_KEY"]
    head = ["run", "--rm", "--pull", "never", "--network", "none", "--read-only"]
    head += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    tail = ["--pids-limit", "64", "--memory", "512m", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
    user = ["--user", f"{uid}:{uid}"]
    podman = Container("podman", "python:3.11-slim", share, **limited)
    assert podman.wrap(["claude", "-p"], proxy_socket=sock, env=env, **where) == [
        "podman",
        *head,
        *(["--userns", "keep-id"] if uid else user),
        *tail,
        *volumes,
        "python:3.11-slim",
        *RELAY,
        "claude",
        "-p",
    ]
    docker = Container("docker", "python:3.11-slim", share, **limited)
    assert docker.wrap(["claude", "-p"], proxy_socket=sock, env=env, **where) == [
        "docker",
        *head,
        *user,
        *tail,
        *volumes,
        "python:3.11-slim",
        *RELAY,
        "claude",
        "-p",
    ]
    apptainer = Container("apptainer", "/cache/images/a.sif", share)
    assert apptainer.wrap(["sh", "-c", "make test"], env=env, **where) == [
        "apptainer",
        "exec",
        "--contain",
        "--pid",
        "--ipc",
        "--no-privs",
        "--net",
        "--network",
        "none",
        "--home",
        "/h",
        "--bind",
        "/w:/w",
        "--bind",
        "/opt/py:/opt/py:ro",
        "--bind",
        "/opt/tool:/opt/tool:ro",
        "--pwd",
        "/w",
        "/cache/images/a.sif",
        "sh",
        "-c",
        "make test",
    ]


def test_a_rootfs_shows_its_root_around_what_the_sandbox_mounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root directory holding a mount point (the workspace here) is shown entry by
    entry around it; the root's own entries elsewhere are bound whole."""
    monkeypatch.setattr(sandbox, "python_runtime", lambda: ())
    root = tmp_path / "root"
    for path in ("srv/runs/other", "srv/data", "usr/bin"):
        (root / path).mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    argv = Rootfs(root).wrap(["x"], workspace=Path("/srv/runs/ws"), home=Path("/h"), hidden=())
    layout = argv[argv.index("--die-with-parent") + 1 : argv.index("--remount-ro")]
    assert layout == [
        "--symlink", "usr/bin", "/bin",
        "--dir", "/srv",
        "--ro-bind", str(root / "srv/data"), "/srv/data",
        "--dir", "/srv/runs",
        "--ro-bind", str(root / "srv/runs/other"), "/srv/runs/other",
        "--ro-bind", str(root / "usr"), "/usr",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        "--bind", "/h", "/h",
        "--tmpfs", "/var/tmp",
        "--bind", "/srv/runs/ws", "/srv/runs/ws",
    ]  # fmt: skip


@needs_bwrap
def test_a_rootfs_checks_that_its_shell_runs(tmp_path: Path) -> None:
    Rootfs(make_root(tmp_path / "good"), tuple(Path(p) for p in SHARE)).check()
    with pytest.raises(SandboxUnavailable, match="cannot run /bin/sh in it"):
        Rootfs(make_root(tmp_path / "bare")).check()


def test_what_a_sandbox_hides_stays_hidden_inside_a_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "python_runtime", lambda: ())
    (tmp_path / "tool" / "keys").mkdir(parents=True)
    (tmp_path / "tool" / "token").write_text("t")
    where = {"workspace": tmp_path / "w", "home": tmp_path / "h"}
    hidden = (tmp_path / "tool" / "keys", tmp_path / "tool" / "token", tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    docker = Container("docker", "img", (tmp_path / "tool",)).wrap(["x"], hidden=hidden, **where)
    keys, token = hidden[0], hidden[1]
    at = docker.index(f"{tmp_path}/tool:{tmp_path}/tool:ro")
    assert docker[at + 1 : at + 5] == ["--tmpfs", str(keys), "--volume", f"/dev/null:{token}:ro"]
    assert str(tmp_path / "elsewhere") not in " ".join(docker)  # not shown: nothing to cover
    rootfs = Rootfs(tmp_path / "root", (tmp_path / "tool",)).wrap(["x"], hidden=hidden, **where)
    assert ["--tmpfs", str(keys)] == rootfs[
        rootfs.index(str(keys)) - 1 : rootfs.index(str(keys)) + 1
    ]
    assert ["--ro-bind", "/dev/null", str(token)] == rootfs[
        rootfs.index(str(token)) - 2 : rootfs.index(str(token)) + 1
    ]
    assert rootfs[rootfs.index("/") - 1 : rootfs.index("/") + 3] == [
        "--remount-ro",
        "/",
        "--remount-ro",
        str(keys),
    ]


def _startable_runtime(tmp_path: Path) -> Container:
    """A container runtime on this machine that starts a container of a root made here
    (imported as an image), found by trying; skips with what each said."""
    root = make_root(tmp_path / "image-root")
    tar = archive(root, tmp_path / "image.tar")
    why = []
    for runtime in environments.RUNTIMES:
        if shutil.which(runtime) is None:
            why.append(f"{runtime}: not on PATH")
            continue
        image = str(root)  # apptainer runs a directory as it is
        if runtime != "apptainer":
            image = "localhost/qwengyre-environment-test:latest"
            done = subprocess.run(
                [runtime, "import", str(tar), image], capture_output=True, text=True, timeout=120
            )
            if done.returncode != 0:
                why.append(f"{runtime} import: {done.stderr.strip()[-200:]}")
                continue
        confine = Container(runtime, image, tuple(Path(p) for p in SHARE))
        try:
            confine.check()
        except SandboxUnavailable as error:
            why.append(str(error)[-300:])
            continue
        return confine
    pytest.skip("no container runtime can start a container here: " + "; ".join(why))


def test_a_container_runtime_runs_the_harness_in_its_image_and_reaches_the_proxy(
    tmp_path: Path,
) -> None:
    confine = _startable_runtime(tmp_path)
    workspace, logs = tmp_path / "run" / "ws", tmp_path / "run" / "logs"
    workspace.mkdir(parents=True)
    host_file = tmp_path / "on-the-machine-only.txt"
    host_file.write_text("x")
    spec = HarnessSpec(
        command=(sys.executable, "-c", PROBE),
        deadline_s=120,
        env={"HOST_FILE": str(host_file)},
        sandbox=confine,
    )

    async def scenario(proxy: Upstream) -> None:
        launch = prepare_harness(
            spec,
            workspace=workspace,
            logs_dir=logs,
            execution_id="ex_1",
            base_url=proxy.url,
            api_key="qg-real",
            instructions="look around",
        )
        run = await supervise(launch)
        assert run.ok, (logs / "stderr.log").read_text()

    with_upstream(scenario)
    saw = json.loads((workspace / "seen.json").read_text())
    assert (saw["marker"], saw["host_file"], saw["proxy"]) == ("only-in-the-root", False, "hi")


@needs_bwrap
def test_a_rollout_runs_the_toy_harness_in_its_tasks_archive_and_grades_it_there(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``qwengyre rollout`` end to end: the config's cache, an archive unpacked once for
    the group, the toy harness reaching the proxy from inside (its calls are traced),
    the evaluator seeing the root's marker, with ``harness.sandbox=none`` for the run."""
    archive(make_root(tmp_path / "root"), tmp_path / "envs" / "root.tgz")
    environment = RootfsEnvironment(path=tmp_path / "envs" / "root.tgz", share=SHARE)
    (example,) = load_tasks(example_tasks_path())[:1]
    task = example.model_copy(update={"environment": environment, "evaluator": IN_ROOT})
    dump_tasks(tmp_path / "tasks.jsonl", [task])
    cache = tmp_path / "cache"
    options = _options(
        tmp_path,
        tiny_model_dir,
        tmp_path / "tasks.jsonl",
        "harness.sandbox=none",
        f"harness.environment_cache={cache}",
    )
    rows = asyncio.run(rollout(options))
    assert [(outcome, reward) for _, _, outcome, reward in rows] == [("completed", 1.0)] * 2
    traces = read_trace(options.run_dir / "traces.jsonl")
    assert len(traces) == 2 and all(t.calls for t in traces)  # through the proxy relay
    assert len(list((cache / "rootfs").iterdir())) == 1
