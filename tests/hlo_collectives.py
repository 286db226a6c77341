"""The collectives of a compiled HLO module's text, with the device groups each one spans.

XLA prints replica groups in three forms: explicit (``{{0,1},{2,3}}``), iota
(``[2,2]<=[4]`` or ``[2,2]<=[2,2]T(1,0)``) and mesh (``mesh['axis_0'=2,'axis_1'=2],
device_ids=([2,2]T(1,0)) {'axis_0'}``: the devices laid out on the named axes, one group per
combination of the axes not listed). Collective-permutes give source/target pairs instead.
"""

from __future__ import annotations

import re

import numpy as np

_OP = re.compile(r"= (\S+?)(?:\{[^}]*\})? (all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter|"
                 r"collective-broadcast)(?:-start)?\(")


def _iota(dims, reshape, perm=None):
    a = np.arange(int(np.prod(reshape))).reshape(reshape)
    if perm is not None:
        a = a.transpose(perm)
    return a.reshape(dims)


def _ints(text):
    return [int(x) for x in re.findall(r"\d+", text)]


def groups_of(line: str, n_devices: int) -> list[list[int]]:
    """Device groups (logical ids) of one collective instruction line."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if m:
        return [_ints(p) for p in re.findall(r"\{\d+,\d+\}", m.group(1))]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:<=\[([\d,]+)\])?"
                  r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        if m.group(2):
            dims = _ints(m.group(2))
            ids = _iota(dims, _ints(m.group(3)) if m.group(3) else dims, _ints(m.group(4)) if m.group(4) else None)
        else:
            ids = np.arange(int(np.prod(sizes)))
        ids = np.asarray(ids).reshape(sizes)
        over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(5))]
        rest = [i for i in range(len(names)) if i not in over]
        g = ids.transpose(rest + over).reshape(-1, int(np.prod([sizes[i] for i in over])) if over else 1)
        return g.tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        return _iota((int(m.group(1)), int(m.group(2))), _ints(m.group(3)),
                     _ints(m.group(4)) if m.group(4) else None).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m and m.group(1):
        return [_ints(g) for g in re.findall(r"\{[\d,]*\}", m.group(1))]
    return [list(range(n_devices))]  # no groups: every device


def collectives(hlo_text: str, n_devices: int):
    """(op, result shape, device groups, line) of every collective in a compiled module."""
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        shape = _ints(m.group(1).split("[", 1)[1].split("]")[0]) if "[" in m.group(1) else []
        yield m.group(2), shape, groups_of(line, n_devices), line
