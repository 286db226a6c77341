"""Compile what a step runs past its layers for a TPU (libtpu on this host, no TPU needed) and
count its bytes op by op: the plain sampler's own executable at R rows (``aot.lower_sampler``)
and a verification step's LM head and verdict at R rows of k drafts (``aot.lower_verification``).
These compile in a minute at an 8B model's vocabulary, where the whole step takes minutes a
layer (``tpu_compile.py``).

    pip install -e '.[tpu]'
    python benchmarks/sampler_tpu_bytes.py --target v6e-1 --model llama-3-8b --pieces sampler-256 verify-4x64 --out DIR

writes ``DIR/report.json`` (one record per piece) and each piece's optimized HLO as
``DIR/<piece>.hlo.txt``. Per piece: XLA's bytes accessed; ``jaxinfer.hlo_bytes``' count of it
op by op and its HBM-only count (``hbm_bytes``; a conditional's dearest branch, a loop's body
once), with each loop counted per trip (``hbm_bytes_trips``: the bisections over the logits);
the top ops by HBM bytes; and ``logits_relayouts``, every op that writes a logits-sized array
into another layout (``hlo_bytes.relayouts``), with the computation it sits in (``main``: every
step, not only when a row samples). Projections from a compile: nothing runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tpu_compile import HF_CONFIGS, PRESETS, model_config  # noqa: E402

from jaxinfer import aot, hlo_bytes  # noqa: E402


def piece(name: str) -> tuple[str, int, int]:
    """("sampler", rows, 1) from "sampler-R"; ("verify", rows, k + 1) from "verify-KxR"."""
    kind, _, size = name.partition("-")
    try:
        if kind == "sampler":
            return kind, int(size), 1
        if kind == "verify":
            k, rows = size.split("x")
            return kind, int(rows), int(k) + 1
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{name!r} is not sampler-R or verify-KxR (e.g. sampler-256, verify-4x64)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="v6e-1", choices=sorted(aot.TARGETS))
    ap.add_argument("--model", default="llama-3-8b", choices=[*HF_CONFIGS, *PRESETS])
    ap.add_argument("--pieces", nargs="+", default=["sampler-256", "verify-4x64"])
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    try:
        pieces = {name: piece(name) for name in args.pieces}
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))

    cfg = model_config(args.model)
    mesh = aot.target_mesh(args.target, model=1)
    kernels = aot.target_kernels(mesh)
    weights, _ = aot.abstract_weights(cfg, mesh, kernels)
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for name, (kind, rows, q) in pieces.items():
        t0 = time.time()
        with jax.set_mesh(mesh):
            lowered = (aot.lower_sampler(cfg, mesh, rows) if kind == "sampler"
                       else aot.lower_verification(cfg, weights, mesh, kernels, rows, q))
            compiled = lowered.compile()
        compile_s = time.time() - t0
        text = compiled.as_text()
        (args.out / f"{name}.hlo.txt").write_text(text)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        _, entry = hlo_bytes.parse(text)
        hbm = hlo_bytes.bytes_by_op(text, hbm=True, top=8)
        rec = dict(piece=name, target=args.target, model=args.model, rows=rows * q, vocab=cfg.vocab_size,
                   compile_s=round(compile_s, 1), xla_bytes_accessed=cost["bytes accessed"],
                   op_bytes=hlo_bytes.bytes_by_op(text)["total"], hbm_bytes=hbm["total"],
                   hbm_bytes_trips=hlo_bytes.bytes_by_op(text, hbm=True, trips=True)["total"],
                   temp_bytes=compiled.memory_analysis().temp_size_in_bytes, hbm_top=hbm["top"],
                   logits_relayouts=[dict(r, computation="main" if r["computation"] == entry else r["computation"])
                                     for r in hlo_bytes.relayouts(text, rows * q * cfg.vocab_size)])
        records.append(rec)
        print(f"{name}: compiled in {compile_s:.0f} s; XLA {rec['xla_bytes_accessed'] / 1e9:.3f} GB, "
              f"HBM {rec['hbm_bytes'] / 1e9:.3f} GB ({rec['hbm_bytes_trips'] / 1e9:.3f} with loops' trips), "
              f"temp {rec['temp_bytes'] / 1e9:.3f} GB, {len(rec['logits_relayouts'])} logits relayouts "
              f"({sum(r['computation'] == 'main' for r in rec['logits_relayouts'])} outside conditionals)")
        for r in hbm["top"]:
            print(f"  {r['bytes'] / 1e9:7.3f} GB  {r['scope'][:80]}  {r['type'][:60]}")
    (args.out / "report.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
