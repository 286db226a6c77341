"""The engine's steps compiled ahead of time for a target it need not run on: a TPU slice from a
CPU host (libtpu's topologies), or the devices at hand.

Everything is lowered on abstract values (``jax.ShapeDtypeStruct`` carrying the engine's own
shardings), so nothing of the model's size is allocated. A compiled executable tells what the
target would do with each step: ``memory_analysis()`` (argument, temp, output and aliased
bytes per chip), ``cost_analysis()`` (flops, bytes accessed) and the optimized HLO (layouts,
copies, collectives). ``analyse`` reads those into one record; ``benchmarks/tpu_compile.py``
writes the records of a workload's executables for a named target.

What a compile cannot tell: real DMA overlap, ICI contention, host overhead between steps.
XLA's cost analysis counts nothing for a Pallas call (a custom call); ``analyse`` adds what its
DMAs move instead: the pages its tables name for attention, every operand once for a matmul.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer import cache as kv
from jaxinfer import dispatch, hlo_bytes
from jaxinfer.config import ModelConfig
from jaxinfer.engine.chaining import chained_decode
from jaxinfer.engine.slots import make_slots
from jaxinfer.engine.state import EngineState
from jaxinfer.engine.step import StepInputs, packed_step, sample_rows
from jaxinfer.engine.verify import DraftBlock, verify
from jaxinfer.models.packed import PackedBatch
from jaxinfer.models.registry import model_family
from jaxinfer.specs import is_spec, spec_dtype

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice by libtpu's topology name, and its chips' published HBM size and bandwidth
    (Google Cloud TPU documentation)."""

    topology: str  # "v6e:1x1"
    host_bounds: tuple[int, int, int]  # chips per host
    hbm_bytes: int  # per chip
    hbm_bw: float  # bytes/s per chip

    @property
    def chips(self) -> int:
        return int(np.prod([int(d) for d in self.topology.split(":")[1].split("x")]))


TARGETS = {
    "v5e-1": Target("v5e:1x1", (1, 1, 1), 16 * GiB, 819e9),
    "v5e-4": Target("v5e:2x2", (2, 2, 1), 16 * GiB, 819e9),
    "v5e-8": Target("v5e:2x4", (2, 4, 1), 16 * GiB, 819e9),
    "v6e-1": Target("v6e:1x1", (1, 1, 1), 32 * GiB, 1640e9),
    "v6e-8": Target("v6e:2x4", (2, 4, 1), 32 * GiB, 1640e9),
    # v5p-N counts TensorCores: v5p-8 is 4 chips of 2 cores (one device each), 95 GiB per chip
    "v5p-8": Target("v5p:2x2x1", (2, 2, 1), 95 * GiB, 2765e9),
    # slices of several hosts of 4 chips each (DeepSeek-V3's 671B parameters need them)
    "v5p-16": Target("v5p:2x2x2", (2, 2, 1), 95 * GiB, 2765e9),
    "v5p-32": Target("v5p:2x2x4", (2, 2, 1), 95 * GiB, 2765e9),
}


def libtpu_available() -> bool:
    """Whether libtpu (``pip install 'jaxinfer[tpu]'``) is importable here."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


@functools.cache
def target_devices(name: str) -> tuple:
    """The devices of target ``name`` (a key of TARGETS), from libtpu's topology description:
    real TPU devices to compile for, on any host."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    if not libtpu_available():
        raise RuntimeError("compiling for a TPU target needs libtpu: pip install 'jaxinfer[tpu]'")
    # several processes (a test run's workers) may each describe a topology; without this libtpu
    # holds a lock file for the first and refuses the rest
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    t = TARGETS[name]
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=t.topology,
                                              chips_per_host_bounds=t.host_bounds).devices)


def target_mesh(name: str, *, model: int | None = None, data: int = 1) -> Mesh:
    """A (data, stage, model) mesh over the first data * model devices of target ``name``
    (default: all of them on the model axis)."""
    from jaxinfer.sharding import make_mesh

    devices = target_devices(name)
    model = model or len(devices) // data
    return make_mesh(data=data, model=model, devices=devices[: data * model])


