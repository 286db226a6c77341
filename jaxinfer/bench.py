"""Reproducible synthetic workloads and the serving metrics computed over them.

A workload is a list of requests drawn from a seed: prompt lengths and output lengths from
uniform ranges, prompts made of real text (a fixed English passage, cycled and cut at a
random offset) so tokenizers see natural input, and an optional shared prefix (a long
"system prompt") on a given share of the requests.
"""

from __future__ import annotations

import dataclasses
import random

PASSAGE = (
    "The history of the printing press is closely tied to the spread of literacy in Europe. "
    "Before Johannes Gutenberg built his press in Mainz around 1440, books were copied by hand, "
    "usually by monks working in scriptoria, and a single volume could take months to finish. "
    "Movable metal type, oil-based ink and a screw press adapted from wine making allowed a small "
    "workshop to produce hundreds of identical pages in a day. Within fifty years, presses were "
    "operating in more than two hundred cities, and millions of books had been printed. Pamphlets, "
    "newspapers and scientific journals followed, and ideas could now travel faster than ever. "
    "Rivers carved the valleys where the first towns grew; merchants followed the water, and "
    "with them came scribes, accountants and teachers. A ledger kept in one city could be copied "
    "and read in another within weeks, and prices, recipes, maps and songs moved with it. "
)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 128
    prompt_len: tuple[int, int] = (25, 250)  # tokens, inclusive range
    output_len: tuple[int, int] = (64, 64)
    shared_prefix_len: int = 0  # tokens of a common prefix
    shared_prefix_share: float = 0.0  # fraction of requests that carry it
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


def make_workload(spec: WorkloadSpec, tokenizer) -> list[BenchRequest]:
    """Token-exact prompts: lengths are counted in the model's own tokens."""
    rng = random.Random(spec.seed)
    text_ids = tokenizer.encode(PASSAGE * 40, add_special_tokens=False)
    prefix = text_ids[-spec.shared_prefix_len:] if spec.shared_prefix_len else []
    out = []
    for _ in range(spec.num_requests):
        n = rng.randint(*spec.prompt_len)
        start = rng.randrange(0, len(text_ids) - n)
        body = text_ids[start : start + n]
        if prefix and rng.random() < spec.shared_prefix_share:
            body = prefix + body
        out.append(BenchRequest(body, rng.randint(*spec.output_len)))
    return out
