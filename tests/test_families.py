"""Every supported family equals transformers float32 on a tiny random checkpoint that
transformers itself writes: prompt log-probs and greedy tokens through the paged engine (with a
prefix-cache hit), n-gram speculation, the int8 KV cache and tensor parallelism 2
(``tests/family_testing.py``)."""

import pytest

from tests import family_testing as ft

pytestmark = pytest.mark.reference

# model_type -> config overrides of the tiny checkpoint (beside family_testing.COMMON)
FAMILIES = {
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32}},
    "mistral": {"sliding_window": 8},  # every layer slides
    "qwen2": {"tie_word_embeddings": True},
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 8, "query_pre_attn_scalar": 24,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "final_logit_softcapping": 5.0, "hidden_activation": "gelu_pytorch_tanh"},
    # post-attention and post-MLP norms, fused gate_up, interleaved rotary over half of each head
    "glm4": {"partial_rotary_factor": 0.5, "attention_bias": True},
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.05,
                "logits_scaling": 2.5, "attention_bias": True},
}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_equals_transformers(model_type, tmp_path):
    path = ft.write_tiny(tmp_path / model_type, model_type, FAMILIES[model_type])
    ft.check_family(path)


@pytest.mark.slow  # Pallas interpret mode: minutes
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_family_with_keys_pools_as_a_tpu_keeps_them_equals_transformers(model_type, tmp_path):
    """kernels="pallas" (interpret mode on CPU): the pools keep keys [P, K, ps, H], as on a TPU
    (``dispatch.keys_transposed``), read by the Pallas kernels (decode rows, n-gram verification
    rows, a prefill row over cached pages; Gemma 3's window pools) and, under the int8 KV cache,
    by the pure-JAX readers."""
    path = ft.write_tiny(tmp_path / model_type, model_type, FAMILIES[model_type])
    ft.check_family(path, tp=False, kernels="pallas")
