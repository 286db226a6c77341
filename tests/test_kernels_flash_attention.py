"""Flash attention: the reference on hand-worked cases and against a dense numpy attention,
then both kernel variants (interpret mode) against the reference over a grid."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_attention as fa
from tests.kernel_testing import INTERPRET, skip_unless_runs_here, assert_close, covering_grid, dense_attention_np, run_interpreted

LN3 = math.log(3.0)


def _one_head(qs, ks, vs):
    """[T] / [S] scalars -> q [1, T, 1, 1], k, v [1, S, 1, 1] (H = 1, scale 1)."""
    f = lambda a: jnp.asarray(a, jnp.float32).reshape(1, -1, 1, 1)
    return f(qs), f(ks), f(vs)


# ----------------------------------------------------------------------------- hand-worked
def test_reference_hand_causal():
    # q1 . k = (0, ln 3): softmax weights 1/4, 3/4 over values 4, 8 -> 7. q0 sees k0 only.
    q, k, v = _one_head([1.0, 1.0], [0.0, LN3], [4.0, 8.0])
    out = fa.flash_attention_reference(q, k, v, scale=1.0)
    np.testing.assert_allclose(np.asarray(out).ravel(), [4.0, 7.0], rtol=1e-6)
    full = fa.flash_attention_reference(q, k, v, scale=1.0, causal=False)
    np.testing.assert_allclose(np.asarray(full).ravel(), [7.0, 7.0], rtol=1e-6)


def test_reference_hand_window_softcap():
    q, k, v = _one_head([1.0, 1.0], [0.0, LN3], [4.0, 8.0])
    own = fa.flash_attention_reference(q, k, v, scale=1.0, window=1)  # each sees itself only
    np.testing.assert_allclose(np.asarray(own).ravel(), [4.0, 8.0], rtol=1e-6)
    # softcap 1: logit ln 3 -> tanh(ln 3) = 0.8, so weights 1 : e^0.8.
    capped = fa.flash_attention_reference(q, k, v, scale=1.0, softcap=1.0)
    e = math.exp(0.8)
    np.testing.assert_allclose(np.asarray(capped).ravel(), [4.0, (4 + 8 * e) / (1 + e)], rtol=1e-6)


def test_reference_hand_offsets_lengths_and_nan():
    # One query at position 1 (a chunk starting at 1) over keys 0..2, key 2 is NaN garbage.
    q, k, v = _one_head([1.0], [0.0, LN3, np.nan], [4.0, 8.0, np.nan])
    q, k, v = (jnp.concatenate([a] * 3) for a in (q, k, v))  # three rows
    out = fa.flash_attention_reference(
        q, k, v, jnp.array([1, 1, 1]), jnp.array([2, 1, 0]), scale=1.0
    )
    np.testing.assert_allclose(np.asarray(out).ravel(), [7.0, 4.0, 0.0], rtol=1e-6)


def test_reference_hand_gqa_heads_share_kv():
    # Two query heads on one kv head: head 0 has q=1 (weights 1/4, 3/4), head 1 has q=0
    # (uniform) at the second position.
    q = jnp.array([1.0, 0.0, 1.0, 0.0], jnp.float32).reshape(1, 2, 2, 1)
    _, k, v = _one_head([0.0], [0.0, LN3], [4.0, 8.0])
    out = np.asarray(fa.flash_attention_reference(q, k, v, scale=1.0))
    np.testing.assert_allclose(out[0, 1, :, 0], [7.0, 6.0], rtol=1e-6)
    np.testing.assert_allclose(out[0, 0, :, 0], [4.0, 4.0], rtol=1e-6)


# ----------------------------------------------------------------------------- vs numpy
def _inputs(rng, *, B=3, T=5, S=13, N=4, K=2, H=8, dtype=jnp.float32, q_start, kv_len):
    q = rng.normal(size=(B, T, N, H)).astype(np.float32)
    k = rng.normal(size=(B, S, K, H)).astype(np.float32)
    v = rng.normal(size=(B, S, K, H)).astype(np.float32)
    for b, n in enumerate(kv_len):  # what lies past kv_len must never be read
        k[b, n:], v[b, n:] = np.nan, np.nan
    q, k, v = (jnp.asarray(a, dtype) for a in (q, k, v))
    return q, k, v, jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32)


@pytest.mark.parametrize(
    "opts",
    [dict(), dict(window=3), dict(softcap=2.0), dict(causal=False), dict(window=4, softcap=1.5)],
)
def test_reference_matches_dense_numpy(opts):
    rng = np.random.default_rng(0)
    # A prefill from 0, a chunk at the end of its keys, a padded row with queries past kv_len.
    q, k, v, qs, kl = _inputs(rng, q_start=[0, 8, 3], kv_len=[5, 13, 6])
    out = fa.flash_attention_reference(q, k, v, qs, kl, **opts)
    qpos = np.asarray(qs)[:, None] + np.arange(q.shape[1])
    want = dense_attention_np(q, k, v, qpos, np.asarray(kl), scale=q.shape[-1] ** -0.5, **opts)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=2e-6)


# ----------------------------------------------------------------------------- kernel grid
VARIANTS = {"tpu": fa.flash_attention_tpu, "gpu": fa.flash_attention_gpu}
# Block sizes each variant accepts: TPU multiples of the sublane count (8 f32 / 16 bf16),
# GPU powers of two >= 16.
BLOCKS = {
    "tpu": [fa.BlockSizes(16, 16), fa.BlockSizes(16, 32)],
    "gpu": [fa.BlockSizes(16, 16), fa.BlockSizes(16, 32)],
}


def _case(variant, dtype, N, K, blocks, T, S, opts, seed=0):
    skip_unless_runs_here(variant)
    rng = np.random.default_rng(seed)
    # Rows: a prefill from 0 (T keys), a chunk ending at S, a padded row whose last query is
    # past kv_len (no key at all when T = 1).
    q_start = [0, S - T, 0]
    kv_len = [T, S, max(T - 1, 0)]
    q, k, v, qs, kl = _inputs(
        rng, T=T, S=S, N=N, K=K, H=16, dtype=dtype, q_start=q_start, kv_len=kv_len
    )
    ref = jax.jit(lambda *a: fa.flash_attention_reference(*a, **opts))(q, k, v, qs, kl)
    out = run_interpreted(
        lambda *a: VARIANTS[variant](*a, block_sizes=blocks, interpret=INTERPRET, **opts),
        q,
        k,
        v,
        qs,
        kl,
    )
    assert_close(out, ref)


# The default run: every axis of the grid is covered, not every combination.
DEFAULT_GRID = [
    # dtype, (N, K), blocks index, T, S, opts
    (jnp.float32, (4, 4), 0, 7, 37, dict()),
    (jnp.float32, (4, 2), 1, 1, 20, dict(window=5)),
    (jnp.bfloat16, (8, 2), 0, 17, 40, dict(softcap=3.0)),
    (jnp.bfloat16, (4, 1), 1, 16, 16, dict(window=9, softcap=2.0)),
]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,heads,b,T,S,opts", DEFAULT_GRID)
def test_kernel_matches_reference(variant, dtype, heads, b, T, S, opts):
    _case(variant, dtype, *heads, BLOCKS[variant][b], T, S, opts)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    "dtype,heads,TS,b,opts",
    covering_grid(
        [
            [jnp.float32, jnp.bfloat16],
            [(8, 8), (8, 4), (8, 2), (8, 1)],
            [(1, 16), (16, 16), (19, 53)],
        ],
        [[0, 1], [dict(), dict(window=6, softcap=5.0), dict(causal=False), dict(window=1)]],
    ),
)
def test_kernel_matches_reference_wide(variant, dtype, heads, TS, b, opts):
    _case(variant, dtype, *heads, BLOCKS[variant][b], *TS, opts)


def test_dispatch_picks_reference_on_cpu_and_kernel_when_interpreting(monkeypatch):
    calls = []
    monkeypatch.setattr(fa, "flash_attention_reference", lambda *a, **k: calls.append("ref"))
    monkeypatch.setattr(fa, "flash_attention_kernel", lambda *a, **k: calls.append("kernel"))
    q = jnp.zeros((1, 1, 1, 8))
    fa.flash_attention(q, q, q)
    fa.flash_attention(q, q, q, interpret=True)
    assert calls == ["ref", "kernel"]


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "fn", [fa.flash_attention_reference, fa.flash_attention_tpu, fa.flash_attention_gpu]
)
def test_bad_inputs_have_clear_messages(fn):
    q, k = jnp.zeros((1, 2, 3, 8)), jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"N=3 must be a multiple of kv heads K=2"):
        fn(q, k, k)
    q = jnp.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"window=0"):
        fn(q, k, k, window=0)
    with pytest.raises(ValueError, match=r"kv_len must be \[B\]=1"):
        fn(q, k, k, None, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"dtypes differ"):
        fn(q.astype(jnp.bfloat16), k, k)


def test_kernel_block_size_messages():
    q, k = jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"block_q=12 must be a multiple of 8"):
        fa.flash_attention_tpu(q, k, k, block_sizes=fa.BlockSizes(12, 16), interpret=True)
    with pytest.raises(ValueError, match=r"block_kv=24 must be a power of 2 >= 16 on GPU"):
        fa.flash_attention_gpu(q, k, k, block_sizes=fa.BlockSizes(16, 24), interpret=True)
