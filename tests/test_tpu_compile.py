"""Compiled for a TPU from this host (libtpu's topologies; nothing runs): every Pallas kernel
lowers through Mosaic at the shapes the engine gives it, and the engine's packed step compiles
with its kernels into a program that reads and writes the page pools in place.

interpret mode checks none of Mosaic's rules (tiling, VMEM, layouts); these tests do. Under
CI=true a missing libtpu fails them instead of skipping (the ``tpu`` extra installs it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer import aot
from jaxinfer.config import ModelConfig, RopeConfig, RopeKind

ROOT = Path(__file__).resolve().parents[1]

if not aot.libtpu_available():
    if os.environ.get("CI") == "true":
        pytest.fail("libtpu is missing: .ci/run installs the tpu extra (pip install -e '.[tpu]')",
                    pytrace=False)
    pytest.skip("libtpu is not installed (pip install -e '.[tpu]')", allow_module_level=True)

TINY = ModelConfig(family="llama", vocab_size=2048, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=128, d_ff=512, norm_eps=1e-5, rope=RopeConfig(theta=10000.0, kind=RopeKind.DEFAULT),
                   max_position=4096, tie_embeddings=False, dtype="bfloat16", name="llama-tiny")


def _on(mesh, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def _kernel_cases():
    """(name, the kernel's TPU variant, its abstract arguments) at the engine's shapes:
    bf16 pools of 16-token pages and heads of 128, int8 weights of the quantized matmuls."""
    from pallas_kernels.grouped_matmul.kernel import grouped_matmul_tpu
    from pallas_kernels.lora import lora_delta_kernel
    from pallas_kernels.paged_attention.kernel import paged_attention_tpu
    from pallas_kernels.quant_matmul.kernel import int8_matmul_tpu, weight_only_matmul_tpu
    from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention_tpu
    from pallas_kernels.spec_verify.common import BlockSizes as VerifyBlocks
    from pallas_kernels.spec_verify.kernel import _VARIANTS as VERIFY

    bf, i32 = jnp.bfloat16, jnp.int32
    B, N, K, H, P, ps, W = 8, 8, 2, 128, 64, 16, 4
    pool = ((P, K, ps, H), bf)
    attn = dict(scale=None, window=None, softcap=None, keys_transposed=False, block_sizes=None, interpret=False,
                sinks=None)
    return {
        "paged_attention": (lambda *a: paged_attention_tpu(*a, **attn),
                            [((B, N, H), bf), pool, pool, ((B, W), i32), ((B,), i32)]),
        "ragged_paged_attention": (lambda *a: ragged_paged_attention_tpu(*a, **attn),
                                   [((64, N, H), bf), pool, pool, ((4, W), i32), ((4,), i32), ((4,), i32),
                                    ((4,), i32)]),
        "int8_matmul": (int8_matmul_tpu, [((64, 512), jnp.int8), ((64,), jnp.float32), ((512, 256), jnp.int8),
                                          ((256,), jnp.float32)]),
        "weight_only_matmul": (weight_only_matmul_tpu, [((64, 512), bf), ((512, 256), jnp.int8),
                                                        ((256,), jnp.float32)]),
        # a 70B LM head over 8 chips: no multiple of 128 divides 16032 columns, so block_n is all
        # of them, and the contraction step must shrink to fit the chip's scoped VMEM
        "weight_only_matmul_lm_head": (weight_only_matmul_tpu, [((64, 8192), bf), ((8192, 16032), jnp.int8),
                                                                ((16032,), jnp.float32)]),
        "int8_matmul_lm_head": (int8_matmul_tpu, [((64, 8192), jnp.int8), ((64,), jnp.float32),
                                                  ((8192, 16032), jnp.int8), ((16032,), jnp.float32)]),
        "grouped_matmul": (grouped_matmul_tpu, [((128, 512), bf), ((4, 512, 256), bf), ((4,), i32)]),
        # gpt-oss-20b's down projection over 8 of its 32 experts a chip: no multiple of 128
        # divides 2880, and a whole-width block (33 MB double-buffered) overflowed scoped VMEM
        "grouped_matmul_2880": (grouped_matmul_tpu, [((256, 2880), bf), ((8, 2880, 2880), bf), ((8,), i32)]),
        # 64 rows over 4 active of 8 adapter slots of rank 16
        "lora_delta": (lora_delta_kernel, [((64, 512), bf), ((512, 8, 16), bf), ((8, 16, 512), bf), ((4,), i32),
                                           ((64,), i32)]),
        "spec_verify": (lambda *a: VERIFY["tpu"](*a, None, VerifyBlocks(), False),
                        [((B, 5, 1024), jnp.float32), ((B, 5), jnp.float32), ((B, 4), i32), ((B,), i32),
                         ((B, 5, 3), jnp.float32), ((B,), jnp.bool_)]),
    }


# v5e in the default run; v6e and v5p (the same kernels, other chips' tiling and VMEM) marked slow
@pytest.mark.parametrize("target", ["v5e-1", pytest.param("v6e-1", marks=pytest.mark.slow),
                                    pytest.param("v5p-8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kernel", list(_kernel_cases()))
def test_every_kernel_compiles_for_tpu(kernel, target):
    fn, shapes = _kernel_cases()[kernel]
    mesh = aot.target_mesh(target, model=1)
    args = [_on(mesh, s, d) for s, d in shapes]
    with jax.set_mesh(mesh):  # Mosaic reads the chip it lowers for from the mesh's devices
        compiled = jax.jit(fn).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()


_THRESHOLD_SHAPES = [(target, rows, vocab) for target in ("v5e-1", "v6e-1", "v5p-8") for rows in (8, 64, 256, 320)
                     for vocab in (128256, 262144)]
_THRESHOLD_DEFAULT = {("v5e-1", 256, 128256), ("v6e-1", 8, 262144)}


# two shapes in the default run (v5e at a 256-row decode step of Llama 3's vocabulary, v6e at
# Gemma 3's); every chip, row bucket and vocabulary marked slow
@pytest.mark.parametrize("target,rows,vocab", [s if s in _THRESHOLD_DEFAULT else pytest.param(*s, marks=pytest.mark.slow)
                                               for s in _THRESHOLD_SHAPES])
def test_the_sampler_threshold_kernels_compile_for_tpu(target, rows, vocab):
    """Both bisections (top-k count, top-p mass) lower through Mosaic with their row blocks in
    the chip's scoped VMEM (exp(z - m) stored or recomputed, by ``plan``)."""
    from pallas_kernels import sample_threshold as st

    mesh = aot.target_mesh(target, model=1)
    x, per_row = _on(mesh, (rows, vocab), jnp.float32), _on(mesh, (rows,), jnp.float32)
    k = _on(mesh, (rows,), jnp.int32)
    with jax.set_mesh(mesh):
        assert st.fits(rows, vocab)
        for fn, args in ((st.count_threshold_kernel, (x, per_row, k)),
                         (st.mass_threshold_kernel, (x, per_row, per_row, per_row))):
            compiled = jax.jit(fn).lower(*args).compile()
            assert "tpu_custom_call" in compiled.as_text()


# 8 KV heads and rows of 16k positions: each pool (128-256 MB) is larger than a chip's VMEM, as
# an engine's pools are, so XLA cannot stage a whole one there and every pool-sized copy is a relayout
WIDE = dataclasses.replace(TINY, n_heads=8, n_kv_heads=8)


def _step(kind: aot.StepKind, cfg=WIDE, target="v5e-1", kv_dtype="bfloat16", context=16384, model=1, **layout):
    mesh = aot.target_mesh(target, model=model)
    kernels = aot.target_kernels(mesh, "pallas")
    weights, _ = aot.abstract_weights(cfg, mesh, kernels)
    with jax.set_mesh(mesh):
        lowered, info = aot.lower_step(cfg, weights, mesh, kernels, kind, aot.Workload(context=context, kv_dtype=kv_dtype),
                                       **layout)
        compiled = lowered.compile()
    return dict(aot.analyse(compiled, info), pools=info["pools"]), compiled


def _family_config(hf: dict):
    from jaxinfer.loaders.hf import family_for

    return family_for(hf, "toy").config_from_hf(hf, dtype="bfloat16")


# toys of the pools whose minor dimension no multiple of 128 divides: gpt-oss's 64-wide heads
# (with its sinks, sliding window and experts) and DeepSeek-V3's 576-wide latent (512 + 64)
GPT_OSS_TOY = dict(architectures=["GptOssForCausalLM"], vocab_size=2048, hidden_size=256, intermediate_size=256,
                   num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                   num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"], attention_bias=True, rms_norm_eps=1e-5,
                   rope_theta=150000.0, max_position_embeddings=32768, swiglu_limit=7.0,
                   tie_word_embeddings=False, hidden_act="silu")
DEEPSEEK_TOY = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=2048, hidden_size=256,
                    intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5,
                    kv_lora_rank=512, q_lora_rank=256, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                    n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                    tie_word_embeddings=False, hidden_act="silu")


