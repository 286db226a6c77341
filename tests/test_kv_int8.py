"""int8 KV cache: int8 keys/values with a float32 scale per (token, head), in the dense and
paged caches. Logits stay close to a float cache (tolerances below, measured with margin),
the paged int8 cache equals the dense int8 one, greedy tokens of the real SmolLM2 agree with
float KV, the engine runs end to end on int8 page pools, and memory_report shows the
smaller bytes per token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer import cache as kv
from jaxinfer.config import ModelConfig
from jaxinfer.errors import InvalidRequest
from jaxinfer.models import llama
from jaxinfer.specs import init_weights
from tests.conftest import require_native

CFG = ModelConfig(family="llama", vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                  head_dim=16, d_ff=64)
# int8 with a per-(token, head) scale: each key/value element is off by at most scale / 2
# (0.4% of the head's largest |x|). This random model (weights N(0, 0.2), |logits| up to 5.6)
# amplifies that to 2.2% of the largest logit at worst and a KL of 7e-4 nats: the bounds
# leave about 2x margin.
LOGIT_RTOL = 0.05  # max |logit error| / max |logit|
MAX_KL = 2e-3  # nats, per position


@jax.jit
def _fwd(w, tokens, start, cache):
    h, cache = llama.forward(w, tokens, start, cache, cfg=CFG)
    return llama.unembed(w, h, CFG), cache


def test_quantize_kv_round_trip_within_half_a_step():
    x = jax.random.normal(jax.random.key(0), (3, 5, 2, 16)) * 3.0
    q, scale = kv.quantize_kv(x, axis=-1)
    assert q.dtype == jnp.int8 and scale.shape == (3, 5, 2)
    err = jnp.abs(kv.dequantize_kv(q, scale, axis=-1) - x)
    assert float(jnp.max(err / scale[..., None])) <= 0.5 + 1e-6
    assert int(jnp.max(jnp.abs(q))) == 127  # each (token, head) uses the whole range


def _decode_logits(w, tokens, cache, P=5):
    B, T = tokens.shape
    logits, cache = _fwd(w, tokens[:, :P], jnp.zeros(B, jnp.int32), cache)
    out = [logits]
    for t in range(P, T):
        logits, cache = _fwd(w, tokens[:, t : t + 1], jnp.full(B, t, jnp.int32), cache)
        out.append(logits)
    return np.concatenate([np.asarray(o) for o in out], axis=1), cache


def test_int8_dense_cache_logits_close_to_float():
    w = init_weights(llama.weight_specs(CFG), CFG, jax.random.key(1), scale=0.2)
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, CFG.vocab_size)
    ref, _ = _decode_logits(w, tokens, kv.init_cache(CFG, 2, 16))
    got, cache = _decode_logits(w, tokens, kv.init_cache(CFG, 2, 16, "int8"))
    assert isinstance(cache.k[0], kv.QuantKV) and cache.k[0].values.dtype == jnp.int8
    assert cache.k[0].scale.shape == (2, 2, 16) and cache.v[0].scale.shape == (2, 2, 16)
    assert np.abs(ref).max() > 1.0
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert 0 < err < LOGIT_RTOL, err  # quantized (not silently float), and close
    lp, lq = jax.nn.log_softmax(ref), jax.nn.log_softmax(got)
    assert float(jnp.max(jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1))) < MAX_KL
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.95


@pytest.mark.parametrize("native,keys_transposed,platform,lanes", [
    (False, True, None, 1), (True, True, None, 1), (False, False, None, 1), (False, False, "tpu", 1),
    (False, False, "tpu", 32)])
def test_int8_paged_cache_equals_int8_dense(native, keys_transposed, platform, lanes):
    """Same quantization per (token, head) in both layouts: decode rows over int8 pages (the
    engine's packed steps, XLA's readers or the native kernels) = decode over the dense int8 cache.
    The prefixes go in as decode rows, which read back their own quantized keys as the dense
    cache's prefill does (the prefill row attends to its own tokens unquantized). Keys pools
    of either layout: [P, K, ps, H] ones keep their scales over the last axis, as values do;
    and a TPU's writes of whole pages. lanes 32: the head dim (16) and each head's scale slots
    (4) padded, as a TPU pads them to 128 (``cache.init_paged_cache``)."""
    from jaxinfer import dispatch
    from tests.kernel_testing import packed_decode_logits

    if native:
        require_native("paged_attention")
    w = init_weights(llama.weight_specs(CFG), CFG, jax.random.key(3), scale=0.2)
    tokens = jax.random.randint(jax.random.key(4), (2, 13), 0, CFG.vocab_size)
    dense, _ = _decode_logits(w, tokens, kv.init_cache(CFG, 2, 16, "int8"))
    kernels = dispatch.Kernels(dispatch.Attention.NATIVE) if native else dispatch.Kernels(platform=platform)
    paged = packed_decode_logits(llama, CFG, w, np.asarray(tokens), [5, 5], 8, page_size=4, num_pages=12,
                                 kv_dtype="int8", kernels=kernels, prefill_row=False,
                                 keys_transposed=keys_transposed, lanes=lanes)
    np.testing.assert_allclose(paged, dense[:, 5:], rtol=1e-5, atol=1e-5)


def test_paged_int8_pools_of_both_keys_layouts():
    """int8 page pools: transposed keys [P, K, H, ps] scale over axis -2, [P, K, ps, H] keys over
    the last axis as values do; scales flat, [P, K * ps], either way (a page's row is its heads'
    slots in order: ``unflatten`` splits it into [K, ps] without moving anything)."""
    H = CFG.head_dim
    for transposed, shape, axis in ((True, (5, 2, H, 4), -2), (False, (5, 2, 4, H), -1)):
        pools = kv.init_paged_cache(CFG, 5, 4, "int8", keys_transposed=transposed)
        k = pools.k[0]
        assert (k.values.shape, k.axis, k.scale.shape, k.flat) == (shape, axis, (5, 8), True)
        assert pools.keys_transposed == transposed
        scale = jnp.arange(40, dtype=jnp.float32).reshape(5, 8)
        view = kv.QuantKV(k.values, scale, k.axis).unflatten(scale[jnp.array([[3, 1]])])
        np.testing.assert_array_equal(view, np.arange(40).reshape(5, 2, 4)[[[3, 1]]])


def test_padded_scale_rows_fill_a_chips_lanes():
    """A flat scale row [P, K * w] pads each head's ps slots to w so that one chip's part (its KV
    heads) is a multiple of ``lanes`` wide; unflatten drops the padding and flatten restores it."""
    for shards, width in ((1, 2 * 4), (2, 2 * 128)):  # 2 heads of 4-token pages; split: 1 a chip
        pools = kv.init_paged_cache(CFG, 5, 4, "int8", keys_transposed=False, lanes=128 if shards > 1 else 1,
                                    model_shards=shards)
        pool = pools.v[0]
        assert pool.scale.shape == (5, width) and pool.values.shape == (5, 2, 4, 128 if shards > 1 else 16)
        s = jnp.arange(5 * 2 * 4, dtype=jnp.float32).reshape(5, 2, 4)
        flat = pool.flatten(s)
        assert flat.shape == (5, width)
        np.testing.assert_array_equal(pool.unflatten(flat), s)


def test_kv_bytes_per_token_int8():
    per_head = 16 + 4  # int8 values + one float32 scale
    assert CFG.kv_bytes_per_token("int8") == 2 * 2 * 2 * per_head
    assert CFG.kv_bytes_per_token("float32") == 2 * 2 * 2 * 16 * 4


def assert_greedy_agrees_until_near_tie(got, want, near_tie: float) -> None:
    """int8 KV moves every logit a little, so greedy paths may part only at a step where the
    float run's top two candidates were within ``near_tie`` (after that, anything goes).
    ``want`` carries logprobs=2, so its top-2 logprob gap is the logit margin."""
    for g, w in zip(got, want):
        a, b = g.outputs[0].token_ids, w.outputs[0].token_ids
        assert len(a) == len(b)
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is not None:
            top = sorted((lp.logprob for lp in w.outputs[0].logprobs[k].values()), reverse=True)
            assert top[0] - top[1] < near_tie, (k, a, b, top)


# Measured on this tiny model: int8 KV moved logprobs by at most 0.075, and all 36 greedy
# tokens agreed; a part at a float margin of twice that would be a real int8 error.
TINY_NEAR_TIE = 0.15


def test_engine_end_to_end_and_memory_report(tiny_gguf):
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog", "1 2 3 4 5 6 7 8"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    kw = {"progress": False, "max_num_seqs": 4, "block_size": 4}
    f32 = LLM(str(tiny_gguf), **kw)
    want = f32.generate(prompts, sp, use_tqdm=False)
    llm = LLM(str(tiny_gguf), kv_cache_dtype="int8", **kw)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in got] == [12] * 3
    assert_greedy_agrees_until_near_tie(got, want, TINY_NEAR_TIE)
    r = llm.memory_report()
    assert r["kv_cache_dtype"] == "int8"
    assert r["kv_bytes_per_token"] == llm.cfg.kv_bytes_per_token("int8") < f32.memory_report()["kv_bytes_per_token"]
    assert all(isinstance(a, kv.QuantKV) for a in llm.engine.k_pages + llm.engine.v_pages)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages - 1


def test_invalid_kv_cache_dtype(tiny_gguf):
    with pytest.raises(InvalidRequest, match="kv_cache_dtype must be one of auto, .*int8, got 'int4'"):
        LLM(str(tiny_gguf), progress=False, kv_cache_dtype="int4")


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Once upon a time, in a small village,"]


# Measured on SmolLM2 over PROMPTS: int8 KV moved logprobs by at most 0.165 (the float
# run's smallest top-2 margin was 0.10), and all 64 greedy tokens agreed. Twice the
# perturbation is the margin below which a part is rounding, not an int8 bug.
SMOLLM2_NEAR_TIE = 0.35


@pytest.mark.slow
def test_smollm2_greedy_agrees_with_float_kv(smollm2_llm, smollm2_gguf):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    int8 = LLM(str(smollm2_gguf), max_model_len=1024, progress=False, kv_cache_dtype="int8")
    want = smollm2_llm.generate(PROMPTS, sp, use_tqdm=False)
    got = int8.generate(PROMPTS, sp, use_tqdm=False)
    assert_greedy_agrees_until_near_tie(got, want, SMOLLM2_NEAR_TIE)


def test_perplexity_through_the_cache(tiny_llm):
    """Scoring through a float32 cache equals scoring cache-free (an independent path:
    attention over the new tokens only); an int8 cache moves it a little, not a lot."""
    from jaxinfer.evaluate import perplexity

    text = "The quick brown fox jumps over the lazy dog. " * 12
    free = perplexity(tiny_llm, text, window=64, stride=32)
    f32 = perplexity(tiny_llm, text, window=64, stride=32, kv_cache_dtype="float32")
    i8 = perplexity(tiny_llm, text, window=64, stride=32, kv_cache_dtype="int8")
    assert f32.tokens == free.tokens == i8.tokens
    np.testing.assert_allclose(f32.nll, free.nll, rtol=1e-5)
    assert i8.nll != f32.nll and abs(i8.nll / f32.nll - 1) < 0.02
    with pytest.raises(InvalidRequest, match="kv_cache_dtype must be one of"):
        perplexity(tiny_llm, text, kv_cache_dtype="int3")
