"""The Pallas kernels and the engine on a real GPU: compiled (not interpreted), checked against
their references, timed, and set against the card's measured copy bandwidth (MBU) and matmul
rate. Written to run as one command within --budget seconds on a GPU machine without network
access that gets the checkout and `.gpu/`. The engine section needs the gguf wheel: installed
outside the checkout, or else imported from the wheel itself (a pure-Python zip), so a failed
pip stops nothing else:

    python -m pip install -q --no-index --no-deps --target /tmp/gguf .gpu/gguf-0.19.0-py3-none-any.whl; \\
    XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda,cpu \\
    PYTHONPATH=/tmp/gguf:.gpu/gguf-0.19.0-py3-none-any.whl \\
        python benchmarks/gpu_check.py --out $OUT --budget 400

Prepare on a machine with network access first (both go in `.gpu/`, which git ignores):
  the gguf wheel (a GPU image may lack it): pip download --no-deps --only-binary=:all:
      --python-version 3.12 --platform manylinux2014_x86_64 -d .gpu gguf==0.19.0
  SmolLM2's tokenizer in a 3 MB GGUF (so the 94 MB checkpoint need not be copied over):
      python -c "from tests.tiny_gguf import write_tiny_llama; from jaxinfer import registry;
      write_tiny_llama('.gpu/tokenizer-smollm2.gguf', registry.fetch('smollm2-135m-instruct'),
      layers=1, d=8, heads=2, kv_heads=1, ff=8, context=2048)"

Sections, each in its own try block so one failure does not hide the rest, in this order (the
measurements first: each section stops starting new work at its share of --budget, so the
whole run ends within it):
  env          jax version, device, driver
  ceilings     device-to-device copy bandwidth (bytes read + written), a bf16 and an int8
               matmul's rate, and the timing harness's own floor per loop step and per call
  spec_verify  the speculative-verification kernel (Triton variant) against its reference
               (XLA) at B=64 and B=1, k=4, V=49152: greedy, sampled (point-mass drafts) and
               sampled with draft probabilities; rows equal, time, MBU
  tests        the kernel-grid tests compiled for the GPU (JAXINFER_TEST_COMPILED=1, -k gpu),
               spec_verify's among them
  kernels      each kernel against its pure-JAX reference (XLA on the same GPU) at serving
               shapes: time, bytes it must move, MBU = bytes / time / copy bandwidth; and
               the paged decode kernel against the ragged kernel on the same decode rows
               (what a decode-only engine step runs under each), both inside the jitted loop
  engine       LLM.generate on a SmolLM2-shaped model (random weights, SmolLM2's real
               tokenizer), bfloat16: batch 1 and 64, Pallas kernels on and off (same tokens?)
  wide         the slow (wide) kernel grids, with what time is left

Timing: a Python loop of calls puts a per-call dispatch floor (33-89 us on the H100) under
small ops, so each op is timed inside one jitted lax.fori_loop of n calls (`loop_timed`,
about 20 ms of work): after each call every input has its first element rewritten with
itself plus a zero computed from the call's outputs (behind an optimization barrier), so XLA
can neither hoist any part of the call out of the loop nor narrow it to the elements read;
that costs one in-place element per input per step, and one copy of the inputs per loop.
`*_us` is that loop's median time over n; `*_call_us` the Python-loop time (20 calls per
timed region, blocking on the last), kept beside it; ops slower than 300 us per call (where
the floor does not matter) are timed by the call loop only. The ceilings give both
harnesses' floor on a trivial op. MBU for spec_verify counts the bytes any implementation
must read: the logits, plus with draft probabilities the one row of them a residual needs
(the others are read only at the drafted tokens). Inputs are random normal, never zeros.
Everything is written to OUT/gpu_check.json and the summary is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS: dict = {}
T0 = time.perf_counter()
DRY = False  # --dry: the whole script on CPU at toy sizes, GPU variants in interpret mode


def size(real, dry):
    return dry if DRY else real


def elapsed() -> float:
    return time.perf_counter() - T0


def section(name):
    def wrap(fn):
        def run(*a, **k):
            t = time.perf_counter()
            print(f"\n=== {name} (at {elapsed():.0f} s)", flush=True)
            try:
                RESULTS[name] = fn(*a, **k)
            except Exception as e:  # a failed section is a result too
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            RESULTS.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t, 1)
        return run
    return wrap


def timed(f, *args, calls=20, repeats=7):
    """Median seconds per call of f(*args) (already compiled by a first call)."""
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


LOOP_BELOW_US = 300  # ops slower than this per call are timed by the call loop alone


def loop_timed(f, args, n, repeats=5):
    """Median seconds per call of f(*args) over one jitted fori_loop of n calls.

    Every array argument is carried through the loop, and after each call its first element
    is rewritten with itself plus a zero (xor False for booleans) computed from every output:
    no part of the call is independent of the step before it, so XLA can hoist none of it
    out of the loop (loop-invariant code motion would otherwise lift, e.g., a reference's
    page gather that does not depend on a perturbed query). The optimization barrier keeps
    XLA from computing only the output elements the zero reads. The rewrites are in place,
    one element each; the loop's one copy of the (undonated) inputs is spread over n."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def touch(x, hit):
        at = (0,) * x.ndim
        old = lax.dynamic_slice(x, at, (1,) * x.ndim)
        new = old ^ hit if x.dtype == jnp.bool_ else old + hit.astype(x.dtype)
        return lax.dynamic_update_slice(x, new, at)

    def body(_, xs):
        out = f(*xs)
        out, xs = lax.optimization_barrier((out, xs))
        firsts = [leaf.reshape(-1)[0].astype(jnp.float32) for leaf in jax.tree.leaves(out)]
        hit = sum(firsts) == -3.0e38  # never true, unknown to XLA
        return tuple(x if x is None or not x.ndim else touch(x, hit) for x in xs)

    loop = jax.jit(lambda *xs: lax.fori_loop(0, n, body, xs))
    jax.block_until_ready(loop(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def loop_calls(call_s: float) -> int:
    """Loop length for an op of call_s seconds per Python call: about 20 ms of device work."""
    return size(int(min(400, max(20, 0.02 / max(call_s, 1e-6)))), 2)


def bench(name, kern, ref, args, *, bw, compare=None, bytes_moved=None, flops=None, calls=20, loop=False):
    """One row: kernel vs reference (compare(out, want) -> dict; default the relative error,
    reference at highest matmul precision), each timed by the jitted loop (*_us, below
    LOOP_BELOW_US per call, or always with loop=True or in --dry) and the Python call loop
    (*_call_us)."""
    import jax

    r = {"name": name}
    try:
        out = jax.block_until_ready(kern(*args))
        if compare is None:
            with jax.default_matmul_precision("highest"):
                want = jax.block_until_ready(ref(*args))
            r["rel_err"] = rel_err(out, want)
        else:
            r |= compare(out, jax.block_until_ready(ref(*args)))
        for key, f in (("kernel", kern), ("xla_ref", ref)):
            t_call = timed(f, *args, calls=size(calls, 2), repeats=size(7, 1))
            r[f"{key}_call_us"] = t_call * 1e6
            t = t_call
            if DRY or loop or t_call * 1e6 < LOOP_BELOW_US:
                n = loop_calls(t_call)
                t = loop_timed(f, args, n, repeats=size(5, 1))
                r[f"{key}_loop_n"] = n
            r[f"{key}_us"] = t * 1e6
        if bytes_moved:
            r["bytes"] = bytes_moved
            r["GBps"] = bytes_moved / r["kernel_us"] / 1e3
            r["MBU"] = bytes_moved / (r["kernel_us"] * 1e-6) / bw
            r["ref_MBU"] = bytes_moved / (r["xla_ref_us"] * 1e-6) / bw
        if flops:
            r["TFLOPs"] = flops / r["kernel_us"] / 1e6
            r["ref_TFLOPs"] = flops / r["xla_ref_us"] / 1e6
    except Exception as e:
        traceback.print_exc()
        r["error"] = f"{type(e).__name__}: {e}"[:600]
    print(json.dumps(r), flush=True)
    return r


def rel_err(out, ref) -> float:
    import numpy as np

    a, b = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@section("env")
def env():
    import jax

    d = jax.devices()[0]
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        smi = "no nvidia-smi"
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device": str(d),
            "device_kind": d.device_kind, "nvidia_smi": smi, "python": sys.version.split()[0]}


@section("ceilings")
def ceilings():
    import jax
    import jax.numpy as jnp

    n = size(1 << 28, 1 << 20)  # 1 GiB of float32
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    copy = jax.jit(lambda x: x * 1.5)
    t = timed(copy, x, calls=10, repeats=9)
    bw = 2 * 4 * n / t
    m = size(8192, 256)
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    tm = timed(mm, a, b, calls=10, repeats=7)
    i8 = jax.random.randint(jax.random.key(3), (m, m), -127, 128, jnp.int8)
    mi = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.int32))
    ti = timed(mi, i8, i8, calls=10, repeats=7)
    # The harnesses' own floor: a trivial op on 256 floats, per loop step and per Python call.
    tiny = jax.jit(lambda x: x * 1.5)
    small = jnp.ones((256,), jnp.float32)
    floor_loop = loop_timed(tiny, (small,), size(1000, 10), repeats=size(5, 1))
    floor_call = timed(tiny, small, calls=size(200, 5), repeats=size(5, 1))
    return {"copy_GBps": bw / 1e9, "bf16_matmul_TFLOPs": 2 * m**3 / tm / 1e12,
            "int8_matmul_TOPs": 2 * m**3 / ti / 1e12, "loop_floor_us": floor_loop * 1e6,
            "call_floor_us": floor_call * 1e6}


