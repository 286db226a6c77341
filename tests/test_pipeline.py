"""Pipeline parallelism through LLM on 8 virtual CPU devices (each check in a subprocess, so
XLA_FLAGS apply): greedy tokens equal one device's token for token, prompt and sampled-token
logprobs within float32 tolerance; each stage's devices hold only their own layers' weights and
pages; the compiled step moves nothing across stages but activations, by collective-permute.
Bad sizes get one clear error (exit 2 on the CLI)."""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxinfer import LLM
from jaxinfer.errors import InvalidRequest

# float32: a pipeline computes the same sums as one device except that a decode row meets its
# own new key as a separate block of the running softmax, and TP splits head/MLP sums
ATOL = 2e-4

_COMMON = textwrap.dedent("""
    import gc, re, sys
    import jax, numpy as np
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine.pipeline import micro_batches
    from tests.hlo_collectives import collectives

    assert len(jax.devices()) == 8
    path, layouts, atol = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3])
    check_hlo = "hlo" in sys.argv[4:]
    kv_dtype = "int8" if "int8" in sys.argv[4:] else "auto"
    # "pallas": the pipelines under kernels="pallas", whose pools keep keys [P, K, ps, H] as on a
    # TPU (the stages' deferred writes and XLA readers take them); one device stays the CPU's
    kernels = "pallas" if "pallas" in sys.argv[4:] else "auto"
    # "ngram": the pipelines verify n-gram drafts (the one engine step with a draft block); the
    # reference stays one device's plain decoding
    spec = {"method": "ngram", "num_speculative_tokens": 2} if "ngram" in sys.argv[4:] else None
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time there was", "1, 2, 3, 4,"]
    ref = None

    def first_lp(entries):
        return [next(iter(d.values())).logprob for d in entries]

    for layout in layouts:
        pp, tp = (int(x) for x in layout.split("x"))
        llm = LLM(path, progress=False, max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=64 << 20,
                  kv_cache_dtype=kv_dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  kernels=kernels if pp > 1 else "auto", speculative_config=spec if pp > 1 else None)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        toks = [o.outputs[0].token_ids for o in outs]
        lps = [first_lp(o.outputs[0].logprobs) for o in outs]
        plps = [first_lp(o.prompt_logprobs[1:]) for o in outs]
        if ref is None:
            ref = (toks, lps, plps)
            del llm, outs
            gc.collect()
            continue
        assert toks == ref[0], (layout, toks, ref[0])
        for got, want in zip(lps + plps, ref[1] + ref[2]):
            np.testing.assert_allclose(got, want, atol=atol)
        rep = llm.memory_report()["parallel"]
        e = llm.engine
        if spec is not None:
            assert e.spec_stats.drafted > 0, e.spec_stats  # some steps verified drafts
        ps = e.config.block_size
        assert e.keys_transposed == (kernels != "pallas")
        assert jax.tree.leaves(e.k_pages)[0].shape[-2:] == ((e.cfg.head_dim, ps) if e.keys_transposed
                                                              else (ps, e.cfg.head_dim))
        L = e.cfg.n_layers
        bounds = [b for b, _ in rep["stage_layers"]] + [L]
        assert rep["pipeline_parallel_size"] == pp and rep["tensor_parallel_size"] == tp, rep
        assert sum(rep["layers_per_stage"]) == L and max(rep["layers_per_stage"]) - min(rep["layers_per_stage"]) <= 1
        # each stage's devices hold only their own layers: block s of every stacked weight and pool
        stage_of = {d.id: s for s in range(pp) for d in e.mesh.devices[:, s, :].reshape(-1)}
        for leaf in jax.tree.leaves(e.weights["layers"]) + jax.tree.leaves((e.k_pages, e.v_pages)):
            assert leaf.shape[0] == pp, leaf.shape
            for sh in leaf.addressable_shards:
                assert sh.index[0] == slice(stage_of[sh.device.id], stage_of[sh.device.id] + 1), (sh.device, sh.index)
        for leaf in jax.tree.leaves({k: v for k, v in e.weights.items() if k != "layers"}):
            assert {d.id for d in leaf.sharding.device_set} == set(stage_of)
        old = jax.tree.leaves(e.k_pages)[0]
        e.run_step(e.idle_batch(4, 8, 0))
        assert old.is_deleted()  # the stacked pools are donated to the pipelined step
        if check_hlo:  # a step with decode rows and a prefill row: 2 decode micro-batches + 1
            batch = e.idle_batch(4, 8, 32)
            from jaxinfer.engine.step import StepInputs
            txt = e._step.lower(e.weights, StepInputs(batch), e.state, cfg=e.cfg, num_logprobs=-1,
                                prompt_logprobs=-1, kernels=e.kernels).compile().as_text()
            ids = [d.id for d in e.mesh.devices.reshape(-1)]
            cross = []
            for op, shape, groups, line in collectives(txt, len(ids)):
                spans = any(len({stage_of[ids[i]] for i in g}) > 1 for g in groups)
                if spans:
                    assert op == "collective-permute", line  # nothing but activations cross stages
                    cross.append(shape)
                if op == "all-gather":  # within a stage too, no weight is ever gathered
                    assert np.prod(shape) < 4 * e.cfg.d_model * 64, line
            M = len(micro_batches(batch, pp))
            assert len(cross) == (M + pp - 2) + (pp - 1), (len(cross), cross)  # ticks - 1, then the broadcast
            assert all(s[-1] == e.cfg.d_model for s in cross), cross  # [tokens, D] activations only
        print("layout", layout, rep["stage_layers"], "max |dlogprob|",
              max(np.abs(np.array(a) - np.array(b)).max() for a, b in zip(lps + plps, ref[1] + ref[2])))
        del llm, outs, e
        gc.collect()
    print("ok")
""")


