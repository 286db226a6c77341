"""The sampler's top-k / top-p thresholds: the reference (the exact bisection) on cases worked
by hand and against numpy's sort, then the Pallas kernel (interpret mode) against the reference
over a grid of vocabularies, temperatures, k and p, with -inf padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sample_threshold as st
from pallas_kernels.sample_threshold.kernel import plan

_count_ref = jax.jit(st.count_threshold_reference)
_mass_ref = jax.jit(st.mass_threshold_reference)
_count_kernel = jax.jit(st.count_threshold_kernel, static_argnames=("block_sizes", "interpret"))
_mass_kernel = jax.jit(st.mass_threshold_kernel, static_argnames=("block_sizes", "interpret"))


def _padded(rows, Vp=128):
    x = np.full((len(rows), Vp), -np.inf, np.float32)
    for i, r in enumerate(rows):
        x[i, : len(r)] = r
    return x


def test_reference_by_hand():
    x = _padded([[3.0, 1.0, 2.0], [3.0, 1.0, 2.0]])
    t = np.array([1.0, 2.0], np.float32)
    # the 2nd largest z: 2.0, and 1.0 at temperature 2 (z = 1.5, 0.5, 1.0)
    np.testing.assert_array_equal(_count_ref(x, t, np.array([2, 2], np.int32)), [2.0, 1.0])
    # probabilities 0.5, 0.3, 0.2: mass relative to the max 1, 0.6, 0.4 (total 2); a target of
    # 1.8 (p = 0.9) needs all three, so the threshold is the smallest z; 1.2 (p = 0.6) two
    z = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    x = _padded([z, z])
    m = np.full(2, z.max(), np.float32)
    got = _mass_ref(x, np.ones(2, np.float32), m, np.array([1.8, 1.2], np.float32))
    np.testing.assert_array_equal(got, [z[2], z[1]])


def _rows(B, V, Vp, seed):
    """B rows of V logits padded with -inf to Vp; temperatures != 1; ties in some rows."""
    rng = np.random.default_rng(seed)
    x = np.full((B, Vp), -np.inf, np.float32)
    x[:, :V] = rng.standard_normal((B, V)).astype(np.float32) * 3
    x[1, : V // 2] = np.round(x[1, : V // 2]) + 0.25  # many ties (and no zeros: XLA flushes denormals)
    t = np.resize(np.array([0.7, 1.3, 0.5, 2.0, 1.0, 0.9], np.float32), B)
    return x, t


def _targets(x, t, ps):
    z = x.astype(np.float64) / t[:, None]
    m = z.max(axis=1)
    total = np.exp(z - m[:, None]).sum(axis=1)
    return (m.astype(np.float32), (np.resize(np.asarray(ps), len(t)) * total).astype(np.float32))


def test_reference_against_numpy():
    """count: the k-th largest z; mass: the z where numpy's float64 cumulative mass of the
    sorted row first reaches the target (compared where that is not within rounding of it).
    z = x / t as XLA divides (XLA:CPU's division may differ from numpy's by an ulp)."""
    B, V, Vp = 6, 1000, 1024
    x, t = _rows(B, V, Vp, 0)
    k = np.array([65, 500, 999, 1, 1000, 130], np.int32)
    z = np.asarray(jax.jit(jnp.divide)(x, t[:, None]))
    expected = -np.sort(-z, axis=1)[np.arange(B), k - 1]
    np.testing.assert_array_equal(_count_ref(x, t, k), expected)
    m, target = _targets(x, t, [0.5, 0.9, 0.999])
    got = np.asarray(_mass_ref(x, t, m, target))
    for b in range(B):
        zs = -np.sort(-z[b, :V].astype(np.float64))
        cum = np.cumsum(np.exp(zs - m[b]))
        j = np.searchsorted(cum, target[b])
        if abs(cum[j] - target[b]) > 1e-5 * cum[-1] and (j == 0 or abs(cum[j - 1] - target[b]) > 1e-5 * cum[-1]):
            assert got[b] == np.float32(zs[j]), (b, got[b], zs[j])


def _same_or_tie(got, ref, x, t, m, target):
    """Equal, or both thresholds leave a mass within float32 rounding of the target (the kernel
    sums in another order than XLA; a sum that close to the target can settle either way)."""
    z = x.astype(np.float64) / t[:, None]
    e = np.exp(z - m[:, None].astype(np.float64))
    for b in np.flatnonzero(got != ref):
        at = [e[b][z[b] >= c].sum() for c in (got[b], ref[b])]
        bound = 4e-7 * x.shape[1] ** 0.5 * e[b].sum()
        assert all(abs(a - target[b]) <= bound for a in at) or min(at) >= target[b] - bound, (b, got[b], ref[b], at)


BLOCKS = [st.BlockSizes(), st.BlockSizes(block_v=384, store_exp=True), st.BlockSizes(block_v=128, store_exp=False)]


@pytest.mark.parametrize("bs", BLOCKS, ids=["default", "384-stored", "128-recomputed"])
@pytest.mark.parametrize("B,V,Vp", [(4, 1000, 1024), (16, 1600, 1664), (8, 2048, 2048)])
def test_kernel_equals_reference(B, V, Vp, bs):
    """Vp 1664 = 13 x 128: a tail after the 1024-lane chunks; B = 4: one block of fewer than 8
    rows; B = 16: two programs."""
    x, t = _rows(B, V, Vp, B + V)
    k = np.resize(np.array([65, 500, V - 1, 1, V], np.int32), B)
    np.testing.assert_array_equal(_count_kernel(x, t, k, block_sizes=bs, interpret=True), _count_ref(x, t, k))
    m, target = _targets(x, t, [0.5, 0.9, 0.999])
    got = np.asarray(_mass_kernel(x, t, m, target, block_sizes=bs, interpret=True))
    ref = np.asarray(_mass_ref(x, t, m, target))
    _same_or_tie(got, ref, x, t, m, target)
    assert np.mean(got == ref) >= 0.9, (got, ref)


def test_dispatch_picks_the_kernel_on_tpu_or_interpreted():
    x, t = _rows(8, 500, 512, 3)
    k = np.full(8, 100, np.int32)
    ref = _count_ref(x, t, k)
    # jitted: run op by op, XLA:CPU divides x / t otherwise than in a fusion (by an ulp)
    run = jax.jit(st.count_threshold, static_argnames=("interpret", "platform"))
    np.testing.assert_array_equal(run(x, t, k, platform="cpu"), ref)
    np.testing.assert_array_equal(run(x, t, k, interpret=True), ref)


def test_bad_inputs_are_named():
    x, t = _rows(8, 100, 128, 0)
    with pytest.raises(ValueError, match="multiple of 128"):
        st.count_threshold_reference(x[:, :100], t, np.ones(8, np.int32))
    with pytest.raises(ValueError, match=r"t must be \[B\]"):
        st.mass_threshold_reference(x, t[:4], np.zeros(8, np.float32), np.ones(8, np.float32))
    with pytest.raises(ValueError, match="block_v=100"):
        st.BlockSizes(block_v=100)
    with pytest.raises(ValueError, match="must divide"):
        st.count_threshold_kernel(np.zeros((12, 128), np.float32), np.ones(12, np.float32), np.ones(12, np.int32),
                                  interpret=True)


MB = 1 << 20


@pytest.mark.parametrize("V,vmem,store", [(128256, 16 * MB, True), (151936, 16 * MB, True), (262144, 16 * MB, False),
                                          (262144, 32 * MB, True), (49152, 16 * MB, True)])
def test_row_blocks_fit_the_scoped_vmem_at_the_vocabularies_we_run(V, vmem, store):
    """8 rows a program; exp(z - m) kept beside z where both fit 3/4 of the scoped VMEM, else
    recomputed in each step; a block that does not fit alone goes to the reference."""
    assert plan(256, V, mass=True, block_sizes=st.BlockSizes(), vmem_bytes=vmem) == (8, store)
    assert plan(256, V, mass=False, block_sizes=st.BlockSizes(), vmem_bytes=vmem) == (8, False)
    assert plan(4, V, mass=False, block_sizes=st.BlockSizes(), vmem_bytes=vmem)[0] == 4
    assert not st.fits(8, 512 * 1024, vmem_bytes=16 * MB) and not st.fits(12, 1024, vmem_bytes=16 * MB)
