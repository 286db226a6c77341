"""Qwen3-MoE against transformers' own tiny checkpoint (8 experts, top 2, without and with
norm_topk_prob, a dense layer among the sparse ones): prompt log-probs and greedy tokens
through the paged engine, with a prefix-cache hit, n-gram speculation, the int8 KV cache and
tensor parallelism 2 (``tests/family_testing.py``); and the GGUF llama.cpp's converter writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests import family_testing as ft

pytestmark = pytest.mark.reference

TINY = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False}


def test_qwen3_moe_equals_transformers(tmp_path):
    ft.check_family(ft.write_tiny(tmp_path / "m", "qwen3_moe", TINY))


def test_qwen3_moe_dense_layer_and_renormalised_weights(tmp_path):
    """mlp_only_layers [1]: layer 1 keeps a dense MLP of intermediate_size; norm_topk_prob:
    the top-2 weights sum to 1."""
    from jaxinfer import LLM

    path = ft.write_tiny(tmp_path / "m", "qwen3_moe", TINY | {"norm_topk_prob": True, "mlp_only_layers": [1]})
    ref = ft.reference(path)
    llm = LLM(str(path), max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    assert llm.cfg.dense_layers == (1,) and llm.cfg.norm_topk_prob
    assert "moe" not in llm.weights["layers"][1] and "moe" in llm.weights["layers"][0]
    ft.assert_matches(ft.generate(llm), ref, what="dense layer 1")


def write_gguf(path: Path, hf_dir: Path) -> Path:
    """The tiny checkpoint as llama.cpp's converter writes Qwen3-MoE ("qwen3moe"): Q/K rows
    as in HF, per-head q/k norms, experts stacked per projection ([E, F, D] as numpy reads it)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(str(hf_dir / "model.safetensors"))
    E, a = cfg["num_local_experts"], "qwen3moe"
    w = gguf.GGUFWriter(str(path), a)
    for key, value in (("block_count", cfg["num_hidden_layers"]), ("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.head_count_kv", cfg["num_key_value_heads"]),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("expert_count", E), ("expert_used_count", cfg["num_experts_per_tok"]),
                       ("expert_feed_forward_length", cfg["moe_intermediate_size"])):
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg["vocab_size"])])
    w.add_array("tokenizer.ggml.scores", [0.0] * cfg["vocab_size"])
    w.add_array("tokenizer.ggml.token_type", [2 if i == 3 else 1 for i in range(cfg["vocab_size"])])
    w.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    tensors = {"token_embd.weight": t["model.embed_tokens.weight"], "output_norm.weight": t["model.norm.weight"],
               "output.weight": t["lm_head.weight"]}
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {f"blk.{i}.{ours}.weight": t[f"{p}{theirs}.weight"] for ours, theirs in names.items()}
        for proj in ("gate", "up", "down"):
            tensors[f"blk.{i}.ffn_{proj}_exps.weight"] = np.stack(
                [t[f"{p}mlp.experts.{e}.{proj}_proj.weight"] for e in range(E)])
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen3_moe_gguf_equals_transformers(tmp_path):
    """llama.cpp always renormalises qwen3moe's top-k weights, so the checkpoint compared has
    norm_topk_prob true."""
    from jaxinfer import LLM

    hf = ft.write_tiny(tmp_path / "m", "qwen3_moe", TINY | {"norm_topk_prob": True})
    llm = LLM(str(write_gguf(tmp_path / "q.gguf", hf)), max_model_len=128, progress=False,
              kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    assert llm.cfg.family == "qwen3_moe" and llm.cfg.n_experts == 8 and llm.cfg.moe_d_ff == 32
    ft.assert_matches(ft.generate(llm), ft.reference(hf), what="gguf")
