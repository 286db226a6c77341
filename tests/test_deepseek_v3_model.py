"""DeepSeek-V3 against transformers' own tiny checkpoint (multi-head latent attention with a
q bottleneck and YaRN rotary; 8 routed experts top 2 in 4 groups of which 2 are picked, a
random score-correction bias, one shared expert, a dense first layer): prompt log-probs and
greedy tokens through the paged engine over latent pools, with a prefix-cache hit, the int8
KV cache and preemption; n-gram speculation and tensor / expert parallelism 2 are ``slow``
(``tests/family_testing.py``). And what the latent cache saves at DeepSeek-V3's real sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests import family_testing as ft
from tests.conftest import require

pytestmark = pytest.mark.reference

ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
# head_dim: transformers rotates head_dim dims, which DeepseekV3Config sets to qk_rope_head_dim
TINY = {"first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 32, "q_lora_rank": 32, "kv_lora_rank": 24,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "head_dim": 8, "num_key_value_heads": 4,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_parameters": ROPE}

# deepseek-ai/DeepSeek-V3's config.json, the sizes that matter here
V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
      "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
      "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
      "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
      "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
      "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
      "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
      "tie_word_embeddings": False, "num_nextn_predict_layers": 1}


def write_checkpoint(path):
    """The tiny checkpoint, its (buffer, so never randomised by ``write_tiny``) score-correction
    biases set at random: they must steer the choice of experts and nothing else, and with a
    multi-token-prediction tensor beside the layers, which loading skips.

    Routing is discontinuous: where two experts' biased scores nearly tie, int8's rounding of
    the latents (a few thousandths on a score) picks the other one, and the token's output
    jumps (by up to 1 in log-prob on this model: more than int8's tolerance, and not a fault of
    the cache). These biases leave no such near-tie on the test's sequences."""
    from safetensors.numpy import load_file, save_file

    path = ft.write_tiny(path, "deepseek_v3", TINY)
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    rng = np.random.default_rng(9)
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = (0.3 * rng.standard_normal(tensors[name].shape)).astype(np.float32)
    # a multi-token-prediction module's tensor, stored as layer num_hidden_layers (as DeepSeek-V3's
    # layer 61): neither transformers nor jaxinfer runs it
    tensors["model.layers.3.eh_proj.weight"] = rng.standard_normal((64, 128)).astype(np.float32)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("deepseek_v3") / "m")
    return path, ft.reference(path)


def _llm(path, **kw):
    from jaxinfer import LLM

    return LLM(str(path), **({"max_model_len": 128, "progress": False, "kv_cache_memory_bytes": 16 << 20, "max_num_seqs": 4}
                             | kw))


def test_deepseek_v3_equals_transformers(tiny):
    """Plain, a prefix-cache hit and the int8 KV cache, all over latent pools: each layer has
    one pool of C + R values per token and no keys pool."""
    path, ref = tiny
    llm = _llm(path)
    cfg = llm.cfg
    assert cfg.latent_attention and cfg.layer_kv_heads(0) == 1 and cfg.layer_head_dim(0) == 24 + 8
    assert cfg.dense_layers == (0,) and "moe" in llm.weights["layers"][1] and "shared" in llm.weights["layers"][1]
    assert all(k is None for k in llm.engine.k_pages)
    assert [v.shape[1:] for v in llm.engine.v_pages] == [(1, 16, 32)] * 3
    report = llm.memory_report()
    assert report["kv_bytes_per_token"] == 3 * 32 * 4
    assert report["kv_latent"]["values_per_token_layer"] == 32
    assert report["kv_latent"]["expanded_values_per_token_layer"] == 4 * (16 + 8 + 12)
    assert report["kv_cache_bytes"] == 3 * llm.engine.v_pages[0].shape[0] * 16 * 32 * 4
    del llm
    ft.check_family(path, tp=False, ngram=False, ref=ref)


@pytest.mark.slow
def test_deepseek_v3_preemption_on_latent_pools(tiny):
    """Pages for fewer than the three sequences at once: rows are preempted, their latent
    pages released, and recomputed later to the same tokens."""
    path, ref = tiny
    llm = _llm(path, num_gpu_blocks_override=8, enable_prefix_caching=False)
    got = ft.generate(llm, prompt_logprobs=False)
    assert llm.engine.stats["preemptions"] > 0
    ft.assert_matches(got, ref, what="preempted")


@pytest.mark.slow
def test_deepseek_v3_ngram_and_tensor_parallel(tiny):
    """n-gram drafts verified over latent pages; tensor
    parallel 2 (heads split, latent pools whole on both devices) and expert parallel 2 (4 whole
    experts per device) on virtual CPUs."""

    path, ref = tiny
    llm = _llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                         "prompt_lookup_min": 2})
    ft.assert_matches(ft.generate(llm), ref, what="ngram")
    assert llm.engine.spec_stats.drafted > 0
    del llm
    ft.assert_matches(ft.tensor_parallel(path), ref, what="tensor parallel 2")
    ft.assert_matches(ft.tensor_parallel(path, enable_expert_parallel=True), ref, what="expert parallel 2")