def pytest_kernels(extra: list[str], timeout: float, log: Path):
    env = dict(os.environ, JAXINFER_TEST_COMPILED="1", JAX_PLATFORMS="cuda,cpu")
    # One file failing to import (a module the device image lacks) must not stop the others.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "gpu", "-rfE",
           "--continue-on-collection-errors",
           "tests/test_kernels_ragged_paged_attention.py", "tests/test_kernels_paged_attention.py",
           "tests/test_kernels_quant_matmul.py",
           "tests/test_spec_verify.py", *extra]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    log.write_text(out)
    tail = out.strip().splitlines()[-25:]
    print("\n".join(tail), flush=True)
    return {"rc": rc, "summary": tail[-1] if tail else "", "failed": [l for l in out.splitlines() if l.startswith("FAILED")][:20]}


# ----------------------------------------------------------------------------- spec_verify
def _spec_inputs(B, k, V, mode):
    """Verification inputs for B rows of k drafts over V logits. mode "greedy": every row
    greedy, drafts the argmax; "sampled": every row sampled under a min-p-like filter (keep z
    within 6 of the row's maximum), half the drafts the argmax and half random (rejections
    land at every position), point-mass drafts; "sampled+q": the same with draft
    probabilities (a softmax of perturbed logits)."""
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(8), 5)
    z = jax.random.normal(ks[0], (B, k + 1, V), jnp.float32) * 3
    amax = jnp.argmax(z[:, :k], -1).astype(jnp.int32)
    greedy = jnp.full((B,), mode == "greedy")
    if mode == "greedy":
        thr, drafts = jnp.full((B, k + 1), -jnp.inf, jnp.float32), amax
    else:
        thr = jnp.max(z, -1) - 6.0
        guess = jax.random.randint(ks[1], (B, k), 0, V, jnp.int32)
        drafts = jnp.where(jax.random.uniform(ks[2], (B, k)) < 0.5, amax, guess)
    q = None
    if mode == "sampled+q":
        q = jax.nn.softmax(z[:, :k] * 0.8 + jax.random.normal(ks[3], (B, k, V)), -1)
    u = jax.random.uniform(ks[4], (B, k + 1, 3), jnp.float32)
    return (z, thr, drafts, jnp.full((B,), k, jnp.int32), u, greedy, q)