def _run(path, layouts: str, *extra, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _COMMON, str(path), layouts, str(ATOL), *extra], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=root)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stdout.strip().endswith("ok")
    return p.stdout


@pytest.fixture(scope="module")
def tiny_deep(tmp_path_factory, smollm2_gguf):
    """Tiny random Llamas deep enough for uneven splits: 5 layers (PP 2: 3 + 2) and 7 layers
    (PP 4: 2 + 2 + 2 + 1)."""
    from tests.tiny_gguf import write_tiny_llama

    out = {}
    for layers in (5, 7):
        path = tmp_path_factory.mktemp("tiny_pp") / f"tiny-{layers}.gguf"
        write_tiny_llama(path, smollm2_gguf, layers=layers, d=64, heads=4, kv_heads=2, ff=128, context=512)
        out[layers] = path
    return out


@pytest.mark.slow
def test_tiny_tp2_x_pp2_uneven_equals_one_device(tiny_deep):
    out = _run(tiny_deep[5], "1x1,2x2", "hlo")
    assert "[[0, 3], [3, 5]]" in out


@pytest.mark.slow
def test_tiny_pipeline_2_verifying_ngram_drafts_equals_one_device(tiny_deep):
    """Speculation under pipeline stages: the verification step is the pipelined step with a
    draft block, so its greedy tokens are one device's plain ones."""
    _run(tiny_deep[5], "1x1,2x1", "ngram")


@pytest.mark.slow
def test_tiny_pipeline_4_uneven_equal_one_device(tiny_deep):
    out = _run(tiny_deep[7], "1x1,4x1", "hlo")
    assert "[[0, 2], [2, 4], [4, 6], [6, 7]]" in out


def test_tiny_pipeline_2_over_untransposed_keys_equals_one_device(tiny_deep):
    """Pools whose keys are [P, K, ps, H] (a TPU's layout, here under kernels="pallas"): the
    stages write and read them as one device reads the CPU's transposed keys."""
    _run(tiny_deep[5], "1x1,2x1", "pallas")


def test_tiny_pipeline_2_with_int8_kv_equals_one_device_int8(tiny_deep):
    """int8 page pools (values and scales) stacked by stage; a decode row's own new key is
    read back as the pool would store it."""
    _run(tiny_deep[5], "1x1,2x1", "int8")


@pytest.mark.slow
def test_smollm2_pipeline_2_and_tp3_x_pp2_equal_one_device(smollm2_gguf):
    """30 layers over 2 stages; with TP 3 inside each stage (9 query heads, 3 KV heads)."""
    out = _run(smollm2_gguf, "1x1,2x1,2x3", "hlo")
    assert "[[0, 15], [15, 30]]" in out


@pytest.mark.slow
def test_gemma3_pipeline_2_equals_one_device(gemma3_gguf):
    """18 layers, LOCAL and GLOBAL ones mixed within each stage, windowed pools per stage."""
    out = _run(gemma3_gguf, "1x1,2x1", "hlo")
    assert "[[0, 9], [9, 18]]" in out


