"""What every kernel package shares: the variant for the caller's platform, and small shape helpers."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

# A finite "minus infinity" for masked logits: exp(MASK - m) underflows to 0 without the
# inf - inf = NaN that -inf gives on rows whose every key so far was masked.
MASK_VALUE = -1e30

# Pallas lowerings by the platform that compiles them. CPU has none: there the kernels only
# run in interpret mode, which interprets the TPU variant (its grid/BlockSpec program is the
# one that the interpreter models most closely).
KERNEL_PLATFORMS = ("tpu", "gpu")


PLATFORMS = ("cpu", "gpu", "tpu")


def resolve_platform(p: str | None = None) -> str:
    """The platform a kernel is built for: ``p`` ("cpu", "gpu" or "tpu": where the caller's
    devices are), or, when None, the default backend's (read at call, i.e. trace, time: for
    standalone callers only; an engine passes the platform of the devices it runs on, so that
    it compiles for a TPU topology from a CPU host)."""
    if p is None:
        p = jax.default_backend()
        return "gpu" if p in ("cuda", "rocm") else p
    check(p in PLATFORMS, f"platform={p!r} must be one of {PLATFORMS} (or None: the default backend's)")
    return p


def kernel_target(platform: str | None = None) -> str:
    """Which kernel variant to build on this platform: its own, or "tpu" for interpret mode
    on CPU."""
    p = resolve_platform(platform)
    return p if p in KERNEL_PLATFORMS else "tpu"


def use_kernel(interpret: bool, platform: str | None = None) -> bool:
    """Dispatch rule shared by every op: the kernel where it compiles or when interpreting."""
    return interpret or resolve_platform(platform) in KERNEL_PLATFORMS


def pick_variant(variants: Mapping[str, Callable], name: str, platform: str | None = None) -> Callable:
    """The kernel variant for this platform (``variants`` maps target -> builder)."""
    target = kernel_target(platform)
    if target not in variants:
        raise NotImplementedError(
            f"{name} has no Pallas lowering for {target=}; it has {sorted(variants)}"
        )
    return variants[target]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def sublane(dtype) -> int:
    """Rows per TPU tile for dtype: second-minor block dims must be a multiple of this."""
    return {4: 8, 2: 16, 1: 32}[jnp.dtype(dtype).itemsize]


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """x zero-padded (or ``value``-padded) at the end of ``axis`` up to ``size``."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def check(cond: bool, msg: str) -> None:
    """Input validation shared by kernels and references: a ValueError naming the values."""
    if not cond:
        raise ValueError(msg)


def check_pages(q, k_pages, v_pages, *, keys_transposed: bool, rows: str) -> None:
    """The checks every paged-attention kernel makes of its queries q [rows, N, H] and page
    pools (values [P, K, page_size, H]; keys the same, or [P, K, H, page_size] transposed)."""
    check(q.ndim == 3, f"q must be [{rows}, N, H]; got {q.shape=}")
    check(v_pages.ndim == 4, f"v_pages must be [P, K, page_size, H]; got {v_pages.shape=}")
    _, N, H = q.shape
    P, K, page_size, Hv = v_pages.shape
    want = (P, K, H, page_size) if keys_transposed else (P, K, page_size, H)
    check(
        k_pages.shape == want,
        f"k_pages must be {'[P, K, H, page_size]' if keys_transposed else '[P, K, page_size, H]'}"
        f"={want} to match {v_pages.shape=} and {q.shape=}; got {k_pages.shape}",
    )
    check(Hv == H, f"head dim differs: {q.shape=} {v_pages.shape=}")
    check(N % K == 0, f"query heads {N=} must be a multiple of kv heads {K=}")
    check(
        q.dtype == k_pages.dtype == v_pages.dtype,
        f"dtypes differ: {q.dtype=} {k_pages.dtype=} {v_pages.dtype=}",
    )
    check(jnp.issubdtype(q.dtype, jnp.floating), f"{q.dtype=} must be floating point")


def check_options(q, *, scale, window, softcap, sinks) -> float:
    """Checks the attention options every paged kernel takes; returns the scale to use."""
    check(
        window is None or (isinstance(window, int) and window >= 1),
        f"{window=} must be None or a positive int",
    )
    check(softcap is None or softcap > 0, f"{softcap=} must be None or positive")
    check(sinks is None or sinks.shape == (q.shape[1],),
          f"sinks must be None or [N]={q.shape[1]} (one per query head); got {getattr(sinks, 'shape', sinks)}")
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def masked_attention(s, ok, v, sinks=None):
    """The references' attention in one pass: scores s f32[X, K, G, L] of X query rows, their
    visible keys ok bool[X, L], values v f32[X, K, L, H] -> f32[X, K, G, H]. Invisible keys
    weigh nothing even when their values are NaN; a row with none gives zeros. sinks: f32[K * G]
    one more logit per head in each denominator (weighing no value), or None."""
    K, G = s.shape[1], s.shape[2]
    s = jnp.where(ok[:, None, None], s, MASK_VALUE)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, K, G, 1)
        m = jnp.maximum(m, sink)
    p = jnp.where(ok[:, None, None], jnp.exp(s - m), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + jnp.exp(sink - m)
    v = jnp.where(ok[:, None, :, None], v, 0.0)
    return jnp.einsum("XKGL,XKLH->XKGH", p / jnp.where(l == 0, 1.0, l), v)


def with_sink(m, l, acc, sink):
    """Online-softmax state (max m, sum l, values acc; [M, 1], [M, 1], [M, H]) with one more
    logit per row, sink [M, 1], that weighs no value (attention sinks)."""
    m_new = jnp.maximum(m, sink)
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + jnp.exp(sink - m_new), alpha * acc


def finish_softmax(l, acc):
    """The attention output of online-softmax state (sum l, values acc); rows that saw no
    visible key (l == 0) give zeros."""
    return acc / jnp.where(l == 0.0, 1.0, l)


# The scoped VMEM a Mosaic kernel gets by default, by TPU generation (XLA's default
# --xla_tpu_scoped_vmem_limit_kib): a kernel whose double-buffered blocks need more fails to
# compile. v6e doubles it; an unknown chip (or none: interpret mode) gets the smaller.
SCOPED_VMEM_BYTES = {"v5e": 16 << 20, "v5p": 16 << 20, "v4": 16 << 20, "v6e": 32 << 20}


def scoped_vmem_bytes() -> int:
    """The default scoped VMEM of the TPU being compiled for (the device kind Pallas reads:
    the abstract mesh's inside a shard_map, else the default device's), at trace time."""
    from jax.experimental.pallas import tpu as pltpu

    try:
        version = pltpu.get_tpu_info().chip_version.name.lower()  # "tpu_v5e", ...
    except (ValueError, RuntimeError, AttributeError):
        return min(SCOPED_VMEM_BYTES.values())
    return SCOPED_VMEM_BYTES.get(version.removeprefix("tpu_"), min(SCOPED_VMEM_BYTES.values()))


def page_kernel_fits(page_size: int, dtype, *, platform: str | None = None) -> bool:
    """Whether this platform's paged-attention variants take pages of page_size for pools of
    dtype (the checks they make, asked before calling): TPU tiles need a multiple of the
    dtype's sublane count, Triton dot tiles a power of two >= 16."""
    if kernel_target(platform) == "gpu":
        return is_pow2(page_size) and page_size >= 16
    return page_size % sublane(dtype) == 0
