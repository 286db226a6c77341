"""Flash attention's shared pieces: block sizes, input validation and the visibility rule.

The kernel variants and the reference validate the same way, so a bad call gets the same
message on every platform.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._common import check


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. Each is clipped to the (padded) problem size, so small inputs stay small.

    TPU: block_q rows of each of the G query heads of one kv head form one [G*block_q, H]
    tile; block_q and block_kv must be multiples of the dtype's sublane count (8 f32, 16
    bf16). GPU (Triton): powers of two, at least 16.
    """

    block_q: int = 128  # query tokens per tile
    block_kv: int = 256  # keys per inner step of the online softmax

    def __post_init__(self):
        check(self.block_q > 0 and self.block_kv > 0, f"block sizes must be positive: {self}")


def validate(q, k, v, q_start, kv_len, *, scale, causal, window, softcap):
    """Checks shapes and options; returns (q_start i32[B], kv_len i32[B], scale)."""
    check(q.ndim == 4, f"q must be [B, T, N, H]; got {q.shape=}")
    check(k.ndim == 4, f"k must be [B, S, K, H]; got {k.shape=}")
    check(v.shape == k.shape, f"{v.shape=} must equal {k.shape=}")
    B, _, N, H = q.shape
    _, S, K, Hk = k.shape
    check(k.shape[0] == B, f"batch differs: {q.shape=} {k.shape=}")
    check(Hk == H, f"head dim differs: {q.shape=} {k.shape=}")
    check(N % K == 0, f"query heads {N=} must be a multiple of kv heads {K=}")
    check(q.dtype == k.dtype == v.dtype, f"dtypes differ: {q.dtype=} {k.dtype=} {v.dtype=}")
    check(jnp.issubdtype(q.dtype, jnp.floating), f"{q.dtype=} must be floating point")
    check(
        window is None or (isinstance(window, int) and window >= 1),
        f"{window=} must be None or a positive int",
    )
    check(softcap is None or softcap > 0, f"{softcap=} must be None or positive")
    check(isinstance(causal, bool), f"{causal=} must be a bool")
    q_start = jnp.zeros((B,), jnp.int32) if q_start is None else q_start
    kv_len = jnp.full((B,), S, jnp.int32) if kv_len is None else kv_len
    for name, a in (("q_start", q_start), ("kv_len", kv_len)):
        check(a.shape == (B,), f"{name} must be [B]={B}; got {a.shape}")
        check(jnp.issubdtype(a.dtype, jnp.integer), f"{name} must be integer; got {a.dtype}")
    scale = H**-0.5 if scale is None else float(scale)
    return q_start.astype(jnp.int32), kv_len.astype(jnp.int32), scale


def visible(qpos, kpos, kv_len, *, causal: bool, window: int | None):
    """Whether a query at position qpos sees the key at kpos (arrays broadcast together)."""
    ok = kpos < kv_len
    if causal:
        ok &= kpos <= qpos
    if window is not None:
        ok &= qpos - kpos < window
    return ok


def kv_block_range(q_first, q_last, kv_len, block_kv: int, *, causal: bool, window: int | None):
    """Key blocks [first, last] that queries at positions q_first..q_last can see, and
    whether they see any key at all. Blocks outside the range are skipped (and not fetched:
    the index maps clamp to the range, so the pipeline sees an unchanged block index)."""
    hi = jnp.minimum(kv_len, q_last + 1) if causal else kv_len  # one past the last key
    lo = jnp.maximum(q_first - window + 1, 0) if window is not None else jnp.int32(0)
    first = lo // block_kv
    last = jnp.maximum((hi + block_kv - 1) // block_kv - 1, first)
    return first, last, hi > lo


def positions(q_start: jax.Array, T: int) -> jax.Array:
    """Position of each query: i32[B, T] = q_start[b] + t."""
    return q_start[:, None] + jnp.arange(T, dtype=jnp.int32)
