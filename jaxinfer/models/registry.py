"""Family name -> the module implementing it (weight_specs, forward, embed, unembed)."""

from __future__ import annotations

import importlib

from jaxinfer.config import Family

_MODULES = {Family.LLAMA: "jaxinfer.models.llama", Family.GEMMA3: "jaxinfer.models.gemma3"}


def family_module(family: Family):
    return importlib.import_module(_MODULES[Family(family)])
