"""The mixture-of-experts MLP block every MoE family shares (weight declarations and compute).

weights = {"router": [D, E], "w_gate": [E, D, F], "w_up": [E, D, F], "w_down": [E, F, D],
           optional "router_bias": [E], "b_gate", "b_up": [E, F], "b_down": [E, D]}

A family supplies two functions, so its differences stay in its own file:

* a router ``route(logits f32[M, E], w) -> (weights f32[M, k], experts i32[M, k])`` over the
  router's logits (``w``: the block's weights, for a router with parameters of its own, such
  as DeepSeek-V3's correction bias, declared beside "router" without the "expert" axis so
  every device keeps them whole); ``softmax_topk`` is Mixtral's and Qwen3-MoE's;
* a gated activation ``glu(gate, up) -> h`` (``swiglu`` by default; gpt-oss clamps its own).

Compute is proportional to the experts used: the T*k (token, expert) pairs are sorted by
expert (fixed shape: T*k rows), each projection is one grouped matmul over the sorted rows
(``dispatch.grouped_matmul``: the Pallas kernel on TPU/GPU, on CPU a loop that reads only the
experts with rows; ``jax.lax.ragged_dot`` is the reference), and the rows go back to their
tokens, summed with their routing weights. No loop over all experts, no dense expert einsum.

On a mesh (``sharding.place_experts``) the expert weights arrive as ``sharding.Placed`` and
the expert compute runs inside ``shard_map`` over the model axis: every device sorts the same
(replicated) routing, multiplies the rows by the experts it holds (expert parallelism) or by
its columns of every expert (tensor parallelism), and one all-reduce sums the parts. No
device gathers another's expert weights. The grouped matmul's Pallas kernel, which XLA cannot
partition, thus runs per shard as it is.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxinfer import dispatch
from jaxinfer.einsum import einsum
from jaxinfer.models.layers import dot, silu
from jaxinfer.quant import QuantArray, QuantScheme
from jaxinfer.sharding import Placed, per_model_shard
from jaxinfer.specs import WeightSpec

Route = Callable[[jax.Array, dict], tuple[jax.Array, jax.Array]]
# the expert weights, in the order the block hands them to shard_map
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def weight_specs(d_model: int, n_experts: int, d_ff: int, *, expert_bias: bool = False,
                 router_bias: bool = False) -> dict:
    """The block's weights. Experts carry the "expert" logical axis (split whole under expert
    parallelism) and "expert_mlp" for their width (split under tensor parallelism); each is
    quantized per expert and output channel (its expert axis is not contracted). The router
    stays float: its top-k picks the experts, and a rounding there would change which."""
    D, E, F = d_model, n_experts, d_ff
    specs = {
        "router": WeightSpec((D, E), ("embed", None)),
        "w_gate": WeightSpec((E, D, F), ("expert", "embed", "expert_mlp"), contract=("embed",)),
        "w_up": WeightSpec((E, D, F), ("expert", "embed", "expert_mlp"), contract=("embed",)),
        "w_down": WeightSpec((E, F, D), ("expert", "expert_mlp", "embed"), contract=("expert_mlp",)),
    }
    if router_bias:
        specs["router_bias"] = WeightSpec((E,), (None,), "zeros")
    if expert_bias:  # split with whole experts, never by width (the block cuts them to its columns)
        specs["b_gate"] = WeightSpec((E, F), ("expert", None), "zeros")
        specs["b_up"] = WeightSpec((E, F), ("expert", None), "zeros")
        specs["b_down"] = WeightSpec((E, D), ("expert", "embed"), "zeros")
    return specs


# ----------------------------------------------------------------------------- routers
def softmax_topk(k: int, *, renormalize: bool) -> Route:
    """Softmax over all experts, the k largest kept; ``renormalize``: rescaled to sum to 1
    (Mixtral always, which equals a softmax over the top-k logits; Qwen3-MoE with
    ``norm_topk_prob``)."""
    def route(logits: jax.Array, w: dict) -> tuple[jax.Array, jax.Array]:
        del w
        top, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        if renormalize:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        return top, experts.astype(jnp.int32)

    return route


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return silu(gate) * up


# ----------------------------------------------------------------------------- the block
def moe_mlp(x: jax.Array, w: dict, *, route: Route, glu: Callable = swiglu) -> jax.Array:
    """The block over x [B, T, D] -> [B, T, D] in x.dtype."""
    B, T, D = x.shape
    E = w["router"].shape[-1]
    with jax.named_scope("router"):
        # a router declared float32 (DeepSeek-V3's, as transformers keeps it) scores float32 inputs
        xr = x.astype(jnp.float32) if w["router"].dtype == jnp.float32 else x
        logits = dot("BTD,DE->BTE", xr, w["router"]).astype(jnp.float32)
        if "router_bias" in w:
            logits = logits + w["router_bias"].astype(jnp.float32)
        weights, experts = route(logits.reshape(B * T, E), w)
    with jax.named_scope("experts"):
        y = routed_experts(x.reshape(B * T, D), weights, experts, {n: w[n] for n in EXPERT_WEIGHTS if n in w},
                           glu=glu, n_experts=E)
    return y.reshape(B, T, D)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w: dict, *, glu: Callable,
                   n_experts: int) -> jax.Array:
    """Tokens x [M, D] through their k experts each (experts i32[M, k], routing weights
    f32[M, k]) -> [M, D]; on a mesh (``Placed`` weights) under ``shard_map`` (module doc)."""
    placed = [v for v in w.values() if isinstance(v, Placed)]
    if not placed:
        return _expert_rows(x, weights, experts, w, glu=glu, n_experts=n_experts, axis=None)
    names = tuple(w)
    values = [w[n].value if isinstance(w[n], Placed) else w[n] for n in names]
    specs = [w[n].in_specs if isinstance(w[n], Placed) else PartitionSpec() for n in names]
    split = any(v.split for v in placed)

    def local(x, weights, experts, *values):
        return _expert_rows(x, weights, experts, dict(zip(names, values)), glu=glu, n_experts=n_experts,
                            axis="model" if split else None)

    rep = PartitionSpec()
    # (inside the data-parallel engine's shard_map, manual over "data", on that context's mesh)
    return per_model_shard(local, placed[0].mesh, (rep, rep, rep, *specs), rep)(x, weights, experts, *values)


def _groups_held(w) -> int:
    """How many experts a (local) expert weight holds: a float [E, I, O], or a QuantArray
    stored [I, E*O] (whose static shape is the whole weight's; its arrays are this device's)."""
    if isinstance(w, QuantArray):
        return w.scale.shape[-1] // w.shape[-1]
    return w.shape[0]


def _rows_held(w) -> int:
    """The contracted size a (local) expert weight holds: I of a float [E, I, O], or of a
    QuantArray's [I, E*O] (int4: two rows a byte)."""
    if isinstance(w, QuantArray):
        return w.values.shape[0] * (2 if w.scheme == QuantScheme.INT4 else 1)
    return w.shape[1]