_BAD = textwrap.dedent("""
    import sys
    import jax
    from jaxinfer import LLM
    from jaxinfer.cli import main
    from jaxinfer.errors import InvalidRequest
    from jaxinfer.sharding import make_mesh

    path = sys.argv[1]  # 2 layers
    cases = [
        (dict(pipeline_parallel_size=3), "pipeline_parallel_size=3 is larger than the model's 2 layers"),
        (dict(pipeline_parallel_size=2, tensor_parallel_size=8), "needs 16 devices; 8 available"),
        (dict(pipeline_parallel_size=4, mesh=make_mesh(stage=2, model=4)),
         "pipeline_parallel_size=4 does not match the mesh's stage axis of 2"),
        (dict(pipeline_parallel_size=2, tensor_parallel_size=2, mesh=make_mesh(stage=2, model=4)),
         "tensor_parallel_size=2 does not match the mesh's model axis of 4"),
        (dict(pipeline_parallel_size=2, speculative_config={"method": "early_exit", "num_speculative_tokens": 2,
                                                            "num_layers": 1}),
         "early_exit is not supported with pipeline_parallel_size > 1"),
    ]
    for kw, msg in cases:
        try:
            LLM(path, progress=False, **kw)
        except InvalidRequest as e:
            assert msg in str(e), (kw, str(e))
        else:
            raise AssertionError(f"{kw} was accepted")
    assert main(["generate", "--model", path, "--prompt", "x", "--pipeline-parallel-size", "4"]) == 2
    print("ok")
""")


