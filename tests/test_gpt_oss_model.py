"""gpt-oss against transformers' own tiny checkpoint (4 layers alternating sliding-window and
full attention with a window of 8 that the prompts pass, 8 experts top 2, YaRN rotary as in the
released config): prompt log-probs and greedy tokens through the paged engine with a
prefix-cache hit (and, marked slow, n-gram speculation, the int8 KV cache and tensor
parallelism 2: ``tests/family_testing.py``); a checkpoint whose experts are MXFP4 blocks and
scales; YaRN's frequencies against transformers'; and a packed engine step through the ragged
paged-attention kernel (the engine's TPU/GPU path, Pallas interpret mode) with the sinks, over
NaN-poisoned pools, against the pure-JAX path."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxinfer.models.registry import num_params

from tests import family_testing as ft
from tests.conftest import require

pytestmark = pytest.mark.reference

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}
TINY = {"num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 131072, "rope_parameters": YARN}
LLM_KW = {"max_model_len": 128, "progress": False, "kv_cache_memory_bytes": 16 << 20, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return ft.write_tiny(tmp_path_factory.mktemp("gpt_oss") / "m", "gpt_oss", TINY)


def test_gpt_oss_equals_transformers(tiny):
    """The paged engine, the second prompt hitting the first's cached pages."""
    ft.check_family(tiny, tp=False, int8_kv=False, ngram=False)


@pytest.mark.slow
def test_gpt_oss_equals_transformers_everywhere(tiny):
    """check_family in full: n-gram speculation, the int8 KV cache, tensor parallelism 2."""
    ft.check_family(tiny)


# ----------------------------------------------------------------------------- YaRN
@pytest.mark.parametrize("params", [YARN, YARN | {"truncate": True},
                                    YARN | {"factor": 8.0, "beta_fast": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5}])
def test_yarn_frequencies_equal_transformers(params):
    """Inverse frequencies and attention factor from the config, as ``_compute_yarn_parameters``."""
    transformers = require("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from jaxinfer.models import gpt_oss
    from jaxinfer.models.layers import rope_inv_freq

    hf = {"vocab_size": 96, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
          "max_position_embeddings": 131072, "rope_parameters": params}
    config = transformers.GptOssConfig(**hf)
    inv, attention = _compute_yarn_parameters(config)
    rope = gpt_oss.rope_from_hf(hf)
    np.testing.assert_allclose(rope_inv_freq(16, rope), inv.numpy(), rtol=2e-6)
    assert math.isclose(rope.attention_factor, attention, rel_tol=1e-12)


# ----------------------------------------------------------------------------- MXFP4
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w f32[..., O, I] -> (blocks u8[..., O, I/32, 16], scales u8[..., O, I/32]): each block
    of 32 inputs scaled by the power of two that brings its largest magnitude to at most 6,
    each value rounded to the nearest E2M1 code (sign in bit 3), two codes a byte, the even
    input in the low nibble."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(g).max(axis=-1)
    exp = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127, 127).astype(np.int32)
    x = g / np.exp2(exp)[..., None]
    code = np.abs(np.abs(x)[..., None] - _E2M1).argmin(axis=-1) | np.where(x < 0, 8, 0)
    code = code.astype(np.uint8)
    # contiguous: safetensors.numpy writes a strided array's buffer as it lies
    return np.ascontiguousarray(code[..., 0::2] | (code[..., 1::2] << 4)), np.ascontiguousarray(exp + 127, np.uint8)


