"""Phi-3 equals transformers float32 on a tiny random Phi3ForCausalLM with LongRoPE where the
long factors apply (context 128 over an original 16: every forward pass of the 48-token prompts
is past the original context, so transformers picks the long factors too) and the attention
factor is sqrt(1 + ln 8 / ln 16) = 1.32, with partial rotary (half of each head, as Phi-4-mini
rotates 3/4). Through the paged engine (prefix cache, n-gram speculation, int8 KV, tensor
parallelism 2), with a sliding window on every layer (Phi-3-mini-4k), from a GGUF written as
llama.cpp's converter writes one (fused attn_qkv and ffn_up, LongRoPE factor tensors), and with
int8 weights. The fused qkv_proj / gate_up_proj are split into our separate weights at load.
Configs from the published config.json files and from GGUF metadata.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

from jaxinfer.config import AttentionKind
from jaxinfer.errors import CheckpointError
from jaxinfer.models import phi3
from tests import family_testing as ft

pytestmark = pytest.mark.reference

SHORT = [1.0, 1.25, 1.5, 2.0]
LONG = [1.0, 2.0, 4.0, 8.0]
LONGROPE = {"original_max_position_embeddings": 16, "partial_rotary_factor": 0.5,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "short_factor": SHORT, "long_factor": LONG}}
ATTENTION_FACTOR = math.sqrt(1 + math.log(128 / 16) / math.log(16))


def test_family_equals_transformers(tmp_path):
    from jaxinfer.loaders import checkpoint

    path = ft.write_tiny(tmp_path / "phi3", "phi3", LONGROPE)
    cfg = checkpoint.load(path, dtype="float32").cfg
    assert cfg.family == "phi3" and cfg.rope.rotary_dim == 8 and cfg.rope.freq_factors == tuple(LONG)
    assert cfg.rope.attention_factor == pytest.approx(ATTENTION_FACTOR) and ATTENTION_FACTOR > 1.3
    ft.check_family(path)


def test_sliding_window_on_every_layer_equals_transformers(tmp_path):
    """Phi-3-mini-4k's window (2047 of 4096) applies to every layer: here 8 of 128."""
    from jaxinfer import LLM

    path = ft.write_tiny(tmp_path / "phi3", "phi3", {"sliding_window": 8})
    llm = LLM(str(path), max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    assert llm.cfg.layer_kinds == (AttentionKind.LOCAL,) * 3 and llm.cfg.sliding_window == 8
    ft.assert_matches(ft.generate(llm), ft.reference(path), what="window")


def _gguf_keys(w, hf):
    """Phi3MiniModel.set_gguf_parameters and generate_extra_tensors in llama.cpp's
    convert_hf_to_gguf.py (the factor tensors go in as ``extra``)."""
    rp = hf["rope_parameters"]
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    context, original = hf["max_position_embeddings"], rp["original_max_position_embeddings"]
    w.add_context_length(context)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_sliding_window(hf.get("sliding_window") or 0)
    scale = context / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)


