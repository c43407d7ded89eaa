"""The ``qwengyre`` command: help, config show, model init-tiny and export, simulate, user
errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qwengyre", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_help_lists_the_subcommands():
    out = run("--help")
    assert out.returncode == 0
    for command in ("config", "model", "simulate"):
        assert command in out.stdout


def test_config_show_prints_the_resolved_yaml(tmp_path: Path):
    file = tmp_path / "c.yaml"
    file.write_text("groups:\n  size: 8\n")
    out = run("config", "show", str(file), "scheduler.policy=async")
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["groups"]["size"] == 8 and shown["scheduler"]["policy"] == "async"
    # Overrides alone work too (no file).
    assert yaml.safe_load(run("config", "show", "groups.batch=4").stdout)["groups"]["batch"] == 4


def test_user_errors_are_one_line_without_traceback():
    for args, fragment in [
        (("config", "show", "trainer.nonexistent=1"), "trainer.nonexistent"),
        (("config", "show", "groups.size=-4"), "groups.size=-4"),
        (("config", "show", "/nonexistent/c.yaml"), "cannot read config file"),
        (("simulate", "--preset", "nope"), "unknown preset 'nope'"),
        (("simulate", "sim.steps=2", "--compare"), "--compare needs --target-staleness"),
    ]:
        out = run(*args)
        assert out.returncode != 0
        assert out.stderr.count("\n") == 1 and fragment in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_verbose_shows_the_traceback():
    out = run("--verbose", "config", "show", "groups.size=-4")
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_model_init_tiny_builds_an_offline_hf_model(tmp_path: Path):
    target = tmp_path / "m"
    out = run("model", "init-tiny", str(target), "--size", "test", env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert (target / "config.json").exists() and (target / "tokenizer.json").exists()
    again = run("model", "init-tiny", str(target), "--size", "test")
    assert again.returncode != 0 and "Traceback" not in again.stderr


def test_model_init_tiny_untied_builds_a_separate_lm_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    import safetensors.torch

    from qwengyre.cli import main

    target = tmp_path / "m"
    assert main(["model", "init-tiny", str(target), "--size", "test", "--untied"]) == 0
    assert "untied" in capsys.readouterr().out
    assert json.loads((target / "config.json").read_text())["tie_word_embeddings"] is False
    weights = safetensors.torch.load_file(str(target / "model.safetensors"))
    assert weights["lm_head.weight"].shape == weights["model.embed_tokens.weight"].shape


def test_model_init_tiny_template_builds_the_qwen3_coder_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from transformers import AutoTokenizer

    from qwengyre.cli import main

    target = tmp_path / "m"
    args = ["model", "init-tiny", str(target), "--size", "test", "--template", "qwen3-coder"]
    assert main(args) == 0
    assert "qwen3-coder template" in capsys.readouterr().out
    template = AutoTokenizer.from_pretrained(target).chat_template
    assert "<function=" in template and "reasoning_content" in template
    bad = run("model", "init-tiny", str(tmp_path / "n"), "--template", "mistral")
    assert bad.returncode != 0 and "qwen3-coder" in bad.stderr and "Traceback" not in bad.stderr


def test_model_init_tiny_moe_builds_a_qwen3_moe(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from qwengyre.cli import main

    target = tmp_path / "m"
    assert main(["model", "init-tiny", str(target), "--size", "test", "--moe"]) == 0
    assert "tiny Qwen3-MoE model" in capsys.readouterr().out
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_local_experts"] == 4


def test_model_export_writes_the_latest_checkpoint_of_a_run_as_an_hf_model(
    tmp_path: Path, tiny_model_dir: Path
):
    import torch
    from transformers import AutoModelForCausalLM

    from qwengyre.config import TrainerConfig
    from qwengyre.training.checkpoint import save_sharded_checkpoint
    from qwengyre.training.distributed import CellComm
    from qwengyre.training.trainer import Trainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = Trainer(model, TrainerConfig(), CellComm(0, 1, ""))
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2):  # step 2 (the latest) holds halved weights
        if step == 2:
            with torch.no_grad():
                for param in trainer.model.parameters():
                    param.mul_(0.5)
        save_sharded_checkpoint(
            root, step=step, trainer=trainer, state={}, keep=2, model_dir=tiny_model_dir
        )
    expected = {
        k: v.full_tensor().to(torch.bfloat16) for k, v in trainer.model.state_dict().items()
    }

    out = run("model", "export", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "bfloat16")
    assert out.returncode == 0, out.stderr
    assert "exported step 2" in out.stdout
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported.dtype == torch.bfloat16
    state = exported.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key

    for args, fragment in [
        ((str(tmp_path / "run"), str(tmp_path / "hf")), "must be empty or absent"),
        ((str(tmp_path), str(tmp_path / "o")), f"no complete checkpoint in {tmp_path}"),
        ((str(tmp_path / "nope"), str(tmp_path / "o")), "is not a directory"),
    ]:
        refused = run("model", "export", *args)
        assert refused.returncode == 2 and fragment in refused.stderr, refused.stderr
        assert refused.stderr.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_simulate_compare_writes_json_and_plots(tmp_path: Path):
    out = run(
        "simulate",
        "--preset",
        "paper-122b",
        "--compare",
        "--target-staleness",
        "1.5",
        "sim.steps=3",
        "groups.batch=4",
        "cells.capacity=18",
        "--json",
        str(tmp_path / "o.json"),
        "--plot",
        str(tmp_path / "plots"),
    )
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["target_staleness"] == 1.5
    elastic = data["policies"]["elastic"]
    for key in (
        "end_to_end_s",
        "step_times_s",
        "mean_staleness",
        "predicted_staleness",
        "lower_bound_s",
        "cell_training_share",
        "rollout_utilisation",
        "speedup_vs_async",
        "speedup_vs_colocate",
    ):
        assert key in elastic
    assert (elastic["mu"], elastic["phi"]) == (3, 0.5)
    policies = data["policies"]
    for policy in ("async", "colocate"):  # the fastest at E[d] = 1.5 (Eq 2)
        best = policies[policy]
        assert best["phi"] + (best["mu"] - 1) / 2 == 1.5 and best["note"].startswith("best of")
    assert policies["async (paper)"]["phi"] == 1.5
    assert (policies["colocate (paper)"]["mu"], policies["colocate (paper)"]["phi"]) == (4, 0)
    assert len(elastic["step_times_s"]) == 3
    assert elastic["speedup_vs_async"] == (
        data["policies"]["async"]["end_to_end_s"] / elastic["end_to_end_s"]
    )
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert "speedup.png" in pngs and "timeline_elastic.png" in pngs
    assert "elastic" in out.stdout and "colocate" in out.stdout


@pytest.mark.parametrize(
    "engine",
    [
        ["proxy.engine=scripted", "proxy.script="],
        [],  # a bare proxy: the scripted engine's default replies
        ["proxy.engine=embedded", "engine.dtype=bfloat16", "engine.max_context=512"],
    ],
)
def test_proxy_serve_answers_a_real_client(tmp_path: Path, tiny_model_dir: Path, engine):
    import socket
    import time

    import anthropic
    import httpx2

    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": ["Hello from the script."]}))
    if engine[:1] == ["proxy.engine=scripted"]:
        engine = [engine[0], f"proxy.script={script}"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    admin = "cli-admin-token-0123456789"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qwengyre",
            "proxy",
            "serve",
            "--model",
            str(tiny_model_dir),
            *engine,
            "--store",
            str(tmp_path / "store"),
            "--port",
            str(port),
            "--admin-token",
            admin,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx2.head(url + "/").status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.1)
        created = httpx2.post(
            url + "/admin/executions", headers={"authorization": f"Bearer {admin}"}
        ).json()
        assert created["base_url"] == f"{url}/x/{created['id']}"
        client = anthropic.Anthropic(
            api_key=created["key"], base_url=created["base_url"], max_retries=0
        )
        reply = client.messages.create(
            model="tiny", max_tokens=30, messages=[{"role": "user", "content": "hi"}]
        )
        if engine[:1] == ["proxy.engine=scripted"]:
            assert reply.content[0].text == "Hello from the script."
        elif not engine:  # says how to serve something of one's own
            assert reply.content[0].text.startswith("Set proxy.script")
        else:  # the tiny model samples: it answered, and the call is recorded with log-probs
            assert 0 < reply.usage.output_tokens <= 30
            tree = httpx2.get(
                f"{url}/admin/executions/{created['id']}/tree",
                headers={"authorization": f"Bearer {admin}"},
            ).json()
            (node,) = tree["nodes"]
            assert node["engine"] == "embedded" and node["versions"] == [0] * len(node["logprobs"])
            assert len(node["output_ids"]) == len(node["logprobs"]) == reply.usage.output_tokens
            assert all(-30 < logprob < 0 for logprob in node["logprobs"])
    finally:
        proc.terminate()
        proc.wait(120)  # a loaded machine: the test is not about speed


def test_proxy_serve_refuses_a_missing_model_dir(tmp_path: Path):
    out = run(
        "proxy",
        "serve",
        "--model",
        str(tmp_path / "nope"),
        f"proxy.script={tmp_path / 's'}",
        "--store",
        str(tmp_path / "st"),
    )
    assert out.returncode != 0 and "not a HuggingFace model directory" in out.stderr
    assert "Traceback" not in out.stderr


def test_engine_serve_refuses_a_missing_model_dir(tmp_path: Path):
    out = run("engine", "serve", "--model", str(tmp_path / "nope"))
    assert out.returncode != 0 and "not a HuggingFace model directory" in out.stderr


@pytest.mark.parametrize(
    ("tasks", "logged"),
    [
        ("swe:example", "FAIL_TO_PASS: "),
        ("terminal:example", " exited with status "),
        ("spec:example", "hidden tests: "),
    ],
)
def test_rollout_cli_runs_and_grades_each_workload_format_s_example(
    tmp_path: Path, tiny_model_dir: Path, tasks: str, logged: str
):
    """Each bundled workload example through ``qwengyre rollout --tasks FORMAT:example``
    with the toy harness: two tasks, each execution graded by its format's grader (a
    valid assessment, its test log kept as the critique)."""
    from qwengyre.records.assessments import read_assessments

    out = run(
        "rollout",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        tasks,
        "--harness",
        "toy",
        "--run-dir",
        str(tmp_path / "run"),
        "groups.size=1",
        "groups.min_valid=null",
        "cells.capacity=4",
        "harness.deadline_s=60",
        "harness.budget_s=180",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 executions (completed 2)" in out.stdout
    finals = [
        r.assessment
        for r in read_assessments(tmp_path / "run" / "assessments.jsonl")
        if r.assessment.kind == "final"
    ]
    assert len(finals) == 2
    assert all(a.valid and a.evaluator == "command" and logged in a.critique for a in finals)


def test_an_unknown_task_format_is_refused_naming_the_allowed_ones(tmp_path: Path):
    out = run("train", "--tasks", "swebench:data.jsonl", "--check")
    assert out.returncode == 2
    assert "unknown task format 'swebench'" in out.stderr
    assert "one of swe, terminal, spec" in out.stderr
    ready = run("train", "--tasks", "terminal:example", "--check")
    assert ready.returncode == 0, ready.stderr[-2000:]
    assert "ready: 2 tasks" in ready.stdout


def test_the_readme_s_scripted_replies_load(tiny_model_dir: Path):
    """The file the README's scripted-proxy line names ships with the repository."""
    from transformers import AutoTokenizer

    from qwengyre.engines.scripted import ScriptedEngine

    path = Path(__file__).parents[1] / "examples" / "replies.json"
    assert "proxy.script=examples/replies.json" in (path.parents[1] / "README.md").read_text()
    engine = ScriptedEngine.from_file(AutoTokenizer.from_pretrained(tiny_model_dir), path)
    assert {"main.task", "sub.task", "main.summary", "default"} <= set(engine.script)


