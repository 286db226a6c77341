"""Proving a model family against transformers, the independent reference.

transformers builds a tiny random checkpoint of the family (``from_config``, fixed seed, every
parameter randomised so a misplaced norm or bias shows) and writes it with ``save_pretrained``;
jaxinfer loads that directory like any other. Prompt log-probs and greedy tokens of
transformers float32 (eager attention, full forward per token) are the reference; jaxinfer's
``LLM`` must give them through the paged engine:

* prompt log-probs within ``PLP_ATOL`` (1e-3);
* greedy tokens equal, up to the first step where the reference's top-2 margin is under
  ``NEAR_TIE`` (0.01): after a near-tie either token is right and the texts may part.

``check_family`` runs one checkpoint through a plain engine with a prefix-cache hit, n-gram
speculation, the int8 KV cache and tensor parallelism 2 on virtual CPU devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import require

V = 96  # vocabulary of the tiny checkpoints: tokens t0 .. t95
PLP_ATOL = 1e-3
NEAR_TIE = 0.01
MAX_TOKENS = 12
# int8 keys/values round each value to 1/254 of its row's largest: a looser bound, and tokens
# compared up to a wider margin
INT8_PLP_ATOL = 5e-2
INT8_NEAR_TIE = 0.2

# a prompt, the same prompt's first 40 tokens with another tail (a prefix-cache hit at page
# size 16), and a repetitive one (n-gram speculation finds its drafts in it)
_rng = np.random.default_rng(1234)
_BASE = [int(t) for t in _rng.integers(4, V, 48)]
PROMPTS = [
    _BASE,
    _BASE[:40] + [int(t) for t in _rng.integers(4, V, 9)],
    [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6],
]

# sizes every tiny config shares unless a case overrides them: 4 query heads over 2 KV heads
# (tensor parallel 2 splits them), 3 layers, room for the prompts and their tokens
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)


def write_tiny(path: Path, model_type: str, overrides: dict | None = None, *, seed: int = 0,
               architecture: str | None = None, dtype: str = "float32", outer: dict | None = None) -> Path:
    """A random checkpoint of ``model_type`` written by transformers into ``path``, with a
    word-level tokenizer over its V tokens. outer: the config arguments of a multimodal
    ``model_type``, whose text_config is then the tiny one (COMMON and overrides)."""
    torch = require("torch")
    transformers = require("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    text = COMMON | (overrides or {})
    config = transformers.AutoConfig.for_model(model_type, **(text if outer is None else outer | {"text_config": text}))
    if architecture:
        config.architectures = [architecture]
    torch.manual_seed(seed)
    model = auto_class(config).from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF starts norms at 1 (or 0) and biases at 0: randomise everything
        for name, p in model.named_parameters():
            p.add_(0.2 * torch.randn_like(p)) if "norm" in name else p.copy_(0.15 * torch.randn_like(p))
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "t1", "eos_token": "t2", "pad_token": "t0", "unk_token": "t3",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return Path(path)


def auto_class(config):
    """The transformers auto class that builds ``config``'s model with an LM head: causal LM,
    or, for the multimodal models it does not list there (Mistral 3, Qwen2.5-VL), image-text-to-text."""
    transformers = require("transformers")
    causal = transformers.AutoModelForCausalLM
    return causal if type(config) in causal._model_mapping else transformers.AutoModelForImageTextToText


def reference(path: Path, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """transformers float32 on the checkpoint at ``path``: per prompt, the log-prob of each
    prompt token after the first, and greedy tokens with the top-2 margin of each step."""
    torch = require("torch")
    transformers = require("transformers")

    config = transformers.AutoConfig.from_pretrained(path)
    model = auto_class(config).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model_outputs(model, prompts, max_tokens)


def model_outputs(model, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """A loaded torch model's ``reference`` dicts: per prompt, the log-prob of each prompt token
    after the first, and greedy tokens with the top-2 margin of each step."""
    torch = require("torch")
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            plp = [float(lp[t, ids[t + 1]]) for t in range(len(ids) - 1)]
            toks, margins = [], []
            for _ in range(max_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
                top = torch.topk(logits, 2)
                toks.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                ids.append(toks[-1])
            out.append({"prompt_logprobs": plp, "tokens": toks, "margins": margins})
    return out


def outputs_of(results) -> list[dict]:
    """jaxinfer ``RequestOutput``s as the reference's dicts."""
    got = []
    for r in results:
        plp = None if r.prompt_logprobs is None else [
            next(lp.logprob for tok, lp in pos.items() if tok == r.prompt_token_ids[t + 1])
            for t, pos in enumerate(r.prompt_logprobs[1:])]
        got.append({"prompt_logprobs": plp, "tokens": list(r.outputs[0].token_ids)})
    return got


