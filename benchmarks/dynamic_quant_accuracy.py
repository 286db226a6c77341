"""What weight-only int8 would lose by quantizing its activations on the fly, per group of
input channels (OpenVINO's CPU plugin does so by default for compressed weights:
DYNAMIC_QUANTIZATION_GROUP_SIZE), which would let its matmuls run in integers like w8a8's.

Each weight-only int8 matmul's input x [M, I] is rounded per row and per group of ``G`` input
channels to ``bits``-bit symmetric integers (scale max|x| / (2^(bits-1) - 1)) and multiplied in
float by the int8 weight: the products an integer kernel with per-group float scales computes,
up to float32 summation order (a group's integer sum is exact in float32). Reported against
float32 weights: perplexity on benchmarks/data/english.txt (windows of 512 advancing by 256,
as benchmarks/quant_accuracy.py) and teacher-forced greedy agreement with the golden
continuations (tests/golden; the int8 tests require every position of "france" and
"chat_capital", 16 tokens each).

    python benchmarks/dynamic_quant_accuracy.py [--groups 32 64 0] [--bits 8 7]

(group 0: one scale per row, i.e. per token.) Heavy: one perplexity pass per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's jaxinfer, not an installed one


def fake_quant(x, group: int, bits: int):
    """x [M, I] rounded per row and group of ``group`` channels (0: the whole row) to
    ``bits``-bit symmetric integers, then scaled back."""
    import jax.numpy as jnp

    M, I = x.shape
    g = I if group == 0 or I % group else group
    top = 2.0 ** (bits - 1) - 1
    xg = x.astype(jnp.float32).reshape(M, I // g, g)
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    return (jnp.clip(jnp.round(xg / scale), -top, top) * scale).reshape(M, I).astype(x.dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--golden", default=str(ROOT / "tests/golden/smollm2-135m-instruct.json"))
    ap.add_argument("--text", default=str(ROOT / "benchmarks/data/english.txt"))
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 64, 0])
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 7])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer import LLM, dispatch, quant
    from jaxinfer.evaluate import perplexity
    from jaxinfer.models import llama

    cases = json.loads(Path(a.golden).read_text())["prompts"]
    text = Path(a.text).read_text()
    n = 16
    seqs = [c["prompt_ids"] + c["greedy_ids"][:n] for c in cases]
    T = max(map(len, seqs))
    tokens = jnp.asarray([s + [0] * (T - len(s)) for s in seqs], jnp.int32)  # right padding: causal

    def greedy(llm) -> tuple[float, list[str]]:
        """Teacher-forced: the share of positions whose argmax is the golden token, and the
        cases whose 16 positions all are."""
        cfg = llm.cfg
        fwd = jax.jit(lambda w, t: llama.unembed(w, llama.forward(w, t, jnp.zeros(len(seqs), jnp.int32), None,
                                                                  cfg=cfg, read_cache=False)[0], cfg))
        argmax = np.asarray(jnp.argmax(fwd(llm.weights, tokens), axis=-1))
        hits, whole = 0, []
        for row, c in zip(argmax, cases):
            p = len(c["prompt_ids"])
            same = np.asarray(row[p - 1 : p - 1 + n]) == np.asarray(c["greedy_ids"][:n])
            hits += int(same.sum())
            if same.all():
                whole.append(c["name"])
        return hits / (n * len(cases)), whole

    real_matmul = dispatch.matmul
    rows = []

    def run(label, scheme, group=None, bits=None):
        if group is None:
            dispatch.matmul = real_matmul
        else:
            def patched(w, x, group=group, bits=bits):
                if isinstance(w, quant.QuantArray) and w.scheme == quant.QuantScheme.INT8:
                    x = fake_quant(x, group, bits)
                return real_matmul(w, x)
            dispatch.matmul = patched
        jax.clear_caches()  # the jitted forward must trace the patched matmul
        llm = LLM(a.model, quantization=scheme, max_model_len=512, progress=False)
        t = time.perf_counter()
        ppl = perplexity(llm, text, window=512, stride=256)
        agree, whole = greedy(llm)
        rows.append({"setting": label, "perplexity": ppl.perplexity, "tokens": ppl.tokens,
                     "greedy_agreement": agree, "cases_whole": whole, "seconds": time.perf_counter() - t})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        dispatch.matmul = real_matmul

    run("float32", None)
    run("int8 (weight-only, exact)", "int8")
    for bits in a.bits:
        for group in a.groups:
            run(f"int8, activations {bits}-bit per {'row' if group == 0 else f'group of {group}'}", "int8", group, bits)
    ref = rows[0]
    print(f"{a.model}: perplexity over {ref['tokens']} tokens of {Path(a.text).name} (window 512, stride 256); "
          f"teacher-forced greedy over {len(cases)} golden prompts x {n} tokens; load average "
          f"{os.getloadavg()[0]:.1f} at end\n")
    print("| setting | perplexity | / float32 | greedy = golden | france, chat_capital whole |")
    print("|---|---|---|---|---|")
    for r in rows:
        both = all(c in r["cases_whole"] for c in ("france", "chat_capital"))
        print(f"| {r['setting']} | {r['perplexity']:.3f} | {r['perplexity'] / ref['perplexity']:.4f} "
              f"| {r['greedy_agreement']:.3f} | {'yes' if both else 'no'} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
