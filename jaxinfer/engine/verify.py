"""Verification's part of the engine step (``step.packed_step`` with a ``DraftBlock``): each
decode row carries its last token and k drafts, the one forward pass scores every position, and
``sampling.verify_block`` accepts a prefix of the drafts and adds one token (``verify``).

Drafts made on device live here too (``draft``, before the forward pass): early exit (the
model's own first layers), a draft model (``draft_kv_pass`` keeps its pools in step during plain
steps), an EAGLE head run from each row's accepted position (``eagle_next_drafts``), and
``chain_block``, which moves a block the host built before reading the previous step on by that
step's device outputs (``engine.drafting`` chains steps so).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer import sampling as smp
from jaxinfer.dispatch import Kernels, sampler_kernels
from jaxinfer.engine import branches
from jaxinfer.engine.pages import SCRATCH_PAGE
from jaxinfer.engine.slots import SlotState
from jaxinfer.engine.speculative import ngram_drafts
from jaxinfer.models import eagle as eagle_mod
from jaxinfer.models import medusa
from jaxinfer.models.packed import PackedBatch, PackedKV
from jaxinfer.models.registry import model_family


def _eagle_drafts(eagle, weights, g0, start, batch: PackedBatch, eagle_kv, k: int, *, cfg, kernels,
                  keys_transposed: bool = True):
    """k drafts per decode row: the first read out of g0 f32[R, D] (the draft layer's estimate at
    each row's accepted position, ``start`` i32[R]), each further one from an entry of the
    previous estimate and draft written at start + j. Positions past the row's pages go to the
    scratch page (such an entry can only lower acceptance; real entries replace every one
    before the target's own tokens get there) -> (drafts i32[R, k], eagle_kv)."""
    R = batch.rows
    ps, width = eagle_kv[1][0].shape[2], batch.table.shape[1]
    none = jnp.zeros(0, jnp.int32)

    def read(g):
        return eagle["vocab"][smp.argmax_first(eagle_mod.draft_logits(weights, eagle["rows"], g, cfg))]

    g, tok = g0, read(g0)
    drafts = [tok]
    for j in range(1, k):  # unrolled, as the draft model's passes (a loop carrying pools copies them)
        pos = start + j
        slot = pos // ps
        page = jnp.take_along_axis(batch.table[:R], jnp.minimum(slot, width - 1)[:, None], axis=1)[:, 0]
        page = jnp.where(batch.active & (slot < width), page, SCRATCH_PAGE)
        sub = PackedBatch(tokens=tok, positions=pos, write_page=page, write_wpage=page, active=batch.active,
                          use_prev=jnp.zeros(R, bool), last_q=jnp.zeros(R, jnp.int32), table=batch.table,
                          wtable=batch.wtable, wbase=batch.wbase, seg=none, hist_end=jnp.int32(0), targets=none,
                          rows=R, q=1)
        x = eagle_mod.entries(eagle["head"], weights, g, tok, cfg)
        cache = PackedKV(*eagle_kv, sub, (), kernels, keys_transposed=keys_transposed)
        g, cache = eagle_mod.run_layer(eagle["head"], x[None], pos[None], cache, cfg)
        g, eagle_kv = g[0], (cache.k, cache.v)
        tok = read(g)
        drafts.append(tok)
    return jnp.stack(drafts, axis=1).astype(jnp.int32), eagle_kv


def _decode_row_batch(batch: PackedBatch, j: int | jax.Array, tokens, *, with_prefill: bool) -> PackedBatch:
    """The q = 1 batch of query j of every decode row of a q-query batch (token ``tokens``
    i32[R]), followed by the prefill row when with_prefill: what a draft model computes in one
    pass of a speculative step."""
    R, Q = batch.rows, batch.q
    at = lambda a: a[: R * Q].reshape(R, Q)[:, j]
    rest = lambda a, pre: jnp.concatenate([pre, a[R * Q :]]) if with_prefill else pre
    none = jnp.zeros(0, jnp.int32)
    return PackedBatch(tokens=rest(batch.tokens, tokens), positions=rest(batch.positions, at(batch.positions)),
                       write_page=rest(batch.write_page, at(batch.write_page)),
                       write_wpage=rest(batch.write_wpage, at(batch.write_wpage)),
                       active=batch.active, use_prev=jnp.zeros(R, bool), last_q=jnp.zeros(R, jnp.int32),
                       table=batch.table, wtable=batch.wtable, wbase=batch.wbase,
                       seg=batch.seg if with_prefill else none, hist_end=batch.hist_end if with_prefill else jnp.int32(0),
                       targets=batch.targets if with_prefill else none, rows=R, q=1)


def draft_kv_pass(draft_weights, batch: PackedBatch, draft_kv, *, draft_cfg, kernels: Kernels,
                  keys_transposed: bool = True):
    """A plain step's draft pass: the draft model runs over every token of ``batch`` (decode
    rows and prefill row alike, their first queries already the slots' last tokens where
    use_prev) only to write its keys and values to its own pools draft_kv = (k, v), which it
    returns. Keeps the draft's pages holding every position the target's hold."""
    with jax.named_scope("draft_kv_pass"):
        mod = model_family(draft_cfg.family)
        cache = PackedKV(*draft_kv, batch, (), kernels, keys_transposed=keys_transposed)
        _, cache = mod.forward(draft_weights, batch.tokens[None], None, cache, cfg=draft_cfg,
                               positions=batch.positions[None])
    return cache.k, cache.v


def _draft_model_drafts(draft_weights, batch: PackedBatch, draft_kv, sub: SlotState, *, draft_cfg, kernels,
                        keys_transposed: bool = True):
    """Each decode row's k drafts from the draft model -> (drafts i32[R, k], q f32[R, k, V],
    draft pools).

    Pass 0 runs the rows' last tokens and the prefill row (whose keys and values the draft
    needs later), passes 1..k the drafts, one position at a time, each at the page its
    verification query writes (the scratch page past a row's own number of drafts). Pass k
    only writes the last draft's keys and values, which the next block reads when every draft
    is accepted. Each draft is drawn by ``sampling.draft_sample`` from the row's own shaping of
    the draft's logits, which also gives the q that verification needs."""
    mod = model_family(draft_cfg.family)
    R, Q = batch.rows, batch.q
    k = Q - 1
    last = batch.tokens[0 : R * Q : Q]

    def run(b, kv_, toks):
        cache = PackedKV(*kv_, b, (), kernels, keys_transposed=keys_transposed)
        h, cache = mod.forward(draft_weights, toks[None], None, cache, cfg=draft_cfg, positions=b.positions[None])
        return h[0, :R], (cache.k, cache.v)

    def draw(h, drafts, j):
        logits = mod.unembed(draft_weights, h[:, None], draft_cfg)[:, 0]
        return smp.draft_sample(logits, drafts, sub.sampling, sub.generated + j, sub.stop_ids, sub.min_tokens)

    b0 = _decode_row_batch(batch, 0, last, with_prefill=True)
    h, draft_kv = run(b0, draft_kv, b0.tokens)
    drafts = jnp.full((R, k), -1, jnp.int32)  # -1: not drawn yet (counts nothing in the shaping)
    tok, q0 = draw(h, drafts, 0)
    drafts = drafts.at[:, 0].set(tok)

    # unrolled, not a scan: a loop carrying the page pools made XLA:CPU copy them every pass
    qs = [q0]
    for j in range(1, k + 1):  # pass j: the keys and values of draft j - 1, then draft j
        h, draft_kv = run(_decode_row_batch(batch, j, tok, with_prefill=False), draft_kv, tok)
        if j < k:
            tok, q = draw(h, drafts, j)
            drafts = drafts.at[:, j].set(tok)
            qs.append(q)
    return drafts, jnp.stack(qs, axis=1), draft_kv  # f32[R, k, V]


def _early_exit_drafts(mod, weights, batch: PackedBatch, k_pages, v_pages, *, cfg, windowed, kernels,
                       num_layers: int, keys_transposed: bool = True):
    """Fill each decode row's draft columns with the greedy tokens of the model's first
    num_layers layers (plus final norm and head), one position at a time; their keys and
    values go to the same pages the verification pass then rewrites -> (tokens i32[N], pools)."""
    R, Q = batch.rows, batch.q
    toks = batch.tokens[: R * Q].reshape(R, Q)
    pos = batch.positions[: R * Q].reshape(R, Q)
    wp = batch.write_page[: R * Q].reshape(R, Q)
    wwp = batch.write_wpage[: R * Q].reshape(R, Q)
    head = dict(weights, layers=weights["layers"][:num_layers])
    none = jnp.zeros(0, jnp.int32)
    cur, drafts = toks[:, 0], []
    for j in range(Q - 1):
        sub = PackedBatch(tokens=cur, positions=pos[:, j], write_page=wp[:, j], write_wpage=wwp[:, j],
                          active=batch.active, use_prev=jnp.zeros(R, bool), last_q=jnp.zeros(R, jnp.int32),
                          table=batch.table, wtable=batch.wtable, wbase=batch.wbase, seg=none,
                          hist_end=jnp.int32(0), targets=none, rows=R, q=1)
        cache = PackedKV(k_pages, v_pages, sub, windowed, kernels, keys_transposed=keys_transposed)
        h, cache = mod.forward(head, cur[None], None, cache, cfg=cfg, positions=pos[None, :, j])
        k_pages, v_pages = cache.k, cache.v
        cur = smp.argmax_first(mod.unembed(weights, h[0][:, None], cfg)[:, 0])
        drafts.append(cur)
    toks = toks.at[:, 1:].set(jnp.stack(drafts, axis=1))
    return batch.tokens.at[: R * Q].set(toks.reshape(-1)), k_pages, v_pages


def ngram_chain_drafts(history, lengths, block, accepted, k: int, *, lookup: tuple[int, int]):
    """The n-gram drafts of a block chained to an unread one: each row's history as the host
    last read it (history i32[R, L], lengths i32[R]) extended by the unread block's accepted
    drafts and new token (block i32[R, q], accepted i32[R]), then looked up as ``ngram_propose``
    would (lookup = (prompt_lookup_min, prompt_lookup_max)) -> (drafts i32[R, k], count i32[R])."""
    R, L = history.shape
    j = jnp.arange(block.shape[1])[None]
    at = jnp.where(j <= accepted[:, None], lengths[:, None] + j, L)  # L: not emitted, dropped
    history = history.at[jnp.arange(R)[:, None], at].set(block, mode="drop")
    return ngram_drafts(history, lengths + accepted + 1, k, *lookup)


def chain_block(batch: PackedBatch, last_tokens, accepted, next_drafts, budget, page_size: int) -> PackedBatch:
    """The decode rows of a verification step dispatched before the host read the previous
    one (``engine.drafting`` chains Medusa, EAGLE and n-gram steps so): the host built ``batch`` as a
    block without drafts at each row's previous first query p, not yet knowing how far the
    previous step got. Each row now starts at p + 1 + accepted (i32[R], the previous step's),
    with that step's last token (last_tokens i32[S]) and then its next drafts (i32[R, >= k]),
    as many as ``budget`` i32[R] (the host's max_new - generated - 2, generated as the host
    last read it) leaves after the accepted ones: what the host would have built."""
    R, Q = batch.rows, batch.q
    base = batch.positions[0 : R * Q : Q] + 1 + accepted
    last_q = jnp.clip(budget - accepted, 0, Q - 1)
    j = jnp.arange(Q)[None]
    pos = base[:, None] + jnp.minimum(j, last_q[:, None])  # unused queries repeat the last position
    page = jnp.take_along_axis(batch.table[:R], jnp.minimum(pos // page_size, batch.table.shape[1] - 1), axis=1)
    page = jnp.where((j <= last_q[:, None]) & batch.active[:, None], page, SCRATCH_PAGE)
    toks = jnp.concatenate([last_tokens[:R, None], next_drafts[:, : Q - 1]], axis=1)
    at = lambda a, x: a.at[: R * Q].set(x.reshape(-1).astype(a.dtype))
    return dataclasses.replace(batch, tokens=at(batch.tokens, toks), positions=at(batch.positions, pos),
                               write_page=at(batch.write_page, page), last_q=last_q.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftModels:
    """The drafter's weights a step reads (none donated)."""

    heads: dict | None = None  # Medusa heads (verification steps)
    draft_weights: object = None  # the draft model's weights (speculative draft_model; every step)
    eagle: dict | None = None  # the EAGLE head {"head", "rows", "vocab"}: its entries are written where given


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftBlock:
    """What makes a step a verification step: each decode row carries its last token and up to
    q - 1 drafts (``batch.last_q[r]`` of them real), verified instead of sampled."""

    branch_drafts: jax.Array | None = None  # i32[R, W - 1, k] EAGLE branches 1..W-1
    chain: tuple | None = None  # (accepted i32[R], next_drafts i32[R, K], budget i32[R]) of the unread step
    # n-gram chained: (history i32[R, L], lengths i32[R], the unread step's tokens i32[R, q]); next_drafts None
    history: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Drafting:
    """The drafter's static options (part of every step's cache key, the same for all of an
    engine's steps)."""

    cfg: object = None  # the draft model's ModelConfig (speculative draft_model)
    layers: int = 0  # early exit: how many of the target's first layers draft
    lookup: tuple[int, int] | None = None  # n-gram: (prompt_lookup_min, prompt_lookup_max)
    page_size: int = 0  # the pools' page size, for moving chained blocks on


NO_DRAFTING = Drafting()


def draft(mod, weights, models: DraftModels, block: DraftBlock, batch: PackedBatch, k_pages, v_pages, draft_kv,
          slots: SlotState, *, cfg, drafting: Drafting, windowed, kernels: Kernels, keys_transposed: bool = True):
    """Before a verification step's forward pass: its block moved on by the unread step it is
    chained to (``chain_block``; with n-gram ``history`` the next drafts looked up here first,
    ``ngram_chain_drafts``), then drafts made on device (early exit; a draft model, which also
    gives verification its distributions q) -> (batch, k_pages, v_pages, draft_kv, q_draft
    f32[R, k, V] or None, drafted i32[R]: the drafts each row carried where looked up here, or None)."""
    R, Q = batch.rows, batch.q
    drafted = q_draft = None
    if block.chain is not None:
        prev, ahead, budget = block.chain
        if block.history is not None:  # n-gram: a row drafts what its lookup finds, within its budget
            with jax.named_scope("ngram_drafts"):
                ahead, n = ngram_chain_drafts(*block.history, prev, Q - 1, lookup=drafting.lookup)
                ahead, budget = jnp.maximum(ahead, 0), jnp.minimum(budget, prev + n)
        batch = chain_block(batch, slots.last_tokens, prev, ahead, budget, page_size=drafting.page_size)
        drafted = None if block.history is None else batch.last_q
    if drafting.layers:
        with jax.named_scope("early_exit_draft"):
            tokens, k_pages, v_pages = _early_exit_drafts(mod, weights, batch, k_pages, v_pages, cfg=cfg,
                                                          windowed=windowed, kernels=kernels,
                                                          num_layers=drafting.layers, keys_transposed=keys_transposed)
        batch = dataclasses.replace(batch, tokens=tokens)
    if drafting.cfg is not None:
        with jax.named_scope("draft_model"):
            sub = jax.tree.map(lambda a: a[:R], slots)
            d, q_draft, draft_kv = _draft_model_drafts(models.draft_weights, batch, draft_kv, sub,
                                                       draft_cfg=drafting.cfg, kernels=kernels,
                                                       keys_transposed=keys_transposed)
            tokens = batch.tokens.at[: R * Q].set(
                jnp.concatenate([batch.tokens[0 : R * Q : Q][:, None], d], axis=1).reshape(-1))
        batch = dataclasses.replace(batch, tokens=tokens)
    return batch, k_pages, v_pages, draft_kv, q_draft, drafted


def verify(mod, weights, h, batch: PackedBatch, vb: PackedBatch, sub: SlotState, cache, *, heads, guide, q_draft,
           W: int, cfg, kernels: Kernels):
    """After a verification step's forward pass (h [1, N', D] over vb, which is batch with each
    row repeated for its W branches): ``sampling.verify_block`` accepts a prefix of each row's
    drafts and adds one token; with branches each row keeps one (its pages, features, logits
    and verdict). With Medusa ``heads``, their logits come out of the same LM-head matmul, and
    those at each row's accepted position are its next drafts. guide: None, or the masks of every
    block position (bitmask i32[R, q, V/32], has_mask bool[R]), applied to the logits
    verification reads (logprobs stay the raw model's). -> (verdict, row_logits f32[R, q, V],
    h [1, N, D], cache, next_drafts i32[R, K] or None)."""
    R, Q = batch.rows, batch.q
    hd = h[0, : R * W * Q].reshape(R * W, Q, -1)
    if heads is None:
        # unembedded as one sequence of R * Q rows: as [R, Q, D] a TPU's dot writes f32[R, Q, V]
        # with Q (5 at 4 drafts) padded to 8 rows and copies it twice before the sampler
        # reads it as [R * Q, V]; this reshape costs nothing
        row_logits = mod.unembed(weights, h[:, : R * W * Q], cfg)[0].reshape(R * W, Q, -1)  # f32[R, Q, V]
    else:  # one matmul for the verification logits and every head at every position
        hk = medusa.head_hidden(heads, hd).astype(hd.dtype)  # [R, Q, K, D]
        x = jnp.concatenate([hd[:, :, None], hk], axis=2)  # [R, Q, 1 + K, D]
        both = mod.unembed(weights, x.reshape(R * W, -1, x.shape[-1]), cfg).reshape(x.shape[:3] + (-1,))
        row_logits, head_logits = both[:, :, 0], both[:, :, 1:]  # f32[R, Q, V], f32[R, Q, K, V]
    vsub = sub if W == 1 else jax.tree.map(lambda a: jnp.repeat(a, W, axis=0), sub)
    drafts = vb.tokens[: R * W * Q].reshape(R * W, Q)[:, 1:]
    shaped = row_logits
    if guide is not None:
        bm, has = guide
        bm, has = (bm, has) if W == 1 else (jnp.repeat(bm, W, axis=0), jnp.repeat(has, W))
        V = row_logits.shape[-1]
        shaped = smp.apply_token_bitmask(row_logits.reshape(R * W * Q, V), bm.reshape(R * W * Q, -1),
                                         jnp.repeat(has, Q)).reshape(R * W, Q, V)
    ver = smp.verify_block(shaped, drafts, vb.last_q, vsub.sampling, vsub.generated, vsub.stop_ids,
                           vsub.min_tokens, draft_probs=q_draft, use_kernel=kernels.pallas,
                           interpret=kernels.interpret, platform=kernels.platform, mesh=kernels.mesh,
                           sampler=sampler_kernels(kernels))
    if W > 1:  # each row keeps one branch: its pages, features, logits and verdict
        free = sub.sampling.temperature <= 0.0
        if guide is not None:
            free = free & ~guide[1]
        chosen = branches.choose(ver.accepted.reshape(R, W), free)
        at = jnp.arange(R) * W + chosen
        ver = jax.tree.map(lambda a: a[at], ver)
        row_logits = row_logits[at]
        h = branches.pick(h[0], chosen, R, W, Q)[None]
        cache = branches.store_chosen(cache, batch, chosen, W)
    next_drafts = None
    if heads is not None:
        at = jnp.take_along_axis(head_logits, ver.accepted[:, None, None, None], axis=1)[:, 0]
        next_drafts = smp.argmax_first(at)  # i32[R, K]
    return ver, row_logits, h, cache, next_drafts


def eagle_entry_pass(eagle, weights, h, batch: PackedBatch, next_tokens, eagle_kv, *, cfg, kernels,
                     keys_transposed: bool = True):
    """EAGLE entry p = (f_p, t_{p+1}) of every token the target just computed (features h
    [1, N, D], next_tokens i32[N], -1 read as 0: their entries are rewritten before anything
    reads them), written to the draft's pools at p -> (g f32[N, D], eagle_kv)."""
    x = eagle_mod.entries(eagle["head"], weights, h[0], jnp.maximum(next_tokens, 0), cfg)
    cache = PackedKV(*eagle_kv, batch, (), kernels, keys_transposed=keys_transposed)
    g, cache = eagle_mod.run_layer(eagle["head"], x[None], batch.positions[None], cache, cfg)
    return g[0], (cache.k, cache.v)


def eagle_next_drafts(eagle, weights, g, batch: PackedBatch, accepted, eagle_kv, W: int, *, cfg, kernels,
                      keys_transposed: bool = True):
    """A verification step's next drafts from the EAGLE head, run k times from each row's
    accepted position (g f32[N, D]: the entry pass's estimates) -> (next_drafts i32[R, k], or
    i32[R, W, k] with branches; eagle_kv)."""
    R, Q = batch.rows, batch.q
    g0 = jnp.take_along_axis(g[: R * Q].reshape(R, Q, -1), accepted[:, None, None], axis=1)[:, 0]
    start = batch.positions[: R * Q].reshape(R, Q)[:, 0] + accepted
    if W == 1:
        return _eagle_drafts(eagle, weights, g0, start, batch, eagle_kv, Q - 1, cfg=cfg, kernels=kernels,
                             keys_transposed=keys_transposed)
    return branches.eagle_drafts(eagle, weights, g0, start, batch, eagle_kv, Q - 1, W, cfg=cfg, kernels=kernels,
                                 keys_transposed=keys_transposed), eagle_kv
