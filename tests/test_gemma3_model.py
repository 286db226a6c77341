"""Gemma 3 model on tiny random configs.

Prefill and each decode step equal the full forward pass (which uses no cache), including
sequences several windows long; each layer's receptive field follows its configured kind
(LOCAL: the last W positions, GLOBAL: everything); configs from GGUF/HF metadata and the
published presets. The reference tests build tiny random Gemma3ForCausalLM models with
transformers (sliding window, soft-capping, linear rotary scaling on global layers, a query
scale that is not head_dim) and load them through our HF loader: logits must agree.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cache as kv
from jaxinfer.config import AttentionKind, ModelConfig, RopeConfig, RopeKind
from jaxinfer.models import gemma3
from jaxinfer.specs import init_weights
from jaxinfer.models.registry import num_params
from tests.conftest import require

L, G = AttentionKind.LOCAL, AttentionKind.GLOBAL
W = 4  # the tiny configs' sliding window



@functools.partial(jax.jit, static_argnames=("cfg", "read_cache"))
def _step(w, tokens, start, cache, *, cfg, read_cache=True):
    """Logits [B, T, V] and the updated cache (one executable per shape: compiles dominate)."""
    h, cache = gemma3.forward(w, tokens, start, cache, cfg=cfg, read_cache=read_cache)
    return gemma3.unembed(w, h, cfg), cache

BASE = ModelConfig(
    family="gemma3", vocab_size=97, d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
    d_ff=64, norm_eps=1e-6, rope=RopeConfig(theta=1e6), rope_local=RopeConfig(theta=1e4),
    layer_kinds=(L, G, L, G), sliding_window=W, query_pre_attn_scalar=12.0,
)

CONFIGS = {
    "local_global": BASE,
    "mqa_softcap_linear_rope_untied": dataclasses.replace(
        BASE, n_kv_heads=1, rope=RopeConfig(theta=1e6, kind=RopeKind.LINEAR, factor=8.0),
        attn_logit_softcap=2.0, final_logit_softcap=3.0, tie_embeddings=False),
}


def _setup(cfg, seed=0):
    """Random weights; norms too (their zero init would hide a swapped or unused norm)."""
    w = init_weights(gemma3.weight_specs(cfg), cfg, jax.random.key(seed), scale=0.2)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
    norms = lambda d: {k: 0.3 * jax.random.normal(next(keys), v.shape) if k.endswith("norm") else v
                       for k, v in d.items()}
    return {**norms(w), "layers": [norms(layer) for layer in w["layers"]]}


def _full_logits(w, tokens, cfg):
    return _step(w, tokens, jnp.zeros(tokens.shape[0], jnp.int32), None, cfg=cfg)[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_decode_match_full_forward(name):
    """Decoding runs to 14 positions, three and a half windows: local layers must stop
    seeing the keys that left their window while global layers keep them."""
    cfg = CONFIGS[name]
    w = _setup(cfg)
    B, T, P = 3, 14, 5
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)
    full = np.asarray(_full_logits(w, tokens, cfg))
    assert np.abs(full).max() > 0.5  # not comparing near-zero numbers

    cache = kv.init_cache(cfg, B, 16)
    logits, cache = _step(w, tokens[:, :P], jnp.zeros(B, jnp.int32), cache, cfg=cfg, read_cache=False)
    np.testing.assert_allclose(np.asarray(logits), full[:, :P], rtol=1e-5, atol=1e-5)
    for t in range(P, T):
        logits, cache = _step(w, tokens[:, t : t + 1], jnp.full(B, t, jnp.int32), cache, cfg=cfg)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_chunked_prefill_and_ragged_decode_past_the_window():
    cfg = BASE
    w = _setup(cfg)
    tokens = jax.random.randint(jax.random.key(3), (2, 14), 0, cfg.vocab_size)
    full = np.asarray(_full_logits(w, tokens, cfg))
    cache = kv.init_cache(cfg, 2, 16)
    for c in range(4):  # chunks of 3 against a window of 4: each straddles a boundary differently
        logits, cache = _step(w, tokens[:, 3 * c : 3 * c + 3], jnp.full(2, 3 * c, jnp.int32), cache, cfg=cfg)
        np.testing.assert_allclose(np.asarray(logits), full[:, 3 * c : 3 * c + 3], rtol=1e-5, atol=1e-5)
    # rows decode at their own positions: row 0 redoes position 10, row 1 goes on at 12
    start = jnp.asarray([10, 12], jnp.int32)
    logits, cache = _step(w, jnp.asarray([[tokens[0, 10]], [tokens[1, 12]]]), start, cache, cfg=cfg)
    np.testing.assert_allclose(np.asarray(logits)[:, 0], full[[0, 1], [10, 12]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 6])
def test_ring_cache_keeps_only_the_window_and_matches_full_forward(chunk):
    """LOCAL layers keep a ring of W + chunk - 1 slots (never-written slots NaN): chunks of
    1, 3 and 6 tokens (longer than the window of 4) through 20 positions equal the full pass."""
    cfg, B, T, S = BASE, 2, 20, 32
    w = _setup(cfg)
    tokens = jax.random.randint(jax.random.key(11), (B, T), 0, cfg.vocab_size)
    full = np.asarray(_full_logits(w, tokens, cfg))
    cache = kv.init_cache(cfg, B, S, max_chunk=chunk)
    R = W + chunk - 1
    assert [c.shape[2] for c in cache.v] == [R, S, R, S] and cache.ring_pos.shape == (B, R)
    assert cache.nbytes() < kv.init_cache(cfg, B, S).nbytes()
    cache = dataclasses.replace(cache, k=[jnp.full_like(a, jnp.nan) for a in cache.k],
                                v=[jnp.full_like(a, jnp.nan) for a in cache.v])
    for c in range(0, T, chunk):
        n = min(chunk, T - c)
        logits, cache = _step(w, tokens[:, c : c + n], jnp.full(B, c, jnp.int32), cache, cfg=cfg)
        np.testing.assert_allclose(np.asarray(logits), full[:, c : c + n], rtol=1e-5, atol=1e-5)


def test_ring_cache_after_a_right_padded_prefill():
    """The dense ring cache: a fresh right-padded prefill longer than the window
    (read_cache=False, every row's T positions kept in a ring of W + T - 1), then each row
    decodes at its own position, past its padding."""
    cfg, T = BASE, 10
    w = _setup(cfg, seed=3)
    lens = [10, 3]
    tokens = jax.random.randint(jax.random.key(12), (2, 22), 0, cfg.vocab_size)
    full = np.asarray(_full_logits(w, tokens, cfg))
    cache = kv.init_cache(cfg, 2, 32, max_chunk=T)
    prompt = jnp.where(jnp.arange(T)[None, :] < jnp.asarray(lens)[:, None], tokens[:, :T], 0)
    logits, cache = _step(w, prompt, jnp.zeros(2, jnp.int32), cache, cfg=cfg, read_cache=False)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(logits)[b, :n], full[b, :n], rtol=1e-5, atol=1e-5)
    for i in range(12):
        pos = jnp.asarray(lens, jnp.int32) + i
        logits, cache = _step(w, tokens[jnp.arange(2), pos][:, None], pos, cache, cfg=cfg)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[np.arange(2), np.asarray(pos)], rtol=1e-5, atol=1e-5)


def _changed_positions(cfg, w, s, T=16):
    """Positions whose logits change when the token at position s changes."""
    tokens = jax.random.randint(jax.random.key(4), (1, T), 0, cfg.vocab_size)
    other = tokens.at[0, s].set((tokens[0, s] + 1) % cfg.vocab_size)
    a, b = _full_logits(w, tokens, cfg)[0], _full_logits(w, other, cfg)[0]
    return set(np.nonzero(np.abs(np.asarray(a - b)).max(-1) > 1e-6)[0].tolist())


@pytest.mark.parametrize("kinds, reach", [
    ((L,), W - 1),  # one local layer: a token reaches the next W-1 positions
    ((L, L), 2 * (W - 1)),  # two: receptive fields add up
    ((L, G), None),  # a global layer: every later position
])
def test_receptive_field_follows_layer_kinds(kinds, reach):
    """The window is exact (key p-W+1 seen, p-W not) and applies to LOCAL layers only."""
    cfg = dataclasses.replace(BASE, n_layers=len(kinds), layer_kinds=kinds)
    w = _setup(cfg, seed=5)
    T, s = 16, 3
    want = set(range(s, T if reach is None else s + reach + 1))
    assert _changed_positions(cfg, w, s, T) == want


def test_flipping_one_layer_changes_outputs_only_past_the_window():
    """Each layer reads its own kind: making a single layer GLOBAL (or LOCAL) changes the
    logits, and only at positions that have keys outside the window (one rotary base for
    both kinds here, so that the window is the only difference)."""
    cfg = dataclasses.replace(BASE, rope_local=None)
    w = _setup(cfg, seed=6)
    tokens = jax.random.randint(jax.random.key(7), (2, 12), 0, cfg.vocab_size)
    base = np.asarray(_full_logits(w, tokens, cfg))
    for i in (0, 3):  # a LOCAL layer made GLOBAL, and a GLOBAL one made LOCAL
        kinds = list(cfg.layer_kinds)
        kinds[i] = G if kinds[i] == L else L
        flipped = np.asarray(_full_logits(w, tokens, dataclasses.replace(cfg, layer_kinds=tuple(kinds))))
        np.testing.assert_array_equal(flipped[:, :W], base[:, :W])  # the window covers everything
        assert np.abs(flipped[:, W:] - base[:, W:]).max() > 1e-3, i


def test_embedding_scale_rounds_like_hf_in_bfloat16():
    cfg = dataclasses.replace(BASE, d_model=640, n_heads=4, dtype="bfloat16")
    w = {"embed": jnp.ones((3, 640), jnp.bfloat16)}
    x = gemma3.embed(w, jnp.zeros((1, 1), jnp.int32), cfg)
    assert x.dtype == jnp.bfloat16 and float(x[0, 0, 0]) == 25.25  # sqrt(640) = 25.298 in bf16


# ----------------------------------------------------------------------------- configs
def test_published_presets():
    p = gemma3.PRESETS
    # exact parameter counts Google publishes for the text-only sizes
    assert num_params(p["gemma-3-270m"]) == 268_098_176
    assert num_params(p["gemma-3-1b"]) == 999_885_952
    for name, billions in [("gemma-3-4b", 3.88), ("gemma-3-12b", 11.77), ("gemma-3-27b", 27.01)]:
        assert round(num_params(p[name]) / 1e9, 2) == billions, name  # text towers
    for cfg in p.values():
        assert [i for i in range(cfg.n_layers) if cfg.layer_kind(i) == G] == list(range(5, cfg.n_layers, 6))
        assert cfg.rope.theta == 1e6 and cfg.rope_local.theta == 1e4
    assert p["gemma-3-27b"].attn_scale == pytest.approx(168**-0.5)
    assert p["gemma-3-4b"].attn_scale == 256**-0.5
    assert p["gemma-3-4b"].layer_rope(5).factor == 8.0 and p["gemma-3-4b"].layer_rope(0).factor == 1.0
    assert p["gemma-3-1b"].rope.kind == RopeKind.DEFAULT


def test_kv_bytes_expected_with_windowed_local_layers():
    """270M: 3 of 18 layers global, window 512. At 32k tokens a windowed cache needs
    (3 * 32768 + 15 * 512) / (18 * 32768) = 0.1797 of the dense one (5.6x less); each token
    past the window adds 3 layers' worth instead of 18 (6x less)."""
    cfg = gemma3.PRESETS["gemma-3-270m"]
    per_layer_token = 2 * 1 * 256 * 4
    assert cfg.kv_bytes_per_token() == 18 * per_layer_token
    assert cfg.kv_bytes(32768, windowed=False) == 18 * 32768 * per_layer_token
    assert cfg.kv_bytes(32768) == (3 * 32768 + 15 * 512) * per_layer_token
    assert cfg.kv_bytes(400) == cfg.kv_bytes(400, windowed=False)  # inside the window: no saving
    assert (cfg.kv_bytes(4096) - cfg.kv_bytes(4095)) * 6 == cfg.kv_bytes_per_token()


def test_config_rejects_inconsistent_patterns():
    with pytest.raises(ValueError, match="layer_kinds"):
        dataclasses.replace(BASE, layer_kinds=(L, G))
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(BASE, sliding_window=None)


HF_270M_V4 = {  # google/gemma-3-270m config.json as transformers 4 wrote it
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
    "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "rope_scaling": None, "query_pre_attn_scalar": 256,
    "sliding_window": 512, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
}


def _same_model(a: ModelConfig, b: ModelConfig):
    assert dataclasses.replace(a, name="", dtype="float32") == dataclasses.replace(b, name="", dtype="float32")


def test_config_from_hf_both_transformers_generations():
    _same_model(gemma3.config_from_hf(HF_270M_V4, dtype="float32"), gemma3.PRESETS["gemma-3-270m"])
    # transformers 5 writes rope_parameters per layer type; 4B-style scaling on global layers
    v5 = {k: v for k, v in HF_270M_V4.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    v5["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    cfg = gemma3.config_from_hf(v5, dtype="float32")
    assert cfg.rope == RopeConfig(theta=1e6, kind=RopeKind.LINEAR, factor=8.0)
    assert cfg.rope_local == RopeConfig(theta=1e4)
    # no layer_types: the sliding_window_pattern rule (transformers 4 configs of 1B and up)
    old = {k: v for k, v in HF_270M_V4.items() if k != "layer_types"}
    assert gemma3.config_from_hf(old, dtype="float32").layer_kinds == gemma3.layer_kinds(18)


def test_gguf_norms_are_stored_plus_one():
    a = np.asarray([7.4375, 1.0, 0.0, -2.8125], np.float32)
    np.testing.assert_array_equal(gemma3.gguf_tensor("blk.0.attn_q_norm.weight", a), a - 1)
    np.testing.assert_array_equal(gemma3.gguf_tensor("output_norm.weight", a), a - 1)
    np.testing.assert_array_equal(gemma3.gguf_tensor("blk.0.attn_q.weight", a), a)


# ----------------------------------------------------------------------------- transformers
# transformers' Gemma 3 ignores attn_logit_softcapping (Gemma 2 applied it): so do we. The
# linear scaling applies to global layers only; local ones keep the plain 10k base.
HF_CASES = {
    "softcap_linear_rope": {
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
}


def _hf_tiny(tmp_path, extra, seed=0):
    torch = require("torch")
    transformers = require("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=W,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=1, **extra)
    config.architectures = ["Gemma3ForCausalLM"]
    config._attn_implementation = "eager"  # sdpa would silently skip the score soft-cap
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to zero (scale 1): randomise everything
        for name, p in model.named_parameters():
            p.copy_((0.3 if "norm" in name else 0.15) * torch.randn_like(p))
    model.eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t2", "eos_token": "t1"}))
    return torch, model


@pytest.mark.reference
@pytest.mark.parametrize("name", list(HF_CASES))
def test_logits_match_transformers_past_the_window(name, tmp_path):
    from jaxinfer.loaders import checkpoint

    torch, model = _hf_tiny(tmp_path, HF_CASES[name])
    loaded = checkpoint.load(tmp_path, dtype="float32")
    cfg, w = loaded.cfg, loaded.weights
    assert cfg.family == "gemma3" and cfg.layer_kinds == (L, G, L, G) and cfg.sliding_window == W
    assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap == HF_CASES[name].get("final_logit_softcapping")
    tokens = np.asarray(jax.random.randint(jax.random.key(9), (2, 20), 0, 64), np.int32)
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()
    assert np.abs(ref).max() > 1.0
    got = np.asarray(_full_logits(w, jnp.asarray(tokens), cfg))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5)
    # and through the cache, token by token after a 6-token prefill
    cache = kv.init_cache(cfg, 2, 32)
    _, cache = _step(w, jnp.asarray(tokens[:, :6]), jnp.zeros(2, jnp.int32), cache, cfg=cfg, read_cache=False)
    for t in range(6, 20):
        logits, cache = _step(w, jnp.asarray(tokens[:, t : t + 1]), jnp.full(2, t, jnp.int32), cache, cfg=cfg)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], ref[:, t], rtol=1e-5, atol=2e-5)


# ----------------------------------------------------------------------------- GGUF -> LLM
TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
)


def write_tiny_gemma3(path, source_gguf, *, layers=6, d=32, heads=2, kv_heads=1, head_dim=16, ff=64,
                      window=8, context=128, seed=0, chat_template=None) -> dict:
    """A random gemma3 GGUF with the real Gemma tokenizer, written the way llama.cpp's
    converter writes one (norms stored as 1 + w). Returns the stored tensors."""
    import gguf

    from jaxinfer.loaders.gguf import read_metadata

    meta = read_metadata(source_gguf)
    vocab = len(meta["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in [("block_count", layers), ("context_length", context), ("embedding_length", d),
                       ("feed_forward_length", ff), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("attention.key_length", head_dim),
                       ("attention.value_length", head_dim), ("attention.sliding_window", window)]:
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.rope.freq_base", 1e6)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    for k in TOKENIZER_KEYS:
        v = meta[k]
        if isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)
    if chat_template is not None:
        w.add_string("tokenizer.chat_template", chat_template)
    q, kv_ = heads * head_dim, kv_heads * head_dim
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.attn_q.weight": (q, d), f"blk.{i}.attn_k.weight": (kv_, d),
            f"blk.{i}.attn_v.weight": (kv_, d), f"blk.{i}.attn_q_norm.weight": (head_dim,),
            f"blk.{i}.attn_k_norm.weight": (head_dim,), f"blk.{i}.attn_output.weight": (d, q),
            f"blk.{i}.post_attention_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d),
            f"blk.{i}.ffn_down.weight": (d, ff), f"blk.{i}.post_ffw_norm.weight": (d,),
        }
    stored = {}
    for name, shape in shapes.items():
        a = rng.standard_normal(shape).astype(np.float32)
        a = (1.0 + 0.3 * a) if len(shape) == 1 else 0.3 * a  # llama.cpp stores 1 + w
        stored[name] = a.astype(np.float32)
        w.add_tensor(name, stored[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, gemma3_gguf):
    path = tmp_path_factory.mktemp("tiny-gemma3") / "tiny-gemma3.gguf"
    return path, write_tiny_gemma3(path, gemma3_gguf)


def test_gguf_loads_with_norms_shifted_back(tiny_gemma3):
    from jaxinfer.loaders import checkpoint

    path, stored = tiny_gemma3
    loaded = checkpoint.load(path, dtype="float32")
    cfg, w = loaded.cfg, loaded.weights
    assert cfg.family == "gemma3" and cfg.sliding_window == 8 and cfg.tie_embeddings
    assert [cfg.layer_kind(i) for i in range(6)] == [L] * 5 + [G]
    assert (cfg.rope.theta, cfg.rope_local.theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 16.0)
    np.testing.assert_array_equal(np.asarray(w["layers"][2]["k_norm"]), stored["blk.2.attn_k_norm.weight"] - 1)
    np.testing.assert_array_equal(np.asarray(w["final_norm"]), stored["output_norm.weight"] - 1)
    np.testing.assert_array_equal(np.asarray(w["layers"][1]["wq"]).reshape(32, -1), stored["blk.1.attn_q.weight"].T)


@pytest.mark.parametrize("quantize", [None, "int8", "w8a8"])
def test_llm_generate_past_the_window_equals_the_model(tiny_gemma3, quantize):
    """LLM(path).generate, greedy, 30 tokens after prompts of 2 and 17 tokens (window 8),
    against a plain greedy loop over gemma3.forward with a dense cache (on the same, possibly
    quantized, weights)."""
    from jaxinfer import LLM, SamplingParams

    path, _ = tiny_gemma3
    llm = LLM(str(path), max_model_len=64, progress=False, quantization=quantize)
    prompts = ["Hi", "The history of the printing press is closely tied to the spread of literacy in"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    cfg, w = llm.cfg, llm.weights
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids and ids[0] == 2
        cache = kv.init_cache(cfg, 1, 64)
        logits, cache = _step(w, jnp.asarray([ids]), jnp.zeros(1, jnp.int32), cache, cfg=cfg, read_cache=False)
        want = []
        for t in range(30):
            want.append(int(jnp.argmax(logits[0, -1])))
            logits, cache = _step(w, jnp.asarray([[want[-1]]]), jnp.full(1, len(ids) + t, jnp.int32), cache, cfg=cfg)
        assert list(out.outputs[0].token_ids) == want, prompt
        assert out.outputs[0].text == llm.tokenizer.decode(want)


# ----------------------------------------------------------------------------- windowed paged KV
def _greedy_reference(llm, ids, steps):
    """Greedy tokens and their log-probs from a plain loop over gemma3.forward (dense cache
    keeping every position)."""
    cfg, w = llm.cfg, llm.weights
    cache = kv.init_cache(cfg, 1, 96)  # one decode executable for every prompt
    logits, cache = _step(w, jnp.asarray([ids]), jnp.zeros(1, jnp.int32), cache, cfg=cfg, read_cache=False)
    toks, lps = [], []
    for t in range(steps):
        lp = jax.nn.log_softmax(logits[0, -1])
        toks.append(int(jnp.argmax(lp)))
        lps.append(float(lp[toks[-1]]))
        logits, cache = _step(w, jnp.asarray([[toks[-1]]]), jnp.full(1, len(ids) + t, jnp.int32), cache, cfg=cfg)
    return toks, lps


def _poison_released_pages(engine):
    """Fill every page with NaN the moment the allocator takes it back: a later read of a
    page that left the window poisons the logits."""
    for alloc, windowed in ((engine.allocator, False), (engine.window_allocator, True)):
        release = alloc.release

        def poisoned(pages, release=release, windowed=windowed):
            release(pages)
            idx = jnp.asarray([p for p in pages if p], jnp.int32)
            if idx.size:
                nan = lambda pool: [a.at[idx].set(jnp.nan) if w == windowed else a
                                    for a, w in zip(pool, engine.windowed, strict=True)]
                engine.state = dataclasses.replace(engine.state, k_pages=nan(engine.k_pages),
                                                   v_pages=nan(engine.v_pages))

        alloc.release = poisoned


def _all_pages_free(engine):
    for alloc in (engine.allocator, engine.window_allocator):
        alloc.check_invariants()
        assert alloc.num_free == alloc.num_pages - 1


WORDS = ["the", "history", "of", "the", "printing", "press", "is", "closely", "tied", "to", "the", "spread", "of", "literacy", "in", "Europe"]


def test_paged_window_pages_equal_dense_reference_with_poisoned_freed_pages(tiny_gemma3):
    """Window 8, pages of 4, chunks of 16 (longer than the window): LOCAL layers hold only
    their window, pages freed as they leave it are NaN-poisoned at once, and the greedy
    tokens and their log-probs equal a dense cache keeping everything."""
    from jaxinfer import LLM, SamplingParams

    path, _ = tiny_gemma3
    llm = LLM(str(path), max_model_len=96, progress=False, block_size=4, max_num_batched_tokens=16, max_num_seqs=3,
              enable_prefix_caching=False)
    eng = llm.engine
    assert eng.window == 8 and sum(eng.windowed) == 5
    assert all(a.shape[0] == eng.window_allocator.num_pages for a, w in zip(eng.k_pages, eng.windowed) if w)
    _poison_released_pages(eng)
    prompts = ["Hi", " ".join(WORDS * 3), " ".join(WORDS[:7])]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert len(outs[1].prompt_token_ids) > 40  # several chunks, many windows
    for out in outs:
        want, want_lp = _greedy_reference(llm, out.prompt_token_ids, 24)
        got = out.outputs[0]
        assert list(got.token_ids) == want
        got_lp = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(got_lp, want_lp, rtol=1e-4, atol=1e-4)
    # a sequence of up to 65 positions held at most (8 + 16 - 1) // 4 + 2 window pages
    assert 0 < eng.stats["peak_window_pages"] <= 3 * 4 + (8 + 16 - 1) // 4 + 2
    assert eng.stats["peak_window_pages"] < eng.stats["peak_pages"]
    _all_pages_free(eng)


@pytest.mark.slow
def test_prefix_cache_with_window_pages_on_and_off_agree(tiny_gemma3):
    from jaxinfer import LLM, SamplingParams

    path, _ = tiny_gemma3
    system = " ".join(WORDS * 2) + " "
    prompts = [system + q for q in ("What is two?", "Name a color.", "Say hi.", "Count to three.")]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = {"max_model_len": 96, "progress": False, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 2}
    on = LLM(str(path), **kw)
    got = [o.outputs[0].token_ids for o in on.generate(prompts, sp, use_tqdm=False)]
    got2 = [o.outputs[0].token_ids for o in on.generate(prompts, sp, use_tqdm=False)]
    off = LLM(str(path), enable_prefix_caching=False, **kw)
    _poison_released_pages(off.engine)
    want = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    assert got == got2 == want
    assert on.engine.stats["cached_prompt_tokens"] >= 4 * 8 * 4  # whole system prompt reused
    assert off.engine.stats["cached_prompt_tokens"] == 0
    _all_pages_free(on.engine)
    _all_pages_free(off.engine)


def test_window_prefix_reused_only_while_its_window_pages_are_cached(tiny_gemma3):
    """Evict the window pages of a cached prefix: the full-length pages alone are not
    enough to resume, so the prefix is recomputed (and the tokens stay the same)."""
    from jaxinfer import LLM, SamplingParams

    path, _ = tiny_gemma3
    prompt = " ".join(WORDS * 2)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(path), max_model_len=96, progress=False, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    first = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    wa = llm.engine.window_allocator
    wa.release(wa.allocate(wa.num_free))  # takes every free page, evicting every cached window page
    before = llm.engine.stats["cached_prompt_tokens"]
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == first
    assert llm.engine.stats["cached_prompt_tokens"] == before  # nothing reused
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == first
    assert llm.engine.stats["cached_prompt_tokens"] > before  # cached again, reused
    _all_pages_free(llm.engine)


@pytest.mark.slow
def test_windowed_kv_memory_on_270m_shapes(tmp_path, gemma3_gguf):
    """Gemma 3 270M's KV shapes (18 layers, 5 LOCAL : 1 GLOBAL, one kv head of 256, window
    512; a tiny model width): one sequence decoding past 4096 positions. The pages the
    engine actually holds while decoding: the full-length pool grows 3 layers' worth per
    token, the window pool stays at W // ps + 2 pages, so each token past the window costs
    1/6 of an all-global cache and the whole sequence (3 * 4096 + 15 * 512) / (18 * 4096)."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.config import AttentionKind

    path = tmp_path / "gemma3-270m-shapes.gguf"
    write_tiny_gemma3(path, gemma3_gguf, layers=18, d=32, heads=4, kv_heads=1, head_dim=256, ff=32,
                      window=512, context=4160)
    ps = 16
    llm = LLM(str(path), max_model_len=4160, progress=False, block_size=ps, max_num_batched_tokens=2048,
              max_num_seqs=1, num_gpu_blocks_override=270, enable_prefix_caching=False)
    eng, cfg = llm.engine, llm.cfg
    used = []
    dispatch = eng._dispatch_decode

    def recording():
        out = dispatch()
        if out is not None:
            used.append((eng.allocator.num_used, eng.window_allocator.num_used))
        return out

    eng._dispatch_decode = recording
    n_prompt, n_new = 4064, 40
    ids = [2] + list(np.random.default_rng(0).integers(3, 1000, n_prompt - 1))
    llm.generate([[int(t) for t in ids]], SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True),
                 use_tqdm=False)
    g, loc = cfg.kv_bytes_per_token(kind=AttentionKind.GLOBAL), cfg.kv_bytes_per_token(kind=AttentionKind.LOCAL)
    assert (g, loc) == (3 * 2 * 256 * 4, 15 * 2 * 256 * 4) and g + loc == cfg.kv_bytes_per_token()
    full_pages, window_pages = used[-1]
    n = n_prompt + n_new - 1  # positions written by the end
    assert full_pages == -(-n // ps)
    # the window's 512 positions span 32 or 33 pages (+1 when a step's page opens before
    # the host frees the oldest): bounded while the full-length pages grow
    assert {w for _, w in used} <= {512 // ps, 512 // ps + 1, 512 // ps + 2}
    assert used[-1][0] - used[0][0] == -(-n // ps) - -(-n_prompt // ps)
    windowed = full_pages * ps * g + window_pages * ps * loc
    all_global = full_pages * ps * cfg.kv_bytes_per_token()
    # config.kv_bytes (every layer keeps what it can still see) plus page rounding
    assert cfg.kv_bytes(n) <= windowed <= cfg.kv_bytes(n) + ps * g + 2 * ps * loc
    assert all_global / windowed > 3.6  # (18 * 4096) / (3 * 4096 + 15 * 528)
    # past the window, each token adds the global layers only: 6x less than all-global
    assert cfg.kv_bytes_per_token() / g == 6
    report = llm.memory_report(4096)
    assert report["kv_bytes_per_token_global"] == g and report["kv_bytes_per_token_local"] == loc
    assert report["kv_bytes_seq_dense"] / report["kv_bytes_seq"] == pytest.approx(73728 / 19968)
    _all_pages_free(eng)


GEMMA_TEMPLATE = (  # Gemma 3's chat template (string contents)
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def test_chat_uses_the_gguf_chat_template(tmp_path, gemma3_gguf):
    """A Gemma GGUF carrying Gemma 3's template: llm.chat renders turns with the control
    tokens (one BOS, <start_of_turn>=105, <end_of_turn>=106) and the model turn is open."""
    from jaxinfer import LLM, SamplingParams

    path = tmp_path / "chat.gguf"
    write_tiny_gemma3(path, gemma3_gguf, chat_template=GEMMA_TEMPLATE)
    llm = LLM(str(path), max_model_len=64, progress=False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text, ids = llm.encode_chat(msgs)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids.count(105) == 2 and ids.count(106) == 1
    assert ids[-3:-1] == [105, llm.tokenizer.encode("model", add_special_tokens=False)[0]]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) == 3


def test_real_gemma3_gguf_has_no_chat_template(gemma3_llm):
    """The registry's gemma-3-270m GGUF ships without tokenizer.chat_template: chat says so
    instead of guessing a format."""
    from jaxinfer.errors import InvalidRequest

    assert gemma3_llm.tokenizer.chat_template is None
    with pytest.raises(InvalidRequest, match="no chat template"):
        gemma3_llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)


@pytest.mark.slow
def test_int8_window_pages_agree_with_float(tiny_gemma3):
    """int8 KV in both pools (full-length and window): greedy tokens past the window agree
    with float KV, and the pools hold int8 values with float32 scales."""
    from jaxinfer import LLM, SamplingParams

    path, _ = tiny_gemma3
    kw = {"max_model_len": 96, "progress": False, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 3}
    prompts = [" ".join(WORDS * 2), " ".join(WORDS[:5])]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(path), kv_cache_dtype="int8", **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert all(isinstance(a, kv.QuantKV) for a in llm.engine.k_pages + llm.engine.v_pages)
    assert sum(w for w in llm.engine.windowed) == 5
    assert np.mean([a == b for x, y in zip(got, want) for a, b in zip(x, y)]) > 0.8
    _all_pages_free(llm.engine)


def test_cli_generate_and_batch_on_gemma3(tmp_path, gemma3_gguf, capsys):
    """`jaxinfer generate --chat/--prompt --json` and `jaxinfer batch` (a chat and a completions
    request, OpenAI batch format) on a tiny Gemma 3 GGUF with Gemma's chat template: the
    CLI's greedy tokens equal LLM.chat / LLM.generate on the same file."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.cli import main

    path = tmp_path / "chat.gguf"
    write_tiny_gemma3(path, gemma3_gguf, chat_template=GEMMA_TEMPLATE)
    llm = LLM(str(path), max_model_len=64, progress=False)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    msgs = [{"role": "user", "content": "Hi there"}]
    want_chat = llm.chat(msgs, sp, use_tqdm=False)[0]
    want_text = llm.generate("The printing press", sp, use_tqdm=False)[0]

    common = ["--model", str(path), "--max-model-len", "64"]
    assert main(["generate", *common, "--chat", "Hi there", "--max-tokens", "5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["prompt_token_ids"] == want_chat.prompt_token_ids
    # generate stops at EOS; the tiny random model may emit it: compare the common prefix
    assert got["token_ids"] == want_chat.outputs[0].token_ids[: len(got["token_ids"])]

    reqs = tmp_path / "requests.jsonl"
    reqs.write_text("\n".join(json.dumps(r) for r in [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True}},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The printing press", "max_tokens": 5, "temperature": 0, "ignore_eos": True}},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(reqs), "-o", str(out), *common, "--no-progress", "--max-num-seqs", "2"]) == 0
    lines = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert set(lines) == {"chat", "text"} and all(x["error"] is None for x in lines.values())
    chat, text = lines["chat"]["response"], lines["text"]["response"]
    assert chat["status_code"] == text["status_code"] == 200
    assert chat["body"]["usage"]["prompt_tokens"] == len(want_chat.prompt_token_ids)
    assert chat["body"]["choices"][0]["message"]["content"] == want_chat.outputs[0].text
    assert text["body"]["choices"][0]["text"] == want_text.outputs[0].text


def test_chat_takes_content_parts_and_refuses_images(tmp_path, gemma3_gguf):
    """vLLM's content parts: text parts joined with newlines render as the same prompt as the
    joined string; on a checkpoint without an image encoder (a GGUF text model), an image part,
    or a prompt's multi_modal_data, gets one clear refusal."""
    from PIL import Image

    from jaxinfer import LLM
    from jaxinfer.errors import InvalidRequest

    path = tmp_path / "chat.gguf"
    write_tiny_gemma3(path, gemma3_gguf, chat_template=GEMMA_TEMPLATE)
    llm = LLM(str(path), max_model_len=64, progress=False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert llm.encode_chat(parts) == llm.encode_chat([{"role": "user", "content": "Hi\nthere"}])
    image = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(InvalidRequest, match="conversation 0: this model takes no images"):
        llm.chat(image, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="prompt 0: this model takes no images"):
        llm.generate({"prompt": "Hi", "multi_modal_data": {"image": Image.new("RGB", (4, 4))}}, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="content parts must be"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": 5}]}], use_tqdm=False)
