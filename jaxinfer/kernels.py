"""Where the engine meets ``pallas_kernels``: which ops run as Pallas kernels, decided at trace time.

On TPU and GPU the model's hot ops run as the Pallas kernels, one dispatch function here per op:

* ``ragged_paged_attention``: the packed engine step's attention (``models.packed``), every
  decode row (1..q queries) and every prompt chunk of the prefill row in one call that reads
  each sequence's pages in place (``pallas_kernels.ragged_paged_attention``), windowed layers
  included; int8 KV pools keep the pure-JAX blockwise path.
* ``paged_decode_attention``: one decode token per row over a ``cache.PagedKVCache``
  (``layers.cache_attention``, the model-level paged forward) (``pallas_kernels.paged_attention``).
* ``prefill_attention``: prompts that start from 0 attending to their own new keys (the static
  engine's prefill, perplexity, calibration: ``layers.attend_layer`` without a cache to read)
  (``pallas_kernels.flash_attention``).
* ``quant_matmul``: quantized matmuls as the int8 / weight-only kernels
  (``pallas_kernels.quant_matmul``).
* ``grouped_matmul``: a mixture-of-experts layer's expert matmuls over tokens sorted by expert
  (``pallas_kernels.grouped_matmul``).

On CPU, where Pallas does not compile, the pure-JAX paths stay (``KernelMode.OFF``): the packed
step's blockwise gather, the cache's gather + ``layers.attention``, and ``QuantArray.matmul``
(XLA's native s8 x s8 -> s32 dot), and for grouped matmuls the kernel's schedule as a JAX loop
(``grouped_matmul_xla``: XLA CPU lowers the reference, ``ragged_dot``, to a dense dot over
every expert).

``interpret_kernels()`` forces the kernel path in Pallas interpret mode on any backend, so
the seam itself is tested on CPU: a model or engine built and traced inside it runs every
kernel it would run on a TPU. The choice is read while tracing; an executable already
compiled keeps the path it was traced with (the engine's steps take the mode as a static
argument, so it is part of their cache key).

Kept out of the kernel path (the reference serves): int8 KV pools; layers with attention
sinks (gpt-oss) in ``paged_decode_attention`` and ``prefill_attention``, whose kernels take
none (``ragged_paged_attention``, the paged engine's, does); and, for
``paged_decode_attention``, windowed layers whose page table starts at a per-row base page
(that kernel indexes tables from logical page 0; the packed step lays such tables out by
logical page before its ragged call).
"""

from __future__ import annotations

import contextlib
import enum
import threading

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import flash_attention as fa
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import paged_attention as pa
from pallas_kernels import quant_matmul as qm
from pallas_kernels import ragged_paged_attention as rpa

_state = threading.local()


class KernelMode(str, enum.Enum):
    """Which path the ops of a trace take. The engine passes it to its jitted steps as a
    static argument, so it is part of every executable's cache key: an executable traced
    with one mode is never reused under another."""

    OFF = "off"  # the pure-JAX references (CPU)
    NATIVE = "native"  # compiled Pallas kernels (TPU/GPU)
    INTERPRET = "interpret"  # Pallas kernels in interpret mode (CPU tests of the kernel path)


@contextlib.contextmanager
def interpret_kernels():
    """Trace the kernel path in Pallas interpret mode (CPU tests of the TPU/GPU path)."""
    with traced_with(KernelMode.INTERPRET):
        yield


@contextlib.contextmanager
def traced_with(mode: KernelMode):
    """Ops traced inside take ``mode``'s path (the jitted steps enter it with their static
    ``kernel_mode``)."""
    old = getattr(_state, "mode", None)
    _state.mode = KernelMode(mode)
    try:
        yield
    finally:
        _state.mode = old


def current_mode() -> KernelMode:
    """The mode in force: the innermost ``traced_with``, else the platform's."""
    mode = getattr(_state, "mode", None)
    if mode is not None:
        return mode
    return KernelMode.NATIVE if _common.platform() in _common.KERNEL_PLATFORMS else KernelMode.OFF


def _interpret() -> bool:
    return current_mode() == KernelMode.INTERPRET


def enabled() -> bool:
    """Whether the ops traced now run as Pallas kernels."""
    return current_mode() != KernelMode.OFF


