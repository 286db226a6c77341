"""Branch drafting for EAGLE (speculative ``branches`` = W > 1): a decode row carries W chains
of k drafts, each begun by one of the head's W most likely first drafts and continued by its
top-1 guesses. A small tree (W leaves off the root), verified as W virtual rows.

Each virtual row is an ordinary chain ``[last token, d_1 .. d_k]`` at positions p .. p + k, on
its real row's pages. The W chains of a row share positions, so the forward pass defers its
key/value writes (``PackedKV(defer_writes=True)``: every virtual row reads the pages before p
and its own new keys), each chain is verified exactly as a chain is, and a greedy row keeps the
branch that accepted most (branch 0 on ties): every branch's accepted tokens are the target's
own argmaxes, so any branch gives the tokens plain decoding gives. A sampled or grammar-guided
row keeps branch 0, the top-1 chain, whose rejection sampling is the chain's own (lossless);
the other branches only cost compute. Then the chosen chain's keys and values are written to
the real row's pages at p .. p + k, and the rest of the step sees one row again.

The head drafts W chains the same way: its deferred-write layer runs over each branch's entries
so far (virtual rows again), and no branch's entries reach the head's pages. The next step's
entry pass writes the entries of what was accepted.

Where it pays: where verifying W * (k + 1) tokens costs about what k + 1 do (a memory-bound
accelerator). On the 2-core CPU it does not: SmolLM2 chat at batch 1, k = 2, took 1.44 / 1.57
/ 1.64 / 1.69 tokens per block at W = 1 / 2 / 3 / 4, but ran at 1.10x / 0.98x / 0.86x / 0.76x
speculation off, because the 9-token verification at W = 3 costs ~1.5 plain steps there
(benchmarks/RESULTS.md, "Speculative decoding"), so W = 1 stays the default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import dispatch
from jaxinfer import sampling as smp
from jaxinfer.cache import write_pages
from jaxinfer.models import eagle as eagle_mod
from jaxinfer.models.packed import PackedBatch, PackedKV


def _rows(a: jax.Array, W: int) -> jax.Array:
    """A per-row array [R, ...] -> [R * W, ...]: each row repeated for its W branches."""
    return jnp.repeat(a, W, axis=0)


def _table(t: jax.Array, R: int, W: int) -> jax.Array:
    """A page table [R + 1, w] (row R: the prefill row's) -> [R * W + 1, w]."""
    return jnp.concatenate([_rows(t[:R], W), t[R:]])


def expand(batch: PackedBatch, branch_drafts: jax.Array) -> PackedBatch:
    """The batch with each decode row r as W virtual rows r * W + b: branch 0 is the row as
    built (its last token and chain drafts), branch b >= 1 the same last token and
    branch_drafts i32[R, W - 1, q - 1][r, b - 1]. The prefill row follows unchanged."""
    R, Q = batch.rows, batch.q
    W = branch_drafts.shape[1] + 1
    n = R * Q

    def tokens_of(a):  # per token [N] -> [R * W * Q + Tp], each row's Q entries repeated W times
        d = jnp.broadcast_to(a[:n].reshape(R, 1, Q), (R, W, Q)).reshape(-1)
        return jnp.concatenate([d, a[n:]])

    first = batch.tokens[:n].reshape(R, 1, Q)
    others = jnp.concatenate([jnp.broadcast_to(first[:, :, :1], (R, W - 1, 1)),
                              branch_drafts.astype(jnp.int32)], axis=2)
    toks = jnp.concatenate([jnp.concatenate([first, others], axis=1).reshape(-1), batch.tokens[n:]])
    # a row's padding queries (past its last draft) sit at its last real position in the
    # batch; with deferred writes every query sees the row's own keys by position, so they move
    # past it instead (their outputs are never read, their keys never stored)
    first_pos = batch.positions[:n].reshape(R, 1, Q)[:, :, :1]
    pos = jnp.broadcast_to(first_pos + jnp.arange(Q, dtype=jnp.int32), (R, W, Q)).reshape(-1)
    return PackedBatch(tokens=toks, positions=jnp.concatenate([pos, batch.positions[n:]]),
                       write_page=tokens_of(batch.write_page),
                       write_wpage=tokens_of(batch.write_wpage), active=_rows(batch.active, W),
                       use_prev=_rows(batch.use_prev, W), last_q=_rows(batch.last_q, W),
                       table=_table(batch.table, R, W), wtable=_table(batch.wtable, R, W),
                       wbase=_table(batch.wbase, R, W), seg=batch.seg, hist_end=batch.hist_end,
                       targets=batch.targets, rows=R * W, q=Q, max_segments=batch.max_segments)


def choose(accepted: jax.Array, free: jax.Array) -> jax.Array:
    """i32[R]: the branch each row keeps, from accepted i32[R, W] per branch: the first that
    accepted most where ``free`` bool[R] (greedy, unguided), else 0."""
    W = accepted.shape[1]
    score = jnp.where(free[:, None] | (jnp.arange(W) == 0)[None], accepted, -1)
    return jnp.argmax(score, axis=1).astype(jnp.int32)


def pick(a: jax.Array, chosen: jax.Array, R: int, W: int, Q: int) -> jax.Array:
    """A per-token array of the expanded batch [R * W * Q + Tp, ...] -> the real batch's
    [R * Q + Tp, ...]: each row's chosen branch, then the prefill row."""
    n = R * W * Q
    d = a[:n].reshape((R, W, Q) + a.shape[1:])
    d = jnp.take_along_axis(d, chosen.reshape((R, 1, 1) + (1,) * (a.ndim - 1)), axis=1)[:, 0]
    return jnp.concatenate([d.reshape((R * Q,) + a.shape[1:]), a[n:]])


def store_chosen(cache: PackedKV, batch: PackedBatch, chosen: jax.Array, W: int) -> PackedKV:
    """Write the deferred keys/values of ``cache`` (the expanded batch's) to the pools: each
    row's chosen branch at the real batch's pages and positions, and the prefill row's."""
    R, Q = batch.rows, batch.q
    ks, vs = list(cache.k), list(cache.v)
    for layer, kv in enumerate(cache.written):
        if kv is None:  # a layer that shares another's keys/values wrote none
            continue
        k, v = kv
        windowed = bool(cache.windowed) and cache.windowed[layer]
        page = batch.write_wpage if windowed else batch.write_page
        off = batch.positions % vs[layer].shape[2]
        k, v = (pick(a[0], chosen, R, W, Q)[None] for a in (k, v))
        whole = (batch.pages_written(vs[layer].shape[2])
                 if dispatch.whole_page_writes(cache.kernels, cache.keys_transposed) else None)
        if ks[layer] is not None:  # (a latent pool stores the latent once, as its values)
            ks[layer] = write_pages(ks[layer], page, off, k, keys_transposed=cache.keys_transposed,
                                    whole_pages=whole)
        vs[layer] = write_pages(vs[layer], page, off, v, whole_pages=whole)
    return PackedKV(ks, vs, batch, cache.windowed, cache.kernels, keys_transposed=cache.keys_transposed)


def eagle_drafts(eagle: dict, weights: dict, g0: jax.Array, start: jax.Array, batch: PackedBatch, eagle_kv,
                 k: int, W: int, *, cfg, kernels, keys_transposed: bool = True) -> jax.Array:
    """i32[R, W, k]: per decode row, the head's W most likely first drafts out of g0 f32[R, D]
    (its estimate at the accepted position ``start`` i32[R]), each continued greedily to k
    drafts. Draft j >= 2 of a branch comes from the head's layer over that branch's entries at
    start + 1 .. start + j - 1, attending to the head's pages before start + 1 and to those
    entries (deferred writes): nothing is written to eagle_kv."""
    R = batch.rows
    D = g0.shape[-1]
    rows = eagle["rows"]
    first = jax.lax.top_k(eagle_mod.draft_logits(weights, rows, g0, cfg), W)[1]  # [R, W] draft-vocab ids
    toks = [eagle["vocab"][first].reshape(R * W)]
    g, s0, active = _rows(g0, W), _rows(start, W), _rows(batch.active, W)
    table = _table(batch.table, R, W)
    none = jnp.zeros(0, jnp.int32)
    xs = []
    for j in range(1, k):  # unrolled: the branch's j entries so far, at start + 1 .. start + j
        xs.append(eagle_mod.entries(eagle["head"], weights, g, toks[-1], cfg))
        pos = s0[:, None] + 1 + jnp.arange(j, dtype=jnp.int32)[None]  # [R * W, j]
        zeros = jnp.zeros(R * W * j, jnp.int32)
        sub = PackedBatch(tokens=zeros, positions=pos.reshape(-1), write_page=zeros, write_wpage=zeros, active=active,
                          use_prev=jnp.zeros(R * W, bool), last_q=jnp.zeros(R * W, jnp.int32), table=table,
                          wtable=table, wbase=jnp.zeros(R * W + 1, jnp.int32), seg=none, hist_end=jnp.int32(0),
                          targets=none, rows=R * W, q=j)
        cache = PackedKV(*eagle_kv, sub, (), kernels, defer_writes=True, keys_transposed=keys_transposed)
        out, _ = eagle_mod.run_layer(eagle["head"], jnp.stack(xs, axis=1).reshape(1, R * W * j, D),
                                     pos.reshape(1, -1), cache, cfg)
        g = out[0].reshape(R * W, j, D)[:, -1]
        toks.append(eagle["vocab"][smp.argmax_first(eagle_mod.draft_logits(weights, rows, g, cfg))])
    return jnp.stack(toks, axis=1).reshape(R, W, k).astype(jnp.int32)
