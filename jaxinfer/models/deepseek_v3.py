"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention and a mixture of experts
with grouped sigmoid routing and shared experts.

A layer, as transformers computes it:
  h = attn_norm(x)
  q = wq_b(q_a_norm(wq_a(h)))  [B, T, N, Dn + R]   (or wq(h) without q_lora_rank)
  c, k_rope = wkv_a(h)         [B, T, C], [B, T, R]  (one latent per token, shared by all heads)
  c = kv_a_norm(c); q_rope, k_rope rotated (interleaved pairs, YaRN frequencies)
  head n: key [wkv_b_k[n] c | k_rope], value wkv_b_v[n] c; softmax scale (Dn + R)^-0.5 * mscale^2
  x = x + wo(attention)
  x = x + MLP(mlp_norm(x)): a dense SwiGLU in the first ``dense_layers``, else shared experts
      plus routed experts (``route`` below)

The cache holds the latent [c | k_rope] per token (C + R values per layer), not per-head keys
and values, and attention runs in the absorbed form: each head's q_nope goes through its key
up-projection into latent space, q = [q_nope @ wkv_b_k[n]^T | q_rope], so its score against a
token is q . [c | k_rope]; all heads attend over the one latent head (MQA) and the weighted
latents go out through each head's value up-projection. The same for prefill and decode
(``layers.attend_latent``: always the XLA attention; see ``models.packed``).

weights = {"embed": [V, D], "layers": [one dict per layer], "final_norm": [D], "lm_head": [D, V]}
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig, RopeKind, yarn_mscale, yarn_or_default_rope
from jaxinfer.einsum import einsum
from jaxinfer.errors import CheckpointError
from jaxinfer.models import moe
from jaxinfer.models.family import LayerAt, ModelFamily, decoder, layer_loop
from jaxinfer.models.layers import (
    apply_rope,
    attend_latent,
    dot,
    gated_mlp,
    rms_norm,
    silu,
)
from jaxinfer.models.llama import embed, unembed  # noqa: F401 (the family's embed / unembed)
from jaxinfer.specs import WeightSpec

@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """DeepSeek-V3's own knobs (the latent attention's cache shape stays in ModelConfig, which
    the engine reads): queries through a rank-q_lora_rank bottleneck (0: one projection);
    experts in n_expert_groups groups, tokens picking from the topk_expert_groups best groups,
    routing weights times routed_scaling_factor; n_shared_experts experts' width of a dense MLP
    every token goes through beside them."""

    q_lora_rank: int = 0
    n_expert_groups: int = 1
    topk_expert_groups: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0


