"""Weight declarations: one ``WeightSpec`` per weight, and what derives from them.

A model family's ``weight_specs(cfg)`` returns a pytree of ``WeightSpec`` leaves; random
initialisation, checkpoint loading (``loaders``), sharding (``sharding``) and quantization
(``quant``) all walk that one tree. This module sits at the bottom of the package and imports
nothing from jaxinfer (``config`` imports it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from jaxinfer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One declaration per weight: initialisation, eval_shape, sharding and loading derive
    from it."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, one per dim ("embed", "q_heads", ...)
    init: str = "normal"  # "normal" | "ones" | "zeros"
    dtype: str | None = None  # None: the model's dtype
    # Matmul weights: the logical axes the model's einsum sums over ("embed" for wq, the
    # (heads, head_dim) pair for wo). Quantization keeps one scale per remaining channel;
    # () marks a weight that is never quantized (norms, biases).
    contract: tuple[str, ...] = ()

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"{self.shape=} and {self.axes=} differ in rank")
        if not set(self.contract) <= set(self.axes):
            raise ValueError(f"{self.contract=} names axes not in {self.axes=}")

    @property
    def contract_axes(self) -> tuple[int, ...]:
        """Positions of the contracted axes (empty for weights that stay float)."""
        return tuple(i for i, a in enumerate(self.axes) if a in self.contract)


def is_spec(x) -> bool:
    return isinstance(x, WeightSpec)


def weight_key(path) -> tuple[tuple[str, ...], int | None]:
    """A weight's tree path as (names, layer index): ("layers", 3, "wq") -> (("layers", "wq"), 3).

    Per-layer weights live in a list of per-layer dicts rather than stacked on a leading
    axis: on XLA CPU, slicing a stacked [L, ...] array per layer (scan or unrolled) copies
    the weights and made a decode step 1.6x slower.
    """
    names, layer = [], None
    for p in path:
        if isinstance(p, jax.tree_util.SequenceKey):
            layer = p.idx
        else:
            names.append(p.key)
    return tuple(names), layer


def spec_dtype(spec: WeightSpec, cfg: ModelConfig):
    return jnp.dtype(spec.dtype or cfg.dtype)


def init_weights(specs, cfg: ModelConfig, key: jax.Array, scale: float = 0.02):
    """Random weights for tests and tiny configs: normal(0, scale), ones or zeros per spec."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        dt = spec_dtype(spec, cfg)
        if spec.init == "ones":
            out.append(jnp.ones(spec.shape, dt))
        elif spec.init == "zeros":
            out.append(jnp.zeros(spec.shape, dt))
        else:
            out.append((scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(dt))
    return jax.tree.unflatten(treedef, out)