def test_a_resume_of_a_directory_that_is_no_run_is_refused_before_torch_loads(tmp_path: Path):
    code = (
        "import sys; from qwengyre.cli import main; "
        f"rc = main(['train', '--resume', {str(tmp_path / 'nope')!r}]); "
        "print(rc, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "is not a training run (no config.yaml) to resume" in done.stderr


def test_init_tiny_into_a_directory_in_use_names_the_flag(tmp_path: Path):
    (tmp_path / "mine.txt").write_text("x")
    out = run("model", "init-tiny", str(tmp_path))
    assert out.returncode == 2 and "pass --force to write over it" in out.stderr
    assert "overwrite=True" not in out.stderr and (tmp_path / "mine.txt").exists()


def test_a_second_proxy_on_a_store_in_use_is_refused_naming_the_first(
    tmp_path: Path, tiny_model_dir: Path
):
    import socket
    import time

    from qwengyre.runtime.lock import LOCK_FILE

    def serve(port: int) -> list[str]:
        store = ["--store", str(tmp_path / "store"), "--port", str(port)]
        model = ["--model", str(tiny_model_dir)]
        return [sys.executable, "-m", "qwengyre", "proxy", "serve", *model, *store]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lock = tmp_path / "store" / LOCK_FILE
    first = subprocess.Popen(serve(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while f'"pid": {first.pid},' not in (lock.read_text() if lock.exists() else ""):
            assert first.poll() is None and time.monotonic() < deadline, "the first never held it"
            time.sleep(0.1)
        second = subprocess.run(serve(port + 1), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert f"is in use by pid {first.pid}" in second.stderr, second.stderr
    finally:
        first.terminate()
        first.wait(120)


def test_serving_on_a_device_that_is_not_there_is_refused_before_the_model_loads(
    tmp_path: Path, tiny_model_dir: Path
):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proxy = ["proxy", "serve", "--model", str(tmp_path / "no-model"), "--store", str(tmp_path)]
    out = run(*proxy, "proxy.engine=embedded", "run.device=cuda")  # checked before the model
    assert out.returncode == 2 and "run.device is 'cuda'" in out.stderr, out.stderr
    out = run("engine", "serve", "--model", str(tiny_model_dir), "run.device=cuda")
    assert out.returncode == 2 and "run.device is 'cuda'" in out.stderr, out.stderr
