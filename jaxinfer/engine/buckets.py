"""The one set of shape buckets the engine uses, so the number of executables is small and
known: batch rows, page-table widths, prefill-row tokens, logprobs, LoRA adapters in use."""

from __future__ import annotations

from typing import Sequence

BATCH_BUCKETS = (1, 4, 16, 64, 256, 512)  # powers of 4: batch 1 runs alone, few executables
PREFILL_BUCKETS = (32, 128, 512, 2048)  # tokens of the packed prefill row (capped at max_num_batched_tokens)


def bucket(n: int, buckets: Sequence[int], cap: int | None = None) -> int:
    """The smallest bucket >= n (capped at ``cap``)."""
    for b in buckets:
        if b >= n:
            return b if cap is None else min(b, cap)
    if cap is not None and n <= cap:
        return cap
    raise ValueError(f"{n=} exceeds the largest bucket {buckets[-1]}")


def width_bucket(n: int, cap: int) -> int:
    """Page-table width: 8, 16, 24, 32, then steps of about 1.5x (48, 64, 96, 128, 192, ...),
    capped at the per-sequence maximum. Decode attention reads (rows x width) pages per layer,
    so the padding above the longest row matters: powers of two left 37% of a 20-page batch
    masked, 24 leaves 17%."""
    n = max(n, 1)
    w = 8
    while w < n:
        w = w + 8 if w < 32 else (w * 3 // 2 if (w & (w - 1)) == 0 else w * 4 // 3)
    return min(w, max(cap, n))


def logprob_bucket(wanted: Sequence[int | None]) -> int:
    """Top-n width of a step's logprobs: -1 (none asked), 0, 5 or 20: three shapes, not 22."""
    asked = [n for n in wanted if n is not None]
    if not asked:
        return -1
    top = max(asked)
    return 0 if top == 0 else 5 if top <= 5 else 20


def lora_bucket(n: int, max_loras: int) -> int:
    """The active-set size of a step whose tokens use n distinct LoRA adapters (1 <= n <=
    max_loras): the next power of two, capped at max_loras, so a step shape has at most
    log2(max_loras) + 1 variants with adapters."""
    if not 1 <= n <= max_loras:
        raise ValueError(f"{n=} adapters must be between 1 and {max_loras=}")
    return min(1 << (n - 1).bit_length(), max_loras)


def lora_buckets(max_loras: int) -> list[int]:
    """Every active-set size a step may take: 1, 2, 4, ..., max_loras."""
    return sorted({lora_bucket(n, max_loras) for n in range(1, max_loras + 1)})
