"""Batch jobs: a file of requests in, a JSONL file of results out, each request answered once.

Two input formats:

* OpenAI Batch API JSONL (``*.jsonl``): one ``{"custom_id", "method", "url", "body"}`` per line;
  result lines in OpenAI's batch output format (``jaxinfer.openai_format``).
* Quick mode (any other file): one prompt per line, through the chat template when the model has
  one; result lines ``{"index", "prompt", "text", "finish_reason", "prompt_tokens",
  "completion_tokens"}`` (``{"index", "prompt", "error"}`` for a prompt that cannot run).

What survives what:

* Results are appended as each request finishes: one ``os.write`` per line, an fsync every
  ``FSYNC_EVERY`` lines or ``FSYNC_SECONDS`` seconds, and one at exit.
* A rerun of the same command reads the output back and skips every request already answered
  (keyed by custom_id; by line number for lines without a usable one; by prompt index in quick
  mode). A torn last line, from a kill in the middle of a write, is cut off first; any other
  invalid line stops the job rather than being appended after. An exclusive lock keeps two runs
  off one file.
* SIGTERM / SIGINT: no more requests are admitted; those in flight get ``grace_period`` seconds
  to finish and be written; a second signal (or the deadline) stops at once, but never in the
  middle of a write. The exit leaves a file a rerun resumes.
* Memory is bounded: the input is streamed twice (an index pass that counts lines and notes the
  first line of each custom_id, then the run), and the engine pulls requests a window at a time.
  What grows with the input is one small entry per request (its key).
* Multi-host (``jax.distributed``): process p of P answers the lines whose custom_id hashes to p
  (lines without one by line number, quick mode by prompt index), so a repeated custom_id always
  meets its first occurrence in the same process. It appends to ``OUTPUT.part-p-of-P``; after a
  barrier, process 0 merges the parts into OUTPUT. Parts and OUTPUT must be on a filesystem all
  processes share. Merging skips keys already present, so a crash during it is harmless.
* ``order="input"``: once every request is answered the file is rewritten in input order
  (through a temporary file and a rename); the default is completion order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxinfer import metrics
from jaxinfer import openai_format as oai
from jaxinfer.errors import InvalidRequest, JaxinferError
from jaxinfer.sampling import SamplingParams

FSYNC_EVERY = 32
FSYNC_SECONDS = 1.0
GRACE_PERIOD = 20.0  # seconds in-flight requests get after SIGTERM (preemption notices give ~30)
QUICK_MAX_TOKENS = 64
ORDERS = ("completion", "input")
_PART = re.compile(r"\.part-(\d{5})-of-(\d{5})$")


class OutputFileError(JaxinferError):
    """The output file cannot be resumed: not a batch output, or locked by another run."""


# ------------------------------------------------------------------------------------- results


@dataclasses.dataclass
class Tally:
    """Counts over result lines."""

    ok: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def add(self, ok: bool, tokens: tuple[int, int]) -> None:
        self.ok += ok
        self.failed += not ok
        self.input_tokens += tokens[0]
        self.output_tokens += tokens[1]

    def merge(self, other: Tally) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def answered(self) -> int:
        return self.ok + self.failed


class Latency:
    """Latency samples in log-spaced bins 1% wide (10 us to ~3 h, clamped outside).

    Fixed size and mergeable: percentiles over any number of requests and across processes in
    bounded memory, each within 1% of the exact value (min, max and mean are exact).
    """

    LO, GROWTH = 1e-5, 1.01
    BINS = math.ceil(math.log(1e4 / 1e-5) / math.log(1.01))

    def __init__(self):
        self.counts: dict[int, int] = {}
        self.n, self.total, self.min, self.max = 0, 0.0, math.inf, -math.inf

    def add(self, x: float | None) -> None:
        if x is None or not math.isfinite(x):
            return
        x = max(float(x), 0.0)
        b = 0 if x <= self.LO else min(self.BINS - 1, int(math.log(x / self.LO) / math.log(self.GROWTH)))
        self.counts[b] = self.counts.get(b, 0) + 1
        self.n += 1
        self.total += x
        self.min, self.max = min(self.min, x), max(self.max, x)

    def merge(self, other: Latency) -> None:
        for b, c in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + c
        self.n += other.n
        self.total += other.total
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)

    def percentile(self, q: float) -> float | None:
        """The q-th percentile of the binned samples (each bin at its middle, within
        [min, max]), by ``metrics.percentile``."""
        if not self.n:
            return None
        bins = sorted(self.counts)
        mids = [min(max(self.LO * self.GROWTH ** (b + 0.5), self.min), self.max) for b in bins]
        return metrics.percentile(mids, q, [self.counts[b] for b in bins])

    def summary(self) -> dict:
        if not self.n:
            return {"count": 0}
        out = {"count": self.n, "mean": self.total / self.n, "min": self.min}
        out.update({f"p{q}": self.percentile(q) for q in (50, 90, 95, 99)})
        out["max"] = self.max
        return out

    def to_json(self) -> dict:
        return {"counts": {str(b): c for b, c in self.counts.items()}, "n": self.n, "total": self.total,
                "min": self.min if self.n else None, "max": self.max if self.n else None}

    @classmethod
    def from_json(cls, d: dict) -> Latency:
        h = cls()
        h.counts = {int(b): c for b, c in d["counts"].items()}
        h.n, h.total = d["n"], d["total"]
        h.min = d["min"] if d["min"] is not None else math.inf
        h.max = d["max"] if d["max"] is not None else -math.inf
        return h


# TTFT, TPOT (per request: mean gap after the first token), ITL (every gap between two tokens of
# the first sample), end-to-end, and time in the engine's queue
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")


@dataclasses.dataclass
class BatchSummary:
    """What a batch run did. ``total``/``before``/``result`` cover the whole job (all processes
    when this is process 0 of a multi-host run); ``run`` and the latencies cover this run."""

    output: str
    total: int  # requests (input lines) in the job
    before: int  # answered before this run started
    result: Tally  # every answer in the output now
    run: Tally  # answered by this run
    wall_s: float
    latency: dict[str, Latency]
    interrupted: int | None = None  # the signal that stopped the run, if one did
    process_index: int = 0
    process_count: int = 1

    @property
    def complete(self) -> bool:
        return self.interrupted is None

    def metrics(self) -> dict:
        """The ``--metrics-out`` JSON."""
        wall = max(self.wall_s, 1e-9)
        return {
            "output": self.output, "processes": self.process_count, "complete": self.complete,
            "requests": {"total": self.total, "ok": self.result.ok, "failed": self.result.failed,
                         "answered_before_this_run": self.before},
            "input_tokens": self.result.input_tokens, "output_tokens": self.result.output_tokens,
            "this_run": {"requests": self.run.answered, "ok": self.run.ok, "failed": self.run.failed,
                         "input_tokens": self.run.input_tokens, "output_tokens": self.run.output_tokens,
                         "wall_s": self.wall_s, "output_tokens_per_s": self.run.output_tokens / wall,
                         "requests_per_s": self.run.answered / wall},
            "latency": {name: h.summary() for name, h in self.latency.items()},
        }

    def to_json(self) -> dict:
        return {"total": self.total, "before": self.before, "result": dataclasses.asdict(self.result),
                "run": dataclasses.asdict(self.run), "wall_s": self.wall_s,
                "latency": {k: h.to_json() for k, h in self.latency.items()}}

    def merge_json(self, d: dict) -> None:
        """Fold in the summary of another process of the same job."""
        self.total += d["total"]
        self.before += d["before"]
        self.result.merge(Tally(**d["result"]))
        self.run.merge(Tally(**d["run"]))
        self.wall_s = max(self.wall_s, d["wall_s"])
        for k, h in d["latency"].items():
            self.latency[k].merge(Latency.from_json(h))


# ------------------------------------------------------------------------------------- formats


@dataclasses.dataclass(eq=False)
class _Work:
    """One input line on its way through the engine."""

    key: tuple
    prompts: list[tuple[str | None, list[int]]]  # (text, token ids) per prompt
    params: SamplingParams
    finish: Callable[[list], dict]  # RequestOutput per prompt -> result line
    outs: list = dataclasses.field(default_factory=list)
    left: int = 0


def _shard_of_id(custom_id: str) -> int:
    # a stable hash: Python's hash() of a str differs between processes
    return int.from_bytes(hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class _OpenAIFormat:
    """OpenAI Batch API JSONL. Keys: ("id", custom_id) or ("line", n)."""

    name = "openai"
    default_order = "completion"
    record_prefix = b'{"id":"batch_req_'

    def __init__(self, defaults: dict | None, model_name: str | None):
        self.defaults = dict(defaults or {})
        self.model_name = model_name
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
            req = oai.parse_request(cid, obj, n, self.defaults)
            prompts, params = _encode(llm, req)
        except oai.RequestError as e:
            return oai.error_response_line(cid, e)
        build = oai.chat_completion if req.kind == "chat" else oai.text_completion
        model = self.model_name

        def finish(outs):
            return oai.result_line(cid, build(req, outs, model))

        return _Work(key, prompts, params, finish)

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
    try:
        if req.kind == "chat":
            prompts = [llm.encode_chat(req.messages, 0)]
        else:
            prompts = [llm.encode_prompt(p, k) for k, p in enumerate(req.prompts)]
    except InvalidRequest as e:
        code = "context_length_exceeded" if "max_model_len" in str(e) else "invalid_value"
        param = "messages" if req.kind == "chat" else "prompt"
        raise oai.RequestError(f"line {req.line}: {e}", code=code, param=param) from None
    p = req.params
    longest = max(len(ids) for _, ids in prompts)
    room = llm.max_model_len - longest
    if req.max_tokens_set and p.max_tokens > room:
        raise oai.context_error(req.line, req.kind, longest, p.max_tokens, llm.max_model_len)
    changes = {}
    if p.max_tokens > room:  # a default, not asked for: generation runs to the context end
        changes.update(max_tokens=room, min_tokens=min(p.min_tokens, room))
    if p.top_k > llm.cfg.vocab_size:  # the same distribution; keeps per-row ints small
        changes["top_k"] = 0
    return prompts, dataclasses.replace(p, **changes) if changes else p


# ------------------------------------------------------------------------------------- the log


def _dumps(rec: dict) -> bytes:
    try:
        return json.dumps(rec, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8") + b"\n"
    except UnicodeEncodeError:  # lone surrogates (from a custom_id): JSON escapes instead
        return json.dumps(rec, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii") + b"\n"


def _parse_result(raw: bytes, key_of) -> tuple[dict, tuple] | None:
    try:
        rec = json.loads(raw)
        return rec, key_of(rec)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError, AttributeError):
        return None


def scan_results(path: Path, fmt, *, repair: bool = False) -> Iterator[tuple[int, int, dict, tuple]]:
    """Yield (offset, size, record, key) for each result line of ``path``.

    What follows the last newline is a write cut off by a kill (the start of a result line, or
    the zeros a crash can leave): it is skipped, and with ``repair`` cut from the file (or, if it
    is a whole record missing only its newline, given one). Anything else that is not a result
    line of this format raises OutputFileError: the file is not ours to append to.
    """
    fix = None  # ("truncate", offset) | ("newline", None)
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            parsed = _parse_result(raw, fmt.key_of)
            if not raw.endswith(b"\n"):
                if parsed is not None:
                    fix = ("newline", None)
                    yield offset, len(raw), *parsed
                elif _torn(raw, fmt.record_prefix):
                    fix = ("truncate", offset)
                else:
                    raise _not_ours(path, n)
            elif parsed is not None:
                yield offset, len(raw), *parsed
            elif raw.strip():
                raise _not_ours(path, n)
            offset += len(raw)
    if repair and fix is not None:
        if fix[0] == "truncate":
            os.truncate(path, fix[1])
            print(f"jaxinfer: repaired {path}: cut an incomplete last line", file=sys.stderr)
        else:
            with open(path, "ab") as f:
                f.write(b"\n")
        _fsync_path(path)


def _torn(tail: bytes, prefix: bytes) -> bool:
    """Whether an unterminated last line can be a result line cut short."""
    return prefix.startswith(tail) or tail.startswith(prefix) or not tail.strip(b"\0")


def _not_ours(path: Path, n: int) -> OutputFileError:
    return OutputFileError(f"{path}: line {n} is not a result line of this kind of job; refusing to append to "
                           "it (move the file away or choose another output file)")


class _ResultLog:
    """The append-only output of one process: locked, repaired, appended to, fsynced in groups."""

    def __init__(self, path: Path, stop: _StopSignals):
        self.path, self.stop = path, stop
        self.fd = None
        self.unsynced, self.last_sync = 0, time.monotonic()

    def open(self, fmt) -> Iterator[tuple[dict, tuple]]:
        """Lock the file (creating it), repair its tail, and yield the records already in it."""
        import fcntl

        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputFileError(f"cannot write the output file {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise OutputFileError(f"{self.path} is locked: another jaxinfer batch is writing it") from None
        for _, _, rec, key in scan_results(self.path, fmt, repair=True):
            yield rec, key

    def append(self, rec: dict) -> None:
        data = _dumps(rec)
        with self.stop.writing():
            end = os.lseek(self.fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
            except BaseException:
                os.ftruncate(self.fd, end)  # never leave half a line for the next append to follow
                raise
            self.unsynced += 1
            if self.unsynced >= FSYNC_EVERY or time.monotonic() - self.last_sync >= FSYNC_SECONDS:
                self.sync()

    def sync(self) -> None:
        if self.fd is not None and self.unsynced:
            os.fsync(self.fd)
        self.unsynced, self.last_sync = 0, time.monotonic()

    def close(self) -> None:
        if self.fd is not None:
            self.sync()
            os.close(self.fd)
            self.fd = None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------- signals


class _Interrupted(Exception):
    pass


class _StopSignals:
    """SIGTERM and SIGINT: the first stops admitting work and gives in-flight requests
    ``grace`` seconds; the second, or the deadline (SIGALRM), stops at once, though never inside
    ``writing()``: the exception waits for the write to finish."""

    def __init__(self, grace: float):
        self.grace = grace
        self.signum: int | None = None
        self.hard = False
        self._writing = 0
        self._deferred = False
        self._armed = False
        self._saved = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
                self._saved[s] = signal.signal(s, self._on_signal)
            self._armed = True
        return self

    def __exit__(self, *exc):
        self._armed = False
        if self._saved:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for s, h in self._saved.items():
                signal.signal(s, h)
            self._saved = {}

    @property
    def stopping(self) -> bool:
        return self.signum is not None

    def _on_signal(self, signum, frame):
        if signum != signal.SIGALRM and self.signum is None:
            self.signum = signum
            # os.write, not print: the handler may run in the middle of a print
            os.write(2, f"\njaxinfer: {signal.Signals(signum).name}: admitting no more requests; finishing "
                        f"those in flight (up to {self.grace:g} s; signal again to stop now)\n".encode())
            if self.grace > 0:
                signal.setitimer(signal.ITIMER_REAL, self.grace)
                return
        self.hard = True
        if not self._armed:
            return
        if self._writing:
            self._deferred = True
        else:
            raise _Interrupted

    def check(self) -> None:
        """Raise if a hard stop is due (for stops a handler could not raise, e.g. in a __del__)."""
        if self.hard and self._armed and not self._writing:
            raise _Interrupted

    def writing(self):
        return _Writing(self)

    def disarm(self) -> None:
        """From here on signals are only noted: the run is closing its files."""
        self._armed = False
        if self._saved:
            signal.setitimer(signal.ITIMER_REAL, 0)


class _Writing:
    def __init__(self, s: _StopSignals):
        self.s = s

    def __enter__(self):
        self.s._writing += 1

    def __exit__(self, *exc):
        self.s._writing -= 1
        if self.s._deferred and not self.s._writing and self.s._armed and exc[0] is None:
            self.s._deferred = False
            raise _Interrupted


# ------------------------------------------------------------------------------------- the job


def input_format(path) -> str:
    """"openai" for ``*.jsonl`` / ``*.json`` files, "prompts" (quick mode) for anything else."""
    return "openai" if Path(path).suffix.lower() in (".jsonl", ".json") else "prompts"


def part_path(output: Path, process_index: int, process_count: int) -> Path:
    return output.with_name(f"{output.name}.part-{process_index:05d}-of-{process_count:05d}")


def _parts(output: Path) -> list[Path]:
    if not output.parent.is_dir():
        return []
    return sorted(p for p in output.parent.iterdir() if p.name.startswith(output.name + ".part-")
                  and _PART.search(p.name[len(output.name):]))


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of each non-blank line, streamed."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


def check_input(path) -> Path:
    """The input file, or InvalidRequest saying why it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"input file {path} does not exist" if not path.exists() else f"input {path} is not a file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise InvalidRequest(f"cannot read input file {path}: {e.strerror}") from None
    return path


