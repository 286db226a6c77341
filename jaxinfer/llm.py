"""The public Python API, in vLLM's shape.

    from jaxinfer import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    out = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from jaxinfer import registry
from jaxinfer.config import default_dtype
from jaxinfer.engine.static import Row, StaticEngine
from jaxinfer.errors import InvalidRequest
from jaxinfer.loaders import checkpoint
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.sampling import SamplingParams, StopChecker, default_seed_for

_DTYPES = ("float32", "bfloat16", "float16")


class LLM:
    """A model loaded for offline generation.

    model: a registry name (see ``jaxinfer models``) or a path to a .gguf file, a Hugging Face
    directory or an Orbax checkpoint. dtype: None picks float32 on CPU and bfloat16 on TPU/GPU.
    max_model_len: the longest prompt + output allowed (default: the checkpoint's context).
    """

    def __init__(self, model: str = registry.DEFAULT_MODEL, *, dtype: str | None = None,
                 max_model_len: int | None = None, seed: int = 0, max_num_seqs: int = 64,
                 progress: bool = True):
        dtype = dtype or default_dtype()
        if dtype == "auto":
            dtype = default_dtype()
        if dtype not in _DTYPES:
            raise InvalidRequest(f"dtype must be one of {', '.join(_DTYPES)} or 'auto', got {dtype!r}")
        if max_num_seqs < 1:
            raise InvalidRequest(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.model_path = registry.resolve(model, progress=progress)
        loaded = checkpoint.load(self.model_path, dtype=dtype)
        self.cfg, self.weights, self.tokenizer = loaded.cfg, loaded.weights, loaded.tokenizer
        if max_model_len is None:
            max_model_len = self.cfg.max_position
        if not 1 < max_model_len <= self.cfg.max_position:
            raise InvalidRequest(
                f"max_model_len must be in [2, {self.cfg.max_position}] (the model's context), got {max_model_len}"
            )
        self.max_model_len = max_model_len
        self.seed = seed
        self.progress = progress
        self.engine = StaticEngine(self.cfg, self.weights, self.tokenizer, max_model_len=max_model_len,
                                   max_num_seqs=max_num_seqs, seed=seed)
        self._request_counter = 0

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for one prompt or many. A prompt is a str, a list of token ids, or a dict
        with "prompt" or "prompt_token_ids"."""
        items = _normalize_prompts(prompts)
        params = _normalize_params(sampling_params, len(items))
        texts, ids = [], []
        for i, p in enumerate(items):
            t, toks = self._tokenize(p, i)
            texts.append(t)
            ids.append(toks)
        return self._run(texts, ids, params, use_tqdm)

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for i, conv in enumerate(convs):
            _check_conversation(conv, i)
            prompts.append(self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt))
        # the template writes the special tokens itself: do not add BOS a second time
        params = _normalize_params(sampling_params, len(prompts))
        ids = [self.tokenizer.encode(p, add_special_tokens=not _starts_with_bos(self.tokenizer, p)) for p in prompts]
        for i, t in enumerate(ids):
            self._check_len(t, i)
        return self._run(prompts, ids, params, use_tqdm)

    def _tokenize(self, p, i):
        if isinstance(p, str):
            toks = self.tokenizer.encode(p)
            text = p
        elif isinstance(p, dict):
            if "prompt_token_ids" in p:
                toks, text = list(p["prompt_token_ids"]), p.get("prompt")
            elif "prompt" in p:
                text = p["prompt"]
                toks = self.tokenizer.encode(text)
            else:
                raise InvalidRequest(f"prompt {i}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        else:
            toks, text = list(p), None
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.cfg.vocab_size for t in toks):
            raise InvalidRequest(f"prompt {i}: token ids must be ints in [0, {self.cfg.vocab_size})")
        self._check_len(toks, i)
        return text, toks

    def _check_len(self, toks, i):
        if not toks:
            raise InvalidRequest(f"prompt {i} is empty (0 tokens)")
        if len(toks) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt {i} has {len(toks)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token"
            )

    def _run(self, texts, ids, params, use_tqdm) -> list[RequestOutput]:
        arrival = time.perf_counter()
        rows_of: list[list[Row]] = []
        rows: list[Row] = []
        base = self._request_counter
        self._request_counter += len(ids)
        for i, (toks, p) in enumerate(zip(ids, params)):
            mine = []
            for j in range(p.n):
                sp = _sample_params(p, j, default_seed_for(self.seed, base + i))
                cap = self.max_model_len - len(toks)
                if sp.max_tokens > cap:
                    sp = dataclasses.replace(sp, max_tokens=cap, min_tokens=min(sp.min_tokens, cap))
                row = Row(prompt_ids=toks, params=sp, request_index=(base + i) * 1024 + j,
                          checker=StopChecker(sp, self.tokenizer.eos_ids),
                          detok=self.tokenizer.detokenizer(skip_special_tokens=sp.skip_special_tokens),
                          max_new=sp.max_tokens, logprobs=[] if sp.logprobs is not None else None)
                mine.append(row)
                rows.append(row)
            rows_of.append(mine)
        bar = _progress(len(rows), self.progress if use_tqdm is None else use_tqdm)
        try:
            self.engine.run(rows, on_row_done=lambda r: bar.update(1))
        finally:
            bar.close()
        outs = []
        for i, (text, toks, p, mine) in enumerate(zip(texts, ids, params, rows_of)):
            plp = self.engine.prompt_logprobs(toks, p.prompt_logprobs) if p.prompt_logprobs is not None else None
            comps = [
                CompletionOutput(
                    index=j, text=r.checker.output_text, token_ids=list(r.token_ids),
                    cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                    logprobs=r.logprobs, finish_reason=r.checker.finish_reason, stop_reason=r.checker.stop_reason,
                )
                for j, r in enumerate(mine)
            ]
            first = min(r.first_token_time for r in mine)
            metrics = RequestMetrics(
                arrival_time=arrival, first_scheduled_time=min(r.scheduled_time for r in mine),
                first_token_time=first, last_token_time=max(r.last_token_time for r in mine),
                finished_time=max(r.finished_time for r in mine),
                num_generated_tokens=sum(len(r.token_ids) for r in mine),
            )
            outs.append(RequestOutput(str(base + i), text, toks, plp, comps, True, metrics))
        return outs

    # ------------------------------------------------------------------ reports
    def memory_report(self) -> dict:
        import jax

        weights = sum(x.nbytes for x in jax.tree.leaves(self.weights))
        return {
            "weights_bytes": int(weights),
            "kv_cache_bytes": int(self.engine.last_cache_bytes),
            "kv_bytes_per_token": self.cfg.kv_bytes_per_token(),
            "dtype": self.cfg.dtype,
            "num_params": self.cfg.num_params(),
        }


