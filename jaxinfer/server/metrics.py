"""The server's Prometheus metrics, named as vLLM names them with our ``jaxinfer:`` prefix.

Counters: ``request_success_total`` (one per finished sequence, by finish reason: stop, length,
repetition (repetition detection), abort),
``prompt_tokens_total`` and ``generation_tokens_total`` (counted when a request finishes, so a
cancelled request adds nothing). Gauges: ``num_requests_running``, ``num_requests_waiting``
(sequences), ``kv_cache_usage_perc`` (0..1). Histograms of TTFT, TPOT and end-to-end latency,
one observation per prompt. Every metric carries ``model_name``. Each server has a registry of
its own, so several can live in one process (the tests do this).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxinfer.outputs import RequestOutput

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        self._success = Counter("jaxinfer:request_success", "Finished sequences, by finish reason.",
                                label + ["finished_reason"], registry=r)
        self._prompt = Counter("jaxinfer:prompt_tokens", "Prompt tokens of finished requests.", label, registry=r)
        self._generation = Counter("jaxinfer:generation_tokens", "Generated tokens of finished requests.", label,
                                   registry=r)
        self._running = Gauge("jaxinfer:num_requests_running", "Sequences in the running batch.", label, registry=r)
        self._waiting = Gauge("jaxinfer:num_requests_waiting", "Sequences waiting to run.", label, registry=r)
        self._kv = Gauge("jaxinfer:kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1).", label,
                         registry=r)
        self._ttft = Histogram("jaxinfer:time_to_first_token_seconds", "Arrival to first token.", label,
                               buckets=TTFT_BUCKETS, registry=r)
        self._tpot = Histogram("jaxinfer:time_per_output_token_seconds", "Mean time per output token after the first.",
                               label, buckets=TPOT_BUCKETS, registry=r)
        self._e2e = Histogram("jaxinfer:e2e_request_latency_seconds", "Arrival to the last token.", label,
                              buckets=E2E_BUCKETS, registry=r)
        for g in (self._running, self._waiting, self._kv):
            g.labels(model_name).set(0)

    def finished(self, outputs: list[RequestOutput]) -> None:
        m = self.model_name
        for out in outputs:
            for c in out.outputs:
                self._success.labels(m, c.finish_reason or "abort").inc()
            self._prompt.labels(m).inc(len(out.prompt_token_ids))
            self._generation.labels(m).inc(sum(len(c.token_ids) for c in out.outputs))
            t = out.metrics
            if t.ttft is not None:
                self._ttft.labels(m).observe(t.ttft)
            if t.tpot is not None:
                self._tpot.labels(m).observe(t.tpot)
            if t.e2e is not None:
                self._e2e.labels(m).observe(t.e2e)

    def gauges(self, running: int, waiting: int, kv_usage: float) -> None:
        m = self.model_name
        self._running.labels(m).set(running)
        self._waiting.labels(m).set(waiting)
        self._kv.labels(m).set(kv_usage)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
