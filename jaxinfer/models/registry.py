"""Every model family, by name: each is one module ``jaxinfer.models.<name>`` that builds a
``ModelFamily`` (its ``FAMILY``); a new family is its file plus one line in ``FAMILIES``.

A family file that fails to import fails the lookup loudly: nothing here catches its error.
"""

from __future__ import annotations

import functools
import importlib

from jaxinfer.errors import CheckpointError
from jaxinfer.models.family import ModelFamily

# the family modules, in the order a checkpoint's architecture is matched against them
FAMILIES = (
    "llama",
    "gemma3",
    "qwen3",
    "gemma2",
    "gemma4",
    "phi3",
    "olmo2",
    "smollm3",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "glm4",
    "granite",
)


@functools.cache
def _load(name: str) -> ModelFamily:
    family = importlib.import_module(f"jaxinfer.models.{name}").FAMILY
    if family.name != name:
        raise ValueError(f"jaxinfer.models.{name} registers a family named {family.name!r}")
    return family


def model_family(name: str) -> ModelFamily:
    """The family a ``ModelConfig.family`` names."""
    name = str(name)
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r} (known: {', '.join(FAMILIES)})")
    return _load(name)


def all_families() -> tuple[ModelFamily, ...]:
    return tuple(_load(name) for name in FAMILIES)


def num_params(cfg) -> int:
    """Parameters of a model of config ``cfg``, from its family's weight declarations."""
    return model_family(cfg.family).num_params(cfg)


def family_for_hf(hf: dict, path) -> ModelFamily:
    """The family whose ``hf_architectures`` names a config.json's architecture (a config
    without "architectures" is matched by its model_type against GGUF architecture names)."""
    archs = hf.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    for family in all_families():
        if family.hf_architectures & set(archs):
            return family
        if not archs and hf.get("model_type") in family.gguf_architectures and family.config_from_hf:
            return family
    supported = sorted(a for f in all_families() for a in f.hf_architectures)
    what = f"architecture {', '.join(map(str, archs))}" if archs else f"model_type {hf.get('model_type')!r}"
    raise CheckpointError(f"{path}: unsupported {what} in config.json (supported: {', '.join(supported)})")


def family_for_gguf(arch: str, path, meta: dict | None = None) -> ModelFamily:
    """The family of a GGUF architecture. Where several list it (llama.cpp writes Mixtral as
    "llama" with experts), one whose ``gguf_claims(meta)`` holds wins over the others; a
    family with such a predicate takes no file it does not claim."""
    plain = None
    for family in all_families():
        if arch not in family.gguf_architectures:
            continue
        if family.gguf_claims is None:
            plain = plain or family
        elif meta is not None and family.gguf_claims(meta):
            return family
    if plain is not None:
        return plain
    raise CheckpointError(
        f"{path}: unsupported architecture {arch!r} (supported: {', '.join(sorted(supported_gguf_architectures()))})")


def supported_gguf_architectures() -> set[str]:
    return {a for f in all_families() for a in f.gguf_architectures}
