"""The durable output of a batch job: result lines appended one ``os.write`` each, fsynced in
groups, under an exclusive lock; on resume, read back with a torn last line cut off."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from jaxinfer.errors import JaxinferError

if TYPE_CHECKING:
    from jaxinfer.batch.signals import _StopSignals

FSYNC_EVERY = 32
FSYNC_SECONDS = 1.0


class OutputFileError(JaxinferError):
    """The output file cannot be resumed: not a batch output, or locked by another run."""


def _dumps(rec: dict) -> bytes:
    try:
        return json.dumps(rec, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8") + b"\n"
    except UnicodeEncodeError:  # lone surrogates (from a custom_id): JSON escapes instead
        return json.dumps(rec, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii") + b"\n"


def _parse_result(raw: bytes, key_of) -> tuple[dict, tuple] | None:
    try:
        rec = json.loads(raw)
        return rec, key_of(rec)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError, AttributeError):
        return None


def scan_results(path: Path, fmt, *, repair: bool = False) -> Iterator[tuple[int, int, dict, tuple]]:
    """Yield (offset, size, record, key) for each result line of ``path``.

    What follows the last newline is a write cut off by a kill (the start of a result line, or
    the zeros a crash can leave): it is skipped, and with ``repair`` cut from the file (or, if it
    is a whole record missing only its newline, given one). Anything else that is not a result
    line of this format raises OutputFileError: the file is not ours to append to.
    """
    fix = None  # ("truncate", offset) | ("newline", None)
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            parsed = _parse_result(raw, fmt.key_of)
            if not raw.endswith(b"\n"):
                if parsed is not None:
                    fix = ("newline", None)
                    yield offset, len(raw), *parsed
                elif _torn(raw, fmt.record_prefix):
                    fix = ("truncate", offset)
                else:
                    raise _not_ours(path, n)
            elif parsed is not None:
                yield offset, len(raw), *parsed
            elif raw.strip():
                raise _not_ours(path, n)
            offset += len(raw)
    if repair and fix is not None:
        if fix[0] == "truncate":
            os.truncate(path, fix[1])
            print(f"jaxinfer: repaired {path}: cut an incomplete last line", file=sys.stderr)
        else:
            with open(path, "ab") as f:
                f.write(b"\n")
        _fsync_path(path)


def _torn(tail: bytes, prefix: bytes) -> bool:
    """Whether an unterminated last line can be a result line cut short."""
    return prefix.startswith(tail) or tail.startswith(prefix) or not tail.strip(b"\0")


def _not_ours(path: Path, n: int) -> OutputFileError:
    return OutputFileError(f"{path}: line {n} is not a result line of this kind of job; refusing to append to "
                           "it (move the file away or choose another output file)")


class _ResultLog:
    """The append-only output of one process: locked, repaired, appended to, fsynced in groups."""

    def __init__(self, path: Path, stop: _StopSignals):
        self.path, self.stop = path, stop
        self.fd = None
        self.unsynced, self.last_sync = 0, time.monotonic()

    def open(self, fmt) -> Iterator[tuple[dict, tuple]]:
        """Lock the file (creating it), repair its tail, and yield the records already in it."""
        import fcntl

        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputFileError(f"cannot write the output file {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise OutputFileError(f"{self.path} is locked: another jaxinfer batch is writing it") from None
        for _, _, rec, key in scan_results(self.path, fmt, repair=True):
            yield rec, key

    @property
    def opened(self) -> bool:
        return self.fd is not None

    def append(self, rec: dict) -> None:
        data = _dumps(rec)
        with self.stop.writing():
            end = os.lseek(self.fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
            except BaseException:
                os.ftruncate(self.fd, end)  # never leave half a line for the next append to follow
                raise
            self.unsynced += 1
            if self.unsynced >= FSYNC_EVERY or time.monotonic() - self.last_sync >= FSYNC_SECONDS:
                self.sync()

    def sync(self) -> None:
        if self.fd is not None and self.unsynced:
            os.fsync(self.fd)
        self.unsynced, self.last_sync = 0, time.monotonic()

    def close(self) -> None:
        if self.fd is not None:
            self.sync()
            os.close(self.fd)
            self.fd = None


class _NullLog:
    """The log of an SPMD job's processes other than 0: they run every request as process 0
    does (their devices hold part of one program) and count what it writes, but only process 0
    writes OUTPUT."""

    fd = None
    opened = False

    def append(self, rec: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
