"""Sampling: request parameters, on-device token sampling, and host-side stop detection.

Three parts, one per side of the host/device boundary:

* ``SamplingParams`` — the public, validated per-request parameters (vLLM's names and ranges).
* ``SamplingState`` and the functions over it — per-row parameters on device, so one jitted
  ``sample`` serves a batch whose rows all sample differently. Randomness for a row depends only
  on that row's seed and the index of the token being generated, never on its batch position or
  on the other rows, so a seeded request reproduces whatever it is batched with.
* ``StopChecker`` — per-request finish detection on the host (stop strings, stop tokens, EOS,
  ``min_tokens``, ``max_tokens``) that streams text without ever retracting it.

Order of the logit transforms in ``sample`` (HF transformers' order, which the golden tests use):
penalties (vLLM semantics) -> temperature -> top-k -> top-p -> min-p -> categorical.

Why no sort: on XLA:CPU a full sort of f32[64, 49152] takes over a second and Gumbel noise for
every logit ~150 ms. So top-k/top-p are reduced to one threshold per row, found exactly from
``lax.top_k`` of a small static K (``FAST_TOPK``) and, only for rows whose nucleus or k is wider
than that, by an exact 32-step bisection over the float ordering
(``pallas_kernels.sample_threshold``: on TPU a Pallas kernel that reads a block of rows into
VMEM once for all 32 steps; elsewhere XLA's 32 passes; ``SamplerKernels`` says which).
Sampling is an inverse CDF in two levels (blocks of ``_BLOCK`` logits, then within the chosen
block) that needs two uniforms per row and keeps float32 cumulative sums short enough that
small tail probabilities are not lost.

The package: ``params`` (SamplingParams), ``device`` (SamplingState and the jitted sampler),
``stop`` (StopChecker). Every name other modules use is re-exported here, so
``from jaxinfer import sampling as smp; smp.sample(...)`` keeps working.
"""

from jaxinfer.sampling.device import (  # noqa: F401 (re-exported, private ones for the tests)
    _BLOCK,
    _FINE,
    FAST_TOPK,
    XLA_SAMPLER,
    SamplerKernels,
    SamplingState,
    _topk_topp_threshold,
    apply_penalties,
    apply_token_bitmask,
    argmax_first,
    banned_ids,
    bitmask_words,
    default_seed_for,
    filter_threshold,
    logprobs_of,
    make_sampling_state,
    mask_tokens_before_min,
    min_tokens_inputs,
    needs_vocab_state,
    penalised,
    sample,
    seed_to_key,
    update_counts,
    with_vocab_state,
    without_vocab_state,
    write_rows,
)
from jaxinfer.sampling.params import (  # noqa: F401
    GREEDY_TEMPERATURE,
    MAX_LOGPROBS,
    GuidedDecoding,
    RepetitionDetection,
    SamplingParams,
)
from jaxinfer.sampling.stop import StopChecker  # noqa: F401
from jaxinfer.sampling.verify import Verified, draft_sample, verify_block  # noqa: F401
