"""Random weights of any family made on the device from its weight declarations, and a
word-level tokenizer to go with them: for measuring model shapes whose checkpoints are not
at hand (an 8B model on a lent GPU, a tiny model with a real vocabulary on CPU). Nothing is
read from disk and nothing large crosses from the host.

    loaded = random_loaded(cfg, quantize=quant.quant_config("int8"))
    llm = LLM(loaded, max_model_len=2048)

Each weight is drawn by one jitted function per distinct (shape, dtype, init, scheme), so a
32-layer model compiles a handful of small programs, and a quantized weight never exists in
float beyond its own call.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.errors import InvalidRequest
from jaxinfer.loaders.common import Loaded
from jaxinfer.loaders.quantize import quantize_weight
from jaxinfer.models.registry import model_family
from jaxinfer.quant import QuantConfig, QuantScheme
from jaxinfer.specs import WeightSpec, is_spec, spec_dtype


@functools.cache
def _maker(spec: WeightSpec, dtype, qcfg: QuantConfig | None, scale: float):
    def make(key):
        if spec.init == "ones":
            w = jnp.ones(spec.shape, dtype)
        elif spec.init == "zeros":
            w = jnp.zeros(spec.shape, dtype)
        else:
            w = (scale * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)
        return w if qcfg is None else quantize_weight("random", spec, w, qcfg)

    return jax.jit(make)


def random_weights(cfg: ModelConfig, *, quantize: QuantConfig | None = None, seed: int = 0,
                   scale: float = 0.02) -> dict:
    """The family's weight tree for ``cfg``: normal(0, scale) matmul and embedding weights (int8
    or int4 when ``quantize`` says, each quantized right after it is drawn), ones and zeros as
    declared, all on the default device. w8a8 needs activations to calibrate and is refused."""
    if quantize is not None and quantize.scheme == QuantScheme.W8A8:
        raise InvalidRequest("random weights support quantize int8 and int4, not w8a8 (it calibrates on activations)")
    specs = model_family(cfg.family).weight_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [_maker(s, spec_dtype(s, cfg), quantize, scale)(k) for s, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``vocab_size`` tokens "t0" .. "t{V-1}" (t0 pad, t1 BOS, t2
    EOS), each decoding to its own name: text in and out of a random model without a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from jaxinfer.tokenizer import tokenizer_from_hf_dir

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    with tempfile.TemporaryDirectory() as d:
        tok.save(str(Path(d) / "tokenizer.json"))
        (Path(d) / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "t1", "eos_token": "t2", "pad_token": "t0", "unk_token": "t3"}))
        return tokenizer_from_hf_dir(d)


def random_loaded(cfg: ModelConfig, *, tokenizer=None, quantize: QuantConfig | None = None, seed: int = 0,
                  scale: float = 0.02) -> Loaded:
    """What ``LLM`` takes in place of a checkpoint path: ``random_weights`` of ``cfg`` with
    ``tokenizer`` (default: ``word_tokenizer(cfg.vocab_size)``)."""
    tokenizer = tokenizer if tokenizer is not None else word_tokenizer(cfg.vocab_size)
    return Loaded(cfg, random_weights(cfg, quantize=quantize, seed=seed, scale=scale), tokenizer, "random")
