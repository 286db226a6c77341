"""EAGLE draft heads: save/load and refusal, training on a tiny model, and the engine's eagle
method: greedy output unchanged, and the drafts it proposes equal to the head run offline over
the finished sequence (so its pages hold the right entries at the right positions), with one
chain per row or several (``branches``), where a row keeps the chain that accepted most."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import CheckpointError, InvalidRequest
from jaxinfer.models import eagle
from jaxinfer import train_eagle as te


def _head(cfg, seed=1, scale=0.3):
    return eagle.init_head(cfg, jax.random.PRNGKey(seed), scale=scale)


def test_save_load_round_trip_and_refusal(tiny_llm, tmp_path):
    cfg = tiny_llm.cfg
    head = _head(cfg)
    vocab = np.arange(0, 200, 3, dtype=np.int32)
    eagle.save_head(tmp_path / "h", head, vocab, cfg, extra={"note": "x"})
    back, v, meta = eagle.load_head(tmp_path / "h", cfg)
    np.testing.assert_array_equal(v, vocab)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(head)):
        np.testing.assert_array_equal(a, b)
    assert meta["note"] == "x" and meta["draft_vocab_size"] == len(vocab)
    with pytest.raises(CheckpointError, match="already exists"):
        eagle.save_head(tmp_path / "h", head, vocab, cfg)
    other = json.loads((tmp_path / "h" / eagle.META_FILE).read_text())
    other["hidden_size"] = cfg.d_model + 1
    (tmp_path / "h" / eagle.META_FILE).write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match="head made for hidden_size"):
        eagle.load_head(tmp_path / "h", cfg)
    with pytest.raises(CheckpointError, match="not an EAGLE head directory"):
        eagle.load_head(tmp_path, cfg)


def test_draft_vocab_keeps_the_most_frequent_answer_tokens():
    seqs = [[1, 2, 9, 9, 9, 8], [3, 4, 8, 7, 9]]
    assert te.draft_vocab(seqs, [2, 2], 2).tolist() == [8, 9]
    assert te.draft_vocab(seqs, [2, 2], 2, always=[5]).tolist() == [5, 9]


def test_batched_features_equal_each_sequence_alone(tiny_llm):
    """Sequences of different lengths forwarded together (right-padded, in length order) get
    the features and labels each gets alone, returned in the order given."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, tiny_llm.cfg.vocab_size, n).tolist() for n in (7, 40, 3, 33, 18)]
    together = te.sequence_features(tiny_llm, seqs, rows=4, bucket=32)
    for ids, (h, lab) in zip(seqs, together):
        (h1, lab1), = te.sequence_features(tiny_llm, [ids], rows=1, bucket=1)
        assert h.shape == (len(ids), tiny_llm.cfg.d_model)
        np.testing.assert_allclose(h, h1, rtol=1e-4, atol=1e-4)
        assert np.mean(lab == lab1) >= 0.95  # argmax: a near tie may flip between shapes


def test_training_learns_a_copy_pattern(tiny_llm):
    """Sequences that repeat a random 8-token block, labelled as if the model predicted the
    text: t_{p+2} is in the context, so the layer's attention can learn to fetch it."""
    rng = np.random.default_rng(0)
    seqs = [np.tile(rng.integers(5, 60, 8), 4).tolist() for _ in range(12)]
    feats = te.sequence_features(tiny_llm, seqs)
    assert feats[0][0].shape == (32, tiny_llm.cfg.d_model) and feats[0][1].shape == (32,)
    F, T, Y, lens, pl = te.pack(feats, seqs, [4] * len(seqs), 32)
    Y = np.roll(T, -1, axis=1)
    data = (F, T, Y, lens, pl)
    vocab = te.draft_vocab(seqs, [0] * len(seqs), 64)
    head, rows, losses = te.train_head(tiny_llm, F, T, Y, lens, vocab, steps=120, batch=8, lr=1e-2, noise=0.0,
                                       progress=False)
    assert losses[-1] < 0.5 * losses[0], losses
    acc = te.accuracy(head, tiny_llm.weights, rows, vocab, tiny_llm.cfg, *data)
    assert acc["answer"] > 0.5 and acc["second_given_first"] > 0.5, acc