def _bias_rows(b: jax.Array, row_expert: jax.Array, index, width: int) -> jax.Array:
    """Each sorted row's bias from b [E, F] (whole experts: F never split) cut to the
    ``width`` columns this device computes (its part of F under tensor parallelism)."""
    rows = jnp.take(b, row_expert, axis=0)
    return jax.lax.dynamic_slice_in_dim(rows, index * width, width, axis=1) if rows.shape[1] > width else rows


def _expert_rows(x, weights, experts, w: dict, *, glu, n_experts: int, axis: str | None):
    """The block's expert compute on one device (all of it, or this device's part when
    ``axis`` names the mesh axis the parts are summed over)."""
    M, k = experts.shape
    flat = experts.reshape(-1)  # i32[M*k]
    order = jnp.argsort(flat, stable=True)  # sorted row -> (token, slot) pair
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)  # rows of each expert
    xs = jnp.take(x, order // k, axis=0)  # [M*k, D] rows sorted by expert
    held = _groups_held(w["w_gate"])
    index = jax.lax.axis_index(axis) if axis is not None else 0
    offset = index * held if held < n_experts else 0  # this device's first expert
    row_expert = None
    if "b_gate" in w or "b_down" in w:  # each sorted row's expert, counted within the held ones
        row_expert = jnp.clip(jnp.take(flat, order) - offset, 0, held - 1)
    gate = dispatch.grouped_matmul(xs, w["w_gate"], sizes, group_offset=offset)
    up = dispatch.grouped_matmul(xs, w["w_up"], sizes, group_offset=offset)
    if "b_gate" in w:
        gate = gate + _bias_rows(w["b_gate"], row_expert, index, gate.shape[1]).astype(gate.dtype)
        up = up + _bias_rows(w["b_up"], row_expert, index, up.shape[1]).astype(up.dtype)
    h = glu(gate, up)
    f_down = _rows_held(w["w_down"])
    if f_down < h.shape[1]:
        # tensor parallel with quantized experts: gate/up stay whole (a column block of an
        # expert is not contiguous in their [D, E*F] storage), w_down holds this device's F rows
        h = jax.lax.dynamic_slice_in_dim(h, index * f_down, f_down, axis=1)
    y = dispatch.grouped_matmul(h, w["w_down"], sizes, group_offset=offset)  # [M*k, D], 0 off this device
    if "b_down" in w:
        # whole experts here: add each held row's bias; experts split by columns: one device adds it
        owner = (index == 0) if held == n_experts else True
        start = jnp.sum(jnp.where(jnp.arange(n_experts) < offset, sizes, 0))
        mine = (jnp.arange(M * k) >= start) & (jnp.arange(M * k) < start + jnp.sum(
            jax.lax.dynamic_slice_in_dim(sizes, offset, held)))
        b = jnp.take(w["b_down"], row_expert, axis=0).astype(y.dtype)
        y = y + jnp.where((mine & owner)[:, None], b, jnp.zeros((), y.dtype))
    back = jnp.zeros_like(order).at[order].set(jnp.arange(M * k, dtype=order.dtype))  # (token, slot) -> sorted row
    y = jnp.take(y, back, axis=0).reshape(M, k, -1)
    out = einsum("MKD,MK->MD", y.astype(jnp.float32), weights.astype(jnp.float32))
    if axis is not None:
        out = jax.lax.psum(out, axis)
    return out.astype(x.dtype)