def _sample_params(p: SamplingParams, j: int, request_seed: int) -> SamplingParams:
    """The j-th of n samples: a distinct, reproducible seed per sample."""
    if p.n == 1:
        return p
    seed = p.seed if p.seed is not None else request_seed
    return dataclasses.replace(p, n=1, seed=default_seed_for(seed, j) if j else seed)


def _starts_with_bos(tok, text: str) -> bool:
    if tok.bos_id is None or not tok.add_bos:
        return False
    return text.startswith(tok.id_to_piece(tok.bos_id))


def _check_conversation(conv, i):
    if not isinstance(conv, list) or not conv:
        raise InvalidRequest(f"conversation {i} must be a non-empty list of messages")
    for m in conv:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequest(f"conversation {i}: each message needs 'role' and 'content', got {m!r}")
        if not isinstance(m["content"], str):
            raise InvalidRequest(f"conversation {i}: message content must be a string, got {type(m['content']).__name__}")


def _normalize_prompts(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single list of token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, dict, list, tuple)):
            raise InvalidRequest(f"prompt {i} must be a str, a list of token ids or a dict, got {type(p).__name__}")
    return prompts


def _normalize_params(sp, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise InvalidRequest(f"got {len(sp)} sampling_params for {n} prompts")
    return sp


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="seq", disable=not enabled or total <= 1)
