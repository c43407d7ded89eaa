"""One config tree for every command: rollout, proxy serve and engine serve read the
same YAML + overrides as train; shortcuts, ``config show COMMAND``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from qwengyre import cli
from qwengyre.apps.rollout import RolloutOptions
from qwengyre.apps.serve import model_dir
from qwengyre.config import Config
from qwengyre.rollout.tasks import example_tasks_path

SHARED = """
groups: {size: 3, oversample: 1, batch: 2, min_valid: 2}
cells: {count: 2, capacity: 5}
trainer: {temperature: 0.7}
model: {path: MODEL}
run: {device: cpu}
harness: {name: toy, deadline_s: 30, budget_s: 40}
proxy: {port: 8181, engine: embedded, store: STORE, harness_sampling: true, max_resident: 7}
engine: {port: 30301, dtype: bfloat16, max_context: 1024}
"""


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    path = tmp_path / "shared.yaml"
    path.write_text(SHARED.replace("MODEL", str(model)).replace("STORE", str(tmp_path / "st")))
    return path


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stand-ins for what the commands would start: they record their options."""
    seen: dict[str, Any] = {}

    async def rollout(options: RolloutOptions) -> list[Any]:
        seen["rollout"] = options
        return []

    class Engine:
        def __init__(self, model: Any, **kwargs: Any) -> None:
            seen["engine"] = {"model": model, **kwargs}

        def close(self) -> None:  # once its server stops
            seen["closed"] = "bind" in seen

    def run_app(app: Any, **kwargs: Any) -> None:
        seen["bind"] = kwargs

    monkeypatch.setattr("qwengyre.apps.rollout.rollout", rollout)

    def serve(config: Config, admin_token: str | None) -> None:
        seen.update(proxy=config, admin_token=admin_token)

    monkeypatch.setattr("qwengyre.apps.serve.serve", serve)
    monkeypatch.setattr("qwengyre.engines.factory.EmbeddedEngine", Engine)
    monkeypatch.setattr("aiohttp.web.run_app", run_app)
    return seen


def test_one_yaml_configures_rollout_proxy_and_engine(
    shared: Path, tmp_path: Path, captured: dict[str, Any]
):
    model = tmp_path / "model"
    assert cli.main(["rollout", str(shared), "--run-dir", str(tmp_path / "r")]) == 0
    options: RolloutOptions = captured["rollout"]
    assert (options.run_dir, options.resume) == (tmp_path / "r", False)
    rolled = options.config
    assert (rolled.model.path, rolled.harness.name, rolled.run.device) == (model, "toy", "cpu")
    assert (rolled.groups.size, rolled.groups.oversample, rolled.groups.min_valid) == (3, 1, 2)
    assert (rolled.cells.capacity, rolled.harness.deadline_s, rolled.harness.budget_s) == (
        5,
        30.0,
        40.0,
    )
    assert (rolled.trainer.temperature, rolled.engine.max_context) == (0.7, 1024)
    assert rolled.engine.dtype == "bfloat16" and rolled.harness.tasks is None

    assert cli.main(["proxy", "serve", str(shared), "--admin-token", "a" * 16]) == 0
    served: Config = captured["proxy"]
    proxy = served.proxy
    assert (model_dir(served), proxy.store, proxy.engine) == (model, tmp_path / "st", "embedded")
    assert (proxy.host, proxy.port, captured["admin_token"]) == ("127.0.0.1", 8181, "a" * 16)
    assert (served.trainer.temperature, served.engine.max_context) == (0.7, 1024)
    assert (served.cells.capacity, served.engine.dtype) == (5, "bfloat16")
    assert (proxy.harness_sampling, proxy.max_resident) == (True, 7)

    assert cli.main(["engine", "serve", str(shared), "--api-key", "k"]) == 0
    engine = captured["engine"]
    assert (engine["model"], engine["capacity"], engine["max_context"]) == (model, 5, 1024)
    assert str(engine["dtype"]) == "torch.bfloat16" and engine["device"] == "cpu"
    assert captured["bind"]["host"] == "127.0.0.1" and captured["bind"]["port"] == 30301
    assert captured["closed"]  # engine serve stops its engine after its server


def test_servers_bind_localhost_by_default_and_generate_credentials(
    tmp_path: Path, captured: dict[str, Any], capsys: pytest.CaptureFixture[str]
):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert cli.main(["engine", "serve", "--model", str(model)]) == 0
    assert captured["bind"] == {"host": "127.0.0.1", "port": 30000, "print": None}
    assert "api key: " in capsys.readouterr().out
    args = ["proxy", "serve", "--model", str(model), "--store", str(tmp_path / "s")]
    assert cli.main(args) == 0
    assert (captured["proxy"].proxy.host, captured["proxy"].proxy.port) == ("127.0.0.1", 8080)
    assert captured["admin_token"] is None  # serve() generates and prints one


def test_shortcuts_win_over_the_file_and_clash_with_overrides(
    shared: Path, tmp_path: Path, captured: dict[str, Any], capsys: pytest.CaptureFixture[str]
):
    assert cli.main(["proxy", "serve", str(shared), "--port", "9001"]) == 0
    assert captured["proxy"].proxy.port == 9001
    assert cli.main(["proxy", "serve", str(shared), "proxy.port=9002"]) == 0
    assert captured["proxy"].proxy.port == 9002
    assert cli.main(["proxy", "serve", str(shared), "--port", "9003", "proxy.port=9004"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--port and the override proxy.port=... set the same" in err
    # Overrides may come after flags; --tasks example is the bundled example set.
    run = ["rollout", "--run-dir", str(tmp_path / "r"), str(shared), "--tasks", "example"]
    assert cli.main([*run, "groups.size=2", "groups.min_valid=null"]) == 0
    assert captured["rollout"].config.groups.size == 2
    assert captured["rollout"].config.harness.tasks == example_tasks_path()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["proxy", "serve", "--model", "m"], "--store DIR or proxy.store=DIR"),
        (["engine", "serve", "--api-key", "k", "engine.api_key_file=f"], "not both"),
    ],
)
def test_missing_and_clashing_settings_are_one_line_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def _show(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert cli.main(["config", "show", *args]) == 0
    shown: dict[str, Any] = yaml.safe_load(capsys.readouterr().out)
    return shown


def test_config_show_prints_the_tree_each_command_resolves(
    shared: Path, capsys: pytest.CaptureFixture[str]
):
    plain = _show(capsys)
    assert plain["groups"]["size"] == 16 and plain["proxy"]["host"] == "127.0.0.1"
    assert set(plain) >= {"run", "checkpoint", "warm_start", "harness", "metrics", "proxy"}
    for command in ("train", "rollout", "proxy", "engine"):  # the embedded preset
        assert _show(capsys, command)["cells"]["count"] == 3, command
    assert _show(capsys, "simulate")["cells"]["count"] == 8
    served = _show(capsys, "proxy", "serve", str(shared), "proxy.port=1234")
    assert served["proxy"]["port"] == 1234 and served["trainer"]["temperature"] == 0.7
    assert _show(capsys, "engine", "engine.port=31000")["engine"]["port"] == 31000


def test_metrics_section_defaults_offline_safe(capsys: pytest.CaptureFixture[str]):
    metrics = _show(capsys, "metrics.wandb_project=demo")["metrics"]
    assert metrics == {
        "tensorboard": True,
        "wandb_project": "demo",
        "wandb_entity": None,
        "wandb_name": None,
        "wandb_mode": None,
    }
