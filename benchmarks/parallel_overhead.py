"""What tensor and data parallelism cost on a CPU box: SmolLM2 135M on 8 virtual XLA CPU devices
(which share the machine's cores, so no layout can be faster than one device here; the point is
that none collapses). For each layout: load, one untimed pass (compiles every shape), then
REPEATS timed passes of the same workload; the median output tok/s is reported.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python benchmarks/parallel_overhead.py [layouts, default 1,3,2x1,2x3]

A layout is T (tensor parallel) or DxT (data x tensor parallel). SmolLM2 has 9 query heads:
TP 2 and 4 do not divide them (the engine refuses), so its TP sizes are 1, 3 and 9.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax

from jaxinfer import LLM, SamplingParams, registry

PROMPTS = [f"Write one sentence about the number {i}." for i in range(8)]
MAX_TOKENS = 32
REPEATS = 3


def main():
    assert len(jax.devices()) >= 6, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    layouts = (sys.argv[1] if len(sys.argv) > 1 else "1,3,2x1,2x3").split(",")
    path = str(registry.fetch("smollm2-135m-instruct", progress=False))
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = None
    for lay in layouts:
        dp, tp = (int(x) for x in lay.split("x")) if "x" in lay else (1, int(lay))
        llm = LLM(path, progress=False, max_model_len=256, max_num_seqs=8, tensor_parallel_size=tp,
                  data_parallel_size=dp)
        llm.generate(PROMPTS, sp, use_tqdm=False)  # compiles
        rates = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            outs = llm.generate(PROMPTS, sp, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        med = statistics.median(rates)
        base = base or med
        print(f"DP {dp} x TP {tp}: {med:7.1f} output tok/s (median of {REPEATS}: "
              f"{', '.join(f'{r:.1f}' for r in rates)}), {med / base:.2f}x one device", flush=True)
        del llm


if __name__ == "__main__":
    main()