def target_kernels(mesh: Mesh, option: str = "pallas") -> dispatch.Kernels:
    """The engine's kernel choice on ``mesh`` (its devices' platform; Pallas calls per shard)."""
    return dispatch.choose(option, mesh=mesh)


def keys_transposed(kernels: dispatch.Kernels) -> bool:
    """The keys layout the engine's pools take under ``kernels`` (``dispatch.keys_transposed``)."""
    return dispatch.keys_transposed(kernels, kernels.platform)


# ----------------------------------------------------------------------------- abstract state
def _abstract(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def replicated(mesh: Mesh, tree):
    """tree's arrays as abstract values replicated over mesh."""
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda a: _abstract(jnp.asarray(a) if isinstance(a, (int, float)) else a, rep), tree)


def abstract_weights(cfg: ModelConfig, mesh: Mesh, kernels: dispatch.Kernels, *, quantization: str | None = None,
                     expert_parallel: bool = False):
    """The model's weights as the engine holds them on ``mesh`` (loaded with its shardings,
    quantized with ``quantization`` as ``LLM(quantization=...)`` does, experts placed, bound
    to ``kernels``), every leaf abstract."""
    from jaxinfer import quant
    from jaxinfer.loaders.quantize import quantize_weight, weight_name
    from jaxinfer.sharding import place_experts, quant_shardings, rules_for, weight_shardings

    specs = model_family(cfg.family).weight_specs(cfg)
    shardings = weight_shardings(specs, mesh, rules_for(expert_parallel))
    qcfg = quant.quant_config(quantization) if quantization else None

    def one(spec, sharding):
        w = jax.ShapeDtypeStruct(tuple(spec.shape), jnp.dtype(spec.dtype or cfg.dtype))
        if qcfg is None or not spec.contract_axes:
            return _abstract(w, sharding)
        qa = jax.eval_shape(lambda x: quantize_weight(weight_name(("w",), None), spec, x, qcfg), w)
        if not isinstance(qa, quant.QuantArray):
            return _abstract(w, sharding)
        return jax.tree.map(_abstract, qa, quant_shardings(qa, sharding))

    weights = jax.tree.map(one, specs, shardings, is_leaf=is_spec)
    if mesh.size > 1:
        weights = place_experts(weights, specs, mesh)
    return dispatch.bind(weights, specs, kernels), specs


def abstract_pools(cfg: ModelConfig, mesh: Mesh, num_pages: int, page_size: int, kv_dtype: str,
                   num_window_pages: int | None = None, *, keys_transposed: bool = False,
                   lanes: int = 1) -> kv.PagedKVCache:
    """The engine's page pools on ``mesh`` (split over KV heads where they divide), abstract;
    lanes: what their minor dimension is padded to (``dispatch.pool_lanes``)."""
    from jaxinfer.sharding import kv_pool_shardings

    cache = jax.eval_shape(lambda: kv.init_paged_cache(cfg, num_pages, page_size, kv_dtype,
                                                       num_window_pages=num_window_pages,
                                                       keys_transposed=keys_transposed, lanes=lanes,
                                                       model_shards=dict(mesh.shape).get("model", 1)))
    shard = kv_pool_shardings(mesh, cfg)

    def place(pools):
        return [None if p is None else jax.tree.map(lambda a, s=s: _abstract(a, s), p)
                for p, s in zip(pools, shard)]

    return dataclasses.replace(cache, k=place(cache.k), v=place(cache.v))


def abstract_slots(cfg: ModelConfig, mesh: Mesh, rows: int):
    return replicated(mesh, jax.eval_shape(lambda: make_slots(cfg.vocab_size, rows, 0, vocab_state=False)))


