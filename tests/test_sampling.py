"""Tests for jaxinfer.sampling.

Every device result is checked against an independent numpy computation: sampled frequencies
against the exact filtered distribution (HF's sort-based top-k/top-p/min-p, written out here),
penalties against vLLM's formula and a case worked by hand, logprobs against log-softmax in
float64. Seeds are fixed, so the statistical checks are deterministic.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer import sampling as S
from jaxinfer.errors import InvalidRequest
from jaxinfer.sampling import SamplingParams, StopChecker

_sample = jax.jit(S.sample)
_update = jax.jit(S.update_counts)
_logprobs = jax.jit(S.logprobs_of, static_argnames="num_top")


# --------------------------------------------------------------------------------------------
# Independent reference (float64 numpy, HF's order: temperature, top-k, top-p, min-p)
# --------------------------------------------------------------------------------------------


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def ref_probs(logits, temperature, top_k, top_p, min_p):
    z = np.asarray(logits, np.float64) / temperature
    if top_k > 0:
        kth = np.sort(z)[::-1][min(top_k, len(z)) - 1]
        z = np.where(z < kth, -np.inf, z)
    if top_p < 1:
        order = np.argsort(z, kind="stable")  # ascending, as HF
        cum = np.cumsum(_softmax(z[order]))
        remove = cum <= 1 - top_p
        remove[-1] = False
        z = z.copy()
        z[order[remove]] = -np.inf
    if min_p > 0:
        q = _softmax(z)
        z = np.where(q < min_p * q.max(), -np.inf, z)
    return _softmax(z)


def ref_penalties(logits, prompt, outputs, rep, pres, freq):
    """vLLM's apply_penalties, row by row."""
    out = np.array(logits, np.float64)
    counts = np.bincount(outputs, minlength=len(out)) if len(outputs) else np.zeros(len(out))
    seen = np.zeros(len(out), bool)
    seen[list(prompt)] = True
    seen |= counts > 0
    for v in range(len(out)):
        if seen[v]:
            out[v] = out[v] / rep if out[v] > 0 else out[v] * rep
        out[v] -= freq * counts[v] + pres * (counts[v] > 0)
    return out


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": float("nan")}, "temperature must be finite, got nan"),
        ({"temperature": "0.7"}, "temperature must be a number, got str '0.7'"),
        ({"temperature": True}, "temperature must be a number, got bool True"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k must be -1 (disable), 0 (disable) or >= 1, got -2"),
        ({"top_k": 2.0}, "top_k must be an int, got float 2.0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": True}, "n must be an int, got bool True"),
        ({"n": "2"}, "n must be an int, got str '2'"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 2.5}, "max_tokens must be an int, got float 2.5"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be <= max_tokens=10, got 20"),
        ({"seed": "42"}, "seed must be an int or None, got str '42'"),
        ({"stop": 5}, "stop must be a str or a list of str, got int 5"),
        ({"stop": ["a", 3]}, "stop must contain only strings, got int 3"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0, got -1"),
        ({"stop_token_ids": [3, "1"]}, "stop_token_ids[1] must be an int, got str '1'"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20], got -1"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a bool, got str 'yes'"),
    ],
)
def test_params_invalid(kwargs, message):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop) == (1, 1.0, 1.0, 0, 16, ())
    assert not p.greedy and SamplingParams(temperature=0).greedy
    p = SamplingParams(stop="###", stop_token_ids=[5, 6], temperature=1, top_k=-1, seed=np.int64(3))
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6)
    assert isinstance(p.temperature, float) and type(p.seed) is int
    with pytest.raises(InvalidRequest, match="top_p"):
        dataclasses.replace(p, top_p=2.0)  # replace re-validates
    from jaxinfer import SamplingParams as Exported

    assert Exported is SamplingParams


# --------------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------------

# Probabilities chosen so that no top-p or min-p cut is within 0.003 of a boundary, in a vocab
# order different from the sorted order.
_P8 = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02])[[5, 2, 7, 0, 3, 6, 1, 4]]
_CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.5, 0, 1.0, 0.0),
    (2.0, 3, 1.0, 0.0),
    (1.0, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.3),
    (1.5, 5, 0.8, 0.1),
    (0.7, 0, 0.9, 0.2),
]


