"""The ``qwengyre`` command: one subcommand per job.

Every command that runs something (``train``, ``simulate``, ``rollout``, ``proxy serve``,
``engine serve``) reads the same typed config tree: ``[config_file] [overrides ...]``
(a YAML file, then ``dotted.key=value`` overrides), so a YAML that trains also rolls
out and serves with the same settings; ``qwengyre config show [COMMAND]`` prints the
tree a command resolves. Without a config file, ``train``, ``rollout`` and the servers
start from the bundled ``embedded`` preset (this machine's defaults), ``simulate`` and
``config show`` from the plain defaults. A few flags remain as shortcuts for keys
(:data:`SHORTCUTS`, e.g. ``--port`` for ``proxy.port``): a shortcut wins over the config
file, and a shortcut together with an override of the same key is refused.

User errors (bad config, bad input files, bad arguments) exit non-zero with one line
on stderr; ``--verbose`` shows the traceback as well. Heavy imports (torch,
transformers, matplotlib) happen inside the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_args

from qwengyre import __version__
from qwengyre.config import (
    Config,
    ConfigError,
    config_to_yaml,
    describe_bases,
    load_config,
    retarget,
)
from qwengyre.types import TinyTemplate

USER_ERRORS = (ConfigError, ValueError, OSError)
"""Exceptions that describe bad input rather than a bug in qwengyre."""

SHORTCUTS: dict[str, dict[str, str]] = {
    "train": {"--tasks": "harness.tasks", "--harness": "harness.name"},
    "rollout": {
        "--model": "model.path",
        "--tasks": "harness.tasks",
        "--harness": "harness.name",
    },
    "proxy": {
        "--model": "model.path",
        "--store": "proxy.store",
        "--port": "proxy.port",
        "--admin-token-file": "proxy.admin_token_file",
    },
    "engine": {"--model": "model.path", "--port": "engine.port"},
}
"""Each command's shortcut flags and the config key each one sets."""

HARNESSES = (
    "toy, claude-code, claude-code-bare, qwen-code, opencode, mini-swe-agent, or a command template"
)
"""What ``--harness`` takes (``harness.name``)."""

TASKS_HELP = (
    "tasks JSONL, or FORMAT:PATH with FORMAT swe (SWE-bench JSONL), terminal (a directory of"
    " Terminal-Bench task directories) or spec (NL2RepoBench-style JSONL); 'example' or"
    " FORMAT:example: a bundled example (default: the toy tasks)"
)
"""What ``--tasks`` takes (``harness.tasks``; :mod:`qwengyre.rollout.workloads`)."""

COMMANDS = ("train", "simulate", "rollout", "proxy", "engine")
"""What ``config show COMMAND`` resolves the tree for."""


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config_file", nargs="?", help="YAML config file (optional)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted.key=value overrides, e.g. groups.size=8"
    )


def _add_shortcut(
    parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup,
    command: str,
    flag: str,
    help: str,
    **kwargs: Any,
) -> None:
    key = SHORTCUTS[command][flag]
    parser.add_argument(flag, help=f"{help} (shortcut for {key}=...)", **kwargs)


def _epilog(command: str) -> str:
    shortcuts = ", ".join(f"{f} = {k}" for f, k in SHORTCUTS.get(command, {}).items())
    return (
        "Settings come from the config tree: [config_file] [dotted.key=value ...]; "
        "'qwengyre config show "
        + command
        + " ...' prints the tree this command resolves. Without a config file it starts "
        "from the bundled 'embedded' preset. " + (f"Shortcuts: {shortcuts}." if shortcuts else "")
    )


