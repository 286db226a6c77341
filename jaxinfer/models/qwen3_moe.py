"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (Llama's, with an RMSNorm over the
head dim of every query and key head before rotary) and a mixture of experts for the MLP.

Each token goes to ``n_experts_per_tok`` experts by softmax top-k, the k weights rescaled to
sum to 1 only with ``norm_topk_prob`` (``moe.softmax_topk``). Layers in ``dense_layers``
(the checkpoint's ``mlp_only_layers`` and those ``decoder_sparse_step`` skips) keep a dense
SwiGLU MLP of width d_ff instead.

weights = {"embed": [V, D], "layers": [one dict per layer: Llama's attention weights,
           "q_norm", "k_norm" [H], "mlp_norm" [D], and "moe" (``models.moe``) or Llama's
           w_gate / w_up / w_down], "final_norm": [D], "lm_head": [D, V] (untied only)}
"""

from __future__ import annotations

import dataclasses


from jaxinfer.config import AttentionKind, ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.models import llama, mixtral, moe
from jaxinfer.models.family import ModelFamily, decoder, layer_loop
from jaxinfer.models.llama import embed, unembed  # noqa: F401 (the family's embed / unembed)
from jaxinfer.models.qwen3 import attention_block
from jaxinfer.specs import WeightSpec

_DENSE_MLP = ("w_gate", "w_up", "w_down")


def weight_specs(cfg: ModelConfig) -> dict:
    """Llama's declarations plus the per-head q/k norms; experts in place of the dense MLP
    except in ``dense_layers``."""
    specs = llama.weight_specs(cfg)
    H = cfg.head_dim
    base = specs["layers"][0] | {"q_norm": WeightSpec((H,), ("head_dim",), "ones"),
                                 "k_norm": WeightSpec((H,), ("head_dim",), "ones")}
    sparse = {k: v for k, v in base.items() if k not in _DENSE_MLP} | {
        "moe": moe.weight_specs(cfg.d_model, cfg.n_experts, cfg.moe_d_ff)}
    return specs | {"layers": [base if i in cfg.dense_layers else sparse for i in range(cfg.n_layers)]}


decoder_layers = layer_loop(mixtral.moe_layer(attention_block))  # Mixtral's layers, Qwen 3's attention

forward = decoder(embed, decoder_layers)


# Where each weight lives (see ``mixtral.CHECKPOINT_NAMES`` for ``{{e}}``); a dense layer's MLP
# keeps Llama's names.
CHECKPOINT_NAMES = llama.CHECKPOINT_NAMES | {
    ("layers", "q_norm"): ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", False),
    ("layers", "k_norm"): ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", False),
    ("layers", "moe", "router"): ("model.layers.{i}.mlp.gate.weight", "blk.{i}.ffn_gate_inp.weight", True),
    ("layers", "moe", "w_gate"): ("model.layers.{i}.mlp.experts.{{e}}.gate_proj.weight",
                                  "blk.{i}.ffn_gate_exps.weight", True),
    ("layers", "moe", "w_up"): ("model.layers.{i}.mlp.experts.{{e}}.up_proj.weight", "blk.{i}.ffn_up_exps.weight",
                                True),
    ("layers", "moe", "w_down"): ("model.layers.{i}.mlp.experts.{{e}}.down_proj.weight",
                                  "blk.{i}.ffn_down_exps.weight", True),
}

HF_ARCHITECTURES = frozenset({"Qwen3MoeForCausalLM"})
GGUF_ARCHITECTURES = frozenset({"qwen3moe"})  # llama.cpp's name; Q/K rows as in HF (NeoX rotary)
GGUF_CONFIG_TENSORS = llama.GGUF_CONFIG_TENSORS


def _moe(cfg: ModelConfig, *, n_experts: int, k: int, d_ff: int, norm_topk_prob: bool, dense_layers=(),
         sliding_window: int | None = None) -> ModelConfig:
    window = dict(layer_kinds=(AttentionKind.LOCAL,) * cfg.n_layers, sliding_window=sliding_window) \
        if sliding_window else {}
    return dataclasses.replace(cfg, family="qwen3_moe", n_experts=n_experts, n_experts_per_tok=k,
                               moe_d_ff=d_ff, norm_topk_prob=norm_topk_prob, dense_layers=tuple(dense_layers),
                               **window)


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    cfg = llama.config_from_hf(hf, dtype=dtype)
    E = int(hf.get("num_experts") or hf["num_local_experts"])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    only = set(hf.get("mlp_only_layers") or ())
    dense = [i for i in range(cfg.n_layers) if i in only or not E or (i + 1) % step]
    if hf.get("attention_bias"):
        raise CheckpointError("Qwen3-MoE with attention_bias=true is not supported")
    return _moe(cfg, n_experts=E, k=int(hf["num_experts_per_tok"]), d_ff=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), dense_layers=dense,
                sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window") else None)


def config_from_gguf(meta: dict, tensor_names, *, dtype: str, load_tensor=None) -> ModelConfig:
    """llama.cpp's qwen3moe: every layer sparse, the top-k weights renormalised (its graph
    always normalises them for this architecture)."""
    cfg = llama.config_from_gguf(meta, tensor_names, dtype=dtype, load_tensor=load_tensor)
    arch = meta["general.architecture"]
    return _moe(cfg, n_experts=int(meta[f"{arch}.expert_count"]), k=int(meta[f"{arch}.expert_used_count"]),
                d_ff=int(meta[f"{arch}.expert_feed_forward_length"]), norm_topk_prob=True)

FAMILY = ModelFamily(
    name="qwen3_moe", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, gguf_architectures=GGUF_ARCHITECTURES,
    config_from_gguf=config_from_gguf, gguf_config_tensors=GGUF_CONFIG_TENSORS,
)
