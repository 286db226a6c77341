"""The engine's device state as one pytree (``EngineState``: the page pools, the per-slot state
and the drafter's pools), which every jitted step takes (donated) and returns; and making it:
pools on one device, split over a mesh's "model" axis, stacked by pipeline stage, or folded
over D replicas (``engine.replicas``: replica d's pages and slots follow replica d - 1's on
the leading axis, split over "data"), and every slot idle, placed as the steps' outputs will be."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer import cache as kv
from jaxinfer.engine.slots import SlotState, make_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EngineState:
    """What the device keeps between steps; the engine holds the only reference. With D
    replicas every array is folded: [D * P, ...] pools, [D * S, ...] slots (``engine.replicas``)."""

    k_pages: list  # per layer, its keys page pool (None: a layer reading another's), by stage when pipelined
    v_pages: list  # per layer, its values page pool
    slots: SlotState  # per decode slot: sampling state, last token, stop ids, step count
    draft_kv: tuple | None = None  # the draft model's or the EAGLE head's pools (k, v), else None


def devices(weights) -> list:
    """The device of (one-device) weights: the first committed leaf's, else the default one."""
    leaf = next((a for a in jax.tree.leaves(weights) if getattr(a, "committed", False)), None)
    return list(leaf.devices()) if leaf is not None else jax.local_devices()[:1]


def committed(tree, weights):
    """``tree`` committed to the device of the (one-device) weights, without a copy. jit keys
    its executables on whether each argument is committed: a step's outputs are (its
    weights are), so pools or slots left uncommitted (made by jnp.zeros or a bare
    device_put) would make the first step shape's executable twice, once for them and
    again for the outputs that replace them (a second lowering, 0.5-1 s, mid-run)."""
    return jax.device_put(tree, devices(weights)[0])


@dataclasses.dataclass
class Pools:
    """The target's page pools and what making them decided."""

    k: list
    v: list
    windowed: tuple  # per layer: whether its pool is a sliding window's
    pipeline: object = None  # engine.pipeline.PipelineLayout, when the mesh has stages
    weights: object = None  # the weights, stacked by stage when pipelined


def make_pools(cfg, config, weights, mesh, replicas: int, kv_dtype, keys_transposed: bool, num_pages: int,
               num_window_pages: int | None, started=None, max_model_len: int = 0, *, lanes: int = 1) -> Pools:
    """The target's page pools: on the weights' device, split over the mesh's "model" axis
    (KV heads, or replicated), one per pipeline stage's layers, folded over the replicas.
    started: ``config.start_pools``' future, begun while the weights were read (one device).
    lanes: the pools' head-dim padding (``dispatch.pool_lanes``; not the pipeline's pools)."""
    ps = config.block_size
    if mesh is not None and mesh.shape.get("stage", 1) > 1:
        # pipeline parallel: each stage's devices hold only their layers' weights and pools
        from jaxinfer.engine import pipeline as pp

        pp.check_pipeline(cfg)
        windowed = tuple(num_window_pages is not None and cfg.layer_window(i) is not None for i in range(cfg.n_layers))
        layout = pp.PipelineLayout.make(mesh, cfg.n_layers, windowed)
        k, v = pp.init_pools(cfg, layout, num_pages, ps, kv_dtype, num_window_pages, keys_transposed)
        return Pools(k, v, windowed, layout, pp.stack_weights(weights, layout))
    if started is not None and started.made_for != (cfg, config, max_model_len):
        raise ValueError("the page pools were started for another model or engine configuration")
    cache = (started.result() if started is not None else
             kv.init_paged_cache(cfg, num_pages, ps, kv_dtype, num_window_pages=num_window_pages,
                                 keys_transposed=keys_transposed, lanes=lanes,
                                 model_shards=dict(mesh.shape).get("model", 1) if mesh is not None else 1))
    if cache.keys_transposed != keys_transposed:
        raise ValueError("the page pools were started with another keys layout than this engine's")
    if next(v for v in cache.v if v is not None).shape[-1] % lanes:
        raise ValueError(f"the page pools were started with head dims not padded to {lanes} lanes")
    if mesh is None:
        k, v = committed((cache.k, cache.v), weights)
        return Pools(k, v, cache.windowed, weights=weights)
    from jaxinfer.sharding import kv_pool_shardings

    pool = [None if s is None else NamedSharding(mesh, replica_spec(replicas, s.spec))
            for s in kv_pool_shardings(mesh, cfg)]
    k, v = jax.device_put(fold((cache.k, cache.v), replicas), (pool, pool))
    return Pools(k, v, cache.windowed, weights=weights)


def fresh_slots(vocab_size: int, max_num_seqs: int, seed: int, weights, mesh, replicas: int) -> SlotState:
    """Every slot idle, placed as the steps' own outputs will be: folded over the replicas
    and split over them, replicated over the mesh, or committed to the weights' device."""
    slots = make_slots(vocab_size, max_num_seqs, seed, vocab_state=False)
    if mesh is None:
        return committed(slots, weights)
    return jax.device_put(fold(slots, replicas), NamedSharding(mesh, replica_spec(replicas)))


def fold(tree, replicas: int):
    """``replicas`` copies of every array of a fresh one-replica ``tree`` concatenated along
    its leading axis (the folded state: ``engine.replicas``); one replica: ``tree`` itself,
    not copied."""
    if replicas == 1:
        return tree
    return jax.tree.map(lambda a: jnp.concatenate([a] * replicas), tree)


def replica_spec(replicas: int, inner: PartitionSpec = PartitionSpec()) -> PartitionSpec:
    """The placement of a folded state array whose one-replica placement is ``inner`` (its
    leading axis not split): that axis split over "data" where there are several replicas.
    One replica keeps ``inner`` itself, the placement its step's outputs come back with (a
    spec naming the size-1 "data" axis would key the step's executables apart from them)."""
    if replicas == 1:
        return inner
    assert len(inner) == 0 or inner[0] is None, inner
    return PartitionSpec("data", *tuple(inner)[1:])


def cache_bytes(state: EngineState) -> int:
    """Bytes of every page pool the state holds, the drafter's included."""
    extra = state.draft_kv
    pools = state.k_pages + state.v_pages + (list(extra[0]) + list(extra[1]) if extra else [])
    return sum(a.nbytes for a in pools if a is not None)
