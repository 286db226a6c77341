"""Bytes accessed, op by op, read off an optimized HLO module's text.

XLA's cost analysis gives one ``bytes accessed`` per program. To say which ops carry it, this
module counts each top-level instruction of the entry computation (a ``while`` or
``conditional`` carrying what it runs) as XLA's ``HloCostAnalysis`` does:

* an op reads each operand whole and writes its result (a tuple: every leaf);
* a fusion reads each parameter as its fused users do: a (dynamic) slice or gather of it
  reads the slice, a dynamic-update-slice or scatter into it reads only the update, a
  broadcast or reshape of it reads it whole, any other use reads it whole once however many
  such users it has. A fusion whose root is a dynamic-update-slice or scatter (or a tuple of
  them) writes only the updates: the buffer is updated in place;
* an async copy's start reads its operand and writes its whole result tuple (the destination
  and the operand again), its done writes the destination: a buffer staged in VMEM and read
  there by one fusion counts 5 times its size. An async slice's start reads and writes the
  slice, its done writes it again;
* a ``while`` counts its body and condition once (not per trip), a ``conditional`` its
  dearest branch, a ``call`` its callee;
* bitcasts, tuples, get-tuple-elements, parameters and constants count nothing, nor do custom
  calls (a Pallas call's traffic is counted apart, by what its DMAs move).

Sizes are as laid out: a layout's tile pads the minor dimensions (``type_bytes``). A gather
counts the tiles its rows touch. On small programs compiled for v6e (staged matrix-vector
products, a page scatter, an embedding gather, a loop, a top-k) the sum is XLA's figure to
0.02%; on the 8B decode steps, one layer's bytes to 0.1%, and the whole step to 0.01% at 1 row
and 98% at 256, the rest in the sampler and not found.

``hbm=True`` counts instead only what moves through HBM: an array whose layout puts it in
another memory space (``S(1)`` VMEM, ``S(2)``/``S(6)`` scalar memories) counts nothing, an
async copy or slice counts its HBM side once. This is the traffic the chip's HBM bandwidth
bounds; XLA's figure adds every VMEM read and write beside it.
"""

from __future__ import annotations

import dataclasses
import math
import re

_ITEM = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s16": 2, "u16": 2, "s8": 1, "u8": 1,
         "pred": 1, "s64": 8, "u64": 8, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^{}]*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "custom-call"}
_SLICING = {"slice", "dynamic-slice", "gather"}


def type_bytes(type_text: str, *, hbm: bool = False) -> float:
    """Bytes of every array in an HLO type (``bf16[8,128]{1,0:T(8,128)(2,1)}``, or a tuple of
    them) as laid out: the layout's tile pads the minor dimensions (an f32[256,64] tiled
    (8, 128) takes 256 x 128 floats). With ``hbm``, only arrays whose layout names no memory
    space other than HBM's."""
    total = 0.0
    for dt, dims, layout in _ARRAY.findall(type_text):
        if hbm and re.search(r"S\([1-9]\d*\)", layout):
            continue
        total += _ITEM.get(dt, 4) * _padded_elems([int(d) for d in dims.split(",") if d], layout)
    return total


def _padded_elems(dims: list[int], layout: str) -> int:
    order = re.match(r"\{([\d,]*)", layout)
    tile = re.search(r":T\(([\d,]+)\)", layout)
    dims = list(dims)
    if order and tile and order.group(1):
        minor_to_major = [int(d) for d in order.group(1).split(",")]
        t = [int(x) for x in tile.group(1).split(",")]
        for dim, size in zip(minor_to_major, reversed(t)):  # the tile's last size pads the most minor dim
            if dim < len(dims) and size > 1:
                dims[dim] = -(-dims[dim] // size) * size
    n = 1
    for d in dims:
        n *= d
    return n


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # the result type's text
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list
    args: str  # the operand list's text (a constant's value)
    root: bool
    line: str

    def called(self, key: str) -> list[str]:
        m = re.search(r"\b" + key + r"=(?:\{([^}]*)\}|%?([\w.\-]+))", self.attrs)
        if not m:
            return []
        return [c.strip().lstrip("%") for c in m.group(1).split(",")] if m.group(1) is not None else [m.group(2)]

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.line)
        return m.group(1) if m else ""

    @property
    def param_index(self) -> int:
        m = re.search(r"parameter\((\d+)\)", self.line)
        return int(m.group(1)) if m else -1