def test_sampled_frequencies_match_exact_distribution():
    """One batch, one row per draw, every case in the same batch. Half the draws of a case
    differ by seed (at step 0), half share a seed and differ by step: both must be random."""
    N = 6000  # draws per case
    logits = (np.log(_P8) + 1.7).astype(np.float32)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=10**6 * c + i % 2 * i)
        for c, (t, k, p, m) in enumerate(_CASES)
        for i in range(N)
    ]
    B = len(params)
    state = S.make_sampling_state(params, [[]] * B, 8, default_seed=0)
    step = jnp.asarray(np.tile(np.arange(N) * (1 - np.arange(N) % 2), len(_CASES)), jnp.int32)
    tokens = np.asarray(_sample(jnp.tile(logits, (B, 1)), state, step))
    for c, case in enumerate(_CASES):
        expected = ref_probs(logits, *case)
        counts = np.bincount(tokens[c * N : (c + 1) * N], minlength=8)
        assert counts[expected == 0].sum() == 0, (case, counts)  # filtered tokens never drawn
        live = expected > 0
        chi2 = np.sum((counts[live] - N * expected[live]) ** 2 / (N * expected[live]))
        p_value = scipy.stats.chi2.sf(chi2, live.sum() - 1)
        assert p_value > 1e-4, (case, counts / N, expected, p_value)


def test_wide_nucleus_and_large_k_use_exact_bisection():
    """The thresholds from the bisection fallback equal the fast path and the numpy reference."""
    rng = np.random.default_rng(0)
    B, V = 12, 300
    x = rng.standard_normal((B, V)).astype(np.float32)
    top_k = np.array([0, 1, 5, 50, 299, 300, 1000, 0, 0, 0, 40, 200], np.int32)
    top_p = np.array([1, 1, 1, 1, 1, 1, 1, 0.5, 0.9, 0.99, 0.9, 0.7], np.float32)
    t = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 0.7, 1.3, 1], np.float32)
    xp = jnp.pad(jnp.asarray(x), ((0, 0), (0, -V % S._BLOCK)), constant_values=-jnp.inf)
    bmax = jnp.max(xp.reshape(B, -1, S._FINE), axis=2)
    m = jnp.max(jnp.asarray(x), axis=1) / t

    threshold = jax.jit(S._topk_topp_threshold, static_argnames=("vocab_size", "fast_k"))

    def kept(fast_k):
        thr = threshold(
            xp, bmax, jnp.asarray(t), m, jnp.asarray(top_k), jnp.asarray(top_p), V, fast_k=fast_k
        )
        return np.asarray(jnp.asarray(x) / t[:, None] >= thr[:, None])

    slow, fast = kept(4), kept(V)  # fast_k=4: nearly every row needs a bisection
    for b in range(B):
        expected = ref_probs(x[b], t[b], top_k[b], top_p[b], 0.0) > 0
        np.testing.assert_array_equal(slow[b], expected, err_msg=f"row {b}")
        np.testing.assert_array_equal(fast[b], expected, err_msg=f"row {b}")


# --------------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------------


