"""Compile the engine's sampler apart (``step.sample_rows`` jitted alone with the slots donated,
as ``Engine.separate_sampler`` runs it; ``aot.lower_sampler``) for a TPU target on this host
(libtpu, no TPU needed) under each kernel choice, and print its byte counts as JSON lines:

    python benchmarks/sampler_compile.py --target v6e-1 --model llama-3-8b --rows 256 --kernels xla pallas

* ``xla_bytes_accessed``: XLA's cost analysis (nothing for a Pallas call; a conditional's
  dearest branch, a loop's body once); ``pallas_operand_bytes``: the Pallas calls' operands and
  results once each (the threshold kernels read their row blocks once);
* ``hbm_op_bytes``: ``jaxinfer.hlo_bytes``'s op by op count of what lies in HBM (which leaves
  the Pallas calls out), ``pallas_hbm_operand_bytes`` the calls' operands and results in HBM
  once, ``hbm_traffic_bytes`` the two together;
* ``hbm_traffic_loops_extra``: what the loops' further trips add (the bisections' 32 passes
  over the logits where XLA runs them; a kernel's loop runs over VMEM, not in the HLO), and
  ``hbm_traffic_with_loops`` the step's HBM traffic when a row takes both bisections.

Projections from a compile: nothing runs.
"""

from __future__ import annotations

import argparse
import json
import time

from tpu_compile import model_config

from jaxinfer import aot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="v6e-1", choices=list(aot.TARGETS))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--kernels", nargs="+", default=["xla", "pallas"], choices=["xla", "pallas"])
    args = ap.parse_args()
    import jax

    cfg = model_config(args.model)
    mesh = aot.target_mesh(args.target, model=1)
    for option in args.kernels:
        kernels = aot.target_kernels(mesh, option)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = aot.lower_sampler(cfg, mesh, args.rows, kernels=kernels).compile()
        rec = aot.analyse(compiled, {"pools": []})
        traffic = rec["hbm_op_bytes"] + rec["pallas_hbm_operand_bytes"]
        loops = rec["hbm_op_bytes_trips"] - rec["hbm_op_bytes"]
        print(json.dumps(dict(
            target=args.target, model=args.model, rows=args.rows, vocab=cfg.vocab_size, kernels=option,
            compile_s=round(time.perf_counter() - t0, 1), pallas_calls=rec["pallas_calls"],
            xla_bytes_accessed=rec["xla_bytes_accessed"], pallas_operand_bytes=rec["pallas_operand_bytes"],
            hbm_op_bytes=rec["hbm_op_bytes"], pallas_hbm_operand_bytes=rec["pallas_hbm_operand_bytes"],
            hbm_traffic_bytes=traffic, hbm_traffic_loops_extra=loops, hbm_traffic_with_loops=traffic + loops)),
            flush=True)


if __name__ == "__main__":
    main()