def _split_args(rest: str) -> tuple[str, str]:
    """The operand list of ``op(...)`` (``rest`` starts after the opening parenthesis) and what follows."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch in "({"
        depth -= ch in ")}"
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
    """The module's computations by name (each a list of instructions) and the entry's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = comps.setdefault(h.group(2), [])
            if h.group(1):
                entry = h.group(2)
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            args, attrs = _split_args(m.group(5))
            current.append(Instr(m.group(2), m.group(3), m.group(4), re.findall(r"%([\w.\-]+)", args), attrs,
                                 args, bool(m.group(1)), line))
    return comps, entry


def tuple_leaves(type_text: str) -> list[str]:
    """The top-level elements of a tuple type's text (a non-tuple: itself)."""
    t = type_text.strip()
    if not t.startswith("("):
        return [t]
    parts, depth, cur = [], 0, ""
    for ch in t[1:-1]:
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        depth += ch in "({["
        depth -= ch in ")}]"
        cur += ch
    return [*parts, cur.strip()] if cur.strip() else parts


def _row_tiles(gather: Instr, operand_type: str) -> float:
    """How many times a TPU gather reads the rows it gathers: its operand is tiled (8, 128) or
    so on the two minor dims, and a gathered slice fewer rows tall than a tile reads the tile
    (XLA counts an embedding lookup of 256 rows from a bf16 (8, 128)-tiled table as 8 x 256)."""
    if gather.opcode != "gather":
        return 1.0
    tile = re.search(r":T\((\d+),\d+\)", operand_type)
    sizes = re.search(r"slice_sizes=\{([\d,]+)\}", gather.attrs)
    if not tile or not sizes:
        return 1.0
    dims = [int(d) for d in sizes.group(1).split(",")]
    rows = dims[-2] if len(dims) >= 2 else 1
    return max(1.0, int(tile.group(1)) / max(rows, 1))