def test_second_pass_on_real_entries_is_the_first_pass(tiny_llm):
    """The training-time test's attention (earlier real entries, then the query's own key)
    fed the real entries again must give the causal first pass back."""
    cfg = tiny_llm.cfg
    head = _head(cfg)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 11, cfg.d_model))
    pos = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    g, first = eagle.run_layer(head, x, pos, te._FirstPass(), cfg)
    g_plain, _ = eagle.run_layer(head, x, pos, None, cfg)
    g2, _ = eagle.run_layer(head, x, pos, te._SecondPass(first.k, first.v), cfg)
    np.testing.assert_allclose(g, g_plain, rtol=1e-5, atol=1e-4)  # float32 sums in another order
    np.testing.assert_allclose(g2, g, rtol=1e-5, atol=1e-4)


def _proposed_drafts(llm, monkeypatch):
    """Record each decoding row's drafts as the engine proposes them: [(tokens so far, drafts,
    the first drafts of its other branches)]."""
    seen = []
    drafter = type(llm.engine.drafter)
    orig = drafter.propose

    def spy(self, decoding):
        out = orig(self, decoding)
        for s, d in out.items():
            if d:
                seen.append((list(s.tokens), list(d), [c[0] for c in s.branch_drafts]))
        return out

    monkeypatch.setattr(drafter, "propose", spy)
    # chained blocks take their drafts on device, never through propose: host-built ones only
    monkeypatch.setattr(drafter, "chains", lambda self: False)
    return seen


@pytest.mark.parametrize("branches", [1, 3])
def test_engine_eagle_keeps_greedy_output_and_drafts_what_the_head_says(tiny_llm, tiny_gguf, tmp_path,
                                                                        monkeypatch, branches):
    cfg = tiny_llm.cfg
    vocab = np.arange(cfg.vocab_size, dtype=np.int32)[:: 7][:512]
    eagle.save_head(tmp_path / "h", _head(cfg), vocab, cfg)
    spec = LLM(str(tiny_gguf), progress=False, max_num_seqs=8, kv_cache_memory_bytes=64 << 20,
               speculative_config={"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "h"),
                                   "branches": branches})
    seen = _proposed_drafts(spec, monkeypatch)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["a b c a b c", "hello world", "1 2 3"]
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert spec.engine.spec_stats.drafted > 0 and seen
    # draft 1 of a block whose last token sits at P comes from entry P - 1 = (f_{P-1}, t_P)
    # over the entries before it: the head run offline over the same tokens must agree
    head, v, _ = eagle.load_head(tmp_path / "h", cfg)
    rows = eagle.readout_rows(tiny_llm.weights, v, cfg)
    seqs = [toks for toks, _, _ in seen]  # all at one length: one compile, not one per sequence
    F, T, _, _, _ = te.pack(te.sequence_features(tiny_llm, seqs), seqs, [0] * len(seqs),
                            max(map(len, seqs)) + 1)
    _, logits = te._forward(head, tiny_llm.weights, rows, jnp.asarray(F), jnp.asarray(T), cfg)
    order = np.asarray(jnp.argsort(-logits, axis=-1)[..., :branches])  # the head's top guesses, best first
    firsts = [[int(v[i]) for i in order[n, len(toks) - 2]] for n, (toks, _, _) in enumerate(seen)]
    match = sum(f == [d[0]] + other for f, (_, d, other) in zip(firsts, seen) if len(other) == branches - 1)
    assert match >= 0.9 * len(seen), (match, len(seen))


