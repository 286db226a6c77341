"""The output of a batch job in object storage (``gs://``, ``s3://``), where an object cannot be
appended to and no lock can be taken: results go out in bounded part objects, and only the
finished job joins them into OUTPUT.

* ``OUTPUT.parts/<run>-<n>.jsonl``: each written whole (a create that fails if the name exists)
  once it holds ``part_lines`` results, or at the first result ``part_seconds`` after its first
  line, and at exit (SIGTERM included). ``<run>`` is unique to each process of each run
  (``<UTC time>-<random>``, and ``-p<I>`` for process I of a multi-host job), so a rerun, or
  another host, never writes over a part; ``<n>`` counts the run's parts.
* What a kill can lose: the results of one unwritten part per process, which a rerun answers
  again.
* A rerun reads OUTPUT (if a finished run left one) and every part, and skips every request
  answered in any of them. A part written twice (a retried upload that had landed, a copy)
  only repeats keys: each key counts once.
* ``OUTPUT.parts/lease`` (``lease-p<I>`` for process I > 0): the run that holds it may write. It
  is created with a precondition (GCS ``ifGenerationMatch=0``, S3 ``If-None-Match: *``), renewed
  every ``LEASE_SECONDS / 3`` with the generation or ETag last written, and deleted at exit. A
  second run finding a live lease stops with an error naming its holder. A lease is stale (taken
  over, again with a precondition) once expired, or at once when its holder was on this host and
  its process is gone (a kill, a reboot).
* Finishing (every request answered): the sources (OUTPUT, then the parts by name) are read; a
  source whose keys all came earlier is left out; if the rest share no key and the order is
  completion order, the store joins them (a compose on GCS; a multipart copy on S3 when every
  part but the last holds 5 MiB, which S3 requires), otherwise OUTPUT is rewritten line by line,
  each key once (and in input order for ``order="input"``). OUTPUT appears whole when the upload
  completes; the parts are deleted only after that, so a crash in between leaves keys a rerun
  skips.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from jaxinfer import storage
from jaxinfer.batch.log import OutputFileError, _dumps, _parse_result
from jaxinfer.storage import Url

if TYPE_CHECKING:
    from jaxinfer.batch.signals import _StopSignals

PART_LINES = 1000
PART_SECONDS = 30.0
LEASE_SECONDS = 60.0
_PART = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{8}(?:-p\d{5})?-\d{6}\.jsonl$")


def parts_prefix(out: Url) -> Url:
    return Url(out.scheme, out.bucket, out.key + ".parts")


def list_parts(out: Url) -> list[tuple[Url, int]]:
    """(URL, size) of each part of OUTPUT, by name (a run's parts in the order written)."""
    prefix = parts_prefix(out)
    return [(prefix.child(name), size) for name, size in sorted(storage.listing(prefix).items()) if _PART.match(name)]


def scan_object(u: Url, fmt) -> Iterator[tuple[int, int, dict, tuple]]:
    """(offset, size, record, key) of each line of an object written whole, streamed: every line
    must be a result line of this format."""
    offset = 0
    with storage.open_read(u) as f, storage.errors(u, "read"):
        for n, raw in enumerate(f, 1):
            parsed = _parse_result(raw, fmt.key_of)
            if parsed is None:
                if raw.strip():
                    raise OutputFileError(f"{u}: line {n} is not a result line of this kind of job; refusing to "
                                          "add to it (move it away or choose another output)")
            else:
                yield offset, len(raw), *parsed
            offset += len(raw)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class _Lease:
    """The right to write OUTPUT's parts: one object, held while renewed."""

    def __init__(self, out: Url, run: str, process_index: int, ttl: float = LEASE_SECONDS):
        self.url = parts_prefix(out).child("lease" if process_index == 0 else f"lease-p{process_index:05d}")
        self.out, self.run, self.ttl = out, run, ttl
        self.version: str | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _body(self) -> bytes:
        return json.dumps({"run": self.run, "host": socket.gethostname(), "pid": os.getpid(), "boot": _boot_id(),
                           "expires": time.time() + self.ttl}).encode()

    def _stale(self, held: dict) -> bool:
        if held.get("expires", 0) < time.time():
            return True
        here = held.get("host") == socket.gethostname()
        return here and (held.get("boot") != _boot_id() or not _alive(int(held.get("pid", 0))))

    def acquire(self) -> None:
        for _ in range(3):  # a race with another run taking a stale lease: look again
            i = storage.info(self.url)
            if i is None:
                ok = storage.create(self.url, self._body())
            else:
                try:
                    held = json.loads(storage.read(self.url))
                except (ValueError, storage.StorageError):
                    held = {}
                if not self._stale(held):
                    left = held.get("expires", 0) - time.time()
                    raise OutputFileError(
                        f"{self.out} is being written by another jaxinfer batch (run {held.get('run')} on host "
                        f"{held.get('host')}, pid {held.get('pid')}; its lease {self.url} expires in {left:.0f} s "
                        "unless renewed): stop that run first, or rerun once the lease has expired")
                ok = storage.replace(self.url, self._body(), storage.version(i))
            if ok:
                # read it back: a store that ignores preconditions (some emulators) must not let
                # two runs both believe they hold it
                i = storage.info(self.url)
                if i is not None and json.loads(storage.read(self.url)).get("run") == self.run:
                    self.version = storage.version(i)
                    self._thread = threading.Thread(target=self._renew, name="jaxinfer-lease", daemon=True)
                    self._thread.start()
                    return
        raise OutputFileError(f"{self.out}: another run took the lease {self.url} while this one tried to; "
                              "two runs are starting on one output")

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    if not storage.replace(self.url, self._body(), self.version):
                        self.lost = True
                        return
                    self.version = storage.version(storage.info(self.url) or {})
                except storage.StorageError as e:  # a blip: the next renewal tries again, well before expiry
                    print(f"jaxinfer: warning: could not renew the lease {self.url}: {e}", file=sys.stderr)

    def check(self) -> None:
        if self.lost:
            raise OutputFileError(f"{self.out}: another run took over the lease {self.url} (this run did not renew "
                                  f"it for {self.ttl:g} s); stopping without writing more")

    def release(self) -> None:
        self._stop.set()
        if self._thread is None:
            return
        with self._lock:
            self._thread.join(timeout=0)
            self._thread = None
            if not self.lost:
                try:
                    i = storage.info(self.url)
                    if i is not None and storage.version(i) == self.version:
                        storage.remove([self.url])
                except storage.StorageError as e:
                    print(f"jaxinfer: warning: could not delete the lease {self.url} ({e}); it expires by itself",
                          file=sys.stderr)


def new_run_id(process_index: int, process_count: int) -> str:
    run = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)
    return run + (f"-p{process_index:05d}" if process_count > 1 else "")


