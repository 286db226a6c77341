"""The SmolLM3 family (SmolLM3ForCausalLM): Llama's layers, weights and checkpoint names
(``models/llama.py``), except that some layers use no position embedding at all (NoPE).

transformers' ``no_rope_layers`` holds one flag per layer, 1 where the layer DOES apply rotary
(the name says the opposite); without it every ``no_rope_layer_interval``-th layer (4th, 8th, ...)
skips rotary. We keep the skipping layers' indices in ``cfg.nope_layers``, which
``llama.decoder_layers`` honours. Layers that ``layer_types`` names "sliding_attention" attend to
the last ``sliding_window`` positions (no published SmolLM3 slides).

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D],
           "lm_head": [D, V] (untied models only; SmolLM3 ties them by default)}
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.models import llama
from jaxinfer.models.family import ModelFamily
from jaxinfer.models.llama import (  # noqa: F401 (this family's, unchanged)
    CHECKPOINT_NAMES,
    GGUF_CONFIG_TENSORS,
    decoder_layers,
    embed,
    forward,
    unembed,
    weight_specs,
)
from jaxinfer.models.llama import sliding_kinds

# llama.cpp converts SmolLM3 as a Llama (its rotary is the interleaved one): Q/K rows permuted.
GGUF_PERMUTED_QK = frozenset({"smollm3"})
GGUF_ARCHITECTURES = frozenset({"smollm3"})
HF_ARCHITECTURES = frozenset({"SmolLM3ForCausalLM"})
# llama.cpp's fixed NoPE interval for smollm3: its GGUFs carry no key for it
GGUF_NOPE_INTERVAL = 4

# SmolLM3Config's defaults, for keys a config.json leaves out.
HF_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 32768,
               "rope_theta": 2_000_000.0}


def nope_every(interval: int, n_layers: int) -> tuple[int, ...]:
    """Every ``interval``-th layer skips rotary: layers interval-1, 2*interval-1, ..."""
    return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    """A SmolLM3ForCausalLM config.json."""
    hf = HF_DEFAULTS | hf
    if hf.get("attention_bias"):
        raise CheckpointError("unsupported SmolLM3 variant: attention_bias=true")
    n_layers = hf["num_hidden_layers"]
    flags = hf.get("no_rope_layers")
    if flags is None:
        nope = nope_every(int(hf.get("no_rope_layer_interval", 4)), n_layers)
    elif len(flags) != n_layers:
        raise CheckpointError(f"no_rope_layers lists {len(flags)} layers, the model has {n_layers}")
    else:
        nope = tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if window and i in nope else "full_attention" for i in range(n_layers)]
    elif "sliding_attention" in types and not hf.get("use_sliding_window"):
        # transformers' eager attention would slide these layers and its flash attention would not
        raise CheckpointError("layer_types has sliding_attention layers but use_sliding_window is false")
    kinds = sliding_kinds(types, n_layers, window)
    return dataclasses.replace(
        llama.config_from_hf(hf, dtype=dtype), family="smollm3", qkv_bias=False, nope_layers=nope,
        layer_kinds=kinds, sliding_window=window if kinds else None)


def config_from_gguf(meta: dict, tensor_names, *, dtype: str, load_tensor=None) -> ModelConfig:
    """llama.cpp's reading of a smollm3 GGUF: Llama's keys, every 4th layer without rotary."""
    cfg = llama.config_from_gguf(meta, tensor_names, dtype=dtype, load_tensor=load_tensor)
    return dataclasses.replace(cfg, family="smollm3", nope_layers=nope_every(GGUF_NOPE_INTERVAL, cfg.n_layers))

FAMILY = ModelFamily(
    name="smollm3", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, gguf_architectures=GGUF_ARCHITECTURES,
    config_from_gguf=config_from_gguf, gguf_permuted_qk=GGUF_PERMUTED_QK,
    gguf_config_tensors=GGUF_CONFIG_TENSORS,
)
