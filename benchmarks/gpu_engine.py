"""The engine on a lent GPU, through ``LLM.generate``, on random weights made on the device:
decode MBU and prefill MFU of an 8B Llama shape in bfloat16 and int8, and a SmolLM2 shape.
One command, nothing large carried (weights are drawn under jit from the weight
declarations, ``loaders.random_weights``; the tokenizer is a word-level one over the vocab):

    XLA_PYTHON_CLIENT_MEM_FRACTION=.92 JAX_PLATFORMS=cuda,cpu \\
        python benchmarks/gpu_engine.py --out $OUT --budget 450
    python benchmarks/gpu_engine.py --dry      # toy sizes on CPU, seconds: the script's own check

Sections, in this order, each stopping before it would start work past its share of
--budget (the whole run then ends within it; --dry runs them all), each in its own try block:
  ceilings   device copy bandwidth (bytes read + written by a large bf16 copy) and a large
             bf16 matmul's rate: the denominators of MBU and MFU
  llama8b    32 layers, d 4096, 32/8 heads of 128, FFN 14336, vocab 128256, untied (~16 GB
             bf16): decode at batch 1, 16, 64, 256 with 1,024-token prompts, and prefill of
             2,048-token prompts
  llama8b-int8   the same with weight-only int8 matmul weights (one scale per channel)
  smollm2    SmolLM2-135M's shape (30 layers, d 576, 9/3 heads, vocab 49152, tied) at batch 64

Decode: ``batch`` requests of ``prompt`` tokens, ``new`` tokens each, greedy, EOS ignored. The
decode step time is taken over the window where every row is decoding (after the last row's
first token, up to the first row's last), from the host arrival times of the first row's
tokens (``RequestMetrics.token_times``). MBU = (weight bytes + the KV bytes the step's rows
read at their mean context) / step time / copy bandwidth. Prefill: ``prefill_prompts``
prompts of 2,048 tokens, max_tokens 1, max_num_batched_tokens 2048 (one prompt per step); prefill time
= last first-token time - first scheduled time, minus one decode step per prompt; MFU =
(2 x layer parameters x tokens + causal attention's 2 x L x N x H x T^2 per prompt) / time /
the measured matmul rate (and the card's nameplate dense bf16 rate when the name is known).
The LM head runs only for the decode rows, so its parameters are left out of prefill FLOPs.

The first generate of each batch size compiles its step shapes; the timed one is the second.
Results print as a table and go to OUT/gpu_engine.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jaxinfer.models.registry import num_params
from timing import median_seconds

# dense bf16 tensor-core rates from the vendor's data sheets (SXM parts), TFLOP/s
NAMEPLATE_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


@dataclasses.dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    prompt: int  # decode prompts' tokens
    new: int  # tokens generated per decode request
    prefill_len: int  # prefill prompts' tokens
    prefill_prompts: int
    smol_batch: int
    copy_mib: int
    matmul_n: int


FULL = Sizes(batches=(1, 16, 64, 256), prompt=1024, new=48, prefill_len=2048, prefill_prompts=6, smol_batch=64,
             copy_mib=2048, matmul_n=8192)
DRY = Sizes(batches=(2,), prompt=16, new=4, prefill_len=32, prefill_prompts=1, smol_batch=2, copy_mib=8,
            matmul_n=256)


def model_configs(dry: bool) -> dict:
    """(name -> (ModelConfig, quantize)) of the shapes measured; toy sizes under --dry."""
    from jaxinfer.config import ModelConfig, RopeConfig

    if dry:
        llama = ModelConfig("llama", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=16, d_ff=128, max_position=256, tie_embeddings=False, name="toy-llama")
        smol = dataclasses.replace(llama, vocab_size=384, tie_embeddings=True, name="toy-smollm2")
    else:
        llama = ModelConfig("llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            head_dim=128, d_ff=14336, norm_eps=1e-5, rope=RopeConfig(theta=500000.0),
                            max_position=8192, tie_embeddings=False, name="llama-8b-shape")
        smol = ModelConfig("llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           head_dim=64, d_ff=1536, norm_eps=1e-5, rope=RopeConfig(theta=100000.0),
                           max_position=8192, tie_embeddings=True, name="smollm2-135m-shape")
    dtype = "float32" if dry else "bfloat16"
    llama, smol = (dataclasses.replace(c, dtype=dtype) for c in (llama, smol))
    return {"llama8b": (llama, None), "llama8b-int8": (llama, "int8"), "smollm2": (smol, None)}


def ceilings(sz: Sizes) -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured here."""
    n = sz.copy_mib * (1 << 20) // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.0009765625))  # not a no-op: every byte read and written
    t = median_seconds(copy, x, reps=10)
    m = sz.matmul_n
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    tm = median_seconds(jax.jit(lambda p, q: p @ q), a, b, reps=10)
    del x, a, b
    return {"copy_bytes": 4 * n, "copy_s": t, "copy_gbps": 4 * n / t / 1e9,
            "matmul_n": m, "matmul_tflops": 2 * m**3 / tm / 1e12}


