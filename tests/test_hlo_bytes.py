"""The op-by-op bytes count of ``jaxinfer.hlo_bytes`` on a small HLO module worked by hand: a
fused embedding row gather, an in-place page write, a weight staged in VMEM by an async copy,
an async slice, a loop and a conditional. (Its agreement with XLA's own figure on compiled TPU
programs is checked in tests/test_tpu_compile.py, where libtpu is installed.)"""

from __future__ import annotations

from jaxinfer import hlo_bytes

# sizes: embed bf16[1024,256] = 512 KiB, a row 512 B; pool bf16[64,16,128] = 256 KiB, a page
# 4 KiB; w bf16[256,256] = 128 KiB
MODULE = """HloModule m

%row (p0: bf16[1024,256], p1: s32[]) -> bf16[256] {
  %p0 = bf16[1024,256]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %c0 = s32[]{:T(128)} constant(0)
  %ds = bf16[1,256]{1,0} dynamic-slice(%p0, %p1, %c0), dynamic_slice_sizes={1,256}
  ROOT %r = bf16[256]{0} reshape(%ds)
}

%write (q0: bf16[64,16,128], q1: bf16[1,16,128], q2: s32[]) -> bf16[64,16,128] {
  %q0 = bf16[64,16,128]{2,1,0} parameter(0)
  %q1 = bf16[1,16,128]{2,1,0} parameter(1)
  %q2 = s32[]{:T(128)} parameter(2)
  %z = s32[]{:T(128)} constant(0)
  ROOT %dus = bf16[64,16,128]{2,1,0} dynamic-update-slice(%q0, %q1, %q2, %z, %z)
}

%gemv (g0: bf16[256,256], g1: bf16[256]) -> bf16[256] {
  %g0 = bf16[256,256]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %g1 = bf16[256]{0:S(1)} parameter(1)
  %b = bf16[256,256]{1,0} broadcast(%g1), dimensions={0}
  %m = bf16[256,256]{1,0} multiply(%g0, %b)
  %c = bf16[] constant(0)
  ROOT %red = bf16[256]{0} reduce(%m, %c), dimensions={0}, to_apply=%add
}

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%body (t: (s32[], f32[512])) -> (s32[], f32[512]) {
  %t = (s32[], f32[512]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[512]{0} get-tuple-element(%t), index=1
  %y = f32[512]{0} exponential(%x)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %o = (s32[], f32[512]) tuple(%next, %y)
}

%cond (t: (s32[], f32[512])) -> pred[] {
  %t = (s32[], f32[512]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%cheap (u: f32[512]) -> f32[512] {
  %u = f32[512]{0} parameter(0)
  ROOT %neg = f32[512]{0} negate(%u)
}

%dear (v: f32[512]) -> f32[512] {
  %v = f32[512]{0} parameter(0)
  %e = f32[512]{0} exponential(%v)
  ROOT %l = f32[512]{0} log(%e)
}

ENTRY %main (embed: bf16[1024,256], tok: s32[], pool: bf16[64,16,128], page: s32[], new: bf16[1,16,128], w: bf16[256,256], x: f32[512], k: s32[], big: s8[4096]) -> (bf16[256], bf16[64,16,128]) {
  %embed = bf16[1024,256]{1,0:T(8,128)(2,1)} parameter(0), metadata={op_name="jit(step)/step/embed"}
  %tok = s32[]{:T(128)} parameter(1)
  %pool = bf16[64,16,128]{2,1,0:T(8,128)(2,1)} parameter(2)
  %page = s32[]{:T(128)} parameter(3)
  %new = bf16[1,16,128]{2,1,0:T(8,128)(2,1)} parameter(4)
  %w = bf16[256,256]{1,0:T(8,128)(2,1)} parameter(5)
  %x = f32[512]{0} parameter(6)
  %k = s32[] parameter(7)
  %big = s8[4096]{0} parameter(8)
  %emb = bf16[256]{0:S(1)} fusion(%embed, %tok), kind=kLoop, calls=%row, metadata={op_name="jit(step)/step/layer3/embed/take"}
  %pool2 = bf16[64,16,128]{2,1,0:T(8,128)(2,1)} fusion(%pool, %new, %page), kind=kLoop, calls=%write, metadata={op_name="jit(step)/step/layer0/attention/scatter"}
  %cs = (bf16[256,256]{1,0:T(8,128)(2,1)S(1)}, bf16[256,256]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w)
  %cd = bf16[256,256]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %h = bf16[256]{0:S(1)} fusion(%cd, %emb), kind=kLoop, calls=%gemv
  %ss = ((s8[4096]{0}), s8[1024]{0:S(1)}, s32[]{:S(2)}) slice-start(%big), slice={[0:1024]}
  %sd = s8[1024]{0:S(1)} slice-done(%ss)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[512]) tuple(%zero, %x)
  %loop = (s32[], f32[512]) while(%t0), condition=%cond, body=%body
  %which = f32[512]{0} conditional(%k, %x, %x), branch_computations={%cheap, %dear}
  ROOT %out = (bf16[256]{0}, bf16[64,16,128]{2,1,0}) tuple(%h, %pool2)
}
"""

KiB = 1024


