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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import paged_attention as pa
from pallas_kernels import quant_matmul as qm
from pallas_kernels import ragged_paged_attention as rpa


# ----------------------------------------------------------------------------- matmuls
def quant_matmul(w, x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """x [M, I] @ QuantArray w -> [M, O] in x.dtype, as a Pallas kernel (int4: groups of a
    multiple of 64 rows, the kernel's tile)."""
    from jaxinfer.quant import QuantScheme, quantize_rows

    if w.scheme == QuantScheme.W8A8:
        xf = x.astype(jnp.float32)
        if w.smooth is not None:
            xf = xf * w.smooth
        xq, xs = quantize_rows(xf)
        y = qm.int8_matmul(xq, xs, w.values_io(), w.scale, out_dtype=jnp.float32, interpret=interpret)
        return y.astype(x.dtype)
    return qm.weight_only_matmul(x, w.values_io(), w.scale, interpret=interpret).astype(x.dtype)


# ----------------------------------------------------------------------------- attention
def ragged_paged_attention_fits(page_size: int, dtype) -> bool:
    """Whether the ragged kernel takes pools of this page size and dtype here (else the
    caller keeps its pure-JAX path)."""
    return rpa.kernel_fits(page_size, dtype)


def ragged_paged_attention(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, *, scale, window, softcap,
                           interpret: bool = False, sinks=None, keys_transposed: bool = False):
    """Query segments of any length over their sequences' pages (q [T, N, H] packed, keys
    k_pages [P, K, ps, H], or [P, K, H, ps] when keys_transposed) -> [T, N, H]: the packed step's
    decode rows and prefill segments in one call. See ``pallas_kernels.ragged_paged_attention``.
    Queries are cast to the pools' dtype (a float32 model over bfloat16 pools multiplies in
    bfloat16, accumulating in float32) and the output back to q's. sinks: f32[N] per-head
    attention sinks (gpt-oss), or None."""
    out = rpa.ragged_paged_attention(q.astype(k_pages.dtype), k_pages, v_pages, page_table, q_start, q_len, kv_len,
                                     scale=scale, window=window, softcap=softcap, keys_transposed=keys_transposed,
                                     interpret=interpret, sinks=sinks)
    return out.astype(q.dtype)



def paged_attention_fits(page_size: int, dtype) -> bool:
    """Whether the paged decode kernel takes pools of this page size and dtype here."""
    return pa.kernel_fits(page_size, dtype)


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, scale, window, softcap, interpret: bool = False,
                    sinks=None, keys_transposed: bool = False):
    """One query per row over its pages (q [B, N, H] at position lengths[b] - 1, keys k_pages
    [P, K, ps, H], or [P, K, H, ps] when keys_transposed) -> [B, N, H]: a decode-only packed step.
    See ``pallas_kernels.paged_attention``. Queries are cast to the pools' dtype and the output
    back to q's, as ``ragged_paged_attention`` does. sinks: f32[N] per-head attention sinks
    (gpt-oss), or None."""
    out = pa.paged_attention(q.astype(k_pages.dtype), k_pages, v_pages, page_table, lengths, scale=scale,
                             window=window, softcap=softcap, keys_transposed=keys_transposed, interpret=interpret,
                             sinks=sinks)
    return out.astype(q.dtype)
