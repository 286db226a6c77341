"""``jaxinfer convert``: any checkpoint (a registry name, a Hub id, GGUF, Hugging Face or
Orbax) to an Orbax checkpoint (see ``orbax_io`` for the layout), on local disk or in a bucket
(``gs://``, ``s3://``). It loads through
``checkpoint.load`` and writes through ``orbax_io.save``, so it sits above both.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from jaxinfer import bucket, quant, registry, storage
from jaxinfer.errors import CheckpointError
from jaxinfer.loaders import checkpoint, hf, orbax_io
from jaxinfer.loaders.common import detect_format

DEFAULT_STORE = "checkpoints"  # where a bare destination name goes, relative to the working directory
_DTYPES = ("float32", "bfloat16", "float16")


def default_dest(dest) -> Path:
    """A bare name (no directory part) goes under the local store ``checkpoints/``."""
    s = os.fspath(dest)
    if not os.path.dirname(s) and not Path(s).is_absolute():
        return Path.cwd() / DEFAULT_STORE / s
    return Path(s).expanduser().absolute()


def convert(src, dest, *, dtype: str | None = None, progress: bool = True,
            quantize: str | None = None, quant_group: int | None = None) -> Path | str:
    """Convert a registry name, a Hub id or a checkpoint path to an Orbax checkpoint; returns its path.

    dtype None or "auto" keeps the source's precision: float32 for GGUF (dequantized), the
    saved dtype of a Hugging Face or converted checkpoint. quantize ("int8" / "int4" /
    "w8a8", with quant_group for int4) writes the weights quantized, as ``LLM(quantize=)``
    would load them.
    """
    if storage.is_url(dest):  # written locally, then uploaded, its jaxinfer.json last
        u = storage.parse(str(dest).rstrip("/"))
        if storage.listing(u):
            raise CheckpointError(f"{u}: already holds objects; remove them or choose another destination")
        with tempfile.TemporaryDirectory() as tmp:
            local = convert(src, Path(tmp) / "ckpt", dtype=dtype, progress=progress, quantize=quantize,
                            quant_group=quant_group)
            bucket.upload_tree(local, u, last=orbax_io.META_FILE)
        return str(u)
    qcfg = quant.quant_config(quantize, quant_group)
    dest = default_dest(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise CheckpointError(f"{dest}: already exists; remove it or choose another destination")
    path = registry.resolve(src, progress=progress, check_config=lambda config: hf.family_for(config, src))
    fmt = detect_format(path)
    if dtype in (None, "auto"):
        dtype = _source_dtype(path, fmt)
    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(_DTYPES)} or 'auto', got {dtype!r}")
    loaded = checkpoint.load(path, dtype=dtype, quantize=qcfg)
    return orbax_io.save(dest, loaded.cfg, loaded.weights, path)


def _source_dtype(path: Path, fmt: str) -> str:
    if fmt == "hf":
        return hf.saved_dtype(hf.read_config(path))
    if fmt == "orbax":
        return orbax_io.read_config(path).dtype
    return "float32"