def trip_count(comps: dict[str, list[Instr]], caller: list[Instr], loop: Instr) -> int | None:
    """The trips of a ``while`` whose condition is ``i < N`` on a counter that starts at a
    constant and goes up by 1 (a ``fori_loop``'s); None when that cannot be read off the HLO."""
    cond = comps.get((loop.called("condition") or [""])[0], [])
    body = comps.get((loop.called("body") or [""])[0], [])
    cn = {i.name: i for i in cond}
    root = next((i for i in cond if i.root), None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    counter, bound = (cn.get(o) for o in root.operands)
    if counter is None or bound is None or counter.opcode != "get-tuple-element" or bound.opcode != "constant":
        return None
    k = re.search(r"index=(\d+)", counter.attrs)
    cs = {i.name: i for i in caller}
    init = cs.get(loop.operands[0]) if loop.operands else None
    if k is None or init is None or init.opcode != "tuple" or int(k.group(1)) >= len(init.operands):
        return None
    start = cs.get(init.operands[int(k.group(1))])
    while start is not None and start.opcode in ("copy", "bitcast") and start.operands:
        start = cs.get(start.operands[0])
    bn = {i.name: i for i in body}
    broot = next((i for i in body if i.root), None)
    if start is None or start.opcode != "constant" or broot is None or broot.opcode != "tuple":
        return None
    step = bn.get(broot.operands[int(k.group(1))])
    if step is None or step.opcode != "add" or not any(
            bn.get(o) is not None and bn[o].opcode == "constant" and _value(bn[o]) == 1 for o in step.operands):
        return None
    n, s0 = _value(bound), _value(start)
    return None if n is None or s0 is None else max(n - s0, 0)


def _value(constant: Instr) -> int | None:
    try:
        return int(constant.args.strip())
    except ValueError:
        return None


class _Counter:
    def __init__(self, comps: dict[str, list[Instr]], hbm: bool, trips: bool = False):
        self.comps, self.hbm, self.trips = comps, hbm, trips
        self.caller: list[Instr] = []

    def size(self, type_text: str) -> float:
        return type_bytes(type_text, hbm=self.hbm)

    def param_read(self, comp: list[Instr], index: int, operand_type: str) -> float:
        """Bytes a fused computation reads of its parameter ``index`` (of type ``operand_type``)."""
        full = self.size(operand_type)
        param = next((i for i in comp if i.opcode == "parameter" and i.param_index == index), None)
        if param is None or not full:
            return full
        by_name = {i.name: i for i in comp}
        size, whole_once = 0.0, False
        for user in comp:
            if param.name not in user.operands:
                continue
            first = user.operands[0] == param.name
            if user.opcode in _SLICING and first:
                size += type_bytes(user.type) * _row_tiles(user, operand_type)
            elif user.opcode == "dynamic-update-slice" and first:
                size += type_bytes(by_name[user.operands[1]].type) if user.operands[1] in by_name else 0.0
            elif user.opcode == "scatter" and first:
                size += type_bytes(by_name[user.operands[-1]].type) if user.operands[-1] in by_name else 0.0
            elif user.opcode in ("broadcast", "reshape"):
                size += full
            elif user.opcode == "fusion":
                inner = self.comps.get((user.called("calls") or [""])[0], [])
                size += sum(self.param_read(inner, k, operand_type) for k, o in enumerate(user.operands)
                            if o == param.name)
            elif not whole_once:
                whole_once = True
                size += full
        return size

    def fusion(self, instr: Instr, types: dict[str, Instr]) -> float:
        comp = self.comps.get((instr.called("calls") or [""])[0], [])
        root = next((i for i in comp if i.root), None)
        by_name = {i.name: i for i in comp}
        outs = [] if root is None else [root] if root.opcode != "tuple" else [by_name.get(o) for o in root.operands]
        leaves = tuple_leaves(instr.type)
        # XLA counts a fusion that ends in dynamic-update-slices or scatters as updating its
        # operands in place (as the TPU compiler places them: ``aliasing_operands``)
        in_place = bool(outs) and len(outs) == len(leaves) and all(
            o is not None and o.opcode in ("dynamic-update-slice", "scatter") for o in outs)
        read = sum(self.param_read(comp, k, types[o].type) for k, o in enumerate(instr.operands) if o in types)
        if in_place:
            # only the updates are written, into buffers where the result lies
            write = sum(type_bytes(by_name[o.operands[-1 if o.opcode == "scatter" else 1]].type)
                        if self.size(leaf) else 0.0 for o, leaf in zip(outs, leaves))
        else:
            write = self.size(instr.type)
        return read + write

    def instruction(self, instr: Instr, types: dict[str, Instr]) -> float:
        op = instr.opcode
        operands = sum(self.size(types[o].type) for o in instr.operands if o in types)
        if op in _FREE:
            return 0.0
        if op == "fusion":
            return self.fusion(instr, types)
        if op == "while":
            n = trip_count(self.comps, self.caller, instr) if self.trips else None
            once = sum(self.total(c) for c in instr.called("body") + instr.called("condition"))
            return once * n if n is not None else once
        if op == "conditional":
            return max((self.total(c) for c in instr.called("branch_computations")), default=0.0)
        if op == "call":
            return sum(self.total(c) for c in instr.called("to_apply"))
        if op == "slice-start":
            # result: ((operand), slice, semaphore)
            piece = tuple_leaves(instr.type)[1]
            if not self.hbm:
                return 2 * type_bytes(piece)
            return type_bytes(piece) * ((operands > 0) + (self.size(piece) > 0))
        if op.endswith("-start"):
            # result: (destination, operand again, ...) for a copy; collectives alike
            if not self.hbm:
                return operands + self.size(instr.type)
            return operands + max(self.size(instr.type) - operands, 0.0)
        if op.endswith("-done"):
            return 0.0 if self.hbm else self.size(instr.type)
        if op in _SLICING and instr.operands and instr.operands[0] in types:
            # reads what it slices (of the first operand; a gather's rows by their tiles)
            src = types[instr.operands[0]].type
            piece = type_bytes(instr.type) * _row_tiles(instr, src) if self.size(src) else 0.0
            rest = sum(self.size(types[o].type) for o in instr.operands[1:] if o in types)
            return piece + rest + self.size(instr.type)
        return operands + self.size(instr.type)

    def rows(self, name: str) -> list[tuple[Instr, float]]:
        comp = self.comps.get(name, [])
        types = {i.name: i for i in comp}
        out = []
        for instr in comp:
            self.caller = comp
            out.append((instr, self.instruction(instr, types)))
        return out

    def total(self, name: str) -> float:
        return sum(b for _, b in self.rows(name))


def computation_bytes(comps: dict[str, list[Instr]], name: str, *, hbm: bool = False,
                      trips: bool = False) -> list[tuple[Instr, float]]:
    """(instruction, bytes accessed) of each top-level instruction of computation ``name``;
    ``trips``: a loop's body counted once per trip where ``trip_count`` reads it (XLA counts it
    once); a loop whose bound is no constant (a chain's, which also stops when its rows are
    done) counts once, its inner loops at their trips."""
    return _Counter(comps, hbm, trips).rows(name)


def _fusion_kind(instr: Instr) -> str:
    m = re.search(r"kind=(k\w+)", instr.attrs)
    return m.group(1) if m else "?"


def scope_of(instr: Instr) -> str:
    """Where an instruction came from in the JAX program, the same in every layer: its
    ``op_name`` without the jit prefix, layer numbers as ``layer*``, and its opcode."""
    name = re.sub(r"^jit\(\w+\)/(\w+/)?", "", instr.op_name)
    name = re.sub(r"layer\d+", "layer*", name)
    kind = instr.opcode if instr.opcode != "fusion" else f"fusion:{_fusion_kind(instr)}"
    return f"{name} [{kind}]" if name else f"[{kind}]"


def _elements(type_text: str) -> int:
    """Elements of the largest array in an HLO type (its logical shape, no tile padding)."""
    return max([1] + [math.prod(int(x) for x in dims.split(",") if x) for _, dims, _ in _ARRAY.findall(type_text)])


def relayouts(text: str, elems: int) -> list[dict]:
    """Every op of the module (the entry, a conditional's branches, a loop's body) that writes
    an array of at least ``elems`` elements into another layout: a copy, a transpose, a copy or
    transpose fusion, a reshape XLA did not make a bitcast. On a TPU each one reads and
    rewrites the whole array. -> [{computation, name, scope, type}]."""
    comps, _ = parse(text)
    fused = {c for instrs in comps.values() for i in instrs if i.opcode == "fusion" for c in i.called("calls")}
    found = []
    for comp, instrs in comps.items():
        if comp in fused:  # inside a fusion: nothing is written out
            continue
        for i in instrs:
            if i.opcode in ("copy", "transpose", "reshape") or (
                    i.opcode == "fusion" and re.match(r"(copy|transpose)", i.name)):
                if _elements(i.type) >= elems:
                    found.append(dict(computation=comp, name=i.name, scope=scope_of(i), type=i.type[:120]))
    return found


def bytes_by_op(text: str, *, top: int = 10, hbm: bool = False, trips: bool = False, loops: bool = False) -> dict:
    """The entry computation's bytes accessed: ``total`` (the sum over its instructions),
    ``top`` (the ``top`` largest instructions: name, ``scope_of``, bytes, result type) and
    ``by_scope`` (bytes per ``scope_of`` key: what compiles of different depths share, so that
    their difference is one layer's). ``loops``: an entry's loop is listed as the instructions
    of its body and condition (times its trips where counted), so that a chain of steps, all
    in one loop, shows its ops; the total is the same."""
    comps, entry = parse(text)
    rows = []
    for instr, b in computation_bytes(comps, entry, hbm=hbm, trips=trips):
        if loops and instr.opcode == "while":
            n = (trip_count(comps, comps[entry], instr) if trips else None) or 1
            rows += [(i, c * n) for comp in instr.called("body") + instr.called("condition")
                     for i, c in computation_bytes(comps, comp, hbm=hbm, trips=trips)]
        else:
            rows.append((instr, b))
    rows = [(i, b) for i, b in rows if b]
    by_scope: dict[str, float] = {}
    for instr, b in rows:
        key = scope_of(instr)
        by_scope[key] = by_scope.get(key, 0.0) + b
    rows.sort(key=lambda r: -r[1])
    return dict(total=sum(b for _, b in rows),
                top=[dict(name=i.name, scope=scope_of(i), bytes=b, type=i.type[:120]) for i, b in rows[:top]],
                by_scope=by_scope)


def loop_bytes(text: str, *, hbm: bool = False) -> float:
    """Bytes of the entry computation's dearest top-level ``while`` (its body and condition
    once, as ``bytes_by_op`` counts it): a chain of steps' loop, whose further trips a caller
    scales apart from what runs once around it (the weights a chain relays out before its
    loop). 0 where the entry has no loop."""
    comps, entry = parse(text)
    return max((b for i, b in computation_bytes(comps, entry, hbm=hbm) if i.opcode == "while"), default=0.0)