@pytest.mark.parametrize("name", ["gpt-oss", pytest.param("deepseek-v3", marks=pytest.mark.slow)])  # one default
def test_pools_of_narrow_heads_and_latents_are_padded_to_whole_tiles_on_tpu(name):
    """A pool whose minor dimension is 64 (gpt-oss's heads) or 576 (DeepSeek-V3's latent) fills
    its (8, 128) tiles only in part: stored so, XLA laid it out with the pages minor and copied
    it whole to row-major and back around each layer's write and read. On a TPU the pools pad
    that dimension to 128 and 640 (``dispatch.pool_lanes``): no pool is copied, and the donated
    pools come back aliased."""
    cfg = _family_config(GPT_OSS_TOY if name == "gpt-oss" else DEEPSEEK_TOY)
    rec, _ = _step(aot.StepKind("decode", rows=8), cfg=cfg)
    widths = {shape[-1] for leaves in rec["pools"] for shape, _ in leaves}
    assert rec["pool_copies"] == [], rec["pool_copies"]
    assert rec["alias_bytes"] >= rec["pool_bytes"], rec
    assert all(w % 128 == 0 for w in widths), widths


INT8_TP = dict(target="v5e-4", model=4, kv_dtype="int8", context=2048)


def test_int8_kv_scale_rows_fill_whole_tiles_under_tensor_parallelism():
    """int8 KV split over 4 chips, 2 KV heads each: a chip's part of the flat scale row [P, K *
    ps] is 32 wide, and XLA laid such pools out pages-minor and copied both scale pools a layer
    (4 copies). Each head's slots are padded to 64 on a TPU, a chip's row to 128: no copy."""
    rec, _ = _step(aot.StepKind("decode", rows=64), **INT8_TP)
    assert rec["pool_copies"] == [], rec["pool_copies"]
    assert rec["alias_bytes"] >= rec["pool_bytes"], rec
    # per chip: the values' head dim, and the scale row of 2 heads of 64 slots
    assert {s[-1] for leaves in rec["pools"] for s, _ in leaves} == {128}