def test_branches_keep_the_chain_that_accepted_most(tiny_llm, tiny_gguf, tmp_path, monkeypatch):
    """Branch 1 of every block is the true continuation, branch 0 the (random) head's: every
    block must accept all it can, and the output stay plain decoding's. Wrong keys kept for a
    chosen branch, or the wrong branch's tokens, would change what follows."""
    from jaxinfer.engine import drafting

    cfg = tiny_llm.cfg
    eagle.save_head(tmp_path / "h", _head(cfg), np.arange(cfg.vocab_size, dtype=np.int32)[:512], cfg)
    k = 3
    spec = LLM(str(tiny_gguf), progress=False, max_num_seqs=8, kv_cache_memory_bytes=64 << 20,
               speculative_config={"method": "eagle", "num_speculative_tokens": k, "model": str(tmp_path / "h"),
                                   "branches": 2, "disable_by_batch_size": 8})
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["a b c a b c", "hello world", "1 2 3"]
    want = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in tiny_llm.generate(prompts, sp, use_tqdm=False)}
    orig = drafting.Drafter.branch_drafts

    def truth(self, R, k, rows):
        out = orig(self, R, k, rows)
        for s in self.eng.sched.slots:
            if s is not None and s.slot in rows:
                n, ref = len(s.row.token_ids), want[tuple(s.row.prompt_ids)]
                d = len(rows[s.slot])
                out[s.slot, 0, :d] = (ref[n: n + d] + [0] * d)[:d]
        return out

    monkeypatch.setattr(drafting.Drafter, "branch_drafts", truth)
    got = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)}
    assert got == want
    st = spec.engine.spec_stats
    assert st.drafted > 0 and st.accepted == st.drafted  # every block took branch 1 whole


def test_int8_head_keeps_greedy_output(tiny_llm, tiny_gguf, tmp_path):
    """``quantization: int8`` stores the head's matmul weights and readout rows as int8; its
    drafts change a little, the output not at all."""
    from jaxinfer.quant import QuantArray

    cfg = tiny_llm.cfg
    eagle.save_head(tmp_path / "h", _head(cfg), np.arange(cfg.vocab_size, dtype=np.int32)[:512], cfg)
    spec = LLM(str(tiny_gguf), progress=False, max_num_seqs=8, kv_cache_memory_bytes=64 << 20,
               speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "h"),
                                   "quantization": "int8"})
    held = spec.engine.drafter.eagle
    assert isinstance(held["rows"], QuantArray) and isinstance(held["head"]["fc"], QuantArray)
    assert isinstance(held["head"]["layer"]["w_down"], QuantArray)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["a b c a b c", "hello world", "1 2 3"]
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, sp, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)] == want
    assert spec.engine.spec_stats.drafted > 0
    with pytest.raises(InvalidRequest, match="eagle head must be int8"):
        LLM(str(tiny_gguf), progress=False, speculative_config={
            "method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "h"), "quantization": "int4"})


def test_branch_helpers_by_hand():
    from jaxinfer.engine import branches

    acc = jnp.array([[1, 2, 2], [0, 0, 1], [2, 0, 3]])
    free = jnp.array([True, True, False])
    assert branches.choose(acc, free).tolist() == [1, 2, 0]  # first best; a sampled row keeps 0
    R, W, Q = 2, 3, 2
    a = jnp.arange(R * W * Q + 3)  # three prefill tokens after the virtual rows
    assert branches.pick(a, jnp.array([2, 0]), R, W, Q).tolist() == [4, 5, 6, 7, 12, 13, 14]


def test_bad_config(tiny_gguf, tmp_path):
    with pytest.raises(InvalidRequest, match="eagle needs model"):
        LLM(str(tiny_gguf), progress=False, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(CheckpointError, match="not an EAGLE head directory"):
        LLM(str(tiny_gguf), progress=False,
            speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path)})


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from jaxinfer.cli import main

    assert main(["train-eagle", "no-such-model", "--out", str(tmp_path / "o"), "--steps", "0"]) == 2
    assert "steps, batch, lr and vocab size must be positive" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}']) == 2
    assert "eagle needs model" in capsys.readouterr().err


def test_training_without_optax_names_the_extra(tmp_path, monkeypatch, capsys):
    import sys

    from jaxinfer.cli import main

    monkeypatch.setitem(sys.modules, "optax", None)  # what an install without the train extra sees
    # refused before loading the model (no-such-model would fail otherwise)
    assert main(["train-eagle", "no-such-model", "--out", str(tmp_path / "o")]) == 2
    assert "pip install 'jaxinfer[train]'" in capsys.readouterr().err
