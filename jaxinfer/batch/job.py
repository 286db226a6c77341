"""The batch job itself: ``run_batch`` reads what is answered already, indexes the input,
runs what is left through the engine, and merges / reorders the output when complete."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from jaxinfer import storage
from jaxinfer.batch import parts
from jaxinfer.batch.distributed import _gather, _Spmd, fingerprint
from jaxinfer.batch.formats import _OpenAIFormat, _PromptsFormat, _Work
from jaxinfer.batch.log import _fsync_path, _NullLog, _ResultLog, scan_results
from jaxinfer.batch.signals import GRACE_PERIOD, _Interrupted, _StopSignals
from jaxinfer.batch.statistics import LATENCIES, BatchSummary, Latency, Tally
from jaxinfer.errors import InvalidRequest, JaxinferError
from jaxinfer.sampling import SamplingParams

ORDERS = ("completion", "input")
_PART = re.compile(r"\.part-(\d{5})-of-(\d{5})$")


def input_format(path) -> str:
    """"openai" for ``*.jsonl`` / ``*.json`` files, "prompts" (quick mode) for anything else."""
    return "openai" if Path(str(path)).suffix.lower() in (".jsonl", ".json") else "prompts"


def part_path(output: Path, process_index: int, process_count: int) -> Path:
    return output.with_name(f"{output.name}.part-{process_index:05d}-of-{process_count:05d}")


def _parts(output: Path) -> list[Path]:
    if not output.parent.is_dir():
        return []
    return sorted(p for p in output.parent.iterdir() if p.name.startswith(output.name + ".part-")
                  and _PART.search(p.name[len(output.name):]))


def _lines(path: Path | storage.Url) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of each non-blank line, streamed."""
    with open(path, "rb") if isinstance(path, Path) else storage.open_read(path) as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


