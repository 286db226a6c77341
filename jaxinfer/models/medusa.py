"""Medusa heads (Cai et al., 2024): K extra decoding heads on the target model's last hidden
state, head i predicting the token i + 1 positions past the one the model itself predicts.

Each head is one residual block, ``h_i = h + silu(h @ w[i] + b[i])``, read out through the
model's own final norm and LM head (shared, frozen). ``w`` starts at zero, so an untrained head
repeats the model's next-token prediction; training (``jaxinfer.train_medusa``) moves it.

A heads directory is an Orbax checkpoint of ``{"w", "b"}`` plus ``medusa.json`` naming the
base model's shape, so loading refuses heads made for another model.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.einsum import einsum
from jaxinfer.errors import CheckpointError
from jaxinfer.models.registry import model_family
from jaxinfer.specs import WeightSpec, init_weights

META_FILE = "medusa.json"
WEIGHTS_DIR = "heads"
FORMAT = "jaxinfer-medusa"


def head_specs(num_heads: int, hidden: int) -> dict:
    """One declaration per weight of the heads."""
    return {
        "w": WeightSpec((num_heads, hidden, hidden), ("medusa_heads", "embed", "embed_out"), init="zeros",
                        dtype="float32"),
        "b": WeightSpec((num_heads, hidden), ("medusa_heads", "embed"), init="zeros", dtype="float32"),
    }


def init_heads(cfg, num_heads: int, key=None, scale: float = 0.0) -> dict:
    """Zero heads (``scale=0``: each repeats the model's own prediction) or random ones."""
    specs = head_specs(num_heads, cfg.d_model)
    if scale == 0.0:
        return init_weights(specs, cfg, jax.random.PRNGKey(0))
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, WeightSpec))
    keys = jax.random.split(key if key is not None else jax.random.PRNGKey(0), len(leaves))
    return jax.tree.unflatten(treedef, [scale * jax.random.normal(k, s.shape, jnp.float32)
                                        for s, k in zip(leaves, keys)])


def head_hidden(heads: dict, h: jax.Array) -> jax.Array:
    """h f32[..., D] (the model's hidden state before its final norm) -> f32[..., K, D]."""
    h = h.astype(jnp.float32)
    z = einsum("...d,kde->...ke", h, heads["w"]) + heads["b"]
    return h[..., None, :] + jax.nn.silu(z)


def head_logits(heads: dict, weights: dict, h: jax.Array, cfg) -> jax.Array:
    """h f32[B, D] -> logits f32[B, K, V] through the model's own final norm and LM head."""
    hk = head_hidden(heads, h).astype(jnp.dtype(cfg.dtype))  # [B, K, D]
    return model_family(cfg.family).unembed(weights, hk, cfg)


def save_heads(dest, heads: dict, cfg, extra: dict | None = None) -> Path:
    """Write the heads as an Orbax checkpoint plus ``medusa.json``; whole or not at all."""
    meta = {"format": FORMAT, "num_heads": int(heads["w"].shape[0]), "hidden_size": cfg.d_model,
            "vocab_size": cfg.vocab_size, **(extra or {})}
    return save_checkpoint(dest, jax.device_get(heads), WEIGHTS_DIR, META_FILE, meta)


def save_checkpoint(dest, tree: dict, weights_dir: str, meta_file: str, meta: dict) -> Path:
    """Write ``tree`` (Orbax, under ``weights_dir``) and ``meta`` (JSON) into the new directory
    ``dest``, through a temporary sibling renamed into place: whole or not at all."""
    import orbax.checkpoint as ocp

    dest = Path(dest).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise CheckpointError(f"{dest}: already exists; remove it or choose another destination")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / weights_dir, tree)
            ckptr.wait_until_finished()
        (tmp / meta_file).write_text(json.dumps(meta, indent=2) + "\n")
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def load_heads(path, cfg) -> tuple[dict, dict]:
    """Read heads made for a model shaped like ``cfg`` -> (heads, meta)."""
    def abstract(meta):
        k, d = meta["num_heads"], cfg.d_model
        return {"w": jax.ShapeDtypeStruct((k, d, d), jnp.float32), "b": jax.ShapeDtypeStruct((k, d), jnp.float32)}

    return read_checkpoint(path, WEIGHTS_DIR, META_FILE, FORMAT, abstract, "a Medusa heads directory", "heads",
                           {"hidden_size": cfg.d_model, "vocab_size": cfg.vocab_size})


def read_checkpoint(path, weights_dir: str, meta_file: str, fmt: str, abstract, what: str, noun: str,
                    expect: dict) -> tuple[dict, dict]:
    """The tree and meta that ``save_checkpoint`` wrote -> (tree, meta). The meta must name
    ``fmt`` and match ``expect`` (the model's shape), else one CheckpointError says which;
    ``abstract(meta)`` gives the tree's shapes."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    try:
        meta = json.loads((path / meta_file).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not {what} ({meta_file}: {e})") from None
    if meta.get("format") != fmt:
        raise CheckpointError(f"{path / meta_file}: format {meta.get('format')!r}, expected {fmt!r}")
    for key, have in expect.items():
        if meta.get(key) != have:
            raise CheckpointError(f"{path}: {noun} made for {key}={meta.get(key)!r}, the model has {have!r}")
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path / weights_dir, abstract(meta)), meta
