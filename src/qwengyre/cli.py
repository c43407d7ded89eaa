"""The ``qwengyre`` command: one subcommand per job.

User errors (bad config, bad input files, bad arguments) exit non-zero with one line
on stderr; ``--verbose`` shows the traceback as well. Heavy imports (torch,
transformers, matplotlib) happen inside the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from qwengyre import __version__
from qwengyre.config import Config, ConfigError, config_to_yaml, load_config, retarget

USER_ERRORS = (ConfigError, ValueError, OSError)
"""Exceptions that describe bad input rather than a bug in qwengyre."""

DTYPES = ["float32", "bfloat16", "float16"]  # the embedded engine's weights and KV cache


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config_file", nargs="?", help="YAML config file (optional)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted.key=value overrides, e.g. groups.size=8"
    )


def _resolve_config(args: argparse.Namespace, preset: str | None = None) -> Config:
    """The config file is optional: a first positional holding '=' is an override.

    A ``preset`` (a bundled YAML file) stands in for the config file.
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
    return load_config(config_file, overrides)


def cmd_config_show(args: argparse.Namespace) -> int:
    print(config_to_yaml(_resolve_config(args)), end="")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    import json

    from qwengyre.sim.compare import compare_policies
    from qwengyre.sim.report import print_table
    from qwengyre.sim.simulator import simulate
    from qwengyre.sim.workload import workload_from_name

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
    else:
        result = simulate(config, workload)
        results = {result.policy: result}
        summary = {"policies": {result.policy: result.summary()}}
    print_table(results, title=f"{config.sim.workload}: {config.sim.steps} steps")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from qwengyre.sim.plots import write_plots

        for path in write_plots(results, Path(args.plot)):
            print(f"wrote {path}")
    return 0


def cmd_proxy_serve(args: argparse.Namespace) -> int:
    from qwengyre.proxy.serve import ServeOptions, resolve_admin_token, serve

    token_file = Path(args.admin_token_file) if args.admin_token_file else None
    admin_token = resolve_admin_token(args.admin_token, token_file)
    print(f"proxy on http://{args.host}:{args.port} (model {args.model})", flush=True)
    serve(
        ServeOptions(
            model=Path(args.model),
            store=Path(args.store),
            engine=args.engine,
            script=Path(args.script) if args.script else None,
            device=args.device,
            dtype=args.dtype,
            host=args.host,
            port=args.port,
            admin_token=admin_token,
            max_context=args.max_context,
            temperature=args.temperature,
            harness_sampling=args.harness_sampling,
        )
    )
    return 0


def cmd_engine_serve(args: argparse.Namespace) -> int:
    import secrets

    import torch
    from aiohttp import web

    from qwengyre.engines.embedded import EmbeddedEngine
    from qwengyre.engines.server import engine_app

    if not (Path(args.model) / "config.json").exists():
        raise ValueError(f"{args.model} is not a HuggingFace model directory (no config.json)")
    api_key = args.api_key or secrets.token_urlsafe(24)
    engine = EmbeddedEngine(
        args.model, capacity=args.capacity, device=args.device, dtype=getattr(torch, args.dtype)
    )
    if args.api_key is None:
        print(f"api key: {api_key}", flush=True)
    print(f"engine on http://{args.host}:{args.port} (SGLang HTTP API)", flush=True)
    web.run_app(engine_app(engine, api_key), host=args.host, port=args.port, print=None)
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    import asyncio

    from qwengyre.rollout.runner import RolloutOptions, rollout, summary
    from qwengyre.rollout.tasks import example_tasks_path

    tasks = example_tasks_path() if args.tasks == "example" else Path(args.tasks)
    options = RolloutOptions(
        model=Path(args.model),
        tasks=tasks,
        harness=args.harness,
        run_dir=Path(args.run_dir),
        executions_per_task=args.executions_per_task,
        oversample=args.oversample,
        min_valid=args.min_valid,
        concurrency=args.concurrency,
        harness_s=args.harness_timeout,
        overall_s=args.overall_timeout,
        resume=args.resume,
        device=args.device,
    )
    rows = asyncio.run(rollout(options))
    print(summary(rows))
    print(f"store {options.run_dir / 'proxy.sqlite'}, traces {options.run_dir / 'traces.jsonl'}")
    return 0


