"""The README's tour of the CLI, walked as a newcomer would, from the repository's own
files, in a short form: every ``qwengyre`` line runs as written, except that

- ``train`` lines get ``--check`` (the config resolves and the run's preflight passes:
  its tasks, harness, sandbox, engine, device; a real run is tests/test_runtime_*.py),
- ``simulate`` and ``plan`` lines get ``sim.steps=3``,
- ``proxy serve`` and ``engine serve`` run until they answer, then are stopped,
- ``/tmp/tiny``, ``DIR``, ``my.yaml`` and ``runs/...`` are a tiny model, a small config
  file and recorded runs of the test's own.

A line that needs what this machine lacks (:data:`CANNOT_RUN_HERE`: Claude Code, a vLLM
or SGLang environment, a GPU, ...) must then fail in one line naming it; every other line
must succeed. A README line changed or added is walked too: the README cannot drift from
the code unnoticed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.test_report import _async_records, _write_run

from qwengyre.config import config_to_yaml, load_config
from qwengyre.presets import preset_path

pytestmark = pytest.mark.slow

README = Path(__file__).parents[1] / "README.md"
CANNOT_RUN_HERE = {
    "examples/claude-code.yaml": "Claude Code is not installed here",
    "--harness claude-code": "Claude Code is not installed here",
    "--harness opencode": "OpenCode is not installed here",
    "engine.backend=vllm": "no vLLM environment here",
    "engine.backend=sglang": "SGLang starts only on a GPU machine",
    "run.device=cuda": "no GPU here",
    "~/.npm-global": "no ~/.npm-global here",
    "metrics.wandb_project": "wandb may not be installed",
    "harness.hosts=ray": "harness.hosts=ray over nodes needs a Ray cluster",
    "plan --trace": "needs the traces of a finished training run",
}


def tour() -> list[str]:
    """The tour's command lines (continuations joined, comments dropped)."""
    text = README.read_text()
    block = text[text.index("## A tour of the CLI") :]
    start = block.index("```bash") + len("```bash")
    block = block[start : block.index("\n```", start)]
    lines = block.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in lines if "qwengyre " in line]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A working directory with what the tour's lines name."""
    root = tmp_path_factory.mktemp("tour")
    shutil.copytree(tiny_model_dir, root / "tiny")
    shutil.copytree(README.parent / "examples", root / "examples")
    (root / "my.yaml").write_text("groups:\n  size: 8\n")
    config = config_to_yaml(load_config(preset_path("embedded")))
    for name, records in (("async", _async_records()), ("elastic", None), ("colocate", None)):
        run = root / "runs" / name
        run.mkdir(parents=True)
        _write_run(run, records)
        (run / "config.yaml").write_text(config)
    return root


@pytest.mark.parametrize("line", tour())
def test_a_readme_line_runs_as_written(line: str, home: Path) -> None:
    built = line.startswith("qwengyre model init-tiny")  # a directory of its own
    tiny = home / ("built" if built else "tiny")
    shutil.rmtree(home / "built", ignore_errors=True)
    words = shlex.split(line.replace("/tmp/tiny", str(tiny)))
    env = dict(os.environ)
    while "=" in words[0]:  # VAR=value before the command
        name, _, value = words.pop(0).partition("=")
        env[name] = value.replace("$TOKEN", "tour-admin-token-0123456789")
    assert words[0] == "qwengyre", line
    words = [str(home / "tiny") if w == "DIR" else w for w in words]
    command = [sys.executable, "-m", "qwengyre", *words[1:]]
    if words[1] == "train":
        command.append("--check")
    elif words[1] in ("simulate", "plan"):
        command.append("sim.steps=3")
    cannot = next((why for key, why in CANNOT_RUN_HERE.items() if key in line), None)
    if words[1:3] in (["proxy", "serve"], ["engine", "serve"]):
        served, err = serve(command, home, env)
    else:
        done = subprocess.run(
            command, cwd=home, env=env, capture_output=True, text=True, timeout=900
        )
        served, err = done.returncode == 0, done.stderr
    if cannot is not None and not served:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("qwengyre: error: "), (cannot, err)
    else:
        assert served, err[-3000:]


def serve(command: list[str], home: Path, env: dict[str, str]) -> tuple[bool, str]:
    """Start a server line (on a port of its own) until it answers, or until it exits."""
    if "--port" in command:
        command[command.index("--port") + 1] = str(port := free_port())
    else:
        command += ["--port", str(port := free_port())]
    if "--store" in command:
        at = command.index("--store") + 1
        command[at] = str(home / command[at])
    process = subprocess.Popen(
        command, cwd=home, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return True, ""
            time.sleep(0.2)
        return False, process.stderr.read() if process.poll() is not None else "no answer"  # type: ignore[union-attr]
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
