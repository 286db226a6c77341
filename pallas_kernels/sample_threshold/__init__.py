"""The sampler's exact top-k and top-p thresholds: per row, the largest float c such that at
least k of the row's z = x / t are >= c (count), or such that the softmax mass
sum(exp(z - m) over z >= c) reaches a target (mass). Both are 32-step bisections over the
float ordering; the kernel runs all 32 steps over a block of rows held in VMEM, reading the
logits from HBM once instead of 32 times.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_platform
from pallas_kernels.sample_threshold.common import BlockSizes
from pallas_kernels.sample_threshold.kernel import count_threshold_kernel, fits, mass_threshold_kernel
from pallas_kernels.sample_threshold.reference import count_threshold_reference, mass_threshold_reference

__all__ = ["BlockSizes", "count_threshold", "count_threshold_kernel", "count_threshold_reference", "fits",
           "mass_threshold", "mass_threshold_kernel", "mass_threshold_reference"]


def _use_kernel(interpret: bool, platform: str | None) -> bool:
    # TPU only: on GPU XLA's fused reduction streams the row at bandwidth and there is no
    # Triton variant; on CPU the reference is the fast path
    return interpret or resolve_platform(platform) == "tpu"


def count_threshold(x, t, k, *, block_sizes: BlockSizes | None = None, interpret: bool = False,
                    platform: str | None = None) -> jax.Array:
    """Dispatch: the Pallas kernel on TPU (or anywhere with interpret=True), else the reference;
    ``platform``: where it runs ("cpu", "gpu", "tpu"; None: the default backend's)."""
    fn = count_threshold_kernel if _use_kernel(interpret, platform) else count_threshold_reference
    return fn(x, t, k, block_sizes=block_sizes, interpret=interpret, platform=platform)


def mass_threshold(x, t, m, target, *, block_sizes: BlockSizes | None = None, interpret: bool = False,
                   platform: str | None = None) -> jax.Array:
    """Dispatch as ``count_threshold``."""
    fn = mass_threshold_kernel if _use_kernel(interpret, platform) else mass_threshold_reference
    return fn(x, t, m, target, block_sizes=block_sizes, interpret=interpret, platform=platform)
