"""jaxinfer.hostmem: after keep_freed_memory, a block far above glibc's mmap threshold comes
from the heap (glibc's own counters, mallinfo2, say so), and a freed one is reused rather than
unmapped. Run in a child process: the setting is process-wide."""

import subprocess
import sys

import pytest

CHILD = r"""
import ctypes, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "keep":
    from jaxinfer.hostmem import keep_freed_memory
    assert keep_freed_memory()
n = 64 << 20  # twice glibc's largest mmap threshold
p = libc.malloc(n)
mapped = libc.mallinfo2().hblkhd
libc.free(p)
after_free = libc.mallinfo2()
q = libc.malloc(n)
print(mapped >= n, after_free.fordblks >= n, q == p)
"""


def _child(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_keep_freed_memory_serves_large_blocks_from_the_heap():
    try:
        default = _child("default")
    except subprocess.CalledProcessError as e:  # no mallinfo2: not glibc >= 2.33
        pytest.skip(f"no glibc mallinfo2: {e.stderr[-200:]}")
    assert default[0] == "True"  # glibc's default: a 64 MB block is its own mapping
    mapped, kept, reused = _child("keep")
    assert mapped == "False"  # from the heap, not a fresh mapping
    assert kept == "True"  # freed, it stays in the heap (below the 1 GiB trim threshold)
    assert reused == "True"  # and the next block of that size is the same memory