# ----------------------------------------------------------------------------- matmuls
def quant_matmul(w, x: jax.Array) -> jax.Array:
    """x [M, I] @ QuantArray w -> [M, O] in x.dtype, as a Pallas kernel (the ``matmul`` seam
    of ``QuantArray.einsum``)."""
    from jaxinfer.quant import QuantScheme, quantize_rows

    interpret = _interpret()
    if w.scheme == QuantScheme.W8A8:
        xf = x.astype(jnp.float32)
        if w.smooth is not None:
            xf = xf * w.smooth
        xq, xs = quantize_rows(xf)
        y = qm.int8_matmul(xq, xs, w.values_io(), w.scale, out_dtype=jnp.float32, interpret=interpret)
        return y.astype(x.dtype)
    if w.scheme == QuantScheme.INT4 and w.group % 64:
        return w.matmul(x)  # the kernel unpacks int4 in tiles of 64 rows; XLA serves the rest
    return qm.weight_only_matmul(x, w.values_io(), w.scale, interpret=interpret).astype(x.dtype)


def matmul_for_quantized():
    """The ``matmul=`` to hand ``QuantArray.einsum``: the kernel, or None (plain XLA)."""
    return quant_matmul if enabled() else None


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *, group_offset=0) -> jax.Array:
    """x [M, I] (rows sorted by group) times each group's weight -> [M, O] in x.dtype. w: a
    float [G, I, O] or a ``QuantArray`` of one (contracting axis 1: stored [I, G*O] with a scale
    per group and output channel), holding groups group_offset .. + G - 1 of ``group_sizes``;
    rows of other groups give 0. TPU/GPU (or interpret mode): the Pallas kernel (int4: the XLA
    loop); CPU: ``grouped_matmul_xla``, which reads only the weights of groups with rows."""
    from jaxinfer.quant import QuantArray

    kw = {}
    if isinstance(w, QuantArray):
        if w.smooth is not None:
            x = (x.astype(jnp.float32) * w.smooth).astype(x.dtype)
        # w8a8 experts are multiplied as weight-only int8: the same values and scales
        kw = dict(w_scale=w.scale, out_size=w.shape[-1])
        w = w.values_io()
    mode = current_mode()
    if mode != KernelMode.OFF and gm.kernel_fits(w, x.shape[1]):
        return gm.grouped_matmul_kernel(x, w, group_sizes, group_offset=group_offset,
                                        interpret=mode == KernelMode.INTERPRET, **kw)
    return gm.grouped_matmul_xla(x, w, group_sizes, group_offset=group_offset, **kw)


# ----------------------------------------------------------------------------- attention
def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale, window, softcap):
    """One query per row (q [B, 1, N, H]) over its pages -> [B, 1, N, H]; keys stored
    transposed ([P, K, H, page_size]) as jaxinfer's paged cache keeps them."""
    out = pa.paged_attention(q[:, 0], k_pages, v_pages, page_table, lengths, scale=scale,
                             window=window, softcap=softcap, keys_transposed=True,
                             interpret=_interpret())
    return out[:, None]


def ragged_paged_attention_fits(page_size: int, dtype) -> bool:
    """Whether the ragged kernel takes pools of this page size and dtype here (else the
    caller keeps its pure-JAX path)."""
    return rpa.kernel_fits(page_size, dtype)


def ragged_paged_attention(q, k_pages, v_pages, page_table, q_start, q_len, kv_len, *, scale, window, softcap,
                           sinks=None):
    """Query segments of any length over their sequences' pages (q [T, N, H] packed, keys
    stored transposed as jaxinfer's paged cache keeps them) -> [T, N, H]: the packed step's
    decode rows and prefill segments in one call. See ``pallas_kernels.ragged_paged_attention``.
    Queries are cast to the pools' dtype (a float32 model over bfloat16 pools multiplies in
    bfloat16, accumulating in float32) and the output back to q's. sinks: f32[N] per-head
    attention sinks (gpt-oss), or None."""
    out = rpa.ragged_paged_attention(q.astype(k_pages.dtype), k_pages, v_pages, page_table, q_start, q_len, kv_len,
                                     scale=scale, window=window, softcap=softcap, keys_transposed=True,
                                     interpret=_interpret(), sinks=sinks)
    return out.astype(q.dtype)


def prefill_attention(q, k, v, q_start, *, scale, window, softcap):
    """Causal attention of prompts that start from 0 over their own new keys (q [B, T, N, H],
    k, v [B, T, K, H]; q_start i32[B], 0 by that contract) -> [B, T, N, H]: the flash kernel,
    for the prefill-only steps (perplexity, calibration)."""
    return fa.flash_attention(q, k, v, q_start, None, scale=scale, causal=True, window=window, softcap=softcap,
                              interpret=_interpret())