def test_gguf_equals_transformers(tmp_path):
    from jaxinfer import LLM
    from jaxinfer.loaders import checkpoint
    from tests.hf_to_gguf import hf_to_gguf

    hf_dir = ft.write_tiny(tmp_path / "hf", "phi3", LONGROPE)
    path = hf_to_gguf(hf_dir, tmp_path / "phi3.gguf", "phi3", _gguf_keys,
                      extra={"rope_factors_long.weight": LONG, "rope_factors_short.weight": SHORT})
    a, b = checkpoint.load(hf_dir, dtype="float32"), checkpoint.load(path, dtype="float32")
    same = lambda c: dataclasses.replace(c, name="", norm_eps=round(c.norm_eps, 12),  # noqa: E731 (stored as f32)
                                         rope=dataclasses.replace(c.rope, attention_factor=round(c.rope.attention_factor, 6)))
    assert same(b.cfg) == same(a.cfg)
    for name in ("wq", "wk", "wv", "w_gate", "w_up"):  # split from attn_qkv and ffn_up
        np.testing.assert_array_equal(np.asarray(b.weights["layers"][2][name]), np.asarray(a.weights["layers"][2][name]))
    llm = LLM(str(path), max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    ft.assert_matches(ft.generate(llm), ft.reference(hf_dir), what="gguf")


def test_fused_tensors_split_into_our_weights(tmp_path):
    """wq/wk/wv are the row blocks N*H, K*H, K*H of qkv_proj, w_gate/w_up the halves of
    gate_up_proj (transposed to our [in, out]); a fused tensor that does not split is refused."""
    from safetensors.numpy import load_file

    from jaxinfer.loaders import checkpoint

    path = ft.write_tiny(tmp_path / "phi3", "phi3")
    w = checkpoint.load(path, dtype="float32").weights["layers"][1]
    t = load_file(str(path / "model.safetensors"))
    qkv, gate_up = t["model.layers.1.self_attn.qkv_proj.weight"], t["model.layers.1.mlp.gate_up_proj.weight"]
    np.testing.assert_array_equal(np.asarray(w["wq"]).reshape(64, 64), qkv[:64].T)
    np.testing.assert_array_equal(np.asarray(w["wk"]).reshape(64, 32), qkv[64:96].T)
    np.testing.assert_array_equal(np.asarray(w["wv"]).reshape(64, 32), qkv[96:].T)
    np.testing.assert_array_equal(np.asarray(w["w_gate"]), gate_up[:128].T)
    np.testing.assert_array_equal(np.asarray(w["w_up"]), gate_up[128:].T)
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(hf | {"num_key_value_heads": 1}))
    with pytest.raises(CheckpointError, match="qkv_proj.weight.*does not split"):
        checkpoint.load(path, dtype="float32")


# int8 weights (one scale per output channel) move a tiny random model's log-probs by up to
# ~0.07: a bound for quantization, not for a bug (a misplaced weight moves them by whole units)
INT8_WEIGHTS_PLP_ATOL, INT8_WEIGHTS_NEAR_TIE = 0.15, 0.3


def test_int8_weights_load_and_stay_close(tmp_path):
    """quantization="int8": every matmul weight, each split from its fused tensor, quantized at
    load; log-probs stay near transformers' float ones."""
    from jaxinfer import LLM
    from jaxinfer.quant import QuantArray

    path = ft.write_tiny(tmp_path / "phi3", "phi3", LONGROPE)
    llm = LLM(str(path), quantization="int8", max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    assert all(isinstance(llm.weights["layers"][0][k], QuantArray) for k in ("wq", "wk", "wv", "w_gate", "w_up"))
    ft.assert_matches(ft.generate(llm), ft.reference(path), plp_atol=INT8_WEIGHTS_PLP_ATOL,
                      near_tie=INT8_WEIGHTS_NEAR_TIE, what="int8 weights")


def _factors(n, base):
    return [round(base + 0.01 * i, 4) for i in range(n)]


# The published config.json files (transformers 4), factor lists shortened to synthetic values of
# the right length (48 = head_dim 96 / 2; Phi-4-mini: 48 = 128 * 0.75 / 2).
HF_MINI_128K = {
    "architectures": ["Phi3ForCausalLM"], "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": _factors(48, 1.0), "short_factor": _factors(48, 1.05), "type": "longrope"},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False, "vocab_size": 32064,
}
HF_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
    "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "vocab_size": 32064,
}
HF_PHI4_MINI = {
    "architectures": ["Phi3ForCausalLM"], "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "model_type": "phi3", "num_attention_heads": 24, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True,
    "rope_scaling": {"long_factor": _factors(48, 1.0), "short_factor": _factors(48, 1.05), "type": "longrope"},
    "vocab_size": 200064,
}


