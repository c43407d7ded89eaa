"""Durable writes: a file that appears whole or not at all, a line log that a crash or a
full disk cannot tear, and a full disk reported as one clear error naming the path.

:func:`write_atomic` writes a temporary sibling, fsyncs it, renames it into place and
fsyncs the directory: a crash leaves the old file (or none) or the new one, never a part.
:class:`LineLog` appends whole lines: a line cut short (a crash or a full disk mid-write)
is removed again when the write fails, and cut on the next open if the process died
first, so the next line never lands glued onto it. A full disk (``ENOSPC``, or a quota's
``EDQUOT``) raises :class:`DiskFullError` naming the file; what was written before stays
as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["DiskFullError", "LineLog", "disk_full", "fsync_dir", "guard_disk", "write_atomic"]

_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
NEARLY_FULL_BYTES = 64 << 20
"""Less free space than this after a failed write counts as a full disk: some writers
(torch's file writer among them) report a failed write without its errno."""


class DiskFullError(OSError):
    """The disk (or quota) holding a record is full; what was recorded before is intact."""


def disk_full(path: str | Path, what: str) -> DiskFullError:
    """The error for a write of ``what`` to ``path`` that found the disk full."""
    try:
        left = shutil.disk_usage(Path(path).parent).free
        free = f"{left >> 20} MiB free" if left >= 1 << 20 else f"{left >> 10} KiB free"
    except OSError:
        free = "free space unknown"
    return DiskFullError(
        f"{path}: the disk is full (no space left on device, {free}) writing {what}; "
        "everything recorded before is intact: free some space, then resume the run"
    )


def _says_full(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it came from, is ``ENOSPC`` or ``EDQUOT``."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_disk_full(exc: BaseException, path: str | Path) -> bool:
    """Whether ``exc`` (or an exception it came from) says no space is left, or the
    filesystem holding ``path`` has less than :data:`NEARLY_FULL_BYTES` left."""
    if _says_full(exc):
        return True
    for candidate in (Path(path), *Path(path).parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(candidate).free < NEARLY_FULL_BYTES
    return False


@contextlib.contextmanager
def guard_disk(path: str | Path, what: str) -> Iterator[None]:
    """Turn a full disk met inside the block into :class:`DiskFullError` naming ``path``."""
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as exc:  # a writer may wrap the OSError (zipfile, torch)
        if _says_full(exc):
            raise disk_full(path, what) from exc
        raise


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in ``path`` durable (best effort where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, write: Callable[[BinaryIO], None], what: str) -> None:
    """``write(file)`` into ``.NAME.tmp`` beside ``path``, fsynced, then renamed to
    ``path`` and the directory fsynced: after a crash ``path`` is whole or absent (a
    leftover ``.NAME.tmp`` is the part a crash cut off). A full disk raises
    :class:`DiskFullError` and leaves no temporary file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with guard_disk(path, what):
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


class LineLog:
    """A text file appended one whole line at a time (UTF-8, ``\\n``-terminated).

    Opening cuts a last line that has no newline (a write the process died in); a write
    that fails (a full disk: :class:`DiskFullError`) removes what it wrote of its line.
    ``fsync``: each line is also fsynced (durable across power loss, not only a crash).
    """

    def __init__(self, path: Path, what: str, *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.what = what
        self._fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with guard_disk(self.path, what):
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            _cut_torn_line(self._fd)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def append(self, line: str) -> None:
        """Write ``line`` and its newline, whole or not at all."""
        if self._fd is None:
            raise ValueError(f"{self.what} {self.path} is closed")
        data = memoryview((line + "\n").encode("utf-8"))
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            with guard_disk(self.path, self.what):
                while data:
                    data = data[os.write(self._fd, data) :]
                if self._fsync:
                    os.fsync(self._fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _cut_torn_line(fd: int) -> None:
    """Truncate the file after its last newline (to empty if it has none)."""
    end = os.lseek(fd, 0, os.SEEK_END)
    keep = end
    while keep > 0:
        block = min(keep, 1 << 16)
        chunk = os.pread(fd, block, keep - block)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            keep = keep - block + newline + 1
            break
        keep -= block
    if keep != end:
        os.ftruncate(fd, keep)