@pytest.mark.slow
def test_deepseek_v3_on_the_kernel_path(tiny):
    """With the Pallas kernels on (interpret mode: TPU/GPU's path), latent layers still read
    their pools through the XLA readers (the kernels take separate key and value pools), and
    the rest (the experts' grouped matmuls) runs as kernels: still transformers' numbers."""
    path, ref = tiny
    got = ft.generate(_llm(path, kernels="pallas"))
    ft.assert_matches(got, ref, what="kernel path")


def test_deepseek_v3_latent_cache_at_real_sizes():
    """DeepSeek-V3's own config (no weights): a token adds 512 + 64 cached values per layer,
    against 128 heads x (192 key + 128 value) = 40,960 for per-head keys and values."""
    from jaxinfer.engine.pipeline import check_pipeline
    from jaxinfer.errors import CheckpointError, InvalidRequest
    from jaxinfer.models.deepseek_v3 import config_from_hf

    cfg = config_from_hf(V3, dtype="bfloat16")
    assert cfg.kv_values_per_token() == 512 + 64
    assert cfg.kv_values_per_token(expanded=True) == 128 * (128 + 64 + 128) == 40960
    report = cfg.latent_kv_report("bfloat16")
    assert report["bytes_per_token"] == cfg.kv_bytes_per_token("bfloat16") == 61 * 576 * 2
    assert report["expanded_bytes_per_token"] == 61 * 40960 * 2
    assert cfg.kv_bytes_per_token("int8") == 61 * (576 + 4)
    assert cfg.kv_bytes_per_token("bfloat16", lanes=128) == 61 * 640 * 2  # a TPU's pools: whole 128-lane tiles
    assert cfg.kv_bytes(4096, "bfloat16") == 4096 * 61 * 576 * 2
    assert cfg.dense_layers == (0, 1, 2) and cfg.family_config.n_expert_groups == 8 and cfg.family_config.topk_expert_groups == 4
    with pytest.raises(InvalidRequest, match="latent attention"):
        check_pipeline(cfg)
    with pytest.raises(CheckpointError, match="'fp8' are not supported"):
        config_from_hf(V3 | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
                       dtype="bfloat16")


def test_deepseek_v3_yarn_against_transformers():
    """YaRN's frequencies and cos/sin factor, and the softmax scale with its mscale^2, as
    transformers computes them for DeepSeek-V3's config."""
    require("torch")
    transformers = require("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from jaxinfer.models.deepseek_v3 import config_from_hf
    from jaxinfer.models.layers import rope_inv_freq

    cfg = config_from_hf(V3, dtype="float32")
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in V3.items() if k not in ("architectures", "model_type")})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    np.testing.assert_allclose(rope_inv_freq(64, cfg.rope), inv_freq.numpy(), rtol=1e-6)
    assert math.isclose(cfg.rope.attention_factor, factor, rel_tol=1e-9)
    want = hf.yarn_apply_mscale(hf_cfg.rope_parameters, hf_cfg.qk_head_dim**-0.5)
    assert math.isclose(cfg.attn_scale, want, rel_tol=1e-9)


@pytest.mark.parametrize("kv_dtype", ["float32", pytest.param("int8", marks=pytest.mark.slow)])
def test_deepseek_v3_padded_latent_pools_give_the_same_logits(kv_dtype):
    """A TPU's latent pool stores the latent padded with zeros to whole 128-lane tiles (576 ->
    640; here 24 + 8 = 32 -> 48 at lanes of 48, ``cache.init_paged_cache``): packed steps over
    NaN-poisoned padded pools, written a whole page at a time as on a TPU, give the logits of
    the unpadded pools (the engine's on CPU, held to transformers above)."""
    import jax

    from jaxinfer import dispatch
    from jaxinfer.models import deepseek_v3
    from jaxinfer.specs import init_weights
    from tests.kernel_testing import packed_decode_logits

    hf = V3 | TINY | {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "rope_scaling": None, "max_position_embeddings": 128}
    cfg = deepseek_v3.config_from_hf(hf, dtype="float32")
    w = init_weights(deepseek_v3.weight_specs(cfg), cfg, jax.random.key(3), scale=0.2)
    tokens = np.asarray(jax.random.randint(jax.random.key(4), (2, 13), 0, cfg.vocab_size))
    run = lambda lanes: packed_decode_logits(deepseek_v3, cfg, w, tokens, [5, 5], 8, page_size=4,  # noqa: E731
                                             num_pages=12, kv_dtype=kv_dtype, lanes=lanes,
                                             kernels=dispatch.Kernels(platform="tpu"), keys_transposed=False)
    np.testing.assert_allclose(run(48), run(1), rtol=1e-5, atol=1e-5)