def _bytes(hbm=False):
    comps, entry = hlo_bytes.parse(MODULE)
    return {i.name: b for i, b in hlo_bytes.computation_bytes(comps, entry, hbm=hbm)}


def test_each_op_counts_what_xla_counts():
    b = _bytes()
    # the row it slices (not the 512 KiB table), the token (s32) and the row it writes
    assert b["emb"] == 512 + 4 + 512
    # reads the new page, the page number and (as XLA counts an update in place) the page it
    # overwrites, writes the page: the 256 KiB pool is neither read nor copied
    assert b["pool2"] == 3 * 4 * KiB + 4
    assert b["cs"] == 128 * KiB * 3 + 4  # reads w, writes the tuple (the VMEM copy, w again, a u32)
    assert b["cd"] == 128 * KiB  # writes the VMEM copy
    # gemv reads w's copy (once, however many fused users) and the vector its broadcast reads
    assert b["h"] == 128 * KiB + 512 + 512
    assert b["ss"] == 2 * KiB and b["sd"] == KiB  # the slice read and written, and written again
    # the body once (exp reads and writes 2 KiB, the counter's add 12 B) and the condition
    assert b["loop"] == 2 * 2 * KiB + 12 + 4 + 4 + 1
    assert b["which"] == 4 * 2 * KiB  # the dearer branch: exp, then log, each reading and writing 2 KiB
    assert all(b[n] == 0 for n in ("embed", "t0", "zero", "out"))


def test_hbm_count_leaves_out_what_lies_in_vmem():
    b = _bytes(hbm=True)
    assert b["emb"] == 512 + 4  # the row and the token read from HBM; the result lies in VMEM
    assert b["pool2"] == 12 * KiB + 4
    assert b["cs"] == 128 * KiB and b["cd"] == 0  # w read from HBM once
    assert b["h"] == 0  # all in VMEM
    assert b["ss"] == KiB and b["sd"] == 0  # the slice read from HBM once


def test_bytes_by_op_keys_ops_by_their_jax_op_across_layers():
    r = hlo_bytes.bytes_by_op(MODULE, top=2)
    assert r["total"] == sum(_bytes().values())
    assert [t["name"] for t in r["top"]] == ["cs", "h"]
    assert r["by_scope"]["layer*/embed/take [fusion:kLoop]"] == 1 * KiB + 4
    assert r["by_scope"]["layer*/attention/scatter [fusion:kLoop]"] == 12 * KiB + 4


def test_loops_at_their_trip_counts():
    """``trips`` counts a loop's body per trip where the counter runs from a constant to a
    constant bound (here 0 to 4); XLA's figure, and the default, count it once."""
    comps, entry = hlo_bytes.parse(MODULE)
    loop = next(i for i in comps[entry] if i.opcode == "while")
    assert hlo_bytes.trip_count(comps, comps[entry], loop) == 4
    once = dict((i.name, b) for i, b in hlo_bytes.computation_bytes(comps, entry))
    trips = dict((i.name, b) for i, b in hlo_bytes.computation_bytes(comps, entry, trips=True))
    assert trips["loop"] == 4 * once["loop"]
    assert trips["which"] == once["which"]


def test_a_loop_whose_bound_is_no_constant_counts_once_with_trips():
    """A loop that stops on a runtime value (a chain of decode steps that ends when its rows are
    done) has no trip count in the HLO: ``trips`` counts it once, as XLA does, so that a caller
    scales it by the trips it knows."""
    module = MODULE.replace("%n = s32[] constant(4)", "%n = s32[] get-tuple-element(%t), index=0")
    comps, entry = hlo_bytes.parse(module)
    loop = next(i for i in comps[entry] if i.opcode == "while")
    assert hlo_bytes.trip_count(comps, comps[entry], loop) is None
    once = dict((i.name, b) for i, b in hlo_bytes.computation_bytes(comps, entry))
    trips = dict((i.name, b) for i, b in hlo_bytes.computation_bytes(comps, entry, trips=True))
    assert trips["loop"] == once["loop"]


def test_loop_bytes_is_the_entry_loops_body_once():
    """``loop_bytes``: what the entry's loop counts (its body and condition once), apart from
    the ops around it, so that a chain's further steps scale the loop alone."""
    assert hlo_bytes.loop_bytes(MODULE) == _bytes()["loop"]
    assert hlo_bytes.loop_bytes(MODULE, hbm=True) == _bytes(hbm=True)["loop"]
    assert hlo_bytes.loop_bytes(MODULE.replace(" while(", " copy(")) == 0.0


def test_bytes_by_op_can_list_a_loop_by_the_ops_of_its_body():
    """``loops``: the entry's loop is listed as its body's and condition's ops (a chain of
    steps shows its layers' ops, not one ``while``), and the total stays the same."""
    whole, listed = hlo_bytes.bytes_by_op(MODULE), hlo_bytes.bytes_by_op(MODULE, loops=True)
    assert listed["total"] == whole["total"]
    assert "[while]" in whole["by_scope"] and "[while]" not in listed["by_scope"]
    assert listed["by_scope"]["[exponential]"] == 2 * 2 * KiB
    trips = hlo_bytes.bytes_by_op(MODULE, loops=True, trips=True)
    assert trips["total"] == hlo_bytes.bytes_by_op(MODULE, trips=True)["total"]
