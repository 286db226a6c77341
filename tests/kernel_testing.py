"""What the kernel tests share: the one tolerance table, an independent numpy attention,
and builders of NaN-poisoned inputs."""

from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

# Kernel (interpret mode) vs reference, per output dtype:
#   |out - ref| <= atol * max(1, rms(ref)) + rtol * |ref|
# atol scales with the reference's RMS so a 256-term dot (outputs ~5) and a softmax average
# (outputs ~1) are held to the same relative standard; elements near zero by cancellation
# are judged against the size of the whole output, not their own. float32 differs only in
# summation order; bfloat16 also rounds the softmax weights (or dequantized weights) to
# bfloat16 before the second matmul, as a real kernel does, and rounds the output.
TOLERANCES = {
    jnp.dtype(jnp.float32): {"atol": 5e-6, "rtol": 2e-6},
    jnp.dtype(jnp.bfloat16): {"atol": 2e-2, "rtol": 2e-2},
}


# JAXINFER_TEST_COMPILED=1 on a GPU (or TPU) machine: the kernel-grid tests compile each
# kernel for the device (Triton on GPU, Mosaic on TPU) instead of interpreting it, and a
# variant for another platform is skipped. Run them there as
#   JAX_PLATFORMS=cuda,cpu JAXINFER_TEST_COMPILED=1 pytest tests/test_kernels_*.py -m "slow or not slow" -k gpu
# A float32 dot compiled for the device may round its operands to tf32 (10 mantissa bits),
# as Triton's default does, so float32 is held to tf32's standard there; bfloat16 as before.
COMPILED = os.environ.get("JAXINFER_TEST_COMPILED", "") == "1"
INTERPRET = not COMPILED
COMPILED_TOLERANCES = TOLERANCES | {jnp.dtype(jnp.float32): {"atol": 5e-3, "rtol": 5e-3}}


def skip_unless_runs_here(variant: str) -> None:
    """When compiled for the device, skip a variant this machine cannot compile ("tpu" on a GPU)."""
    if COMPILED:
        import pytest

        from pallas_kernels import _common

        if variant != _common.resolve_platform():
            pytest.skip(f"the {variant} variant does not compile on {_common.resolve_platform()}")


def assert_close(out, ref, dtype=None):
    dtype = jnp.dtype(dtype or out.dtype)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        out.shape,
        out.dtype,
        ref.shape,
        ref.dtype,
    )
    a, b = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(a).all(), "NaN/inf in the kernel output"
    tol = (COMPILED_TOLERANCES if COMPILED else TOLERANCES)[dtype]
    rms = float(np.sqrt(np.mean(np.square(b)))) if b.size else 0.0
    np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, rms))


def dense_attention_np(q, k, v, qpos, kv_len, *, scale, causal=True, window=None, softcap=None):
    """Plain softmax attention in float64, one (row, head, query) at a time.

    q [B, T, N, H], k/v [B, S, K, H], qpos [B, T], kv_len [B]. Keys/values at or past
    kv_len are not even looked at (they may be NaN)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for t in range(T):
            p = int(qpos[b, t])
            keys = [
                s
                for s in range(int(kv_len[b]))
                if (not causal or s <= p) and (window is None or p - s < window)
            ]
            if not keys:
                continue
            for n in range(N):
                logits = np.array([q[b, t, n] @ k[b, s, n // G] for s in keys]) * scale
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                w = np.exp(logits - logits.max())
                w /= w.sum()
                out[b, t, n] = sum(wi * v[b, s, n // G] for wi, s in zip(w, keys))
    return out


def paged_pool(
    rng,
    lengths,
    *,
    K,
    H,
    page_size,
    pages_per_seq,
    spare_pages=3,
    dtype=jnp.float32,
    keys_transposed=False,
):
    """A page pool [P, K, page_size, H] holding each sequence's tokens on shuffled pages
    (keys [P, K, H, page_size] if keys_transposed).

    Every slot that is not a live token is NaN: spare pages, the unused tail of each last
    page, and the NaN page that page-table entries past a sequence's pages point to. Also
    returns the contiguous keys/values [B, S, K, H] (S = pages_per_seq * page_size, NaN past
    each length) for the dense reference."""
    B = len(lengths)
    used = sum(-(-int(n) // page_size) for n in lengths)
    P = used + spare_pages + 1
    order = rng.permutation(P)
    nan_page = int(order[-1])
    kp = np.full((P, K, page_size, H), np.nan, np.float32)
    vp = kp.copy()
    table = np.full((B, pages_per_seq), nan_page, np.int32)
    S = pages_per_seq * page_size
    kd = np.full((B, S, K, H), np.nan, np.float32)
    vd = kd.copy()
    c = 0
    for b, n in enumerate(lengths):
        n = int(n)
        kd[b, :n] = rng.normal(size=(n, K, H))
        vd[b, :n] = rng.normal(size=(n, K, H))
        for j in range(-(-n // page_size)):
            page = int(order[c])
            c += 1
            table[b, j] = page
            live = min(page_size, n - j * page_size)
            kp[page, :, :live] = kd[b, j * page_size : j * page_size + live].transpose(1, 0, 2)
            vp[page, :, :live] = vd[b, j * page_size : j * page_size + live].transpose(1, 0, 2)
    if keys_transposed:
        kp = kp.transpose(0, 1, 3, 2)
    cast = lambda a: jnp.asarray(a, dtype)
    # Round through the dtype so the dense numpy reference sees the same numbers.
    kd, vd = np.asarray(cast(kd), np.float32), np.asarray(cast(vd), np.float32)
    return cast(kp), cast(vp), jnp.asarray(table), kd, vd


def run_interpreted(fn, *args):
    """jit(fn)(*args), compiled without LLVM's optimisation passes: an interpret-mode kernel
    is a large while loop that runs once on tiny inputs, and compiling it dominates its
    test (this halves that). Under JAXINFER_TEST_COMPILED=1, plainly compiled for the device."""
    if COMPILED:
        return jax.jit(fn)(*args)
    lowered = jax.jit(fn).lower(*args)
    return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})(*args)


def covering_grid(full: list[list], cycled: list[list]) -> list[tuple]:
    """Every combination of the ``full`` axes, each paired with one combination of the
    ``cycled`` axes, counted through in mixed radix: every value of every axis is covered
    (and every cycled combination, when there are at least that many full ones) at a
    fraction of the full product's cost."""
    cycle = list(itertools.product(*cycled))
    return [(*combo, *cycle[i % len(cycle)]) for i, combo in enumerate(itertools.product(*full))]


