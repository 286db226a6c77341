"""The jitted speculative verification step: each decode row carries its last token and k
drafts, one forward pass scores every position, and ``sampling.verify_block`` accepts a prefix
of the drafts and adds one token (``spec_step``).

Drafts made on device live here too: early exit (the model's own first layers), a draft model
(``draft_kv_step`` keeps its pools in step during plain steps), an EAGLE head run from each
row's accepted position, and ``chain_block``, which moves a block the host built before reading
the previous step on by that step's device outputs (``engine.drafting`` chains steps so). The
plain step and the sampling step both kinds share: ``step``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer import sampling as smp
from jaxinfer.dispatch import Kernels
from jaxinfer.engine import branches
from jaxinfer.engine.pages import SCRATCH_PAGE
from jaxinfer.engine.slots import SlotState
from jaxinfer.engine.speculative import ngram_drafts
from jaxinfer.engine.step import _eagle_entry_pass, token_logprobs
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


def draft_kv_step(draft_weights, batch: PackedBatch, draft_kv, last_tokens, *, draft_cfg, kernels: Kernels,
                  keys_transposed: bool = True):
    """A plain step's draft pass: the draft model runs over every token of ``batch`` (decode
    rows and prefill row alike, the first query of a use_prev row being last_tokens i32[S]'s)
    only to write its keys and values to its own pools draft_kv = (k, v), which it returns
    (donated). Keeps the draft's pages holding every position the target's hold."""
    with jax.named_scope("draft_kv_step"):
        mod = model_family(draft_cfg.family)
        R, Q = batch.rows, batch.q
        tokens = batch.tokens
        if R:
            first = jnp.where(batch.use_prev, last_tokens[:R], tokens[0 : R * Q : Q])
            tokens = tokens.at[0 : R * Q : Q].set(first)
        cache = PackedKV(*draft_kv, batch, (), kernels, keys_transposed=keys_transposed)
        _, cache = mod.forward(draft_weights, tokens[None], None, cache, cfg=draft_cfg, positions=batch.positions[None])
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecOutput:
    tokens: jax.Array  # i32[R, q] each row's accepted drafts, then its new token; -1 after
    accepted: jax.Array  # i32[R] drafts accepted per row
    logprobs: tuple | None  # (chosen f32[R, q], rank i32[R, q], top ids i32[R, q, n], top logprobs f32[R, q, n])
    prompt_logprobs: tuple | None
    next_drafts: jax.Array | None = None  # i32[R, K] (EAGLE branches: [R, W, K]) each row's next block's drafts
    drafted: jax.Array | None = None  # i32[R] drafts each row carried, where they were made on device (n-gram chained)


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
class SpecInputs:
    """What one verification step reads besides the target's weights (nothing here is donated)."""

    batch: PackedBatch
    guide: tuple | None = None  # (bitmask i32[R, q, V/32], has_mask bool[R]) when a row is constrained
    branch_drafts: jax.Array | None = None  # i32[R, W - 1, k] EAGLE branches 1..W-1
    chain: tuple | None = None  # (accepted i32[R], next_drafts i32[R, K], budget i32[R]) of the unread step
    # n-gram chained: (history i32[R, L], lengths i32[R], the unread step's tokens i32[R, q]); next_drafts None
    history: tuple | None = None
    heads: dict | None = None  # Medusa heads
    draft_weights: object = None  # the draft model's weights (speculative draft_model)
    eagle: dict | None = None  # the EAGLE head: {"head", "rows", "vocab"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    """The device state a verification step donates and returns."""

    k_pages: list
    v_pages: list
    slots: SlotState
    draft_kv: tuple | None = None  # the draft model's or the EAGLE head's pools (k, v)


