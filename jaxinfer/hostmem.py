"""Host memory for a process that runs the engine: keep freed memory in the heap.

glibc's malloc serves every request above 32 MB (its largest mmap threshold) with a fresh
``mmap`` and unmaps it on ``free``. XLA CPU allocates each executable's temporary buffer, and
the outputs that do not alias a donated input, anew on every call, so under glibc's defaults
every engine step faults in (and the kernel zeroes) the same tens of megabytes again:
``clear_page_erms`` was 11% of a profile of the packed decode step, and the whole batch
workload ran 10-15% faster with it gone (``benchmarks/RESULTS.md``, "Host memory").

``keep_freed_memory`` turns chunk mmaps off (large blocks come from the heap and are reused)
and keeps up to ``trim_threshold`` bytes of free heap top instead of returning it at once.
It changes the whole process's allocator, so it is for the processes the engine owns (the
``jaxinfer`` command, benchmarks); a Python program embedding ``LLM`` may call it itself.
"""

from __future__ import annotations

import ctypes
import sys

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