@section("spec_verify")
def spec_verify_bench(bw: float, budget_end: float):
    """The Triton variant against the reference (XLA) on the same GPU: rows whose accepted
    count and next token both equal (integer outputs; a draw within rounding of a boundary
    may differ), times, MBU over the bytes that must be read."""
    import jax
    import numpy as np

    from pallas_kernels import spec_verify as sv

    def compare(out, want):
        a, n = (np.asarray(x) for x in out)
        wa, wn = (np.asarray(x) for x in want)
        return {"rows_equal": f"{int(((a == wa) & (n == wn)).sum())}/{len(a)}",
                "mean_accepted": float(wa.mean())}

    kern = jax.jit(lambda *a: sv.spec_verify_kernel(*a, interpret=DRY))
    ref = jax.jit(sv.spec_verify_reference)
    k, V = size((4, 49152), (4, 4096))
    rows = []
    for B in size((64, 1), (3, 1)):
        for mode in ("greedy", "sampled+q", "sampled"):
            name = f"spec_verify B={B} k={k} V={V} {mode}"
            if elapsed() > budget_end:
                rows.append({"name": name, "skipped": "out of time"})
                continue
            args = _spec_inputs(B, k, V, mode)
            read = B * (k + 1) * V * 4 + (B * V * 4 if mode == "sampled+q" else 0)
            rows.append(bench(name, kern, ref, args, bw=bw, compare=compare, bytes_moved=read))
    return rows


