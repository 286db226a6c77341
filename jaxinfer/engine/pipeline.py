"""Pipeline parallelism for the packed step: layers split into contiguous stages on the mesh's
``stage`` axis, micro-batches flowing through them GPipe-style inside one jitted step.

Layout. Stage s runs layers [b[s], b[s + 1]) (``sharding.stage_bounds``). A model's per-layer
weights are restacked into ``slots``: slot j is one array per weight of shape [stages, ...]
holding layer b[s] + j of every stage s, its leading axis sharded over ``stage`` (the rules
table's ``"layers"`` entry) and its other axes as tensor parallelism shards them. So each
stage's devices hold only their own layers. Stages with fewer layers (uneven splits) carry a
zero slot they never run. Page pools are stacked the same way, one slot list per pool kind
(full-length, and windowed for Gemma's LOCAL layers when those keep only their window), so a
stage holds only its own layers' pages. The embedding and the final norm / LM head stay
outside the stages, replicated over ``stage`` (and split over ``model`` as in TP).

Schedule. The step's tokens are cut into micro-batches: the decode rows into up to
``stages`` groups of equal rows, and the packed prefill row as one more (its tokens attend to
each other, so it is not cut). Inside a ``shard_map`` that is manual over ``stage`` only
(``model`` stays automatic, so TP inside a stage is unchanged), tick t runs micro-batch t - s
on stage s (a ``lax.switch`` on the stage index picks the stage's own layers), and one
``ppermute`` hands every stage's output activations to the next stage: S + M - 1 ticks for S
stages and M micro-batches, with all stages busy in the middle ticks. The last stage's hidden
states then travel to the other stages by ``ppermute`` as well, and every device computes the
logits and samples, so slot state stays replicated. Nothing but activations crosses stages.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer import cache as kv
from jaxinfer.models.packed import PackedBatch, PackedKV
from jaxinfer.models.registry import model_family
from jaxinfer.sharding import ShardingRules, kv_pool_sharding, stage_bounds

STAGE = "stage"


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Which stage runs which layers, and where each layer's pages live (static, hashable)."""

    mesh: Mesh
    bounds: tuple[int, ...]  # stage s runs layers [bounds[s], bounds[s + 1])
    windowed: tuple[bool, ...]  # per model layer: its pool is a windowed one

    @classmethod
    def make(cls, mesh: Mesh, n_layers: int, windowed: tuple[bool, ...]) -> "PipelineLayout":
        return cls(mesh, stage_bounds(n_layers, mesh.shape[STAGE]), tuple(windowed) or (False,) * n_layers)

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def layers_of(self, s: int) -> range:
        return range(self.bounds[s], self.bounds[s + 1])

    @property
    def slots(self) -> int:  # weight slots: the most layers any stage runs
        return max(len(self.layers_of(s)) for s in range(self.stages))

    def _kind_count(self, s: int, windowed: bool) -> int:
        return sum(self.windowed[i] == windowed for i in self.layers_of(s))

    @property
    def full_slots(self) -> int:
        return max(self._kind_count(s, False) for s in range(self.stages))

    @property
    def window_slots(self) -> int:
        return max(self._kind_count(s, True) for s in range(self.stages))

    def pool_slot(self, i: int) -> int:
        """Index into the stacked pool list of model layer i's pages."""
        s = next(s for s in range(self.stages) if i in self.layers_of(s))
        w = self.windowed[i]
        n = sum(self.windowed[j] == w for j in range(self.bounds[s], i))
        return self.full_slots + n if w else n

    def report(self) -> dict:
        layers = [len(self.layers_of(s)) for s in range(self.stages)]
        return {
            "pipeline_parallel_size": self.stages,
            "stage_layers": [[self.bounds[s], self.bounds[s + 1]] for s in range(self.stages)],
            "layers_per_stage": layers,
            # uneven splits: a stage with fewer layers holds zero weight slots it never runs
            "padding_layer_slots": [self.slots - n for n in layers],
            "kv_pool_slots": {"full": self.full_slots, "windowed": self.window_slots},
            "embedding": "replicated over stages (split over model as in TP)",
            "lm_head": "replicated over stages; the last stage's hidden states go to every stage by "
                       "collective-permute and each computes the logits",
            "micro_batches": "decode rows in up to pipeline_parallel_size equal groups; the prefill row is one",
        }


