"""Training Medusa heads by self-distillation (``jaxinfer train-medusa``).

1. The frozen model answers a prompt set with its own greedy continuations (``LLM.chat``):
   the heads learn to predict what the model itself will say, which is what verification
   accepts.
2. One forward pass per sequence gives the hidden states before the final norm; head i at
   position t is trained to predict token t + 2 + i (the model's own next token is t + 1).
   Only the heads train; the model, its final norm and its LM head are frozen and shared.
3. optax (the ``train`` extra) adamw with a linear warm-up and cosine decay; cross-entropy over
   the full vocabulary; tqdm shows the loss; the heads are written with Orbax
   (``medusa.save_heads``) along with each head's top-1 accuracy on the held-out prompts (the
   acceptance rate its drafts will see).
"""

from __future__ import annotations

import functools
import json
import time
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import InvalidRequest, JaxinferError
from jaxinfer.models import medusa
from jaxinfer.models.registry import model_family


def require_optax():
    """optax, the optimizer library only training needs (the ``train`` extra), or one clear
    error saying how to install it."""
    try:
        import optax
    except ImportError as e:
        raise JaxinferError(f"training draft heads needs optax ({e}); install the train extra: "
                            "pip install 'jaxinfer[train]'") from None
    return optax


def load_prompts(path=None, packaged: str = "medusa_prompts.jsonl") -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts) from a JSONL of {"prompt", "split"} lines (default:
    the packaged set ``packaged``); a line without "split" trains."""
    text = (Path(path).read_text() if path is not None
            else resources.files("jaxinfer").joinpath(f"data/{packaged}").read_text())
    train, held = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt = rec["prompt"]
        except (ValueError, KeyError, TypeError):
            raise InvalidRequest(f"{path}:{n}: expected a JSON object with a \"prompt\"") from None
        (held if rec.get("split") == "heldout" else train).append(prompt)
    if not train:
        raise InvalidRequest(f"{path or 'the prompt set'} has no training prompts")
    return train, held


def self_distill(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of each chat-templated prompt followed by the model's greedy answer."""
    return self_distill_with_lengths(llm, prompts, max_tokens)[0]


def self_distill_with_lengths(llm, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """(prompt + greedy answer token ids, prompt lengths) of each chat-templated prompt."""
    from jaxinfer import SamplingParams

    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True)
    return ([o.prompt_token_ids + o.outputs[0].token_ids for o in outs], [len(o.prompt_token_ids) for o in outs])