@pytest.mark.slow  # three more compiles, of the layouts no longer used
@pytest.mark.parametrize("case", ["gpt-oss", "deepseek-v3", "int8-tp"])
def test_the_unpadded_layouts_copy_whole_pools(case):
    """What the toys above guard against: the same steps over pools of the model's own widths
    (``lanes_=1``) copy whole pools, so those tests fail on that layout."""
    if case == "int8-tp":
        rec, _ = _step(aot.StepKind("decode", rows=64), lanes_=1, **INT8_TP)
    else:
        cfg = _family_config(GPT_OSS_TOY if case == "gpt-oss" else DEEPSEEK_TOY)
        rec, _ = _step(aot.StepKind("decode", rows=8), cfg=cfg, lanes_=1)
    assert len(rec["pool_copies"]) >= 2, rec["pool_copies"]


@pytest.mark.parametrize("target,kind", [
    ("v5e-1", aot.StepKind("decode", rows=8)),
    ("v5e-1", aot.StepKind("mixed", rows=4, prefill=64)),
    pytest.param("v5e-1", aot.StepKind("mixed-long", rows=4, prefill=1024), marks=pytest.mark.slow),
    ("v5e-1", aot.StepKind("chain", rows=8, chain=2)),
    ("v5e-1", aot.StepKind("decode-sampling-apart", rows=8, sample=False)),
    ("v6e-1", aot.StepKind("decode", rows=8)),
], ids=lambda x: x if isinstance(x, str) else x.name)
def test_packed_step_compiles_for_tpu_with_the_kernels_in_place(target, kind):
    """The step's attention is one Pallas call per layer over keys pools [P, K, ps, H] (the
    engine's layout on a TPU, ``dispatch.keys_transposed``); the donated pools come back
    aliased, and nothing copies or transposes a whole pool: not around a long prompt chunk's
    write, nor around the writes inside a chain's loop (a token-wise scatter did both)."""
    rec, _ = _step(kind, target=target)
    assert rec["pallas_attention_calls"] == TINY.n_layers  # a chain's loop body holds one step
    assert rec["alias_bytes"] >= rec["pool_bytes"], rec
    assert rec["pool_copies"] == []
    assert rec["temp_bytes"] < rec["pool_bytes"], rec


