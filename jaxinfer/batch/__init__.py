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
* Multi-host (``jax.distributed``), a model on each host (its parallel layout fits one process's
  devices): process p of P answers the lines whose custom_id hashes to p (lines without one by
  line number, quick mode by prompt index), so a repeated custom_id always meets its first
  occurrence in the same process. It appends to ``OUTPUT.part-p-of-P``; after a barrier,
  process 0 merges the parts into OUTPUT. Parts and OUTPUT must be on a filesystem all
  processes share. Merging skips keys already present, so a crash during it is harmless.
* Multi-host, one model over all hosts (``spmd``: the layout needs more devices than one process
  has, so ``LLM`` builds one global mesh, tensor parallel within a host and data or pipeline
  parallel across; ``jaxinfer.llm.spans_processes`` decides it): every process is part of each
  engine step, so every process reads every line and feeds the engine the same requests in the
  same order. First the processes compare their input (size, the sha256 of its first and last
  MiB, the options) and all refuse if any differs. Process 0 alone writes OUTPUT: it locks and
  repairs it (creating it, even before the model loads), then the others read it to build the
  same set of answered requests, then all run; the others write nothing but count the same
  tallies, so every process prints the job's summary, and process 0 writes the metrics and the
  ``order="input"`` rewrite. Before admitting each request all processes agree (through the
  ``jax.distributed`` key-value store) whether to stop, so a SIGTERM/SIGINT on any one of them
  stops all at the same request, each giving those in flight the grace period. A hard stop (a
  second signal, or the end of the grace period) is not agreed: that process leaves; what
  process 0 has written stays, and a rerun resumes it; the other processes fail once the
  runtime notices (a collective or the coordination service's heartbeat), or wait for the
  interrupted step until they are killed. Kill them all, then rerun.
* Object storage (``gs://``, ``s3://``; ``jaxinfer.storage``): the input may be an object, and an
  output URL is written in bounded part objects with a lease instead of appends and a lock
  (``parts``): a kill loses at most the one part each process had not written yet; a rerun
  skips what any part holds; the finished job joins the parts into OUTPUT. Multi-host processes
  write their own parts under the same prefix: no shared filesystem is needed.
* ``order="input"``: once every request is answered the file is rewritten in input order
  (through a temporary file and a rename); the default is completion order.

The package: ``statistics`` (counts, latency histograms), ``formats`` (the two input formats and
their result lines), ``log`` (the durable output), ``parts`` (the output in object storage), ``signals``, ``distributed`` (multi-host), and
``job`` (``run_batch``), which uses them all. The names below are its public face.
"""

from jaxinfer.batch.distributed import BARRIER_TIMEOUT_S, init_distributed
from jaxinfer.batch.formats import QUICK_MAX_TOKENS, _encode, _OpenAIFormat, _PromptsFormat  # noqa: F401
from jaxinfer.batch.job import ORDERS, check_input, input_format, part_path, run_batch
from jaxinfer.batch.parts import LEASE_SECONDS, PART_LINES, PART_SECONDS
from jaxinfer.batch.log import FSYNC_EVERY, FSYNC_SECONDS, OutputFileError, _dumps, scan_results  # noqa: F401
from jaxinfer.batch.signals import GRACE_PERIOD
from jaxinfer.batch.statistics import LATENCIES, BatchSummary, Latency, Tally

__all__ = [
    "BARRIER_TIMEOUT_S", "BatchSummary", "FSYNC_EVERY", "FSYNC_SECONDS", "GRACE_PERIOD", "LATENCIES",
    "LEASE_SECONDS", "Latency", "ORDERS", "PART_LINES", "PART_SECONDS", "OutputFileError", "QUICK_MAX_TOKENS", "Tally", "check_input",
    "init_distributed", "input_format", "part_path", "run_batch", "scan_results",
]
