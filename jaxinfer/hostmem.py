"""Host memory for a process that runs the engine: keep freed memory in the heap, and let a
mapped checkpoint's pages go once they are read.

glibc's malloc serves every request above 32 MB (its largest mmap threshold) with a fresh
``mmap`` and unmaps it on ``free``. XLA CPU allocates each executable's temporary buffer, and
the outputs that do not alias a donated input, anew on every call, so under glibc's defaults
every engine step faults in (and the kernel zeroes) the same tens of megabytes again:
``clear_page_erms`` was 11% of a profile of the packed decode step, and the whole batch
workload ran 10-15% faster with it gone (``benchmarks/RESULTS.md``, "Host memory"). Blocks
below 32 MB fare no better: the 12.6 MB logits of a batch-64 step over a 49,152-token
vocabulary were faulted in again on every call (3,072 pages), and only both settings below
together stopped it.

``keep_freed_memory`` turns chunk mmaps off (large blocks come from the heap and are reused)
and keeps up to ``trim_threshold`` bytes of free heap top instead of returning it at once.
It changes the whole process's allocator, so it is for the processes the engine owns (the
``jaxinfer`` command, benchmarks); a Python program embedding ``LLM`` may call it itself.

``release_mapped`` hands back the pages of a memory-mapped checkpoint once a tensor is copied
out of them, so loading holds one tensor of the file at a time, not the file; the copies go
into ``mapped_empty`` arrays, which leave no holes in the heap when dropped.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

_M_TRIM_THRESHOLD = -1  # mallopt parameters from glibc's malloc.h
_M_MMAP_MAX = -4


def keep_freed_memory(trim_threshold: int = 1 << 30) -> bool:
    """Ask glibc to serve large blocks from the heap and keep up to ``trim_threshold`` free
    bytes there. Returns False (and changes nothing) where the C library has no mallopt."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)) == 1


def release_mapped(buf: mmap.mmap, offset: int, nbytes: int) -> None:
    """Drop the pages of ``buf[offset:offset + nbytes]`` from this process once they are
    copied out. Every page read through a mapping otherwise stays in the process's resident
    memory until the map closes, so a load that reads each tensor of a checkpoint once would
    end holding the whole file there beside the weights. The mapping is of a read-only file:
    a later read faults the pages in again (from the page cache, when they are still there)."""
    if nbytes <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset - offset % mmap.PAGESIZE
    buf.madvise(mmap.MADV_DONTNEED, start, min(offset + nbytes, len(buf)) - start)


def mapped_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array in an anonymous mapping of its own, for the large
    short-lived host copies of loading. It is page-aligned, so jax on CPU adopts it as a
    device buffer without copying it (XLA CPU wants 64 bytes), and it goes back to the system
    the moment it is dropped. A heap block would stay in the process: glibc keeps freed
    blocks below its mmap threshold (which rises to 32 MB as large blocks are freed), and the
    device buffers allocated between them fragment the heap; loading a 2 GB model on CPU had
    left 100 MB of such holes by its last layer."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    # Populated in one call, not faulted in a page at a time as it is written: twice as fast.
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if populate:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    else:
        buf = mmap.mmap(-1, nbytes)
    return np.frombuffer(buf, dtype).reshape(shape)