class _PartsLog:
    """One process's output to object storage: results buffered, written a whole part at a time."""

    def __init__(self, out: Url, stop: _StopSignals, *, process_index: int = 0, process_count: int = 1,
                 part_lines: int = PART_LINES, part_seconds: float = PART_SECONDS):
        self.out, self.stop = out, stop
        self.run = new_run_id(process_index, process_count)
        self.lease = _Lease(out, self.run, process_index)
        self.part_lines, self.part_seconds = part_lines, part_seconds
        self.buffer: list[bytes] = []
        self.first = 0.0
        self.written = 0
        self.opened = False

    def open(self, fmt) -> Iterator[tuple[dict, tuple]]:
        """Take the lease, then yield every record of OUTPUT and of every part (a key may repeat)."""
        storage.check_bucket(self.out)
        self.lease.acquire()
        self.opened = True
        yield from read_done(self.out, fmt)

    def append(self, rec: dict) -> None:
        with self.stop.writing():
            if not self.buffer:
                self.first = time.monotonic()
            self.buffer.append(_dumps(rec))
            if len(self.buffer) >= self.part_lines or time.monotonic() - self.first >= self.part_seconds:
                self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        self.lease.check()
        u = parts_prefix(self.out).child(f"{self.run}-{self.written:06d}.jsonl")
        storage.create(u, b"".join(self.buffer))  # False: a retry of this very upload had landed
        self.written += 1
        self.buffer = []

    def close(self) -> None:
        try:
            if self.opened:
                with self.stop.writing():
                    self.flush()
        finally:
            self.lease.release()
            self.opened = False


def read_done(out: Url, fmt) -> Iterator[tuple[dict, tuple]]:
    """Every record of OUTPUT and of its parts."""
    for u in [out] * (storage.info(out) is not None) + [u for u, _ in list_parts(out)]:
        for _, _, rec, key in scan_object(u, fmt):
            yield rec, key


def finish(out: Url, fmt, order: str, run: str) -> None:
    """Join OUTPUT's parts into OUTPUT (see the module docstring), under the lease."""
    lease = _Lease(out, run, 0)
    lease.acquire()
    try:
        parts = list_parts(out)
        i = storage.info(out)
        sources = ([(out, i["size"])] if i is not None else []) + parts
        if not parts and (order == "completion" or not sources):
            if not sources:  # nothing answered (an empty input): the output still appears
                storage.put(out, b"")
            return
        seen: set[tuple] = set()
        chosen, overlap = [], False
        entries = []  # (order, source index, offset, size) for a rewrite in input order
        for si, (u, size) in enumerate(sources):
            keys = [(off, sz, key) for off, sz, _, key in scan_object(u, fmt)]
            new = [k for k in keys if k[2] not in seen]
            if not new:
                continue
            overlap |= len(new) < len(keys)
            chosen.append((u, size))
            if order == "input":
                entries.extend((fmt.order_of(key), si, off, sz) for off, sz, key in new)
            seen.update(k for _, _, k in new)
        if order == "completion" and not overlap:
            if [u for u, _ in chosen] != [out]:
                if storage.can_compose(out, [s for _, s in chosen]):
                    storage.compose(out, [u for u, _ in chosen])
                else:
                    _rewrite(out, fmt, sources, None)
        else:
            _rewrite(out, fmt, sources, sorted(entries, key=lambda e: e[0]) if order == "input" else None)
        storage.remove([u for u, _ in parts])
    finally:
        lease.release()


def _rewrite(out: Url, fmt, sources: list[tuple[Url, int]], entries) -> None:
    """Write OUTPUT anew, streamed: each key once, in source order, or in ``entries``' order
    ((order, source index, offset, size); the sources read with read-ahead, mostly forward since
    each part is in completion order)."""
    fs = storage.filesystem(out)
    with storage.errors(out, "write"), fs.open(out.path, "wb") as dst:
        if entries is None:
            seen: set[tuple] = set()
            for u, _ in sources:
                with storage.open_read(u) as f:
                    for raw in f:
                        parsed = _parse_result(raw, fmt.key_of)
                        if parsed is not None and parsed[1] not in seen:
                            seen.add(parsed[1])
                            dst.write(_line(raw))
        else:
            files = [storage.open_read(u) for u, _ in sources]
            try:
                for _, si, off, sz in entries:
                    f = files[si]
                    f.seek(off)
                    dst.write(_line(f.read(sz)))
            finally:
                for f in files:
                    f.close()
    fs.invalidate_cache(out.path)


def _line(data: bytes) -> bytes:
    return data if data.endswith(b"\n") else data + b"\n"
