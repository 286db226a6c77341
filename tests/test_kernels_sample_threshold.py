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


# ----------------------------------------------------------------------------- wired into the sampler
def _sampler_case(B=8, V=1500, seed=0):
    """Rows that take the bisections (k over 64, nuclei wider than 64 tokens), temperatures
    != 1, some logits -inf (banned), and a greedy row."""
    from jaxinfer import sampling as S

    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((B, V)).astype(np.float32) * 2
    logits[:, 7::11] = -np.inf
    params = [S.SamplingParams(temperature=tmp, top_k=k, top_p=p, seed=i) for i, (tmp, k, p) in enumerate(
        [(0.7, 65, 1.0), (1.3, 500, 1.0), (0.5, V - 1, 1.0), (1.0, 0, 0.5), (2.0, 0, 0.9), (0.8, 0, 0.999),
         (1.2, 300, 0.95), (0.0, 0, 1.0)][:B])]
    state = S.make_sampling_state(params, [[0]] * B, V, default_seed=0, vocab_state=False)
    return jnp.asarray(logits), state


def test_the_sampler_with_the_kernel_equals_the_sampler_with_xla():
    """The thresholds (so the kept sets) and the tokens drawn, kernel (interpret mode) against
    XLA's bisections; the kernel is in the traced program only when asked for."""
    from jaxinfer import sampling as S

    logits, state = _sampler_case()
    B, V = logits.shape
    kernel = S.SamplerKernels(pallas=True, interpret=True)
    xp = jnp.pad(logits, ((0, 0), (0, -V % S._BLOCK)), constant_values=-jnp.inf)
    bmax = jnp.max(xp.reshape(B, -1, S._FINE), axis=2)
    thr = jax.jit(S.filter_threshold, static_argnames=("vocab_size", "kernels"))
    ref = thr(xp, bmax, state, vocab_size=V)[2]
    got = thr(xp, bmax, state, vocab_size=V, kernels=kernel)[2]
    np.testing.assert_array_equal(got, ref)
    # every sampled row was filtered, but k = V - 1 (past the -inf logits: keeps them all)
    assert np.all(np.isfinite(np.asarray(ref)[[0, 1, 3, 4, 5, 6]])), ref
    sample = jax.jit(S.sample, static_argnames="kernels")
    for step in range(3):
        s = jnp.full((B,), step, jnp.int32)
        np.testing.assert_array_equal(sample(logits, state, s, kernels=kernel), sample(logits, state, s))
    assert "pallas_call" in str(jax.make_jaxpr(lambda lg: S.sample(lg, state, s, kernels=kernel))(logits))
    assert "pallas_call" not in str(jax.make_jaxpr(lambda lg: S.sample(lg, state, s))(logits))


def test_the_engines_choice_decides_where_the_sampler_bisects():
    """The Pallas kernel on a TPU under a Pallas choice, interpreted where the choice
    interprets; XLA's passes under the XLA choice, on GPU (no Triton variant) and on a CPU."""
    from jaxinfer import dispatch
    from jaxinfer.sampling import SamplerKernels

    pallas = dispatch.Kernels("pallas", "pallas")
    assert dispatch.sampler_kernels(dispatch.Kernels(platform="tpu")) == SamplerKernels()
    assert dispatch.sampler_kernels(pallas.__class__("pallas", "pallas", platform="tpu")) == SamplerKernels(pallas=True)
    assert dispatch.sampler_kernels(dispatch.Kernels("pallas", "pallas", platform="gpu")) == SamplerKernels()
    assert dispatch.sampler_kernels(dispatch.INTERPRET) == SamplerKernels()  # the TPU kernels, on a CPU
    tpu_interpreted = dispatch.Kernels("pallas", "pallas", interpret=True, platform="tpu")
    assert dispatch.sampler_kernels(tpu_interpreted) == SamplerKernels(pallas=True, interpret=True)
    assert dispatch.sampler_kernels(dispatch.XLA) == SamplerKernels()


def test_the_engines_sampling_step_with_the_kernel_gives_the_same_tokens():
    """``step.sample_rows``, as the engine runs it apart, under the interpreted Pallas choice
    and under XLA's: the same tokens and the same slot state; the choice is a static argument,
    so each gets an executable of its own."""
    from jaxinfer import dispatch
    from jaxinfer.engine import step as st_step
    from jaxinfer.engine.slots import SlotState

    logits, state = _sampler_case()
    B, V = logits.shape
    slots = SlotState(state, jnp.zeros(B, jnp.int32), jnp.full((B, 1), -1, jnp.int32), jnp.zeros(B, jnp.int32),
                      jnp.zeros(B, jnp.int32))
    run = jax.jit(st_step.sample_rows, static_argnames=("num_logprobs", "kernels"))
    active = jnp.ones(B, bool)
    a = run(logits, slots, active, num_logprobs=-1, kernels=dispatch.Kernels("pallas", "pallas", interpret=True,
                                                                             platform="tpu"))
    b = run(logits, slots, active, num_logprobs=-1, kernels=dispatch.XLA)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert run._cache_size() == 2


def test_speculative_verification_with_the_kernel_equals_it_with_xla():
    """verify_block's positions (B * (k + 1) = 8 rows, one kernel block) with wide top-k and
    top-p: the same accepted drafts and tokens with the thresholds from the interpreted kernel."""
    from jaxinfer import sampling as S

    rng = np.random.default_rng(5)
    B, k, V = 4, 1, 700
    logits = jnp.asarray(rng.normal(size=(B, k + 1, V)) * 2, jnp.float32)
    drafts = jnp.asarray(rng.integers(0, V, (B, k)), jnp.int32)
    params = [S.SamplingParams(temperature=0.8, top_k=300, seed=1), S.SamplingParams(temperature=1.2, top_p=0.95, seed=2),
              S.SamplingParams(temperature=0.6, top_k=100, top_p=0.9, seed=3), S.SamplingParams(temperature=0)]
    state = S.make_sampling_state(params, [[]] * B, V, default_seed=0)
    args = (logits, drafts, jnp.full(B, k, jnp.int32), state, jnp.arange(B, dtype=jnp.int32),
            jnp.full((B, 1), -1, jnp.int32), jnp.zeros(B, jnp.int32))
    run = jax.jit(S.verify_block, static_argnames="sampler")
    ref = run(*args)
    got = run(*args, sampler=S.SamplerKernels(pallas=True, interpret=True))
    np.testing.assert_array_equal(got.accepted, ref.accepted)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    traced = jax.make_jaxpr(lambda *a: S.verify_block(*a, sampler=S.SamplerKernels(pallas=True, interpret=True)))
    assert "pallas_call" in str(traced(*args))