def _mxfp4_pair(tiny: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The tiny checkpoint with its experts as MXFP4 blocks and scales (as released gpt-oss
    checkpoints store them), and a float checkpoint of the weights transformers' own decoder
    (``convert_moe_packed_tensors``) reads from those blocks: the reference's."""
    torch = require("torch")
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxinfer import mxfp4

    quant, dequant = tmp_path / "mxfp4", tmp_path / "dequantized"
    for d in (quant, dequant):
        shutil.copytree(tiny, d)
    t = load_file(str(tiny / "model.safetensors"))
    packed, floats = {}, {}
    for name, a in t.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = floats[name] = a
            continue
        blocks, scales = quantize_mxfp4(np.swapaxes(a, -1, -2))  # stored [E, out, in] as torch Linear keeps it
        theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                            dtype=torch.float32).numpy()  # [E, in, out]
        ours = np.swapaxes(mxfp4.dequantize(blocks, scales), -1, -2)
        np.testing.assert_array_equal(ours, theirs)  # our decoder is transformers' to the bit
        np.testing.assert_allclose(theirs, a, atol=0.55 * np.abs(a).max())  # and it is a quantization of a
        assert np.mean(np.abs(theirs - a)) < 0.2 * np.mean(np.abs(a))  # FP4: about 12% here
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        floats[name] = theirs
    save_file(packed, str(quant / "model.safetensors"))
    save_file(floats, str(dequant / "model.safetensors"))
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router",
                                                                                       "model.embed_tokens", "lm_head"]}
    (quant / "config.json").write_text(json.dumps(cfg))
    return quant, dequant


def test_mxfp4_checkpoint_equals_transformers_on_its_dequantized_weights(tiny, tmp_path):
    from jaxinfer import LLM

    quant, dequant = _mxfp4_pair(tiny, tmp_path)
    ref = ft.reference(dequant, prompts=ft.PROMPTS[:1], max_tokens=4)
    llm = LLM(str(quant), **LLM_KW)
    assert llm.cfg.family == "gpt_oss" and llm.cfg.sliding_window == 8
    assert [k.value for k in llm.cfg.layer_kinds] == ["local", "global"] * 2
    assert llm.engine.windowed == (True, False) * 2  # the sliding layers keep their window in pools of their own
    ft.assert_matches(ft.generate(llm, ft.PROMPTS[:1], max_tokens=4), ref, what="mxfp4")


def test_mxfp4_dequantize_hand_block():
    """One block: codes 1 (0.5) and 15 (-6) alternating, scale 2^(129 - 127) = 4."""
    from jaxinfer import mxfp4
    from jaxinfer.errors import CheckpointError

    blocks = np.full((1, 1, 16), 0xF1, np.uint8)  # one row of one block
    out = mxfp4.dequantize(blocks, np.array([[129]], np.uint8))
    np.testing.assert_array_equal(out, [[2.0, -24.0] * 16])
    with pytest.raises(CheckpointError, match="do not match scales"):
        mxfp4.dequantize(blocks, np.array([[129, 1]], np.uint8), name="w")
    from jaxinfer.models import gpt_oss

    name = "model.layers.0.mlp.experts.gate_up_proj"
    # one expert, two output rows (gate, up interleaved) scaled by 4 and by 1, stored [E, out, in/32, 16]
    stored = {name + "_blocks": np.full((1, 2, 1, 16), 0xF1, np.uint8),
              name + "_scales": np.array([[[129], [127]]], np.uint8)}
    np.testing.assert_array_equal(gpt_oss.hf_read(name + ":gate", stored.get)[0, :, 0], [2.0, -24.0] * 16)
    np.testing.assert_array_equal(gpt_oss.hf_read(name + ":up", stored.get)[0, :, 0], [0.5, -6.0] * 16)
    del stored[name + "_scales"]
    with pytest.raises(CheckpointError, match="has its blocks but not its scales"):
        gpt_oss.hf_read(name + ":gate", stored.get)


