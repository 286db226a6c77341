"""Compile the engine's steps for a TPU slice on this host (libtpu, no TPU needed) and report
what each executable would do per chip: memory, bytes accessed against the bytes the step
must move, collectives, whole-pool copies, and a projected step time at the chip's HBM
bandwidth.

    pip install -e '.[tpu]'
    python benchmarks/tpu_compile.py --target v6e-1 --model llama-3-8b --out out/tpu-v6e-1

writes ``OUT/report.json`` (one record per executable) and each executable's optimized HLO
as ``OUT/<name>.hlo.txt``. Nothing of the model's size is allocated: weights and pools are
abstract values carrying the engine's shardings (``jaxinfer.aot``).

A few layers stand for many: each step is compiled at two depths (``--layers``, default one
period of the family's layer pattern and twice that), and the per-layer difference scales the
layer-dependent figures to the model's depth (``scaled``). Figures per chip:

* ``bytes_accessed``: XLA's cost analysis (which counts nothing for a Pallas call) plus what the
  Pallas calls move: every non-pool operand and result once, and for attention the pages the
  step's tables name (every decode row at the full context of ``--context``), as their DMAs read them;
* ``op_bytes``, ``bytes_by_op``, ``bytes_by_op_per_layer``: XLA's count (``xla_bytes_accessed``)
  redone op by op from the optimized HLO (``jaxinfer.hlo_bytes``: operands and results by their
  shapes, a fusion's parameters by what its fused ops read), scaled like the rest; the top 10
  JAX ops by bytes in the whole step and in one layer (a chain's: one step's, its loop's
  body listed op by op; ``OUT/<name>.<L2>layers.hlo.txt`` holds the
  second depth's HLO), and ``op_bytes_over_xla`` how close the sum comes to XLA's figure;
* ``hbm_traffic_bytes``, ``hbm_traffic_over_ideal``, ``hbm_bytes_by_op``: a corrected figure, not
  XLA's, beside it: the same op by op count, but only of arrays that lie in HBM. XLA's figure
  counts VMEM too: a weight or pool XLA stages in VMEM counts 5 times its size there (the
  async copy's read, its result tuple, the done, the fusion's read), once here. Like XLA's,
  it counts a ``conditional``'s dearest branch (the sampler's, with top-k/top-p) and a loop's
  body once; ``hbm_traffic_loops_extra`` is what the loops' further trips add (the sampler's
  32-step bisections over the logits: real traffic for rows that sample with them). A chain's
  steps are a loop too, whose trips the HLO does not fix: its body (``loop_op_bytes``,
  ``hbm_loop_op_bytes``), and the loops' extra, are scaled by the chain's length, and what
  runs once around it (attention weights relaid out before the loop) counts once;
* ``ideal_bytes``: the weights on the chip + the KV the rows read (the same pages) + the KV
  they write + the logits;
* ``compile_s`` at the first depth, ``compile_s_scaled`` the two depths' times scaled to the
  model's depth (a compile's time grows with the layers it unrolls);
* ``projected_step_ms`` = bytes_accessed / the chip's HBM bandwidth, ``projected_mbu`` =
  ideal_bytes / bytes_accessed. These are projections: a compile cannot tell real DMA overlap,
  ICI contention or the host's time between steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer import aot, dispatch  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.loaders.hf import family_for  # noqa: E402

# config.json of each model as published on the Hugging Face Hub (the fields our families read)
HF_CONFIGS = {
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=8192),
                       max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu",
                       bos_token_id=128000, eos_token_id=128001),
    "llama-3-70b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
                        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=8192),
                        max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu",
                        bos_token_id=128000, eos_token_id=128001),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                          tie_word_embeddings=False, hidden_act="silu", bos_token_id=151643, eos_token_id=151645),
    # the experts dequantized from the checkpoint's MXFP4 when loaded (``models.gpt_oss``): held as
    # bfloat16, or as int8/int4 with --quantization
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
                        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
                        attention_bias=True, rms_norm_eps=1e-5, rope_theta=150000.0,
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                          original_max_position_embeddings=4096, truncate=False),
                        max_position_embeddings=131072, swiglu_limit=7.0, tie_word_embeddings=False,
                        hidden_act="silu", eos_token_id=200002, pad_token_id=199999),
    # as a bfloat16 conversion of the FP8 release (the family loads no FP8 checkpoint)
    "deepseek-v3": dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
                        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                        num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                        rms_norm_eps=1e-6, rope_theta=10000.0,
                        rope_scaling=dict(type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
                                          mscale_all_dim=1.0, original_max_position_embeddings=4096),
                        max_position_embeddings=163840, tie_word_embeddings=False, hidden_act="silu",
                        bos_token_id=0, eos_token_id=1),
    # a toy of Llama's shape, for checking this script in seconds
    "llama-tiny": dict(architectures=["LlamaForCausalLM"], vocab_size=2048, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                       tie_word_embeddings=False, hidden_act="silu"),
}
# the rest come from the families' own presets (Gemma 3: its 5:1 local/global pattern)
PRESETS = {"gemma-3-4b": ("gemma3", "gemma-3-4b"), "gemma-3-27b": ("gemma3", "gemma-3-27b")}
KINDS = {
    "decode-1": aot.StepKind("decode-1", rows=1),
    "decode-64": aot.StepKind("decode-64", rows=64),
    "decode-256": aot.StepKind("decode-256", rows=256),
    "mixed-2048": aot.StepKind("mixed-2048", rows=64, prefill=2048),
    "chain-8": aot.StepKind("chain-8", rows=64, chain=8),
    "verify-4": aot.StepKind("verify-4", rows=64, q=5, verify=True),
    "decode-64-int8kv": aot.StepKind("decode-64-int8kv", rows=64, kv_dtype="int8"),
    # a multimodal checkpoint's step with an image: a 512-token prefill row holding one image's
    # 256 soft tokens (Gemma 3), beside 64 decode rows; asked for by name only
    "image-256": aot.StepKind("image-256", rows=64, prefill=512, image_tokens=256),
}


def model_config(name: str, dtype: str = "bfloat16") -> ModelConfig:
    if name in HF_CONFIGS:
        hf = HF_CONFIGS[name]
        return dataclasses.replace(family_for(hf, name).config_from_hf(hf, dtype=dtype), name=name)
    if name in PRESETS:
        import importlib

        mod, preset = PRESETS[name]
        cfg = importlib.import_module(f"jaxinfer.models.{mod}").PRESETS[preset]
        return dataclasses.replace(cfg, dtype=dtype, name=name)
    raise SystemExit(f"unknown model {name!r}; known: {', '.join([*HF_CONFIGS, *PRESETS])}")


def period(cfg: ModelConfig, first: int = 0) -> int:
    """Layers of one repeat of the model's layer pattern from layer ``first`` on (Gemma 3: 5 local
    + 1 global; gpt-oss: sliding, full)."""
    kinds = [(cfg.layer_window(i), i in cfg.dense_layers) for i in range(first, cfg.n_layers)]
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return p
    return len(kinds)


def cut(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model's first n layers (the layer pattern and the leading dense layers as in the model)."""
    kw = {"layer_kinds": cfg.layer_kinds[:n]} if cfg.layer_kinds else {}
    return dataclasses.replace(cfg, n_layers=n, dense_layers=tuple(i for i in cfg.dense_layers if i < n), **kw)


