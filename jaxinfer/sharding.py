"""Sharding by logical axes: one rules table maps logical axis names to mesh axes.

The mesh has three named axes: ``data`` (replicas), ``stage`` (pipeline stages) and ``model``
(tensor parallelism). The mesh is always passed in explicitly. ``spec_for`` refuses a rules table that maps two
dimensions of one array to the same mesh axis, and silently replicates a dimension the
mesh axis does not divide (small models on big meshes), which keeps every config loadable.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.quant import QuantArray, QuantScheme
from jaxinfer.specs import is_spec

# Megatron-style tensor parallelism over "model", batch over "data", and the stacked layer
# axis of a pipeline's weights and page pools ([stages, ...], one layer of each stage per
# array; see ``engine.pipeline``) over "stage". A mixture-of-experts layer's experts
# ([E, D, F], axes "expert", "embed", "expert_mlp") split each expert's width like a dense
# MLP's; ``EXPERT_PARALLEL_RULES`` splits whole experts instead.
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("vocab", "model"),
    ("q_heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("embed", None),
    ("head_dim", None),
    ("layers", "stage"),
    ("expert", None),
    ("expert_mlp", "model"),
)
# Expert parallelism (``LLM(enable_expert_parallel=True)``, as vLLM's): each device of the
# model axis holds E / size whole experts; attention keeps its tensor parallelism.
EXPERT_PARALLEL_RULES = tuple((a, {"expert": "model", "expert_mlp": None}.get(a, m)) for a, m in DEFAULT_RULES)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    rules: tuple[tuple[str, str | None], ...] = DEFAULT_RULES

    def mesh_axis(self, logical: str | None) -> str | None:
        return dict(self.rules).get(logical) if logical else None


def rules_for(expert_parallel: bool) -> ShardingRules:
    return ShardingRules(EXPERT_PARALLEL_RULES if expert_parallel else DEFAULT_RULES)


def spec_for(shape, axes, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> PartitionSpec:
    used: set[str] = set()
    out = []
    for dim, name in zip(shape, axes):
        m = rules.mesh_axis(name)
        if m is not None and m in used:
            raise ValueError(f"logical axes {axes} map mesh axis {m!r} twice")
        if m is not None and (m not in mesh.shape or dim % mesh.shape[m]):
            m = None  # not divisible (or not in this mesh): replicate this dimension
        if m is not None:
            used.add(m)
        out.append(m)
    return PartitionSpec(*out)


def weight_shardings(specs, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """NamedSharding for every declared weight, from its logical axes."""
    return jax.tree.map(lambda s: NamedSharding(mesh, spec_for(s.shape, s.axes, mesh, rules)), specs, is_leaf=is_spec)


def quant_shardings(qa: QuantArray, float_sharding: NamedSharding) -> QuantArray:
    """Where each part of a quantized weight goes, from its float weight's sharding: a
    QuantArray with NamedSharding leaves (the same pytree, so ``jax.device_put(qa, that)``).

    A QuantArray stores the matrix [I, O]: the contracted axes flattened into I, the free
    ones into O, each in the weight's order. A flattened side keeps its float axis's mesh
    axis when that axis is the side's leading one (so each device's rows or columns stay one
    contiguous block): wq's O = (q_heads, head_dim) splits with q_heads, wo's I = (q_heads,
    head_dim) and w_down's I = mlp split with theirs. The per-channel scale f32[O] and w8a8's
    smoothing f32[I] follow their side; int4's values [I/2, O] and scale [I/group, O] split I
    by whole groups, so only when the device count divides the group count."""
    spec = tuple(float_sharding.spec) + (None,) * (len(qa.shape) - len(float_sharding.spec))
    mesh = float_sharding.mesh

    def side(axes) -> str | None:
        if any(spec[a] is not None for a in axes[1:]):
            return None  # sharded on an inner axis: a device's part would not be one block
        return spec[axes[0]]

    i_ax, o_ax = side(qa.contract), side(qa.free)
    if qa.scheme == QuantScheme.INT4 and i_ax is not None and (qa.in_size // qa.group) % mesh.shape[i_ax]:
        i_ax = None  # a group would straddle two devices
    ns = lambda *s: NamedSharding(mesh, PartitionSpec(*s))  # noqa: E731
    scale = ns(i_ax, o_ax) if qa.scheme == QuantScheme.INT4 else ns(o_ax)
    return dataclasses.replace(qa, values=ns(i_ax, o_ax), scale=scale,
                               smooth=None if qa.smooth is None else ns(i_ax))


MESH_AXES = ("data", "stage", "model")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Placed:
    """A weight with how it lies on the mesh, for code that computes with it inside
    ``shard_map`` (a mixture-of-experts block: each device multiplies the tokens by the
    experts, or the expert columns, it holds, and one all-reduce sums the parts). Inside a
    jitted function arrays no longer say how they are sharded; this says it, statically."""

    value: object  # the weight: a jax.Array or a QuantArray
    mesh: jax.sharding.AbstractMesh = dataclasses.field(metadata={"static": True})
    specs: tuple = dataclasses.field(metadata={"static": True})  # PartitionSpec of each leaf of value

    @property
    def in_specs(self):
        """``shard_map`` in_specs for ``value`` (a pytree of PartitionSpecs like it)."""
        return jax.tree.unflatten(jax.tree.structure(self.value), self.specs)

    @property
    def split(self) -> bool:
        """Whether any part of the weight is split over the model axis."""
        return any("model" in tuple(s) for s in self.specs)


def place_experts(weights, specs, mesh: Mesh):
    """``weights`` with every weight that has an "expert" axis wrapped in ``Placed`` (its
    leaves' shardings as they were loaded), so the mixture-of-experts block runs it under
    ``shard_map`` on ``mesh``; other weights as they are (GSPMD splits those)."""
    def one(spec, w):
        if "expert" not in spec.axes:
            return w
        leaves = jax.tree.leaves(w)
        return Placed(w, mesh.abstract_mesh, tuple(PartitionSpec(*leaf.sharding.spec) for leaf in leaves))

    return jax.tree.map(one, specs, weights, is_leaf=is_spec)


def pipeline_weight_shardings(specs, mesh: Mesh, bounds: tuple[int, ...], rules: ShardingRules = ShardingRules()):
    """Like ``weight_shardings``, but each layer's weights go to its own pipeline stage's
    sub-mesh only (stage s holds layers [bounds[s], bounds[s + 1])); the rest (embedding,
    final norm, LM head) to the whole mesh. With one stage this is ``weight_shardings``."""
    if len(bounds) <= 2:
        return weight_shardings(specs, mesh, rules)
    out = weight_shardings({k: v for k, v in specs.items() if k != "layers"}, mesh, rules)
    stage_of = [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
    out["layers"] = [weight_shardings(layer, stage_mesh(mesh, stage_of[i]), rules)
                     for i, layer in enumerate(specs["layers"])]
    return out


def make_mesh(data: int = 1, model: int | None = None, devices=None, *, stage: int = 1) -> Mesh:
    """A (data, stage, model) mesh over ``devices`` (default: all). Consecutive devices share a
    stage, so tensor parallelism stays within neighbours (one host) and stages span them."""
    devices = list(devices if devices is not None else jax.devices())
    model = model or len(devices) // (data * stage)
    if data * stage * model != len(devices):
        raise ValueError(f"mesh {data=} x {stage=} x {model=} needs {data * stage * model} devices, "
                         f"have {len(devices)}")
    return Mesh(np.array(devices).reshape(data, stage, model), MESH_AXES)


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """The (data, model) sub-mesh of one pipeline stage: where that stage's layers are loaded."""
    return Mesh(mesh.devices[:, stage, :], ("data", "model"))


def kv_heads_axis(mesh, n_kv_heads: int) -> str | None:
    """The mesh axis a page pool's KV heads are split over: "model" when it divides them,
    else None (every device keeps every KV head). ``mesh``: a Mesh or an AbstractMesh."""
    return "model" if n_kv_heads % dict(mesh.shape).get("model", 1) == 0 else None


def per_model_shard(fn, mesh, in_specs, out_specs):
    """``fn`` run per shard of the "model" axis: how a Pallas call, which XLA cannot partition,
    runs on a mesh. ``jax.shard_map`` over every axis of the mesh not already manual (Mosaic
    takes a call only where all of them are; the specs name "model" alone, so the data and
    stage axes, of one device wherever a step runs a kernel, keep the arrays whole). The mesh
    is the one in context when there is one (inside the data-parallel engine's ``shard_map``,
    manual over "data", or a pipeline's, over "stage", a nested one must name it), else
    ``mesh``. Where every axis is manual already (inside a mixture-of-experts block's own
    ``shard_map``) ``fn`` is per shard as it is. Over a mesh of TPU devices the shard_map also
    tells Mosaic the device kind it compiles for (from the mesh, not the default backend)."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and set(context.manual_axes) == set(context.axis_names):
        return fn
    on = mesh if context.empty else context
    free = set(on.axis_names) - set(() if context.empty else context.manual_axes)
    return jax.shard_map(fn, mesh=on, in_specs=in_specs, out_specs=out_specs, axis_names=free, check_vma=False)


def kv_pool_sharding(mesh: Mesh, n_kv_heads: int, *, stacked: bool = False):
    """NamedSharding of a page pool ([P, K, ...], int8 values and scales alike): split over KV
    heads when the model axis divides them, else replicated (each device then keeps every KV
    head and only the query heads are split). stacked: a pipeline's pool slot [stages, P, K,
    ...], whose leading "layers" axis goes where the rules table sends it (the stage axis)."""
    heads = kv_heads_axis(mesh, n_kv_heads)
    if stacked:
        return NamedSharding(mesh, PartitionSpec(ShardingRules().mesh_axis("layers"), None, heads))
    return NamedSharding(mesh, PartitionSpec(None, heads))


def kv_pool_shardings(mesh: Mesh, cfg) -> list:
    """``kv_pool_sharding`` of every layer's pool (a list, as the pools are), from that layer's
    KV heads; None for a layer that has no pool (it attends over another's: ``cfg.kv_source``)."""
    def one(i):
        return kv_pool_sharding(mesh, cfg.layer_kv_heads(i)) if cfg.kv_source(i) == i else None

    return [one(i) for i in range(cfg.n_layers)]


def stage_bounds(n_layers: int, stages: int) -> tuple[int, ...]:
    """Layer boundaries of ``stages`` contiguous pipeline stages: stage s runs layers
    [b[s], b[s + 1]). Uneven counts give the first stages one layer more (30 over 4: 8, 8, 7, 7)."""
    from jaxinfer.errors import InvalidRequest

    if stages < 1:
        raise InvalidRequest(f"pipeline_parallel_size must be >= 1, got {stages}")
    if stages > n_layers:
        raise InvalidRequest(f"pipeline_parallel_size={stages} is larger than the model's {n_layers} layers; "
                             "each stage needs at least one layer")
    per, extra = divmod(n_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + per + (s < extra))
    return tuple(bounds)


def tensor_parallel_plan(cfg, tp: int, *, expert_parallel: bool = False) -> dict:
    """How a model splits over ``tp`` devices, checked: query heads must divide (the attention
    output's all-reduce needs whole heads per device); KV heads are split when they divide,
    else replicated; the MLP and vocabulary are split when they divide, else replicated. A
    mixture of experts splits each expert's width likewise, or with ``expert_parallel`` whole
    experts, which must then divide."""
    from jaxinfer.errors import InvalidRequest

    if tp < 1:
        raise InvalidRequest(f"tensor_parallel_size must be >= 1, got {tp}")
    if cfg.n_heads % tp:
        raise InvalidRequest(f"tensor_parallel_size={tp} must divide the model's {cfg.n_heads} query heads")
    experts = {}
    if expert_parallel and not cfg.n_experts:
        raise InvalidRequest("enable_expert_parallel needs a mixture-of-experts model; this one has no experts")
    if cfg.n_experts and expert_parallel:
        if cfg.n_experts % tp:
            raise InvalidRequest(f"enable_expert_parallel: tensor_parallel_size={tp} must divide the model's "
                                 f"{cfg.n_experts} experts")
        experts = {"experts": "expert parallel", "experts_per_device": cfg.n_experts // tp}
    elif cfg.n_experts:
        experts = {"experts": "split" if cfg.moe_d_ff % tp == 0 else "replicated",
                   "experts_per_device": cfg.n_experts}
    kv = sorted({cfg.layer_kv_heads(i) for i in range(cfg.n_layers)})  # one count, or one per layer kind (Gemma 4)
    split = [k for k in kv if k % tp == 0]
    notes = [f"{k} KV heads split {k // tp} per device" if k % tp == 0 else
             f"{k} KV head(s) do not divide over {tp} devices: every device keeps all of them (KV pools "
             f"replicated), only the {cfg.n_heads} query heads split" for k in kv]
    return experts | {"tensor_parallel_size": tp, "query_heads_per_device": cfg.n_heads // tp,
            "kv_heads": "split" if len(split) == len(kv) else "replicated" if not split else "split where they divide",
            "kv_heads_per_device": cfg.n_kv_heads // tp if cfg.n_kv_heads % tp == 0 else cfg.n_kv_heads,
            "mlp": "split" if cfg.d_ff % tp == 0 else "replicated",
            "vocab": "split" if cfg.vocab_size % tp == 0 else "replicated",
            "kv_note": "; ".join(notes)}
