"""Blockwise speculative verification as a Pallas kernel: one program per row, the row's
logits streamed through vocabulary chunks, no softmax ever materialised.

Per row (J = k + 1 positions; on TPU all positions at once as a [J, block_v] tile):
  1. a pass for each position's maximum and first argmax;
  2. a pass for the filtered softmax denominators and the logit (and draft probability) of
     each position's drafted token, so p(x_j) is exp(z[x_j] - m_j) / s_j;
  3. greedy rows accept the longest prefix equal to the argmax; sampled rows accept draft j
     while u_j * q(x_j) < p(x_j) (Leviathan et al. 2023, Chen et al. 2023);
  4. at the first rejected position a, the residual max(0, p_a - q_a) (or p_a when every
     draft passed) is drawn from by inverse CDF in two levels: a pass for the total mass, a
     pass that walks the chunk masses to the chosen chunk, then the entry inside it.
The arithmetic is the reference's, chunk by chunk (sums in another order: integer outputs
equal the reference's unless a draw lands within rounding of a boundary).

* TPU (Mosaic). The row's [J, V] tile sits in VMEM (J * V * 4 bytes: 1 MB at V = 49152,
  k = 4); per-row scalars come as [J, 1] columns. On CPU it runs with interpret=True.
* GPU (Triton). Triton tensors need power-of-two dimensions and J = k + 1 rarely is one;
  padding J would copy the logits. So the row stays in HBM, viewed as [J, V / 64, 64] (a free
  reshape; V may be any multiple of block_v, e.g. 24 * 2048), and every loop body is unrolled
  over the J positions, each a [rows, 64] tile loaded with pl.ds. Pass 1 keeps its running
  maximum, first argmax and softmax denominator per lane (no reduction inside the loop) and
  merges max and sum passes (one exp per entry: the new entry's weight or the old sum's
  rescale; greedy rows too: Triton rejected a trip count chosen per row). Steps 2-4 read one
  entry per drafted token, then only row a of the logits (and of draft_probs, read in place):
  one pass for every chunk's mass, kept in a small tile, then the chunk and the entry inside
  it, each picked in two levels from masked prefix sums (no scan, no slicing of a tensor).
  HBM reads per sampled row: J * V + V (+ V of draft_probs) + one chunk.
  Compiled on an H100 (2026-11-26) it equals the reference on every row, but runs slower
  than XLA's fusion of the reference (175 vs 124 us, B = 64, k = 4, V = 49152), so
  ``spec_verify`` dispatches to the reference on GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check, is_pow2, next_pow2, pick_variant
from pallas_kernels.spec_verify.common import BlockSizes, validate

_BIG = 2**30


def _split_refs(rest, has_q: bool):
    """A kernel's trailing refs -> (draft-probability ref or None, accepted ref, next-token ref)."""
    return tuple(rest) if has_q else (None, *rest)


