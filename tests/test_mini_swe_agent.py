"""mini-swe-agent (an OpenAI-API harness, via litellm) through the proxy.

mini-swe-agent is a heavy install (litellm; ~800 MB), so the suite does not install
it: the test runs where its ``mini`` command is on PATH or named by
``QWENGYRE_MINI_SWE_AGENT`` and skips, saying so, elsewhere. Measured here with
mini-swe-agent 2.4.6: two calls, the bash tool really runs, the second call extends
the first in the tree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.test_proxy_server import Running, start

from qwengyre.engines.scripted import ScriptedEngine

pytestmark = pytest.mark.slow  # seconds to minutes; still in the default suite


def bash(command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<tool_call>\n{call}\n</tool_call>"


SCRIPT = {
    "default": [bash("echo hi > out.txt"), bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]
}


@pytest.fixture
def mini() -> str:
    found = os.environ.get("QWENGYRE_MINI_SWE_AGENT") or shutil.which("mini")
    if not found:
        pytest.skip("mini-swe-agent is not installed (pip install mini-swe-agent)")
    return found


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Running]:
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), SCRIPT)
    yield from start(tmp_path, tiny_model_dir, engines=[engine], max_context=1_000_000)


def test_mini_swe_agent_runs_through_the_proxy(mini: str, proxy: Running, tmp_path: Path):
    ex = proxy.new_execution()
    workspace, config = tmp_path / "ws", tmp_path / "cfg"
    workspace.mkdir()
    config.mkdir()
    env = {
        **os.environ,
        "MSWEA_CONFIGURED": "true",
        "MSWEA_GLOBAL_CONFIG_DIR": str(config),
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "MSWEA_SILENT_STARTUP": "1",
    }
    done = subprocess.run(
        [
            mini,
            "-m",
            "openai/tiny",
            "-t",
            "write hi to out.txt",
            "-y",
            "--exit-immediately",
            "-c",
            "mini.yaml",
            "-c",
            f"model.model_kwargs.api_base={ex['openai_base_url']}",
            "-c",
            f"model.model_kwargs.api_key={ex['key']}",
            "-o",
            str(tmp_path / "traj.json"),
        ],
        cwd=workspace,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (workspace / "out.txt").read_text() == "hi\n"
    nodes = proxy.tree(ex["id"])
    assert [(n["parent"], n["class"]) for n in nodes] == [(None, "main.task"), (0, "main.task")]