def batch_for(mesh: Mesh, *, rows: int, width: int, wwidth: int = 1, q: int = 1, prefill: int = 0,
              max_segments: int = 0) -> PackedBatch:
    """An abstract ``PackedBatch`` of the given shape (as ``Engine.idle_batch`` builds it)."""
    z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    N = rows * q + prefill
    b = PackedBatch(tokens=z(N), positions=z(N), write_page=z(N), write_wpage=z(N),
                    active=np.zeros(rows, np.bool_), use_prev=np.zeros(rows, np.bool_), last_q=z(rows),
                    table=z(rows + 1, width), wtable=z(rows + 1, wwidth), wbase=z(rows + 1),
                    seg=np.full(prefill, -1, np.int32), hist_end=np.int32(0),
                    targets=np.full(prefill, -1, np.int32), rows=rows, q=q, max_segments=max_segments)
    return replicated(mesh, b)


def with_images(mesh: Mesh, batch: PackedBatch, cfg: ModelConfig) -> PackedBatch:
    """``batch`` as a step whose prefill row holds image soft tokens (``ImageInputs.attach``):
    their embeddings [Tp, D] in the model's dtype, each token's row in them, the bidirectional
    mask's last position per prefill-row token."""
    N, Tp = batch.tokens.shape[0], batch.prefill_len
    return dataclasses.replace(batch, **replicated(mesh, dict(
        image_embeds=np.zeros((Tp, cfg.d_model), jnp.dtype(cfg.dtype)), image_index=np.zeros(N, np.int32),
        attend_to=np.zeros(Tp, np.int32))))


# ----------------------------------------------------------------------------- the workload
@dataclasses.dataclass(frozen=True)
class Workload:
    """What the engine serves: decode rows at a context, a prompt chunk, a chain, drafts."""

    context: int = 4096  # positions every decode row's page table covers
    page_size: int = 16
    kv_dtype: str = "bfloat16"
    window_ahead: int = 4  # window pages beyond a windowed layer's window
    num_pages: int | None = None  # the pools' pages (as the engine sizes them); None: what the step needs


@dataclasses.dataclass(frozen=True)
class StepKind:
    """One executable of the engine: ``rows`` decode rows of ``q`` queries, a prefill row of
    ``prefill`` tokens, a chain of ``chain`` decode steps (0: one step), or verification."""

    name: str
    rows: int
    q: int = 1
    prefill: int = 0
    chain: int = 0
    verify: bool = False
    kv_dtype: str | None = None  # None: the workload's
    max_segments: int | None = None  # prompts the prefill row packs at most; None: min(prefill, 8)
    # False: a plain step that returns its rows' logits for the sampler's own executable
    # (``lower_sampler``), as an engine with ``separate_sampler`` runs it
    sample: bool = True
    image_tokens: int = 0  # image soft tokens in the prefill row (``engine.multimodal``); 0: a text step

    @property
    def tokens(self) -> int:
        return self.rows * self.q + self.prefill


