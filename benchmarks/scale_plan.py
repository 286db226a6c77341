"""The numbers behind benchmarks/SCALE.md: for Gemma 3 27B and a Llama-3-70B-shaped config on
v5e-8, v5e-64 and v5p-128, the TP x PP x DP layout, weights and KV per chip at 8k context, the
collective bytes per decoded token read from the compiled HLO of the engine's own decode step
(``engine.step.packed_step``) on a fake CPU mesh of the tensor-parallel shape, and the decode
MBU that follows from the chips' published HBM and ICI bandwidths.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python benchmarks/scale_plan.py > benchmarks/data/scale_plan.json

The step is lowered on abstract weights and pools (ShapeDtypeStructs carrying the engine's
shardings), so nothing of the 27B/70B size is allocated; it is compiled with a few layers
(Gemma: 6, one GLOBAL and five LOCAL, its 5:1 pattern; Llama: 2) and the per-layer collectives
(named scopes ``layerI/...``) are scaled by the real layer count, the rest (embedding, LM head,
sampling) counted once. The pipeline step is not lowered here: a PP boundary's bytes are the
activations it passes (R x D in bf16), stated as such.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cache as kv
from jaxinfer import dispatch
from jaxinfer.config import ModelConfig, RopeConfig, RopeKind
from jaxinfer.engine.slots import make_slots
from jaxinfer.engine.state import EngineState
from jaxinfer.engine.step import StepInputs, packed_step
from jaxinfer.models import gemma3
from jaxinfer.models.packed import PackedBatch
from jaxinfer.models.registry import model_family
from jaxinfer.sharding import kv_pool_sharding, make_mesh, weight_shardings
from jaxinfer.models.registry import num_params

GiB = 1 << 30
CTX = 8192
BATCH = 32  # decode rows per replica (sequences in flight) the plan sizes KV for
ROWS = 8  # decode rows of the lowered step (collective bytes are per step; divided by this)

# Published per-chip numbers (Google Cloud TPU docs): HBM bytes, HBM GB/s, ICI GB/s per chip
# (v5e 1600 Gbps, v5p 4800 Gbps), chips per host.
CHIPS = {
    "v5e": dict(hbm=16 * GiB, hbm_bw=819e9, ici_bw=200e9, per_host=8),
    "v5p": dict(hbm=95 * GiB, hbm_bw=2765e9, ici_bw=600e9, per_host=4),
}
SLICES = {"v5e-8": ("v5e", 8), "v5e-64": ("v5e", 64), "v5p-128": ("v5p", 64)}  # v5p-N counts TensorCores: N/2 chips

LLAMA3_70B = ModelConfig(
    family="llama", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
    d_ff=28672, norm_eps=1e-5, rope=RopeConfig(theta=500000.0, kind=RopeKind.LLAMA3, factor=8.0),
    max_position=131072, tie_embeddings=False, dtype="bfloat16", name="llama-3-70b-shape")
MODELS = {"gemma-3-27b": dataclasses.replace(gemma3.PRESETS["gemma-3-27b"], dtype="bfloat16"),
          "llama-3-70b": LLAMA3_70B}


def weight_bytes(cfg: ModelConfig, bytes_per_param: float) -> float:
    return num_params(cfg) * bytes_per_param


def pick_layout(cfg: ModelConfig, slice_name: str) -> dict:
    """The engine's rule: a replica is the fewest chips that hold its weights and BATCH
    sequences of 8k KV within 90% of HBM. Tensor parallelism first, inside one host, at a size
    dividing the query heads (and the KV heads when it can, so KV splits rather than
    replicates); pipeline stages across hosts only when one host's chips cannot hold a replica;
    every remaining chip is another data-parallel replica (replicas share nothing, so decode
    throughput scales with them while TP beyond what memory needs only adds all-reduces)."""
    chip, n = SLICES[slice_name]
    c = CHIPS[chip]
    per_host = min(c["per_host"], n)
    hosts = max(n // c["per_host"], 1)
    tried = []
    # BATCH sequences first; a slice too small for that many 8k sequences plans fewer
    for batch in (BATCH, BATCH // 2, BATCH // 4, BATCH // 8):
        for wbytes, wname in ((2, "bf16"), (1, "int8")):
            for pp in (1, 2, 4, 8):
                for tp in (1, 2, 4, 8):
                    if tp > per_host or cfg.n_heads % tp or pp > hosts or tp * pp > n or cfg.n_layers < pp:
                        continue
                    kv_split = tp if cfg.n_kv_heads % tp == 0 else 1
                    kv_seq = cfg.kv_bytes(CTX, "bfloat16", windowed=True)
                    w_chip = weight_bytes(cfg, wbytes) / (tp * pp)
                    kv_chip = batch * kv_seq / (kv_split * pp)
                    fits = w_chip + kv_chip <= 0.9 * c["hbm"]
                    tried.append((batch, wname, tp, pp, fits))
                    if fits:
                        return dict(slice=slice_name, chips=n, tp=tp, pp=pp, dp=n // (tp * pp), weights=wname,
                                    kv="split" if kv_split > 1 else ("replicated" if tp > 1 else "one chip"),
                                    weights_per_chip_gib=w_chip / GiB, kv_per_seq_8k_gib=kv_seq / GiB,
                                    kv_per_chip_gib=kv_chip / GiB, batch=batch, hbm_gib=c["hbm"] / GiB)
    raise SystemExit(f"{cfg.name} fits nowhere on {slice_name}: {tried}")


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def step_collectives(cfg: ModelConfig, tp: int, n_layers: int) -> dict:
    """Compile one decode step (ROWS rows at width 8k/page) of ``cfg`` cut to n_layers on a
    (1, tp) CPU mesh; the collectives of its HLO by kind, per layer and outside the layers."""
    small = dataclasses.replace(cfg, n_layers=n_layers,
                                layer_kinds=gemma3.layer_kinds(n_layers) if cfg.layer_kinds else ())
    mesh = make_mesh(data=1, model=tp, devices=jax.devices()[:tp])
    mod = model_family(small.family)
    specs = mod.weight_specs(small)
    w = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype or small.dtype)),
                     specs, is_leaf=lambda x: hasattr(x, "axes"))
    weights = _abstract(w, weight_shardings(specs, mesh))
    ps, width = 16, CTX // 16
    window_pages = (small.sliding_window // ps + 4) * ROWS if small.sliding_window else None
    cache = jax.eval_shape(lambda: kv.init_paged_cache(small, ROWS * width + 1, ps, "bfloat16",
                                                       num_window_pages=window_pages))
    pool = kv_pool_sharding(mesh, small.n_kv_heads)
    kp = _abstract(cache.k, jax.tree.map(lambda _: pool, cache.k))
    vp = _abstract(cache.v, jax.tree.map(lambda _: pool, cache.v))
    from jax.sharding import NamedSharding, PartitionSpec

    slots0 = jax.eval_shape(lambda: make_slots(small.vocab_size, ROWS, 0))
    slots = _abstract(slots0, jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), slots0))
    ww = min(width, (small.sliding_window or 0) // ps + 2) if small.sliding_window else 1
    z = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    batch = PackedBatch(tokens=z(ROWS), positions=z(ROWS), write_page=z(ROWS), write_wpage=z(ROWS),
                        active=np.ones(ROWS, np.bool_), use_prev=np.zeros(ROWS, np.bool_), last_q=z(ROWS),
                        table=z(ROWS + 1, width), wtable=z(ROWS + 1, ww), wbase=z(ROWS + 1),
                        seg=np.full(0, -1, np.int32), hist_end=np.int32(0), targets=np.full(0, -1, np.int32),
                        rows=ROWS, q=1)
    step = jax.jit(lambda w_, b, st: packed_step(w_, StepInputs(b), st, cfg=small, windowed=cache.windowed,
                                                 num_logprobs=-1, prompt_logprobs=-1, kernels=dispatch.XLA))
    compiled = step.lower(weights, batch, EngineState(kp, vp, slots)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    per_layer: dict = {}
    outside: dict = {}
    for line in compiled.as_text().splitlines():
        m = re.search(r"= (\(?[a-z0-9]+\[[^=]*?\]\S*) (all-reduce|all-gather|reduce-scatter|collective-permute|"
                      r"all-to-all)(?:-start)?\(", line)
        if not m:
            continue
        nbytes = sum(_shape_bytes(t) for t in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", m.group(1)))
        layer = re.search(r"layer(\d+)/", line)
        key = m.group(2)
        if layer:
            per_layer.setdefault(int(layer.group(1)), {}).setdefault(key, [0, 0])
            per_layer[int(layer.group(1))][key][0] += 1
            per_layer[int(layer.group(1))][key][1] += nbytes
        else:
            outside.setdefault(key, [0, 0])
            outside[key][0] += 1
            outside[key][1] += nbytes
    return dict(per_layer=per_layer, outside=outside, flops=float(cost.get("flops", 0)),
                bytes_accessed=float(cost.get("bytes accessed", 0)), n_layers=n_layers)


_ITEM = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "u64": 8}


def _shape_bytes(t) -> int:
    dt, dims = t
    return _ITEM.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))


def scaled_bytes(col: dict, cfg: ModelConfig) -> dict:
    """Collective bytes and count of one step of the full model: the compiled layers'
    average (GLOBAL and LOCAL layers alike hold the same collectives) times the layer count,
    plus what is outside the layers."""
    n = col["n_layers"]
    kinds = {k for v in col["per_layer"].values() for k in v}
    out = {}
    for k in kinds | set(col["outside"]):
        layer_b = sum(v.get(k, [0, 0])[1] for v in col["per_layer"].values()) / n
        layer_c = sum(v.get(k, [0, 0])[0] for v in col["per_layer"].values()) / n
        ob, oc = col["outside"].get(k, [0, 0])[1], col["outside"].get(k, [0, 0])[0]
        out[k] = dict(count=layer_c * cfg.n_layers + oc, bytes=layer_b * cfg.n_layers + ob,
                      per_layer_count=layer_c, per_layer_bytes=layer_b)
    return out


def mbu(cfg: ModelConfig, lay: dict, coll_bytes_step: float, coll_count_step: float) -> dict:
    """Decode at the plan's batch rows per replica: each step every chip reads its weights and its share
    of the batch's KV (mean context 4k: half the 8k pools) from HBM; the step's collectives
    (per chip: the all-reduced bytes, ring all-reduce moving 2(tp-1)/tp of them, plus ~5 us of
    latency each) and, with PP, one boundary's activations per stage. MBU = HBM time / step time."""
    c = CHIPS[SLICES[lay["slice"]][0]]
    wbytes = lay["weights_per_chip_gib"] * GiB
    kvbytes = lay["kv_per_chip_gib"] * GiB / 2
    t_hbm = (wbytes + kvbytes) / c["hbm_bw"]
    tp, pp = lay["tp"], lay["pp"]
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    t_coll = coll_bytes_step * ring / c["ici_bw"] + 5e-6 * coll_count_step
    B = lay["batch"]
    t_pp = (pp - 1) * (B * cfg.d_model * 2 / c["ici_bw"] + 5e-6)
    step = t_hbm * pp + t_coll + t_pp  # one token of a row crosses every stage in turn
    return dict(t_hbm_ms=t_hbm * 1e3, t_collectives_ms=t_coll * 1e3, t_pp_ms=t_pp * 1e3, step_ms=step * 1e3,
                mbu=t_hbm * pp / step, tok_s_per_replica=B / step, tok_s_slice=B / step * lay["dp"])


def main():
    assert len(jax.devices()) >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    out = []
    cache: dict = {}
    for name, cfg in MODELS.items():
        for slice_name in SLICES:
            lay = pick_layout(cfg, slice_name)
            key = (name, lay["tp"])
            if key not in cache:
                cache[key] = step_collectives(cfg, lay["tp"], 6 if cfg.layer_kinds else 2)
                print(f"compiled {name} tp={lay['tp']}", file=sys.stderr)
            col = cache[key]
            full = scaled_bytes(col, cfg)
            # a step of ROWS rows on one stage holds 1/pp of the layers
            b_step = sum(v["bytes"] for v in full.values()) * lay["batch"] / ROWS / lay["pp"]
            c_step = sum(v["count"] for v in full.values()) / lay["pp"]
            row = dict(model=name, **lay, collectives=full,
                       collective_bytes_per_token=sum(v["bytes"] for v in full.values()) / ROWS,
                       pp_bytes_per_token=(lay["pp"] - 1) * cfg.d_model * 2,
                       hlo_flops_per_step=col["flops"], hlo_bytes_accessed_per_step=col["bytes_accessed"],
                       hlo_layers=col["n_layers"], **mbu(cfg, lay, b_step, c_step))
            out.append(row)
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
