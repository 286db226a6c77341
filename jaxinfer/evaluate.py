"""Teacher-forced perplexity of a model on a text, through the model's own forward pass.

    from jaxinfer import LLM
    from jaxinfer.evaluate import perplexity
    r = perplexity(LLM(quantization="int8"), open("benchmarks/data/english.txt").read())
    print(r.perplexity, r.tokens)

The text is tokenized once (with BOS when the tokenizer adds one) and scored in windows of
``window`` tokens that advance by ``stride``: every window but the first scores only its
last ``stride`` tokens, each seen with at least ``window - stride`` tokens of context (the
sliding-window evaluation of Hugging Face's perplexity guide). Every window has the same
length (the last one is aligned to the end of the text), so one program compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cache as kv
from jaxinfer.errors import InvalidRequest
from jaxinfer.models.registry import model_family


@dataclasses.dataclass(frozen=True)
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    windows: int


@functools.partial(jax.jit, static_argnames=("cfg", "kv_dtype"))
def _token_nll(weights, tokens, *, cfg, kv_dtype=None):
    """tokens i32[1, T] -> f32[T - 1]: -log p(token t+1 | tokens <= t). With kv_dtype, every
    layer writes its keys/values to a cache of that dtype and attends over what it reads back
    (how the int8 KV cache's rounding reaches the scores); without, no cache at all."""
    mod = model_family(cfg.family)
    cache = None if kv_dtype is None else kv.init_cache(cfg, 1, tokens.shape[1], kv_dtype)
    h, _ = mod.forward(weights, tokens, jnp.zeros(1, jnp.int32), cache, cfg=cfg, read_cache=kv_dtype is not None)
    logp = jax.nn.log_softmax(mod.unembed(weights, h, cfg)[0, :-1], axis=-1)
    return -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=1)[:, 0]


def perplexity(model, text: str | None = None, *, token_ids=None, window: int = 512,
               stride: int = 256, cfg=None, tokenizer=None, kv_cache_dtype: str | None = None) -> Perplexity:
    """Perplexity of ``model`` (an ``LLM``, or a weights pytree with ``cfg`` and
    ``tokenizer``) on ``text`` (or already tokenized ``token_ids``). ``kv_cache_dtype``
    ("float32", "int8", ...) scores through a KV cache of that dtype."""
    if hasattr(model, "weights"):
        weights, cfg, tokenizer = model.weights, model.cfg, model.tokenizer
    else:
        weights = model
        if cfg is None:
            raise InvalidRequest("perplexity of a weights pytree needs cfg=")
    if token_ids is None:
        if text is None or tokenizer is None:
            raise InvalidRequest("perplexity needs text and a tokenizer, or token_ids")
        token_ids = tokenizer.encode(text)
    ids = np.asarray(token_ids, np.int32)
    if not 0 < stride <= window - 1:
        raise InvalidRequest(f"{stride=} must be in [1, window - 1 = {window - 1}]")
    if window > cfg.max_position:
        raise InvalidRequest(f"{window=} exceeds the model's context {cfg.max_position}")
    kv_dtype = None if kv_cache_dtype is None else kv.kv_storage_dtype(kv_cache_dtype, cfg)
    if len(ids) < 2:
        raise InvalidRequest("perplexity needs at least 2 tokens")
    window = min(window, len(ids))
    total, count, windows = 0.0, 0, 0
    scored_to = 1  # tokens [0, scored_to) are done (token 0 has no prediction)
    begin = 0
    while scored_to < len(ids):
        begin = min(begin, len(ids) - window)
        nll = np.asarray(_token_nll(weights, jnp.asarray(ids[None, begin : begin + window]), cfg=cfg,
                                    kv_dtype=kv_dtype))
        # nll[j] scores token begin + j + 1; keep the ones not scored yet
        first = scored_to - (begin + 1)
        total += float(nll[first:].astype(np.float64).sum())
        count += len(nll) - first
        scored_to = begin + window
        windows += 1
        begin += stride
    mean = total / count
    return Perplexity(math.exp(mean), mean, count, windows)
