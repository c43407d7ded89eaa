"""The ``--smoke`` flag every benchmark script takes: its smallest real run.

A smoke run goes through the whole script in seconds with tiny sizes, so a script that
drifted from the code fails in CI (``tests/test_benchmarks.py``) rather than when
someone next measures with it. Its figures mean nothing; flags given explicitly still
win over the smoke sizes."""

from __future__ import annotations

import argparse
from typing import Any


def parse(
    parser: argparse.ArgumentParser, argv: list[str] | None = None, **smoke: Any
) -> argparse.Namespace:
    """``parser``'s arguments in ``argv`` (None: the command line's), with a ``--smoke``
    flag whose run takes ``smoke``'s values as the defaults (each the destination of one
    of ``parser``'s arguments: ValueError otherwise)."""
    unknown = set(smoke) - {action.dest for action in parser._actions}
    if unknown:
        raise ValueError(f"smoke sizes for no argument: {sorted(unknown)}")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest real run (seconds): checks the script end to end; its figures"
        " mean nothing",
    )
    if parser.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)
