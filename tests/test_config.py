"""The typed config tree: defaults, YAML, overrides and one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qwengyre.config import Config, ConfigError, config_to_yaml, load_config, retarget


def test_defaults_are_the_papers():
    c = load_config()
    assert (c.groups.size, c.groups.batch, c.trainer.j_max) == (16, 32, 5)
    assert c.trainer.token_weight_cap == 5.0
    assert (c.trainer.clip_low, c.trainer.clip_high) == (0.995, 1.005)
    assert (c.trainer.optimizer, c.trainer.lr) == ("adam", 1e-6)
    assert (c.scheduler.mu, c.scheduler.phi) == (1, 0.0)
    assert (c.cells.rollout_to_training_s, c.cells.training_to_rollout_s) == (8.52, 3.46)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("trainer.nonexistent=1", ["unknown config key 'trainer.nonexistent'", "j_max"]),
        ("nonexistent=1", ["unknown config key 'nonexistent'", "top level"]),
        ("groups.size=-3", ["groups.size=-3", "greater than or equal to 1"]),
        ("groups.size=abc", ["groups.size='abc'", "valid integer"]),
        ("scheduler.policy=fifo", ["scheduler.policy='fifo'", "'elastic', 'async' or"]),
        ("scheduler.rho_min=1.5", ["scheduler.rho_min=1.5", "less than or equal to 1"]),
        ("trainer.lr=0", ["trainer.lr=0", "greater than 0"]),
        ("trainer.backend=megatron", ["trainer.backend='megatron'", "'fsdp2'"]),
        ("scheduler.phi=0.3", ["(scheduler.phi + scheduler.mu) * groups.batch = 41.6"]),
        ("scheduler", ["must look like dotted.key=value"]),
        (
            "run.harness_s=60",
            [
                "unknown config key 'run.harness_s'",
                "allowed keys at run: steps, placement, device, torch_threads, restarts",
            ],
        ),
    ],
)
def test_bad_values_are_refused_with_one_line_naming_key_and_value(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="colocate needs a standalone pool"):
        load_config(None, ["scheduler.policy=colocate", "scheduler.phi=1"])
    with pytest.raises(
        ConfigError, match=r"async_training_cells=8 must be in \[1, cells\.count - 1 = 7\]"
    ):
        load_config(None, ["scheduler.policy=async", "scheduler.async_training_cells=8"])
    with pytest.raises(ConfigError, match=r"sim\.trace=PATH"):
        load_config(None, ["sim.workload=trace"])
    with pytest.raises(
        ConfigError, match=r"harness\.deadline_s \(400\.0\) must not exceed harness\.budget_s"
    ):
        load_config(None, ["harness.deadline_s=400"])
    with pytest.raises(ConfigError, match=r"run\.replace_dead_cells needs run\.placement=local"):
        load_config(None, ["run.placement=ray", "run.replace_dead_cells=1"])


def test_target_staleness_derives_mu_and_phi_per_policy():
    c = load_config(None, ["scheduler.target_staleness=1.5"])
    assert (c.scheduler.mu, c.scheduler.phi) == (3, 0.5)
    c = load_config(None, ["scheduler.target_staleness=1.5", "scheduler.policy=colocate"])
    assert (c.scheduler.mu, c.scheduler.phi) == (4, 0.0)
    # Agreeing values are accepted; contradicting ones are refused.
    assert load_config(None, ["scheduler.target_staleness=1.5", "scheduler.mu=3"]).scheduler.mu == 3
    with pytest.raises(ConfigError, match=r"scheduler\.mu=2 contradicts target_staleness=1\.5"):
        load_config(None, ["scheduler.target_staleness=1.5", "scheduler.mu=2"])


def test_retarget_switches_policy_and_rederives_the_burst():
    c = retarget(load_config(None, ["scheduler.mu=2"]), 1.5, "async")
    assert (c.scheduler.policy, c.scheduler.mu, c.scheduler.phi) == ("async", 1, 1.5)


def test_yaml_file_plus_overrides_and_round_trip(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("groups:\n  size: 8\ncells:\n  count: 3\n")
    c = load_config(path, ["groups.batch=4", "scheduler.target_staleness=1"])
    assert (c.groups.size, c.groups.batch, c.cells.count) == (8, 4, 3)
    again = tmp_path / "again.yaml"
    again.write_text(config_to_yaml(c))
    assert load_config(again) == c
    assert yaml.safe_load(config_to_yaml(c))["scheduler"]["mu"] == 2  # elastic at E[d]=1


def test_bad_files_are_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(scalar)
    section = tmp_path / "section.yaml"
    section.write_text("groups: 3\n")
    with pytest.raises(ConfigError, match="'groups' is a value, not a section"):
        load_config(section, ["groups.size=4"])


def test_override_into_a_value_is_refused():
    with pytest.raises(ConfigError, match="conflicts with an earlier override"):
        load_config(None, ["groups.size=4", "groups.size.x=1"])


def test_config_is_a_plain_pydantic_tree():
    assert Config().model_dump()["groups"]["size"] == 16


def test_a_config_file_extends_the_embedded_preset_unless_it_names_a_base(tmp_path: Path):
    from qwengyre.config import Config, describe_bases
    from qwengyre.presets import preset_path

    embedded = load_config(preset_path("embedded"))
    mine = tmp_path / "my.yaml"
    mine.write_text("groups:\n  size: 2\n")
    config = load_config(mine)  # only what it says changes
    assert config.groups.size == 2 and config.groups.batch == embedded.groups.batch
    assert config.cells == embedded.cells and config.model == embedded.model
    assert describe_bases(mine) == f"{mine} on preset embedded on the built-in defaults"

    mine.write_text("base: defaults\ngroups:\n  size: 2\n")  # the paper's scale
    assert load_config(mine).cells == Config().cells
    mine.write_text("base: paper-122b\nseed: 3\n")
    assert load_config(mine).cells == load_config(preset_path("paper-122b")).cells

    team = tmp_path / "team.yaml"  # a file of one's own as a base, relative to the file
    team.write_text("base: paper-2p4t\ngroups:\n  batch: 4\n")
    mine.write_text("base: team.yaml\ngroups:\n  size: 3\n")
    config = load_config(mine)
    assert (config.groups.size, config.groups.batch) == (3, 4)
    assert config.cells == load_config(preset_path("paper-2p4t")).cells
    assert describe_bases(mine) == f"{mine} on {team} on preset paper-2p4t on the built-in defaults"


def test_bad_bases_are_refused_naming_what_is_allowed(tmp_path: Path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("base: b.yaml\n")
    b.write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(a)
    a.write_text("base: embeded\n")
    with pytest.raises(ConfigError, match=r"'embeded' is neither a preset \(embedded, paper-122b"):
        load_config(a)


def test_a_resolved_config_reloads_as_it_is(tmp_path: Path):
    from qwengyre.config import config_to_yaml

    mine = tmp_path / "my.yaml"
    mine.write_text("groups:\n  size: 2\n")
    config = load_config(mine)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(config_to_yaml(config))
    assert load_config(dumped) == config
