"""gpt-oss (``GptOssForCausalLM``): Llama-shaped attention with biases and learned attention
sinks, alternating sliding-window and full layers, YaRN rotary, and a mixture of clamped-SwiGLU
experts with biases.

* Attention: q/k/v/o projections with biases; each query head has a learned sink, one more
  logit in its softmax denominator that weighs no value (``layers.attend_layer``'s ``sinks``).
  The layers ``layer_types`` names "sliding_attention" see the last ``sliding_window``
  positions and keep only those in the paged cache; the others see everything.
* Experts: the router (with a bias) keeps each token's top k logits and softmaxes over them;
  each expert computes ``(up + 1) * gate * sigmoid(alpha * gate)`` with gate clamped above at
  ``limit`` and up to +-limit, every projection with a bias (``models.moe``).
* Checkpoints store each layer's experts fused: ``gate_up_proj`` [E, D, 2F] with gate and up
  in alternating columns, ``down_proj`` [E, F, D], either as floats or as MXFP4 blocks and
  scales (``jaxinfer.mxfp4``), dequantized when loaded (``hf_read``).

On the native CPU attention kernels (``cpu_kernels.paged_rows``, ``prefill_row``), which take
no sinks, every layer reads its pages through the packed step's XLA readers instead
(``models.packed``); on TPU/GPU the ragged and the paged decode kernels take the sinks
(``dispatch.paged_path``).

weights = {"embed": [V, D], "layers": [one dict per layer: Llama's attention weights with
           bq, bk, bv, "bo" [D], "sinks" [N], "mlp_norm" [D], "moe": the block's weights with
           router and expert biases], "final_norm": [D], "lm_head": [D, V] (untied only)}
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import mxfp4
from jaxinfer.config import ModelConfig, RopeConfig, yarn_or_default_rope
from jaxinfer.errors import CheckpointError
from jaxinfer.models import llama, moe
from jaxinfer.models.family import LayerAt, ModelFamily, decoder, layer_loop
from jaxinfer.models.layers import attend_layer, dot, dot_many, rms_norm
from jaxinfer.models.llama import embed, unembed  # noqa: F401 (the family's embed / unembed)
from jaxinfer.specs import WeightSpec

_DENSE_MLP = ("w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """The clamped SwiGLU experts: gate clamped above at swiglu_limit, up to +-swiglu_limit,
    (up + 1) * gate * sigmoid(swiglu_alpha * gate)."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def weight_specs(cfg: ModelConfig) -> dict:
    """Llama's declarations (with q/k/v biases) plus the output bias and the sinks, and the MoE
    block with router and expert biases in place of the dense MLP."""
    specs = llama.weight_specs(dataclasses.replace(cfg, qkv_bias=True))
    layer = {k: v for k, v in specs["layers"][0].items() if k not in _DENSE_MLP} | {
        "bo": WeightSpec((cfg.d_model,), ("embed",), "zeros"),
        "sinks": WeightSpec((cfg.n_heads,), ("q_heads",), "zeros"),
        "moe": moe.weight_specs(cfg.d_model, cfg.n_experts, cfg.moe_d_ff, expert_bias=True, router_bias=True),
    }
    return specs | {"layers": [layer] * cfg.n_layers}