# ----------------------------------------------------------------------------- the kernel path
@pytest.mark.parametrize("decode_only", [False, True])
def test_packed_attention_with_sinks_through_the_kernels_equals_reference(decode_only):
    """A packed step's attention (``PackedKV.attend``, as gpt-oss's layers call it) over decode
    rows of 1 and 3 queries and a prefill row of two chunks (the ragged kernel), or over decode
    rows of one query only (the paged decode kernel), NaN-poisoned pools, a sliding layer over
    its own windowed pool and a full one, with sinks far from 0: the kernel (interpret mode)
    gives what the pure-JAX readers give, and the sinks matter."""
    from jaxinfer import dispatch
    from jaxinfer.config import AttentionKind, ModelConfig
    from jaxinfer.models.packed import PackedKV
    from tests.kernel_testing import assert_close, run_interpreted
    from tests.test_kernels_engine import _hand_decode_batch, _hand_packed_batch, _hand_pools

    cfg = ModelConfig(family="gpt_oss", vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=8, d_ff=16, layer_kinds=(AttentionKind.LOCAL, AttentionKind.GLOBAL), sliding_window=4)
    batch = _hand_decode_batch(8) if decode_only else _hand_packed_batch(8)
    windowed = (True, False)
    ks, vs = _hand_pools(cfg, windowed, 8)
    rng = np.random.default_rng(5)
    n = batch.tokens.shape[0]
    q, k, v = (jnp.asarray(rng.normal(size=(1, n, heads, 8)), jnp.float32) for heads in (4, 2, 2))
    sinks = jnp.array([3.0, -2.0, 0.5, 1.5])

    def make(kernels):
        def attend(q, k, v, sinks):
            cache = PackedKV(ks, vs, batch, windowed, kernels)
            return [cache.attend(i, q, k, v, scale=8**-0.5, window=cfg.layer_window(i), sinks=sinks)[0][0]
                    for i in range(cfg.n_layers)]
        return attend

    ref = jax.jit(make(dispatch.XLA))(q, k, v, sinks)
    plain = jax.jit(make(dispatch.XLA))(q, k, v, jnp.full((4,), -1e4))  # a sink that weighs nothing
    jaxpr = str(jax.make_jaxpr(make(dispatch.INTERPRET))(q, k, v, sinks))
    assert jaxpr.count("pallas_call") == cfg.n_layers
    assert ("ragged_paged_attention" in jaxpr) != decode_only  # decode-only: the paged decode kernel
    got = run_interpreted(make(dispatch.INTERPRET), q, k, v, sinks)
    if decode_only:
        real = np.asarray(batch.active)  # the idle row: scratch
    else:
        real = np.concatenate([[True] * 3 + [True, False, False], np.asarray(batch.seg) >= 0])  # B's padding
    for g, r, p in zip(got, ref, plain):
        assert np.isfinite(np.asarray(g)[real]).all()
        assert_close(g[real], r[real])
        assert not np.allclose(np.asarray(p)[real], np.asarray(r)[real], atol=1e-2)


def test_released_20b_config():
    """gpt-oss-20b's config.json (rope_scaling beside rope_theta, as transformers 4.55 wrote it)."""
    from jaxinfer.config import AttentionKind, RopeKind
    from jaxinfer.models import gpt_oss

    hf = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64, "hidden_act": "silu",
          "hidden_size": 2880, "intermediate_size": 2880, "max_position_embeddings": 131072,
          "layer_types": ["sliding_attention", "full_attention"] * 12, "model_type": "gpt_oss",
          "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
          "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128,
          "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                           "rope_type": "yarn", "truncate": False},
          "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088,
          "quantization_config": {"quant_method": "mxfp4"}}
    cfg = gpt_oss.config_from_hf(hf, dtype="bfloat16")
    assert cfg.layer_kinds == (AttentionKind.LOCAL, AttentionKind.GLOBAL) * 12 and cfg.sliding_window == 128
    assert (cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_d_ff) == (32, 4, 2880)
    assert cfg.rope.kind == RopeKind.YARN and cfg.rope.theta == 150000 and not cfg.rope.truncate
    assert math.isclose(cfg.rope.attention_factor, 0.1 * math.log(32) + 1)
    assert 20.5e9 < num_params(cfg) < 21.5e9  # "gpt-oss-20b": 20.9B parameters
