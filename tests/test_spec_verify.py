"""Speculative verification: the reference by hand, greedy verification against the plain
sampler, rejection sampling against the exact distribution of a bigram model (chi-square,
independent numpy probabilities), and both Pallas kernel variants (interpret mode) against the
reference.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxinfer import sampling as S
from jaxinfer.sampling import SamplingParams
from pallas_kernels.spec_verify import BlockSizes, spec_verify_reference
from pallas_kernels.spec_verify.kernel import _VARIANTS
from tests.kernel_testing import INTERPRET, run_interpreted, skip_unless_runs_here

_verify = jax.jit(S.verify_block, static_argnames=("use_kernel", "interpret"))
_sample = jax.jit(S.sample)


def ref_probs(*args):
    """tests.test_sampling's independent numpy probabilities, imported where used: that module
    needs hypothesis, which a GPU image running only this file's kernel cases may lack."""
    from tests.test_sampling import ref_probs

    return ref_probs(*args)


def _state(params, V, prompts=None):
    prompts = prompts or [[] for _ in params]
    return S.make_sampling_state(params, prompts, V, default_seed=3)


def _no_min(B):
    return jnp.full((B, 1), -1, jnp.int32), jnp.zeros(B, jnp.int32)


# ------------------------------------------------------------------ by hand
def test_greedy_block_by_hand():
    V, k = 6, 3
    logits = np.full((1, k + 1, V), -1.0, np.float32)
    for j, t in enumerate([2, 5, 1, 4]):  # the target's argmax at each position
        logits[0, j, t] = 3.0
    state = _state([SamplingParams(temperature=0)], V)
    stop, mins = _no_min(1)
    for drafts, nd, want_a, want in [([2, 5, 1], 3, 3, [2, 5, 1, 4]), ([2, 0, 1], 3, 1, [2, 5, -1, -1]),
                                     ([3, 5, 1], 3, 0, [2, -1, -1, -1]), ([2, 5, 1], 1, 1, [2, 5, -1, -1])]:
        out = _verify(jnp.asarray(logits), jnp.asarray([drafts], jnp.int32), jnp.asarray([nd], jnp.int32), state,
                      jnp.zeros(1, jnp.int32), stop, mins)
        assert int(out.accepted[0]) == want_a
        assert out.tokens[0].tolist() == want
        counts = np.bincount([t for t in want if t >= 0], minlength=V)
        np.testing.assert_array_equal(out.state.output_counts[0], counts)


def test_sampled_point_mass_by_hand():
    """Two tokens; the draft has probability 0.25: accepted iff u < 0.25, else the other."""
    logits = jnp.asarray(np.log([[[0.25, 0.75], [0.5, 0.5]]]), jnp.float32)
    z = jnp.pad(logits, ((0, 0), (0, 0), (0, 126)), constant_values=-jnp.inf)
    thr = jnp.full((1, 2), -jnp.inf)
    for u0, want_a, want in [(0.2, 1, None), (0.3, 0, 1)]:
        u = jnp.asarray([[[u0, 0.5, 0.5], [0.5, 0.5, 0.5]]], jnp.float32)
        a, nxt = spec_verify_reference(z, thr, jnp.asarray([[0]]), jnp.asarray([1]), u, jnp.asarray([False]),
                                       block_sizes=BlockSizes(128))
        assert int(a[0]) == want_a
        if want is not None:
            assert int(nxt[0]) == want  # the residual max(0, p - 1[x=0]) is all on token 1


