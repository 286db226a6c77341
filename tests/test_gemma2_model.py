"""Gemma 2 equals transformers float32 on a tiny random Gemma2ForCausalLM: both soft-caps on
(scores capped at 2, so the cap bends nearly every score), sliding-window layers with a window of
8 under 48-token prompts, a query scale that is not head_dim. Through the paged engine (prefix
cache, n-gram speculation, int8 KV, tensor parallelism 2), from a GGUF written as llama.cpp's
converter writes one, and with int8 weights. Configs from the published config.json and from
GGUF metadata.
"""

import dataclasses

import numpy as np
import pytest

from jaxinfer.config import AttentionKind
from jaxinfer.models import gemma2
from tests import family_testing as ft

pytestmark = pytest.mark.reference

L, G = AttentionKind.LOCAL, AttentionKind.GLOBAL
OVERRIDES = {"sliding_window": 8, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
             "final_logit_softcapping": 5.0, "hidden_activation": "gelu_pytorch_tanh"}


def test_family_equals_transformers(tmp_path):
    path = ft.write_tiny(tmp_path / "gemma2", "gemma2", OVERRIDES)
    from jaxinfer.loaders import checkpoint

    cfg = checkpoint.load(path, dtype="float32").cfg
    assert (cfg.family, cfg.layer_kinds, cfg.sliding_window) == ("gemma2", (L, G, L), 8)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.attn_scale) == (2.0, 5.0, 24**-0.5)
    ft.check_family(path)


def _gguf_keys(w, hf):
    """Gemma2Model.set_gguf_parameters in llama.cpp's convert_hf_to_gguf.py."""
    w.add_context_length(hf["max_position_embeddings"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
    w.add_final_logit_softcapping(hf["final_logit_softcapping"])
    w.add_sliding_window(hf["sliding_window"])


def test_gguf_equals_transformers(tmp_path):
    """llama.cpp's converter stores every norm as 1 + w and drops lm_head (Gemma 2 ties it; so
    does this checkpoint). The GGUF holds the same model as the directory, and generates what
    transformers does. Its query scale comes from llama.cpp's rule (head_dim below 27B), so
    the checkpoint keeps query_pre_attn_scalar = head_dim here."""
    from jaxinfer import LLM
    from jaxinfer.loaders import checkpoint
    from tests.hf_to_gguf import hf_to_gguf

    hf_dir = ft.write_tiny(tmp_path / "hf", "gemma2", OVERRIDES | {"query_pre_attn_scalar": 16,
                                                                    "tie_word_embeddings": True})
    path = hf_to_gguf(hf_dir, tmp_path / "gemma2.gguf", "gemma2", _gguf_keys, skip=("lm_head.weight",),
                      modify=lambda name, a: a + np.float32(1.0) if name.endswith("norm.weight") else a)
    a, b = checkpoint.load(hf_dir, dtype="float32"), checkpoint.load(path, dtype="float32")
    same = lambda c: dataclasses.replace(c, name="", norm_eps=round(c.norm_eps, 12))  # noqa: E731 (stored as f32)
    assert same(b.cfg) == same(a.cfg)
    np.testing.assert_allclose(np.asarray(b.weights["layers"][1]["post_mlp_norm"]),
                               np.asarray(a.weights["layers"][1]["post_mlp_norm"]), rtol=0, atol=1e-7)
    llm = LLM(str(path), max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    ft.assert_matches(ft.generate(llm), ft.reference(hf_dir), what="gguf")


# int8 weights (one scale per output channel) move this tiny random model's log-probs by up to
# ~0.07: a bound for quantization, not for a bug (a misplaced weight moves them by whole units)
INT8_WEIGHTS_PLP_ATOL, INT8_WEIGHTS_NEAR_TIE = 0.15, 0.3


def test_int8_weights_load_and_stay_close(tmp_path):
    """quantization="int8": every matmul weight quantized at load; log-probs stay near
    transformers' float ones and the greedy tokens agree up to a near-tie."""
    from jaxinfer import LLM
    from jaxinfer.quant import QuantArray

    path = ft.write_tiny(tmp_path / "gemma2", "gemma2", OVERRIDES)
    llm = LLM(str(path), quantization="int8", max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    assert isinstance(llm.weights["layers"][0]["wq"], QuantArray)
    ft.assert_matches(ft.generate(llm), ft.reference(path), plp_atol=INT8_WEIGHTS_PLP_ATOL,
                      near_tie=INT8_WEIGHTS_NEAR_TIE, what="int8 weights")


# gemma-2-2b's config.json as published (transformers 4)
HF_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "use_cache": True, "vocab_size": 256000,
}


def test_config_from_published_hf_and_gguf_metadata():
    cfg = gemma2.config_from_hf(HF_2B, dtype="float32")
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (26, 8, 4, 256, 9216)
    assert cfg.layer_kinds == (L, G) * 13 and cfg.sliding_window == 4096 and cfg.tie_embeddings
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.attn_scale) == (50.0, 30.0, 1 / 16)
    assert cfg.rope.theta == 10000.0 and cfg.norm_eps == 1e-6 and cfg.max_position == 8192
    # transformers 5: layer_types and rope_parameters; soft-caps may be switched off
    v5 = {k: v for k, v in HF_2B.items() if k != "rope_theta"} | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "attn_logit_softcapping": None,
        "layer_types": ["full_attention"] * 26}
    cfg5 = gemma2.config_from_hf(v5, dtype="float32")
    assert cfg5.attn_logit_softcap is None and cfg5.layer_kinds == () and cfg5.sliding_window is None
    with pytest.raises(Exception, match="rope type"):
        gemma2.config_from_hf(HF_2B | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, dtype="float32")

    def meta(n_layers, **extra):
        return {"general.architecture": "gemma2", "tokenizer.ggml.tokens": ["a"] * 256000,
                "gemma2.block_count": n_layers, "gemma2.embedding_length": 4608, "gemma2.attention.head_count": 32,
                "gemma2.attention.head_count_kv": 16, "gemma2.attention.key_length": 128,
                "gemma2.feed_forward_length": 36864, "gemma2.context_length": 8192,
                "gemma2.attention.sliding_window": 4096} | extra

    # llama.cpp: the 27B (46 layers) scales queries by (D / N)**-0.5 = 144**-0.5; soft-caps 50
    # and 30 where the file leaves them out
    big = gemma2.config_from_gguf(meta(46), ["token_embd.weight"], dtype="float32")
    assert big.attn_scale == 144**-0.5 and (big.attn_logit_softcap, big.final_logit_softcap) == (50.0, 30.0)
    assert big.layer_kinds == (L, G) * 23 and big.tie_embeddings
    small = gemma2.config_from_gguf(meta(42, **{"gemma2.attn_logit_softcapping": 20.0}), [], dtype="float32")
    assert small.attn_scale == 128**-0.5 and small.attn_logit_softcap == 20.0