def run_batch(llm, input_path, output_path, *, kind: str | None = None, order: str | None = None,
              defaults: dict | None = None, sampling_params: SamplingParams | None = None, raw: bool = False,
              model_name: str | None = None, metrics_out=None, progress: bool = True,
              grace_period: float = GRACE_PERIOD, process_index: int = 0, process_count: int = 1) -> BatchSummary:
    """Answer every request of ``input_path`` into ``output_path``, resuming what is there.

    llm: an ``LLM``, or a function returning one (called only if some request still needs the
    model). kind: the input format, "openai", "prompts" or None (from the file name). order: "completion"
    or "input" (default: completion for OpenAI files, input for quick mode). defaults: sampling
    fields for OpenAI bodies that leave them out (``max_tokens``, ``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``seed``). sampling_params: quick mode's parameters. model_name: the
    ``model`` of the responses (default: the model's file name). process_index/process_count:
    this process's place in a ``jax.distributed`` job (see ``init_distributed``).
    """
    t0 = time.perf_counter()
    inp = check_input(input_path)
    out = Path(output_path)
    if out.exists() and out.resolve() == inp.resolve():
        raise InvalidRequest(f"the output file {out} is the input file")
    if not out.parent.is_dir():  # a typo in a path should not become a tree of new directories
        raise InvalidRequest(f"output directory {out.parent} does not exist (create it first)")
    if not 0 <= process_index < process_count:
        raise InvalidRequest(f"process_index must be in [0, {process_count}), got {process_index}")
    kind = kind or input_format(inp)
    if kind == "openai":
        fmt = _OpenAIFormat(defaults, model_name)
    elif kind == "prompts":
        fmt = _PromptsFormat(sampling_params, raw)
    else:
        raise InvalidRequest(f"input format must be 'openai' or 'prompts', got {kind!r}")
    order = order or fmt.default_order
    if order not in ORDERS:
        raise InvalidRequest(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    P, me = process_count, process_index
    mine = (lambda key: fmt.shard_of_key(key) % P == me) if P > 1 else (lambda key: True)

    stop = _StopSignals(grace_period)
    own = out if P == 1 else part_path(out, me, P)
    log = _ResultLog(own, stop)
    done: set[tuple] = set()
    before = Tally()
    try:
        # 1. what is answered already: this process's file (locked and repaired), then the
        # others'. A file that does not exist yet is created only once there is a model to
        # fill it: a model that fails to load leaves no empty output behind.
        if own.exists():
            for rec, key in log.open(fmt):
                _note(done, before, fmt, rec, key, mine)
        for src in [out, *_parts(out)]:
            if src != own and src.exists():
                for _, _, rec, key in scan_results(src, fmt):
                    _note(done, before, fmt, rec, key, mine)
        # 2. index pass: this process's share of the input, and how much is left
        total = todo = 0
        for n, line in _lines(inp):
            key, shard, _ = fmt.classify(n, line, indexing=True)
            if shard % P == me:
                total += 1
                todo += key not in done
        # 3. run what is left
        summary = BatchSummary(str(out), total, total - todo, before, Tally(), 0.0,
                               {k: Latency() for k in LATENCIES}, None, me, P)
        if todo:
            if callable(llm):
                llm = llm()
            if log.fd is None:
                for rec, key in log.open(fmt):  # (another run may have created it meanwhile)
                    _note(done, before, fmt, rec, key, mine)
            if isinstance(fmt, _OpenAIFormat) and fmt.model_name is None:
                fmt.model_name = Path(str(llm.model_path)).name
            if isinstance(fmt, _PromptsFormat):
                fmt.reset()
            with stop:
                _run(llm, fmt, inp, log, stop, done, summary, mine_shard=(me, P), progress=progress)
        elif log.fd is None:  # nothing to answer (an empty input): the output still appears
            for _ in log.open(fmt):
                pass
    finally:
        log.close()
    summary.result.merge(summary.run)
    summary.wall_s = time.perf_counter() - t0
    if summary.interrupted is not None:  # resumable as it is; merging and reordering wait for a complete run
        if metrics_out is not None and P == 1:
            _write_json(Path(metrics_out), summary.metrics())
        return summary
    if P > 1:
        summary = _gather(summary, me, P)
    if me == 0:
        _finish_output(out, fmt, order)
        if metrics_out is not None:
            _write_json(Path(metrics_out), summary.metrics())
    return summary


def _note(done: set, tally: Tally, fmt, rec: dict, key: tuple, mine) -> None:
    if key not in done:
        done.add(key)
        if mine(key):
            tally.add(fmt.ok(rec), fmt.tokens(rec))


def _run(llm, fmt, inp: Path, log: _ResultLog, stop: _StopSignals, done: set, summary: BatchSummary, *,
         mine_shard: tuple[int, int], progress: bool) -> None:
    """The run pass: stream the input, write error lines at once, feed the rest to the engine."""
    from tqdm.auto import tqdm

    me, P = mine_shard
    desc = "batch" if P == 1 else f"batch {me}/{P}"
    bar = tqdm(total=summary.total, initial=summary.before, unit="req", desc=desc, disable=not progress,
               dynamic_ncols=True)
    started = time.perf_counter()
    pending: dict[int, _Work] = {}
    last_postfix = [0.0]

    def record(rec: dict, outs=()) -> None:
        log.append(rec)
        summary.run.add(fmt.ok(rec), fmt.tokens(rec))
        for o in outs:
            m = o.metrics
            for name, value in (("ttft_s", m.ttft), ("tpot_s", m.tpot), ("e2e_s", m.e2e), ("queue_s", m.time_in_queue)):
                summary.latency[name].add(value)
            for a, b in zip(m.token_times, m.token_times[1:]):
                summary.latency["itl_s"].add(b - a)
        bar.update(1)
        now = time.perf_counter()
        if now - last_postfix[0] > 0.5:
            last_postfix[0] = now
            bar.set_postfix_str(f"{summary.run.output_tokens / max(now - started, 1e-9):.1f} out tok/s", refresh=False)

    def requests():
        seq = 0
        for n, raw in _lines(inp):
            if stop.stopping:
                return
            stop.check()
            key, shard, parsed = fmt.classify(n, raw, indexing=False)
            if shard % P != me or key in done:
                continue
            w = fmt.work(llm, n, key, parsed)
            if isinstance(w, dict):
                record(w)
                continue
            seq += 1
            w.outs, w.left = [None] * len(w.prompts), len(w.prompts)
            pending[seq] = w
            for k, (text, ids) in enumerate(w.prompts):
                yield f"{seq}/{k}", text, ids, w.params

    try:
        try:
            try:
                for o in llm.generate_stream(requests()):
                    seq, k = map(int, o.request_id.split("/"))
                    w = pending[seq]
                    w.outs[k] = o
                    w.left -= 1
                    if not w.left:
                        del pending[seq]
                        record(w.finish(w.outs), w.outs)
                    stop.check()
            finally:
                stop.disarm()
        except _Interrupted:  # also when it lands in the finally, before disarm
            pass
        if stop.stopping and (pending or summary.run.answered + summary.before < summary.total):
            summary.interrupted = stop.signum
    finally:
        bar.close()


def _finish_output(out: Path, fmt, order: str) -> None:
    """Merge parts into OUTPUT and/or rewrite it in input order (tmp file, fsync, rename)."""
    parts = _parts(out)
    if not parts and order == "completion":
        return
    sources = [p for p in [out, *parts] if p.exists()]
    if not sources:
        return
    seen: set[tuple] = set()
    entries = []  # (order, source, offset, size); in source order unless order == "input"
    for si, src in enumerate(sources):
        for offset, size, _, key in scan_results(src, fmt):
            if key not in seen:
                seen.add(key)
                entries.append((fmt.order_of(key) if order == "input" else 0, si, offset, size))
    if order == "input":
        entries.sort(key=lambda e: e[0])  # stable: equal orders keep file order
    tmp = out.with_name(out.name + ".tmp")
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(s, "rb")) for s in sources]
        dst = stack.enter_context(open(tmp, "wb"))
        for _, si, offset, size in entries:
            f = files[si]
            f.seek(offset)
            data = f.read(size)
            dst.write(data if data.endswith(b"\n") else data + b"\n")
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, out)
    _fsync_path(out.parent)
    for p in parts:  # only now: a crash before this leaves keys the next merge skips
        p.unlink()


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------- multi-host


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> tuple[int, int]:
    """Join a ``jax.distributed`` job; (process index, process count).

    With no arguments JAX detects the cluster (Cloud TPU pod slices, SLURM, Open MPI, ...).
    Must run before anything touches a JAX device.
    """
    import jax

    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    except (ValueError, RuntimeError) as e:
        raise InvalidRequest(f"cannot join the jax.distributed job: {e}") from None
    return jax.process_index(), jax.process_count()


def _client():
    # jax.distributed's key-value store and barrier (the ones orbax uses). A device collective
    # would not do: gloo gives up after 30 s, and processes finish their shares minutes apart.
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise InvalidRequest("process_count > 1 needs jax.distributed (see init_distributed)")
    return client


BARRIER_TIMEOUT_S = 24 * 3600


def _gather(summary: BatchSummary, me: int, P: int) -> BatchSummary:
    """Every process posts its summary; all wait for each other; process 0 sums them."""
    client = _client()
    client.key_value_set(f"jaxinfer_batch/summary/{me}", json.dumps(summary.to_json()))
    client.wait_at_barrier("jaxinfer_batch/done", BARRIER_TIMEOUT_S * 1000)
    if me != 0:
        return summary
    total = dataclasses.replace(summary, result=dataclasses.replace(summary.result),
                                run=dataclasses.replace(summary.run),
                                latency={k: Latency.from_json(h.to_json()) for k, h in summary.latency.items()})
    for p in range(1, P):
        total.merge_json(json.loads(client.blocking_key_value_get(f"jaxinfer_batch/summary/{p}", 60_000)))
    return total
