"""``python -m sglang.launch_server`` for tests: qwengyre's engine server
(:func:`qwengyre.engines.server.engine_app`, SGLang's native HTTP API) over a real
:class:`~qwengyre.engines.embedded.EmbeddedEngine` on the CPU, generating from the
model at ``--model-path``.

It parses the flags of SGLang's ``server_args.py`` that qwengyre passes, strictly: an
unknown flag, or an abbreviation of one, is an error (exit code 2), so that a test
catches a wrongly named flag. ``--api-key`` is required (the fake serves with a key
only), on the command line or in the ``--config`` file. ``--tp-size``,
``--enable-memory-saver`` and ``--enable-return-routed-experts`` are accepted and
otherwise ignored (one CPU process; releasing memory works anyway; the engine server
answers ``return_routed_experts`` whenever its engine records routing, an MoE's).
``--weight-version`` labels the tokens when it is an integer, else (SGLang's
``default``) they are labelled -1.

It generates with one torch thread: several such servers beside the cells on a small
CPU machine would otherwise oversubscribe it many times over (a real SGLang server has
its own GPUs), and their calls slow to tens of seconds.

``--config FILE`` (SGLang's ``ConfigArgumentMerger``): at most one, as two arguments,
naming a ``.yaml``/``.yml`` file that holds a mapping of options to values. Its
options go before the command line's, so that flags given there win. As in SGLang's
first releases with ``--config`` (later ones set parser defaults instead, and accept
more), a key is the flag's name (``api-key``, not ``api_key``), ``true`` adds a
switch, and a value is parsed as a command-line argument (so one beginning with
``-`` is an error): what the fake takes, every SGLang with ``--config`` takes.

With ``$QWENGYRE_FAKE_SGLANG_RECORD`` set, it first writes its arguments and
``CUDA_VISIBLE_DEVICES`` there as JSON: ``{"argv": [...], "cuda_visible_devices": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import yaml
from aiohttp import web

from qwengyre.engines.embedded import EmbeddedEngine
from qwengyre.engines.server import engine_app


def parser() -> argparse.ArgumentParser:
    """SGLang's names for the flags the fake knows (``server_args.py``)."""
    p = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", required=True)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    return p


def with_config(argv: list[str]) -> list[str]:
    """``argv`` with its ``--config FILE`` replaced by the file's options, put first."""
    at = [i for i, arg in enumerate(argv) if arg == "--config"]
    if not at:
        return argv
    if len(at) > 1 or at[0] == len(argv) - 1:
        parser().error("--config: one config file, as the next argument")
    path = Path(argv[at[0] + 1])
    if path.suffix.lower() not in (".yaml", ".yml"):
        parser().error(f"--config: a YAML file (.yaml or .yml), not {path}")
    config = yaml.safe_load(path.read_text()) or {}
    if not isinstance(config, dict):
        parser().error(f"--config: {path} holds no mapping")
    options: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            options += [f"--{key}"] if value else []
        else:
            options += [f"--{key}", str(value)]
    return options + argv[: at[0]] + argv[at[0] + 2 :]


def main(argv: list[str]) -> None:
    record = os.environ.get("QWENGYRE_FAKE_SGLANG_RECORD")
    if record:
        with open(record, "w") as f:
            json.dump(
                {
                    "argv": argv,
                    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "pid": os.getpid(),
                },
                f,
            )
    args = parser().parse_args(with_config(argv))
    torch.set_num_threads(1)
    engine = EmbeddedEngine(
        args.model_path, name="fake-sglang", capacity=4, max_context=args.context_length
    )
    version = args.weight_version
    engine.version = int(version) if version.lstrip("-").isdigit() else -1

    async def close(app: web.Application) -> None:
        engine.close()

    app = engine_app(engine, args.api_key)
    app.on_cleanup.append(close)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main(sys.argv[1:])
