"""Server output throughput under concurrent streaming clients vs offline ``LLM.generate`` on the
same workload, side by side in one run.

    python benchmarks/server_throughput.py --model smollm2-135m-instruct --clients 64 --max-tokens 64 --repeats 2

The server is ``jaxinfer serve`` in its own process (as it is deployed); the clients are the
official ``openai`` client's AsyncOpenAI, one streaming request each, all started at once. The
offline side is ``LLM.generate`` over the same prompts and SamplingParams in this process. Both
use the same engine settings (max_num_seqs = clients, same max_model_len, prefix caching off so a
repeat recomputes what the warm-up computed) and greedy decoding with ignore_eos, so both
generate exactly clients x max_tokens tokens. Each side runs once to warm (compile) and then
``--repeats`` timed passes, alternating; prints medians and the ratio server/offline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a lighthouse", "mountains", "a city at night", "an old library", "the desert",
              "a train journey", "a garden"]
    return [f"Write a short story about {topics[i % len(topics)]} (story {i})." for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _clients(url: str, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    async def one(p: str) -> int:
        n = 0
        stream = await client.completions.create(model="m", prompt=p, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return wall, sum(counts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    import httpx2 as httpx  # the openai client's own HTTP library

    from jaxinfer import LLM, SamplingParams

    prompts = _prompts(a.clients)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")] if p))
    server = subprocess.Popen([sys.executable, "-m", "jaxinfer", "serve", a.model, "--port", str(port),
                               "--max-num-seqs", str(a.clients), "--max-model-len", str(a.max_model_len),
                               "--no-enable-prefix-caching", "--max-waiting", str(4 * a.clients)], env=env)
    try:
        llm = LLM(a.model, max_model_len=a.max_model_len, max_num_seqs=a.clients, enable_prefix_caching=False,
                  progress=False)
        sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)

        def offline() -> tuple[float, int]:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        offline()  # warm: compile every shape the workload hits
        asyncio.run(_clients(url, prompts, a.max_tokens))
        off, srv = [], []
        for _ in range(a.repeats):
            wall, n = offline()
            off.append(n / wall)
            wall, n = asyncio.run(_clients(url, prompts, a.max_tokens))
            assert n == a.clients * a.max_tokens, n
            srv.append(n / wall)
            print(f"offline {off[-1]:.1f} tok/s, server {srv[-1]:.1f} tok/s", flush=True)
        mo, ms = statistics.median(off), statistics.median(srv)
        print(f"median: offline {mo:.1f} output tok/s, server ({a.clients} streaming clients) {ms:.1f} output "
              f"tok/s, server/offline = {ms / mo:.1%}")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