def assert_matches(got: list[dict], ref: list[dict], *, plp_atol: float = PLP_ATOL, near_tie: float = NEAR_TIE,
                   what: str = ""):
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if g["prompt_logprobs"] is not None:
            np.testing.assert_allclose(g["prompt_logprobs"], r["prompt_logprobs"], rtol=0, atol=plp_atol,
                                       err_msg=f"{what} prompt {i}: prompt log-probs")
        for t, (a, b, m) in enumerate(zip(g["tokens"], r["tokens"], r["margins"], strict=True)):
            if m < near_tie:  # either token is right from here on
                break
            assert a == b, f"{what} prompt {i}: token {t} is {a}, transformers {b} (margin {m:.4f}); " \
                           f"got {g['tokens']}, want {r['tokens']}"


def generate(llm, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, *, prompt_logprobs: bool = True) -> list[dict]:
    """Greedy tokens (and prompt log-probs, which vLLM and jaxinfer compute without the prefix
    cache) of ``prompts``."""
    from jaxinfer import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        prompt_logprobs=0 if prompt_logprobs else None)
    return outputs_of(llm.generate([list(p) for p in prompts], sp, use_tqdm=False))


_TP_SCRIPT = r"""
import json, sys
from tests.family_testing import generate
from jaxinfer import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), max_model_len=128, progress=False,
          kv_cache_memory_bytes=16 << 20, max_num_seqs=4, **json.loads(sys.argv[3]))
print("RESULT " + json.dumps(generate(llm)))
"""


def tensor_parallel(path: Path, size: int = 2, **llm_kw) -> list[dict]:
    """``generate`` with tensor_parallel_size=size (and ``llm_kw``, e.g. enable_expert_parallel)
    on 8 virtual CPU devices (a subprocess, so XLA_FLAGS apply)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(path), str(size), json.dumps(llm_kw)], env=env, capture_output=True,
                       text=True, timeout=600, cwd=root)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def check_family(path: Path, *, tp: bool = True, int8_kv: bool = True, ngram: bool = True, ref=None, **llm_kw):
    """The checkpoint at ``path`` through jaxinfer equals transformers: plain (the second
    prompt hits the first's cached pages), with n-gram speculation, with the int8 KV cache,
    and under tensor parallelism 2. ref: ``reference(path)`` when the caller has it already."""
    from jaxinfer import LLM

    ref = reference(path) if ref is None else ref
    kw = dict(max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=4) | llm_kw
    llm = LLM(str(path), **kw)
    assert_matches(generate(llm), ref, what="paged")
    generate(llm, PROMPTS[:1], prompt_logprobs=False)
    hits = llm.engine.allocator.stats.prefix_hits
    again = generate(llm, PROMPTS[1:2], prompt_logprobs=False)
    assert llm.engine.allocator.stats.prefix_hits > hits, "the second prompt should reuse the first's pages"
    assert_matches(again, ref[1:2], what="prefix-cache hit")
    del llm
    if ngram:
        llm = LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_max": 3, "prompt_lookup_min": 2}, **kw)
        assert_matches(generate(llm), ref, what="ngram")
        assert llm.engine.spec_stats.drafted > 0, "the repetitive prompt should give n-gram drafts to verify"
        del llm
    if int8_kv:
        llm = LLM(str(path), kv_cache_dtype="int8", **kw)
        assert_matches(generate(llm), ref, plp_atol=INT8_PLP_ATOL, near_tie=INT8_NEAR_TIE, what="int8 KV")
        del llm
    if tp:
        assert_matches(tensor_parallel(path), ref, what="tensor parallel 2")
    return ref