def spec_step(weights, inputs: SpecInputs, state: SpecState, *, cfg, windowed, num_logprobs: int,
              prompt_logprobs: int, kernels: Kernels, draft_layers: int = 0, draft_cfg=None,
              lookup: tuple[int, int] | None = None, keys_transposed: bool = True):
    """One speculative scheduler iteration -> (SpecOutput, SpecState).

    Decode row r (slot r) carries q = k + 1 queries: its last token, then its drafts
    (``batch.last_q[r]`` of them are real; the rest write to the scratch page). With
    draft_layers > 0 the drafts are made here first (early exit). One forward pass over every
    row and the prefill row, then ``sampling.verify_block`` accepts a prefix of each row's
    drafts and adds one token; the slot state advances by what was emitted. With Medusa
    ``heads``, their logits come out of the same LM-head matmul as the verification logits,
    and those at each row's accepted position are its next block's drafts. guide: None, or the
    structured-output masks of every block position (bitmask i32[R, q, V/32], has_mask bool[R]),
    applied to the logits verification reads (logprobs stay the raw model's). With a draft
    model (draft_weights, its pools draft_kv = (k, v), donated, and draft_cfg), it drafts
    first (``_draft_model_drafts``) and verification gets its distributions q. With an EAGLE
    head (``eagle``, its pools eagle_kv donated and returned in draft_kv's place), the verified
    block's entries are written with the target's real features, and the draft layer then runs
    k times from each row's accepted position: next_drafts, as with Medusa. With
    ``branch_drafts`` i32[R, W - 1, k] (EAGLE branches, ``engine.branches``), each row also
    carries W - 1 more chains, verified as virtual rows; next_drafts is then i32[R, W, k].
    With ``chain`` = (accepted i32[R], next_drafts i32[R, k], budget i32[R]) of the previous
    step, still unread by the host, the decode rows are first moved on by it (``chain_block``;
    with n-gram ``history`` the next drafts are looked up here first, ``ngram_chain_drafts``
    with lookup = (prompt_lookup_min, prompt_lookup_max), and SpecOutput.drafted says how many;
    no window pools). keys_transposed: the layout of every keys pool here, the target's and
    the drafter's (``cache.PagedKVCache.keys_transposed``)."""
    batch, k_pages, v_pages, slots = inputs.batch, state.k_pages, state.v_pages, state.slots
    heads, guide, draft_weights, eagle = inputs.heads, inputs.guide, inputs.draft_weights, inputs.eagle
    branch_drafts, chain = inputs.branch_drafts, inputs.chain
    draft_kv = state.draft_kv if draft_cfg is not None else None
    eagle_kv = state.draft_kv if eagle is not None else None
    with jax.named_scope("spec_step"):
        drafted = None
        if chain is not None:
            prev, ahead, budget = chain
            if inputs.history is not None:  # n-gram: a row drafts what its lookup finds, within its budget
                with jax.named_scope("ngram_drafts"):
                    ahead, n = ngram_chain_drafts(*inputs.history, prev, batch.q - 1, lookup=lookup)
                    ahead, budget = jnp.maximum(ahead, 0), jnp.minimum(budget, prev + n)
            batch = chain_block(batch, slots.last_tokens, prev, ahead, budget, page_size=v_pages[0].shape[2])
            drafted = None if inputs.history is None else batch.last_q
        mod = model_family(cfg.family)
        R, Q = batch.rows, batch.q
        tokens = batch.tokens
        if draft_layers:
            with jax.named_scope("early_exit_draft"):
                tokens, k_pages, v_pages = _early_exit_drafts(mod, weights, batch, k_pages, v_pages, cfg=cfg,
                                                              windowed=windowed, kernels=kernels,
                                                              num_layers=draft_layers, keys_transposed=keys_transposed)
            batch = dataclasses.replace(batch, tokens=tokens)
        q_draft = None
        if draft_cfg is not None:
            with jax.named_scope("draft_model"):
                sub = jax.tree.map(lambda a: a[:R], slots)
                d, q_draft, draft_kv = _draft_model_drafts(draft_weights, batch, draft_kv, sub, draft_cfg=draft_cfg,
                                                           kernels=kernels, keys_transposed=keys_transposed)
                tokens = batch.tokens.at[: R * Q].set(
                    jnp.concatenate([batch.tokens[0 : R * Q : Q][:, None], d], axis=1).reshape(-1))
            batch = dataclasses.replace(batch, tokens=tokens)
        W = 1 if branch_drafts is None else branch_drafts.shape[1] + 1
        vb = batch if W == 1 else branches.expand(batch, branch_drafts)  # W virtual rows per row
        cache = PackedKV(k_pages, v_pages, vb, windowed, kernels, defer_writes=W > 1, keys_transposed=keys_transposed)
        h, cache = mod.forward(weights, vb.tokens[None], None, cache, cfg=cfg, positions=vb.positions[None])
        with jax.named_scope("verify"):
            hd = h[0, : R * W * Q].reshape(R * W, Q, -1)
            if heads is None:
                row_logits = mod.unembed(weights, hd, cfg)  # f32[R, Q, V]
            else:  # one matmul for the verification logits and every head at every position
                hk = medusa.head_hidden(heads, hd).astype(hd.dtype)  # [R, Q, K, D]
                x = jnp.concatenate([hd[:, :, None], hk], axis=2)  # [R, Q, 1 + K, D]
                both = mod.unembed(weights, x.reshape(R, -1, x.shape[-1]), cfg).reshape(x.shape[:3] + (-1,))
                row_logits, head_logits = both[:, :, 0], both[:, :, 1:]  # f32[R, Q, V], f32[R, Q, K, V]
            sub = jax.tree.map(lambda a: a[:R], slots)
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
                                   interpret=kernels.interpret, platform=kernels.platform, mesh=kernels.mesh)
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
            new_last = jnp.take_along_axis(ver.tokens, ver.accepted[:, None], axis=1)[:, 0]
            next_drafts = None
            if heads is not None:
                at = jnp.take_along_axis(head_logits, ver.accepted[:, None, None, None], axis=1)[:, 0]
                next_drafts = smp.argmax_first(at)  # i32[R, K]
            upd = SlotState(ver.state, new_last, sub.stop_ids, sub.min_tokens, sub.generated + ver.accepted + 1)
            keep = lambda n, o: jnp.where(batch.active.reshape((R,) + (1,) * (n.ndim - 1)), n, o)
            sub = jax.tree.map(keep, upd, sub)
            slots = jax.tree.map(lambda a, s: a.at[:R].set(s), slots, sub)
        if eagle is not None:
            with jax.named_scope("eagle"):
                nxt = jnp.concatenate([ver.tokens.reshape(-1), batch.targets])
                g, eagle_kv = _eagle_entry_pass(eagle, weights, h, batch, nxt, eagle_kv, cfg=cfg,
                                                kernels=kernels, keys_transposed=keys_transposed)
                g0 = jnp.take_along_axis(g[: R * Q].reshape(R, Q, -1), ver.accepted[:, None, None], axis=1)[:, 0]
                start = batch.positions[: R * Q].reshape(R, Q)[:, 0] + ver.accepted
                if W == 1:
                    next_drafts, eagle_kv = _eagle_drafts(eagle, weights, g0, start, batch, eagle_kv, Q - 1, cfg=cfg,
                                                          kernels=kernels, keys_transposed=keys_transposed)
                else:
                    next_drafts = branches.eagle_drafts(eagle, weights, g0, start, batch, eagle_kv, Q - 1, W, cfg=cfg,
                                                        kernels=kernels, keys_transposed=keys_transposed)
            draft_kv = eagle_kv
        lp = plp = None
        if num_logprobs >= 0:
            flat = row_logits.reshape(R * Q, -1)
            toks = jnp.maximum(ver.tokens.reshape(-1), 0)
            chosen, top_ids, top_lp = smp.logprobs_of(flat, toks, num_logprobs)
            picked = jnp.take_along_axis(flat, toks[:, None], axis=1)
            rank = 1 + jnp.sum(flat > picked, axis=-1)
            lp = tuple(a.reshape((R, Q) + a.shape[1:]) for a in (chosen, rank, top_ids, top_lp))
        if prompt_logprobs >= 0 and batch.prefill_len:
            with jax.named_scope("prompt_logprobs"):
                logits = mod.unembed(weights, h[:, R * Q :], cfg)[0]
                plp = token_logprobs(logits, batch.targets, prompt_logprobs)
    return SpecOutput(ver.tokens, ver.accepted, lp, plp, next_drafts, drafted), SpecState(cache.k, cache.v, slots, draft_kv)
