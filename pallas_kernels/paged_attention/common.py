"""Paged decode attention's shared pieces: block sizes, input validation, the page range."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._common import check


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """pages_per_block: pages folded into one step of the online softmax (clipped to the
    pages per sequence). On TPU each is its own pipelined DMA, so several pages are in
    flight at once; on GPU (Triton) pages_per_block * page_size must be a power of 2."""

    pages_per_block: int = 8

    def __post_init__(self):
        check(self.pages_per_block > 0, f"pages_per_block={self.pages_per_block} must be positive")


def validate(q, k_pages, v_pages, page_table, lengths, *, scale, window, softcap):
    """Checks shapes and options; returns the scale to use."""
    check(q.ndim == 3, f"q must be [B, N, H]; got {q.shape=}")
    check(k_pages.ndim == 4, f"k_pages must be [K, P, page_size, H]; got {k_pages.shape=}")
    check(v_pages.shape == k_pages.shape, f"{v_pages.shape=} must equal {k_pages.shape=}")
    B, N, H = q.shape
    K, Hk = k_pages.shape[0], k_pages.shape[3]
    check(Hk == H, f"head dim differs: {q.shape=} {k_pages.shape=}")
    check(N % K == 0, f"query heads {N=} must be a multiple of kv heads {K=}")
    check(q.dtype == k_pages.dtype == v_pages.dtype,
          f"dtypes differ: {q.dtype=} {k_pages.dtype=} {v_pages.dtype=}")
    check(jnp.issubdtype(q.dtype, jnp.floating), f"{q.dtype=} must be floating point")
    check(page_table.ndim == 2 and page_table.shape[0] == B,
          f"page_table must be [B={B}, pages_per_seq]; got {page_table.shape}")
    check(lengths.shape == (B,), f"lengths must be [B]={B}; got {lengths.shape}")
    for name, a in (("page_table", page_table), ("lengths", lengths)):
        check(jnp.issubdtype(a.dtype, jnp.integer), f"{name} must be integer; got {a.dtype}")
    check(window is None or (isinstance(window, int) and window >= 1),
          f"{window=} must be None or a positive int")
    check(softcap is None or softcap > 0, f"{softcap=} must be None or positive")
    return H**-0.5 if scale is None else float(scale)


def page_range(length, page_size: int, pages_per_seq: int, window: int | None):
    """Pages [first, last] of a sequence that its query (at position length - 1) can see,
    and whether it sees any token. Pages past the length or wholly before the window are
    skipped; their page-table entries are never dereferenced."""
    n = jnp.minimum((length + page_size - 1) // page_size, pages_per_seq)
    last = jnp.maximum(n - 1, 0)
    first = jnp.int32(0) if window is None else jnp.maximum(length - window, 0) // page_size
    return jnp.minimum(first, last), last, length > 0


def visible(kpos, length, window: int | None):
    """Whether the query of a sequence of this length sees the key at kpos."""
    ok = kpos < length
    if window is not None:
        ok &= kpos >= length - window
    return ok
