"""Paged decode attention's shared pieces: block sizes, input validation, the page range."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._common import check, check_options, check_pages


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """pages_per_block: pages handled per grid step (TPU) or loop step (GPU), clipped to the
    pages per sequence. On TPU each is its own pipelined DMA, so that many page copies are
    in flight at once."""

    pages_per_block: int = 8

    def __post_init__(self):
        check(self.pages_per_block > 0, f"pages_per_block={self.pages_per_block} must be positive")


def validate(q, k_pages, v_pages, page_table, lengths, *, scale, window, softcap, keys_transposed, sinks=None):
    """Checks shapes and options; returns the scale to use."""
    check_pages(q, k_pages, v_pages, keys_transposed=keys_transposed, rows="B")
    B = q.shape[0]
    check(
        page_table.ndim == 2 and page_table.shape[0] == B,
        f"page_table must be [B={B}, pages_per_seq]; got {page_table.shape}",
    )
    check(lengths.shape == (B,), f"lengths must be [B]={B}; got {lengths.shape}")
    for name, a in (("page_table", page_table), ("lengths", lengths)):
        check(jnp.issubdtype(a.dtype, jnp.integer), f"{name} must be integer; got {a.dtype}")
    return check_options(q, scale=scale, window=window, softcap=softcap, sinks=sinks)


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