def default_depths(cfg: ModelConfig) -> tuple[int, int]:
    """The two depths compiled: the leading dense layers (DeepSeek-V3's first 3) and one period of
    the layer pattern, then one period more, so that the difference is one period of the layers
    that repeat."""
    lead = len(cfg.dense_layers) if cfg.dense_layers == tuple(range(len(cfg.dense_layers))) else 0
    p = period(cfg, lead)
    return lead + p, lead + 2 * p


def tree_bytes(tree) -> float:
    return float(sum(np.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
                     for a in jax.tree.leaves(tree) if hasattr(a, "sharding")))


def ideal_bytes(cfg: ModelConfig, kind: aot.StepKind, info: dict, weights_chip: float, tp: int) -> dict:
    """What the step must move per chip: its weights, the KV pages its rows read (every decode
    row at the full context, windowed layers their window), the KV its tokens write, and the
    f32 logits of its decode rows (vocabulary split over the model axis)."""
    kvpt = aot.kv_bytes_per_token(cfg, info)
    ps = info["page_size"]
    read = 0.0
    for i in range(cfg.n_layers):
        src = cfg.kv_source(i)
        ctx = (info["wwidth"] if info["windowed"] and info["windowed"][src] else info["width"]) * ps
        read += kvpt[src] * (kind.rows * ctx + kind.prefill)
    steps = max(kind.chain, 1)
    write = sum(kvpt) * kind.tokens
    logits = kind.rows * kind.q * cfg.vocab_size * 4 / tp
    return dict(weights=weights_chip * steps, kv_read=read * steps, kv_write=write * steps,
                logits=logits * steps, total=(weights_chip + read + write + logits) * steps)


