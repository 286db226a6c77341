"""Sharding from logical axes: the rules table, and a sharded forward pass on 8 virtual CPU
devices equal to the single-device one (run in a subprocess so XLA_FLAGS apply)."""

import os
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import PartitionSpec

from jaxinfer.sharding import ShardingRules, make_mesh, spec_for


def test_rules_refuse_one_mesh_axis_twice():
    mesh = make_mesh(data=1, model=1)
    rules = ShardingRules((("embed", "model"), ("mlp", "model")))
    with pytest.raises(ValueError, match="twice"):
        spec_for((8, 8), ("embed", "mlp"), mesh, rules)


def test_indivisible_dimension_is_replicated():
    mesh = make_mesh(data=1, model=1)
    assert spec_for((6, 4), ("q_heads", "head_dim"), mesh) == PartitionSpec("model", None)
    fake = type("M", (), {"shape": {"data": 1, "model": 4}})()  # a 4-way model axis
    assert spec_for((6, 8), ("q_heads", "mlp"), fake, ShardingRules((("q_heads", "model"),))) == PartitionSpec(None, None)


_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxinfer import cache as kv
    from jaxinfer.config import ModelConfig
    from jaxinfer.models import llama
    from jaxinfer.specs import init_weights
    from jaxinfer.sharding import make_mesh, weight_shardings

    assert len(jax.devices()) == 8
    cfg = ModelConfig(family="llama", vocab_size=128, d_model=64, n_layers=2, n_heads=8,
                      n_kv_heads=4, head_dim=8, d_ff=128)
    specs = llama.weight_specs(cfg)
    w = init_weights(specs, cfg, jax.random.key(0), scale=0.2)
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, cfg.vocab_size)

    def run(w, tokens):
        B = tokens.shape[0]
        cache = kv.init_cache(cfg, B, 16)
        h, cache = llama.forward(w, tokens[:, :8], jnp.zeros(B, jnp.int32), cache, cfg=cfg, read_cache=False)
        outs = [llama.unembed(w, h, cfg)]
        for t in range(8, 12):
            h, cache = llama.forward(w, tokens[:, t:t + 1], jnp.full(B, t, jnp.int32), cache, cfg=cfg)
            outs.append(llama.unembed(w, h, cfg))
        return jnp.concatenate(outs, axis=1)

    ref = np.asarray(jax.jit(run)(w, tokens))
    mesh = make_mesh(data=2, model=4)
    ws = jax.device_put(w, weight_shardings(specs, mesh))
    assert ws["layers"][0]["wq"].sharding.spec == P(None, "model", None)
    ts = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    got = jax.jit(run)(ws, ts)
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    print("ok")
""")


@pytest.mark.slow  # 20 s in a subprocess; the engine under TP, DP x TP and PP runs in tests/test_parallel.py
def test_sharded_forward_equals_single_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    p = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("ok")