def test_penalties_hand_computed():
    logits = jnp.array([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    state = S.make_sampling_state([p], [[0, 1]], 6, default_seed=0)
    for tok in (3, 3, 4):
        state = S.update_counts(state, jnp.array([tok]))
    assert np.asarray(state.output_counts).tolist() == [[0, 0, 0, 2, 1, 0]]
    # 0: prompt, 2/2. 1: prompt, -1*2. 2: unseen. 3: 3/2 - 0.25*2 - 0.5. 4: -2*2 - 0.25 - 0.5.
    expected = [1.0, -2.0, 0.5, 0.5, -4.75, 0.0]
    np.testing.assert_allclose(np.asarray(S.apply_penalties(logits, state))[0], expected)


def test_penalties_match_reference_and_steer_greedy():
    rng = np.random.default_rng(1)
    B, V = 8, 1000
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    prompts = [list(rng.integers(0, V, size=rng.integers(0, 30))) for _ in range(B)]
    outputs = [list(rng.integers(0, 40, size=12)) for _ in range(B)]  # repeats likely
    pens = [(1.0 + 0.2 * b, 0.3 * (b % 3) - 0.3, 0.1 * b - 0.2) for b in range(B)]
    params = [
        SamplingParams(
            temperature=0, repetition_penalty=r, presence_penalty=pp, frequency_penalty=f
        )
        for r, pp, f in pens
    ]
    state = S.make_sampling_state(params, prompts, V, default_seed=0)
    for i in range(12):
        state = _update(state, jnp.array([o[i] for o in outputs]))
    got = np.asarray(S.apply_penalties(jnp.asarray(logits), state))
    ref = np.stack([ref_penalties(logits[b], prompts[b], outputs[b], *pens[b]) for b in range(B)])
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    tokens = np.asarray(_sample(jnp.asarray(logits), state, jnp.zeros(B, jnp.int32)))
    np.testing.assert_array_equal(tokens, ref.argmax(axis=1))


# --------------------------------------------------------------------------------------------
# Greedy, seeds, logprobs
# --------------------------------------------------------------------------------------------


def test_greedy_is_argmax_in_mixed_batch():
    rng = np.random.default_rng(2)
    B, V = 8, 1000  # V not a multiple of the block size: the padded path
    logits = rng.standard_normal((B, V)).astype(np.float32)
    logits[3, [17, 900]] = 10.0  # a tie: the first index wins, as np.argmax
    greedy = [0, 2, 3, 5, 7]
    params = [SamplingParams(temperature=0 if b in greedy else 1.0, top_p=0.9) for b in range(B)]
    state = S.make_sampling_state(params, [[]] * B, V, default_seed=0)
    tokens = np.asarray(_sample(jnp.asarray(logits), state, jnp.zeros(B, jnp.int32)))
    np.testing.assert_array_equal(tokens[greedy], logits[greedy].argmax(axis=1))
    assert tokens[3] == 17
    # All-greedy batches take the argmax-only branch: same answer.
    state = S.make_sampling_state([SamplingParams(temperature=0)] * B, [[]] * B, V, default_seed=0)
    tokens = np.asarray(_sample(jnp.asarray(logits), state, jnp.zeros(B, jnp.int32)))
    np.testing.assert_array_equal(tokens, logits.argmax(axis=1))


def _request_logits(step, V, salt):
    """Logits that the 'model' gives one request at one step (independent of the batch)."""
    return np.random.default_rng([salt, step]).standard_normal(V).astype(np.float32) * 2


def _run(requests, slots, B, V, steps, default_seed=7):
    """Decodes each request (params, prompt, salt, request_index) in its slot for `steps`
    steps; other slots get unrelated rows and unrelated step counters. Returns tokens per slot."""
    rng = np.random.default_rng(B * 31 + slots[0])
    params = [
        SamplingParams(temperature=0.8, top_k=int(rng.integers(0, 30)), seed=int(rng.integers(1e6)))
        if b % 2
        else SamplingParams(temperature=0)
        for b in range(B)
    ]
    prompts = [list(rng.integers(0, V, 5)) for _ in range(B)]
    indices = list(range(100, 100 + B))
    for (p, prompt, _, index), slot in zip(requests, slots):
        params[slot], prompts[slot], indices[slot] = p, prompt, index
    state = S.make_sampling_state(
        params, prompts, V, default_seed=default_seed, request_indices=indices
    )
    step = jnp.asarray(rng.integers(0, 50, B), jnp.int32)
    for slot in slots:
        step = step.at[slot].set(0)
    out = {slot: [] for slot in slots}
    for i in range(steps):
        logits = rng.standard_normal((B, V)).astype(np.float32)
        for (_, _, salt, _), slot in zip(requests, slots):
            logits[slot] = _request_logits(i, V, salt)
        tokens = _sample(jnp.asarray(logits), state, step)
        state = _update(state, tokens)
        step = step + 1
        for slot in slots:
            out[slot].append(int(tokens[slot]))
    return [out[slot] for slot in slots]


def test_seeded_tokens_independent_of_batch_position_and_composition():
    V = 1000
    seeded_params = SamplingParams(
        temperature=1.0,
        top_p=0.95,
        min_p=0.02,
        seed=1234,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
    )
    seeded = (seeded_params, [1, 2, 3], 11, 0)
    unseeded = (SamplingParams(temperature=1.2, top_k=50), [4, 5], 12, 3)  # default seed + index
    a = _run([seeded, unseeded], [0, 1], B=8, V=V, steps=6)
    b = _run([seeded, unseeded], [5, 2], B=8, V=V, steps=6)
    c = _run([seeded, unseeded], [13, 6], B=16, V=V, steps=6)
    assert a == b == c
    assert len(set(a[0])) > 1 and len(set(a[1])) > 1  # actually random, not constant
    other_seed = (dataclasses.replace(seeded[0], seed=99),) + seeded[1:]
    assert _run([other_seed], [0], B=8, V=V, steps=6)[0] != a[0]
    other_default = _run([seeded, unseeded], [0, 1], B=8, V=V, steps=6, default_seed=8)
    assert other_default[0] == a[0] and other_default[1] != a[1]


def test_seed_key_layout():
    for seed in (0, 1, 12345, 2**32 - 1):
        np.testing.assert_array_equal(
            S.seed_to_key(seed), jax.random.key_data(jax.random.PRNGKey(seed))
        )
    assert S.seed_to_key(2**32 + 5).tolist() == [1, 5]  # high bits kept
    assert S.default_seed_for(0, 1) != S.default_seed_for(0, 2) != S.default_seed_for(1, 2)


def test_logprobs_match_log_softmax():
    rng = np.random.default_rng(3)
    B, V = 4, 1000
    logits = rng.standard_normal((B, V)).astype(np.float32) * 4
    tokens = rng.integers(0, V, B)
    chosen, top_ids, top_lp = _logprobs(jnp.asarray(logits), jnp.asarray(tokens), num_top=5)
    x = logits.astype(np.float64)
    ref = x - x.max(1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(chosen), ref[np.arange(B), tokens], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-ref, axis=1)[:, :5])
    np.testing.assert_allclose(np.asarray(top_lp), -np.sort(-ref, axis=1)[:, :5], atol=1e-5)
    chosen0, ids0, lp0 = _logprobs(jnp.asarray(logits), jnp.asarray(tokens), num_top=0)
    assert ids0.shape == (B, 0) and lp0.shape == (B, 0)
    np.testing.assert_allclose(np.asarray(chosen0), np.asarray(chosen))


# --------------------------------------------------------------------------------------------
# State construction and min_tokens
# --------------------------------------------------------------------------------------------


def test_make_sampling_state_padding_and_validation():
    p = SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, seed=5)
    state = S.make_sampling_state([p], [[1, 2]], 10, default_seed=0, batch_size=3)
    assert np.asarray(state.temperature).tolist() == [0.5, 0.0, 0.0]  # padding rows are greedy
    assert np.asarray(state.top_k).tolist() == [0, 0, 0]  # -1 means off
    assert np.asarray(state.prompt_mask)[0].tolist() == [0, 1, 1] + [0] * 7
    assert state.output_counts.shape == (3, 10) and state.key.dtype == jnp.uint32
    with pytest.raises(InvalidRequest, match="prompt token ids"):
        S.make_sampling_state([p], [[10]], 10, default_seed=0)
    # write_rows admits a request into a slot of a live batch.
    big = S.make_sampling_state([SamplingParams(temperature=0)] * 4, [[]] * 4, 10, default_seed=0)
    new = S.make_sampling_state([p], [[1, 2]], 10, default_seed=0)
    big = S.write_rows(big, jnp.array([2]), new)
    assert np.asarray(big.temperature).tolist() == [0, 0, 0.5, 0]
    np.testing.assert_array_equal(np.asarray(big.key)[2], S.seed_to_key(5))