# ----------------------------------------------------------------------------- kernels
def _paged_inputs(key, B, ctx, N, K, H, page_size, dtype, extra_pages=64):
    """Pools of B sequences of ctx tokens on shuffled pages (keys transposed, as the engine
    keeps them) and a query per row."""
    import jax
    import jax.numpy as jnp

    pps = -(-ctx // page_size)
    P = B * pps + extra_pages
    ks = jax.random.split(key, 4)
    kp = jax.random.normal(ks[0], (P, K, H, page_size), dtype)
    vp = jax.random.normal(ks[1], (P, K, page_size, H), dtype)
    table = jax.random.permutation(ks[2], P)[: B * pps].reshape(B, pps).astype(jnp.int32)
    q = jax.random.normal(ks[3], (B, N, H), dtype)
    return q, kp, vp, table


@section("kernels")
def kernels_bench(bw: float, budget_end: float):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import paged_attention as pa
    from pallas_kernels import quant_matmul as qm
    from pallas_kernels import ragged_paged_attention as rpa

    rows = []

    def add(name, kern, ref, args, bytes_moved=None, flops=None, calls=20, loop=False):
        if elapsed() > budget_end:
            rows.append({"name": name, "skipped": "out of time"})
            return
        rows.append(bench(name, kern, ref, args, bw=bw, bytes_moved=bytes_moved, flops=flops, calls=calls,
                          loop=loop))

    bf16 = jnp.bfloat16
    key = jax.random.key(0)
    I_ = dict(interpret=DRY)
    # Paged decode: SmolLM2's heads (9 query, 3 kv, dim 64) and Llama-3-8B's (32, 8, 128).
    shapes = [((9, 3, 64), 64, 1024), ((32, 8, 128), 32, 4096), ((32, 8, 128), 64, 1024)]
    for (N, K, H), B, ctx in size(shapes, [((4, 2, 16), 2, 40)]):
        q, kp, vp, table = _paged_inputs(key, B, ctx, N, K, H, 16, bf16)
        lengths = jnp.full((B,), ctx, jnp.int32)
        kv_bytes = 2 * B * ctx * K * H * 2
        opts = dict(keys_transposed=True)
        # one decode query per segment
        S = jnp.arange(B, dtype=jnp.int32)
        add(f"ragged_paged decode B={B} ctx={ctx} N/K/H={N}/{K}/{H} bf16",
            jax.jit(lambda *a: rpa.ragged_paged_attention_kernel(*a, **opts, **I_)),
            jax.jit(lambda *a: rpa.ragged_paged_attention_reference(*a, **opts)),
            (q, kp, vp, table, S, jnp.ones((B,), jnp.int32), lengths), bytes_moved=kv_bytes)
        # The same rows through the paged decode kernel (a decode-only engine step's choice),
        # with the ragged kernel as its "reference": both timed inside one jitted loop, so MBU
        # and ref_MBU set the two kernels side by side against the measured copy bandwidth.
        ones = jnp.ones((B,), jnp.int32)
        add(f"paged_decode vs ragged B={B} ctx={ctx} N/K/H={N}/{K}/{H} bf16",
            jax.jit(lambda q, kp, vp, t, n: pa.paged_attention_kernel(q, kp, vp, t, n, **opts, **I_)),
            jax.jit(lambda q, kp, vp, t, n: rpa.ragged_paged_attention_kernel(q, kp, vp, t, S, ones, n, **opts, **I_)),
            (q, kp, vp, table, lengths), bytes_moved=kv_bytes, loop=True)
    # A packed step: one 512-token prompt chunk (history 512) beside 63 decode rows of ctx 1024.
    N, K, H = size((9, 3, 64), (4, 2, 16))
    B, ctx, chunk = size((64, 1024, 512), (3, 48, 16))
    q1, kp, vp, table = _paged_inputs(key, B, ctx, N, K, H, 16, bf16)
    T = chunk + B - 1
    qp = jax.random.normal(jax.random.key(5), (T, N, H), bf16)
    q_start = jnp.concatenate([jnp.zeros(1, jnp.int32), chunk + jnp.arange(B - 1, dtype=jnp.int32)])
    q_len = jnp.concatenate([jnp.full(1, chunk, jnp.int32), jnp.ones(B - 1, jnp.int32)])
    kv_len = jnp.full((B,), ctx, jnp.int32)
    add(f"ragged_paged packed 1x{chunk}-chunk + {B-1} decode ctx={ctx} bf16",
        jax.jit(lambda *a: rpa.ragged_paged_attention_kernel(*a, keys_transposed=True, **I_)),
        jax.jit(lambda *a: rpa.ragged_paged_attention_reference(*a, keys_transposed=True)),
        (qp, kp, vp, table, q_start, q_len, kv_len), bytes_moved=2 * B * ctx * K * H * 2,
        flops=4 * (chunk * (ctx - chunk / 2) + (B - 1) * ctx) * N * H)
    # Quantized matmuls on an 8B MLP shape (I 4096 -> O 14336) and SmolLM2's (576 -> 1536).
    for I, O in size([(4096, 14336), (576, 1536)], [(256, 256)]):
        kw = jax.random.split(jax.random.key(7), 4)
        w8 = jax.random.randint(kw[0], (I, O), -127, 128, jnp.int8)
        ws = jax.random.uniform(kw[1], (O,), jnp.float32, 1e-3, 1e-2)
        g = 128 if I % 128 == 0 else 64
        w4 = qm.pack_int4(jax.random.randint(kw[2], (I, O), -8, 8, jnp.int8), g)
        ws4 = jax.random.uniform(kw[3], (I // g, O), jnp.float32, 1e-3, 1e-2)
        for M in size((1, 16, 256), (1, 16)):
            x = jax.random.normal(jax.random.key(M), (M, I), bf16)
            add(f"weight_only int8 M={M} {I}x{O}", jax.jit(lambda *a: qm.weight_only_matmul_kernel(*a, **I_)),
                jax.jit(qm.weight_only_matmul_reference), (x, w8, ws),
                bytes_moved=I * O + 2 * M * (I + O), flops=2 * M * I * O)
            add(f"weight_only int4 M={M} {I}x{O}", jax.jit(lambda *a: qm.weight_only_matmul_kernel(*a, **I_)),
                jax.jit(qm.weight_only_matmul_reference), (x, w4, ws4),
                bytes_moved=I * O // 2 + 2 * M * (I + O), flops=2 * M * I * O)
        for M in size((1, 256, 4096), (1, 32)):
            xq, xs = qm.quantize_rows(jax.random.normal(jax.random.key(M + 1), (M, I), jnp.float32))
            add(f"w8a8 int8_matmul M={M} {I}x{O}", jax.jit(lambda *a: qm.int8_matmul_kernel(*a, **I_)),
                jax.jit(qm.int8_matmul_reference), (xq, xs, w8, ws),
                bytes_moved=I * O + M * (I + 4 * O), flops=2 * M * I * O)
    return rows


# ----------------------------------------------------------------------------- engine
SMOLLM2 = dict(layers=30, d=576, heads=9, kv_heads=3, ff=1536, context=2048)


@section("engine")
def engine(bw: float, out_dir: Path, budget_end: float):
    import jax
    import numpy as np

    from jaxinfer import LLM, SamplingParams
    from tests.tiny_gguf import write_tiny_llama

    path = out_dir.parent / "smollm2-shaped-random.gguf"
    if not path.exists():
        dims = SMOLLM2 if not DRY else dict(SMOLLM2, layers=2, d=64, heads=4, kv_heads=2, ff=128)
        write_tiny_llama(path, ROOT / ".gpu" / "tokenizer-smollm2.gguf", **dims, seed=1)
    res = {}
    t = time.perf_counter()
    # No prefix caching: the timed run repeats the warm-up's prompts, and cache hits would give
    # it step shapes the warm-up never compiled (seen on the H100: a 50 s batch-64 run).
    # one engine per kernel choice ("pallas": interpret mode in a dry run on CPU)
    llms = {mode: LLM(str(path), dtype="bfloat16", max_model_len=2048, max_num_seqs=64, progress=False,
                      kv_cache_memory_bytes=2 << 30, enable_prefix_caching=False, kernels=mode) for mode in ("pallas", "xla")}
    llm = llms["pallas"]
    res["load_s"] = (time.perf_counter() - t) / 2
    nparams = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(llm.weights))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.weights))
    res["params"], res["weight_bytes"] = nparams, weight_bytes
    vocab = llm.cfg.vocab_size

    def run(batch, mode):
        new = size(128 if batch == 1 else 32, 8)
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        rng = np.random.default_rng(batch)  # the same prompts in both modes
        prompts = [rng.integers(100, vocab, 64).tolist() for _ in range(batch)]
        llm = llms[mode]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)  # compile the prefill and decode shapes
        llm.generate(prompts, sp, use_tqdm=False)
        prof = None
        if batch > 1 and mode == "pallas":  # where a step took 200 ms: whose time?
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        if prof is not None:
            import io
            import pstats
            prof.disable()
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(22)
                text = buf.getvalue()
                (out_dir / f"profile_b{batch}_{key}.txt").write_text(text)
                print(text[-6000:], flush=True)
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        steps = new - 1
        r = {"batch": batch, "mode": mode, "wall_s": wall,
             "decode_tok_s": batch * steps / (last - first), "step_ms": (last - first) / steps * 1e3}
        kv_bytes = 2 * batch * (64 + new // 2) * llm.cfg.n_layers * llm.cfg.n_kv_heads * llm.cfg.head_dim * 2
        r["MBU"] = (weight_bytes + kv_bytes) / (r["step_ms"] * 1e-3) / bw
        print(json.dumps(r), flush=True)
        return r, [o.outputs[0].token_ids for o in outs]

    rows, toks = [], {}
    on = "pallas"
    for batch in size((1, 64), (1, 3)):
        for mode in (on, "xla"):
            if elapsed() > budget_end:
                rows.append({"batch": batch, "mode": mode, "skipped": "out of time"})
                continue
            r, toks[(batch, mode)] = run(batch, mode)
            rows.append(r)
        a, b = toks.get((batch, on)), toks.get((batch, "xla"))
        if a and b:
            same = [x == y for x, y in zip(a, b)]
            first_diff = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(a, b)]
            res[f"batch{batch}_rows_equal"] = f"{sum(same)}/{len(same)}"
            res[f"batch{batch}_first_diff"] = [d for d in first_diff if d is not None][:16]
    res["runs"] = rows
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check"))
    ap.add_argument("--budget", type=float, default=420, help="seconds for the whole run")
    ap.add_argument("--skip", nargs="*", default=[], help="sections to leave out")
    ap.add_argument("--dry", action="store_true",
                    help="check the script on CPU: toy sizes, GPU variants in interpret mode, no tests")
    args = ap.parse_args()
    if args.dry:
        global DRY
        from pallas_kernels import _common

        DRY = True
        _common.kernel_target = lambda platform=None: "gpu"  # every kernel asks _common which variant runs
        args.skip += ["tests", "wide"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env()
    if "ceilings" not in args.skip:
        ceilings()
    bw = RESULTS.get("ceilings", {}).get("copy_GBps", 3000.0) * 1e9
    # Each section starts no new work past its share of the budget (the engine's last run may
    # go on a while past 0.88; the wide grids get what is left).
    if "spec_verify" not in args.skip:
        spec_verify_bench(bw, budget_end=0.2 * args.budget)
    if "tests" not in args.skip:
        timeout = max(30, min(0.2 * args.budget, 0.4 * args.budget - elapsed()))
        section("tests")(pytest_kernels)([], timeout=timeout, log=out / "tests.log")
    if "kernels" not in args.skip:
        kernels_bench(bw, budget_end=0.65 * args.budget)
    if "engine" not in args.skip:
        engine(bw, out, budget_end=0.88 * args.budget)
    if "wide" not in args.skip and elapsed() < 0.88 * args.budget:
        section("wide")(pytest_kernels)(["-m", "slow"], timeout=max(10, args.budget - elapsed() - 10),
                                        log=out / "wide.log")
    RESULTS["total_s"] = round(elapsed(), 1)
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print("\n=== summary")
    for k in ("env", "ceilings"):
        print(k, json.dumps(RESULTS.get(k)))
    for k in ("tests", "wide"):
        if k in RESULTS:
            print(k, RESULTS[k].get("summary", RESULTS[k]), RESULTS[k].get("failed", ""))
    for k in ("spec_verify", "kernels"):
        for r in RESULTS.get(k, []) if isinstance(RESULTS.get(k), list) else [RESULTS.get(k)]:
            print(json.dumps(r, default=lambda x: round(x, 4)))
    print("engine", json.dumps(RESULTS.get("engine"), default=str)[:3000])
    print("sections", RESULTS.get("section_seconds"), "total", RESULTS["total_s"])


if __name__ == "__main__":
    main()