def lower_step(cfg: ModelConfig, weights, mesh: Mesh, kernels: dispatch.Kernels, kind: StepKind,
               work: Workload = Workload(), *, keys_transposed_: bool | None = None, lanes_: int | None = None):
    """The engine's jitted function for ``kind`` lowered on abstract state: (lowered, info)
    where info holds the pool shapes per chip and the workload's sizes for ``analyse``.
    keys_transposed_, lanes_: the keys pools' layout and the pools' minor-dimension padding
    (None: the engine's choice for these kernels, ``dispatch.keys_transposed`` / ``pool_lanes``)."""
    ps = work.page_size
    width = -(-work.context // ps)
    rows_total = max(kind.rows, 1)
    num_pages = work.num_pages or rows_total * width + 1 + (-(-kind.prefill // ps))  # + the scratch page
    window = cfg.sliding_window if any(cfg.layer_window(i) for i in range(cfg.n_layers)) else None
    wwidth, num_window_pages = 1, None
    if window:
        wwidth = min(width, -(-window // ps) + work.window_ahead)
        num_window_pages = rows_total * wwidth + 1 + (-(-kind.prefill // ps))
    kv_dtype = kind.kv_dtype or work.kv_dtype
    transposed = keys_transposed(kernels) if keys_transposed_ is None else keys_transposed_
    lanes = dispatch.pool_lanes(kernels) if lanes_ is None else lanes_
    pools = abstract_pools(cfg, mesh, num_pages, ps, kv_dtype, num_window_pages, keys_transposed=transposed,
                           lanes=lanes)
    slots = abstract_slots(cfg, mesh, max(kind.rows, 1))
    batch = batch_for(mesh, rows=kind.rows, width=width, wwidth=wwidth, q=kind.q, prefill=kind.prefill,
                      max_segments=min(kind.prefill, 8) if kind.max_segments is None else kind.max_segments)
    if kind.image_tokens:
        batch = with_images(mesh, batch, cfg)
    statics = dict(cfg=cfg, windowed=pools.windowed, num_logprobs=-1, kernels=kernels, keys_transposed=transposed)
    state = EngineState(pools.k, pools.v, slots)
    if kind.chain:
        rep = NamedSharding(mesh, PartitionSpec())
        fn = jax.jit(functools.partial(chained_decode, steps=kind.chain, page_size=ps, **statics),
                     donate_argnames=("state",))
        lowered = fn.lower(weights, batch, state,
                           jax.ShapeDtypeStruct((kind.rows,), jnp.int32, sharding=rep),
                           jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                           jax.ShapeDtypeStruct((), jnp.bool_, sharding=rep))
    else:
        # a verification step is the one step with a draft block
        fn = jax.jit(functools.partial(packed_step, prompt_logprobs=-1, sample=kind.sample, **statics),
                     donate_argnames=("state",))
        lowered = fn.lower(weights, StepInputs(batch, drafts=DraftBlock() if kind.verify else None), state)
    info = dict(pools=pool_shapes(pools), width=width, wwidth=wwidth, page_size=ps,
                windowed=pools.windowed, kv_dtype=kv_dtype)
    return lowered, info


def lower_sampler(cfg: ModelConfig, mesh: Mesh, rows: int, *, num_logprobs: int = -1,
                  kernels: dispatch.Kernels | None = None):
    """The sampler's own executable (``step.sample_rows``, the slots donated, as
    ``Engine.separate_sampler`` runs it) for ``rows`` decode rows, lowered on abstract logits
    f32[rows, V] and slot state replicated over ``mesh``; kernels: the engine's choice (None:
    ``target_kernels(mesh)``, the Pallas kernels on a TPU)."""
    rep = NamedSharding(mesh, PartitionSpec())
    logits = jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.float32, sharding=rep)
    active = jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=rep)
    kernels = target_kernels(mesh) if kernels is None else kernels
    fn = jax.jit(functools.partial(sample_rows, num_logprobs=num_logprobs, kernels=kernels), donate_argnames=("slots",))
    return fn.lower(logits, abstract_slots(cfg, mesh, rows), active)


def lower_verification(cfg: ModelConfig, weights, mesh: Mesh, kernels: dispatch.Kernels, rows: int, q: int):
    """What a verification step runs past its layers, alone: ``engine.verify.verify`` (the LM
    head over ``rows`` decode rows of ``q`` positions each, then ``sampling.verify_block``) on
    abstract hidden states bf16[1, rows * q, D] and slot state replicated over ``mesh``,
    lowered. Compiled in a minute at 8B's vocabulary where the whole step takes minutes a
    layer; returns the verdict (accepted drafts, tokens, sampling state)."""
    rep = NamedSharding(mesh, PartitionSpec())
    mod = model_family(cfg.family)
    h = jax.ShapeDtypeStruct((1, rows * q, cfg.d_model), jnp.dtype(cfg.dtype), sharding=rep)
    batch = batch_for(mesh, rows=rows, width=1, q=q)

    def run(weights, h, batch, slots):
        ver, *_ = verify(mod, weights, h, batch, batch, slots, None, heads=None, guide=None, q_draft=None, W=1,
                         cfg=cfg, kernels=kernels)
        return ver

    return jax.jit(run).lower(weights, h, batch, abstract_slots(cfg, mesh, rows))


def lower_image_encoder(encoder, cfg, mesh: Mesh, images: int):
    """A family's image encoder (``ModelFamily.image_encoders``) over ``images`` images at once,
    lowered for ``mesh``'s devices: its weights abstract and replicated, as ``weight_specs``
    declares them; pixels f32[images, C, S, S]."""
    rep = NamedSharding(mesh, PartitionSpec())
    weights = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, spec_dtype(s, cfg), sharding=rep),
                           encoder.weight_specs(cfg), is_leaf=is_spec)
    pixels = jax.ShapeDtypeStruct((images, cfg.channels, cfg.image_size, cfg.image_size), jnp.float32,
                                  sharding=rep)
    return jax.jit(functools.partial(encoder.encode, cfg=cfg)).lower(weights, pixels)


def pool_shapes(pools: kv.PagedKVCache) -> list:
    """Per layer, keys pools then values pools: the (shape on one chip, dtype) of each array of
    the pool (an int8 pool's values and scales), [] for a layer with no pool."""
    return [[] if pool is None else [(tuple(a.sharding.shard_shape(a.shape)), jnp.dtype(a.dtype))
                                     for a in jax.tree.leaves(pool)] for pool in pools.k + pools.v]


# ----------------------------------------------------------------------------- reading a compiled step
_ITEM = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s16": 2, "u16": 2, "s8": 1, "u8": 1,
         "pred": 1, "s64": 8, "u64": 8, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z\-]*)\((.*)$")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def _bytes_of(type_text: str) -> float:
    return sum(_ITEM.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for dt, dims in _SHAPE.findall(type_text))


def _elems(dims: str) -> int:
    return int(np.prod([int(d) for d in dims.split(",") if d] or [1]))


def hlo_ops(text: str):
    """(name, result type, opcode, operand names, line) of every instruction of an HLO module."""
    for line in text.splitlines():
        m = _DEF.match(line)
        if m:
            args = m.group(4)
            yield m.group(1), m.group(2), m.group(3), re.findall(r"%([\w.\-]+)", args.split("),")[0]), line


def analyse(compiled, info: dict, *, hbm_bytes: int | None = None, hbm_bw: float | None = None) -> dict:
    """One record of a compiled step (per chip): memory, XLA's cost, the bytes its Pallas calls
    move, collectives, ops that copy or transpose a whole page pool (``pool_copies``: relayouts),
    and copies of a whole pool into or out of VMEM (``pool_vmem_moves``: only a pool small
    enough to fit there, a toy's, is ever staged so). ``op_bytes`` is XLA's count redone op by
    op from the HLO (``hlo_bytes``), ``bytes_by_op`` its largest ops and ``bytes_by_scope`` its
    bytes per JAX op (``hlo_bytes.scope_of``), to set beside ``xla_bytes_accessed``;
    ``hbm_op_bytes`` and ``hbm_bytes_by_scope`` the same counting only what moves through HBM,
    ``hbm_op_bytes_trips`` that with each loop's body counted once per trip where the HLO fixes
    the trips (the sampler's bisections; not a chain's loop, which stops when every row is done
    and counts once); ``loop_op_bytes`` and ``hbm_loop_op_bytes`` the two counts of the entry's
    dearest loop alone (a chain's: what each further step adds)."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else (cost or {})
    text = compiled.as_text()
    types: dict[str, str] = {}
    ops = list(hlo_ops(text))
    for name, typ, *_ in ops:
        types[name] = typ
    # every array of a pool (an int8 pool's flat scales [P, K * ps] too)
    pool_elems = {int(np.prod(s)) for leaves in info["pools"] for s, dt in leaves if len(s) >= 2}
    pool_bytes = sum(np.prod(s) * dt.itemsize for leaves in info["pools"] for s, dt in leaves)
    collectives: dict[str, dict] = {}
    copies, staged, pallas_calls, attention_calls, pallas_bytes = [], [], 0, 0, 0.0
    # the same counting only what lies in HBM, and the attention calls that read their pools
    # there (not from a copy XLA staged in VMEM, which the HBM count already holds)
    pallas_hbm_bytes, attention_hbm_calls = 0.0, 0
    for name, typ, op, operands, line in ops:
        base = op.removesuffix("-start")
        if base in COLLECTIVES and not op.endswith("-done"):
            c = collectives.setdefault(base, {"count": 0, "bytes": 0.0})
            c["count"] += 1
            c["bytes"] += _bytes_of(typ)
        shapes = _SHAPE.findall(typ)
        if op in ("copy", "copy-start", "transpose") or (op == "fusion" and re.search(r"copy|transpose", name)):
            if any(_elems(d) in pool_elems for _, d in shapes):
                # a copy between HBM and VMEM (memory space S(1)) stages a pool small enough to
                # fit there; any other is a relayout
                (staged if op == "copy-start" and "S(1)" in typ else copies).append(line.strip()[:240])
        if op == "custom-call" and ("tpu_custom_call" in line or "__gpu$xla.gpu.triton" in line):
            pallas_calls += 1
            attention_calls += "attention" in name
            seen, pools_in_hbm = set(), False
            for o in operands:
                if o in seen or o not in types:
                    continue
                seen.add(o)
                dims = [_elems(d) for _, d in _SHAPE.findall(types[o])]
                if any(d in pool_elems for d in dims):
                    # a page pool: counted below by the pages the tables name
                    pools_in_hbm |= hlo_bytes.type_bytes(types[o], hbm=True) > 0
                    continue
                pallas_bytes += _bytes_of(types[o])
                pallas_hbm_bytes += hlo_bytes.type_bytes(types[o], hbm=True)
            pallas_bytes += _bytes_of(typ)
            pallas_hbm_bytes += hlo_bytes.type_bytes(typ, hbm=True)
            attention_hbm_calls += "attention" in name and pools_in_hbm
    # (a chain's steps are one loop: its ops are listed from the loop's body)
    ops, hbm = hlo_bytes.bytes_by_op(text, loops=True), hlo_bytes.bytes_by_op(text, hbm=True, loops=True)
    rec = dict(
        op_bytes=ops["total"], bytes_by_op=ops["top"], bytes_by_scope=ops["by_scope"],
        hbm_op_bytes=hbm["total"], hbm_bytes_by_scope=hbm["by_scope"],
        hbm_op_bytes_trips=hlo_bytes.bytes_by_op(text, hbm=True, trips=True)["total"],
        loop_op_bytes=hlo_bytes.loop_bytes(text), hbm_loop_op_bytes=hlo_bytes.loop_bytes(text, hbm=True),
        argument_bytes=int(mem.argument_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
        pool_bytes=int(pool_bytes), flops=float(cost.get("flops", 0.0)),
        xla_bytes_accessed=float(cost.get("bytes accessed", 0.0)), pallas_calls=pallas_calls,
        pallas_attention_calls=attention_calls, pallas_operand_bytes=pallas_bytes,
        pallas_hbm_operand_bytes=pallas_hbm_bytes, pallas_attention_hbm_calls=attention_hbm_calls, collectives=collectives, pool_copies=copies,
        pool_vmem_moves=len(staged))
    if hbm_bytes is not None:
        rec["hbm_bytes"] = hbm_bytes
    if hbm_bw is not None:
        rec["hbm_bw"] = hbm_bw
    return rec


def kv_bytes_per_token(cfg: ModelConfig, info: dict) -> list[float]:
    """Bytes one token's keys and values (int8 pools: with their scales) take in each layer's
    pools on one chip; 0 for a layer with no pool of its own."""
    n, ps = cfg.n_layers, info["page_size"]
    return [sum(np.prod(shape) * dt.itemsize / (shape[0] * ps)
                for leaves in (info["pools"][i], info["pools"][n + i]) for shape, dt in leaves)
            for i in range(n)]
