"""Every benchmark script runs end to end in its smoke form (``--smoke``: the smallest
real run, see ``benchmarks/_smoke.py``): one that drifted from the code (a name moved, a
module renamed, a record that changed shape) fails here, not when someone next measures
with it. The figures of a smoke run mean nothing and are not checked; that the script
ran through to its last table is."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted(
    p for p in (Path(__file__).parents[1] / "benchmarks").glob("*.py") if p.name[0] != "_"
)

NEEDS = {
    "bench_sandbox.py": ("bwrap", "bubblewrap is not installed (apt-get install bubblewrap)"),
}
"""Scripts that measure an external program, and why they skip without it."""

ON_CPU = {"gpu_fsdp.py": ["--device", "cpu"], "gpu_engines.py": ["--device", "cpu"]}
"""The GPU scripts' smoke runs on this machine's CPU."""


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_script_runs_its_smoke_form(script: Path) -> None:
    program, why = NEEDS.get(script.name, (None, ""))
    if program is not None and shutil.which(program) is None:
        pytest.skip(why)
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", *ON_CPU.get(script.name, [])],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=script.parent,
    )
    assert done.returncode == 0, (done.stdout[-1000:], done.stderr[-3000:])
    assert done.stdout.strip(), done.stderr[-2000:]  # it printed its tables


def test_smoke_sizes_are_the_defaults_of_named_arguments_only() -> None:
    sys.path.insert(0, str(BENCHMARKS[0].parent))
    try:
        from _smoke import parse
    finally:
        sys.path.pop(0)

    def parser() -> argparse.ArgumentParser:
        made = argparse.ArgumentParser()
        made.add_argument("--steps", type=int, default=48)
        return made

    with pytest.raises(ValueError, match=r"smoke sizes for no argument: \['step'\]"):
        parse(parser(), [], step=3)
    assert parse(parser(), [], steps=3).steps == 48
    assert parse(parser(), ["--smoke"], steps=3).steps == 3
    assert parse(parser(), ["--smoke", "--steps", "5"], steps=3).steps == 5