def test_the_sampler_compiles_for_tpu_apart_from_the_step_with_the_slots_in_place():
    """A step that samples apart hands its rows' logits f32[R, V] to the sampler's own
    executable (``step.sample_rows``), which takes the slot state donated and returns it
    aliased, and bisects wide top-k / top-p thresholds in the Pallas kernel."""
    from jaxinfer.engine.slots import make_slots

    _, step = _step(aot.StepKind("decode", rows=8, sample=False), context=256)
    out = step.out_info[0]
    assert out.tokens is None and (out.logits.shape, out.logits.dtype) == ((8, WIDE.vocab_size), jnp.float32)
    mesh = aot.target_mesh("v5e-1", model=1)
    with jax.set_mesh(mesh):
        compiled = aot.lower_sampler(WIDE, mesh, 8).compile()
    slots = jax.eval_shape(lambda: make_slots(WIDE.vocab_size, 8, 0, vocab_state=False))
    slot_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(slots))
    assert compiled.memory_analysis().alias_size_in_bytes >= slot_bytes
    assert compiled.out_info[0].shape == (8,)  # the tokens
    assert "tpu_custom_call" in compiled.as_text()  # the top-k / top-p bisections' kernels


def test_the_sampler_on_a_tensor_parallel_mesh_splits_the_threshold_rows_over_model():
    """On a v5e-4 mesh (model 4) the threshold kernels run inside shard_map, each chip on its
    share of the rows: 12 rows are 3 a chip, one block smaller than a tile's 8 rows."""
    mesh = aot.target_mesh("v5e-4", model=4)
    with jax.set_mesh(mesh):
        compiled = aot.lower_sampler(WIDE, mesh, 12).compile()
    text = compiled.as_text()
    assert text.count("tpu_custom_call") == 2 and "f32[3,2048]" in text


@pytest.mark.slow  # the default suite compiles int8 pools under tensor parallelism, above
def test_int8_kv_decode_step_reads_and_writes_its_pools_in_place():
    """int8 pools (XLA's readers; the Pallas kernels take float pools): the int8 values and the
    float32 scales, stored flat [P, K * ps] (128 wide here: 8 KV heads of 16-token pages), come
    back aliased with no whole-pool copy. Scales stored [P, K, ps] took a layout with the pages
    minor, and every layer copied both scale pools to row-major and back."""
    rec, _ = _step(aot.StepKind("decode", rows=64), kv_dtype="int8", context=2048)
    assert rec["alias_bytes"] >= rec["pool_bytes"], rec
    assert rec["pool_copies"] == []
    assert rec["temp_bytes"] < rec["pool_bytes"] / 10, rec