def test_mask_tokens_before_min():
    B, V = 8, 1000  # rows 3.. are padding
    params = [
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7]),
        SamplingParams(temperature=0, min_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0),
    ]
    stop_ids, min_tokens = S.min_tokens_inputs(params, eos_token_ids=[2], batch_size=B)
    assert stop_ids[:4].tolist() == [[7, 2], [-1, -1], [2, -1], [-1, -1]]
    assert min_tokens.tolist() == [2, 2, 0, 0, 0, 0, 0, 0]
    logits = np.zeros((B, V), np.float32)
    logits[:, 2] = 5.0  # EOS is the argmax
    logits[:, 7] = 4.0
    logits[:, 9] = 3.0
    state = S.make_sampling_state(params, [[]] * 3, V, default_seed=0, batch_size=B)
    bool_mask = np.zeros((B, V), bool)
    for b, ids in enumerate(stop_ids):
        bool_mask[b, ids[ids >= 0]] = True
    for count, expected in ((0, [9, 2, 2]), (1, [9, 2, 2]), (2, [2, 2, 2])):
        generated = jnp.full((B,), count, jnp.int32)
        for mask in (jnp.asarray(stop_ids), jnp.asarray(bool_mask)):
            masked = S.mask_tokens_before_min(jnp.asarray(logits), mask, generated, min_tokens)
            tokens = _sample(masked, state, generated)
            assert np.asarray(tokens)[:3].tolist() == expected, (count, mask.dtype)