def cmd_model_init_tiny(args: argparse.Namespace) -> int:
    from qwengyre.models import build_tiny_model

    out = build_tiny_model(Path(args.dir), size=args.size, seed=args.seed, overwrite=args.force)
    print(f"built the {args.size} tiny model in {out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from qwengyre.runtime.train import TrainOptions, train

    if args.resume is not None:
        if args.config_file or args.overrides or args.run_dir:
            raise ConfigError("--resume RUN_DIR continues that run with its own config.yaml")
        options = TrainOptions(Path(args.resume), resume=True, display=not args.quiet)
    else:
        given = args.config_file is not None and "=" not in args.config_file
        config = _resolve_config(args, preset=None if given else "embedded")
        run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        options = TrainOptions(run_dir, config, display=not args.quiet)
    controller = asyncio.run(train(options))
    from qwengyre.report.html import write_report

    records = controller.step_records
    if records:
        first, last = records[0], records[-1]
        print(
            f"{len(records)} steps in {last.time_s:.0f} s; reward {first.reward_mean:.3f} "
            f"(first step) -> {last.reward_mean:.3f} (last step)"
        )
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
    show = config_sub.add_parser("show", help="print the resolved config as YAML")
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
    sim.add_argument("--json", metavar="FILE", help="write the measurements as JSON")
    sim.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    sim.set_defaults(func=cmd_simulate)

    proxy = sub.add_parser("proxy", help="the OpenAI/Anthropic-API model proxy")
    proxy_sub = proxy.add_subparsers(dest="proxy_command", required=True, metavar="ACTION")
    serve = proxy_sub.add_parser("serve", help="serve a model through the proxy")
    serve.add_argument("--model", required=True, help="HF model directory (tokenizer, template)")
    serve.add_argument("--engine", choices=["scripted", "embedded"], default="scripted")
    serve.add_argument("--script", help="JSON replies by request class (scripted engine)")
    serve.add_argument("--device", default="cpu", help="embedded engine device, e.g. cuda")
    serve.add_argument("--dtype", default="float32", choices=DTYPES, help="embedded engine")
    serve.add_argument("--store", required=True, help="directory for the durable store")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    token = serve.add_mutually_exclusive_group()
    token.add_argument(
        "--admin-token",
        help="admin API token (other users see it in ps: prefer --admin-token-file or "
        "$QWENGYRE_ADMIN_TOKEN; none of them: generated, printed)",
    )
    token.add_argument(
        "--admin-token-file", metavar="PATH", help="read the admin API token from PATH"
    )
    serve.add_argument("--max-context", type=int, help="default: the model's limit")
    serve.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="every call samples at this temperature, without top-k / top-p, whatever the "
        "harness asks: the recorded log-probs are then those the trainer computes",
    )
    serve.add_argument(
        "--harness-sampling",
        action="store_true",
        help="honour the harness's temperature / top_p / top_k instead (the embedded engine "
        "then records log-probs of the truncated distribution it sampled from)",
    )
    serve.set_defaults(func=cmd_proxy_serve)

    roll = sub.add_parser(
        "rollout", help="run a task set's executions through the proxy (no training)"
    )
    roll.add_argument("--model", required=True, help="HF model directory")
    roll.add_argument("--tasks", required=True, help="tasks JSONL, or 'example'")
    roll.add_argument(
        "--harness", default="toy", help="toy, claude-code, mini-swe-agent, or a command template"
    )
    roll.add_argument("--run-dir", required=True)
    roll.add_argument("--executions-per-task", type=int, default=4, help="N valid per group")
    roll.add_argument("--oversample", type=int, default=0, help="extra executions per group")
    roll.add_argument(
        "--min-valid", type=int, help="train a short group with at least this many valid rewards"
    )
    roll.add_argument("--concurrency", type=int, default=4)
    roll.add_argument("--harness-timeout", type=float, default=600.0, help="seconds")
    roll.add_argument("--overall-timeout", type=float, default=900.0, help="seconds")
    roll.add_argument("--device", default="cpu")
    roll.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    roll.set_defaults(func=cmd_rollout)

    engine = sub.add_parser("engine", help="inference engines")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True, metavar="ACTION")
    eserve = engine_sub.add_parser(
        "serve", help="the embedded engine as its own process, behind SGLang's HTTP API"
    )
    eserve.add_argument("--model", required=True, help="HF model directory")
    eserve.add_argument("--host", default="127.0.0.1")
    eserve.add_argument("--port", type=int, default=30000)
    eserve.add_argument("--device", default="cpu")
    eserve.add_argument("--dtype", default="float32", choices=DTYPES)
    eserve.add_argument("--capacity", type=int, default=32, help="concurrent requests")
    eserve.add_argument("--api-key", help="bearer token (default: generated, printed)")
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
    tiny.set_defaults(func=cmd_model_init_tiny)

    trainp = sub.add_parser(
        "train",
        help="train (no config: the embedded default on this machine)",
        description="Elastic RL training. Without a config file it runs the embedded "
        "default (preset 'embedded'): the tiny local model, the toy harness, 3 cells.",
    )
    _add_config_args(trainp)
    trainp.add_argument("--run-dir", help="output directory (default runs/<timestamp>)")
    trainp.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run")
    trainp.add_argument("--quiet", action="store_true", help="no live display")
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
    args = parser.parse_args(argv)
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