def _llm(cfg, quantize, *, max_num_seqs: int, max_model_len: int, kv_tokens: int, prefill_chunk: int,
         num_scheduler_steps: int):
    from jaxinfer import LLM, quant
    from jaxinfer.loaders.random_weights import random_loaded

    loaded = random_loaded(cfg, quantize=quant.quant_config(quantize))
    kv_bytes = int(1.15 * kv_tokens * cfg.kv_bytes_per_token(cfg.dtype)) + (64 << 20)
    return LLM(loaded, max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_bytes,
               max_num_batched_tokens=prefill_chunk, enable_prefix_caching=False, progress=False,
               num_scheduler_steps=num_scheduler_steps)


def _weight_bytes(llm) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(llm.weights)))


def decode_run(llm, B: int, sz: Sizes, bw: float) -> dict:
    """One timed generate (after one that compiles) of B requests; the all-decoding window."""
    from jaxinfer import SamplingParams

    rng = np.random.default_rng(B)
    V = llm.cfg.vocab_size
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, V, sz.prompt)]} for _ in range(B)]
    sp = SamplingParams(temperature=0, max_tokens=sz.new, ignore_eos=True)
    c0 = llm.engine.num_compilations()
    llm.generate(prompts, sp, use_tqdm=False)
    c1 = llm.engine.num_compilations()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    start = max(o.metrics.first_token_time for o in outs)
    stop = min(o.metrics.last_token_time for o in outs)
    times = [t for t in outs[0].metrics.token_times if start <= t <= stop]
    if len(times) < 3 or times[-1] == times[0]:
        # rows never all decoded together, or every token of the window was read at the end of
        # one chain of steps (num_scheduler_steps): the first row's own span, first to last token
        times = list(outs[0].metrics.token_times)
    step = (times[-1] - times[0]) / (len(times) - 1) if times[-1] > times[0] else wall / sz.new
    cfg = llm.cfg
    ctx = sz.prompt + sz.new / 2
    kv = B * ctx * cfg.kv_bytes_per_token(llm.engine.kv_dtype)
    wb = _weight_bytes(llm)
    return {"batch": B, "step_ms": step * 1e3, "tok_s": B / step, "weight_bytes": wb, "kv_bytes": int(kv),
            "mbu": (wb + kv) / step / bw, "generate_s": wall, "built_first": c1 - c0,
            "built_second": llm.engine.num_compilations() - c1}