def positions(llm, seqs: list[list[int]], num_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(hidden f32[N, D], targets i32[N, K]) over every position of every sequence that has at
    least one target (-1 where t + 2 + i runs past the end)."""
    mod = model_family(llm.cfg.family)
    fwd = jax.jit(lambda w, t: mod.forward(w, t, jnp.zeros(1, jnp.int32), None, cfg=llm.cfg)[0][0])
    hs, ts = [], []
    for ids in seqs:
        T = len(ids)
        pad = max(16, 1 << (T - 1).bit_length())  # length buckets: few executables
        h = np.asarray(fwd(llm.weights, jnp.asarray([ids + [0] * (pad - T)], jnp.int32)))[: T - 2]
        arr = np.asarray(ids)
        tgt = np.full((T - 2, num_heads), -1, np.int32)
        for i in range(num_heads):
            n = max(0, T - 2 - i)
            tgt[:n, i] = arr[2 + i: 2 + i + n]
        hs.append(h)
        ts.append(tgt)
    return np.concatenate(hs).astype(np.float32), np.concatenate(ts)


def _loss(heads, weights, h, targets, cfg):
    logits = medusa.head_logits(heads, weights, h, cfg)  # f32[B, K, V]
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    valid = targets >= 0
    per_head = jnp.sum(jnp.where(valid, lse - picked, 0.0), axis=0) / jnp.maximum(jnp.sum(valid, axis=0), 1)
    return jnp.mean(per_head), per_head


def accuracy(heads, weights, cfg, h: np.ndarray, targets: np.ndarray, batch: int = 256) -> list[float]:
    """Top-1 accuracy of each head against its target (the acceptance rate of its drafts when
    the drafts before it were accepted)."""
    f = jax.jit(lambda hd, x: jnp.argmax(medusa.head_logits(hd, weights, x, cfg), axis=-1))
    hit = np.zeros(targets.shape[1])
    n = np.zeros(targets.shape[1])
    for s in range(0, len(h), batch):
        pred = np.asarray(f(heads, jnp.asarray(h[s: s + batch])))
        t = targets[s: s + batch]
        hit += np.sum((pred == t) & (t >= 0), axis=0)
        n += np.sum(t >= 0, axis=0)
    return [round(float(a), 4) for a in hit / np.maximum(n, 1)]


def train_heads(llm, h: np.ndarray, targets: np.ndarray, *, steps: int, batch: int, lr: float, seed: int = 0,
                progress: bool = True):
    """Train zero-initialised heads on (h, targets) -> (heads, losses per step)."""
    from tqdm import tqdm

    optax = require_optax()
    cfg, weights = llm.cfg, llm.weights
    heads = medusa.init_heads(cfg, targets.shape[1])
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=max(1, steps // 20), decay_steps=steps,
                                               end_value=lr / 20)
    opt = optax.adamw(sched, weight_decay=0.01)
    state = opt.init(heads)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(heads, state, x, t):
        (loss, per_head), grads = jax.value_and_grad(_loss, has_aux=True)(heads, weights, x, t, cfg)
        updates, state = opt.update(grads, state, heads)
        return optax.apply_updates(heads, updates), state, loss, per_head

    rng = np.random.default_rng(seed)
    losses = []
    bar = tqdm(range(steps), desc="train medusa", disable=not progress)
    for i in bar:
        idx = rng.integers(0, len(h), batch)
        heads, state, loss, per_head = step(heads, state, jnp.asarray(h[idx]), jnp.asarray(targets[idx]))
        if i % 10 == 0 or i == steps - 1:
            losses.append(float(loss))
            bar.set_postfix(loss=f"{float(loss):.3f}", heads=" ".join(f"{float(x):.2f}" for x in per_head))
    return heads, losses


def train_medusa(model: str, out, *, num_heads: int = 3, steps: int = 600, batch: int = 128, lr: float = 1e-3,
                 max_tokens: int = 128, data=None, seed: int = 0, progress: bool = True, llm=None) -> dict:
    """The whole recipe; returns what it wrote into ``out``'s medusa.json."""
    from jaxinfer import LLM

    require_optax()  # before minutes of self-distillation
    if num_heads < 1:
        raise InvalidRequest(f"heads must be >= 1, got {num_heads}")
    if steps < 1 or batch < 1 or lr <= 0:
        raise InvalidRequest(f"steps, batch and lr must be positive, got {steps}, {batch}, {lr}")
    if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise InvalidRequest(f"{out}: already exists; remove it or choose another destination")
    train, held = load_prompts(data)
    t0 = time.perf_counter()
    llm = llm or LLM(model, progress=progress, max_num_seqs=64, max_model_len=1024)
    seqs = self_distill(llm, train, max_tokens)
    h, targets = positions(llm, seqs, num_heads)
    t_data = time.perf_counter() - t0
    heads, losses = train_heads(llm, h, targets, steps=steps, batch=batch, lr=lr, seed=seed, progress=progress)
    t_train = time.perf_counter() - t0 - t_data
    report = {"model": str(model), "train_prompts": len(train), "train_positions": int(len(h)),
              "steps": steps, "batch": batch, "lr": lr, "max_tokens": max_tokens,
              "final_loss": losses[-1], "data_s": round(t_data, 1), "train_s": round(t_train, 1)}
    if held:
        hh, ht = positions(llm, self_distill(llm, held, max_tokens), num_heads)
        report["heldout_prompts"] = len(held)
        report["heldout_accuracy_by_head"] = accuracy(heads, llm.weights, llm.cfg, hh, ht)
    medusa.save_heads(out, heads, llm.cfg, extra=report)
    return report