def check_pipeline(cfg) -> None:
    """Refuse a model the stacked layout cannot hold: stage slots stack one layer of every
    stage, so every layer must have one pool shape of its own (no per-layer head dims or KV
    heads, no layers reading another's keys/values), and the family must run its layers from
    the hidden state alone (``ModelFamily.pipeline_stages``; Gemma 4's per-layer inputs come from the tokens)."""
    from jaxinfer.errors import InvalidRequest

    shapes = {(cfg.layer_kv_heads(i), cfg.layer_head_dim(i)) for i in range(cfg.n_layers)}
    if len(shapes) > 1 or cfg.kv_shared_layers or not model_family(cfg.family).pipeline_stages:
        raise InvalidRequest(f"pipeline_parallel_size > 1 is not supported for {cfg.family} models with "
                             "per-layer inputs, per-layer attention shapes or shared keys/values")
    if cfg.latent_attention:  # the stacked pools hold keys and values, not one latent per token
        raise InvalidRequest(f"pipeline_parallel_size > 1 is not supported for {cfg.family} models with "
                             "multi-head latent attention")


# ----------------------------------------------------------------------------- placement
def _stack(per_stage: list, mesh: Mesh, rules: ShardingRules):
    """One [stages, ...] array from per-stage arrays (each on its own stage's sub-mesh; None:
    a padding slot, zeros), assembled from the devices' own shards: nothing moves across stages."""
    ref = next(a for a in per_stage if a is not None)
    spec = tuple(ref.sharding.spec) + (None,) * (ref.ndim - len(ref.sharding.spec))
    sharding = NamedSharding(mesh, PartitionSpec(rules.mesh_axis("layers"), *spec))
    local = ref.sharding.shard_shape(ref.shape)
    shards = []
    for s, a in enumerate(per_stage):
        on = {} if a is None else {sh.device: sh.data for sh in a.addressable_shards}
        for d in mesh.devices[:, s, :].reshape(-1):
            x = on.get(d)
            shards.append(jnp.zeros((1,) + local, ref.dtype, device=d) if x is None else jnp.expand_dims(x, 0))
    return jax.make_array_from_single_device_arrays((len(per_stage),) + ref.shape, sharding, shards)


def stack_weights(weights: dict, layout: PipelineLayout, rules: ShardingRules = ShardingRules()) -> dict:
    """The model's weights with ``layers`` (one dict per layer, each on its stage's sub-mesh)
    restacked into ``layout.slots`` slots of [stages, ...] arrays."""
    layers = weights["layers"]
    slots = []
    for j in range(layout.slots):
        per = [layers[layout.bounds[s] + j] if j < len(layout.layers_of(s)) else None for s in range(layout.stages)]
        ref = next(p for p in per if p is not None)
        leaves = [jax.tree.leaves(p) if p is not None else None for p in per]
        stacked = [_stack([lv[k] if lv is not None else None for lv in leaves], layout.mesh, rules)
                   for k in range(len(jax.tree.leaves(ref)))]
        slots.append(jax.tree.unflatten(jax.tree.structure(ref), stacked))
    return dict(weights, layers=slots)


