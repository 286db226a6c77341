"""Blockwise speculative verification as a Pallas kernel: one program per row, the row's
logits streamed through vocabulary chunks, no softmax ever materialised.

Per row (J = k + 1 positions, all positions at once as a [J, block_v] tile):
  1. a pass for each position's maximum and first argmax;
  2. a pass for the filtered softmax denominators and the logit (and draft probability) of
     each position's drafted token, so p(x_j) is exp(z[x_j] - m_j) / s_j;
  3. greedy rows accept the longest prefix equal to the argmax; sampled rows accept draft j
     while u_j * q(x_j) < p(x_j) (Leviathan et al. 2023, Chen et al. 2023);
  4. at the first rejected position a, the residual max(0, p_a - q_a) (or p_a when every
     draft passed) is drawn from by inverse CDF in two levels: a pass for the total mass, a
     pass that walks the chunk masses to the chosen chunk, then the entry inside it.
Every pass reads the row from VMEM only; the arithmetic is the reference's, chunk by chunk.

TPU (Mosaic) layout: the row's [J, V] tile sits in VMEM (J * V * 4 bytes: 1 MB at V = 49152,
k = 4); per-row scalars come as [J, 1] columns. On CPU it runs with interpret=True. There is
no Triton (GPU) variant: Triton needs power-of-two blocks and J = k + 1 rarely is, so on GPU
the dispatcher uses the reference (XLA fuses it well there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import pick_variant
from pallas_kernels.spec_verify.common import BlockSizes, pick, validate

_BIG = 2**30


def _kernel(z_ref, thr_ref, x_ref, nd_ref, u_ref, g_ref, *rest, C: int, nC: int, has_q: bool):
    if has_q:
        q_ref, acc_ref, next_ref = rest
    else:
        q_ref = None
        acc_ref, next_ref = rest
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
    ok = jnp.where(g, x == bi, u[:, 0:1] * qx < px) & (jcol < nd)  # bool[J, 1]

    a = jnp.zeros((1, 1), jnp.int32)
    alive = jnp.ones((1, 1), jnp.bool_)
    for j in range(J - 1):  # leading accepts: J is small and static
        alive = alive & ok[j : j + 1]
        a = a + alive.astype(jnp.int32)
    sel = jcol == a  # bool[J, 1] the position of the new token
    pick_at = lambda v: jnp.sum(jnp.where(sel, v, 0), axis=0, keepdims=True)  # noqa: E731  [J, n] -> [1, n]
    rejected = a < nd
    u_a = pick_at(u)  # f32[1, 3]

    def residual(c):  # f32[1, C] the residual's unnormalised mass in chunk c, at position a
        zc, idx = chunk(c)
        p = jnp.where(zc >= thr, jnp.exp(zc - m), 0.0) / s
        r = jnp.where(rejected, jnp.maximum(p - qchunk(c, idx), 0.0), p)
        return pick_at(r)

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
    inside = residual(chosen[0, 0])  # f32[1, C]
    tok = chosen * C + pick(inside, u_a[:, 2])[:, None]
    acc_ref[0] = a
    next_ref[0] = jnp.where(g, pick_at(bi), tok)


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


_VARIANTS = {"tpu": _spec_verify_tpu}


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
) -> tuple[jax.Array, jax.Array]:  # (accepted i32[B], next token i32[B])
    bs = block_sizes or BlockSizes()
    validate(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs, bs)
    fn = pick_variant(_VARIANTS, "spec_verify")
    return fn(z, thr, drafts, num_drafts, uniforms, greedy, draft_probs, bs, interpret)
