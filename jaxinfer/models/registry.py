"""Family name -> the module implementing it (weight_specs, forward, embed, unembed,
decoder_layers, CHECKPOINT_NAMES, HF_ARCHITECTURES, config_from_hf): ``jaxinfer.models.<family>``."""

from __future__ import annotations

import importlib

from jaxinfer.config import Family


def family_module(family: Family):
    return importlib.import_module(f"jaxinfer.models.{Family(family).value}")