def init_pools(cfg, layout: PipelineLayout, num_pages: int, page_size: int, dtype, num_window_pages: int | None,
               keys_transposed: bool = True):
    """Zeroed stacked page pools (keys list, values list), each slot [stages, P, K, ...] made in
    place on its devices: the full-length slots first, then the windowed ones. Keys [stages, P,
    K, H, ps] when keys_transposed, else [stages, P, K, ps, H] (``cache.init_paged_cache``)."""
    K, H, ps = cfg.n_kv_heads, cfg.head_dim, page_size
    dt = jnp.dtype(dtype)
    sharding = kv_pool_sharding(layout.mesh, K, stacked=True)
    S = layout.stages
    pages = [num_pages] * layout.full_slots + [num_window_pages] * layout.window_slots

    def zeros(shape, axis):
        return jax.jit(lambda: kv._zeros(shape, dt, axis), out_shardings=sharding)()

    return ([zeros((S, *kv.key_pool_shape(P, K, H, ps, keys_transposed)), -2 if keys_transposed else -1)
             for P in pages], [zeros((S, P, K, ps, H), -1) for P in pages])


# ----------------------------------------------------------------------------- the schedule
def micro_batches(batch: PackedBatch, stages: int) -> list[tuple[int, int, PackedBatch]]:
    """(first token, token count, sub-batch) of each micro-batch: the decode rows in the most
    equal groups (at most ``stages``) their count divides into, then the prefill row."""
    R, Q, Tp = batch.rows, batch.q, batch.prefill_len
    out = []
    if R:
        groups = max(d for d in range(1, min(stages, R) + 1) if R % d == 0)
        n = R // groups
        for g in range(groups):
            a, b = g * n, (g + 1) * n
            rows = lambda x: jnp.concatenate([x[a:b], x[R : R + 1]])  # noqa: E731  the prefill row's table stays last
            sub = PackedBatch(
                tokens=batch.tokens[a * Q : b * Q], positions=batch.positions[a * Q : b * Q],
                write_page=batch.write_page[a * Q : b * Q], write_wpage=batch.write_wpage[a * Q : b * Q],
                active=batch.active[a:b], use_prev=batch.use_prev[a:b], last_q=batch.last_q[a:b],
                table=rows(batch.table), wtable=rows(batch.wtable), wbase=rows(batch.wbase),
                seg=batch.seg[:0], hist_end=batch.hist_end, targets=batch.targets[:0], rows=n, q=Q)
            out.append((a * Q, n * Q, sub))
    if Tp:
        t = R * Q
        sub = PackedBatch(
            tokens=batch.tokens[t:], positions=batch.positions[t:], write_page=batch.write_page[t:],
            write_wpage=batch.write_wpage[t:], active=batch.active[:0], use_prev=batch.use_prev[:0],
            last_q=batch.last_q[:0], table=batch.table[R:], wtable=batch.wtable[R:], wbase=batch.wbase[R:],
            seg=batch.seg, hist_end=batch.hist_end, targets=batch.targets, rows=0, q=Q)
        out.append((t, Tp, sub))
    return out


def _tick(s: int, m: int | None, layout: PipelineLayout, cfg, kernels, keys_transposed: bool, width: int,
          recv, ks, vs, layers, x, batch):
    """Stage s's work in one tick: micro-batch m through its layers (None: idle) -> (the
    activations it hands on [width, D], and for every pool slot the new keys and values
    [width, K, H] with the page and in-page offset i32[width] each goes to).

    The pools are only read here: this runs inside a conditional, where an in-place write
    would copy the whole pool; the caller stores what comes back (idle rows on the scratch
    page 0). A stage's layers never read each other's pools, so deferring the writes to the
    end of the tick changes nothing."""
    K, H = cfg.n_kv_heads, cfg.head_dim
    n_slots = len(ks)
    out = jnp.zeros((width, x.shape[-1]), x.dtype)
    knew = [jnp.zeros((width, K, H), x.dtype) for _ in range(n_slots)]
    vnew = [jnp.zeros((width, K, H), x.dtype) for _ in range(n_slots)]
    pages = [jnp.zeros(width, jnp.int32) for _ in range(n_slots)]
    offs = [jnp.zeros(width, jnp.int32) for _ in range(n_slots)]
    if m is None:
        return out, knew, vnew, pages, offs
    start, n, sub = micro_batches(batch, layout.stages)[m]
    span = layout.layers_of(s)
    xin = x[:, start : start + n] if s == 0 else recv[None, :n]
    slot = [layout.pool_slot(i) for i in span]
    cache = PackedKV([ks[p] for p in slot], [vs[p] for p in slot], sub, tuple(layout.windowed[i] for i in span),
                     kernels, defer_writes=True, keys_transposed=keys_transposed)
    mod = model_family(cfg.family)
    y, cache = mod.decoder_layers(layers[: len(span)], xin, sub.positions[None], None, cache, cfg=cfg,
                                  first=span.start)
    ps = vs[0].shape[2]
    for (k, v), i, p in zip(cache.written, span, slot):
        knew[p] = knew[p].at[:n].set(k[0].astype(x.dtype))
        vnew[p] = vnew[p].at[:n].set(v[0].astype(x.dtype))
        pages[p] = pages[p].at[:n].set(sub.write_wpage if layout.windowed[i] else sub.write_page)
        offs[p] = offs[p].at[:n].set(sub.positions % ps)
    return out.at[:n].set(y[0]), knew, vnew, pages, offs


