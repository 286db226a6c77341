"""Grouped matmul's shared pieces: block sizes, validation, and the work list every tiled
implementation walks.

Rows of x are sorted by group: group g owns rows [offsets[g], offsets[g + 1]) where offsets
is the running sum of ``group_sizes``. A caller holding only some groups' weights (expert
parallelism: each device its own experts) passes ``group_offset``: its weight's group j is
group ``group_offset + j`` of ``group_sizes``; rows of any other group come out 0.

The work list (megablox's schedule): rows are cut into tiles of ``block_m``; a work item is
one (row tile, group) pair with at least one row of the group in the tile, in order of group,
then tile. Consecutive groups share at most one tile, so there are at most
``cdiv(M, block_m) + G - 1`` items: the weights are read about once per group (once per
tile a big group spans), never once per row and never for a group with no rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._common import cdiv, check


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles: block_m rows of the sorted x per work item, output columns block_n at a time,
    the contraction in steps of block_k. block_n and block_k must divide O and I (weights are
    never padded per call); rows are padded to block_m. Chosen automatically for float weights
    whose O no multiple of 128 divides, the last output block runs past O (TPU)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 512

    def __post_init__(self):
        check(min(self.block_m, self.block_n, self.block_k) > 0, f"block sizes must be positive: {self}")


def default_block_m(M: int, groups: int, *, lo: int = 8, hi: int = 128) -> int:
    """Rows per tile for M rows over ``groups`` groups: about the mean group size, a power of
    two in [lo, hi]. Decode (2 rows per expert) wants small tiles, so a tile does not carry
    rows of groups it does not compute; a long prompt (hundreds of rows per expert) wants
    large ones, so a big group's weight is read a few times, not once per 8 rows."""
    mean = max(1, M // max(1, groups))
    b = lo
    while b < mean and b < hi:
        b *= 2
    return b


@dataclasses.dataclass(frozen=True)
class Layout:
    """What ``validate`` learnt about a call's weight."""

    groups: int  # G, the groups the weight holds
    in_size: int  # I
    out_size: int  # O
    quant: str  # "": float [G, I, O]; "int8": [I, G*O]; "int4": packed [I/2, G*O]
    int4_group: int = 0  # contracted rows per int4 scale


def validate(x, w, group_sizes, w_scale, out_size: int | None) -> Layout:
    """Checks a grouped matmul's operands.

    w is one of: float [G, I, O]; the int8 matrix [I, G*O] of a weight [G, I, O] quantized
    with one scale per (group, output channel), w_scale f32[G*O] (how ``jaxinfer.quant``
    stores a weight whose group axis is not contracted); packed int4 [I/2, G*O] (the same,
    two values a byte, as ``quant_matmul.pack_int4``) with w_scale f32[I/int4_group, G*O].
    ``out_size`` (O) is needed for the quantized forms."""
    check(x.ndim == 2, f"x must be [M, I]; got {x.shape=}")
    check(jnp.issubdtype(x.dtype, jnp.floating), f"{x.dtype=} must be floating point")
    check(group_sizes.ndim == 1 and jnp.issubdtype(group_sizes.dtype, jnp.integer),
          f"group_sizes must be int[num_groups]; got {group_sizes.shape=} {group_sizes.dtype=}")
    M, I = x.shape
    if w.ndim == 3:
        check(w_scale is None, "a float weight [G, I, O] takes no w_scale")
        check(jnp.issubdtype(w.dtype, jnp.floating), f"a [G, I, O] weight must be floating point; got {w.dtype}")
        G, Iw, O = w.shape
        check(Iw == I, f"contracted sizes differ: {x.shape=} {w.shape=}")
        check(G <= group_sizes.shape[0], f"the weight holds {G} groups, more than {group_sizes.shape[0]=}")
        return Layout(G, I, O, "")
    check(w.ndim == 2 and w.dtype == jnp.int8,
          f"w must be float [G, I, O] or an int8 matrix [I, G*O] / [I/2, G*O]; got {w.shape=} {w.dtype=}")
    check(out_size is not None and out_size > 0, "a quantized weight [I, G*O] needs out_size=O")
    O = out_size
    rows, cols = w.shape
    check(cols % O == 0, f"{out_size=} must divide the weight's {cols} columns")
    G = cols // O
    check(G <= group_sizes.shape[0], f"the weight holds {G} groups, more than {group_sizes.shape[0]=}")
    check(w_scale is not None, "a quantized weight needs w_scale")
    if rows == I:
        check(w_scale.shape == (cols,), f"int8 weights [I, G*O] need w_scale [G*O]={cols}; got {w_scale.shape}")
        return Layout(G, I, O, "int8")
    check(2 * rows == I, f"w has {rows} rows: need I={I} (int8) or I/2 (packed int4)")
    check(w_scale.ndim == 2 and w_scale.shape[1] == cols and w_scale.shape[0] > 0 and I % w_scale.shape[0] == 0,
          f"packed int4 weights need w_scale [I/group, G*O]; got {w_scale.shape} for {I=} {cols=}")
    group = I // w_scale.shape[0]
    check(group % 2 == 0, f"int4 {group=} must be even")
    return Layout(G, I, O, "int4", group)


# ----------------------------------------------------------------------------- schedule
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkItems:
    """The work list of one call (module docstring), padded to a static length W: items past
    ``count`` repeat the last real item's tile and group with an empty row range, so a
    kernel that walks all W keeps its last blocks where they are and writes nothing."""

    group: jax.Array  # i32[W] the item's group, counted within the weight (0 .. G-1)
    tile: jax.Array  # i32[W] the item's row tile
    lo: jax.Array  # i32[W] first row of the group (absolute)
    hi: jax.Array  # i32[W] one past its last row; lo == hi for the padding items
    count: jax.Array  # i32[] real items


def local_bounds(group_sizes: jax.Array, group_offset, groups: int) -> tuple[jax.Array, jax.Array]:
    """(starts, ends) i32[G]: the rows of the weight's groups group_offset .. + G - 1."""
    sizes = group_sizes.astype(jnp.int32)
    ends_all = jnp.cumsum(sizes)
    starts_all = ends_all - sizes
    off = jnp.asarray(group_offset, jnp.int32)
    starts = jax.lax.dynamic_slice_in_dim(starts_all, off, groups)
    ends = jax.lax.dynamic_slice_in_dim(ends_all, off, groups)
    return starts, ends


def work_items(group_sizes: jax.Array, group_offset, groups: int, M: int, block_m: int) -> WorkItems:
    """The work list over M sorted rows in tiles of block_m, for the weight's ``groups``
    groups starting at ``group_offset``."""
    starts, ends = local_bounds(group_sizes, group_offset, groups)
    sizes = ends - starts
    first = starts // block_m
    last = (jnp.maximum(ends, 1) - 1) // block_m
    per = jnp.where(sizes > 0, last - first + 1, 0)  # tiles each group touches
    cum = jnp.cumsum(per)
    count = cum[-1]
    W = cdiv(M, block_m) + groups - 1
    slot = jnp.minimum(jnp.arange(W, dtype=jnp.int32), jnp.maximum(count - 1, 0))
    g = jnp.minimum(jnp.searchsorted(cum, slot, side="right"), groups - 1).astype(jnp.int32)
    tile = first[g] + slot - (cum[g] - per[g])
    real = jnp.arange(W) < count
    lo = starts[g]
    hi = jnp.where(real, ends[g], lo)
    # no items at all: every slot is tile 0 of group 0 with nothing to write
    tile = jnp.where(count > 0, tile, 0).astype(jnp.int32)
    return WorkItems(g, tile, lo, hi, count.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Windows:
    """A loop's work list where row windows need not be tile-aligned: window w holds rows
    [start[w], start[w] + block_m) of group ``group[w]``, keeping those below ``end[w]``.
    Each group's rows are cut into windows from its own first row, so a group of up to
    block_m rows is one window and one read of its weight (aligned tiles split a group that
    straddles a tile boundary into two items). At most ``cdiv(M, block_m) + G`` of them."""

    group: jax.Array  # i32[W] the window's group, counted within the weight
    start: jax.Array  # i32[W] its first row
    end: jax.Array  # i32[W] one past the group's last row
    count: jax.Array  # i32[] real windows


def group_windows(group_sizes: jax.Array, group_offset, groups: int, M: int, block_m: int) -> Windows:
    starts, ends = local_bounds(group_sizes, group_offset, groups)
    per = cdiv_array(ends - starts, block_m)  # windows of each group
    cum = jnp.cumsum(per)
    W = cdiv(M, block_m) + groups
    slot = jnp.arange(W, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(cum, slot, side="right"), groups - 1).astype(jnp.int32)
    start = starts[g] + (slot - (cum[g] - per[g])) * block_m
    return Windows(g, start.astype(jnp.int32), ends[g], cum[-1].astype(jnp.int32))


def cdiv_array(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


def local_row_mask(group_sizes: jax.Array, group_offset, groups: int, M: int) -> jax.Array:
    """bool[M]: rows that belong to one of the weight's groups (the rest come out 0)."""
    starts, ends = local_bounds(group_sizes, group_offset, groups)
    rows = jnp.arange(M, dtype=jnp.int32)
    return (rows >= starts[0]) & (rows < ends[-1])
