"""Gemma 4 (text decoder) equals transformers float32 on tiny random checkpoints that
transformers itself writes (``tests/family_testing.py``): per-layer inputs, proportional
partial rotary on global layers, a global head dim of its own, KV sharing, values from keys
with fewer global KV heads, the double-wide MLP; through the paged engine (prefix-cache hit),
n-gram speculation, the int8 KV cache and tensor parallelism 2. Also: a layer that shares keys
and values has no cache of its own and costs no KV bytes, the config reading, int8 weights,
the multimodal checkpoint's text tower and llama.cpp's GGUF."""

import json

import numpy as np
import pytest

from tests import family_testing as ft

pytestmark = pytest.mark.reference

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# per-layer inputs (E = 8), global layers at head dim 32 with proportional rotary over a quarter
# of it, 4 layers of which the last 2 share the keys/values of layers 0 and 1, a window of 8
# that the 48-token prompts pass
GEMMA4 = {"num_hidden_layers": 4, "layer_types": LAYER_TYPES, "sliding_window": 8, "global_head_dim": 32,
          "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": ft.V, "num_kv_shared_layers": 2,
          "final_logit_softcapping": 5.0}
# values from keys on global layers with one global KV head (replicated under tensor
# parallelism 2 while the local layers' two split), the double-wide MLP on the sharing layers,
# a tied embedding
GEMMA4_K_EQ_V = GEMMA4 | {"attention_k_eq_v": True, "num_global_key_value_heads": 1, "use_double_wide_mlp": True,
                          "tie_word_embeddings": True}