def test_the_transposed_keys_layout_copies_a_pool_per_layer():
    """What the keys layout of the CPU readers ([P, K, H, page_size]) does on a TPU: a page of 16
    positions as the minor dimension does not fit the (8, 128) tile, so XLA relayouts the whole
    keys pool after each layer's write; ``analyse`` sees each copy."""
    mesh = aot.target_mesh("v5e-1", model=1)
    kernels = aot.target_kernels(mesh, "pallas")
    weights, _ = aot.abstract_weights(WIDE, mesh, kernels)
    with jax.set_mesh(mesh):
        lowered, info = aot.lower_step(WIDE, weights, mesh, kernels, aot.StepKind("decode", rows=8),
                                       aot.Workload(context=16384), keys_transposed_=True)
        rec = aot.analyse(lowered.compile(), info)
    assert len(rec["pool_copies"]) >= WIDE.n_layers, rec["pool_copies"]


@pytest.mark.slow  # six compiles in a subprocess: minutes; the steps' own compiles above are the default
def test_tpu_compile_script_writes_a_report(tmp_path):
    """benchmarks/tpu_compile.py at a toy size: a record per executable with the figures the
    page documents, and the HLO beside it."""
    out = tmp_path / "tpu"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tpu_compile.py"), "--target", "v5e-1",
                           "--model", "llama-tiny", "--kinds", "decode-1", "verify-4", "chain-8", "--context", "256",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert [r["name"] for r in report] == ["decode-1", "verify-4", "chain-8"]
    for r in report:
        assert (out / f"{r['name']}.hlo.txt").is_file()
        assert (out / f"{r['name']}.{r['layers_compiled'][1]}layers.hlo.txt").is_file()
        for key in ("compile_s", "argument_bytes", "temp_bytes", "alias_bytes", "bytes_accessed", "ideal_bytes",
                    "flops", "collectives", "pool_copies", "projected_step_ms", "projected_mbu", "op_bytes",
                    "bytes_by_op", "bytes_by_op_per_layer", "hbm_traffic_bytes", "hbm_bytes_by_op"):
            assert key in r, key
        assert r["ideal_bytes"] > r["weights_bytes"] > 0
        assert r["pool_copies"] == 0
        assert 0 < r["hbm_traffic_bytes"] <= r["bytes_accessed"]
        assert r["hbm_traffic_loops_extra"] >= 0
        # (a chain's entry holds few ops: its loop counts as one)
        assert 0 < len(r["bytes_by_op"]) <= 10 and all(isinstance(b, float) for _, b in r["bytes_by_op"])
    # a chain's 8 steps are its loop's 8 trips, what runs around the loop once
    chain = report[2]
    per_depth = chain["per_depth"][str(chain["layers_compiled"][0])]
    assert 0 < per_depth["hbm_loop_op_bytes"] <= per_depth["hbm_op_bytes"]
    assert chain["hbm_traffic_bytes"] > 7 * per_depth["hbm_loop_op_bytes"]


def _tpu_compile_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tpu_compile", ROOT / "benchmarks" / "tpu_compile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("model,depths", [("llama-3-8b", (1, 2)), ("gemma-3-27b", (6, 12)), ("gpt-oss-20b", (2, 4)),
                                          ("deepseek-v3", (4, 5))])
