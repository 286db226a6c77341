"""Images per second through Gemma 3's image encoder (SigLIP tower + projector) on this host,
at the published checkpoints' size (So400m: 27 layers of width 1152, 896 x 896 pixels in 4,096
patches, 256 soft tokens of the 4B's width 2560), with random weights.

    python benchmarks/image_encoder.py --images 1 2 --layers 27 [--dtype float32]

prints one JSON line per batch size: compile seconds, seconds per call (best of --repeat after
a warm-up) and images per second. What an image adds to the time to first token is the encode
time of its batch plus the prefill of its 256 soft tokens (the text model's, not measured here).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from jaxinfer.models import siglip
from jaxinfer.specs import init_weights

SO400M = dict(d_model=1152, n_layers=27, n_heads=16, d_ff=4304, image_size=896, patch_size=14, mm_tokens=256,
              text_d_model=2560)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    cfg = siglip.VisionConfig(**(SO400M | {"n_layers": a.layers}), dtype=a.dtype)
    w = init_weights(siglip.weight_specs(cfg), cfg, jax.random.key(0))
    for n in a.images:
        px = np.random.default_rng(0).standard_normal((n, 3, cfg.image_size, cfg.image_size), np.float32)
        t0 = time.perf_counter()
        siglip.encode_jit(w, px, cfg=cfg).block_until_ready()
        first = time.perf_counter() - t0
        best = float("inf")
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            siglip.encode_jit(w, px, cfg=cfg).block_until_ready()
            best = min(best, time.perf_counter() - t0)
        print(json.dumps({"images": n, "layers": a.layers, "dtype": a.dtype, "compile_and_first_s": round(first, 2),
                          "call_s": round(best, 3), "images_per_s": round(n / best, 3)}), flush=True)


if __name__ == "__main__":
    main()