def _resolve_config(
    args: argparse.Namespace, preset: str | None = None, command: str | None = None
) -> Config:
    """The config file is optional: a first positional holding '=' is an override.

    A ``preset`` (a bundled YAML file) stands in for the config file. ``command``:
    whose shortcut flags (:data:`SHORTCUTS`) apply, after the overrides; a shortcut and
    an override of the same key are refused.
    """
    config_file, overrides = args.config_file, list(args.overrides)
    if config_file is not None and "=" in config_file:
        overrides.insert(0, config_file)
        config_file = None
    if preset is not None:
        if config_file is not None:
            raise ConfigError("give a config file or --preset, not both")
        from qwengyre.presets import preset_path

        config_file = preset_path(preset)
    overridden = {item.partition("=")[0] for item in overrides}
    values: dict[str, Any] = {}
    for flag, key in SHORTCUTS.get(command or "", {}).items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        if key in overridden:
            raise ConfigError(f"{flag} and the override {key}=... set the same key; give one")
        if flag == "--tasks" and value == "example":
            from qwengyre.rollout.tasks import example_tasks_path

            value = example_tasks_path()
        elif flag == "--tasks":
            from qwengyre.rollout.workloads import resolve_example

            value = resolve_example(value)
        values[key] = value
    return load_config(config_file, overrides, values)


def _command_config(args: argparse.Namespace, command: str) -> Config:
    """The tree ``command`` runs with: without a config file, the 'embedded' preset."""
    given = args.config_file is not None and "=" not in args.config_file
    return _resolve_config(args, preset=None if given else "embedded", command=command)


