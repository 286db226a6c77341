"""Medusa heads: declaration, save/load and refusal, the untrained heads' meaning, training by
self-distillation on a tiny model, the engine's medusa method (greedy output unchanged), and
the CLI's bad input."""

import json

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import CheckpointError, InvalidRequest
from jaxinfer.models import medusa
from jaxinfer.models.registry import model_family
from jaxinfer import train_medusa as tm


def test_save_load_round_trip_and_refusal(tiny_llm, tmp_path):
    cfg = tiny_llm.cfg
    heads = medusa.init_heads(cfg, 2, key=jax.random.PRNGKey(1), scale=0.1)
    medusa.save_heads(tmp_path / "h", heads, cfg, extra={"note": "x"})
    back, meta = medusa.load_heads(tmp_path / "h", cfg)
    np.testing.assert_array_equal(back["w"], heads["w"])
    np.testing.assert_array_equal(back["b"], heads["b"])
    assert meta["num_heads"] == 2 and meta["note"] == "x"
    with pytest.raises(CheckpointError, match="already exists"):
        medusa.save_heads(tmp_path / "h", heads, cfg)
    other = json.loads((tmp_path / "h" / medusa.META_FILE).read_text())
    other["hidden_size"] = cfg.d_model + 1
    (tmp_path / "h" / medusa.META_FILE).write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match="heads made for hidden_size"):
        medusa.load_heads(tmp_path / "h", cfg)
    with pytest.raises(CheckpointError, match="not a Medusa heads directory"):
        medusa.load_heads(tmp_path, cfg)


def test_zero_heads_repeat_the_models_own_prediction(tiny_llm):
    cfg, w = tiny_llm.cfg, tiny_llm.weights
    mod = model_family(cfg.family)
    h = jax.random.normal(jax.random.PRNGKey(0), (3, cfg.d_model))
    logits = medusa.head_logits(medusa.init_heads(cfg, 2), w, h, cfg)  # f32[3, 2, V]
    own = mod.unembed(w, h[:, None], cfg)[:, 0]
    np.testing.assert_allclose(logits[:, 0], own, atol=1e-5)
    np.testing.assert_allclose(logits[:, 1], own, atol=1e-5)


def test_training_lowers_the_loss_and_learns_a_shift(tiny_llm):
    """Targets that are a fixed function of the position's own token: the heads must learn them."""
    rng = np.random.default_rng(0)
    cfg = tiny_llm.cfg
    seqs = [rng.integers(5, 60, 24).tolist() for _ in range(6)]
    h, t = tm.positions(tiny_llm, seqs, 2)
    assert h.shape == (sum(len(s) - 2 for s in seqs), cfg.d_model) and t.shape == (len(h), 2)
    np.testing.assert_array_equal(t[: 22, 0], seqs[0][2:24])  # head 0 at t targets token t + 2
    heads, losses = tm.train_heads(tiny_llm, h, t, steps=30, batch=32, lr=3e-2, progress=False)
    assert losses[-1] < 0.8 * losses[0], losses
    before = tm.accuracy(medusa.init_heads(cfg, 2), tiny_llm.weights, cfg, h, t)
    after = tm.accuracy(heads, tiny_llm.weights, cfg, h, t)
    assert after[0] > before[0], (before, after)


def test_engine_medusa_keeps_greedy_output(tiny_llm, tiny_gguf, tmp_path):
    cfg = tiny_llm.cfg
    medusa.save_heads(tmp_path / "h", medusa.init_heads(cfg, 3, key=jax.random.PRNGKey(2), scale=0.05), cfg)
    spec = LLM(str(tiny_gguf), progress=False, max_num_seqs=8,
               speculative_config={"method": "medusa", "num_speculative_tokens": 3, "model": str(tmp_path / "h")})
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["a b c a b c", "hello world", "1 2 3"]
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert spec.engine.spec_stats.drafted > 0
    with pytest.raises(InvalidRequest, match="needs as many Medusa heads"):
        LLM(str(tiny_gguf), progress=False, speculative_config={"method": "medusa", "num_speculative_tokens": 4,
                                                                  "model": str(tmp_path / "h")})


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from jaxinfer.cli import main

    assert main(["train-medusa", "no-such-model", "--out", str(tmp_path / "o"), "--heads", "0"]) == 2
    assert "heads must be >= 1" in capsys.readouterr().err
    bad = tmp_path / "p.jsonl"
    bad.write_text("not json\n")
    assert main(["train-medusa", "no-such-model", "--out", str(tmp_path / "o"), "--data", str(bad)]) == 2
    assert 'expected a JSON object with a "prompt"' in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}']) == 2
    assert "medusa needs model" in capsys.readouterr().err


def test_training_without_optax_names_the_extra(tiny_llm, tmp_path, monkeypatch, capsys):
    import sys

    from jaxinfer.cli import main
    from jaxinfer.errors import JaxinferError

    monkeypatch.setitem(sys.modules, "optax", None)  # what an install without the train extra sees
    with pytest.raises(JaxinferError, match=r"pip install 'jaxinfer\[train\]'"):
        tm.train_heads(tiny_llm, np.zeros((4, tiny_llm.cfg.d_model), np.float32), np.zeros((4, 2), np.int32),
                       steps=1, batch=2, lr=1e-3, progress=False)
    # the CLI refuses before loading the model (no-such-model would fail otherwise) and writes nothing
    assert main(["train-medusa", "no-such-model", "--out", str(tmp_path / "o")]) == 2
    assert "training draft heads needs optax" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
