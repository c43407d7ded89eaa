"""The graders' entry point, what a workload task's command evaluator runs::

    python -m qwengyre.rollout.workloads.grade swe DATASET LINE ID
    python -m qwengyre.rollout.workloads.grade spec DATASET LINE ID
    python -m qwengyre.rollout.workloads.grade terminal TASK_DIR

run with the workspace as its working directory. It reads the task back from its dataset
(the line it was loaded from, which must still hold ``ID``; the task directory), grades
the workspace without changing it, and prints the result as its last stdout line:
``{"score": s, "valid": true, "critique": log}``. A task it cannot read back gives
``valid: false`` (no assessment, never a zero) with the reason as the critique.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from qwengyre.rollout.workloads import spec, swe, terminal
from qwengyre.rollout.workloads.common import read_numbered_line, result_line

USAGE = (
    "usage: python -m qwengyre.rollout.workloads.grade"
    " {swe DATASET LINE ID | spec DATASET LINE ID | terminal TASK_DIR}"
)


def grade(argv: Sequence[str], workspace: Path) -> tuple[float, str]:
    """``(score, log)`` of ``workspace`` by the task ``argv`` names (see the module
    docstring); raises ``ValueError`` (a :class:`~qwengyre.rollout.tasks.TaskFileError`
    among them) when the task cannot be read back, ``OSError`` when files cannot."""
    match list(argv):
        case ["swe", dataset, line, task_id] if line.isdigit():
            instance = read_numbered_line(swe.SweInstance, Path(dataset), int(line), task_id)
            return swe.grade(instance, workspace)
        case ["spec", dataset, line, task_id] if line.isdigit():
            task = read_numbered_line(spec.SpecTask, Path(dataset), int(line), task_id)
            if task.hidden_tests is None:
                raise ValueError(f"{dataset}:{line}: task {task_id!r} has no hidden_tests")
            return spec.grade(task, workspace)
        case ["terminal", task_dir]:
            return terminal.grade(terminal.read_task_dir(Path(task_dir)), workspace)
    raise ValueError(USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    """Grade the current directory and print the result line (0), or the usage (2)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] not in (["swe"], ["spec"], ["terminal"]):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        score, log = grade(args, Path.cwd())
    except (ValueError, OSError) as error:
        print(result_line(0.0, f"cannot grade: {error}", valid=False))
        return 0
    print(result_line(score, log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
