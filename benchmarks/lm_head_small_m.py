"""What a verification step's LM head costs on XLA CPU: SmolLM2's tied head (logits = x @ E^T,
E f32[49152, 576], 113 MB) at M = 1 (plain batch-1 decoding), 2, 5 (ngram's k = 4) and 9 query
rows, written three ways: the dot the model runs, the same as a broadcast multiply and sum
(which XLA fuses into a reduction instead of calling its matmul), and the dot over 4,096-row
slices of E. Medians of 20 calls each.

    python benchmarks/lm_head_small_m.py
    XLA_FLAGS=--xla_cpu_use_onednn=true python benchmarks/lm_head_small_m.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

V, D = 49152, 576
WAYS = {
    "dot (the model's)": lambda x, E: jnp.einsum("md,vd->mv", x, E),
    "multiply + sum": lambda x, E: (E[None, :, :] * x[:, None, :]).sum(-1),
    "dot over slices": lambda x, E: jnp.concatenate(
        [jnp.einsum("md,vd->mv", x, E[i : i + 4096]) for i in range(0, V, 4096)], axis=1),
}


def main():
    rng = np.random.default_rng(0)
    E = jnp.asarray(rng.standard_normal((V, D), np.float32) * 0.05)
    fns = {name: jax.jit(f) for name, f in WAYS.items()}
    print(f"LM head {V} x {D} float32 ({V * D * 4 / 1e6:.0f} MB); ms per call, median of 20")
    for M in (1, 2, 5, 9):
        x = jnp.asarray(rng.standard_normal((M, D), np.float32))
        want = np.asarray(fns["dot (the model's)"](x, E))
        row = []
        for name, f in fns.items():
            np.testing.assert_allclose(np.asarray(f(x, E)), want, atol=1e-3)
            ts = []
            for _ in range(20):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, E))
                ts.append(time.perf_counter() - t0)
            row.append(f"{name} {statistics.median(ts) * 1e3:6.2f}")
        print(f"M = {M}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