# ------------------------------------------------------------------ greedy equals the sampler
@pytest.mark.parametrize("penalties", [False, True])
def test_greedy_equals_plain_sampler(penalties):
    """Drafts equal to the sampler's own continuation are all accepted and the bonus is the
    sampler's next token; a wrong draft at j accepts j and the new token is the sampler's."""
    rng = np.random.default_rng(0)
    B, k, V = 4, 3, 300
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4) if penalties else {}
    params = [SamplingParams(temperature=0, **kw) for _ in range(B)]
    prompts = [rng.integers(0, V, 5).tolist() for _ in range(B)]
    state = _state(params, V, prompts)
    logits = jnp.asarray(rng.normal(size=(B, k + 1, V)), jnp.float32)
    step = jnp.asarray([0, 2, 5, 1], jnp.int32)
    stop = jnp.asarray([[7, -1]] * B, jnp.int32)
    mins = jnp.asarray([0, 3, 0, 9], jnp.int32)  # rows 1 and 3 may not emit token 7 yet
    logits = logits.at[:, :, 7].set(10.0)  # token 7 wins wherever it is allowed
    # the plain sampler's continuation, one step at a time
    st, want = state, []
    for j in range(k + 1):
        masked = S.mask_tokens_before_min(logits[:, j], stop, step + j, mins)
        t = _sample(masked, st, step + j)
        st = S.update_counts(st, t)
        want.append(np.asarray(t))
    want = np.stack(want, 1)  # i32[B, k + 1]
    nd = jnp.full(B, k, jnp.int32)
    out = _verify(logits, jnp.asarray(want[:, :k]), nd, state, step, stop, mins)
    np.testing.assert_array_equal(out.accepted, k)
    np.testing.assert_array_equal(out.tokens, want)
    np.testing.assert_array_equal(out.state.output_counts, st.output_counts)
    wrong = want[:, :k].copy()
    wrong[:, 1] = (wrong[:, 1] + 1) % V
    out = _verify(logits, jnp.asarray(wrong), nd, state, step, stop, mins)
    np.testing.assert_array_equal(out.accepted, 1)
    np.testing.assert_array_equal(out.tokens[:, :2], want[:, :2])
    np.testing.assert_array_equal(out.tokens[:, 2:], -1)


# ------------------------------------------------------------------ rejection sampling is exact
def _bigram_run(L, Q, params, N, k, steps, start, seed):
    """Speculative generation over a bigram model: target logits L[prev], drafts drawn from
    softmax(Q[prev]) (draft model) or, with Q None, a fixed guess (prev + 1) % V (point mass).
    Returns the first `steps` emitted tokens of N independently seeded rows."""
    V = L.shape[0]
    rng = np.random.default_rng(seed)
    p = dataclasses_replace_seeds(params, N)
    state = S.make_sampling_state(p, [[] for _ in range(N)], V, default_seed=seed, request_indices=list(range(N)))
    stop, mins = _no_min(N)
    out = [[] for _ in range(N)]
    last = np.full(N, start)
    gen = np.zeros(N, np.int32)
    while min(len(o) for o in out) < steps:
        drafts = np.zeros((N, k), np.int32)
        probs = np.zeros((N, k, V), np.float32)
        prev = last.copy()
        for j in range(k):
            if Q is None:
                drafts[:, j] = (prev + 1) % V
            else:
                q = np.exp(Q[prev]) / np.exp(Q[prev]).sum(1, keepdims=True)
                probs[:, j] = q
                drafts[:, j] = (q.cumsum(1) > rng.random(N)[:, None]).argmax(1)
            prev = drafts[:, j]
        ctx = np.concatenate([last[:, None], drafts], 1)  # the token before each block position
        logits = jnp.asarray(L[ctx], jnp.float32)
        res = _verify(logits, jnp.asarray(drafts), jnp.full(N, k, jnp.int32), state, jnp.asarray(gen), stop, mins,
                      draft_probs=None if Q is None else jnp.asarray(probs))
        toks, a = np.asarray(res.tokens), np.asarray(res.accepted)
        state = res.state
        for i in range(N):
            out[i] += toks[i, : a[i] + 1].tolist()
        last = toks[np.arange(N), a]
        gen = gen + a + 1
    return np.asarray([o[:steps] for o in out])


def dataclasses_replace_seeds(params, N):
    return [params] * N  # seeds come from default_seed_for(seed, row index)


