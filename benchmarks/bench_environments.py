"""What a task's root file system archive costs an execution before its launch.

A synthetic root (F files of S KiB of random bytes, ``/bin/sh`` among them) packed as a
``.tar.gz``, prepared by :func:`~qwengyre.rollout.environments.prepare_environment` as
each execution of a task naming it prepares it, K times each way, in one run:

- ``cold``: a node that has never seen it (an empty cache): the archive is hashed,
  unpacked and its root checked;
- ``new process``: the node has it unpacked, but this process has not hashed this file
  yet (a restarted controller or harness host): hashed and checked;
- ``cached``: every later execution: the digest remembered (by path, inode, size,
  mtime), the unpacked root found and checked.

Prints the median of each and the ratio cold / cached.

    python benchmarks/bench_environments.py                 # F=1000 files of 16 KiB, K=5
    python benchmarks/bench_environments.py --files 4000 --repeats 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from _smoke import parse
from qwengyre.rollout import environments
from qwengyre.rollout.environments import EnvironmentOptions, RootfsEnvironment, prepare_environment


def make_archive(scratch: Path, files: int, kib: int) -> Path:
    root = scratch / "root"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "sh").write_bytes(b"#!stand-in\n")
    for index in range(files):
        directory = root / "usr" / f"d{index // 100}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"f{index}").write_bytes(os.urandom(kib * 1024))
    archive = scratch / "root.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(root, arcname=".")
    shutil.rmtree(root)
    return archive


async def prepare(spec: RootfsEnvironment, cache: Path) -> float:
    began = time.perf_counter()
    await prepare_environment(spec, EnvironmentOptions(cache=cache), cache)
    return time.perf_counter() - began


async def measure(
    spec: RootfsEnvironment, scratch: Path, repeats: int
) -> tuple[list[float], list[float], list[float]]:
    """Seconds of each cold, new-process and cached preparation, in one event loop (as
    a controller's)."""
    cold, fresh, cached = [], [], []
    for repeat in range(repeats):
        cache = scratch / f"cache-{repeat}"
        cold.append(await prepare(spec, cache))
        environments._caches.pop(cache)  # as a new process finds the node's cache
        fresh.append(await prepare(spec, cache))
        cached.append(await prepare(spec, cache))
        shutil.rmtree(cache)
    return cold, fresh, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1000, help="files in the root")
    parser.add_argument("--kib", type=int, default=16, help="KiB per file")
    parser.add_argument("--repeats", type=int, default=5, help="preparations each way")
    args = parse(parser, files=20, kib=1, repeats=2)
    scratch = Path(tempfile.mkdtemp(prefix="qwengyre-bench-environments-"))
    try:
        archive = make_archive(scratch, args.files, args.kib)
        cold, fresh, cached = asyncio.run(
            measure(RootfsEnvironment(path=archive), scratch, args.repeats)
        )
        mib = archive.stat().st_size / 2**20
        print(f"archive: {args.files} files x {args.kib} KiB, {mib:.1f} MiB gzipped")
        print(f"{'preparation':<14} {'median ms':>10}   (of {args.repeats})")
        for name, times in (("cold", cold), ("new process", fresh), ("cached", cached)):
            print(f"{name:<14} {statistics.median(times) * 1e3:>10.2f}")
        ratio = statistics.median(cold) / statistics.median(cached)
        print(f"cold / cached: {ratio:.0f}x")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