def cmd_config_show(args: argparse.Namespace) -> int:
    command = args.config_file if args.config_file in COMMANDS else None
    if command is not None:  # config show COMMAND [serve] [config_file] [overrides ...]
        rest = list(args.overrides)
        if command in ("proxy", "engine") and rest[:1] == ["serve"]:
            rest = rest[1:]
        args = argparse.Namespace(config_file=rest[0] if rest else None, overrides=rest[1:])
    if command in (None, "simulate"):
        config = _resolve_config(args)
    else:
        config = _command_config(args, command)
    if args.config_file is not None and "=" not in args.config_file:
        print(f"# {describe_bases(args.config_file)}")
    print(config_to_yaml(config), end="")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    import json

    from qwengyre.sim.compare import compare_policies
    from qwengyre.sim.report import print_table
    from qwengyre.sim.simulator import simulate
    from qwengyre.sim.workload import workload_from_name

    if args.ablations:
        return _simulate_ablations(args)
    if args.seeds is not None:
        raise ConfigError("--seeds applies to --ablations only")
    config = _resolve_config(args, preset=args.preset)
    if args.target_staleness is not None:
        config = retarget(config, args.target_staleness)
    workload = workload_from_name(config.sim.workload, config.seed, config.sim.trace)
    if args.compare:
        target = config.scheduler.target_staleness
        if target is None:
            raise ConfigError("--compare needs --target-staleness (or scheduler.target_staleness)")
        comparison = compare_policies(config, workload, target)
        results, summary = comparison.results, comparison.summary()
        notes = comparison.notes
    else:
        result = simulate(config, workload)
        results = {result.policy: result}
        summary = {"policies": {result.policy: result.summary()}}
        notes = {}
    print_table(results, title=f"{config.sim.workload}: {config.sim.steps} steps")
    for name, note in notes.items():
        print(f"{name}: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from qwengyre.sim.plots import write_plots

        for path in write_plots(results, Path(args.plot)):
            print(f"wrote {path}")
    return 0


def _simulate_ablations(args: argparse.Namespace) -> int:
    """``simulate --ablations``: the paper's rows (:mod:`qwengyre.sim.ablations`) from
    --preset, a config file or else the paper-122b preset, over --seeds seeds (default
    5); 12 steps (the paper's) unless ``sim.steps=N`` is given on the command line."""
    import json

    from qwengyre.sim.ablation_report import print_ablations
    from qwengyre.sim.ablations import PAPER_HOURS, STEPS, run_ablations

    if args.compare or args.target_staleness is not None:
        raise ConfigError(
            "--ablations runs the paper's rows at E[d] = 1.5: drop --compare and --target-staleness"
        )
    given = args.config_file is not None and "=" not in args.config_file
    config = _resolve_config(args, preset=args.preset or (None if given else "paper-122b"))
    if not any(item.startswith("sim.steps=") for item in [args.config_file or "", *args.overrides]):
        config = config.model_copy(deep=True)
        config.sim.steps = STEPS
    result = run_ablations(config, 5 if args.seeds is None else args.seeds)
    print_ablations(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result.summary(), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from qwengyre.sim.plots import plot_ablations

        path = Path(args.plot) / "ablations.png"
        print(f"wrote {plot_ablations(result.hours_by_row(), PAPER_HOURS, result.changes(), path)}")
    return 0


def _plan_config(args: argparse.Namespace) -> Config:
    """The tree ``plan`` simulates: ``--trace`` sets the workload, and a trace recorded
    by ``qwengyre train`` (its run directory, or the traces.jsonl in it) comes with that
    run's config.yaml unless a config file is given."""
    from qwengyre.records.metrics import METRICS_FILE
    from qwengyre.sim.plan import run_inputs

    given = args.config_file is not None and "=" not in args.config_file
    overrides = ([] if given or args.config_file is None else [args.config_file]) + args.overrides
    trace = None
    if args.trace is not None:
        trace, recorded = run_inputs(Path(args.trace))
        if recorded is not None and not given:
            print(f"config: {recorded} (the run that recorded the trace)")
            args = argparse.Namespace(
                **{**vars(args), "config_file": str(recorded), "overrides": overrides}
            )
    elif not (given or args.preset or any(o.startswith("sim.workload=") for o in overrides)):
        raise ConfigError(
            "plan needs a workload: --preset NAME, --trace PATH (a traces.jsonl or a run "
            "directory), a config file or sim.workload=NAME"
        )
    config = _resolve_config(args, preset=args.preset)
    if trace is not None:
        sim = {**config.sim.model_dump(), "workload": "trace", "trace": trace}
        config = Config.model_validate({**config.model_dump(), "sim": sim})
        if recorded is not None and (trace.parent / METRICS_FILE).is_file():
            config = _run_costs(config, trace.parent / METRICS_FILE, overrides)
    return config


def _run_costs(config: Config, metrics_path: Path, overrides: list[str]) -> Config:
    """``config`` with the costs measured in the recording run's metrics log
    (:mod:`qwengyre.sim.measured`); a cost set by an override keeps the override."""
    from qwengyre.records.metrics import read_metrics
    from qwengyre.sim.measured import measured_costs, with_costs

    given = {o.split("=", 1)[0] for o in overrides}
    found, missing = measured_costs(read_metrics(metrics_path), config)
    costs = [c for c in found if c.key not in given]
    print(f"costs from {metrics_path}:")
    for cost in costs:
        print(f"  {cost.describe()}")
    for key in sorted(given & {c.key for c in found}):
        print(f"  {key}: as given")
    if missing:
        print(f"  not in the log, kept from the config: {', '.join(missing)}")
    return with_costs(config, costs)


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from qwengyre.sim import plan as planner
    from qwengyre.sim.plots import plot_staleness_sweep

    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    policies = planner.check_policies(args.policies.split(","))
    config = _plan_config(args)
    target = args.target_staleness
    target = config.scheduler.target_staleness if target is None else target
    if target is None:
        raise ConfigError("plan needs --target-staleness (or scheduler.target_staleness)")
    workloads = planner.plan_workloads(config, args.seeds)
    plan = planner.plan_run(config, workloads, target, policies)
    planner.print_plan(plan, args.top)
    for policy in policies:
        if policy not in plan.best_by_policy():
            print(f"{policy}: no shape reaches E[d] = {target:g} on these cells and batch")
    print(f"recommended: {plan.best.shape.policy}, {plan.best.shape.describe()}")
    if args.out:
        Path(args.out).write_text(plan.recommended_yaml())
        print(f"wrote {args.out} (qwengyre train {args.out})")
    else:
        print(plan.recommended_yaml(), end="")
    summary = plan.summary()
    if args.plot:
        targets = (*planner.SWEEP_TARGETS, target)
        plans = planner.sweep(config, workloads, targets, policies, plans=[plan])
        planner.print_sweep(plans)
        points = planner.best_times(plans)
        print(f"wrote {plot_staleness_sweep(points, Path(args.plot) / 'staleness_sweep.png')}")
        summary["sweep"] = {
            policy: [{"target_staleness": t, "end_to_end_s": s, "shape": d} for t, s, d in series]
            for policy, series in points.items()
        }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_proxy_serve(args: argparse.Namespace) -> int:
    from qwengyre.apps.serve import resolve_admin_token, serve

    config = _command_config(args, "proxy")
    serve(config, resolve_admin_token(args.admin_token, config.proxy.admin_token_file))
    return 0


def cmd_engine_serve(args: argparse.Namespace) -> int:
    import secrets

    from aiohttp import web

    from qwengyre.apps.serve import model_dir, read_secret_file
    from qwengyre.cluster.devices import require_device
    from qwengyre.engines.factory import embedded_engine
    from qwengyre.engines.server import engine_app

    config = _command_config(args, "engine")
    settings = config.engine
    if args.api_key is not None and settings.api_key_file is not None:
        raise ConfigError("give --api-key or engine.api_key_file, not both")
    api_key = args.api_key
    if settings.api_key_file is not None:
        api_key = read_secret_file(settings.api_key_file, "engine API key")
    model = model_dir(config)
    if not (model / "config.json").exists():
        raise ValueError(f"{model} is not a HuggingFace model directory (no config.json)")
    require_device(config.run.device)
    engine = embedded_engine(
        model,
        capacity=config.cells.capacity,
        device=config.run.device,
        dtype=settings.dtype,
        max_context=config.engine.max_context,
        routed_experts=settings.return_routed_experts,
    )
    if api_key is None:
        api_key = secrets.token_urlsafe(24)
        print(f"api key: {api_key}", flush=True)
    print(f"engine on http://{settings.host}:{settings.port} (SGLang HTTP API)", flush=True)
    try:
        web.run_app(engine_app(engine, api_key), host=settings.host, port=settings.port, print=None)
    finally:  # its worker must not be in a torch call when the interpreter exits
        engine.close()
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    import asyncio

    from qwengyre.apps.rollout import RolloutOptions, rollout, summary

    config = _command_config(args, "rollout")
    options = RolloutOptions(Path(args.run_dir), config, resume=args.resume)
    rows = asyncio.run(rollout(options))  # holds the run directory's lock throughout
    print(summary(rows))
    print(f"store {options.run_dir / 'proxy.sqlite'}, traces {options.run_dir / 'traces.jsonl'}")
    return 0


def cmd_model_init_tiny(args: argparse.Namespace) -> int:
    from qwengyre.models import build_tiny_model

    try:
        out = build_tiny_model(
            Path(args.dir),
            size=args.size,
            seed=args.seed,
            tie_embeddings=not args.untied,
            overwrite=args.force,
            template=args.template,
            moe=args.moe,
        )
    except FileExistsError:  # the library's advice names its argument, not the flag
        raise ValueError(
            f"{args.dir} is not empty: pick another directory, or pass --force to write over it"
        ) from None
    kind = "untied" if args.untied else "tied"
    what = f"{kind} embeddings, {args.template} template"
    arch = "Qwen3-MoE " if args.moe else ""
    print(f"built the {args.size} tiny {arch}model ({what}) in {out}")
    return 0


def cmd_model_export(args: argparse.Namespace) -> int:
    from qwengyre.training.checkpoint import (
        MANIFEST_FILE,
        CheckpointError,
        export_model,
        latest_checkpoint,
        read_checkpoint,
    )

    given = Path(args.checkpoint)
    if not given.is_dir():
        raise ValueError(f"CHECKPOINT {given} is not a directory")
    path = given if (given / MANIFEST_FILE).exists() else None
    if path is None:  # a checkpoints root, or a run directory holding one
        root = given / "checkpoints" if (given / "checkpoints").is_dir() else given
        path = latest_checkpoint(root)
        if path is None:
            raise ValueError(
                f"no complete checkpoint in {root} (CHECKPOINT is a checkpoint directory, "
                "a checkpoints root or a run directory)"
            )
    try:
        step = read_checkpoint(path, verify=False).step
        out = export_model(path, Path(args.dir), dtype=args.dtype)
    except CheckpointError as exc:
        raise ValueError(str(exc)) from exc
    print(f"exported step {step} ({path}) to {out} as {args.dtype}")
    return 0


def _train_config(args: argparse.Namespace) -> Config:
    """A new run's config: its file (on its base), else the embedded preset; then the
    overrides."""
    given = args.config_file is not None and "=" not in args.config_file
    return _resolve_config(args, preset=None if given else "embedded", command="train")


def _check_train(args: argparse.Namespace) -> int:
    """``train --check``: the run's config and preflight, nothing started or written."""
    from qwengyre.apps.preflight import preflight

    if args.resume is not None:
        config = load_config(Path(args.resume) / "config.yaml")
    else:
        config = _train_config(args)
    checked = preflight(config, warn=lambda line: print(f"qwengyre: warning: {line}"))
    print(
        f"ready: {len(checked.tasks)} tasks, harness {shlex.join(checked.harness.command)},"
        f" engine {config.engine.backend} on {config.run.device},"
        f" {config.cells.count} cells ({config.run.placement})"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import asyncio
    import time

    if args.resume is not None:
        if args.config_file or args.overrides or args.run_dir or args.harness or args.tasks:
            raise ConfigError("--resume RUN_DIR continues that run with its own config.yaml")
        if not (Path(args.resume) / "config.yaml").is_file():  # in a second, before torch
            raise ValueError(f"{args.resume} is not a training run (no config.yaml) to resume")
    from qwengyre.apps.train import TrainOptions, train

    if args.check:
        return _check_train(args)
    if args.resume is not None:
        options = TrainOptions(run_dir=Path(args.resume), resume=True, display=not args.quiet)
    else:
        config = _train_config(args)
        run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        options = TrainOptions(run_dir=run_dir, config=config, display=not args.quiet)
    print(f"run {options.run_dir}: config, metrics, checkpoints, logs and report go there")
    controller = asyncio.run(train(options))
    from qwengyre.report.html import learning_signal_warning, write_report

    records = controller.observer.step_records
    if records:
        first, last = records[0], records[-1]
        none = sum(not r.learning_signal for r in records)
        from qwengyre.rollout.toy_tasks import TOY_KIND

        parity = controller.config.harness.tasks is None and TOY_KIND == "parity"
        chance = " (chance on the bundled parity task: 0.5)" if parity else ""
        print(
            f"{len(records)} steps in {last.time_s:.0f} s; reward {first.reward_mean:.3f} "
            f"(first step) -> {last.reward_mean:.3f} (last step){chance}; "
            f"{none} of {len(records)} steps had no learning signal"
        )
        warning = learning_signal_warning(records)
        if warning is not None:
            print(f"qwengyre: warning: {warning} (in {options.run_dir}).", file=sys.stderr)
    print(f"run {options.run_dir}; report {write_report(options.run_dir)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from qwengyre.report.compare import comparison_rows, print_comparison
    from qwengyre.report.html import write_report

    run_dirs = [Path(d) for d in args.run_dirs]
    if args.out and len(run_dirs) > 1:
        raise ValueError(f"--out DIR takes one RUN_DIR; got {len(run_dirs)} (drop --out)")
    rows = comparison_rows(run_dirs)  # every run is read before any report is written
    for row in rows:
        print(write_report(row.run_dir, Path(args.out) if args.out else None, metrics=row.metrics))
    if len(rows) > 1:
        print_comparison(rows)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwengyre",
        description="Elastic reinforcement learning for long-horizon LLM agents.",
    )
    parser.add_argument("--version", action="version", version=f"qwengyre {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = sub.add_parser("config", help="inspect the configuration tree")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser(
        "show",
        help="print the resolved config as YAML",
        usage="qwengyre config show [COMMAND] [config_file] [overrides ...]",
        description="Print the resolved config tree as YAML (loadable as a config file). "
        f"COMMAND ({', '.join(COMMANDS)}): the tree that command resolves; train, rollout, "
        "proxy and engine start from the bundled 'embedded' preset when no config file is "
        "given. Without COMMAND: the plain defaults.",
    )
    _add_config_args(show)
    show.set_defaults(func=cmd_config_show)

    sim = sub.add_parser(
        "simulate",
        help="simulate a policy (or compare all three) on a workload with the real scheduler",
    )
    _add_config_args(sim)
    sim.add_argument("--preset", help="a bundled config, e.g. paper-122b or paper-2p4t")
    sim.add_argument(
        "--target-staleness", type=float, help="E[d]: pick mu and phi per policy (Eq 2)"
    )
    sim.add_argument(
        "--compare", action="store_true", help="run elastic, async and colocate at the target"
    )
    sim.add_argument(
        "--ablations",
        action="store_true",
        help="run the paper's ablation rows A0-A3, C0-C3, E0-E2 (default preset paper-122b; "
        "12 steps unless sim.steps=N is given)",
    )
    sim.add_argument(
        "--seeds", type=int, metavar="N", help="--ablations: seeds to run each row on (default 5)"
    )
    sim.add_argument("--json", metavar="FILE", help="write the measurements as JSON")
    sim.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    sim.set_defaults(func=cmd_simulate)

    plan = sub.add_parser(
        "plan",
        help="search policies and shapes at a target staleness; recommend a config",
        description="Simulate every shape each policy may take at the target E[d] (mu and "
        "phi per Eq 2, async's training split, standalone cells) on the config's cells, "
        "groups and costs; print the fastest and write the recommended config as YAML that "
        "'qwengyre train' accepts. A parametric workload is ranked by the mean over "
        "--seeds seeds; a trace (a traces.jsonl, or a train run directory) replays "
        "deterministically, with the recording run's config.yaml unless a config is given.",
    )
    _add_config_args(plan)
    workload = plan.add_mutually_exclusive_group()
    workload.add_argument("--preset", help="a bundled config, e.g. paper-122b or paper-2p4t")
    workload.add_argument(
        "--trace", metavar="PATH", help="a traces.jsonl, or a qwengyre train run directory"
    )
    plan.add_argument("--target-staleness", type=float, help="E[d] (default: the config's)")
    plan.add_argument(
        "--policies", default="elastic,async,colocate", help="comma-separated policies to search"
    )
    plan.add_argument("--seeds", type=int, default=1, help="seeds of a parametric workload")
    plan.add_argument("--top", type=int, default=8, help="candidates to show (default 8)")
    plan.add_argument("--out", metavar="FILE", help="write the recommended config here")
    plan.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    plan.add_argument(
        "--plot", metavar="DIR", help="sweep E[d] 0.5-2 and plot time vs staleness in DIR"
    )
    plan.set_defaults(func=cmd_plan)

    proxy = sub.add_parser("proxy", help="the OpenAI/Anthropic-API model proxy")
    proxy_sub = proxy.add_subparsers(dest="proxy_command", required=True, metavar="ACTION")
    serve = proxy_sub.add_parser(
        "serve",
        help="serve a model through the proxy (settings: the proxy section)",
        description="Serve a model through the proxy: the OpenAI and Anthropic APIs and an "
        "admin API. It binds proxy.host (127.0.0.1) and every admin call needs the admin "
        "token. The engine is proxy.engine (scripted: proxy.script; embedded: the model on "
        "run.device, engine.dtype, served by engine.backend: in-process, or a vLLM or SGLang "
        "server launched for it); every call samples at trainer.temperature (see "
        "proxy.harness_sampling) and is capped at engine.max_context tokens.",
        epilog=_epilog("proxy"),
    )
    _add_config_args(serve)
    _add_shortcut(serve, "proxy", "--model", "HF model directory (default: the tiny model)")
    _add_shortcut(serve, "proxy", "--store", "directory for the durable store")
    _add_shortcut(serve, "proxy", "--port", "port to bind", type=int)
    token = serve.add_mutually_exclusive_group()
    token.add_argument(
        "--admin-token",
        help="admin API token (never a config key; other users see it in ps: prefer "
        "--admin-token-file or $QWENGYRE_ADMIN_TOKEN; none of them: generated, printed)",
    )
    _add_shortcut(
        token, "proxy", "--admin-token-file", "read the admin API token from PATH", metavar="PATH"
    )
    serve.set_defaults(func=cmd_proxy_serve)

    roll = sub.add_parser(
        "rollout",
        help="run a task set's executions through the proxy (no training)",
        description="Run every task's group of executions through an in-process proxy and "
        "the model's engine (engine.backend), with the settings train uses: groups.size "
        "valid executions per task (+ groups.oversample, groups.min_valid), cells.capacity "
        "at once, "
        "harness.name within harness.deadline_s / harness.budget_s, on run.device, sampling at "
        "trainer.temperature.",
        epilog=_epilog("rollout"),
    )
    _add_config_args(roll)
    _add_shortcut(roll, "rollout", "--model", "HF model directory (default: the tiny model)")
    _add_shortcut(roll, "rollout", "--tasks", TASKS_HELP)
    _add_shortcut(roll, "rollout", "--harness", HARNESSES)
    roll.add_argument("--run-dir", required=True, help="output directory")
    roll.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    roll.set_defaults(func=cmd_rollout)

    engine = sub.add_parser("engine", help="inference engines")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True, metavar="ACTION")
    eserve = engine_sub.add_parser(
        "serve",
        help="the embedded engine as its own process, behind SGLang's HTTP API",
        description="The embedded engine behind SGLang's HTTP API, as train's cells run it: "
        "on run.device with engine.dtype, cells.capacity concurrent requests, engine.max_context "
        "tokens each. It binds engine.host (127.0.0.1) and every call needs the API key.",
        epilog=_epilog("engine"),
    )
    _add_config_args(eserve)
    _add_shortcut(eserve, "engine", "--model", "HF model directory (default: the tiny model)")
    _add_shortcut(eserve, "engine", "--port", "port to bind", type=int)
    eserve.add_argument(
        "--api-key",
        help="bearer token (never a config key; see engine.api_key_file; default: "
        "generated, printed)",
    )
    eserve.set_defaults(func=cmd_engine_serve)

    model = sub.add_parser("model", help="build and inspect models")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    tiny = model_sub.add_parser(
        "init-tiny", help="build the offline tiny model and tokenizer (HF format) in DIR"
    )
    tiny.add_argument("dir", help="output directory (must be empty or absent)")
    tiny.add_argument("--size", choices=["test", "demo"], default="demo")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--force", action="store_true", help="overwrite a non-empty DIR")
    tiny.add_argument(
        "--untied",
        action="store_true",
        help="give lm_head its own weight instead of sharing the input embedding's",
    )
    tiny.add_argument(
        "--template",
        choices=list(get_args(TinyTemplate)),
        default="qwen3",
        help="chat template: qwen3 (hermes <tool_call>{json} calls), qwen3-coder (XML"
        " <function=...> calls, <think> reasoning) or qwen3-thinking (hermes calls, the"
        " generation prompt opens <think>)",
    )
    tiny.add_argument(
        "--moe",
        action="store_true",
        help="a Qwen3-MoE (every layer's MLP 4 experts, 2 per token, no shared expert)"
        " instead of a dense Qwen3",
    )
    tiny.set_defaults(func=cmd_model_init_tiny)
    export = model_sub.add_parser(
        "export",
        help="write a training checkpoint as a HuggingFace model directory",
        description="Write a training checkpoint's policy as a HuggingFace model directory "
        "(safetensors files and their index, config, tokenizer) that from_pretrained and "
        "inference engines load. CHECKPOINT is a checkpoint directory (step-NNNNNN), a "
        "checkpoints root or a run directory (then its latest complete checkpoint).",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint, root or run dir")
    export.add_argument("dir", metavar="DIR", help="output directory (must be empty or absent)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    export.set_defaults(func=cmd_model_export)

    trainp = sub.add_parser(
        "train",
        help="train (no config: the embedded default on this machine)",
        description="Elastic RL training. Without a config file it runs the embedded "
        "default (preset 'embedded'): the tiny local model, the toy harness, 3 cells.",
    )
    _add_config_args(trainp)
    _add_shortcut(trainp, "train", "--tasks", TASKS_HELP)
    _add_shortcut(trainp, "train", "--harness", HARNESSES)
    trainp.add_argument("--run-dir", help="output directory (default runs/<timestamp>)")
    trainp.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run")
    trainp.add_argument("--quiet", action="store_true", help="no live display")
    trainp.add_argument(
        "--check",
        action="store_true",
        help="only check what the run needs (config, tasks, harness, engine, device), in "
        "seconds, and start nothing",
    )
    trainp.set_defaults(func=cmd_train)

    report = sub.add_parser(
        "report",
        help="write training runs' HTML reports from their metrics (several: also compare them)",
    )
    report.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directory holding metrics.jsonl"
    )
    report.add_argument("--out", metavar="DIR", help="output directory (default RUN_DIR/report)")
    report.set_defaults(func=cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after a flag: argparse leaves them over (no intermixed parsing)
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except USER_ERRORS as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"qwengyre: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qwengyre: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
