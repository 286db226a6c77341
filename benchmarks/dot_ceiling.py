"""The matmul ceiling of the batch workload (``workload.py``) on this CPU: XLA's float32 dot
against torch's float32 and bfloat16 matmuls at SmolLM2-135M's weight shapes, side by side,
and the workload time those rates bound.

    python benchmarks/dot_ceiling.py --m 64 256 512 --repeats 15

Each engine runs in its own subprocess (in one process XLA's spinning thread pool starves
torch's threads: torch read 3-20x slow that way), the engines alternate over ``--rounds``
rounds, and each figure is the median over every round's timings (2 threads for torch as for
XLA's 2 cores). The workload (128 requests, 18,742 prompt and 8,192 output
tokens) spends its matmul FLOPs in prefill rows (every layer's projections, no LM head: a
prompt's logits are only needed at its last token) and decode rows (projections plus the
576 x 49,152 LM head); ``--workload`` prints the seconds each engine needs for those FLOPs
alone at its measured rates, i.e. the fastest it could run the workload if nothing but the
matmuls took time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

# SmolLM2-135M: D 576, 9 query / 3 KV heads of 64, F 1536, V 49152, 30 layers
LAYER = {"wq": (576, 576), "wk": (576, 192), "wv": (576, 192), "wo": (576, 576),
         "w_gate": (576, 1536), "w_up": (576, 1536), "w_down": (1536, 576)}
HEAD = (576, 49152)
LAYERS = 30
PROMPT_TOKENS, OUTPUT_TOKENS = 18742, 8192  # the workload of benchmarks/workload.py


def _xla(m, k, n):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    w = jnp.asarray(rng.standard_normal((k, n), np.float32))
    f = jax.jit(lambda x, w: x @ w)
    f(x, w).block_until_ready()
    return lambda: f(x, w).block_until_ready()


def _xla_s8(m, k, n):
    """The w8a8 dot: int8 x int8 -> int32, as ``quant.s8_dot`` runs it (scales left out)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-127, 128, (m, k), dtype=np.int8))
    w = jnp.asarray(rng.integers(-127, 128, (k, n), dtype=np.int8))
    f = jax.jit(lambda x, w: jax.lax.dot(x, w, preferred_element_type=jnp.int32))
    f(x, w).block_until_ready()
    return lambda: f(x, w).block_until_ready()


def _torch(m, k, n, dtype):
    import torch

    torch.set_num_threads(2)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    x = torch.randn(m, k, dtype=dt)
    w = torch.randn(k, n, dtype=dt)

    def run():
        with torch.inference_mode():
            x @ w

    run()
    return run


def _time(fn, n):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(engine: str, ms, repeats: int) -> dict:
    """Median seconds of each (shape, M) on one engine, in this process."""
    shapes = dict(LAYER, lm_head=HEAD)
    out = {}
    for m in ms:
        for name, (k, n) in shapes.items():
            if engine == "xla f32":
                fn = _xla(m, k, n)
            elif engine == "xla s8":
                fn = _xla_s8(m, k, n)
            else:
                fn = _torch(m, k, n, {"torch f32": "float32", "torch bf16": "bfloat16"}[engine])
            out[f"{name}@{m}"] = _time(fn, repeats)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["xla f32", "xla s8", "torch f32", "torch bf16"])
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(measure(a.worker, a.m, a.repeats)))
        return
    samples = {e: {} for e in a.engines}
    for _ in range(a.rounds):
        for e in a.engines:
            p = subprocess.run([sys.executable, __file__, "--worker", e, "--repeats", str(a.repeats), "--m",
                                *map(str, a.m)], capture_output=True, text=True)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{e} failed: {p.stderr[-2000:]}")
            for key, ts in json.loads(line[7:]).items():
                samples[e].setdefault(key, []).extend(ts)
    shapes = dict(LAYER, lm_head=HEAD)
    rates = {}  # (engine, M) -> (GFLOP/s over a layer's projections, GFLOP/s of the LM head)
    print(f"{'shape':8s} {'M':>5s} " + " ".join(f"{e:>12s}" for e in a.engines) + "   (GFLOP/s or GOP/s, medians)")
    for m in a.m:
        layer_s = {e: 0.0 for e in a.engines}
        head_s = {e: 0.0 for e in a.engines}
        for name, (k, n) in shapes.items():
            med = {e: statistics.median(samples[e][f"{name}@{m}"]) for e in a.engines}
            print(f"{name:8s} {m:5d} " + " ".join(f"{2 * m * k * n / med[e] / 1e9:12.1f}" for e in a.engines))
            for e in a.engines:
                if name == "lm_head":
                    head_s[e] += med[e]
                else:
                    layer_s[e] += med[e]
        layer_flops = 2 * m * sum(k * n for k, n in LAYER.values())
        for e in a.engines:
            rates[(e, m)] = (layer_flops / layer_s[e], 2 * m * HEAD[0] * HEAD[1] / head_s[e])
    print("\nworkload matmul time at these rates (prefill at the largest M, decode at M = 64 if measured):")
    pm, dm = max(a.m), 64 if 64 in a.m else min(a.m)
    layer_flops_tok = 2 * sum(k * n for k, n in LAYER.values()) * LAYERS
    head_flops_tok = 2 * HEAD[0] * HEAD[1]
    for e in a.engines:
        pre = PROMPT_TOKENS * layer_flops_tok / rates[(e, pm)][0]
        dec = OUTPUT_TOKENS * (layer_flops_tok / rates[(e, dm)][0] + head_flops_tok / rates[(e, dm)][1])
        print(f"  {e:10s} prefill {pre:6.1f} s + decode {dec:6.1f} s = {pre + dec:6.1f} s"
              f" -> at most {OUTPUT_TOKENS / (pre + dec):6.1f} output tok/s")


if __name__ == "__main__":
    main()
