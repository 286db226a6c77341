"""Checkpoints in a bucket (``gs://`` or ``s3://``, through ``jaxinfer.storage``).

``stage(url, root)`` gives the loaders a local path for a checkpoint in object storage:

* A Hugging Face directory (``config.json`` + safetensors): its small files (configs, tokenizer)
  are copied into ``root``; the safetensors stay in the bucket, listed in ``remote.json`` beside
  them, and are read in place (``RemoteFile``): each device's part of each weight by parallel
  range requests, so the host holds about one tensor at a time and never a copy of the
  checkpoint.
* A GGUF file or an Orbax directory (written by ``jaxinfer convert``) is copied whole, streamed,
  into ``root`` (a GGUF once per version of the object), then loaded as a local one.

``upload_tree`` writes a converted checkpoint into a bucket (``jaxinfer convert SRC gs://...``).
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxinfer import storage
from jaxinfer.errors import CheckpointError

REMOTE_INDEX = "remote.json"  # in a staged Hugging Face directory: where its safetensors lie
RANGE_BYTES = 4 << 20  # bytes of one range request
RANGE_REQUESTS = 8  # range requests in flight for one read


def stage(url: str, root: Path) -> Path:
    """A local path the loaders read for the checkpoint at ``url`` (see the module docstring)."""
    u = storage.parse(url.rstrip("/"))
    dest = root / u.scheme / u.bucket / u.key
    i = storage.info(u) if u.key else None
    if i is not None and i.get("size") is not None:  # one object: a GGUF file
        return _copy_file(u, i, dest)
    files = storage.listing(u)
    if not files:
        raise CheckpointError(f"{u}: no such object or directory in the bucket")
    if "config.json" in files:
        small = {n: s for n, s in files.items() if not n.endswith(".safetensors")}
        weights = {n: s for n, s in files.items() if n.endswith(".safetensors") and "/" not in n}
        _copy_tree(u, small, dest)
        (dest / REMOTE_INDEX).write_text(json.dumps({"url": str(u), "files": weights}))
        return dest
    if "jaxinfer.json" in files:
        _copy_tree(u, files, dest)
        return dest
    raise CheckpointError(f"{u}: neither a .gguf object nor a directory with config.json (Hugging Face) or "
                          "jaxinfer.json (an Orbax checkpoint written by `jaxinfer convert`)")


def _copy_file(u: storage.Url, info: dict, dest: Path) -> Path:
    """Stream the object to ``dest`` (once per version: a sidecar notes the one copied)."""
    stamp = dest.with_name(dest.name + ".version")
    version = storage.version(info)
    if dest.is_file() and stamp.is_file() and stamp.read_text() == version:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    with storage.open_read(u, block_size=RANGE_BYTES * RANGE_REQUESTS) as src, open(partial, "wb") as out:
        with storage.errors(u, "read"):
            shutil.copyfileobj(src, out, RANGE_BYTES)
    os.replace(partial, dest)  # a copied file is always whole
    stamp.write_text(version)
    return dest


def _copy_tree(u: storage.Url, files: dict[str, int], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> None:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes(storage.read(u.child(name)))
        os.replace(partial, target)

    with ThreadPoolExecutor(RANGE_REQUESTS) as pool:
        list(pool.map(one, sorted(files)))


def upload_tree(local: Path, u: storage.Url, *, last: str) -> None:
    """Copy a local directory under ``u``, the file ``last`` after all others: a reader that finds
    it finds the rest (an Orbax checkpoint's ``jaxinfer.json``)."""
    if storage.listing(u):
        raise CheckpointError(f"{u}: already holds objects; remove them or choose another destination")
    files = sorted(p for p in Path(local).rglob("*") if p.is_file())
    first = [p for p in files if p.relative_to(local).as_posix() != last]

    def one(p: Path) -> None:
        storage.put(u.child(p.relative_to(local).as_posix()), p.read_bytes())

    with ThreadPoolExecutor(RANGE_REQUESTS) as pool:
        list(pool.map(one, first))
    for p in files:
        if p not in first:
            one(p)


class RemoteFile:
    """A file in a bucket read by byte ranges: ``len()``, ``f[a:b]`` and ``read(a, b)``, which
    splits a long range into ``RANGE_REQUESTS`` requests in flight at once."""

    def __init__(self, url: storage.Url, size: int):
        self.url, self.size = url, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, s: slice) -> bytes:
        start, stop, _ = s.indices(self.size)
        return self.read(start, stop)

    def read(self, start: int, stop: int) -> bytes:
        if stop <= start:
            return b""
        piece = max(1 << 20, min(RANGE_BYTES, -(-(stop - start) // RANGE_REQUESTS)))
        ranges = [(a, min(a + piece, stop)) for a in range(start, stop, piece)]
        return b"".join(storage.read_ranges(self.url, ranges))

    def __repr__(self) -> str:
        return f"RemoteFile({self.url})"


def remote_file(directory: Path, name: str) -> RemoteFile | None:
    """The bucket object standing for ``directory / name`` in a staged directory, if any."""
    index = Path(directory) / REMOTE_INDEX
    if not index.is_file():
        return None
    d = json.loads(index.read_text())
    size = d["files"].get(name)
    return None if size is None else RemoteFile(storage.parse(d["url"]).child(name), size)