def test_bad_pipeline_configs_are_one_clear_error(tiny_gguf):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    p = subprocess.run([sys.executable, "-c", _BAD, str(tiny_gguf)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stdout.strip().endswith("ok")
    assert "larger than the model's 2 layers" in p.stderr  # the CLI's one line


def test_more_devices_than_exist_is_one_clear_error(tiny_gguf):
    import jax

    n = len(jax.devices())
    with pytest.raises(InvalidRequest, match=f"needs {2 * n} devices; {n} available"):
        LLM(str(tiny_gguf), progress=False, pipeline_parallel_size=2 * n)


def test_cli_pipeline_size_beyond_devices_exits_2(tiny_gguf, capsys):
    from jaxinfer.cli import main

    assert main(["generate", "--model", str(tiny_gguf), "--prompt", "x", "--pipeline-parallel-size", "64"]) == 2
    assert "needs 64 devices" in capsys.readouterr().err


def test_stage_bounds_and_pool_slots():
    from jaxinfer.engine.pipeline import PipelineLayout
    from jaxinfer.sharding import stage_bounds

    assert stage_bounds(30, 4) == (0, 8, 16, 23, 30)
    assert stage_bounds(5, 2) == (0, 3, 5) and stage_bounds(4, 4) == (0, 1, 2, 3, 4)
    with pytest.raises(InvalidRequest, match="pipeline_parallel_size=5 is larger than the model's 4 layers"):
        stage_bounds(4, 5)
    # Gemma 3 270M's pattern (GLOBAL: 5, 11, 17) over 2 stages: one stacked slot list per pool kind
    windowed = tuple((i + 1) % 6 != 0 for i in range(18))
    lay = PipelineLayout(None, stage_bounds(18, 2), windowed)
    assert (lay.slots, lay.full_slots, lay.window_slots) == (9, 2, 8)
    assert [lay.pool_slot(i) for i in (5, 11, 17)] == [0, 0, 1]
    assert [lay.pool_slot(i) for i in (0, 8, 9, 16)] == [2, 9, 2, 8]
    assert lay.report()["padding_layer_slots"] == [0, 0]


@pytest.mark.parametrize("window,keys_transposed", [(None, True), (3, True), (3, False)])
def test_rows_attention_with_own_new_keys_equals_dense_reference(window, keys_transposed):
    """The pipeline's decode attention (pages hold each row's positions before its query; the
    query's own key and value come beside them) against the dense reference attention. The
    pages the rows do not own, and the query's own slot in its page, hold NaN. Keys pools of
    either layout ([P, K, H, ps] transposed, or [P, K, ps, H])."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.layers import attention
    from jaxinfer.models.packed import paged_rows_attention

    B, K, G, H, ps, per_row = 3, 2, 2, 8, 4, 4
    N, S = K * G, ps * per_row
    lengths = np.array([1, 7, 16])  # the query sits at position length - 1
    r = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(r[0], (B, 1, N, H))
    keys = jax.random.normal(r[1], (B, S, K, H))
    vals = jax.random.normal(r[2], (B, S, K, H))
    table = 1 + np.arange(B * per_row).reshape(B, per_row)  # page 0: scratch
    kpool = np.full((1 + B * per_row, K, H, ps), np.nan, np.float32)
    vpool = np.full((1 + B * per_row, K, ps, H), np.nan, np.float32)
    for b in range(B):
        for t in range(lengths[b] - 1):  # every earlier position written; the query's own is not
            kpool[table[b, t // ps], :, :, t % ps] = keys[b, t]
            vpool[table[b, t // ps], :, t % ps, :] = vals[b, t]
    pos = jnp.asarray(lengths - 1)[:, None]
    own = (keys[jnp.arange(B), lengths - 1][:, None], vals[jnp.arange(B), lengths - 1][:, None])
    if not keys_transposed:
        kpool = kpool.swapaxes(-1, -2)
    got = paged_rows_attention(q, jnp.asarray(kpool), jnp.asarray(vpool), jnp.asarray(table), None, pos, pos[:, 0],
                               scale=H**-0.5, window=window, own=own, keys_transposed=keys_transposed)
    seen = np.arange(S)[None] < lengths[:, None]
    kpos = np.where(seen, np.arange(S)[None], 1 << 30)
    dense_k = jnp.where(seen[:, :, None, None], keys, 0.0).transpose(0, 2, 3, 1)
    dense_v = jnp.where(seen[:, :, None, None], vals, 0.0).transpose(0, 2, 1, 3)
    want = attention(q, dense_k, dense_v, pos, jnp.asarray(kpos), scale=H**-0.5, window=window)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_verification_rows_own_new_keys_skip_their_padding_queries():
    """A verification row's queries under the pipeline's deferred writes: its last token and
    drafts at consecutive positions, then padding queries that repeat the last real position
    (their keys bound for the scratch page). Each real query sees the pages and the real own
    keys up to its own, never a padding query's key at its position: equal to the dense
    reference over the real keys. Unowned pages hold NaN."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.layers import attention
    from jaxinfer.models.packed import paged_rows_attention

    B, T, K, G, H, ps, per_row = 2, 3, 2, 2, 8, 4, 4
    N, S = K * G, ps * per_row
    history, real = np.array([5, 9]), np.array([2, 3])  # positions in the pages; real queries (of T)
    r = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(r[0], (B, T, N, H))
    keys = jax.random.normal(r[1], (B, S, K, H))
    vals = jax.random.normal(r[2], (B, S, K, H))
    table = 1 + np.arange(B * per_row).reshape(B, per_row)
    kpool = np.full((1 + B * per_row, K, H, ps), np.nan, np.float32)
    vpool = np.full((1 + B * per_row, K, ps, H), np.nan, np.float32)
    for b in range(B):
        for t in range(history[b]):
            kpool[table[b, t // ps], :, :, t % ps] = keys[b, t]
            vpool[table[b, t // ps], :, t % ps, :] = vals[b, t]
    pos = np.minimum(history[:, None] + np.arange(T)[None], (history + real - 1)[:, None])
    at = jnp.asarray(pos)
    junk = jax.random.normal(r[3], (2, B, T, K, H))  # what a padding query's key and value are
    pad = (np.arange(T)[None] >= real[:, None])[:, :, None, None]
    own = tuple(jnp.where(pad, j, a[jnp.arange(B)[:, None], at]) for j, a in zip(junk, (keys, vals)))
    got = paged_rows_attention(q, jnp.asarray(kpool), jnp.asarray(vpool), jnp.asarray(table), None, at, at[:, 0],
                               scale=H**-0.5, own=own)
    seen = np.arange(S)[None] < (history + real)[:, None]
    kpos = np.where(seen, np.arange(S)[None], 1 << 30)
    dense_k = jnp.where(seen[:, :, None, None], keys, 0.0).transpose(0, 2, 3, 1)
    dense_v = jnp.where(seen[:, :, None, None], vals, 0.0).transpose(0, 2, 1, 3)
    want = attention(q, dense_k, dense_v, at, jnp.asarray(kpos), scale=H**-0.5)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(got[b, : real[b]]), np.asarray(want[b, : real[b]]), rtol=1e-5,
                                   atol=1e-5)