def test_tpu_compile_script_compiles_whole_periods_of_each_model(model, depths):
    """The two depths differ by one period of the layers that repeat (Gemma 3's 5 local + 1
    global, gpt-oss's sliding + full), after DeepSeek-V3's 3 leading dense layers, so that
    their difference scales to the model's depth; a cut keeps the model's own pattern."""
    tc = _tpu_compile_script()
    cfg = tc.model_config(model)
    assert tc.default_depths(cfg) == depths
    deep = tc.cut(cfg, depths[1])
    for i in range(deep.n_layers):
        assert (deep.layer_window(i), i in deep.dense_layers) == (cfg.layer_window(i), i in cfg.dense_layers)


@pytest.mark.slow  # two starts of libtpu and two compiles each: a minute and more
def test_tpu_startup_script_compiles_a_sample_of_the_warmup_set_and_finds_it_cached_again(tmp_path):
    """benchmarks/tpu_startup.py at a toy size: the engine's warm-up set counted, a sample of it
    compiled on two threads into a persistent compilation cache, and a second start over that
    cache finds every executable there (a TPU host would load each) and adds no entry."""
    from jaxinfer.engine.warmup import step_shapes

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    opts = ["--target", "v5e-1", "--model", "llama-tiny", "--max-model-len", "256", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "32", "--sample", "2", "--threads", "2",
            "--compilation-cache", str(tmp_path / "cache")]
    reports = []
    for run in ("first", "second"):
        out = tmp_path / run
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tpu_startup.py"), *opts, "--out", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        reports.append(json.loads((out / "report.json").read_text()))
    shapes = step_shapes(max_num_seqs=4, page_size=16, chunk=32, pages_per_seq=16, max_len=256, max_prompt=256)
    first, second = reports
    # every step shape, and one sampler per row bucket (plain steps sample apart, as on a TPU)
    assert first["summary"]["executables_in_set"] == len(shapes) + len({R for R, _, _ in shapes if R})
    assert first["summary"]["compiled"] == 2 and first["summary"]["found_in_cache"] == 0
    assert [r["name"] for r in first["executables"]] == [r["name"] for r in second["executables"]]
    assert first["executables"][0]["name"] == "sampler-R1"  # the set's first and last executables
    assert first["summary"]["new_cache_entries"] == 2
    assert second["summary"]["found_in_cache"] == 2 and second["summary"]["new_cache_entries"] == 0
    assert all(r["compile_s"] > 0 for r in first["executables"])


@pytest.mark.slow  # half a minute; the encoder runs on CPU in tests/test_gemma3_vision.py
def test_gemma3_image_encoder_compiles_for_v5e():
    """Gemma 3's SigLIP tower and projector at the published width (1152, 16 heads, 896 x 896
    pixels in 4,096 patches pooled to 256 soft tokens of the 4B's 2560), two of its 27 layers,
    bfloat16, two images at once: compiled for v5e-1, its output the soft tokens' shape."""
    from jaxinfer.models import gemma3, siglip

    cfg = siglip.VisionConfig(d_model=1152, n_layers=2, n_heads=16, d_ff=4304, image_size=896, patch_size=14,
                              mm_tokens=256, text_d_model=2560, dtype="bfloat16")
    encoder = gemma3.FAMILY.image_encoders["Gemma3ForConditionalGeneration"]
    compiled = aot.lower_image_encoder(encoder, cfg, aot.target_mesh("v5e-1"), 2).compile()
    out = compiled.output_shardings  # compiled for the chip: a sharding on its device
    assert out.device_set == {aot.target_devices("v5e-1")[0]}
    text = compiled.as_text()
    assert "bf16[2,256,2560]" in text
    assert compiled.memory_analysis().temp_size_in_bytes < 1 << 30


