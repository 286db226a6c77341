"""The Pallas kernels (``pallas_kernels``) in the shapes jaxinfer's tensors come in.

Each function here runs its kernel, compiled on TPU/GPU or, with ``interpret=True``, in Pallas
interpret mode on any backend (the CPU tests of the TPU/GPU path). Which op runs a kernel and
which its reference is decided by ``jaxinfer.dispatch``, from the engine's ``Kernels``:

* ``ragged_paged_attention``: the packed engine step's attention (``models.packed``), every
  decode row (1..q queries) and every prompt chunk of the prefill row in one call that reads
  each sequence's pages in place (``pallas_kernels.ragged_paged_attention``), windowed layers
  included; int8 KV pools keep the pure-JAX blockwise path.
* ``paged_attention``: the same step's attention when it holds only decode rows of one query
  each (``pallas_kernels.paged_attention``: one tile per row and kv head, no query blocks).
* ``quant_matmul``: quantized matmuls as the int8 / weight-only kernels
  (``pallas_kernels.quant_matmul``).
* the experts' grouped matmul: ``pallas_kernels.grouped_matmul``, called by
  ``dispatch.grouped_matmul`` as it is.

Each takes where it runs, as the engine's ``dispatch.Kernels`` says: ``platform`` (which
variant: Mosaic on TPU, Triton on GPU; on CPU, interpreted, the TPU one) and ``mesh`` (None on
one device): on a mesh the call runs inside ``shard_map`` over the "model" axis, each device on
its shard, since XLA cannot partition a Pallas call (``sharding.per_model_shard``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxinfer.sharding import kv_heads_axis, per_model_shard
from pallas_kernels import paged_attention as pa
from pallas_kernels import quant_matmul as qm
from pallas_kernels import ragged_paged_attention as rpa


# ----------------------------------------------------------------------------- matmuls
def quant_matmul(w, x: jax.Array, *, interpret: bool = False, platform: str | None = None,
                 mesh: Mesh | None = None) -> jax.Array:
    """x [M, I] @ QuantArray w -> [M, O] in x.dtype, as a Pallas kernel (int4: groups of a
    multiple of 64 rows, the kernel's tile) for ``platform`` ("cpu" with interpret=True, "gpu",
    "tpu"; None: the default backend's).

    On a mesh the kernel runs per shard of w (``QuantArray.mesh_axes``: where
    ``sharding.quant_shardings`` split its values and scales over "model"): a weight split by
    columns (O: wq, w_gate) gives each device its columns of y and needs no collective; one
    split by rows (I: wo, w_down) multiplies each device's columns of x by its rows, and the
    float32 partial sums are summed over "model"."""
    from jaxinfer.quant import QuantScheme, quantize_rows

    i_ax, o_ax = w.mesh_axes if mesh is not None else (None, None)
    opts = {"interpret": interpret, "platform": platform}
    if w.scheme == QuantScheme.W8A8:
        xf = x.astype(jnp.float32)
        if w.smooth is not None:
            xf = xf * w.smooth
        # the row scales need whole rows: quantized before the rows are split by I
        args = (*quantize_rows(xf), w.values_io(), w.scale)
        specs = (PartitionSpec(None, i_ax), PartitionSpec(), PartitionSpec(i_ax, o_ax), PartitionSpec(o_ax))

        def local(xq, xs, values, scale):
            return qm.int8_matmul(xq, xs, values, scale, out_dtype=jnp.float32, **opts)
    else:
        args = (x, w.values_io(), w.scale)
        scale_spec = PartitionSpec(i_ax, o_ax) if w.scheme == QuantScheme.INT4 else PartitionSpec(o_ax)
        specs = (PartitionSpec(None, i_ax), PartitionSpec(i_ax, o_ax), scale_spec)

        def local(x, values, scale):
            return qm.weight_only_matmul(x, values, scale, **opts).astype(jnp.float32)

    if mesh is None:
        return local(*args).astype(x.dtype)

    def shard(*a):
        y = local(*a)
        return jax.lax.psum(y, i_ax) if i_ax is not None else y

    return per_model_shard(shard, mesh, specs, PartitionSpec(None, o_ax))(*args).astype(x.dtype)


# ----------------------------------------------------------------------------- attention
def ragged_paged_attention_fits(page_size: int, dtype, *, platform: str | None = None) -> bool:
    """Whether the ragged kernel takes pools of this page size and dtype on this platform
    (else the caller keeps its pure-JAX path)."""
    return rpa.kernel_fits(page_size, dtype, platform=platform)


def ragged_paged_attention(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, *, scale, window, softcap,
                           interpret: bool = False, platform: str | None = None, mesh: Mesh | None = None,
                           sinks=None, keys_transposed: bool = False):
    """Query segments of any length over their sequences' pages (q [T, N, H] packed, keys
    k_pages [P, K, ps, H], or [P, K, H, ps] when keys_transposed) -> [T, N, H]: the packed step's
    decode rows and prefill segments in one call. See ``pallas_kernels.ragged_paged_attention``.
    Queries are cast to the pools' dtype (a float32 model over bfloat16 pools multiplies in
    bfloat16, accumulating in float32) and the output back to q's. sinks: f32[N] per-head
    attention sinks (gpt-oss), or None. platform, mesh: where it runs (``per_kv_heads``)."""

    def local(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, sinks):
        out = rpa.ragged_paged_attention(q.astype(k_pages.dtype), k_pages, v_pages, page_table, q_start, q_len,
                                         kv_len, scale=scale, window=window, softcap=softcap, keys_transposed=keys_transposed,
                                         interpret=interpret, platform=platform, sinks=sinks)
        return out.astype(q.dtype)

    return per_kv_heads(local, mesh, q, k_pages, v_pages, (page_table, q_start, q_len, kv_len), sinks)


def paged_attention_fits(page_size: int, dtype, *, platform: str | None = None) -> bool:
    """Whether the paged decode kernel takes pools of this page size and dtype on this platform."""
    return pa.kernel_fits(page_size, dtype, platform=platform)


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, scale, window, softcap, interpret: bool = False,
                    platform: str | None = None, mesh: Mesh | None = None, sinks=None, keys_transposed: bool = False):
    """One query per row over its pages (q [B, N, H] at position lengths[b] - 1, keys k_pages
    [P, K, ps, H], or [P, K, H, ps] when keys_transposed) -> [B, N, H]: a decode-only packed step.
    See ``pallas_kernels.paged_attention``. Queries are cast to the pools' dtype and the output
    back to q's, as ``ragged_paged_attention`` does. sinks: f32[N] per-head attention sinks
    (gpt-oss), or None. platform, mesh: where it runs (``per_kv_heads``)."""

    def local(q, k_pages, v_pages, page_table, lengths, sinks):
        out = pa.paged_attention(q.astype(k_pages.dtype), k_pages, v_pages, page_table, lengths, scale=scale,
                                 window=window, softcap=softcap, keys_transposed=keys_transposed, interpret=interpret,
                                 platform=platform, sinks=sinks)
        return out.astype(q.dtype)

    return per_kv_heads(local, mesh, q, k_pages, v_pages, (page_table, lengths), sinks)


def per_kv_heads(fn, mesh: Mesh | None, q, k_pages, v_pages, rest: tuple, sinks):
    """``fn(q [rows, N, H], k_pages, v_pages, *rest, sinks) -> [rows, N, H]``, on a mesh per
    shard of the pools' KV heads (axis 1 of either key layout; ``sharding.kv_pool_shardings``
    splits them over "model" where it divides them): each device attends its query heads
    (those of its KV heads: head n reads KV head n // G) over its own pages, with the page
    tables and lengths (``rest``) whole. Pools that keep every KV head on every device
    (replicated) are read whole by each device, for every query head. No pool moves."""
    if mesh is None:
        return fn(q, k_pages, v_pages, *rest, sinks)
    heads = kv_heads_axis(mesh, v_pages.shape[1])
    rep = PartitionSpec()
    specs = (PartitionSpec(None, heads), PartitionSpec(None, heads), PartitionSpec(None, heads),
             *(rep for _ in rest))
    if sinks is None:
        body = lambda *a: fn(*a, None)  # noqa: E731
    else:
        body, specs, rest = fn, (*specs, PartitionSpec(heads)), (*rest, sinks)
    return per_model_shard(body, mesh, specs, PartitionSpec(None, heads))(q, k_pages, v_pages, *rest)
