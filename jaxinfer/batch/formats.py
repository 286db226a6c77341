"""The two input formats of a batch job and their result lines: OpenAI Batch API JSONL
(``_OpenAIFormat``) and quick mode, one prompt per line (``_PromptsFormat``). Each classifies an
input line (its key and shard), turns it into engine work, and reads its result lines back."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from pathlib import Path
from collections.abc import Callable

from jaxinfer import openai_format as oai
from jaxinfer import openai_schema as schema
from jaxinfer.errors import InvalidRequest
from jaxinfer.sampling import SamplingParams

QUICK_MAX_TOKENS = 64


@dataclasses.dataclass(eq=False)
class _Work:
    """One input line on its way through the engine."""

    key: tuple
    prompts: list[tuple[str | None, list[int]]]  # (text, token ids) per prompt
    params: SamplingParams
    finish: Callable[[list], dict]  # RequestOutput per prompt -> result line
    outs: list = dataclasses.field(default_factory=list)
    left: int = 0
    beam: object = None  # beam.BeamSearchParams: run by ``beam_outputs`` after the sampled lines
    lora: object = None  # the line's LoRA adapter (``lora.Adapter``): body.model named it

    def beam_outputs(self, llm) -> list:
        """A use_beam_search line's RequestOutput per prompt, its beams (best first) the choices."""
        from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput

        t0 = time.perf_counter()
        beam = dataclasses.replace(self.beam, max_tokens=self.params.max_tokens)  # fitted to the context
        res = llm.beam_search([{"prompt_token_ids": ids} for _, ids in self.prompts], beam)
        return [RequestOutput(str(k), text, ids, None,
                              [CompletionOutput(j, b.text, b.token_ids, b.cum_logprob, None, b.finish_reason)
                               for j, b in enumerate(r.sequences)], True, RequestMetrics(arrival_time=t0))
                for k, ((text, ids), r) in enumerate(zip(self.prompts, res))]


def _shard_of_id(custom_id: str) -> int:
    # a stable hash: Python's hash() of a str differs between processes
    return int.from_bytes(hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class _OpenAIFormat:
    """OpenAI Batch API JSONL. Keys: ("id", custom_id) or ("line", n)."""

    name = "openai"
    default_order = "completion"
    record_prefix = b'{"id":"batch_req_'

    def __init__(self, defaults: dict | None, model_name: str | None, lora_modules: dict | None = None):
        self.defaults = dict(defaults or {})
        self.model_name = model_name
        self.lora_modules = dict(lora_modules or {})  # adapter name -> lora.LoRARequest
        self.first_line: dict[str, int] = {}  # custom_id -> the line that owns it

    def classify(self, n: int, raw: bytes, *, indexing: bool):
        """(key, shard hash, envelope) of a non-blank line; the index pass notes first lines."""
        # Without its newline: json counts that as a line 2 and reports column 1 of it.
        env = oai.parse_envelope(raw.rstrip(b"\r\n"), n)
        if isinstance(env, oai.LineError):
            return ("line", n), n, env
        cid, _ = env
        first = self.first_line.setdefault(cid, n) if indexing else self.first_line.get(cid, n)
        if first != n:
            return ("line", n), _shard_of_id(cid), oai.duplicate_error(n, cid, first)
        return ("id", cid), _shard_of_id(cid), env

    def work(self, llm, n: int, key: tuple, env) -> dict | _Work:
        if isinstance(env, oai.LineError):
            return oai.line_error_line(env)
        cid, obj = env
        try:
            # the command line's defaults over the checkpoint's generation_config.json
            defaults = {**llm.sampling_defaults, **self.defaults}
            req = schema.parse_request(cid, obj, n, defaults)
            served = {self.model_name, Path(str(llm.model_path)).name, str(llm.model_path)}
            lora = oai.lora_for(llm, req.model, self.lora_modules, served, where=f"line {n}: ")
            if lora is not None and req.beam is not None:
                raise oai.RequestError(f"line {n}: use_beam_search with a LoRA adapter is not supported",
                                       code="unsupported_parameter", param="use_beam_search")
            prompts, params = _encode(llm, req)
        except oai.RequestError as e:
            return oai.error_response_line(cid, e)
        build = oai.chat_completion if req.kind == "chat" else oai.text_completion
        model = self.model_name if lora is None else req.model

        def finish(outs):
            return oai.result_line(cid, build(req, outs, model))

        return _Work(key, prompts, params, finish, beam=req.beam, lora=lora)

    @staticmethod
    def key_of(rec: dict) -> tuple:
        return oai.result_key(rec)

    @staticmethod
    def ok(rec: dict) -> bool:
        return oai.result_ok(rec)

    @staticmethod
    def tokens(rec: dict) -> tuple[int, int]:
        return oai.result_tokens(rec)

    def shard_of_key(self, key: tuple) -> int:
        return _shard_of_id(key[1]) if key[0] == "id" else key[1]

    def order_of(self, key: tuple) -> float:
        return self.first_line.get(key[1], math.inf) if key[0] == "id" else key[1]


class _PromptsFormat:
    """Quick mode: one prompt per line. Keys: ("index", i), i counting non-blank lines."""

    name = "prompts"
    default_order = "input"
    record_prefix = b'{"index":'

    def __init__(self, sampling_params: SamplingParams | None, raw: bool):
        self.params = sampling_params or SamplingParams(max_tokens=QUICK_MAX_TOKENS, temperature=0.0)
        self.raw = raw
        self._count = 0

    def reset(self):
        self._count = 0

    def classify(self, n: int, raw: bytes, *, indexing: bool):
        i = self._count
        self._count += 1
        return ("index", i), i, raw

    def work(self, llm, n: int, key: tuple, raw: bytes) -> dict | _Work:
        i = key[1]
        try:
            prompt = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            return {"index": i, "prompt": raw.decode("utf-8", "replace").rstrip("\r\n"),
                    "error": f"line {n}: not valid UTF-8 ({e.reason} at byte {e.start})"}
        try:
            if not self.raw and llm.tokenizer.chat_template is not None:
                text, ids = llm.encode_chat([{"role": "user", "content": prompt}], i)
            else:
                text, ids = llm.encode_prompt(prompt, i)
        except InvalidRequest as e:
            return {"index": i, "prompt": prompt, "error": f"line {n}: {e}"}

        def finish(outs):
            o = outs[0]
            c = o.outputs[0]
            return {"index": i, "prompt": prompt, "text": c.text, "finish_reason": c.finish_reason,
                    "prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(c.token_ids)}

        return _Work(key, [(text, ids)], self.params, finish)

    @staticmethod
    def key_of(rec: dict) -> tuple:
        i = rec["index"]
        if not isinstance(i, int) or isinstance(i, bool) or not ("text" in rec or "error" in rec):
            raise ValueError("not a quick-mode result")
        return ("index", i)

    @staticmethod
    def ok(rec: dict) -> bool:
        return "error" not in rec

    @staticmethod
    def tokens(rec: dict) -> tuple[int, int]:
        return rec.get("prompt_tokens", 0), rec.get("completion_tokens", 0)

    @staticmethod
    def shard_of_key(key: tuple) -> int:
        return key[1]

    @staticmethod
    def order_of(key: tuple) -> float:
        return key[1]


def _encode(llm, req: oai.BatchRequest) -> tuple[list[tuple[str | None, list[int]]], SamplingParams]:
    """Token ids of a request's prompts, and its params fitted to the context."""
    return oai.encode_for(llm, req.kind, req.messages, req.prompts, req.params, req.max_tokens_set,
                          where=f"line {req.line}: ", guided_field=req.guided_field)