@pytest.mark.parametrize("draft_model", [False, True])
@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.2, top_k=3), dict(temperature=0.9, top_p=0.8)])
def test_rejection_sampling_matches_exact_distribution(draft_model, kw):
    """The first two tokens of speculative generation are distributed as p(t1 | s) p(t2 | t1)
    under the filtered target, computed independently in float64 numpy (chi-square)."""
    V, k, N = 5, 2, 40000
    rng = np.random.default_rng(1)
    L = rng.normal(size=(V, V)) * 1.5
    Q = rng.normal(size=(V, V)) if draft_model else None
    params = SamplingParams(**kw)
    toks = _bigram_run(L, Q, params, N, k, 2, start=0, seed=11)
    filt = lambda row: ref_probs(row, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), 0.0)  # noqa: E731
    expected = np.array([filt(L[0])[a] * filt(L[a])[b] for a, b in itertools.product(range(V), range(V))])
    observed = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a filtered-out token was emitted"
    chi = scipy.stats.chisquare(observed[keep], expected[keep] * N)
    assert chi.pvalue > 1e-4, chi


def test_chi_square_catches_a_two_percent_bias():
    """The power check behind N = 40000: a sampler off by 2% of the probability mass (0.02 of
    it moved from the likeliest outcome to the next) is rejected by the same test."""
    V, N = 5, 40000
    rng = np.random.default_rng(1)
    L = rng.normal(size=(V, V)) * 1.5
    f = lambda row: ref_probs(row, 0.8, 0, 1.0, 0.0)  # noqa: E731
    expected = np.array([f(L[0])[a] * f(L[a])[b] for a, b in itertools.product(range(V), range(V))])
    biased = expected.copy()
    top = np.argmax(expected)
    biased[top] -= 0.02
    biased[np.argsort(expected)[-2]] += 0.02
    draws = np.random.default_rng(5).choice(V * V, size=N, p=biased / biased.sum())
    observed = np.bincount(draws, minlength=V * V)
    keep = expected > 0
    assert scipy.stats.chisquare(observed[keep], expected[keep] * N).pvalue < 1e-4


def test_draft_equal_to_target_accepts_everything():
    """q == p: min(1, p/q) = 1, every draft is accepted whatever the uniforms."""
    rng = np.random.default_rng(2)
    B, k, V = 64, 3, 200
    logits = jnp.asarray(rng.normal(size=(B, k + 1, V)), jnp.float32)
    p = jax.nn.softmax(logits[:, :k], -1)
    p64 = np.asarray(p, np.float64)
    p64 /= p64.sum(-1, keepdims=True)
    drafts = jnp.asarray([[rng.choice(V, p=p64[b, j]) for j in range(k)] for b in range(B)], jnp.int32)
    state = _state([SamplingParams(temperature=1.0, seed=b) for b in range(B)], V)
    stop, mins = _no_min(B)
    out = _verify(logits, drafts, jnp.full(B, k, jnp.int32), state, jnp.zeros(B, jnp.int32), stop, mins, draft_probs=p)
    assert int(jnp.min(out.accepted)) == k


# ------------------------------------------------------------------ kernel against reference
VARIANTS = _VARIANTS  # target -> variant, as the dispatcher picks them