@pytest.mark.parametrize("V", [1000, 512])  # padded to the block size, and a whole number of blocks
def test_banned_ids_sample_as_if_masked(V):
    """min_tokens' ban applied inside the sampler (block maxima and the argmax's block, the
    logits written with it only for sampled rows) gives the tokens of logits with the banned
    ids set to -inf in numpy: greedy rows their first argmax, sampled rows (plain, top-k,
    top-p, penalties) the draw from those logits with the same uniforms, never a banned id."""
    from jaxinfer.engine.step import sample_step

    rng = np.random.default_rng(V)
    B, Sw = 12, 16
    step_fn = jax.jit(sample_step, static_argnames="num_logprobs")
    for trial in range(6):
        logits = rng.integers(0, 40, (B, V)).astype(np.float32) / 4  # ties in and across blocks
        stop_ids = np.full((B, Sw), -1, np.int32)
        for b in range(B):
            top = np.argsort(-logits[b], kind="stable")
            ids = {0: top[:3], 1: [V - 1, V - 2, top[0]], 2: top[:Sw], 3: [top[0]] * 4,
                   4: rng.integers(0, V, 9)}.get(b % 6, [])
            stop_ids[b, : len(ids)] = ids
        min_tokens = np.where(np.arange(B) % 4 == 3, 0, 5).astype(np.int32)  # every 4th row's ban is off
        generated = rng.integers(0, 5, B).astype(np.int32)
        greedy = np.arange(B) % 3 != (trial % 3)
        params = [SamplingParams(temperature=0) if greedy[b] else
                  SamplingParams(temperature=0.9, top_k=[0, 5, 0, 0][b % 4], top_p=[1.0, 1.0, 0.8, 1.0][b % 4],
                                 repetition_penalty=1 + 0.3 * (trial % 2)) for b in range(B)]
        state = S.make_sampling_state(params, [[1, 2]] * B, V, default_seed=trial)
        banned = (generated < min_tokens)[:, None] & (stop_ids >= 0)
        masked = logits.copy()
        for b in range(B):
            masked[b, stop_ids[b][banned[b]]] = -np.inf
        ref = np.asarray(_sample(jnp.asarray(masked), state, jnp.asarray(generated)))
        np.testing.assert_array_equal(ref[greedy], masked[greedy].argmax(axis=1))
        got = np.asarray(_sample(jnp.asarray(logits), state, jnp.asarray(generated),
                                 S.banned_ids(jnp.asarray(stop_ids), jnp.asarray(generated),
                                              jnp.asarray(min_tokens), V)))
        np.testing.assert_array_equal(got, ref, err_msg=f"{trial=}")
        assert not any(banned[b][stop_ids[b] == got[b]].any() for b in range(B))
        tokens, _, _ = step_fn(jnp.asarray(logits), state, jnp.asarray(generated), jnp.asarray(stop_ids),
                               jnp.asarray(min_tokens), num_logprobs=-1)
        np.testing.assert_array_equal(np.asarray(tokens), ref, err_msg=f"{trial=}")


# --------------------------------------------------------------------------------------------
# Stop handling
# --------------------------------------------------------------------------------------------


def _feed(checker, deltas, token_ids=None):
    token_ids = token_ids or [100 + i for i in range(len(deltas))]
    out = []
    for tok, delta in zip(token_ids, deltas):
        out.append(checker.update(tok, delta))
        if checker.finished:
            break
    return out


