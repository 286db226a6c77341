"""Which Medusa head recipe reaches a first-head acceptance of 0.5 on SmolLM2? Offline, on the
model's own greedy answers (``train_medusa.self_distill``), held-out topics, answer positions
only (what decoding drafts from). Three recipes, the same data, steps and optimizer:

* A: the committed recipe: one residual block per head on h_t, every position trained;
* B: the same heads trained on answer positions only;
* C: heads also fed the embedding of token t + 1 (the target's own next token, known when the
  heads draft after a verification step), answer positions only (Hydra-style conditioning).

    pip install -e '.[train]'   # optax, which the training needs
    python benchmarks/medusa_recipes.py --train 160 --heldout 32 --max-tokens 96 --steps 300
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer import LLM, SamplingParams
from jaxinfer import train_medusa as tm
from jaxinfer.models.registry import model_family

HEADS = 3


def _data(llm, prompts, max_tokens):
    """(h f32[N, D], targets i32[N, K], next token i32[N], answer bool[N]) over every position."""
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    h, t = tm.positions(llm, seqs, HEADS)
    nxt = [np.asarray(s[1:-1]) for s in seqs]  # position p's next token
    # position p counts when token p + 1 is an answer token
    ans = [np.arange(1, len(s) - 1) >= len(o.prompt_token_ids) for s, o in zip(seqs, outs)]
    return h, t, np.concatenate(nxt).astype(np.int32), np.concatenate(ans)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--train", type=int, default=160, help="training prompts (of the packaged set)")
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    a = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(a.model, progress=False, max_num_seqs=64, max_model_len=1024)
    train, held = tm.load_prompts()
    h, t, nx, ans = _data(llm, train[: a.train], a.max_tokens)
    hh, ht, hnx, hans = _data(llm, held[: a.heldout], a.max_tokens)
    print(f"data {time.perf_counter() - t0:.0f} s: train {len(h)} positions ({ans.sum()} answer), "
          f"held out {len(hh)} ({hans.sum()} answer)", flush=True)
    cfg, W = llm.cfg, llm.weights
    mod = model_family(cfg.family)
    D = cfg.d_model

    def logits(p, x, tok):  # x f32[B, D], tok i32[B] -> f32[B, K, V]
        z = jnp.einsum("bd,kde->bke", x, p["w"]) + p["b"]
        if "u" in p:
            e = mod.embed(W, tok[None], cfg)[0].astype(jnp.float32)
            z = z + jnp.einsum("bd,kde->bke", e, p["u"])
        return mod.unembed(W, x[:, None] + jax.nn.silu(z), cfg)

    def loss(p, x, tok, tg):
        lg = logits(p, x, tok)
        picked = jnp.take_along_axis(lg, jnp.maximum(tg, 0)[..., None], -1)[..., 0]
        nll = jax.nn.logsumexp(lg, -1) - picked
        v = tg >= 0
        return jnp.mean(jnp.sum(jnp.where(v, nll, 0), 0) / jnp.maximum(v.sum(0), 1))

    def run(name, cond, answers_only):
        p = {"w": jnp.zeros((HEADS, D, D)), "b": jnp.zeros((HEADS, D))}
        if cond:
            p["u"] = jnp.zeros((HEADS, D, D))
        warm = max(1, a.steps // 20)
        sched = optax.warmup_cosine_decay_schedule(0.0, a.lr, warm, a.steps, a.lr / 20)
        opt = optax.adamw(sched, weight_decay=0.01)
        st = opt.init(p)

        @jax.jit
        def step(p, st, x, tok, tg):
            val, g = jax.value_and_grad(loss)(p, x, tok, tg)
            u, st = opt.update(g, st, p)
            return optax.apply_updates(p, u), st, val

        pool = np.nonzero(ans)[0] if answers_only else np.arange(len(h))
        rng = np.random.default_rng(0)
        t1 = time.perf_counter()
        for _ in range(a.steps):
            ix = pool[rng.integers(0, len(pool), a.batch)]
            p, st, val = step(p, st, *(jnp.asarray(arr[ix]) for arr in (h, nx, t)))
        pred = jax.jit(lambda p, x, tok: jnp.argmax(logits(p, x, tok), -1))
        sel = np.nonzero(hans)[0]
        hit, n = np.zeros(HEADS), np.zeros(HEADS)
        for s in range(0, len(sel), 256):
            ix = sel[s : s + 256]
            pr, tg = np.asarray(pred(p, jnp.asarray(hh[ix]), jnp.asarray(hnx[ix]))), ht[ix]
            hit += ((pr == tg) & (tg >= 0)).sum(0)
            n += (tg >= 0).sum(0)
        print(f"{name}: loss {float(val):.3f}, {time.perf_counter() - t1:.0f} s, held-out answer "
              f"accuracy by head {np.round(hit / n, 3).tolist()}", flush=True)

    run("A plain heads, every position", False, False)
    run("B plain heads, answer positions", False, True)
    run("C heads fed token t+1, answer positions", True, True)


if __name__ == "__main__":
    main()