def _kernel(z_ref, thr_ref, x_ref, nd_ref, u_ref, g_ref, *rest, C: int, nC: int, has_q: bool):
    q_ref, acc_ref, next_ref = _split_refs(rest, has_q)
    J = z_ref.shape[1]
    thr = thr_ref[0]  # f32[J, 1]
    x = x_ref[0]  # i32[J, 1] drafted token per position (-1 at the last)
    nd = nd_ref[0]  # i32[1, 1]
    u = u_ref[0]  # f32[J, 3]
    g = g_ref[0] > 0  # bool[1, 1]
    jcol = lax.broadcasted_iota(jnp.int32, (J, 1), 0)
    lane = lax.broadcasted_iota(jnp.int32, (J, C), 1)

    def chunk(c):
        return z_ref[0, :, pl.ds(pl.multiple_of(c * C, C), C)], lane + c * C  # f32[J, C], i32[J, C]

    def qchunk(c, idx):
        if has_q:
            return q_ref[0, :, pl.ds(pl.multiple_of(c * C, C), C)]
        return (idx == x).astype(jnp.float32)

    def max_pass(c, carry):
        m, bi = carry
        zc, idx = chunk(c)
        cm = jnp.max(zc, axis=1, keepdims=True)
        first = jnp.min(jnp.where(zc == cm, idx, _BIG), axis=1, keepdims=True)
        return jnp.maximum(m, cm), jnp.where(cm > m, first, bi)

    neg = jnp.full((J, 1), -jnp.inf, jnp.float32)
    m, bi = lax.fori_loop(0, nC, max_pass, (neg, jnp.zeros((J, 1), jnp.int32)))
    m = jnp.where(jnp.isfinite(m), m, 0.0)

    def sum_pass(c, carry):
        s, zx, qx = carry
        zc, idx = chunk(c)
        s = s + jnp.sum(jnp.where(zc >= thr, jnp.exp(zc - m), 0.0), axis=1, keepdims=True)
        hit = idx == x
        zx = jnp.where(jnp.any(hit, axis=1, keepdims=True),
                       jnp.max(jnp.where(hit, zc, -jnp.inf), axis=1, keepdims=True), zx)
        if has_q:
            qx = qx + jnp.sum(jnp.where(hit, qchunk(c, idx), 0.0), axis=1, keepdims=True)
        return s, zx, qx

    zero = jnp.zeros((J, 1), jnp.float32)
    s, zx, qx = lax.fori_loop(0, nC, sum_pass, (zero, neg, zero))
    px = jnp.where(zx >= thr, jnp.exp(zx - m), 0.0) / s
    if not has_q:
        qx = jnp.ones_like(px)
    # (a select between booleans has no Mosaic lowering: and/or instead)
    ok = ((g & (x == bi)) | (~g & (u[:, 0:1] * qx < px))) & (jcol < nd)  # bool[J, 1]

    a = jnp.zeros((1, 1), jnp.int32)
    alive = jnp.ones((1, 1), jnp.bool_)
    for j in range(J - 1):  # leading accepts: J is small and static
        alive = alive & ok[j : j + 1]
        a = a + alive.astype(jnp.int32)
    sel = jcol == a  # bool[J, 1] the position of the new token
    pick_at = lambda v: jnp.sum(jnp.where(sel, v, 0), axis=0, keepdims=True)  # noqa: E731  [J, n] -> [1, n]
    rejected = a < nd
    u_a = pick_at(u)  # f32[1, 3]

    def residual_at(off, width: int):  # f32[1, width] the residual's unnormalised mass from entry off, at position a
        zc = z_ref[0, :, pl.ds(off, width)]
        idx = lax.broadcasted_iota(jnp.int32, (J, width), 1) + off
        qc = q_ref[0, :, pl.ds(off, width)] if has_q else (idx == x).astype(jnp.float32)
        p = jnp.where(zc >= thr, jnp.exp(zc - m), 0.0) / s
        r = jnp.where(rejected, jnp.maximum(p - qc, 0.0), p)
        return pick_at(r)

    def residual(c):  # f32[1, C] the residual's mass in chunk c
        return residual_at(pl.multiple_of(c * C, C), C)

    total = lax.fori_loop(0, nC, lambda c, t: t + jnp.sum(residual(c), axis=1, keepdims=True),
                          jnp.zeros((1, 1), jnp.float32))
    target = u_a[:, 1:2] * total

    def walk(c, carry):  # the reference's pick over the chunk masses, one chunk at a time
        cum, count, last = carry
        mass = jnp.sum(residual(c), axis=1, keepdims=True)
        cum = cum + mass
        return cum, count + (cum <= target).astype(jnp.int32), jnp.where(mass > 0, c, last)

    _, count, last = lax.fori_loop(0, nC, walk, (jnp.zeros((1, 1), jnp.float32),) + (jnp.zeros((1, 1), jnp.int32),) * 2)
    chosen = jnp.minimum(count, last)  # i32[1, 1]
    tok = chosen * C + _pick_in_chunk(lambda sub: residual_at(pl.multiple_of(chosen[0, 0] * C + sub * _SUB, _SUB),
                                                              _SUB), C // _SUB, u_a[:, 2:3])
    acc_ref[0] = a
    next_ref[0] = jnp.where(g, pick_at(bi), tok)


_SUB = 128  # lanes of one TPU vector register row: the last level of the inverse-CDF pick


def _pick_in_chunk(mass_of, n_sub: int, r):
    """common.pick inside one chunk, in two more levels (Mosaic lowers no scan): walk the
    chunk's n_sub blocks of _SUB entries (mass_of(i) -> f32[1, _SUB]) to the one where r * total
    falls, then the entry inside it from masked prefix sums. i32[1, 1]."""
    total = lax.fori_loop(0, n_sub, lambda i, t: t + jnp.sum(mass_of(i), axis=1, keepdims=True),
                          jnp.zeros((1, 1), jnp.float32))
    target = r * total

    def walk(i, carry):
        cum, count, last = carry
        mass = jnp.sum(mass_of(i), axis=1, keepdims=True)
        cum = cum + mass
        return cum, count + (cum <= target).astype(jnp.int32), jnp.where(mass > 0, i, last)

    zero_i = jnp.zeros((1, 1), jnp.int32)
    _, count, last = lax.fori_loop(0, n_sub, walk, (jnp.zeros((1, 1), jnp.float32), zero_i, zero_i))
    sub = jnp.minimum(count, last)  # i32[1, 1]

    def before_sub(i, b):  # the mass of the blocks before the chosen one, summed as walk did
        return b + jnp.where(i < sub, jnp.sum(mass_of(i), axis=1, keepdims=True), 0.0)

    before = lax.fori_loop(0, n_sub, before_sub, jnp.zeros((1, 1), jnp.float32))
    mass = mass_of(sub[0, 0])  # f32[1, _SUB]
    tri = lax.broadcasted_iota(jnp.int32, (_SUB, _SUB), 1) <= lax.broadcasted_iota(jnp.int32, (_SUB, _SUB), 0)
    cum = before + jnp.sum(jnp.where(tri, mass, 0.0), axis=1, keepdims=True)  # f32[_SUB, 1] inclusive
    inside = jnp.sum((cum <= target).astype(jnp.int32), axis=0, keepdims=True)
    lane = lax.broadcasted_iota(jnp.int32, (1, _SUB), 1)
    last_lane = jnp.max(jnp.where(mass > 0, lane, 0), axis=1, keepdims=True)
    return sub * _SUB + jnp.minimum(inside, last_lane)


def _spec_verify_tpu(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs, bs: BlockSizes, interpret: bool):
    B, J, V = z.shape
    C = bs.block_v
    x = jnp.pad(drafts.astype(jnp.int32), ((0, 0), (0, 1)), constant_values=-1)[..., None]  # [B, J, 1]
    args = [z, thr[..., None], x, num_drafts.astype(jnp.int32)[:, None, None], uniforms,
            greedy.astype(jnp.int32)[:, None, None]]
    row = lambda *shape: pl.BlockSpec((1,) + shape, lambda b: (b,) + (0,) * len(shape))  # noqa: E731
    specs = [row(J, V), row(J, 1), row(J, 1), row(1, 1), row(J, 3), row(1, 1)]
    if draft_probs is not None:
        args.append(jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0))))
        specs.append(row(J, V))
    kernel = functools.partial(_kernel, C=C, nC=V // C, has_q=draft_probs is not None)
    a, nxt = pl.pallas_call(
        kernel,
        grid=(B,),
        in_specs=specs,
        out_specs=[row(1, 1), row(1, 1)],
        out_shape=[jax.ShapeDtypeStruct((B, 1, 1), jnp.int32)] * 2,
        interpret=interpret,
    )(*args)
    return a[:, 0, 0], nxt[:, 0, 0]


# ----------------------------------------------------------------------------- GPU (Triton)
# Triton tensors have power-of-two dimensions, J = k + 1 rarely is one, and padding J would
# copy the [B, J, V] logits. So the GPU variant never holds the J positions as one tensor:
# every loop body is unrolled over them (J is small and static), each position a [rows, _LANE]
# tile. The vocabulary is viewed as [V / _LANE, _LANE] (a free reshape) so that tiles are 2-D
# and a chunk of block_v entries is a [block_v / _LANE, _LANE] tile of whole rows.
_LANE = 64
_TILE = 1024  # entries per position in the first pass's running per-lane state
_FMIN = float(jnp.finfo(jnp.float32).min)  # a finite "no maximum yet": -inf - -inf would be NaN


def _sum2(x):
    return jnp.sum(jnp.sum(x, axis=1), axis=0)


def _max2(x):
    return jnp.max(jnp.max(x, axis=1), axis=0)


def _min2(x):
    return jnp.min(jnp.min(x, axis=1), axis=0)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _flat(rows, start):  # i32[rows, _LANE] the vocabulary index of each entry of a tile
    return start + _iota((rows, _LANE), 0) * _LANE + _iota((rows, _LANE), 1)


def _prefix(x):
    """f32[N] inclusive prefix sums as a masked [N, N] sum: no scan (cumsum), which the
    Triton lowering handles less surely than a reduction; N is a tile's row or lane count
    (at most 64 at block_v <= 4096)."""
    n = x.shape[0]
    tri = _iota((n, n), 1) <= _iota((n, n), 0)
    return jnp.sum(jnp.where(tri, lax.broadcast_in_dim(x, (n, n), (1,)), 0.0), axis=1)


def _pick2(mass, r):
    """common.pick over mass f32[R, W] >= 0 read row-major (entry i is mass[i // W, i % W]),
    in two levels: the row the draw lands in from the row sums' prefix, then the entry inside
    that row from its own prefix. Equal to the one-level count in exact arithmetic; the total
    is the last prefix, as in pick, and the result is clamped to the last entry with mass."""
    R, W = mass.shape
    rows = jnp.sum(mass, axis=1)  # f32[R]
    ends = _prefix(rows)  # mass up to the end of each row
    ri = _iota((R,), 0)
    target = r * jnp.sum(jnp.where(ri == R - 1, ends, 0.0))
    row = jnp.sum((ends <= target).astype(jnp.int32))  # R: past the end (r * total rounded up)
    base = jnp.sum(jnp.where(ri < row, rows, 0.0))
    sel = jnp.sum(jnp.where(_iota((R, W), 0) == row, mass, 0.0), axis=0)  # f32[W] that row
    wi = _iota((W,), 0)
    n = jnp.sum((base + _prefix(sel) <= target).astype(jnp.int32))
    n = jnp.minimum(n, jnp.max(jnp.where(sel > 0, wi, 0)))
    last = _max2(jnp.where(mass > 0, _iota((R, W), 0) * W + _iota((R, W), 1), 0))
    return jnp.minimum(jnp.where(row < R, row * W + n, last), last)


def _gpu_kernel(z_ref, thr_ref, x_ref, nd_ref, u_ref, g_ref, *rest, V: int, C: int, T: int,
                U: int, G: int, NC: tuple[int, int], has_q: bool):
    q_ref, acc_ref, next_ref = _split_refs(rest, has_q)
    J = z_ref.shape[0]
    k, L = J - 1, _LANE
    TR, R, nC = T // L, C // L, V // C
    g = g_ref[0] > 0
    nd = nd_ref[0]
    thr = [thr_ref[j] for j in range(J)]  # per-position scalars: no [J]-shaped tensors
    x = [x_ref[j] for j in range(k)]

    def rows(ref, j, start, n):  # [n, L] tile of position j from vocabulary row `start`
        return ref[j, pl.ds(pl.multiple_of(start, n), n), :]

    # 1. One pass for each position's maximum, first argmax and filtered softmax denominator
    # (which greedy rows do not read), kept per lane: a lane's running maximum, the first index that took
    # it and its sum of exp(z - max) rescaled when the maximum moves (one exp per entry:
    # exp(-|z - m|) is the new entry's weight or the old sum's factor). No reduction inside
    # the loop, so the next tiles' loads issue without waiting for one.
    def first_pass(i, carry):
        zs = [[rows(z_ref, j, (i * U + uu) * TR, TR) for uu in range(U)] for j in range(J)]
        out = []
        for j, (mt, st, bt) in enumerate(carry):
            for uu in range(U):
                zt = zs[j][uu]
                new = zt > mt  # strict: an earlier index keeps a tie
                e = jnp.exp(-jnp.abs(zt - mt))
                keep = zt >= thr[j]
                st = jnp.where(new, st * e + jnp.where(keep, 1.0, 0.0), st + jnp.where(keep, e, 0.0))
                bt = jnp.where(new, _flat(TR, (i * U + uu) * T), bt)
                mt = jnp.where(new, zt, mt)
            out.append((mt, st, bt))
        return tuple(out)

    lanes = (TR, L)
    init = tuple((jnp.full(lanes, _FMIN, jnp.float32), jnp.zeros(lanes, jnp.float32),
                  jnp.zeros(lanes, jnp.int32)) for _ in range(J))
    steps = V // (T * U)
    # static trip counts: Triton (jax 0.11) rejects a loop bound computed from the row's flag
    # ("scf.for op failed to verify that all of {lowerBound, upperBound, step} have same
    # type", H100), so greedy rows pay for the sums they do not read
    carry = lax.fori_loop(0, steps, first_pass, init)
    m, s, bi = [], [], []
    for mt, st, bt in carry:
        mj = _max2(mt)
        bi.append(_min2(jnp.where(mt == mj, bt, _BIG)))  # the first index of the maximum
        mj = jnp.where(mj > _FMIN, mj, 0.0)  # as the reference: 0 where no entry is finite
        s.append(_sum2(st * jnp.exp(mt - mj)))
        m.append(mj)

    # 2. Accept test per drafted position: the drafted token's logit (and draft probability)
    # are single loads.
    ok = []
    for j in range(k):
        valid = (x[j] >= 0) & (x[j] < V)
        xc = jnp.clip(x[j], 0, V - 1)
        at = (j, lax.div(xc, L), lax.rem(xc, L))
        zx = jnp.where(valid, z_ref[at], -jnp.inf)
        px = jnp.where(zx >= thr[j], jnp.exp(zx - m[j]), 0.0) / s[j]
        qx = jnp.where(valid, q_ref[at], 0.0) if has_q else 1.0
        ok.append(jnp.where(g, x[j] == bi[j], u_ref[j, 0] * qx < px) & (j < nd))
    alive = ok[0]
    a = alive.astype(jnp.int32)
    for j in range(1, k):
        alive = alive & ok[j]
        a = a + alive.astype(jnp.int32)

    def pick_at(vals, i):  # vals[i] for a traced i, from a static list of scalars
        out = vals[0]
        for j in range(1, len(vals)):
            out = jnp.where(i == j, vals[j], out)
        return out

    rejected = a < nd
    ai = jnp.minimum(a, k - 1)  # the draft at the rejected position (unused if none was)
    m_a, s_a, thr_a, x_a = pick_at(m, a), pick_at(s, a), pick_at(thr, a), pick_at(x, ai)

    # 3. The residual at position a: one pass for every chunk's mass (G chunks' loads issued
    # together), then the chunk by inverse CDF over those masses, then the entry inside it.
    def load_chunk(c):
        return rows(z_ref, a, c * R, R), rows(q_ref, ai, c * R, R) if has_q else None

    def residual(c, zt, qt):  # f32[R, L] the residual's unnormalised mass in chunk c
        p = jnp.where(zt >= thr_a, jnp.exp(zt - m_a), 0.0) / s_a
        if qt is None:
            qt = jnp.where(_flat(R, c * C) == x_a, 1.0, 0.0)
        return jnp.where(rejected, jnp.maximum(p - qt, 0.0), p)

    ci = _iota(NC, 0) * NC[1] + _iota(NC, 1)  # i32[NC] the chunk each entry holds the mass of

    def masses_body(i, masses):
        tiles = [load_chunk(i * G + gg) for gg in range(G)]
        for gg, (zt, qt) in enumerate(tiles):
            c = i * G + gg
            masses = jnp.where(ci == c, _sum2(residual(c, zt, qt)), masses)
        return masses

    masses = lax.fori_loop(0, nC // G, masses_body, jnp.zeros(NC, jnp.float32))
    chosen = _pick2(masses, u_ref[a, 1])
    inside = residual(chosen, *load_chunk(chosen))
    tok = chosen * C + _pick2(inside, u_ref[a, 2])
    acc_ref[0] = a
    next_ref[0] = jnp.where(g, pick_at(bi, a), tok)


def _spec_verify_gpu(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs, bs: BlockSizes, interpret: bool):
    from jax.experimental.pallas import triton as plgpu

    B, J, V = z.shape
    C, L = bs.block_v, _LANE
    check(is_pow2(C), f"block_v={C} must be a power of 2 on GPU (Triton tiles)")
    T = min(C, _TILE)
    U = 2 if V % (2 * T) == 0 else 1  # two tiles' loads per position per step: more in flight
    nC = V // C
    G = next(n for n in (4, 2, 1) if nC % n == 0)  # chunks per step of the residual pass
    NCP = max(16, next_pow2(nC))
    NW = min(NCP // 2, L)
    NC = (NCP // NW, NW)  # the chunk masses as a [rows, lanes] tile, no dimension of 1

    def per_row(*shape):  # the whole of row b of an array [B, *shape]
        return pl.BlockSpec((None, *shape), lambda b: (b,) + (0,) * len(shape))

    one = pl.BlockSpec((1,), lambda b: (b,))
    args = [z.reshape(B, J, V // L, L), thr, drafts.astype(jnp.int32), num_drafts.astype(jnp.int32), uniforms,
            greedy.astype(jnp.int32)]
    specs = [per_row(J, V // L, L), per_row(J), per_row(J - 1), one, per_row(J, 3), one]
    if draft_probs is not None:  # read in place: one row per batch row, never padded to J
        args.append(draft_probs.reshape(B, J - 1, V // L, L))
        specs.append(per_row(J - 1, V // L, L))
    kernel = functools.partial(_gpu_kernel, V=V, C=C, T=T, U=U, G=G, NC=NC, has_q=draft_probs is not None)
    a, nxt = pl.pallas_call(
        kernel,
        grid=(B,),
        in_specs=specs,
        out_specs=[one, one],
        out_shape=[jax.ShapeDtypeStruct((B,), jnp.int32)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=2),
        interpret=interpret,
        name="spec_verify_gpu",
    )(*args)
    return a, nxt


_VARIANTS = {"tpu": _spec_verify_tpu, "gpu": _spec_verify_gpu}


def spec_verify_kernel(
    z: jax.Array,  # f32[B, J, V]
    thr: jax.Array,  # f32[B, J]
    drafts: jax.Array,  # i32[B, k]
    num_drafts: jax.Array,  # i32[B]
    uniforms: jax.Array,  # f32[B, J, 3]
    greedy: jax.Array,  # bool[B]
    draft_probs: jax.Array | None = None,  # f32[B, k, V]
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,  # where it runs (None: the default backend)
) -> tuple[jax.Array, jax.Array]:  # (accepted i32[B], next token i32[B])
    bs = block_sizes or BlockSizes()
    validate(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs, bs)
    fn = pick_variant(_VARIANTS, "spec_verify", platform)
    return fn(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs, bs, interpret)
