"""What one speculative verification step costs on device, in plain decode steps: the bound on
speculation's speedup at a given number of tokens per block.

Two engines on the real SmolLM2 (float32; one plain, one with an EAGLE head) each answer a chat
prompt; one real batch of each is captured mid-answer. Then the engines' own jitted steps re-run
those batches back to back (no host reads between them, as chained steps run), the two kinds
interleaved per round; medians of the rounds.

    python benchmarks/spec_step_cost.py --k 2 --rounds 9
    python benchmarks/spec_step_cost.py --without drafts entries verification

``--without`` takes parts out of the verification step to see what they cost (the step then
computes wrong tokens; only its time means anything): ``drafts`` (the head's passes after the
entry pass), ``entries`` (the head's entry pass), ``verification`` (``verify_block``).
Speedup bound = tokens per block x plain ms / verification ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

PROMPT = "Write a short story about a robot who learns to paint."


def _take_out(parts) -> None:
    """Replace parts of the verification step by stand-ins of the same shapes (before tracing)."""
    from jaxinfer.engine import verify as verify_step
    from jaxinfer.sampling import verify

    if "drafts" in parts:
        verify_step._eagle_drafts = lambda eagle, weights, g0, start, batch, eagle_kv, k, **kw: (
            jnp.zeros((batch.rows, k), jnp.int32) + g0[:, :1].astype(jnp.int32), eagle_kv)
    if "entries" in parts:
        verify_step.eagle_entry_pass = lambda eagle, weights, h, batch, nxt, eagle_kv, **kw: (h[0], eagle_kv)
    if "verification" in parts:
        def verify_block(logits, drafts, num_drafts, state, *a, **k):
            amax = jnp.argmax(logits[:, :, :64], -1).astype(jnp.int32)
            return verify.Verified(jnp.zeros(logits.shape[0], jnp.int32), amax, state)

        verify_step.smp.verify_block = verify_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--eagle", default="checkpoints/eagle-smollm2-135m-instruct")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--quantization", default="int8", choices=["none", "int8"], help="the EAGLE head's weights")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=30, help="steps per round")
    ap.add_argument("--tokens-per-block", type=float, default=1.436, help="for the bound (the engine's chat figure)")
    ap.add_argument("--without", nargs="*", default=[], choices=["drafts", "entries", "verification"])
    args = ap.parse_args()

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine import engine

    _take_out(args.without)
    captured = {}
    E = engine.Engine
    run_step = E.run_step

    def capture(self, batch, **kw):  # the one engine step: a verification step carries drafts
        which = "plain" if kw.get("drafts") is None else "spec"
        if which not in captured and (which == "spec") == (self.spec is not None) and self.stats["decode_steps"] > 40:
            host = jax.tree.map(np.asarray, batch)
            captured[which] = (lambda: run_step(self, host, **dict(kw, guide=None)), self, host)
        return run_step(self, batch, **kw)

    E.run_step = capture
    spec = {"method": "eagle", "num_speculative_tokens": args.k, "model": args.eagle,
            "quantization": None if args.quantization == "none" else args.quantization}
    llms = {"plain": LLM(args.model, progress=False, max_model_len=1024, max_num_seqs=16),
            "spec": LLM(args.model, progress=False, max_model_len=1024, max_num_seqs=16, speculative_config=spec)}
    for llm in llms.values():
        llm.chat([[{"role": "user", "content": PROMPT}]], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
    E.run_step = run_step

    def rate(which: str) -> float:
        call, eng, _ = captured[which]
        for _ in range(3):
            out = call()
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            out = call()
        jax.block_until_ready((out, eng.k_pages))
        return (time.perf_counter() - t0) / args.calls * 1e3

    ms = {"plain": [], "spec": []}
    for _ in range(args.rounds):
        for which, times in ms.items():
            times.append(rate(which))
    p, s = statistics.median(ms["plain"]), statistics.median(ms["spec"])
    print(f"plain step {p:.2f} ms, verification step (k = {args.k}{', without ' + ' '.join(args.without) if args.without else ''}) "
          f"{s:.2f} ms: {s / p:.3f} plain steps; bound at {args.tokens_per_block} tokens per block: "
          f"{args.tokens_per_block * p / s:.3f}x")


if __name__ == "__main__":
    main()
