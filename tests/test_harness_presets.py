"""The ``qwen-code``, ``opencode`` and ``codex`` harness presets (their launch: argv, environment,
the settings written into the private home) and the request-class rule set a harness
preset brings to ``proxy.classes``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwengyre.apps.preflight import PreflightError, require_program
from qwengyre.config import load_config
from qwengyre.rollout.harness import (
    CODEX_BIN_ENV,
    OPENCODE_BIN_ENV,
    QWEN_BIN_ENV,
    HarnessSpec,
    harness_spec,
    prepare_harness,
)

BRACES = "Fix {x} -- then --yolo"  # a task whose text looks like a template and flags


def launch(name: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    return prepare_harness(
        harness_spec(name, 60),
        workspace=tmp_path,
        logs_dir=tmp_path / "logs",
        execution_id="ex_1",
        base_url="http://127.0.0.1:9/x/ex_1",
        api_key="sk-secret",
        instructions=BRACES,
    )


def test_qwen_code_runs_unattended_offline_with_its_settings_in_the_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(QWEN_BIN_ENV, "/opt/{q}/qwen")
    run = launch("qwen-code", tmp_path)
    home = tmp_path / "logs" / "home"
    assert run.argv == ("/opt/{q}/qwen", "--yolo", "--output-format", "json", f"--prompt={BRACES}")
    assert run.env["HOME"] == str(home) and run.env["OPENAI_MODEL"] == "qwengyre"
    assert run.env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/x/ex_1/v1"
    settings = json.loads((home / ".qwen" / "settings.json").read_text())
    assert settings["security"]["auth"]["selectedType"] == "openai"
    assert settings["telemetry"]["enabled"] is False
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["general"]["enableAutoUpdate"] is False
    assert not any(settings["memory"].values())  # no background memory agents
    assert settings["tools"] == {"approvalMode": "yolo", "sandbox": False}
    assert "sk-secret" not in json.dumps(settings)


def test_opencode_runs_unattended_offline_with_its_config_in_the_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(OPENCODE_BIN_ENV, raising=False)
    run = launch("opencode", tmp_path)
    home = tmp_path / "logs" / "home"
    assert run.argv[:7] == ("opencode", "run", "--auto", "--pure", "--format", "json", "--")
    assert run.argv[7:] == (BRACES,)
    for off in ("AUTOUPDATE", "MODELS_FETCH", "SHARE", "LSP_DOWNLOAD", "PROJECT_CONFIG"):
        assert run.env[f"OPENCODE_DISABLE_{off}"] == "1"
    assert run.env["npm_config_offline"] == "true"  # its plugin install never fetches
    config = json.loads((home / ".config" / "opencode" / "opencode.json").read_text())
    provider = config["provider"]["qwengyre"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    # read from the environment when it starts: the key is never on disk
    assert provider["options"] == {
        "baseURL": "{env:OPENAI_BASE_URL}",
        "apiKey": "{env:OPENAI_API_KEY}",
    }
    assert config["model"] == config["small_model"] == "qwengyre/qwengyre"
    assert config["autoupdate"] is False and config["share"] == "disabled"


def test_codex_runs_unattended_with_its_config_in_the_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CODEX_BIN_ENV, raising=False)
    run = launch("codex", tmp_path)
    home = tmp_path / "logs" / "home"
    assert run.argv[:3] == ("codex", "exec", "--strict-config")
    assert "--dangerously-bypass-approvals-and-sandbox" in run.argv
    assert run.argv[-2:] == ("--", BRACES)
    assert run.env["CODEX_HOME"] == str(home / ".codex")
    config = (home / ".codex" / "config.toml").read_text()
    assert 'base_url = "http://127.0.0.1:9/x/ex_1/v1"' in config  # the execution's
    assert 'wire_api = "responses"' in config and 'env_key = "OPENAI_API_KEY"' in config
    assert "check_for_update_on_startup = false" in config
    assert "[analytics]\nenabled = false" in config and "[feedback]\nenabled = false" in config
    assert "sk-secret" not in config  # the key stays in the environment


def test_home_files_replace_a_link_the_harness_left(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("operator's")
    home = tmp_path / "logs" / "home"
    (home / ".qwen").mkdir(parents=True)
    (home / ".qwen" / "settings.json").symlink_to(outside)
    launch("qwen-code", tmp_path)
    assert outside.read_text() == "operator's"
    assert not (home / ".qwen" / "settings.json").is_symlink()


@pytest.mark.parametrize("name", ["/etc/passwd", "../escape", "a/../../b", ""])
def test_home_files_stay_inside_the_home(name: str) -> None:
    with pytest.raises(ValueError, match="inside the home"):
        HarnessSpec(command=("x", "{instructions}"), deadline_s=1, files={name: "text"})


def test_home_files_are_templates(tmp_path: Path) -> None:
    spec = HarnessSpec(command=("x",), deadline_s=1, files={"a/b.txt": "{workspace} {{literal}}"})
    prepare_harness(
        spec,
        workspace=tmp_path,
        logs_dir=tmp_path / "logs",
        execution_id="e",
        base_url="http://h",
        api_key="k",
        instructions="",
    )
    assert (tmp_path / "logs/home/a/b.txt").read_text() == f"{tmp_path} {{literal}}"
    with pytest.raises(ValueError, match=r"unknown placeholder \{api_key\}"):
        HarnessSpec(command=("x",), deadline_s=1, files={"k": "{api_key}"})


@pytest.mark.parametrize(
    ("name", "package"),
    [
        ("qwen-code", "@qwen-code/qwen-code"),
        ("opencode", "opencode-ai"),
        ("codex", "@openai/codex"),
    ],
)
def test_preflight_names_the_npm_package_of_a_missing_client(
    name: str, package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(QWEN_BIN_ENV, raising=False)
    monkeypatch.delenv(OPENCODE_BIN_ENV, raising=False)
    monkeypatch.delenv(CODEX_BIN_ENV, raising=False)
    spec = harness_spec(name, 60)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PreflightError, match=f"npm install -g {package}"):
        require_program(spec, name)


@pytest.mark.parametrize(
    ("harness", "classes"),
    [
        ("qwen-code", "qwen-code"),
        ("opencode", "opencode"),
        ("codex", "codex"),
        ("claude-code", "claude-code"),
        ("claude-code-bare", "claude-code"),
        ("toy", "claude-code"),
        ("my-agent {instructions}", "claude-code"),
    ],
)
def test_a_harness_preset_brings_its_rule_set(harness: str, classes: str) -> None:
    assert load_config(None, [f"harness.name={harness}"]).proxy.classes == classes


def test_a_rule_set_the_user_names_wins_over_the_harness_s() -> None:
    config = load_config(None, ["harness.name=qwen-code", "proxy.classes=opencode"])
    assert config.proxy.classes == "opencode"
    mine = load_config(None, ["harness.name=opencode", "proxy.classes=mine.yaml"])
    assert mine.proxy.classes == "mine.yaml"


def test_train_harness_flag_picks_the_preset_and_checks_its_client(tmp_path: Path) -> None:
    """``qwengyre train --harness NAME --check``: the preset's argv, or the npm package
    that is missing; refused together with an override of the same key."""
    from tests.test_cli import run

    missing = run("train", "--harness", "opencode", "--check", env={"PATH": str(tmp_path)})
    assert missing.returncode != 0
    assert "npm install -g opencode-ai, or set QWENGYRE_OPENCODE_BIN" in missing.stderr
    fake = tmp_path / "qwen"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    found = run("train", "--harness", "qwen-code", "--check", env={QWEN_BIN_ENV: str(fake)})
    assert found.returncode == 0, found.stderr
    assert f"harness {fake} --yolo --output-format json" in found.stdout
    both = run("train", "--harness", "qwen-code", "harness.name=toy", "--check")
    assert both.returncode != 0 and "--harness and the override harness.name" in both.stderr