def packed_decode_logits(mod, cfg, w, seqs, lens, T: int, *, page_size: int, num_pages: int, kv_dtype=None,
                         kernels=None, seed: int = 0, prefill_row: bool = True, keys_transposed: bool = True,
                         lanes: int = 1):
    """The engine's packed steps by hand over NaN-poisoned pools (``models.packed``): one step
    writes every sequence's first lens[b] tokens to scattered pages, in its prefill row (a
    segment each; prefill_row False: as decode rows of max(lens) queries, which read back
    what they wrote, as a dense cache's prefill does); a second step of decode rows of T
    queries each (tokens lens[b] .. lens[b] + T - 1 of seqs[b]) reads them back -> logits
    f32[B, T, V]. keys_transposed: the keys pools' layout (``cache.PagedKVCache``); lanes: the
    pools' head-dim padding (``cache.init_paged_cache``)."""
    from jaxinfer import cache as kv
    from jaxinfer import dispatch
    from jaxinfer.models.packed import PackedBatch, PackedKV

    kernels = kernels or dispatch.XLA
    ps, B = page_size, len(lens)
    pools = kv.init_paged_cache(cfg, num_pages, ps, kv_dtype, keys_transposed=keys_transposed, lanes=lanes)

    def poison(a):
        if a is None:  # a latent layer's keys: its values pool holds them
            return None
        if isinstance(a, kv.QuantKV):  # int8 values cannot be NaN: their scales can
            return kv.QuantKV(a.values, jnp.full_like(a.scale, jnp.nan), a.axis)
        return jnp.full_like(a, jnp.nan)

    ks, vs = [poison(a) for a in pools.k], [poison(a) for a in pools.v]
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    need = [-(-(n + T) // ps) for n in lens]
    table = np.zeros((B + 1, max(need) + 1), np.int32)  # row B: the prefill row's history (none)
    off = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[off : off + k]
        off += k
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))

    def run(batch, ks, vs):
        cache = PackedKV(ks, vs, batch, (), kernels, keys_transposed=keys_transposed)
        h, cache = mod.forward(w, batch.tokens[None], None, cache, cfg=cfg, positions=batch.positions[None])
        return mod.unembed(w, h, cfg)[0], cache.k, cache.v

    Tp = -(-sum(lens) // 16) * 16
    toks = np.concatenate([np.asarray(s[:n]) for s, n in zip(seqs, lens)])
    pos = np.concatenate([np.arange(n) for n in lens])
    seg = np.concatenate([np.full(n, b) for b, n in enumerate(lens)])
    page = np.concatenate([table[b, np.arange(n) // ps] for b, n in enumerate(lens)])
    pad = Tp - len(toks)
    pre = PackedBatch(
        tokens=i32(np.pad(toks, (0, pad))), positions=i32(np.pad(pos, (0, pad))),
        write_page=i32(np.pad(page, (0, pad))), write_wpage=i32(np.pad(page, (0, pad))),
        active=jnp.zeros(0, bool), use_prev=jnp.zeros(0, bool), last_q=i32([]), table=i32(table[B:]),
        wtable=i32(table[B:]), wbase=i32([0]), seg=i32(np.pad(seg, (0, pad), constant_values=-1)),
        hist_end=jnp.int32(0), targets=i32([-1] * Tp), rows=0, q=1, max_segments=B)

    def rows(starts, real, n):  # decode rows of n queries from starts[b], real[b] of them real
        pos = np.stack([np.minimum(np.arange(a, a + n), a + m - 1) for a, m in zip(starts, real)])
        live = np.arange(n)[None, :] < np.asarray(real)[:, None]  # padding queries write to page 0
        page = np.where(live, np.stack([table[b, pos[b] // ps] for b in range(B)]), 0)
        toks = np.stack([np.asarray(s)[p] for s, p in zip(seqs, pos)])
        return PackedBatch(
            tokens=i32(toks.reshape(-1)), positions=i32(pos.reshape(-1)), write_page=i32(page.reshape(-1)),
            write_wpage=i32(page.reshape(-1)), active=jnp.ones(B, bool), use_prev=jnp.zeros(B, bool),
            last_q=i32(np.asarray(real) - 1), table=i32(table), wtable=i32(table), wbase=i32([0] * (B + 1)),
            seg=i32([]), hist_end=jnp.int32(0), targets=i32([]), rows=B, q=n)

    _, ks, vs = jax.jit(run)(pre if prefill_row else rows([0] * B, lens, max(lens)), ks, vs)
    logits, _, _ = jax.jit(run)(rows(lens, [T] * B, T), ks, vs)
    return np.asarray(logits).reshape(B, T, -1)
