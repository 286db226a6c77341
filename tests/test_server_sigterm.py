"""`jaxinfer serve` as a process: SIGTERM stops admitting, lets the request in flight finish,
then exits 0. (The tiny model: the process loads and compiles it in seconds.)"""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest

from tests.server_testing import free_port


@pytest.fixture
def serve_process(tiny_gguf):
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer", "serve", str(tiny_gguf), "--port", str(port),
                             "--max-num-seqs", "4", "--grace-period", "60"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_sigterm_drains_then_exits(serve_process):
    proc, url = serve_process
    lines, first = [], threading.Event()

    def stream():
        body = {"prompt": "Once upon a time", "max_tokens": 48, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(120)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    try:  # no longer admitting: refused at the socket, or 503 on a kept-alive connection
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10).status_code
    except httpx.TransportError:
        late = None
    assert late in (None, 503)
    t.join(120)
    assert proc.wait(120) == 0
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2].replace(" ", "")


def test_bad_serve_flags_fail_before_the_model_loads(capsys):
    from jaxinfer.cli import main

    assert main(["serve", "no-such-model", "--rate-limit", "lots"]) == 2
    assert "--rate-limit must look like 60/min" in capsys.readouterr().err
