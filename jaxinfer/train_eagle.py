"""Training an EAGLE draft head by self-distillation (``jaxinfer train-eagle``).

1. The frozen model answers the prompt set with its own greedy continuations (as for Medusa,
   ``train_medusa.self_distill``), and forward passes over them, four sequences of similar
   length at a time, give their features (hidden states before the final norm).
2. The draft vocabulary is the ``vocab_size`` most frequent tokens of those answers (plus the
   end-of-sequence ids): the draft head reads out only their rows of the LM head, a fraction of
   its bytes.
3. Teacher forcing over whole sequences: entry p = fc([n(f_p); e(t_{p+1})]) through the draft
   layer gives g_p, trained to predict t_{p+2} (cross-entropy over the draft vocabulary) and to
   equal f_{p+1} (smooth L1 on unit-RMS features, EAGLE's regression loss), with uniform noise on
   the input features so drafting tolerates its own estimates. With ``second_pass`` > 0 a
   second pass trains what draft 2 sees (EAGLE-3's training-time test): entry p built from the
   layer's own g_{p-1} instead of f_p, attending the real entries before p and itself.
   optax (the ``train`` extra) adamw, warm-up and cosine decay; tqdm shows the losses; Orbax
   writes the head (``eagle.save_head``) with the held-out accuracy of its first draft over
   answer positions (the acceptance rate draft 1 will see) and of its second where the first
   was right.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import InvalidRequest
from jaxinfer.models import eagle
from jaxinfer.models.layers import attention
from jaxinfer.models.registry import model_family


def sequence_features(llm, seqs: list[list[int]], rows: int = 4, bucket: int = 32
                      ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each token sequence's (features f32[T, D], the hidden states before the final norm, and
    labels i32[T], the model's own greedy next token at each position: what verification
    compares drafts with). Sequences go ``rows`` at a time, sorted by length and right-padded to
    a multiple of ``bucket`` (causal attention: padding after a sequence cannot change it), so
    the forward passes waste little on padding and compile a few shapes only."""
    mod = model_family(llm.cfg.family)

    def fwd(w, t):
        h = mod.forward(w, t, jnp.zeros(t.shape[0], jnp.int32), None, cfg=llm.cfg, read_cache=False)[0]
        return h, jnp.argmax(mod.unembed(w, h, llm.cfg), axis=-1).astype(jnp.int32)

    fwd = jax.jit(fwd)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = [None] * len(seqs)
    for g in range(0, len(order), rows):
        group = order[g:g + rows]
        pad = -(-max(len(seqs[i]) for i in group) // bucket) * bucket
        toks = np.zeros((rows, pad), np.int32)  # a short last group keeps the shape: empty rows
        for r, i in enumerate(group):
            toks[r, :len(seqs[i])] = seqs[i]
        h, lab = fwd(llm.weights, jnp.asarray(toks))
        h, lab = np.asarray(h), np.asarray(lab)
        for r, i in enumerate(group):
            out[i] = (h[r, :len(seqs[i])], lab[r, :len(seqs[i])])
    return out


def draft_vocab(seqs, prompt_lens, size: int, always=()) -> np.ndarray:
    """The ``size`` most frequent answer tokens (ties by id), ``always`` included, sorted."""
    counts = np.zeros(max(max(s) for s in seqs) + 1, np.int64)
    for ids, n in zip(seqs, prompt_lens):
        np.add.at(counts, np.asarray(ids[n:], np.int64), 1)
    keep = set(int(t) for t in always)
    for t in np.argsort(-counts, kind="stable"):
        if len(keep) >= size or counts[t] == 0:
            break
        keep.add(int(t))
    return np.asarray(sorted(keep), np.int32)


def pack(feats, seqs, prompt_lens, length: int):
    """Sequences cut to ``length`` (or to a multiple of 16 past the longest): (feats f32[N, L, D], tokens i32[N, L],
    labels i32[N, L], lens i32[N], prompt lens i32[N])."""
    N, D = len(seqs), feats[0][0].shape[1]
    length = min(length, -(-(max(len(s) for s in seqs) + 1) // 16) * 16)  # past the longest, not far
    F = np.zeros((N, length, D), np.float32)
    T = np.zeros((N, length), np.int32)
    Y = np.zeros((N, length), np.int32)
    lens = np.zeros(N, np.int32)
    for i, ((f, y), ids) in enumerate(zip(feats, seqs)):
        n = min(len(ids), length)
        F[i, :n], T[i, :n], Y[i, :n], lens[i] = f[:n], ids[:n], y[:n], n
    return F, T, Y, lens, np.minimum(np.asarray(prompt_lens, np.int32), length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _FirstPass:
    """The training pass's attention (``attend_layer`` hands it the layer's rotated q, k, v):
    causal over the sequence's own entries, keeping their keys and values for ``_SecondPass``."""

    k: jax.Array | None = None  # [B, T, K, H]
    v: jax.Array | None = None
    packed = True

    def attend(self, layer, q, k, v, *, scale, window=None, softcap=None, write=True):
        # the head's one layer computes its own keys and values: write is always True here
        pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
        o = attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), pos, pos[0], scale=scale, window=window,
                      softcap=softcap)
        return o, _FirstPass(k, v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _SecondPass:
    """What draft 2 sees in the engine: the query at p (an entry built from the layer's own
    g_{p-1}) attends the first pass's real entries before p, then its own key at p."""

    k: jax.Array  # [B, T, K, H] the first pass's keys and values
    v: jax.Array
    packed = True

    def attend(self, layer, q, k, v, *, scale, window=None, softcap=None, write=True):
        # the head's one layer computes its own keys and values: write is always True here
        B, T, N, H = q.shape
        K = k.shape[2]
        qg = q.reshape(B, T, K, N // K, H).astype(jnp.float32) * scale
        before = jnp.einsum("btkgh,bskh->bkgts", qg, self.k.astype(jnp.float32))
        own = jnp.einsum("btkgh,btkh->bkgt", qg, k.astype(jnp.float32))[..., None]
        s = jnp.concatenate([before, own], axis=-1)
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        t, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        seen = (j < t) if window is None else (j < t) & (t - j < window)
        s = jnp.where(jnp.concatenate([seen, jnp.ones((T, 1), bool)], axis=1), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bkgts,bskh->btkgh", p[..., :T], self.v.astype(jnp.float32))
        o = o + p[..., T].transpose(0, 3, 1, 2)[..., None] * v.astype(jnp.float32)[:, :, :, None, :]
        return o.reshape(B, T, N, H).astype(q.dtype), self


def _forward(head, weights, rows, feats, toks, cfg, second: bool = False):
    """Teacher-forced entries 0..L-2 -> (g f32[B, L-1, D], logits f32[B, L-2, Vd] of the token
    after p + 1[, logits of draft 2 at each entry p >= 1, from g_{p-1} and t_{p+1}])."""
    B, L = toks.shape
    x = eagle.entries(head, weights, feats[:, :-1], toks[:, 1:], cfg)
    pos = jnp.broadcast_to(jnp.arange(L - 1, dtype=jnp.int32), (B, L - 1))
    g, first = eagle.run_layer(head, x, pos, _FirstPass() if second else None, cfg)
    logits = eagle.draft_logits(weights, rows, g[:, :-1], cfg)
    if not second:
        return g, logits
    prev = jnp.concatenate([feats[:, :1], g[:, :-1]], axis=1)  # entry 0 has no estimate before it
    g2, _ = eagle.run_layer(head, eagle.entries(head, weights, prev, toks[:, 1:], cfg), pos,
                            _SecondPass(first.k, first.v), cfg)
    return g, logits, eagle.draft_logits(weights, rows, g2[:, :-1], cfg)


def _ce(logits, tgt, ok):
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.maximum(tgt, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(ok, lse - picked, 0.0)) / jnp.maximum(jnp.sum(ok), 1)


def _loss(head, weights, rows, remap, feats, toks, labels, lens, key, cfg, noise: float, reg_weight: float,
          second_pass: float = 0.0):
    B, L = toks.shape
    feats = feats + noise * jax.random.uniform(key, feats.shape, minval=-1.0, maxval=1.0) * \
        jnp.sqrt(jnp.mean(feats * feats, axis=-1, keepdims=True))
    out = _forward(head, weights, rows, feats, toks, cfg, second=second_pass > 0)
    g, logits = out[:2]
    p = jnp.arange(L - 2)
    tgt = remap[labels[:, 1:-1]]  # draft index of the model's own token after p + 1, -1 outside the vocabulary
    ok = (p[None] + 2 < lens[:, None]) & (tgt >= 0)
    ce = _ce(logits, tgt, ok)
    okr = jnp.arange(L - 1)[None] + 1 < lens[:, None]
    diff = eagle.unit_rms(g) - eagle.unit_rms(feats[:, 1:])
    sl1 = jnp.where(jnp.abs(diff) < 1.0, 0.5 * diff * diff, jnp.abs(diff) - 0.5).mean(-1)
    reg = jnp.sum(jnp.where(okr, sl1, 0.0)) / jnp.maximum(jnp.sum(okr), 1)
    loss = ce + reg_weight * reg
    if second_pass > 0:  # draft 2 at entry p predicts the same token draft 1 of entry p would
        loss = loss + second_pass * _ce(out[2], tgt, ok & (p[None] >= 1))
    return loss, (ce, reg)


def accuracy(head, weights, rows, vocab, cfg, F, T, Y, lens, plens, batch: int = 16) -> dict:
    """Top-1 accuracy of the first draft (entry p's guess at the model's token after p + 1)
    over answer positions (that token is an answer token) and over all positions, and of the
    second draft over answer positions where the first was right (what acceptance needs)."""
    f = jax.jit(lambda hd, x, t: [jnp.argmax(a, axis=-1) for a in _forward(hd, weights, rows, x, t, cfg, True)[1:]])
    hit_a = n_a = hit = n = hit2 = n2 = 0
    vocab = np.asarray(vocab)
    for s in range(0, len(T), batch):
        one, two = (vocab[np.asarray(a)] for a in f(head, jnp.asarray(F[s: s + batch]), jnp.asarray(T[s: s + batch])))
        y = Y[s: s + batch, 1:-1]
        p = np.arange(T.shape[1] - 2)[None]
        valid = p + 2 < lens[s: s + batch, None]
        answer = valid & (p + 2 >= plens[s: s + batch, None])
        good = one == y
        hit, n = hit + np.sum(good & valid), n + np.sum(valid)
        hit_a, n_a = hit_a + np.sum(good & answer), n_a + np.sum(answer)
        tried = answer & np.concatenate([np.zeros_like(good[:, :1]), good[:, :-1]], axis=1)  # draft 1 of p - 1 right
        hit2, n2 = hit2 + np.sum((two == y) & tried), n2 + np.sum(tried)
    return {"answer": round(float(hit_a / max(n_a, 1)), 4), "all": round(float(hit / max(n, 1)), 4),
            "second_given_first": round(float(hit2 / max(n2, 1)), 4)}


def train_head(llm, F, T, Y, lens, vocab, *, steps: int, batch: int, lr: float, seed: int = 0, noise: float = 0.1,
               reg_weight: float = 1.0, second_pass: float = 1.0, init_layer: int | None = None,
               progress: bool = True):
    """Train a head on packed sequences -> (head, losses every 10 steps)."""
    from tqdm import tqdm

    from jaxinfer.train_medusa import require_optax

    optax = require_optax()
    cfg, weights = llm.cfg, llm.weights
    from_layer = None if init_layer is None else weights["layers"][init_layer]
    head = eagle.init_head(cfg, jax.random.PRNGKey(seed), from_layer=from_layer)
    rows = eagle.readout_rows(weights, jnp.asarray(vocab), cfg)
    remap = np.full(cfg.vocab_size, -1, np.int32)
    remap[np.asarray(vocab)] = np.arange(len(vocab), dtype=np.int32)
    remap = jnp.asarray(remap)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=max(1, steps // 20), decay_steps=steps,
                                               end_value=lr / 20)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    state = opt.init(head)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(head, state, f, t, y, n, key):
        (loss, aux), grads = jax.value_and_grad(_loss, has_aux=True)(head, weights, rows, remap, f, t, y, n, key, cfg,
                                                                     noise, reg_weight, second_pass)
        updates, state = opt.update(grads, state, head)
        return optax.apply_updates(head, updates), state, loss, aux

    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed + 1)
    losses = []
    bar = tqdm(range(steps), desc="train eagle", disable=not progress)
    for i in bar:
        idx = rng.integers(0, len(T), batch)
        key, sub = jax.random.split(key)
        head, state, loss, (ce, reg) = step(head, state, jnp.asarray(F[idx]), jnp.asarray(T[idx]),
                                            jnp.asarray(Y[idx]), jnp.asarray(lens[idx]), sub)
        if i % 10 == 0 or i == steps - 1:
            losses.append(float(loss))
            bar.set_postfix(ce=f"{float(ce):.3f}", reg=f"{float(reg):.3f}")
    return head, rows, losses


def distill(llm, prompts, max_tokens: int, length: int):
    """(token ids, prompt lengths, ``pack``'s arrays) of the model's greedy answers to ``prompts``."""
    from jaxinfer.train_medusa import self_distill_with_lengths

    seqs, plens = self_distill_with_lengths(llm, prompts, max_tokens)
    return seqs, plens, pack(sequence_features(llm, seqs), seqs, plens, length)


def train_eagle(model: str, out, *, steps: int = 700, batch: int = 8, lr: float = 1e-3, max_tokens: int = 128,
                vocab_size: int = 8192, length: int = 256, second_pass: float = 1.0, data=None, seed: int = 0,
                progress: bool = True, llm=None) -> dict:
    """The whole recipe; returns what it wrote into ``out``'s eagle.json."""
    from jaxinfer import LLM
    from jaxinfer.train_medusa import load_prompts, require_optax

    require_optax()  # before minutes of self-distillation
    if steps < 1 or batch < 1 or lr <= 0 or vocab_size < 2:
        raise InvalidRequest(f"steps, batch, lr and vocab size must be positive, got {steps}, {batch}, {lr}, "
                             f"{vocab_size}")
    if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise InvalidRequest(f"{out}: already exists; remove it or choose another destination")
    train, held = load_prompts(data, packaged="draft_prompts.jsonl")
    t0 = time.perf_counter()
    llm = llm or LLM(model, progress=progress, max_num_seqs=64, max_model_len=1024)
    seqs, plens, (F, T, Y, lens, pl) = distill(llm, train, max_tokens, length)
    vocab = draft_vocab(seqs, plens, min(vocab_size, llm.cfg.vocab_size), always=llm.tokenizer.eos_ids)
    t_data = time.perf_counter() - t0
    head, rows, losses = train_head(llm, F, T, Y, lens, vocab, steps=steps, batch=batch, lr=lr, seed=seed,
                                    second_pass=second_pass, progress=progress)
    t_train = time.perf_counter() - t0 - t_data
    report = {"model": str(model), "train_prompts": len(train), "train_tokens": int(lens.sum()),
              "steps": steps, "batch": batch, "lr": lr, "max_tokens": max_tokens, "length": length,
              "second_pass": second_pass,
              "final_loss": losses[-1], "data_s": round(t_data, 1), "train_s": round(t_train, 1)}
    if held:
        _, _, held_data = distill(llm, held, max_tokens, length)
        report["heldout_prompts"] = len(held)
        report["heldout_first_draft_accuracy"] = accuracy(head, llm.weights, rows, vocab, llm.cfg, *held_data)
    eagle.save_head(out, head, vocab, llm.cfg, extra=report)
    return report