def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache): attention with sinks, the MoE block."""
    cfg, i, own = at.cfg, at.i, at.cfg.family_config
    with jax.named_scope(f"layer{i}/attention"):
        x, cache = attention_block(w, x, cache, at.j, at.positions, at.start, at.rope(), cfg=cfg, layer=i,
                                   read_cache=at.read_cache)
    with jax.named_scope(f"layer{i}/mlp"):
        route = topk_softmax(cfg.n_experts_per_tok)
        glu = clamped_swiglu(own.swiglu_alpha, own.swiglu_limit)
        x = x + moe.moe_mlp(rms_norm(x, w["mlp_norm"], cfg.norm_eps), w["moe"], route=route, glu=glu)
    return x, cache


decoder_layers = layer_loop(layer)
forward = decoder(embed, decoder_layers)


def attention_block(w: dict, x: jax.Array, cache, j: int, positions, start, rope, *, cfg: ModelConfig, layer: int,
                    read_cache: bool = True):
    """x [B, T, D] + the attention of model layer ``layer`` (cache layer j) -> (x, cache)."""
    h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
    q, k, v = dot_many(h, ("BTD,DNH->BTNH", w["wq"]), ("BTD,DKH->BTKH", w["wk"]), ("BTD,DKH->BTKH", w["wv"]))
    q, k, v = q + w["bq"].astype(q.dtype), k + w["bk"].astype(k.dtype), v + w["bv"].astype(v.dtype)
    o, cache = attend_layer(cache, j, q, k, v, positions, start, rope, read_cache=read_cache,
                            scale=cfg.head_dim**-0.5, window=cfg.layer_window(layer),
                            sinks=w["sinks"].astype(jnp.float32))
    return x + dot("BTNH,NHD->BTD", o, w["wo"]) + w["bo"].astype(x.dtype), cache


def topk_softmax(k: int) -> moe.Route:
    """gpt-oss's router: the k largest logits, softmaxed among themselves."""
    def route(logits: jax.Array, w: dict) -> tuple[jax.Array, jax.Array]:
        del w
        top, experts = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)

    return route


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's expert activation: (up + 1) * gate * sigmoid(alpha * gate), gate clamped above
    at limit and up to [-limit, limit]."""
    def glu(gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))

    return glu


# Where each weight lives: our path -> (HF name, GGUF name, transpose). Experts are stored
# [E, in, out] already. A name ending in ":gate" / ":up" is the even / odd columns of the fused
# tensor before the colon (``hf_read``).
_EXPERTS = "model.layers.{i}.mlp.experts."
CHECKPOINT_NAMES = {k: v for k, v in llama.CHECKPOINT_NAMES.items() if k not in {("layers", n) for n in _DENSE_MLP}} | {
    ("layers", "bo"): ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias", False),
    ("layers", "sinks"): ("model.layers.{i}.self_attn.sinks", "blk.{i}.attn_sinks.weight", False),
    ("layers", "mlp_norm"): ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight",
                             False),
    ("layers", "moe", "router"): ("model.layers.{i}.mlp.router.weight", "blk.{i}.ffn_gate_inp.weight", True),
    ("layers", "moe", "router_bias"): ("model.layers.{i}.mlp.router.bias", "blk.{i}.ffn_gate_inp.bias", False),
    ("layers", "moe", "w_gate"): (_EXPERTS + "gate_up_proj:gate", "blk.{i}.ffn_gate_exps.weight", False),
    ("layers", "moe", "w_up"): (_EXPERTS + "gate_up_proj:up", "blk.{i}.ffn_up_exps.weight", False),
    ("layers", "moe", "w_down"): (_EXPERTS + "down_proj", "blk.{i}.ffn_down_exps.weight", False),
    ("layers", "moe", "b_gate"): (_EXPERTS + "gate_up_proj_bias:gate", "blk.{i}.ffn_gate_exps.bias", False),
    ("layers", "moe", "b_up"): (_EXPERTS + "gate_up_proj_bias:up", "blk.{i}.ffn_up_exps.bias", False),
    ("layers", "moe", "b_down"): (_EXPERTS + "down_proj_bias", "blk.{i}.ffn_down_exps.bias", False),
}

HF_ARCHITECTURES = frozenset({"GptOssForCausalLM"})


def _fused(name: str) -> tuple[str, str]:
    """A checkpoint name as (stored tensor, "gate" | "up" | "")."""
    base, _, part = name.partition(":")
    return base, part


def _quantizable(base: str) -> bool:
    """Expert projections, which a checkpoint may store as MXFP4 blocks and scales."""
    return ".mlp.experts." in base and base.endswith("_proj")


def hf_sources(name: str) -> tuple[str, ...]:
    """The stored tensors checkpoint name ``name`` may be read from."""
    base, _ = _fused(name)
    return (base, base + "_blocks", base + "_scales") if _quantizable(base) else (base,)


def hf_read(name: str, get) -> np.ndarray | None:
    """Checkpoint name -> its array (``get``: stored name -> array or None), or None where
    absent: the stored tensor, an expert projection dequantized from MXFP4 (stored
    [E, out, in/32, 16], read as [E, in, out]), and a ":gate" / ":up" name its tensor's even /
    odd columns (transformers' ``gate_up[..., ::2]``, ``[..., 1::2]``)."""
    base, part = _fused(name)
    a = get(base)
    if a is None and _quantizable(base):
        blocks, scales = get(base + "_blocks"), get(base + "_scales")
        if (blocks is None) != (scales is None):
            raise CheckpointError(f"MXFP4 tensor {base!r}: the checkpoint has its "
                                  f"{'blocks' if scales is None else 'scales'} but not its "
                                  f"{'scales' if scales is None else 'blocks'}")
        if blocks is not None:
            a = np.swapaxes(mxfp4.dequantize(blocks, scales, name=base), -1, -2)
    if a is None or not part:
        return a
    return a[..., 0::2] if part == "gate" else a[..., 1::2]


def rope_from_hf(hf: dict) -> RopeConfig:
    """Plain or YaRN rotary from ``rope_parameters`` (or the older ``rope_theta`` +
    ``rope_scaling``)."""
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(rs.get("rope_theta", hf.get("rope_theta", 150000.0)))
    return yarn_or_default_rope(rs, theta=theta, max_position=hf["max_position_embeddings"], family="gpt-oss")


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    n_layers, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    window = hf.get("sliding_window")
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    kinds = llama.sliding_kinds(types, n_layers, window)
    if not hf.get("attention_bias", True):
        raise CheckpointError("gpt-oss with attention_bias=false is not supported")
    return ModelConfig(
        family="gpt_oss",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_ff=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope=rope_from_hf(hf),
        max_position=int(hf.get("max_position_embeddings", 131072)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True,
        dtype=dtype,
        name=hf.get("_name_or_path", "") or hf.get("model_type", ""),
        layer_kinds=kinds,
        sliding_window=int(window) if kinds else None,
        n_experts=int(hf["num_local_experts"]),
        n_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_d_ff=int(hf["intermediate_size"]),
        family_config=GptOssConfig(swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                                   swiglu_limit=float(hf.get("swiglu_limit", 7.0))),
    )


FAMILY = ModelFamily(
    name="gpt_oss", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, hf_sources=hf_sources, hf_read=hf_read,
    config_class=GptOssConfig,
)
