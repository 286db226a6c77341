"""Mixtral (``MixtralForCausalLM``): Mistral's attention, and a mixture of experts for the MLP.

Each layer routes every token to ``n_experts_per_tok`` of its ``n_experts`` SwiGLU experts:
softmax over the router's logits, the top k kept and rescaled to sum to 1 (``moe.softmax_topk``).
Attention, norms, embedding and head are Llama's (``models.llama``); a ``sliding_window`` in
the config makes every layer attend to that many trailing positions, as Mistral's does.

weights = {"embed": [V, D], "layers": [one dict per layer: Llama's attention weights,
           "mlp_norm" [D], "moe": the block's weights (``models.moe``)], "final_norm": [D],
           "lm_head": [D, V] (untied models only)}
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.config import AttentionKind, ModelConfig
from jaxinfer.models import llama, moe
from jaxinfer.models.family import LayerAt, ModelFamily, decoder, layer_loop
from jaxinfer.models.layers import gated_mlp, rms_norm, silu
from jaxinfer.models.llama import embed, unembed  # noqa: F401 (the family's embed / unembed)

_DENSE_MLP = ("w_gate", "w_up", "w_down")


def weight_specs(cfg: ModelConfig) -> dict:
    """Llama's declarations with the dense MLP replaced by the MoE block's."""
    specs = llama.weight_specs(cfg)
    block = moe.weight_specs(cfg.d_model, cfg.n_experts, cfg.moe_d_ff)
    layer = {k: v for k, v in specs["layers"][0].items() if k not in _DENSE_MLP} | {"moe": block}
    return specs | {"layers": [layer] * cfg.n_layers}


def moe_layer(attention) -> callable:
    """A layer of ``attention`` (a family's attention block: Llama's here, Qwen 3's for
    Qwen3-MoE), then the MoE block, or Llama's SwiGLU MLP on a layer without experts
    (``cfg.dense_layers``)."""

    def layer(w: dict, x: jax.Array, cache, at: LayerAt):
        cfg, i = at.cfg, at.i
        with jax.named_scope(f"layer{i}/attention"):
            x, cache = attention(w, x, cache, at.j, at.positions, at.start, at.rope(), cfg=cfg, layer=i,
                                 read_cache=at.read_cache)
        with jax.named_scope(f"layer{i}/mlp"):
            h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
            if "moe" in w:
                route = moe.softmax_topk(cfg.n_experts_per_tok, renormalize=cfg.norm_topk_prob)
                x = x + moe.moe_mlp(h, w["moe"], route=route)
            else:
                x = x + gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], silu)
        return x, cache

    return layer


layer = moe_layer(llama.attention_block)


decoder_layers = layer_loop(layer)
forward = decoder(embed, decoder_layers)


# Where each weight lives: our path -> (HF name, GGUF name, transpose: torch's [out, in] on
# the last two axes). ``{{e}}`` (a literal ``{e}`` once the layer is filled in) names one
# tensor per expert, which the HF loader stacks on the expert axis; llama.cpp's converter
# wrote them stacked already ([E, F, D] as numpy reads them).
CHECKPOINT_NAMES = {k: v for k, v in llama.CHECKPOINT_NAMES.items() if k not in {("layers", n) for n in _DENSE_MLP}} | {
    ("layers", "moe", "router"): ("model.layers.{i}.block_sparse_moe.gate.weight", "blk.{i}.ffn_gate_inp.weight", True),
    ("layers", "moe", "w_gate"): ("model.layers.{i}.block_sparse_moe.experts.{{e}}.w1.weight",
                                  "blk.{i}.ffn_gate_exps.weight", True),
    ("layers", "moe", "w_up"): ("model.layers.{i}.block_sparse_moe.experts.{{e}}.w3.weight",
                                "blk.{i}.ffn_up_exps.weight", True),
    ("layers", "moe", "w_down"): ("model.layers.{i}.block_sparse_moe.experts.{{e}}.w2.weight",
                                  "blk.{i}.ffn_down_exps.weight", True),
}

HF_ARCHITECTURES = frozenset({"MixtralForCausalLM"})
# llama.cpp writes Mixtral as its "llama" architecture with experts (``gguf_claims``), Q/K
# rows permuted as for Llama.
GGUF_ARCHITECTURES = frozenset({"llama"})
GGUF_PERMUTED_QK = frozenset({"llama"})
GGUF_CONFIG_TENSORS = llama.GGUF_CONFIG_TENSORS


def gguf_claims(meta: dict) -> bool:
    """A llama-architecture GGUF is Mixtral's when it has experts."""
    arch = meta.get("general.architecture")
    return int(meta.get(f"{arch}.expert_count", 0) or 0) > 0


def _moe(cfg: ModelConfig, *, n_experts: int, k: int, d_ff: int, sliding_window: int | None) -> ModelConfig:
    window = dict(layer_kinds=(AttentionKind.LOCAL,) * cfg.n_layers, sliding_window=sliding_window) \
        if sliding_window else {}
    return dataclasses.replace(cfg, family="mixtral", n_experts=n_experts, n_experts_per_tok=k,
                               moe_d_ff=d_ff, norm_topk_prob=True, **window)


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    cfg = llama.config_from_hf(hf, dtype=dtype)
    return _moe(cfg, n_experts=int(hf["num_local_experts"]), k=int(hf["num_experts_per_tok"]),
                d_ff=int(hf["intermediate_size"]), sliding_window=hf.get("sliding_window"))


def config_from_gguf(meta: dict, tensor_names, *, dtype: str, load_tensor=None) -> ModelConfig:
    cfg = llama.config_from_gguf(meta, tensor_names, dtype=dtype, load_tensor=load_tensor)
    arch = meta["general.architecture"]
    return _moe(cfg, n_experts=int(meta[f"{arch}.expert_count"]), k=int(meta[f"{arch}.expert_used_count"]),
                d_ff=int(meta[f"{arch}.feed_forward_length"]), sliding_window=None)

FAMILY = ModelFamily(
    name="mixtral", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, gguf_architectures=GGUF_ARCHITECTURES,
    config_from_gguf=config_from_gguf, gguf_permuted_qk=GGUF_PERMUTED_QK, gguf_config_tensors=GGUF_CONFIG_TENSORS,
    gguf_claims=gguf_claims,
)
