"""Pallas kernels for LLM inference, each beside a pure-JAX reference of the same signature.

One small package per op:

  ragged_paged_attention
                    query segments of any length (decode rows of 1..q tokens, prompt
                    chunks with or without cached history) in one call, each reading its
                    sequence's pages in place; causal, GQA/MQA, sliding window, soft-cap.
                    The packed engine step's attention on TPU/GPU.
  paged_attention   paged decode attention: one query token per sequence over its pages,
                    the G query heads of a kv head in one tile. The packed engine step's
                    attention on TPU/GPU when every row decodes one token.
  quant_matmul      int8 x int8 -> int32 matmul with per-token and per-channel scales, and
                    weight-only int8 / packed-int4 matmuls that dequantize inside the kernel.
  grouped_matmul    rows sorted by group, each group's rows times its own weight (float,
                    int8 or packed int4): a mixture-of-experts layer's expert matmuls,
                    reading each expert's weight about once; megablox's schedule. Also
                    ``grouped_matmul_xla``, that schedule as a plain JAX loop, for XLA CPU
                    (where the reference, ``ragged_dot``, computes every group for every row).
  spec_verify       blockwise speculative verification: accepted lengths and the next token
                    per row from the target's logits at k + 1 positions (greedy prefix match
                    or rejection sampling), streamed over the vocabulary.
  sample_threshold  the sampler's exact top-k and top-p thresholds (32-step bisections over
                    the float ordering), a block of rows read into VMEM once for all 32
                    steps (``count_threshold``, ``mass_threshold``; TPU only).

Each package exports, for its op ``op``:
  ``op``            dispatch: the Pallas kernel on TPU/GPU (or anywhere with
                    ``interpret=True``), the reference elsewhere; decided at call time
                    from the keyword ``platform`` ("cpu", "gpu", "tpu": where the
                    caller's devices are; None: the default backend's), so that a
                    program for a TPU compiles on a CPU host.
  ``op_kernel``     the Pallas kernel (Mosaic on TPU, Triton on GPU, by ``platform``;
                    on CPU it needs ``interpret=True`` and runs the TPU variant). On a
                    mesh the caller runs it inside ``shard_map``: XLA cannot partition
                    a Mosaic or Triton call.
  ``op_reference``  the pure-JAX reference, same signature (static options, the
                    platform among them, are ignored).
  ``BlockSizes``    frozen dataclass of the kernel's tile sizes.

This package imports nothing from ``jaxinfer``. Shape letters: B batch, T query tokens,
S key/value length, N query heads, K kv heads, G = N // K, H head dim, P pages, M rows,
I contracted (input) size, O output size.
"""