def test_bytes_by_op_adds_up_to_xla_bytes_accessed_and_finds_what_is_staged_in_vmem():
    """``hlo_bytes`` redoes XLA's cost analysis op by op: on a chain of matrix-vector products
    compiled for v5e its sum is XLA's ``bytes accessed`` within 1%. XLA stages most of the
    weights in VMEM first (an async copy each), and counts each so staged weight 5 times: the
    HBM-only count is the weights once."""
    from jaxinfer import hlo_bytes

    mesh = aot.target_mesh("v5e-1", model=1)
    ws = [_on(mesh, (2048, 2048), jnp.bfloat16) for _ in range(4)]

    def chain(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    compiled = jax.jit(chain).lower(_on(mesh, (1, 2048), jnp.bfloat16), ws).compile()
    text = compiled.as_text()
    xla = compiled.cost_analysis()["bytes accessed"]
    weights = 4 * 2048 * 2048 * 2
    assert "copy-start" in text
    assert abs(hlo_bytes.bytes_by_op(text)["total"] / xla - 1) < 0.01
    assert xla > 2 * weights
    assert abs(hlo_bytes.bytes_by_op(text, hbm=True)["total"] / weights - 1) < 0.01


@pytest.mark.slow  # a minute: pools of 16k positions beside a prefill row
def test_gemma3_step_with_an_image_compiles_for_v5e_with_the_pools_in_place():
    """A toy Gemma 3 (one local and one global layer, heads of 128, pools larger than VMEM)
    whose packed step carries an image: 8 decode rows beside a prefill row of 128 tokens, 64 of
    them an image's soft tokens scattered into the embeddings and attending bidirectionally.
    The prefill row reads its pages with XLA's reader (the ragged kernel has no image mask), the
    decode rows with the decode kernel, one call per layer: read with XLA's reader too, they
    gathered their 16k-position tables into 162 MB of temporaries (14 MB now). The donated
    pools come back aliased, no whole pool is copied, and the image rows are an operand."""
    from jaxinfer.config import AttentionKind
    from jaxinfer.models import gemma3

    cfg = dataclasses.replace(gemma3.PRESETS["gemma-3-4b"], vocab_size=2048, d_model=256, n_layers=2, n_heads=8,
                              n_kv_heads=8, head_dim=128, d_ff=512, sliding_window=512, dtype="bfloat16",
                              layer_kinds=(AttentionKind.LOCAL, AttentionKind.GLOBAL), name="gemma-3-toy")
    rec, compiled = _step(aot.StepKind("image", rows=8, prefill=128, image_tokens=64), cfg=cfg)
    assert rec["alias_bytes"] >= rec["pool_bytes"], rec
    assert rec["pool_copies"] == []
    assert rec["pallas_attention_calls"] == cfg.n_layers
    assert rec["temp_bytes"] < rec["pool_bytes"] / 10, rec
    assert "bf16[128,256]" in compiled.as_text()


def test_the_verification_sampler_relays_no_logits_out_before_its_sampled_branch():
    """A verification step past its layers (``aot.lower_verification``: the LM head, then
    ``verify_block``), 16 rows of 5 positions: the LM head writes the logits as f32[80, V], one
    row per position, and the block maxima and the argmax's blocks read them in that layout
    (blocks of 128 logits: a lane tile each). As f32[16, 5, V] a TPU pads the 5 positions to 8
    rows; the min_tokens ban written by a scatter flattened them; and blocks of 64 logits (half
    a lane tile) took layouts of their own: XLA copied the logits five times before the branch
    of sampled rows. Inside that branch one copy is left, the verify kernel's [B, J, V] operand."""
    from jaxinfer import hlo_bytes

    R, Q, V = 16, 5, 32768
    cfg = dataclasses.replace(WIDE, vocab_size=V)
    mesh = aot.target_mesh("v5e-1", model=1)
    kernels = aot.target_kernels(mesh, "pallas")
    weights, _ = aot.abstract_weights(cfg, mesh, kernels)
    with jax.set_mesh(mesh):
        text = aot.lower_verification(cfg, weights, mesh, kernels, R, Q).compile().as_text()
    _, entry = hlo_bytes.parse(text)
    copies = hlo_bytes.relayouts(text, R * Q * V)
    assert [c for c in copies if c["computation"] == entry] == [], copies
    assert [c["type"].split("{")[0] for c in copies] == [f"f32[{R},{Q},{V}]"], copies