def check_input(path) -> Path | storage.Url:
    """The input file (a local path, or a gs:// or s3:// object), or InvalidRequest /
    StorageError saying why it cannot be read."""
    if storage.is_url(path):
        u = storage.parse(path)
        i = storage.info(u)
        if i is None or i.get("size") is None:
            raise InvalidRequest(f"input {u} does not exist" if i is None else f"input {u} is not an object")
        return u
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
              grace_period: float = GRACE_PERIOD, process_index: int = 0, process_count: int = 1,
              spmd: bool = False, part_lines: int = parts.PART_LINES,
              part_seconds: float = parts.PART_SECONDS, lora_modules: dict | None = None) -> BatchSummary:
    """Answer every request of ``input_path`` into ``output_path``, resuming what is there.

    llm: an ``LLM``, or a function returning one (called only if some request still needs the
    model). kind: the input format, "openai", "prompts" or None (from the file name). order: "completion"
    or "input" (default: completion for OpenAI files, input for quick mode). defaults: sampling
    fields for OpenAI bodies that leave them out (``max_tokens``, ``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``seed``). sampling_params: quick mode's parameters. model_name: the
    ``model`` of the responses (default: the model's file name). process_index/process_count:
    this process's place in a ``jax.distributed`` job (see ``init_distributed``). spmd: the
    model is one mesh over all processes (``jaxinfer.llm.spans_processes``): every process runs
    every request, in the same order, and only process 0 writes OUTPUT; otherwise each process
    answers its share of the lines into a part file. lora_modules: LoRA adapter name ->
    ``lora.LoRARequest`` (the LLM started with enable_lora): a line whose body.model names one
    runs it; a name that is neither the model's nor an adapter's is that line's 400.

    input_path and output_path may be ``gs://`` or ``s3://`` URLs (``jaxinfer.storage``). An
    output URL is written in part objects of ``part_lines`` lines, or fewer after
    ``part_seconds`` (``jaxinfer.batch.parts``), joined into OUTPUT when the job is complete.
    """
    t0 = time.perf_counter()
    inp = check_input(input_path)
    remote = storage.is_url(output_path)
    if remote:
        out = storage.parse(output_path)
        if out == inp:
            raise InvalidRequest(f"the output {out} is the input")
        if not out.key or out.key.endswith("/"):
            raise InvalidRequest(f"the output {out} names no object (gs://BUCKET/NAME.jsonl)")
    else:
        out = Path(output_path)
        if isinstance(inp, Path) and out.exists() and out.resolve() == inp.resolve():
            raise InvalidRequest(f"the output file {out} is the input file")
        if not out.parent.is_dir():  # a typo in a path should not become a tree of new directories
            raise InvalidRequest(f"output directory {out.parent} does not exist (create it first)")
    if not 0 <= process_index < process_count:
        raise InvalidRequest(f"process_index must be in [0, {process_count}), got {process_index}")
    kind = kind or input_format(inp)
    if kind == "openai":
        fmt = _OpenAIFormat(defaults, model_name, lora_modules)
    elif kind == "prompts":
        fmt = _PromptsFormat(sampling_params, raw)
    else:
        raise InvalidRequest(f"input format must be 'openai' or 'prompts', got {kind!r}")
    order = order or fmt.default_order
    if order not in ORDERS:
        raise InvalidRequest(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if part_lines < 1 or not part_seconds >= 0:
        raise InvalidRequest(f"part_lines must be >= 1 and part_seconds >= 0, got {part_lines} and {part_seconds}")
    P, me = process_count, process_index
    spmd = spmd and P > 1
    ours = (lambda shard: True) if P == 1 or spmd else (lambda shard: shard % P == me)
    mine = lambda key: ours(fmt.shard_of_key(key))  # noqa: E731

    # the last part's upload comes out of the grace period too
    stop = _StopSignals(grace_period - min(5.0, grace_period / 4) if remote else grace_period)
    sync = _Spmd(me, P) if spmd else None
    if sync is not None:
        sync.same_input(fingerprint(inp, kind, order, defaults, sampling_params, raw))
    own = out if P == 1 or spmd or remote else part_path(out, me, P)
    if me != 0 and spmd:
        log = _NullLog()
    elif remote:
        log = parts._PartsLog(out, stop, process_index=me, process_count=1 if spmd else P, part_lines=part_lines,
                              part_seconds=part_seconds)
    else:
        log = _ResultLog(own, stop)
    # the stop handlers, once installed, stay until the output is final: after the run they only
    # note a signal, so one that lands while the last part is uploaded or the output merged
    # cannot kill the process halfway
    held = contextlib.ExitStack()
    try:
        done: set[tuple] = set()
        before = Tally()
        try:
            # 1. what is answered already: this process's file (locked and repaired), then the
            # others'. A file that does not exist yet is created only once there is a model to
            # fill it: a model that fails to load leaves no empty output behind (but see
            # _read_done_spmd).
            if spmd:
                _read_done_spmd(sync, log, out, fmt, done, before)
            elif remote:  # (the lease first: a concurrent run is refused before the model loads)
                for rec, key in log.open(fmt):
                    _note(done, before, fmt, rec, key, mine)
            else:
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
                if ours(shard):
                    total += 1
                    todo += key not in done
            # 3. run what is left
            summary = BatchSummary(str(out), total, total - todo, before, Tally(), 0.0,
                                   {k: Latency() for k in LATENCIES}, None, me, P)
            if todo:
                if callable(llm):
                    llm = llm()
                if not log.opened and not spmd:
                    for rec, key in log.open(fmt):  # (another run may have created it meanwhile)
                        _note(done, before, fmt, rec, key, mine)
                if isinstance(fmt, _OpenAIFormat) and fmt.model_name is None:
                    fmt.model_name = Path(str(llm.model_path)).name
                if isinstance(fmt, _PromptsFormat):
                    fmt.reset()
                held.enter_context(stop)
                _run(llm, fmt, inp, log, stop, done, summary, ours=ours, sync=sync,
                     desc="batch" if P == 1 else f"batch {me}/{P}", progress=progress)
                stats = getattr(getattr(llm, "engine", None), "spec_stats", None)
                summary.speculative = stats.summary() if stats is not None else None
            elif not log.opened and not spmd:  # nothing to answer (an empty input): the output still appears
                for _ in log.open(fmt):
                    pass
        finally:
            log.close()
        summary.result.merge(summary.run)
        summary.wall_s = time.perf_counter() - t0
        if summary.interrupted is not None:  # resumable as it is; merging and reordering wait for a complete run
            if metrics_out is not None and (P == 1 or spmd) and me == 0:
                _write_json(metrics_out, summary.metrics())
            return summary
        if P > 1 and not spmd:  # (an SPMD job's processes all ran every request: process 0's summary is the job's)
            summary = _gather(summary, me, P)
        if me == 0:
            if remote:
                parts.finish(out, fmt, order, log.run)
            else:
                _finish_output(out, fmt, order)
            if metrics_out is not None:
                _write_json(metrics_out, summary.metrics())
        return summary
    finally:
        held.close()


def _read_done_spmd(sync: _Spmd, log, out: Path, fmt, done: set, tally: Tally) -> None:
    """An SPMD job's done-set, the same on every process: process 0 locks and repairs OUTPUT
    (creating it: the others must not read it while process 0 could still cut a torn line, or
    find it created by a run that raced in); then the others read it; then process 0 may
    append. Part files of an earlier line-sharded run count too (process 0 merges them at the
    end). Each step is agreed, so an error on one process stops all of them."""
    everything = lambda key: True  # noqa: E731
    error = None
    try:
        if sync.me == 0:
            for rec, key in log.open(fmt):
                _note(done, tally, fmt, rec, key, everything)
    except JaxinferError as e:
        error = e
    sync.step("opened", error)
    try:
        if isinstance(out, storage.Url):  # process 0 read OUTPUT and its parts when it took the lease
            for rec, key in parts.read_done(out, fmt) if sync.me else ():
                _note(done, tally, fmt, rec, key, everything)
        for src in [] if isinstance(out, storage.Url) else [out, *_parts(out)] if sync.me else _parts(out):
            if src.exists():
                for _, _, rec, key in scan_results(src, fmt):
                    _note(done, tally, fmt, rec, key, everything)
    except JaxinferError as e:
        error = e
    sync.step("read", error)


def _note(done: set, tally: Tally, fmt, rec: dict, key: tuple, mine) -> None:
    if key not in done:
        done.add(key)
        if mine(key):
            tally.add(fmt.ok(rec), fmt.tokens(rec), _repetitions(rec))


def _run(llm, fmt, inp: Path | storage.Url, log, stop: _StopSignals, done: set, summary: BatchSummary, *,
         ours, sync: _Spmd | None, desc: str, progress: bool) -> None:
    """The run pass: stream the input, write error lines at once, feed the rest to the engine.
    ours(shard): whether this process answers a line of that shard. sync: an SPMD job's
    agreements, there to stop every process at the same request."""
    from tqdm.auto import tqdm

    bar = tqdm(total=summary.total, initial=summary.before, unit="req", desc=desc, disable=not progress,
               dynamic_ncols=True)
    started = time.perf_counter()
    pending: dict[int, _Work] = {}
    last_postfix = [0.0]

    def record(rec: dict, outs=()) -> None:
        log.append(rec)
        summary.run.add(fmt.ok(rec), fmt.tokens(rec), _repetitions(rec))
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

    beams = []  # use_beam_search lines: run after the rest (beam search drives the engine itself)

    def stopping() -> bool:
        if sync is None:
            return stop.stopping
        signum = sync.stop_vote(stop.signum)
        if signum is not None:
            stop.adopt(signum)
        return signum is not None

    def requests():
        seq = 0
        for n, raw in _lines(inp):
            stop.check()
            key, shard, parsed = fmt.classify(n, raw, indexing=False)
            if not ours(shard) or key in done:
                continue
            if stopping():  # before each request admitted (agreed in an SPMD job)
                return
            w = fmt.work(llm, n, key, parsed)
            if isinstance(w, dict):
                record(w)
                continue
            if w.beam is not None:
                beams.append(w)
                continue
            seq += 1
            w.outs, w.left = [None] * len(w.prompts), len(w.prompts)
            pending[seq] = w
            for k, (text, ids) in enumerate(w.prompts):
                yield f"{seq}/{k}", text, ids, w.params, w.lora

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
                for w in beams:
                    if stopping():
                        break
                    record(w.finish(w.beam_outputs(llm)))
                    stop.check()
            finally:
                stop.disarm()
        except _Interrupted:  # also when it lands in the finally, before disarm
            pass
        if stop.stopping and (pending or summary.run.answered + summary.before < summary.total):
            summary.interrupted = stop.signum
    finally:
        bar.close()


def _repetitions(rec: dict) -> int:
    """Sequences of a result line (either format) that repetition detection ended."""
    if "finish_reason" in rec:  # quick mode: one sequence per line
        return rec["finish_reason"] == "repetition"
    body = (rec.get("response") or {}).get("body") or {}
    return sum(c.get("finish_reason") == "repetition" for c in body.get("choices", ()))


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


def _write_json(path, obj: dict) -> None:
    if storage.is_url(path):
        storage.put(storage.parse(path), (json.dumps(obj, indent=2) + "\n").encode())
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