def write_gemma4(path, overrides, *, architecture="Gemma4ForCausalLM", outer=None):
    """ft.write_tiny, then every layer_scalar (a buffer transformers leaves at 1) randomised too."""
    from safetensors.numpy import load_file, save_file

    path = ft.write_tiny(path, "gemma4" if outer is not None else "gemma4_text", overrides,
                         architecture=architecture, outer=outer)
    tensors = load_file(path / "model.safetensors")
    rng = np.random.default_rng(7)
    for name in tensors:
        if name.endswith("layer_scalar"):
            tensors[name] = rng.uniform(0.5, 1.5, tensors[name].shape).astype(np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def gemma4_path(tmp_path_factory):
    return write_gemma4(tmp_path_factory.mktemp("gemma4") / "ckpt", GEMMA4)


@pytest.fixture(scope="module")
def k_eq_v_path(tmp_path_factory):
    return write_gemma4(tmp_path_factory.mktemp("gemma4") / "kv", GEMMA4_K_EQ_V)


def test_gemma4_equals_transformers(gemma4_path):
    ft.check_family(gemma4_path)


@pytest.mark.slow
def test_gemma4_values_from_keys_equals_transformers(k_eq_v_path):
    ft.check_family(k_eq_v_path, ngram=False)


def test_multimodal_checkpoint_text_tower_equals_transformers(tmp_path):
    """Gemma4ForConditionalGeneration (what Google publishes) keeps the text decoder under
    model.language_model. and its config in text_config: loaded as the text model."""
    path = write_gemma4(tmp_path / "mm", GEMMA4, architecture="Gemma4ForConditionalGeneration",
                        outer={"vision_config": None, "audio_config": None})
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Gemma4ForConditionalGeneration"]
    from jaxinfer import LLM

    ref = ft.reference(path, ft.PROMPTS[:1])
    llm = LLM(str(path), max_model_len=128, progress=False, kv_cache_memory_bytes=4 << 20, max_num_seqs=2)
    assert llm.cfg.tie_embeddings and llm.cfg.kv_shared_layers == 2
    ft.assert_matches(ft.generate(llm, ft.PROMPTS[:1]), ref, what="multimodal text tower")
    from tests.test_text_towers import _refuses_images

    _refuses_images(llm, path)  # Gemma 4's vision tower is not run: its images are refused


def write_gguf(hf_path, out):
    """The tiny checkpoint as llama.cpp's converter writes a gemma4 GGUF (convert_hf_to_gguf's
    Gemma4Model over Gemma3Model): its metadata keys, its tensor names, norms as stored (no
    1 + w shift), each layer_scalar as blk.N.layer_output_scale.weight, and the global layers'
    proportional rotary as rope_freqs.weight divisors (1 for a turning frequency, 1e30 for a
    still one). The tokenizer: the tiny one's V word pieces as a SentencePiece vocabulary."""
    import gguf
    from safetensors.numpy import load_file

    hf = json.loads((hf_path / "config.json").read_text())
    t = load_file(hf_path / "model.safetensors")
    L, types = hf["num_hidden_layers"], hf["layer_types"]
    swa = [k == "sliding_attention" for k in types]
    shared = hf["num_kv_shared_layers"]
    gh = hf["per_layer_config"][str(types.index("full_attention"))]["head_dim"]
    w = gguf.GGUFWriter(str(out), "gemma4")
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(L)
    F = hf["intermediate_size"]
    w.add_feed_forward_length([F if i < L - shared else 2 * F for i in range(L)] if hf["use_double_wide_mlp"] else F)
    w.add_head_count(hf["num_attention_heads"])
    kv_full = hf["per_layer_config"][str(types.index("full_attention"))].get("num_key_value_heads")
    K = hf["num_key_value_heads"]
    w.add_head_count_kv([K if s else kv_full for s in swa] if kv_full else K)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_key_length(gh)
    w.add_value_length(gh)
    w.add_key_length_swa(hf["head_dim"])
    w.add_value_length_swa(hf["head_dim"])
    w.add_rope_freq_base(hf["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(hf["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(gh)
    w.add_rope_dimension_count_swa(hf["head_dim"])
    w.add_final_logit_softcapping(hf["final_logit_softcapping"])
    w.add_sliding_window(hf["sliding_window"])
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(hf["hidden_size_per_layer_input"])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(ft.V)])
    w.add_token_scores([0.0] * ft.V)
    w.add_token_types([gguf.TokenType.CONTROL if i < 4 else gguf.TokenType.NORMAL for i in range(ft.V)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(3)
    blk = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
           "self_attn.o_proj": "attn_output", "post_attention_layernorm": "post_attention_norm",
           "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm",
           "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj",
           "post_per_layer_input_norm": "post_norm", "layer_scalar": "layer_output_scale"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight", "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
           "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
           "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}
    for name, a in t.items():
        if name in top:
            w.add_tensor(top[name], a)
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        w.add_tensor(f"blk.{i}.{blk[rest.removesuffix('.weight')]}.weight", a)
    rotated = int(gh * hf["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (gh // 2 - rotated), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_equals_transformers(k_eq_v_path, tmp_path):
    """llama.cpp's gemma4 GGUF of the values-from-keys checkpoint (per-layer KV heads and MLP
    widths as arrays, no attn_v on global layers, a tied embedding) gives transformers' numbers."""
    from jaxinfer import LLM

    path = write_gguf(k_eq_v_path, tmp_path / "tiny-gemma4.gguf")
    llm = LLM(str(path), max_model_len=128, progress=False, kv_cache_memory_bytes=4 << 20, max_num_seqs=2)
    cfg = llm.cfg
    own = cfg.family_config
    assert own.values_from_keys and cfg.global_kv_heads == 1 and own.shared_kv_d_ff == 2 * cfg.d_ff
    assert cfg.rope.freq_factors[-1] == np.float32(1e30) and cfg.tie_embeddings and cfg.kv_shared_layers == 2
    ref = ft.reference(k_eq_v_path, ft.PROMPTS[:1])
    ft.assert_matches(ft.generate(llm, ft.PROMPTS[:1]), ref, what="gguf")


def test_config_reads_every_gemma4_option(gemma4_path, tmp_path):
    from jaxinfer.config import AttentionKind, RopeKind
    from jaxinfer.errors import CheckpointError
    from jaxinfer.loaders.hf import read_config
    from jaxinfer.models import gemma4

    hf = read_config(gemma4_path)
    cfg = gemma4.config_from_hf(hf, dtype="float32")
    L, G = AttentionKind.LOCAL, AttentionKind.GLOBAL
    assert cfg.layer_kinds == (L, G, L, G) and cfg.sliding_window == 8
    assert [cfg.layer_head_dim(i) for i in range(4)] == [16, 32, 16, 32]
    assert [cfg.layer_kv_heads(i) for i in range(4)] == [2, 2, 2, 2]
    assert [cfg.kv_source(i) for i in range(4)] == [0, 1, 0, 1]
    assert cfg.rope == gemma4.GLOBAL_ROPE and cfg.rope.kind == RopeKind.PROPORTIONAL
    assert cfg.rope_local.theta == 10000.0 and cfg.rope_local.kind == RopeKind.DEFAULT
    own = cfg.family_config
    assert (own.per_layer_input_dim, own.per_layer_vocab_size, cfg.attn_scale) == (8, ft.V, 1.0)
    assert cfg.final_logit_softcap == 5.0 and not own.values_from_keys and own.shared_kv_d_ff is None

    # the older form of the same config: global_head_dim and num_global_key_value_heads at the top
    flat = {k: v for k, v in hf.items() if k != "per_layer_config"} | {
        "global_head_dim": 32, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
        "use_double_wide_mlp": True}
    cfg2 = gemma4.config_from_hf(flat, dtype="float32")
    assert [cfg2.layer_head_dim(i) for i in range(4)] == [16, 32, 16, 32]
    assert [cfg2.layer_kv_heads(i) for i in range(4)] == [2, 1, 2, 1]
    assert cfg2.family_config.values_from_keys and cfg2.family_config.shared_kv_d_ff == 2 * cfg2.d_ff
    specs = gemma4.weight_specs(cfg2)["layers"]
    assert "wv" in specs[0] and "wv" not in specs[1] and "wk" not in specs[2] and "wk" not in specs[3]
    assert specs[3]["w_up"].shape == (64, 256) and specs[1]["w_up"].shape == (64, 128)

    for bad, word in (({"enable_moe_block": True}, "enable_moe_block"),
                      ({"num_kv_shared_layers": 4}, "num_kv_shared_layers"),
                      ({"per_layer_config": {"1": {"sliding_window": 4}}}, "per_layer_config"),
                      ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "yarn")):
        with pytest.raises(CheckpointError, match=word):
            gemma4.config_from_hf(hf | bad, dtype="float32")


def test_shared_layers_have_no_cache_and_cost_no_kv_bytes(gemma4_path):
    from jaxinfer import LLM
    from jaxinfer import cache as kv
    from jaxinfer.config import AttentionKind

    llm = LLM(str(gemma4_path), max_model_len=128, progress=False, kv_cache_memory_bytes=1 << 20, max_num_seqs=2)
    cfg, eng = llm.cfg, llm.engine
    assert eng.k_pages[2] is None and eng.v_pages[3] is None  # layers 2, 3 read layers 0, 1's pools
    assert [tuple(eng.k_pages[i].shape[1:3]) for i in (0, 1)] == [(2, 16), (2, 32)]  # [P, K, H, ps]
    assert eng.v_pages[1].shape[3] == 32
    # float32: layer 0 keeps 2 x 2 heads x 16, layer 1 2 x 2 heads x 32 per token; 2 and 3 nothing
    local, glob = 2 * 2 * 16 * 4, 2 * 2 * 32 * 4
    assert cfg.kv_bytes_per_token() == local + glob
    assert cfg.kv_bytes_per_token(kind=AttentionKind.LOCAL) == local
    assert cfg.kv_bytes_per_token("int8", kind=AttentionKind.GLOBAL) == 2 * 2 * (32 + 4)
    report = llm.memory_report(seq_len=100)
    assert report["kv_bytes_per_token"] == local + glob
    assert report["kv_bytes_seq"] == 8 * local + 100 * glob  # the local layer keeps its window of 8
    assert report["kv_bytes_seq_dense"] == 100 * (local + glob)
    assert report["kv_cache_bytes"] == sum(a.nbytes for a in eng.k_pages + eng.v_pages if a is not None)
    dense = kv.init_cache(cfg, 2, 64)
    assert dense.k[2] is None and dense.k[3] is None and dense.nbytes() == 2 * 64 * (local + glob)


def test_ragged_kernel_path_equals_transformers(gemma4_path):
    """The TPU/GPU path (Pallas ragged paged attention, traced in interpret mode): per-layer
    head dims, and sharing layers reading their source's pages in the same step."""
    from jaxinfer import LLM

    ref = ft.reference(gemma4_path, ft.PROMPTS[:2], max_tokens=4)
    llm = LLM(str(gemma4_path), max_model_len=128, progress=False, kv_cache_memory_bytes=4 << 20, max_num_seqs=2,
              kernels="pallas")
    got = ft.generate(llm, ft.PROMPTS[:2], max_tokens=4)
    ft.assert_matches(got, ref, what="ragged kernel")


def test_int8_weights_load_and_generate(gemma4_path):
    from jaxinfer import LLM
    from jaxinfer.quant import QuantArray

    ref = ft.reference(gemma4_path, ft.PROMPTS[:1])
    llm = LLM(str(gemma4_path), quantization="int8", max_model_len=128, progress=False, kv_cache_memory_bytes=4 << 20,
              max_num_seqs=2)
    w = llm.weights
    assert all(isinstance(w[n], QuantArray) for n in ("ple_embed", "ple_model_proj", "embed", "lm_head"))
    assert isinstance(w["layers"][0]["ple_gate"], QuantArray) and not isinstance(w["layers"][0]["layer_scalar"],
                                                                                   QuantArray)
    got = ft.generate(llm, ft.PROMPTS[:1])
    # int8 weights over these 64-wide contractions move the log-probs by a few hundredths (a
    # weight read as its raw int8 values, or a scale misplaced, by whole units)
    err = np.abs(np.subtract(got[0]["prompt_logprobs"], ref[0]["prompt_logprobs"]))
    assert err.mean() < 0.05 and err.max() < 0.25, (err.mean(), err.max())


def test_w8a8_and_pipeline_refused(gemma4_path):
    from jaxinfer import LLM
    from jaxinfer.engine.pipeline import check_pipeline
    from jaxinfer.errors import InvalidRequest
    from jaxinfer.loaders.hf import read_config
    from jaxinfer.models import gemma4

    with pytest.raises(InvalidRequest, match="w8a8"):
        LLM(str(gemma4_path), quantization="w8a8", max_model_len=128, progress=False)
    with pytest.raises(InvalidRequest, match="pipeline_parallel_size"):
        check_pipeline(gemma4.config_from_hf(read_config(gemma4_path), dtype="float32"))