def _kernel_case(variant, B, k, V, greedy, with_q, block_v=128, seed=None):
    """Both variants (interpret mode; compiled for the device under JAXINFER_TEST_COMPILED=1) against the
    reference: accepted counts and next tokens equal. Logits end in -inf padding, half the
    positions carry a filter threshold, most drafts are the argmax."""
    skip_unless_runs_here(variant)
    rng = np.random.default_rng(B * 100 + k if seed is None else seed)
    J = k + 1
    z = rng.normal(size=(B, J, V)).astype(np.float32) * 2
    z[:, :, -7:] = -np.inf  # padding
    z = jnp.asarray(z)
    thr = jnp.asarray(np.where(rng.random((B, J)) < 0.5, -np.inf, rng.normal(size=(B, J))), jnp.float32)
    amax = np.argmax(np.asarray(z), -1)
    drafts = jnp.asarray(np.where(rng.random((B, k)) < 0.6, amax[:, :k], rng.integers(0, V - 7, (B, k))), jnp.int32)
    nd = jnp.asarray(rng.integers(0, k + 1, B), jnp.int32)
    u = jnp.asarray(rng.random((B, J, 3)), jnp.float32)
    g = jnp.asarray({"all": np.ones(B, bool), "none": np.zeros(B, bool), "mixed": rng.random(B) < 0.5}[greedy])
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, k, V)), jnp.float32), -1) if with_q else None
    bs = BlockSizes(block_v)
    want = jax.jit(lambda *a: spec_verify_reference(*a, block_sizes=bs))(z, thr, drafts, nd, u, g, q)
    got = run_interpreted(lambda *a: VARIANTS[variant](*a, bs, INTERPRET), z, thr, drafts, nd, u, g, q)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


GRID = [  # B, k, V, greedy rows, draft probabilities
    (1, 1, 128, "all", False), (3, 4, 256, "mixed", False), (2, 2, 384, "none", True),
    (4, 3, 512, "mixed", True), (5, 8, 256, "none", False),
]
# Interpreted on CPU, the GPU variant (unrolled over positions, tiles and chunks) compiles
# about 2 s a case, so here only its two mixed cases run by default (both levels of both
# loops' unrolling, with and without draft probabilities); compiled natively all are quick.
_GPU_DEFAULT = {1, 3}


@pytest.mark.parametrize("variant,B,k,V,greedy,with_q", [
    pytest.param(v, *case, marks=[pytest.mark.slow] if v == "gpu" and i not in _GPU_DEFAULT and INTERPRET else [])
    for v in sorted(VARIANTS) for i, case in enumerate(GRID)
])
def test_kernel_equals_reference(variant, B, k, V, greedy, with_q):
    _kernel_case(variant, B, k, V, greedy, with_q)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("B,k,V,block_v,greedy,with_q", [
    (8, 4, 3 * 2048, 2048, "none", True), (8, 4, 3 * 2048, 2048, "mixed", False),
    (4, 2, 5 * 1024, 1024, "none", False), (2, 4, 24 * 2048, 2048, "none", True),
    (6, 7, 9 * 128, 128, "mixed", True),
])
@pytest.mark.parametrize("seed", [1, 2])
def test_kernel_equals_reference_wide(variant, B, k, V, block_v, greedy, with_q, seed):
    """Serving-like vocabularies (a non-power-of-two number of chunks, V = 49152 among them)."""
    _kernel_case(variant, B, k, V, greedy, with_q, block_v=block_v, seed=seed)


def test_verify_block_through_the_kernel_equals_the_reference_path():
    rng = np.random.default_rng(4)
    B, k, V = 3, 2, 300
    logits = jnp.asarray(rng.normal(size=(B, k + 1, V)), jnp.float32)
    drafts = jnp.asarray(rng.integers(0, V, (B, k)), jnp.int32).at[0].set(jnp.argmax(logits[0, :k], -1))
    state = _state([SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=20),
                    SamplingParams(temperature=1.0, top_p=0.9)], V)
    stop, mins = _no_min(B)
    args = (logits, drafts, jnp.full(B, k, jnp.int32), state, jnp.arange(B, dtype=jnp.int32), stop, mins)
    ref = _verify(*args)
    ker = _verify(*args, use_kernel=True, interpret=True)
    np.testing.assert_array_equal(ref.tokens, ker.tokens)


