#!/usr/bin/env python3
"""Write the bundled ``swe`` example: a tiny Python repository as a git bundle and two
instances on it, each a bug with its hidden test.

    python scripts/make_swe_example.py [OUT_DIR]

OUT_DIR defaults to src/qwengyre/rollout/workloads/examples/swe. It writes
``calc.bundle`` (the repository ``calc``: two commits, authored at fixed dates, so the
commit ids are the same on every machine) and ``tasks.jsonl``:

- ``calc-clamp`` at the first commit: ``clamp`` ignores its lower bound; the hidden
  test ``tests/test_ranges.py::test_clamp_below`` fails until it is fixed;
- ``calc-median`` at the second commit: ``median`` is wrong for an even count; the
  hidden test ``tests/test_stats.py::test_median_even`` fails until it is fixed.

Each instance's ``test_patch`` adds its hidden test, its ``patch`` is the reference fix
(both ``git diff`` s made here). Needs git; no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "src" / "qwengyre" / "rollout" / "workloads" / "examples" / "swe"

STATS = '''"""Small statistics helpers."""


def mean(values):
    """The arithmetic mean of a non-empty sequence."""
    return sum(values) / len(values)
'''

MEDIAN_BUGGY = '''

def median(values):
    """The median of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
'''

MEDIAN_FIXED = '''

def median(values):
    """The median of a non-empty sequence."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
'''

RANGES_BUGGY = '''"""Bounding values."""


def clamp(value, low, high):
    """``value`` limited to the range [low, high]."""
    return min(value, high)
'''

RANGES_FIXED = RANGES_BUGGY.replace("return min(value, high)", "return max(low, min(value, high))")

TEST_STATS = """from calc.stats import mean


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5
"""

TEST_MEDIAN_ODD = """

def test_median_odd():
    assert median([3, 1, 2]) == 2
"""

TEST_MEDIAN_EVEN = """

def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5
"""

TEST_RANGES = """from calc.ranges import clamp


def test_clamp_above():
    assert clamp(15, 0, 10) == 10
"""

TEST_CLAMP_BELOW = """

def test_clamp_below():
    assert clamp(-5, 0, 10) == 0
"""

ENV = {
    "GIT_AUTHOR_NAME": "qwengyre",
    "GIT_AUTHOR_EMAIL": "examples@qwengyre.invalid",
    "GIT_COMMITTER_NAME": "qwengyre",
    "GIT_COMMITTER_EMAIL": "examples@qwengyre.invalid",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_SYSTEM": os.devnull,
}


def git(repo: Path, *args: str, date: str = "2026-01-01T00:00:00+00:00") -> str:
    env = {**os.environ, **ENV, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    done = subprocess.run(
        ["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True
    )
    return done.stdout


def write(repo: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)


def diff_of(repo: Path, files: dict[str, str]) -> str:
    """The ``git diff`` that writing ``files`` over the checkout makes; undone after."""
    write(repo, files)
    patch = git(repo, "diff")
    git(repo, "checkout", "--", ".")
    return patch


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        repo = Path(scratch) / "calc"
        repo.mkdir()
        git(repo, "init", "--quiet", "--initial-branch=main")
        write(
            repo,
            {
                "calc/__init__.py": '"""calc: a tiny library (the swe example)."""\n',
                "calc/stats.py": STATS,
                "calc/ranges.py": RANGES_BUGGY,
                "tests/test_stats.py": TEST_STATS,
                "tests/test_ranges.py": TEST_RANGES,
            },
        )
        git(repo, "add", "-A")
        git(repo, "commit", "--quiet", "-m", "calc: mean and clamp")
        first = git(repo, "rev-parse", "HEAD").strip()
        clamp_test = diff_of(repo, {"tests/test_ranges.py": TEST_RANGES + TEST_CLAMP_BELOW})
        clamp_fix = diff_of(repo, {"calc/ranges.py": RANGES_FIXED})
        test_stats = TEST_STATS.replace("import mean", "import mean, median")
        write(repo, {"calc/stats.py": STATS + MEDIAN_BUGGY})
        write(repo, {"tests/test_stats.py": test_stats + TEST_MEDIAN_ODD})
        git(repo, "add", "-A")
        git(repo, "commit", "--quiet", "-m", "calc: median", date="2026-01-02T00:00:00+00:00")
        second = git(repo, "rev-parse", "HEAD").strip()
        median_test = diff_of(
            repo, {"tests/test_stats.py": test_stats + TEST_MEDIAN_ODD + TEST_MEDIAN_EVEN}
        )
        median_fix = diff_of(repo, {"calc/stats.py": STATS + MEDIAN_FIXED})
        git(repo, "bundle", "create", "--quiet", str(out / "calc.bundle"), "--all")
    instances = [
        {
            "instance_id": "calc-clamp",
            "repository": "calc.bundle",
            "base_commit": first,
            "problem_statement": (
                "calc.ranges.clamp(value, low, high) should limit value to the range"
                " [low, high], but clamp(-5, 0, 10) returns -5 instead of 0. Fix it."
            ),
            "FAIL_TO_PASS": ["tests/test_ranges.py::test_clamp_below"],
            "PASS_TO_PASS": [
                "tests/test_ranges.py::test_clamp_above",
                "tests/test_stats.py::test_mean",
            ],
            "test_patch": clamp_test,
            "patch": clamp_fix,
            "timeout_s": 120,
        },
        {
            "instance_id": "calc-median",
            "repository": "calc.bundle",
            "base_commit": second,
            "problem_statement": (
                "calc.stats.median returns the wrong value for an even number of values:"
                " median([4, 1, 3, 2]) should be 2.5 (the mean of the two middle values)."
                " Fix it."
            ),
            "FAIL_TO_PASS": ["tests/test_stats.py::test_median_even"],
            "PASS_TO_PASS": [
                "tests/test_stats.py::test_mean",
                "tests/test_stats.py::test_median_odd",
            ],
            "test_patch": median_test,
            "patch": median_fix,
            "timeout_s": 120,
        },
    ]
    lines = "".join(json.dumps(instance) + "\n" for instance in instances)
    (out / "tasks.jsonl").write_text(lines)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