def fitting_context(cfg: ModelConfig, kind: aot.StepKind, mesh, target: aot.Target, weights_chip: float,
                    context: int) -> int:
    """The longest context (a multiple of 256, at most ``context``) at which every decode row of
    ``kind`` has its pages in HBM beside the weights, within 90% of the chip (as the engine
    sizes its pools from gpu_memory_utilization)."""
    cut_cfg = cut(cfg, default_depths(cfg)[0])
    pools = aot.abstract_pools(cut_cfg, mesh, 2, 16, kind.kv_dtype or "bfloat16",
                               lanes=dispatch.pool_lanes(aot.target_kernels(mesh, "pallas")))
    info = dict(pools=aot.pool_shapes(pools), page_size=16)
    per_token = sum(aot.kv_bytes_per_token(cut_cfg, info)) * cfg.n_layers / cut_cfg.n_layers
    room = 0.9 * target.hbm_bytes - weights_chip
    fit = int(room // (max(kind.rows, 1) * per_token + 1e-9)) // 256 * 256
    return max(256, min(context, fit))


def engine_pages(full: ModelConfig, kind: aot.StepKind, target: aot.Target, weights_chip: float, tp: int,
                 context: int, page_size: int = 16) -> int:
    """The pages of each full-length pool as an engine on the target sizes them (its defaults,
    at least ``kind.rows`` slots, tables of ``context`` positions): what fits in 90% of HBM beside
    the weights. Pools sized to just the step's tables would be unlike the engine's, and small
    enough at a few rows for XLA to stage them whole in VMEM and write them back each layer."""
    from jaxinfer import cache as kv
    from jaxinfer.engine.config import EngineConfig, pool_sizes

    config = EngineConfig(max_num_seqs=max(kind.rows, 64), block_size=page_size)
    budget = int(0.9 * target.hbm_bytes - weights_chip) * tp
    _, pages, _ = pool_sizes(full, config, kv.kv_storage_dtype(kind.kv_dtype or "auto", full),
                             -(-context // page_size), budget)
    need = max(kind.rows, 1) * -(-context // page_size) + 1 + -(-kind.prefill // page_size)
    return max(pages, need)


def compile_one(cfg, mesh, kernels, kind, work, quantization, expert_parallel):
    weights, _ = aot.abstract_weights(cfg, mesh, kernels, quantization=quantization,
                                      expert_parallel=expert_parallel)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered, info = aot.lower_step(cfg, weights, mesh, kernels, kind, work)
        compiled = lowered.compile()
    rec = aot.analyse(compiled, info)
    rec["compile_s"] = time.perf_counter() - t0
    rec["weights_bytes"] = tree_bytes(weights)
    return rec, info, compiled


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="v6e-1", choices=sorted(aot.TARGETS))
    ap.add_argument("--model", default="llama-3-8b", choices=[*HF_CONFIGS, *PRESETS])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--kinds", nargs="+", default=[k for k, v in KINDS.items() if not v.image_tokens],
                    choices=list(KINDS))
    ap.add_argument("--tp", type=int, default=None, help="tensor parallelism (default: every chip)")
    ap.add_argument("--quantization", choices=["int8", "int4", "w8a8"], default=None)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--kernels", choices=["pallas", "xla"], default="pallas")
    ap.add_argument("--context", type=int, default=4096,
                    help="positions each decode row's table covers, at most (less where the rows' KV would not "
                         "fit the chip's HBM beside the weights)")
    ap.add_argument("--layers", type=int, nargs=2, default=None, metavar=("L1", "L2"),
                    help="the two depths compiled (default: one and two periods of the layer pattern)")
    ap.add_argument("--compilation-cache", type=Path, default=None,
                    help="write each executable to JAX's persistent compilation cache here (as LLM keeps one "
                         "under $JAXINFER_HOME). On a TPU host a second run loads them instead of compiling; a CPU "
                         "host compiling for a TPU topology can write entries but not load them (loading needs a "
                         "TPU client), so there a second run shows only that the keys repeat: no new entries")
    args = ap.parse_args(argv)
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    target = aot.TARGETS[args.target]
    full = model_config(args.model)
    mesh = aot.target_mesh(args.target, model=args.tp)
    tp = mesh.shape["model"]
    kernels = aot.target_kernels(mesh, args.kernels)
    L1, L2 = args.layers or default_depths(full)
    full_weights, _ = aot.abstract_weights(full, mesh, kernels, quantization=args.quantization,
                                           expert_parallel=args.enable_expert_parallel)
    weights_chip = tree_bytes(full_weights)
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for name in args.kinds:
        kind = KINDS[name]
        context = fitting_context(full, kind, mesh, target, weights_chip, args.context)
        work = aot.Workload(context=context,
                            num_pages=engine_pages(full, kind, target, weights_chip, tp, context))
        depth = {}
        for L in (L1, L2):
            rec, info, compiled = compile_one(cut(full, L), mesh, kernels, kind, work, args.quantization,
                                              args.enable_expert_parallel)
            depth[L] = rec
            (args.out / (f"{name}.hlo.txt" if L == L1 else f"{name}.{L}layers.hlo.txt")).write_text(compiled.as_text())
            print(f"{name} L={L}: {rec['compile_s']:.1f} s, {len(rec['pool_copies'])} pool copies", file=sys.stderr)
        a, b = depth[L1], depth[L2]

        def scale(x1, x2):
            return x1 + (x2 - x1) * (full.n_layers - L1) / (L2 - L1)

        rec_full = {}
        for key in ("xla_bytes_accessed", "pallas_operand_bytes", "flops", "argument_bytes", "alias_bytes",
                    "pool_bytes", "output_bytes", "hbm_op_bytes", "pallas_hbm_operand_bytes",
                    "pallas_attention_calls", "pallas_attention_hbm_calls", "hbm_op_bytes_trips",
                    "loop_op_bytes", "hbm_loop_op_bytes"):
            rec_full[key] = scale(a[key], b[key])
        rec_full["pool_copies"] = scale(len(a["pool_copies"]), len(b["pool_copies"]))
        rec_full["pool_vmem_moves"] = scale(a["pool_vmem_moves"], b["pool_vmem_moves"])
        rec_full["pallas_calls"] = scale(a["pallas_calls"], b["pallas_calls"])
        rec_full["collectives"] = {k: {f: scale(a["collectives"].get(k, {}).get(f, 0), v[f]) for f in ("count", "bytes")}
                                   for k, v in b["collectives"].items()}
        rec_full["temp_bytes"] = max(a["temp_bytes"], b["temp_bytes"])
        rec_full["op_bytes"] = scale(a["op_bytes"], b["op_bytes"])
        scopes = set(a["bytes_by_scope"]) | set(b["bytes_by_scope"])
        by_scope = {k: scale(a["bytes_by_scope"].get(k, 0.0), b["bytes_by_scope"].get(k, 0.0)) for k in scopes}
        per_layer = {k: (b["bytes_by_scope"].get(k, 0.0) - a["bytes_by_scope"].get(k, 0.0)) / (L2 - L1)
                     for k in scopes}
        # the full model's pools: the cut's (whole periods of the layer pattern) repeated
        ideal_full = ideal_bytes(full, kind, _full_info(full, info, L2), weights_chip, tp)
        # KV pages read by Pallas attention, which XLA's cost analysis leaves out
        pallas_kv = ideal_full["kv_read"] if a["pallas_attention_calls"] else 0.0
        bytes_accessed = rec_full["xla_bytes_accessed"] + rec_full["pallas_operand_bytes"] + pallas_kv
        # HBM only: XLA's count less what it counts in VMEM (a buffer staged there counts 5
        # times its size in XLA's figure, once here); attention that reads pools XLA staged in
        # VMEM reads no page from HBM (the staging copy, counted, did)
        hbm_kv = pallas_kv * (rec_full["pallas_attention_hbm_calls"] / rec_full["pallas_attention_calls"]
                              if rec_full["pallas_attention_calls"] else 0.0)
        hbm_traffic = rec_full["hbm_op_bytes"] + rec_full["pallas_hbm_operand_bytes"] + hbm_kv
        # loops at their trip counts: the sampler's bisections over the logits, where a row asks
        # for top-k past the cheap path or top-p. A chain's own loop has no trip count in the HLO
        # (it stops when every row is done) and counts once there: what its steps' inner loops add
        # counts once per step, like the rest of the step
        steps = max(kind.chain, 1)
        loops_extra = (rec_full["hbm_op_bytes_trips"] - rec_full["hbm_op_bytes"]) * steps
        if kind.chain:
            # XLA counts a while loop's body once: each further step adds the loop's bytes and
            # its Pallas calls' operands (the pages read are already every step's). What runs
            # once around the loop (weights relaid out before it) counts once
            bytes_accessed += (steps - 1) * (rec_full["loop_op_bytes"] + rec_full["pallas_operand_bytes"])
            hbm_traffic += (steps - 1) * (rec_full["hbm_loop_op_bytes"] + rec_full["pallas_hbm_operand_bytes"])
        hbm_scopes = set(a["hbm_bytes_by_scope"]) | set(b["hbm_bytes_by_scope"])
        hbm_by_scope = {k: scale(a["hbm_bytes_by_scope"].get(k, 0.0), b["hbm_bytes_by_scope"].get(k, 0.0))
                        for k in hbm_scopes}
        hbm_per_layer = {k: (b["hbm_bytes_by_scope"].get(k, 0.0) - a["hbm_bytes_by_scope"].get(k, 0.0)) / (L2 - L1)
                         for k in hbm_scopes}
        rec = dict(name=name, target=args.target, model=args.model, tp=tp, quantization=args.quantization,
                   kernels=args.kernels, kv_dtype=kind.kv_dtype or work.kv_dtype, rows=kind.rows, q=kind.q,
                   prefill=kind.prefill, chain=kind.chain, context=work.context, num_pages=work.num_pages,
                   compile_s=a["compile_s"], compile_s_l2=b["compile_s"], layers_compiled=[L1, L2],
                   # None where the deeper compile took no longer (the host's load varied)
                   compile_s_scaled=(scale(a["compile_s"], b["compile_s"]) if b["compile_s"] > a["compile_s"]
                                     else None),
                   n_layers=full.n_layers, hbm_bytes=target.hbm_bytes,
                   argument_bytes=rec_full["argument_bytes"], temp_bytes=rec_full["temp_bytes"],
                   output_bytes=rec_full["output_bytes"], alias_bytes=rec_full["alias_bytes"],
                   pool_bytes=rec_full["pool_bytes"], weights_bytes=weights_chip,
                   fits_hbm=rec_full["argument_bytes"] + rec_full["temp_bytes"] <= target.hbm_bytes,
                   bytes_accessed=bytes_accessed, bytes_accessed_count="xla cost analysis + pallas operands once "
                   "+ attention pages the tables name",
                   xla_bytes_accessed=rec_full["xla_bytes_accessed"], op_bytes=rec_full["op_bytes"],
                   op_bytes_over_xla=rec_full["op_bytes"] / max(rec_full["xla_bytes_accessed"], 1.0),
                   bytes_by_op=_top(by_scope), bytes_by_op_per_layer=_top(per_layer),
                   hbm_traffic_bytes=hbm_traffic, hbm_traffic_over_ideal=hbm_traffic / ideal_full["total"],
                   hbm_traffic_count="corrected, not XLA's: the HLO's ops counted as XLA counts them but only "
                   "where their arrays lie in HBM (no VMEM or scalar-memory operand or result), + pallas operands in "
                   "HBM + attention pages read from HBM",
                   hbm_bytes_by_op=_top(hbm_by_scope), hbm_bytes_by_op_per_layer=_top(hbm_per_layer),
                   hbm_traffic_loops_extra=loops_extra,
                   projected_step_ms_hbm=hbm_traffic / target.hbm_bw * 1e3, ideal_bytes=ideal_full["total"], ideal=ideal_full,
                   accessed_over_ideal=bytes_accessed / ideal_full["total"], flops=rec_full["flops"],
                   collectives=rec_full["collectives"], pool_copies=rec_full["pool_copies"],
                   pool_vmem_moves=rec_full["pool_vmem_moves"],
                   pool_copy_ops=a["pool_copies"][:4], pallas_calls=rec_full["pallas_calls"],
                   projected_step_ms=bytes_accessed / target.hbm_bw * 1e3,
                   projected_mbu=ideal_full["total"] / bytes_accessed,
                   per_depth={str(L): {k: v for k, v in r.items()
                                       if k not in ("pool_copies", "bytes_by_scope", "hbm_bytes_by_scope")}
                              for L, r in depth.items()})
        records.append(rec)
        print(json.dumps({k: rec[k] for k in ("name", "compile_s", "accessed_over_ideal", "op_bytes_over_xla",
                                              "hbm_traffic_over_ideal", "pool_copies",
                                              "temp_bytes", "alias_bytes", "pool_bytes", "projected_step_ms")}),
              file=sys.stderr)
        (args.out / "report.json").write_text(json.dumps(records, indent=1))
    return records


def _top(by_scope: dict, n: int = 10) -> list:
    """The n largest entries of a bytes-per-scope dict, largest first, as [scope, bytes]."""
    return [[k, v] for k, v in sorted(by_scope.items(), key=lambda kv: -abs(kv[1]))[:n]]


def _full_info(full: ModelConfig, info: dict, L: int) -> dict:
    """``info`` of a cut of L layers extended to the full model's layers (layer i's pools are
    those of layer i % L of the cut: the cut holds whole periods of the pattern)."""
    pools_k, pools_v = info["pools"][:L], info["pools"][L:]
    n = full.n_layers
    windowed = info["windowed"]
    return dict(info, pools=[pools_k[i % L] for i in range(n)] + [pools_v[i % L] for i in range(n)],
                windowed=tuple(windowed[i % L] for i in range(n)) if windowed else windowed)


if __name__ == "__main__":
    main()