def pipeline_forward(layout: PipelineLayout, weights: dict, tokens, batch: PackedBatch, k_pages, v_pages, *,
                     cfg, kernels, keys_transposed: bool = True):
    """The decoder over a packed step's tokens i32[N], pipelined -> (hidden [1, N, D] on every
    device, k_pages, v_pages); keys pools transposed or not (``init_pools``)."""
    mod = model_family(cfg.family)
    S = layout.stages
    x = mod.embed(weights, tokens[None], cfg)  # [1, N, D], replicated over stages
    mbs = micro_batches(batch, S)
    M = len(mbs)
    width = max(n for _, n, _ in mbs)
    right = [(s, s + 1) for s in range(S - 1)]

    def body(layers, x, batch, ks, vs):
        first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731  this stage's block of each slot
        layers, ks, vs = first(layers), first(ks), first(vs)
        stage = jax.lax.axis_index(STAGE)
        h = jnp.zeros_like(x)
        recv = jnp.zeros((width, x.shape[-1]), x.dtype)
        for t in range(M + S - 1):
            with jax.named_scope(f"pipeline_tick{t}"):
                branches = [functools.partial(_tick, s, t - s if 0 <= t - s < M else None, layout, cfg,
                                              kernels, keys_transposed, width) for s in range(S)]
                out, knew, vnew, pages, offs = jax.lax.switch(stage, branches, recv, ks, vs, layers, x, batch)
                ks = [kv.write_pages(a, pg, of, kn[None], keys_transposed=keys_transposed)
                      for a, kn, pg, of in zip(ks, knew, pages, offs)]
                vs = [kv.write_pages(a, pg, of, vn[None]) for a, vn, pg, of in zip(vs, vnew, pages, offs)]
                m = t - (S - 1)  # the micro-batch the last stage finished
                if 0 <= m < M:
                    start, n, _ = mbs[m]
                    done = jnp.where(stage == S - 1, out[None, :n], h[:, start : start + n])
                    h = h.at[:, start : start + n].set(done)
                if t < M + S - 2:
                    recv = jax.lax.ppermute(out, STAGE, right)
        with jax.named_scope("pipeline_broadcast"):  # the last stage's hidden states, around the ring
            for k in range(S - 1):
                got = jax.lax.ppermute(h, STAGE, [((k - 1) % S, k)])
                h = jnp.where(stage == k, got, h)
        last = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
        return h, last(ks), last(vs)

    stacked = PartitionSpec(STAGE)
    fn = jax.shard_map(body, mesh=layout.mesh, in_specs=(stacked, PartitionSpec(), PartitionSpec(), stacked, stacked),
                       out_specs=(PartitionSpec(), stacked, stacked), axis_names={STAGE}, check_vma=False)
    return fn(weights["layers"], x, batch, k_pages, v_pages)
