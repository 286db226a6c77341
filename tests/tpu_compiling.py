"""The engine's packed step compiled for a TPU from this CPU host (libtpu's compiler over a
``jax.experimental.topologies`` device; nothing runs), and what its optimized HLO says about
the page pools."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer import cache as kv
from jaxinfer import dispatch
from jaxinfer.engine.slots import make_slots
from jaxinfer.engine.step import packed_step
from jaxinfer.models.packed import PackedBatch
from jaxinfer.models.registry import model_family
from jaxinfer.specs import init_weights


def tpu_device(topology: str):
    """The first device of a one-chip TPU topology ("v5e:1x1", "v6e:1x1")."""
    from jax.experimental import topologies

    # nothing runs on a TPU here: let several processes (test workers) load libtpu at once
    # instead of the second failing on its lockfile
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology, chips_per_host_bounds=(1, 1, 1))
    return topo.devices[0]


def step_batch(rows: int, width: int, prefill: int = 0) -> PackedBatch:
    """A packed batch of this shape (contents do not matter to the compiler)."""
    z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    N = rows + prefill
    return PackedBatch(tokens=z(N), positions=z(N), write_page=z(N), write_wpage=z(N),
                       active=np.zeros(rows, np.bool_), use_prev=np.zeros(rows, np.bool_), last_q=z(rows),
                       table=z(rows + 1, width), wtable=z(rows + 1, width), wbase=z(rows + 1),
                       seg=np.full(prefill, -1, np.int32), hist_end=np.int32(0),
                       targets=np.full(prefill, -1, np.int32), rows=rows, q=1, max_segments=min(prefill, 4))


def compile_packed_step(cfg, device, kernels: dispatch.Kernels, *, rows: int, num_pages: int, page_size: int,
                        width: int, prefill: int = 0, keys_transposed: bool | None = None):
    """(compiled executable, pools' shapes) of ``step.packed_step`` for ``device`` with pools
    k_pages, v_pages and slots donated as the engine donates them. keys_transposed: the keys
    layout (default: the engine's choice for a TPU, ``dispatch.keys_transposed``)."""
    if keys_transposed is None:
        keys_transposed = dispatch.keys_transposed(kernels, device.platform)
    mesh = Mesh(np.array([device]), ("model",))
    on_tpu = NamedSharding(mesh, PartitionSpec())

    def abstract(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_tpu), tree)

    mod = model_family(cfg.family)
    weights = abstract(jax.eval_shape(lambda: init_weights(mod.weight_specs(cfg), cfg, jax.random.key(0))))
    pools = abstract(jax.eval_shape(lambda: kv.init_paged_cache(cfg, num_pages, page_size,
                                                                 keys_transposed=keys_transposed)))
    slots = abstract(jax.eval_shape(lambda: make_slots(cfg.vocab_size, rows, 0, vocab_state=False)))
    batch = abstract(jax.eval_shape(lambda: jax.tree.map(jnp.asarray, step_batch(rows, width, prefill))))
    step = jax.jit(packed_step, static_argnames=("cfg", "windowed", "num_logprobs", "prompt_logprobs", "kernels",
                                                  "keys_transposed"),
                   donate_argnames=("k_pages", "v_pages", "slots"))
    with jax.set_mesh(mesh):  # Mosaic reads the TPU's kind from the mesh
        lowered = step.lower(weights, batch, pools.k, pools.v, slots, cfg=cfg, windowed=pools.windowed,
                             num_logprobs=-1, prompt_logprobs=-1, kernels=kernels, keys_transposed=keys_transposed)
        compiled = lowered.compile()
    shapes = {tuple(a.shape) for a in pools.k + pools.v if a is not None}
    return compiled, shapes, pools


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]\{[^}]*\}\s+([\w\-]+)\(")
# (not copy-start / copy-done: XLA's memory-space prefetches of a pool small enough to fit in
# faster memory, which keep its layout)
POOL_COPIES = ("copy", "transpose", "fusion")


def pool_sized_ops(hlo: str, pool_shapes, kinds=POOL_COPIES) -> list[str]:
    """Instructions of the optimized HLO text whose result has a pool's shape and whose op is
    one of ``kinds``, other than the in-place writes (fusions XLA names for their scatter or
    dynamic-update-slice root); each line as written."""
    dims = {",".join(map(str, s)) for s in pool_shapes}
    out = []
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m or m.group(2) not in dims or m.group(3) not in kinds:
            continue
        if m.group(3) == "fusion" and re.match(r"(scatter|dynamic[-_]update[-_]slice)", m.group(1)):
            continue
        out.append(line.strip())
    return out
