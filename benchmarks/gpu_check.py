"""The Pallas kernels and the engine on a real GPU: compiled (not interpreted), checked against
their references, timed, and set against the card's measured copy bandwidth (MBU) and matmul
rate. Written for a lent H100 through the device tool, in one short call:

    XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda,cpu \\
        python benchmarks/gpu_check.py --out $OUT --budget 420

Prepare on this machine first (both go in `.gpu/`, which git ignores; name it in the device
call's carry, and install the wheel there with pip --no-index --target):
  the gguf wheel (the device image lacks it): pip download --no-deps --only-binary=:all:
      --python-version 3.12 --platform manylinux2014_x86_64 -d .gpu gguf==0.19.0
  SmolLM2's tokenizer in a 3 MB GGUF (the real checkpoint is over the 64 MB a call carries):
      python -c "from tests.tiny_gguf import write_tiny_llama; from jaxinfer import registry;
      write_tiny_llama('.gpu/tokenizer-smollm2.gguf', registry.fetch('smollm2-135m-instruct'),
      layers=1, d=8, heads=2, kv_heads=1, ff=8, context=2048)"

Sections, each in its own try block so one failure does not hide the rest, in this order:
  env        jax version, device, driver
  ceilings   device-to-device copy bandwidth (bytes read + written) and a bf16 matmul's rate
  tests      the kernel-grid tests compiled for the GPU (JAXINFER_NATIVE_KERNELS=1, -k gpu)
  kernels    each kernel against its pure-JAX reference (XLA on the same GPU) at serving
             shapes: median time, bytes it must move, MBU = bytes / time / copy bandwidth
  engine     LLM.generate on a SmolLM2-shaped model (random weights, SmolLM2's real
             tokenizer), bfloat16: batch 1 and 64, Pallas kernels on and off (same tokens?)
  wide       the slow (wide) kernel grids, with what time is left

Timing: device work is asynchronous, so each timed region issues the call --calls times and
blocks on the last; the median of --repeats such regions over the call count is one call's
time. Inputs are random normal, never zeros. Everything is written to OUT/gpu_check.json and
the summary table is printed last.
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
    return {"copy_GBps": bw / 1e9, "bf16_matmul_TFLOPs": 2 * m**3 / tm / 1e12,
            "int8_matmul_TOPs": 2 * m**3 / ti / 1e12}


def pytest_kernels(extra: list[str], timeout: float, log: Path):
    env = dict(os.environ, JAXINFER_NATIVE_KERNELS="1", JAX_PLATFORMS="cuda,cpu")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "gpu", "-rfE",
           "tests/test_kernels_flash_attention.py", "tests/test_kernels_paged_attention.py",
           "tests/test_kernels_ragged_paged_attention.py", "tests/test_kernels_quant_matmul.py", *extra]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    log.write_text(out)
    tail = out.strip().splitlines()[-25:]
    print("\n".join(tail), flush=True)
    return {"rc": rc, "summary": tail[-1] if tail else "", "failed": [l for l in out.splitlines() if l.startswith("FAILED")][:20]}


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

    from pallas_kernels import flash_attention as fa
    from pallas_kernels import paged_attention as pa
    from pallas_kernels import quant_matmul as qm
    from pallas_kernels import ragged_paged_attention as rpa
    from pallas_kernels import spec_verify as sv

    rows = []

    def add(name, kern, ref, args, bytes_moved=None, flops=None, calls=20):
        if elapsed() > budget_end:
            rows.append({"name": name, "skipped": "out of time"})
            return
        r = {"name": name}
        try:
            out = jax.block_until_ready(kern(*args))
            with jax.default_matmul_precision("highest"):
                want = jax.block_until_ready(ref(*args))
            r["rel_err"] = rel_err(out, want)
            r["kernel_us"] = timed(kern, *args, calls=calls) * 1e6
            r["xla_ref_us"] = timed(ref, *args, calls=calls) * 1e6
            if bytes_moved:
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
        rows.append(r)

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
        add(f"paged_attention B={B} ctx={ctx} N/K/H={N}/{K}/{H} bf16",
            jax.jit(lambda *a: pa.paged_attention_kernel(*a, **opts, **I_)),
            jax.jit(lambda *a: pa.paged_attention_reference(*a, **opts)),
            (q, kp, vp, table, lengths), bytes_moved=kv_bytes)
        # the same rows through the ragged kernel: one decode query per segment
        S = jnp.arange(B, dtype=jnp.int32)
        add(f"ragged_paged decode B={B} ctx={ctx} N/K/H={N}/{K}/{H} bf16",
            jax.jit(lambda *a: rpa.ragged_paged_attention_kernel(*a, **opts, **I_)),
            jax.jit(lambda *a: rpa.ragged_paged_attention_reference(*a, **opts)),
            (q, kp, vp, table, S, jnp.ones((B,), jnp.int32), lengths), bytes_moved=kv_bytes)
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
    # Flash prefill: 4096 causal tokens, Llama-3-8B heads.
    for T, (N, K, H) in size([(4096, (32, 8, 128)), (2048, (9, 3, 64))], [(32, (4, 2, 16))]):
        ks = jax.random.split(jax.random.key(6), 3)
        q = jax.random.normal(ks[0], (1, T, N, H), bf16)
        k = jax.random.normal(ks[1], (1, T, K, H), bf16)
        v = jax.random.normal(ks[2], (1, T, K, H), bf16)
        add(f"flash_attention causal T={T} N/K/H={N}/{K}/{H} bf16",
            jax.jit(lambda q, k, v: fa.flash_attention_kernel(q, k, v, **I_)),
            jax.jit(lambda q, k, v: fa.flash_attention_reference(q, k, v)),
            (q, k, v), flops=4 * T * T / 2 * N * H, calls=5)
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
    # Speculative verification has no Triton variant: its reference (XLA) on the GPU.
    Bv, k, V = size((64, 4, 49152), (2, 2, 2048))
    z = jax.random.normal(jax.random.key(8), (Bv, k + 1, V), jnp.float32) * 3
    thr = jnp.full((Bv, k + 1), -jnp.inf, jnp.float32)
    drafts = jnp.argmax(z[:, :k], -1).astype(jnp.int32)
    u = jax.random.uniform(jax.random.key(9), (Bv, k + 1, 3))
    f = jax.jit(lambda *a: sv.spec_verify_reference(*a))
    args = (z, thr, drafts, jnp.full((Bv,), k, jnp.int32), u, jnp.zeros((Bv,), bool))
    if elapsed() < budget_end:
        try:
            t = timed(f, *args)
            rows.append({"name": f"spec_verify reference B={Bv} k={k} V={V} sampled", "xla_ref_us": t * 1e6,
                         "ref_MBU": Bv * (k + 1) * V * 4 / t / bw})
        except Exception as e:
            rows.append({"name": "spec_verify reference", "error": f"{type(e).__name__}: {e}"[:600]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ----------------------------------------------------------------------------- engine
SMOLLM2 = dict(layers=30, d=576, heads=9, kv_heads=3, ff=1536, context=2048)


@section("engine")
def engine(bw: float, out_dir: Path, budget_end: float):
    import jax
    import numpy as np

    from jaxinfer import LLM, SamplingParams, kernels
    from tests.tiny_gguf import write_tiny_llama

    path = out_dir.parent / "smollm2-shaped-random.gguf"
    if not path.exists():
        dims = SMOLLM2 if not DRY else dict(SMOLLM2, layers=2, d=64, heads=4, kv_heads=2, ff=128)
        write_tiny_llama(path, ROOT / ".gpu" / "tokenizer-smollm2.gguf", **dims, seed=1)
    res = {}
    t = time.perf_counter()
    # No prefix caching: the timed run repeats the warm-up's prompts, and cache hits would give
    # it step shapes the warm-up never compiled (seen on the H100: a 50 s batch-64 run).
    llm = LLM(str(path), dtype="bfloat16", max_model_len=2048, max_num_seqs=64, progress=False,
              kv_cache_bytes=4 << 30, enable_prefix_caching=False)
    res["load_s"] = time.perf_counter() - t
    nparams = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(llm.weights))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.weights))
    res["params"], res["weight_bytes"] = nparams, weight_bytes
    vocab = llm.cfg.vocab_size

    def run(batch, mode):
        new = size(128 if batch == 1 else 32, 8)
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        rng = np.random.default_rng(batch)  # the same prompts in both modes
        prompts = [rng.integers(100, vocab, 64).tolist() for _ in range(batch)]
        with kernels.traced_with(mode):
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)  # compile the prefill and decode shapes
            llm.generate(prompts, sp, use_tqdm=False)
            prof = None
            if batch > 1 and mode != kernels.KernelMode.OFF:  # where a step took 200 ms: whose time?
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
        r = {"batch": batch, "mode": mode.value, "wall_s": wall,
             "decode_tok_s": batch * steps / (last - first), "step_ms": (last - first) / steps * 1e3}
        kv_bytes = 2 * batch * (64 + new // 2) * llm.cfg.n_layers * llm.cfg.n_kv_heads * llm.cfg.head_dim * 2
        r["MBU"] = (weight_bytes + kv_bytes) / (r["step_ms"] * 1e-3) / bw
        print(json.dumps(r), flush=True)
        return r, [o.outputs[0].token_ids for o in outs]

    rows, toks = [], {}
    on = kernels.KernelMode.INTERPRET if DRY else kernels.KernelMode.NATIVE
    for batch in size((1, 64), (1, 3)):
        for mode in (on, kernels.KernelMode.OFF):
            if elapsed() > budget_end:
                rows.append({"batch": batch, "mode": mode.value, "skipped": "out of time"})
                continue
            r, toks[(batch, mode)] = run(batch, mode)
            rows.append(r)
        a, b = toks.get((batch, on)), toks.get((batch, kernels.KernelMode.OFF))
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
        from pallas_kernels.ragged_paged_attention import kernel as rk

        DRY = True
        _common.kernel_target = rk.kernel_target = lambda: "gpu"
        args.skip += ["tests", "wide"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env()
    if "ceilings" not in args.skip:
        ceilings()
    bw = RESULTS.get("ceilings", {}).get("copy_GBps", 3000.0) * 1e9
    if "tests" not in args.skip:
        section("tests")(pytest_kernels)([], timeout=max(30, 0.25 * args.budget), log=out / "tests.log")
    if "kernels" not in args.skip:
        kernels_bench(bw, budget_end=0.55 * args.budget)
    if "engine" not in args.skip:
        engine(bw, out, budget_end=0.85 * args.budget)
    if "wide" not in args.skip and elapsed() < 0.85 * args.budget:
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
    for r in RESULTS.get("kernels", []) if isinstance(RESULTS.get("kernels"), list) else [RESULTS.get("kernels")]:
        print(json.dumps(r, default=lambda x: round(x, 4)))
    print("engine", json.dumps(RESULTS.get("engine"), default=str)[:3000])
    print("sections", RESULTS.get("section_seconds"), "total", RESULTS["total_s"])


if __name__ == "__main__":
    main()