def test_config_from_published_hf():
    long = phi3.config_from_hf(HF_MINI_128K, dtype="float32")
    assert long.rope.freq_factors == tuple(_factors(48, 1.0)) and long.rope.rotary_dim is None
    assert long.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert long.layer_kinds == () and long.sliding_window is None  # 262144 > the context: no window
    assert (long.head_dim, long.max_position, long.tie_embeddings) == (96, 131072, False)
    short = phi3.config_from_hf(HF_MINI_4K, dtype="float32")
    assert short.rope.freq_factors is None and short.rope.attention_factor == 1.0
    assert short.layer_kinds == (AttentionKind.LOCAL,) * 32 and short.sliding_window == 2047
    mini4 = phi3.config_from_hf(HF_PHI4_MINI, dtype="float32")
    assert (mini4.rope.rotary_dim, mini4.head_dim, mini4.n_kv_heads, mini4.tie_embeddings) == (96, 128, 8, True)
    # the short factors where the configured context is the original one; Phi-3's "su" is LongRoPE
    at_original = phi3.config_from_hf(HF_MINI_128K | {"max_position_embeddings": 4096}, dtype="float32")
    assert at_original.rope.freq_factors == tuple(_factors(48, 1.05)) and at_original.rope.attention_factor == 1.0
    su = HF_MINI_128K | {"rope_scaling": HF_MINI_128K["rope_scaling"] | {"type": "su"}}
    assert phi3.config_from_hf(su, dtype="float32") == long
    # transformers 5 keeps the same in rope_parameters, and explicit factor / attention_factor win
    v5 = {k: v for k, v in HF_MINI_128K.items() if k not in ("rope_scaling", "rope_theta")} | {
        "rope_parameters": {**HF_MINI_128K["rope_scaling"], "rope_type": "longrope", "rope_theta": 10000.0,
                            "attention_factor": 1.5}}
    assert phi3.config_from_hf(v5, dtype="float32").rope.attention_factor == 1.5
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        phi3.config_from_hf(HF_MINI_4K | {"rope_scaling": {"type": "yarn", "factor": 4.0}}, dtype="float32")
    with pytest.raises(CheckpointError, match="long_factor has 47 factors"):
        bad = HF_MINI_128K | {"rope_scaling": HF_MINI_128K["rope_scaling"] | {"long_factor": _factors(47, 1.0)}}
        phi3.config_from_hf(bad, dtype="float32")


def test_config_from_gguf_metadata():
    long, short = np.asarray(_factors(48, 1.0), np.float32), np.asarray(_factors(48, 1.05), np.float32)
    tensors = {"rope_factors_long.weight": long, "rope_factors_short.weight": short}

    def meta(context, **extra):
        return {"general.architecture": "phi3", "tokenizer.ggml.tokens": ["a"] * 200064, "phi3.block_count": 32,
                "phi3.embedding_length": 3072, "phi3.attention.head_count": 24, "phi3.attention.head_count_kv": 8,
                "phi3.feed_forward_length": 8192, "phi3.context_length": context,
                "phi3.rope.scaling.original_context_length": 4096, "phi3.rope.dimension_count": 96,
                "phi3.attention.sliding_window": 262144, "phi3.rope.scaling.attn_factor": 1.19} | extra

    cfg = phi3.config_from_gguf(meta(131072), ["token_embd.weight", *tensors], dtype="float32",
                                load_tensor=tensors.__getitem__)
    assert cfg.rope.freq_factors == tuple(float(x) for x in long) and cfg.rope.rotary_dim == 96
    assert cfg.rope.attention_factor == 1.19 and cfg.tie_embeddings and cfg.layer_kinds == ()
    cfg = phi3.config_from_gguf(meta(4096), list(tensors), dtype="float32", load_tensor=tensors.__getitem__)
    assert cfg.rope.freq_factors == tuple(float(x) for x in short)
    # no factor tensors: plain rotary; Phi-3-mini-4k's window on every layer
    cfg = phi3.config_from_gguf(meta(4096, **{"phi3.attention.sliding_window": 2047}), [], dtype="float32")
    assert cfg.rope.freq_factors is None and cfg.sliding_window == 2047
