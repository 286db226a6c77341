"""The engine behind the server: one background thread owns it, HTTP handlers talk to it through
queues.

Handlers ``submit`` a ``Job`` (the prompts of one HTTP request, already encoded and checked) and
``abort`` it when their client goes away. The engine thread takes submissions from a thread-safe
queue, adds their rows to the running batch, calls ``engine.step()`` while there is work, and
after every step hands each job what is new: a ``Delta`` per choice whose text grew (or that
finished), then one ``Done`` with the finished ``RequestOutput``s. A job's ``sink`` is called on
the engine thread; the server's sink moves events onto the request's asyncio queue with
``loop.call_soon_threadsafe``.

The engine interface used (vLLM LLMEngine's shape): ``add(row)`` (validates, raises
InvalidRequest), ``abort(row)`` (frees a waiting or running row's pages; it is never returned),
``step() -> finished rows`` (running rows grow ``token_ids`` and ``checker.output_text`` in
place), ``has_unfinished()``, ``num_running()``, ``num_waiting()``, ``kv_usage()``.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable

from jaxinfer.errors import InvalidRequest
from jaxinfer.outputs import Logprob, RequestOutput
from jaxinfer.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Delta:
    """New output of one choice since the last Delta: text, token ids and their logprobs."""

    index: int  # choice index: prompt i, sample j -> i * n + j
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # set on the choice's last Delta only


@dataclasses.dataclass(frozen=True)
class Done:
    outputs: list[RequestOutput]  # one per prompt, in prompt order


@dataclasses.dataclass(frozen=True)
class Failed:
    error: Exception  # InvalidRequest: the request cannot run; anything else: the server is stopping


@dataclasses.dataclass(frozen=True)
class Accepted:
    pass


@dataclasses.dataclass(eq=False)
class Job:
    """The prompts of one HTTP request; each prompt becomes one engine request of ``params.n`` rows."""

    prompts: list[tuple[str | None, list[int]]]  # (text, token ids)
    params: SamplingParams
    sink: Callable[[object], None]  # called on the engine thread with Accepted/Delta/Done/Failed
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    on_row: Callable[[object], None] | None = None  # called on each new row (e.g. to attach a grammar)
    stream: bool = False  # the client reads each choice's text as it grows (no chained decode steps)
    lora: object = None  # the rows' LoRA adapter (``lora.Adapter``), None: the base model
    # engine-thread state
    requests: list = dataclasses.field(default_factory=list)  # llm.Request per prompt
    rows: list = dataclasses.field(default_factory=list)  # in choice order
    sent: list = dataclasses.field(default_factory=list)  # per row: (chars, tokens) already delivered
    finished: set = dataclasses.field(default_factory=set)  # row positions finished
    cancelled: bool = False
    abandoned: bool = False  # set by abort() on any thread: a job not started yet never starts

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.params.n


class QueueFull(Exception):
    """Past the waiting bound: answer 429."""


class EngineLoop:
    """Owns ``llm.engine`` on one thread; see the module docstring.

    max_waiting: how many rows may wait beyond the engine's ``max_num_seqs`` running slots;
    ``submit`` raises QueueFull past it (a job is always taken when nothing is in flight).
    on_finished(outputs, finish_reasons): called on the engine thread for each finished job.
    on_step(): called on the engine thread after each step (for gauges).
    """

    def __init__(self, llm, *, max_waiting: int = 256, on_finished=None, on_step=None):
        self.llm = llm
        self.engine = llm.engine
        self.max_waiting = max_waiting
        self.capacity = llm.engine.max_num_seqs + max_waiting
        self._on_finished = on_finished
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._rows_in_flight = 0  # rows submitted and not yet finished or aborted (under _lock)
        self._jobs: dict[int, Job] = {}  # engine thread only: live jobs by id
        self._owner: dict[int, tuple[Job, int]] = {}  # engine thread only: id(row) -> (job, position)
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name="jaxinfer-engine", daemon=True)
        self.error: BaseException | None = None  # what killed the engine thread, if anything

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop stepping; jobs still in flight get Failed. Waits for the thread."""
        self._stopping = True
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull. Its sink hears Accepted (or Failed) first."""
        with self._lock:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if self._rows_in_flight and self._rows_in_flight + job.num_rows > self.capacity:
                raise QueueFull(f"{self._rows_in_flight} sequences are in flight; the bound is {self.capacity}")
            self._rows_in_flight += job.num_rows
        self._commands.put(("submit", job))

    def abort(self, job: Job) -> None:
        """Cancel a job (its client went away): its sink hears nothing more. A finished job is left as is."""
        job.abandoned = True
        self._commands.put(("abort", job))

    @property
    def rows_in_flight(self) -> int:
        return self._rows_in_flight

    def counts(self) -> tuple[int, int, float]:
        """(running, waiting, kv usage in [0, 1]) for the gauges; engine thread only."""
        return self.engine.num_running(), self.engine.num_waiting(), float(self.engine.kv_usage())

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            self._run_incremental()
        except BaseException as e:  # the engine broke: every waiting client gets an error
            self.error = e
            raise
        finally:
            self._stopping = True
            for job in list(self._jobs.values()):
                self._drop(job, Failed(self.error or RuntimeError("the server is shutting down")))
            while True:
                try:
                    kind, job = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    self._drop(job, Failed(RuntimeError("the server is shutting down")))

    def _run_incremental(self) -> None:
        while not self._stopping:
            self._take_commands(block=not self.engine.has_unfinished())
            if self._stopping:
                return
            if self.engine.has_unfinished():
                self._publish(self.engine.step())
            if self._on_step is not None:  # after aborts too: the gauges drop without a step
                self._on_step()

    def _take_commands(self, block: bool) -> None:
        """Apply every queued command; with block, wait for the first one."""
        while True:
            try:
                kind, job = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self._start(job)
            elif kind == "abort":
                self._abort(job)

    def _start(self, job: Job) -> bool:
        """Make the job's rows and add them to the engine; False if the engine refused them."""
        if job.abandoned:  # its client left before the engine thread took it
            self._release(job.num_rows)
            return False
        for text, toks in job.prompts:
            req = self.llm.new_request(str(len(job.requests)), text, toks, job.params, job.arrival, lora=job.lora)
            job.requests.append(req)
            job.rows.extend(req.rows)
        job.sent = [(0, 0)] * len(job.rows)
        try:
            for row in job.rows:
                row.stream = job.stream
                if job.on_row is not None:
                    job.on_row(row)
                self.engine.add(row)
        except InvalidRequest as e:
            for row in job.rows:
                self.engine.abort(row)  # the rows added before the refused one
            self._release(job.num_rows)
            job.sink(Failed(e))
            return False
        self._jobs[id(job)] = job
        for pos, row in enumerate(job.rows):
            self._owner[id(row)] = (job, pos)
        job.sink(Accepted())
        return True

    def _abort(self, job: Job) -> None:
        if id(job) not in self._jobs or job.cancelled:
            return
        job.cancelled = True
        for pos, row in enumerate(job.rows):
            if pos not in job.finished:
                self.engine.abort(row)
        self._forget(job)

    def _publish(self, finished_rows) -> None:
        """Deliver what each live job gained in the last step, and finish the jobs that are done."""
        for row in finished_rows:
            job, pos = self._owner.pop(id(row), (None, None))
            if job is not None:
                job.finished.add(pos)
        for job in list(self._jobs.values()):
            if job.cancelled:
                if len(job.finished) == len(job.rows):
                    del self._jobs[id(job)]
                continue
            for pos, row in enumerate(job.rows):
                self._deliver(job, pos, row)
            if len(job.finished) == len(job.rows):
                outputs = [req.output() for req in job.requests]
                self._forget(job)
                job.sink(Done(outputs))
                if self._on_finished is not None:
                    self._on_finished(outputs)

    def _deliver(self, job: Job, pos: int, row) -> None:
        chars, toks = job.sent[pos]
        if chars < 0:
            return  # its last Delta is out
        text = row.checker.output_text
        done = pos in job.finished
        if len(text) == chars and len(row.token_ids) == toks and not done:
            return
        lps = row.logprobs[toks:len(row.token_ids)] if row.logprobs is not None else None
        job.sink(Delta(pos, text[chars:], list(row.token_ids[toks:]), lps,
                       row.checker.finish_reason if done else None))
        job.sent[pos] = (-1, -1) if done else (len(text), len(row.token_ids))

    def _forget(self, job: Job) -> None:
        self._jobs.pop(id(job), None)
        for row in job.rows:
            self._owner.pop(id(row), None)
        self._release(job.num_rows)

    def _drop(self, job: Job, event) -> None:
        if not job.cancelled:
            job.sink(event)
        job.cancelled = True
        self._jobs.pop(id(job), None)

    def _release(self, n: int) -> None:
        with self._lock:
            self._rows_in_flight -= n
