"""Blockwise speculative verification: how many of k drafted tokens a row accepts, and the
token that follows them, from the target's logits at the k + 1 positions.

Inputs are the target's logits already shaped by the sampler (penalties, min-tokens mask,
temperature) as z f32[B, k+1, V], and each position's filter threshold thr f32[B, k+1]
(top-k, top-p and min-p keep z >= thr). Greedy rows accept the longest prefix of drafts equal
to the argmax and add the argmax after it (Stern et al. 2018); sampled rows run rejection
sampling against the draft's distribution (a point mass when ``draft_probs`` is None), so the
output is distributed exactly as sampling from the target alone.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_platform
from pallas_kernels.spec_verify.common import BlockSizes
from pallas_kernels.spec_verify.kernel import spec_verify_kernel
from pallas_kernels.spec_verify.reference import spec_verify_reference

__all__ = ["BlockSizes", "spec_verify", "spec_verify_kernel", "spec_verify_reference"]


def spec_verify(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs=None, *,
                block_sizes: BlockSizes | None = None, interpret: bool = False,
                platform: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Dispatch: the Pallas kernel on TPU (or anywhere with interpret=True), else the reference;
    ``platform``: where it runs ("cpu", "gpu", "tpu"; None: the default backend's).
    On GPU the reference stays: the Triton variant compiles and equals it, but on an H100 it
    ran slower than XLA's fusion of the reference (175 vs 124 us at B = 64, k = 4, V = 49152;
    benchmarks/RESULTS.md, "GPU kernels (NVIDIA H100)"); ``spec_verify_kernel`` still runs it
    there."""
    use = interpret or resolve_platform(platform) == "tpu"
    fn = spec_verify_kernel if use else spec_verify_reference
    return fn(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs, block_sizes=block_sizes, interpret=interpret,
              platform=platform)