def prefill_run(llm, sz: Sizes, flops_rate: float, nameplate: float | None, step_s: float) -> dict:
    from jaxinfer import SamplingParams

    cfg = llm.cfg
    rng = np.random.default_rng(7)
    P, n = sz.prefill_len, sz.prefill_prompts
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, cfg.vocab_size, P)]} for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)  # compiles the prefill shapes
    outs = llm.generate(prompts, sp, use_tqdm=False)
    t = max(o.metrics.first_token_time for o in outs) - min(o.metrics.first_scheduled_time for o in outs)
    t = max(t - n * step_s, 1e-9)  # each prompt's last token goes through one decode step
    specs_params = num_params(cfg) - cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    T = n * (P - 1)  # prefill covers every prompt token but the last
    flops = 2 * specs_params * T + n * 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * (P - 1) ** 2
    out = {"prompts": n, "prompt_len": P, "prefill_s": t, "tok_s": T / t, "tflops": flops / t / 1e12,
           "mfu_measured": flops / t / flops_rate}
    if nameplate:
        out["mfu_nameplate"] = flops / t / (nameplate * 1e12)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true", help="toy sizes (runs on CPU in seconds)")
    ap.add_argument("--out", help="directory for gpu_engine.json")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds; sections stop starting work past it")
    ap.add_argument("--num-scheduler-steps", type=int, default=8,
                    help="decode steps chained on device per host round trip (1: none)")
    a = ap.parse_args(argv)
    sz = DRY if a.dry else FULL
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    nameplate = next((v for k, v in NAMEPLATE_BF16_TFLOPS.items() if k in kind), None)
    res = {"device": kind, "jax": jax.__version__, "dry": a.dry, "sizes": dataclasses.asdict(sz), "sections": {}}
    # share of the budget by which each section must have finished starting its work
    plan = [("ceilings", 0.05), ("llama8b", 0.5), ("llama8b-int8", 0.85), ("smollm2", 1.0)]

    def left(share: float) -> float:  # --dry runs every section whatever the time
        return float("inf") if a.dry else share * a.budget - (time.perf_counter() - t_start)

    ceil = None
    configs = model_configs(a.dry)
    for name, share in plan:
        if left(share) <= 0:
            res["sections"][name] = {"skipped": "budget"}
            continue
        t0 = time.perf_counter()
        try:
            if name == "ceilings":
                ceil = res["sections"][name] = ceilings(sz)
            else:
                res["sections"][name] = model_section(name, configs[name], sz, ceil, nameplate,
                                                      lambda s=share: left(s), a.dry, a.num_scheduler_steps)
        except Exception as e:  # noqa: BLE001 (one failure must not hide the other sections)
            res["sections"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        res["sections"][name]["section_s"] = time.perf_counter() - t0
        print(name, json.dumps(res["sections"][name], default=float)[:600], flush=True)
    res["total_s"] = time.perf_counter() - t_start
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_engine.json"), "w") as f:
            json.dump(res, f, indent=1, default=float)
    summary(res)
    return res


def model_section(name, cfg_q, sz: Sizes, ceil, nameplate, left, dry: bool, steps: int) -> dict:
    cfg, quantize = cfg_q
    bw = ceil["copy_gbps"] * 1e9 if ceil else float("nan")
    rate = ceil["matmul_tflops"] * 1e12 if ceil else float("nan")
    batches = (sz.smol_batch,) if name == "smollm2" else sz.batches
    prefill = name != "smollm2"
    max_len = max(sz.prompt + sz.new, sz.prefill_len + 1 if prefill else 0) + 16
    kv_tokens = max(max(batches) * (sz.prompt + sz.new), sz.prefill_prompts * (sz.prefill_len + 1))
    t0 = time.perf_counter()
    llm = _llm(cfg, quantize, max_num_seqs=max(batches), max_model_len=max_len, kv_tokens=kv_tokens,
               prefill_chunk=2048 if not dry else 32, num_scheduler_steps=steps)
    out = {"model": cfg.name, "num_scheduler_steps": steps, "quantize": quantize, "dtype": cfg.dtype, "weight_bytes": _weight_bytes(llm),
           "load_s": time.perf_counter() - t0, "decode": [], "prefill": None}
    step_b1 = None
    for B in batches:
        if left() <= 0:
            out["decode"].append({"batch": B, "skipped": "budget"})
            continue
        r = decode_run(llm, B, sz, bw)
        step_b1 = step_b1 or r["step_ms"] / 1e3
        out["decode"].append(r)
    if prefill:
        out["prefill"] = ({"skipped": "budget"} if left() <= 0 else
                          prefill_run(llm, sz, rate, nameplate, step_b1 or 0.0))
    del llm
    return out


def summary(res: dict) -> None:
    print(f"\ndevice {res['device']}, jax {res['jax']}, {res['total_s']:.0f} s{' (dry)' if res['dry'] else ''}")
    c = res["sections"].get("ceilings", {})
    if "copy_gbps" in c:
        print(f"copy {c['copy_gbps']:.0f} GB/s, bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s")
    for name, s in res["sections"].items():
        if name == "ceilings":
            continue
        if "decode" not in s:
            print(f"{name}: {s.get('skipped') or s.get('error')}")
            continue
        print(f"{name} ({s['model']}, {s['quantize'] or s['dtype']}, {s['weight_bytes'] / 1e9:.2f} GB of weights)")
        for r in s["decode"]:
            if "skipped" in r:
                print(f"  decode batch {r['batch']:4d}: skipped ({r['skipped']})")
            else:
                print(f"  decode batch {r['batch']:4d}: {r['step_ms']:8.2f} ms/step {r['tok_s']:9.0f} tok/s "
                      f"MBU {r['mbu']:.2f}  executables built {r['built_first']} then {r['built_second']}")
        p = s.get("prefill")
        if p and "skipped" not in p:
            extra = f", {p['mfu_nameplate']:.2f} of nameplate" if "mfu_nameplate" in p else ""
            print(f"  prefill {p['prompts']} x {p['prompt_len']}: {p['tok_s']:.0f} tok/s {p['tflops']:.0f} TFLOP/s "
                  f"MFU {p['mfu_measured']:.2f} of measured matmul{extra}")
        elif p:
            print(f"  prefill: skipped ({p['skipped']})")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
