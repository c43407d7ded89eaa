"""What starting a cell's process costs: a local actor forked from the fork server
(:mod:`qwengyre.cluster.local`, which imported torch, transformers and the cell's
modules once) against a process spawned fresh that imports them itself (how actors
started before).

Each side starts ``--actors`` processes at once and waits until each answers; it
reports the wall time and the CPU its processes used (read from ``/proc`` before they
exit). The fork server's first start is reported apart: it pays the import once, for
every actor the run starts after it (a run starts its cells, then any replacement).

    python benchmarks/bench_actor_start.py [--actors 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path

from _smoke import parse
from qwengyre.cluster.local import PRELOAD, ProcessActor

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User and system CPU seconds process ``pid`` used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Probe:
    """What an actor is asked: its pid, once it is up."""

    def pid(self) -> int:
        return os.getpid()


def forked(actors: int) -> tuple[float, float]:
    """Wall and CPU seconds of ``actors`` local actors started at once."""
    start = time.perf_counter()
    started = [ProcessActor(Probe, name=f"probe-{i}") for i in range(actors)]
    pids = [actor.call_sync("pid") for actor in started]
    wall = time.perf_counter() - start
    cpu = sum(cpu_s(pid) for pid in pids)
    for actor in started:
        actor.close()
    return wall, cpu


def _import_and_answer(conn: Connection) -> None:
    for module in PRELOAD:
        __import__(module)
    conn.send(os.getpid())
    conn.recv()  # hold on until the parent read its CPU time


def spawned(actors: int) -> tuple[float, float]:
    """Wall and CPU seconds of ``actors`` fresh processes that import the cell's modules."""
    context = mp.get_context("spawn")
    start = time.perf_counter()
    pipes, processes = [], []
    for _ in range(actors):
        parent, child = context.Pipe()
        process = context.Process(target=_import_and_answer, args=(child,), daemon=True)
        process.start()
        pipes.append(parent)
        processes.append(process)
    pids = [pipe.recv() for pipe in pipes]
    wall = time.perf_counter() - start
    cpu = sum(cpu_s(pid) for pid in pids)
    for pipe, process in zip(pipes, processes, strict=True):
        pipe.send(None)
        process.join()
    return wall, cpu


def fork_server_cpu_s() -> float:
    """CPU seconds of this process's fork server (its preload), 0 if none runs."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"forkserver" in cmdline:
            return cpu_s(int(stat.parent.name))
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=3, help="processes started at once")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each, interleaved")
    args = parse(parser, actors=1, repeat=1)
    first_wall, first_cpu = forked(args.actors)
    server_cpu = fork_server_cpu_s()
    rounds: dict[str, list[tuple[float, float]]] = {"forked": [], "spawned": []}
    for _ in range(args.repeat):
        rounds["forked"].append(forked(args.actors))
        rounds["spawned"].append(spawned(args.actors))
    print(f"{args.actors} processes at once, medians of {args.repeat} round(s)")
    print(
        f"fork server's first start: {first_wall:.2f} s wall, its preload {server_cpu:.2f} s"
        f" of CPU, the actors {first_cpu:.2f} s"
    )
    medians = {
        name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        for name, runs in rounds.items()
    }
    for name, (wall, cpu) in medians.items():
        print(f"{name:8} {wall:6.2f} s wall {cpu:6.2f} s CPU")
    (fwall, fcpu), (swall, scpu) = medians["forked"], medians["spawned"]
    # CPU as seconds a process: a forked actor's rounds to a clock tick or two.
    print(
        f"spawned/forked wall x{swall / fwall:.1f}; CPU a process: spawned"
        f" {scpu / args.actors:.2f} s, forked {fcpu / args.actors:.2f} s"
    )


if __name__ == "__main__":
    main()
