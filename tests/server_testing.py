"""A live server on 127.0.0.1 for the tests: uvicorn in a thread, on a free port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx2 as httpx  # the openai client's own HTTP library


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(llm, config, *, startup_s: float = 60.0):
    """Yield (base_url, app) while the server runs; stop it (and its engine thread) afterwards."""
    import uvicorn

    from jaxinfer.server import build_app

    app = build_app(llm, config)
    port = free_port()
    # A long keep-alive: with uvicorn's 5 s, a pooled client connection idle for about 5 s can be
    # closed by the server just as the next request goes out ("Server disconnected"); the tests'
    # clients do not retry, so that race would read as a failure of the server under test.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5, timeout_keep_alive=600))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(30)


def metric_samples(url: str) -> dict:
    """{(name, frozenset(labels without model_name)): value} from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out