def test_dispatch_picks_the_kernel_where_it_is_faster(monkeypatch):
    """The reference on CPU and GPU (there XLA's fusion of it beat the Triton variant); the
    kernel on TPU or when interpreting. The GPU variant is what the kernel builds there."""
    import pallas_kernels.spec_verify as sv
    from pallas_kernels import _common

    calls = []
    monkeypatch.setattr(sv, "spec_verify_reference", lambda *a, **k: calls.append("ref"))
    monkeypatch.setattr(sv, "spec_verify_kernel", lambda *a, **k: calls.append("kernel"))
    for plat, interpret in [("cpu", False), ("cpu", True), ("gpu", False), ("tpu", False)]:
        sv.spec_verify(*[None] * 6, interpret=interpret, platform=plat)
    assert calls == ["ref", "kernel", "ref", "kernel"]
    assert _common.pick_variant(_VARIANTS, "spec_verify", "gpu") is _VARIANTS["gpu"]
    assert _common.pick_variant(_VARIANTS, "spec_verify", "cpu") is _VARIANTS["tpu"]  # what interpret mode runs


def test_kernel_input_errors_name_the_problem():
    z = jnp.zeros((2, 3, 256), jnp.float32)
    with pytest.raises(ValueError, match="block_v=512 must divide"):
        spec_verify_reference(z, jnp.zeros((2, 3)), jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32),
                              jnp.zeros((2, 3, 3)), jnp.zeros(2, bool), block_sizes=BlockSizes(512))
    with pytest.raises(ValueError, match="drafts must be"):
        spec_verify_reference(z, jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32),
                              jnp.zeros((2, 3, 3)), jnp.zeros(2, bool), block_sizes=BlockSizes(128))


def test_row_without_drafts_draws_as_the_plain_sampler():
    """num_drafts = 0: the new token is exactly sample()'s at that step (same uniforms), so a
    seeded row's output does not depend on whether its step ran with speculation."""
    rng = np.random.default_rng(7)
    B, k, V = 6, 3, 300
    logits = jnp.asarray(rng.normal(size=(B, k + 1, V)), jnp.float32)
    state = _state([SamplingParams(temperature=0.9, top_k=50, seed=b) for b in range(B)], V)
    stop, mins = _no_min(B)
    step = jnp.arange(B, dtype=jnp.int32)
    out = _verify(logits, jnp.asarray(rng.integers(0, V, (B, k)), jnp.int32), jnp.zeros(B, jnp.int32), state, step,
                  stop, mins)
    np.testing.assert_array_equal(out.accepted, 0)
    np.testing.assert_array_equal(out.tokens[:, 0], _sample(logits[:, 0], state, step))


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=0.9, top_k=4, top_p=0.8)])
def test_draft_sample_draws_from_the_q_it_returns(kw):
    """A draft model's q is the row's own shaping of the draft's logits (independent numpy
    shaping), its draws follow q (chi-square over rows that differ only in their step), and a
    greedy row takes the argmax."""
    V, N = 12, 20000
    logits = np.random.default_rng(2).normal(size=V).astype(np.float32) * 2
    state = _state([SamplingParams(seed=7, **kw)] * N, V)
    stop, mins = _no_min(N)
    tokens, q = jax.jit(S.draft_sample)(jnp.tile(jnp.asarray(logits), (N, 1)), jnp.full((N, 0), -1, jnp.int32), state,
                                        jnp.arange(N, dtype=jnp.int32), stop, mins)
    want = ref_probs(logits, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), 0.0)
    np.testing.assert_allclose(np.asarray(q[0]), want, atol=1e-6)
    observed = np.bincount(np.asarray(tokens), minlength=V)
    keep = want > 0
    assert observed[~keep].sum() == 0
    assert scipy.stats.chisquare(observed[keep], want[keep] * N).pvalue > 1e-4
    g_state = _state([SamplingParams(temperature=0)], V)
    stop, mins = _no_min(1)
    tok, _ = S.draft_sample(jnp.asarray(logits)[None], jnp.full((1, 0), -1, jnp.int32), g_state,
                            jnp.zeros(1, jnp.int32), stop, mins)
    assert int(tok[0]) == int(np.argmax(logits))