def weight_specs(cfg: ModelConfig) -> dict:
    D, N, V = cfg.d_model, cfg.n_heads, cfg.vocab_size
    C, R, Dn, Dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    layer = {
        "attn_norm": WeightSpec((D,), ("embed",), "ones"),
        "wkv_a": WeightSpec((D, C + R), ("embed", "latent"), contract=("embed",)),
        "kv_a_norm": WeightSpec((C,), ("kv_lora",), "ones"),
        # each head's key (first Dn) and value (last Dv) up-projections from the latent; sliced
        # apart in the absorbed attention, so kept float (never quantized)
        "wkv_b": WeightSpec((C, N, Dn + Dv), ("kv_lora", "q_heads", "head_dim")),
        "wo": WeightSpec((N, Dv, D), ("q_heads", "head_dim", "embed"), contract=("q_heads", "head_dim")),
        "mlp_norm": WeightSpec((D,), ("embed",), "ones"),
    }
    own = cfg.family_config
    if own.q_lora_rank:
        Q = own.q_lora_rank
        layer |= {"wq_a": WeightSpec((D, Q), ("embed", "q_lora"), contract=("embed",)),
                  "q_a_norm": WeightSpec((Q,), ("q_lora",), "ones"),
                  "wq_b": WeightSpec((Q, N, Dn + R), ("q_lora", "q_heads", "head_dim"), contract=("q_lora",))}
    else:
        layer["wq"] = WeightSpec((D, N, Dn + R), ("embed", "q_heads", "head_dim"), contract=("embed",))
    dense = layer | _mlp_specs(D, cfg.d_ff)
    Fs = cfg.moe_d_ff * own.n_shared_experts
    block = moe.weight_specs(D, cfg.n_experts, cfg.moe_d_ff)
    # the router and its correction bias stay float32, as transformers keeps them
    block |= {"router": WeightSpec((D, cfg.n_experts), ("embed", None), dtype="float32"),
              "score_bias": WeightSpec((cfg.n_experts,), (None,), "zeros", dtype="float32")}
    sparse = layer | {"moe": block} | ({"shared": _mlp_specs(D, Fs)} if Fs else {})
    specs = {
        "embed": WeightSpec((V, D), ("vocab", "embed"), contract=("embed",)),
        "layers": [dense if i in cfg.dense_layers else sparse for i in range(cfg.n_layers)],
        "final_norm": WeightSpec((D,), ("embed",), "ones"),
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = WeightSpec((D, V), ("embed", "vocab"), contract=("embed",))
    return specs


def _mlp_specs(D: int, F: int) -> dict:
    return {"w_gate": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
            "w_up": WeightSpec((D, F), ("embed", "mlp"), contract=("embed",)),
            "w_down": WeightSpec((F, D), ("mlp", "embed"), contract=("mlp",))}


# ----------------------------------------------------------------------------- routing
def grouped_sigmoid_topk(cfg: ModelConfig) -> moe.Route:
    """DeepSeek-V3's router: sigmoid scores; the correction bias ``score_bias`` shifts them
    for choosing only. The experts fall in n_expert_groups groups, each scored by the sum of
    its two best; the k experts come from the topk_expert_groups best groups. Their weights
    are the unbiased scores, rescaled to sum to 1 with norm_topk_prob, then times
    routed_scaling_factor."""
    own = cfg.family_config
    E, G, k = cfg.n_experts, own.n_expert_groups, cfg.n_experts_per_tok

    def route(logits: jax.Array, w: dict) -> tuple[jax.Array, jax.Array]:
        scores = jax.nn.sigmoid(logits)  # f32[M, E]
        choice = scores + w["score_bias"].astype(jnp.float32)
        M = choice.shape[0]
        group_scores = jax.lax.top_k(choice.reshape(M, G, E // G), 2)[0].sum(axis=-1)  # f32[M, G]
        _, groups = jax.lax.top_k(group_scores, own.topk_expert_groups)
        keep = jnp.zeros((M, G), bool).at[jnp.arange(M)[:, None], groups].set(True)
        choice = jnp.where(jnp.repeat(keep, E // G, axis=1), choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(scores, experts, axis=1)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return weights * own.routed_scaling_factor, experts.astype(jnp.int32)

    return route


# ----------------------------------------------------------------------------- forward
def layer(w: dict, x: jax.Array, cache, at: LayerAt):
    """One layer over hidden x [B, T, D] -> (x, cache): latent attention (rotary over the
    qk_rope_head_dim roped dims), then the routed experts beside the shared ones, or a dense
    SwiGLU MLP on the first layers."""
    cfg, i = at.cfg, at.i
    with jax.named_scope(f"layer{i}/latent_attention"):
        rope = at.rope(cfg.rope, cfg.qk_rope_head_dim)
        x, cache = attention_block(w, x, cache, at.j, at.positions, at.start, rope, cfg=cfg, read_cache=at.read_cache)
    with jax.named_scope(f"layer{i}/mlp"):
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        if "moe" in w:
            y = moe.moe_mlp(h, w["moe"], route=grouped_sigmoid_topk(cfg))
            if "shared" in w:
                y = y + gated_mlp(h, w["shared"]["w_gate"], w["shared"]["w_up"], w["shared"]["w_down"], silu)
        else:
            y = gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], silu)
        x = x + y
    return x, cache


decoder_layers = layer_loop(layer)
forward = decoder(embed, decoder_layers)


def attention_block(w: dict, x: jax.Array, cache, j: int, positions, start, rope, *, cfg: ModelConfig,
                    read_cache: bool = True):
    """x [B, T, D] + the latent attention of cache layer j -> (x, cache) (module doc)."""
    C, Dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
    if "wq_a" in w:
        q = rms_norm(dot("BTD,DQ->BTQ", h, w["wq_a"]), w["q_a_norm"], cfg.norm_eps)
        q = dot("BTQ,QNH->BTNH", q, w["wq_b"])
    else:
        q = dot("BTD,DNH->BTNH", h, w["wq"])
    q_nope, q_rope = q[..., :Dn], q[..., Dn:]  # [B, T, N, Dn], [B, T, N, R]
    ckv = dot("BTD,DL->BTL", h, w["wkv_a"])
    c = rms_norm(ckv[..., :C], w["kv_a_norm"], cfg.norm_eps)  # [B, T, C]
    k_rope = ckv[:, :, None, C:]  # [B, T, 1, R]
    q_rope, k_rope = apply_rope(_pairs_split(q_rope), rope), apply_rope(_pairs_split(k_rope), rope)
    w_uk, w_uv = w["wkv_b"][..., :Dn], w["wkv_b"][..., Dn:]  # [C, N, Dn], [C, N, Dv]
    q_latent = einsum("BTNd,CNd->BTNC", q_nope, w_uk.astype(q_nope.dtype))
    qa = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)  # [B, T, N, C + R]
    latent = jnp.concatenate([c[:, :, None, :], k_rope.astype(c.dtype)], axis=-1)  # [B, T, 1, C + R]
    o, cache = attend_latent(cache, j, qa, latent, positions, start, read_cache=read_cache, scale=cfg.attn_scale)
    o = einsum("BTNC,CNv->BTNv", o[..., :C], w_uv.astype(o.dtype))  # [B, T, N, Dv]
    return x + dot("BTNv,NvD->BTD", o, w["wo"]), cache


def _pairs_split(x: jax.Array) -> jax.Array:
    """DeepSeek's interleaved rotary pairs (x0, x1), (x2, x3), ... as the half-split layout
    ``apply_rope`` rotates: [x0, x2, ..., x1, x3, ...] (transformers' rope_interleave does the
    same; q and k permuted alike leave every score as it is)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


# ----------------------------------------------------------------------------- checkpoints
def _mlp_names(ours: tuple, theirs: str) -> dict:
    return {ours + (n,): (f"model.layers.{{i}}.{theirs}.{p}.weight", None, True)
            for n, p in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))}


# Where each weight lives: our path -> (HF name, GGUF name, transpose). ``{{e}}``: one tensor
# per expert, stacked by the loader (see ``mixtral.CHECKPOINT_NAMES``).
CHECKPOINT_NAMES = {
    ("embed",): ("model.embed_tokens.weight", None, False),
    ("final_norm",): ("model.norm.weight", None, False),
    ("lm_head",): ("lm_head.weight", None, True),
    ("layers", "attn_norm"): ("model.layers.{i}.input_layernorm.weight", None, False),
    ("layers", "wq"): ("model.layers.{i}.self_attn.q_proj.weight", None, True),
    ("layers", "wq_a"): ("model.layers.{i}.self_attn.q_a_proj.weight", None, True),
    ("layers", "q_a_norm"): ("model.layers.{i}.self_attn.q_a_layernorm.weight", None, False),
    ("layers", "wq_b"): ("model.layers.{i}.self_attn.q_b_proj.weight", None, True),
    ("layers", "wkv_a"): ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", None, True),
    ("layers", "kv_a_norm"): ("model.layers.{i}.self_attn.kv_a_layernorm.weight", None, False),
    ("layers", "wkv_b"): ("model.layers.{i}.self_attn.kv_b_proj.weight", None, True),
    ("layers", "wo"): ("model.layers.{i}.self_attn.o_proj.weight", None, True),
    ("layers", "mlp_norm"): ("model.layers.{i}.post_attention_layernorm.weight", None, False),
    ("layers", "moe", "router"): ("model.layers.{i}.mlp.gate.weight", None, True),
    ("layers", "moe", "score_bias"): ("model.layers.{i}.mlp.gate.e_score_correction_bias", None, False),
    ("layers", "moe", "w_gate"): ("model.layers.{i}.mlp.experts.{{e}}.gate_proj.weight", None, True),
    ("layers", "moe", "w_up"): ("model.layers.{i}.mlp.experts.{{e}}.up_proj.weight", None, True),
    ("layers", "moe", "w_down"): ("model.layers.{i}.mlp.experts.{{e}}.down_proj.weight", None, True),
} | _mlp_names(("layers",), "mlp") | _mlp_names(("layers", "shared"), "mlp.shared_experts")

HF_ARCHITECTURES = frozenset({"DeepseekV3ForCausalLM"})
GGUF_ARCHITECTURES = frozenset()

# DeepseekV3Config's defaults, for keys a config.json leaves out
HF_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
               "n_shared_experts": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
               "rope_interleave": True, "num_nextn_predict_layers": 1}


def hf_skipped_prefixes(hf: dict) -> tuple[str, ...]:
    """Tensors a checkpoint carries that the model does not run: the multi-token-prediction
    modules stored as layers num_hidden_layers .. + num_nextn_predict_layers - 1 (as
    transformers, which drops them when loading)."""
    L, mtp = int(hf["num_hidden_layers"]), int(hf.get("num_nextn_predict_layers") or 0)
    return tuple(f"model.layers.{i}." for i in range(L, L + mtp))


def config_from_hf(hf: dict, *, dtype: str) -> ModelConfig:
    hf = HF_DEFAULTS | {k: v for k, v in hf.items() if v is not None or k == "q_lora_rank"}
    if hf.get("attention_bias"):
        raise CheckpointError("DeepSeek-V3 with attention_bias=true is not supported")
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method:
        raise CheckpointError(f"DeepSeek-V3 checkpoints quantized with {method!r} are not supported; "
                              "load a bfloat16 conversion (and quantization=... to quantize it here)")
    rs = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if "rope_theta" not in rs and "rope_theta" in hf:
        rs = rs | {"rope_theta": hf["rope_theta"]}
    max_position = int(hf["max_position_embeddings"])
    rope = yarn_or_default_rope(rs, theta=float(rs.get("rope_theta", 10000.0)), max_position=max_position,
                                family="DeepSeek-V3")
    Dn, R = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    # transformers scales the scores by (Dn + R)^-0.5, times mscale(factor, mscale_all_dim)^2
    # under any rope scaling: expressed as the scalar whose inverse square root that is
    mscale_all = rs.get("mscale_all_dim")
    m = yarn_mscale(rope.factor, mscale_all) if rope.kind != RopeKind.DEFAULT and mscale_all else 1.0
    if not hf.get("rope_interleave", True):
        raise CheckpointError("DeepSeek-V3 with rope_interleave=false is not supported")
    E, G = int(hf["n_routed_experts"]), int(hf.get("n_group") or 1)
    if E % G:
        raise CheckpointError(f"n_group={G} must divide n_routed_experts={E}")
    n_heads = int(hf["num_attention_heads"])
    return ModelConfig(
        family="deepseek_v3",
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=1,  # the one latent head every query head attends over
        head_dim=Dn + R,
        d_ff=int(hf["intermediate_size"]),
        norm_eps=float(hf["rms_norm_eps"]),
        rope=rope,
        max_position=max_position,
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        dtype=dtype,
        name=hf.get("_name_or_path", "") or hf.get("model_type", ""),
        query_pre_attn_scalar=(Dn + R) / m**4,
        n_experts=E,
        n_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_d_ff=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        dense_layers=tuple(range(min(int(hf["first_k_dense_replace"]), int(hf["num_hidden_layers"])))),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_rope_head_dim=R,
        qk_nope_head_dim=Dn,
        v_head_dim=int(hf["v_head_dim"]),
        family_config=DeepseekV3Config(
            q_lora_rank=int(hf["q_lora_rank"] or 0), n_expert_groups=G,
            topk_expert_groups=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf["routed_scaling_factor"]), n_shared_experts=int(hf["n_shared_experts"] or 0)),
    )


FAMILY = ModelFamily(
    name="deepseek_v3", weight_specs=weight_specs, embed=embed, decoder_layers=decoder_layers, forward=forward,
    unembed=unembed, checkpoint_names=CHECKPOINT_NAMES,
    hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf, hf_skipped_prefixes=hf_skipped_prefixes,
    gguf_architectures=GGUF_ARCHITECTURES, config_class=DeepseekV3Config,
)