def test_stop_string_spanning_tokens_is_held_back_and_trimmed():
    c = StopChecker(SamplingParams(stop=["\n\n"], max_tokens=50))
    out = _feed(c, ["Hello", " wor", "ld", "!\n", "\nmore", "never"])
    assert out == ["Hello", " wor", "ld", "!", ""]  # the "\n" waited, then was dropped
    assert c.output_text == "Hello world!" == "".join(out)
    assert (c.finish_reason, c.stop_reason) == ("stop", "\n\n")


def test_include_stop_str_in_output():
    c = StopChecker(SamplingParams(stop=["\n\n"], include_stop_str_in_output=True))
    out = _feed(c, ["Hello", "!\n", "\nmore"])
    assert out == ["Hello", "!\n", "\n"]  # nothing held: the stop string is output anyway
    assert c.output_text == "Hello!\n\n" and c.finish_reason == "stop"


def test_held_back_prefix_released_when_it_does_not_complete():
    c = StopChecker(SamplingParams(stop=["STOP"], max_tokens=4))
    assert _feed(c, ["abc S", "T", "x", "ST"]) == ["abc ", "", "STx", "ST"]
    assert c.finish_reason == "length" and c.output_text == "abc STxST"


def test_earliest_stop_string_wins():
    c = StopChecker(SamplingParams(stop=["world", "lo w"]))
    _feed(c, ["hello world"])
    assert (c.output_text, c.stop_reason) == ("hel", "lo w")


def test_stop_token_ids_and_eos():
    c = StopChecker(SamplingParams(stop_token_ids=[7]), eos_token_ids=[2])
    assert _feed(c, ["a", "<x>", "b"], [5, 7, 6]) == ["a", ""]
    assert (c.output_text, c.finish_reason, c.stop_reason) == ("a", "stop", 7)

    c = StopChecker(SamplingParams(stop_token_ids=[7], include_stop_str_in_output=True))
    _feed(c, ["a", "<x>"], [5, 7])
    assert c.output_text == "a<x>"

    c = StopChecker(SamplingParams(), eos_token_ids=[2])
    _feed(c, ["a", "</s>"], [5, 2])
    assert (c.output_text, c.finish_reason, c.stop_reason) == ("a", "stop", None)

    c = StopChecker(SamplingParams(ignore_eos=True, max_tokens=3), eos_token_ids=[2])
    _feed(c, ["a", "</s>", "b"], [5, 2, 6])
    assert (c.output_text, c.finish_reason) == ("a</s>b", "length")
    with pytest.raises(RuntimeError):
        c.update(1, "x")


def test_min_tokens_defers_stops():
    c = StopChecker(SamplingParams(min_tokens=2, stop=["!"]), eos_token_ids=[2])
    # token 1 is EOS and token 2 completes "!": both within min_tokens, both ignored.
    assert _feed(c, ["", "hi!", " ok", "!"], [2, 5, 6, 7]) == ["", "hi!", " ok", ""]
    assert (c.output_text, c.stop_reason, c.num_tokens) == ("hi! ok", "!", 4)


def _reference_stop(text, stops):
    """Text cut at the earliest-ending occurrence of any stop string (longest on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_stop_strings_streamed_equal_whole_text(text, stops, cuts):
    """However the text is split into deltas, the streamed pieces concatenate to the text cut at
    the first stop string: nothing streamed is ever retracted."""
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    c = StopChecker(SamplingParams(stop=stops, max_tokens=len(deltas)))
    out = _feed(c, deltas)
    expected, stopped = _reference_stop(text, stops)
    assert "".join(out) == c.output_text == expected
    assert c.finish_reason == ("stop" if stopped else "length")


def test_argmax_first_equals_jnp_argmax_with_ties():
    x = jax.random.normal(jax.random.PRNGKey(7), (4, 3, 7789))
    x = x.at[1, 2, 40].set(9.0).at[1, 2, 4000].set(9.0).at[3, 0, 7788].set(9.0)  # ties: the first wins
    x = x.at[2, 1].set(-jnp.inf)  # every entry -inf: index 0, as jnp.argmax
    np.testing.assert_array_equal(S.argmax_first(x), jnp.argmax(x, axis=-1))
