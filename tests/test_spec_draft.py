"""Speculative decoding with a draft model (``method: draft_model``) through the engine.

* Sampled rows: on a tiny-vocabulary random Llama (V = 32), the marginal distributions of the
  tokens a verification step emits, sampled by the engine over thousands of seeds run as one
  batch, match the exact distribution computed from the model's own logits (independent numpy
  shaping, ``tests.test_sampling.ref_probs``), with temperature, top-k and top-p, for the
  draft_model and the ngram paths (chi-square); a power check shows that a sampler 2% off is
  caught at the same sample size.
* Greedy rows on the real SmolLM2: a draft model gives the transformers goldens token for
  token, whatever it drafts (a random draft, a quantized one, the model itself), batched with
  mixed acceptance; a draft equal to the target accepts everything; max_tokens, stop strings
  and EOS inside an accepted block end the row where decoding without speculation does.
* Bad configurations: one clear ``InvalidRequest`` (exit 2 on the command line).
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.speculative import SpeculativeConfig
from jaxinfer.errors import InvalidRequest
from jaxinfer.models import llama
from jaxinfer.specs import init_weights
from tests.test_sampling import ref_probs

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2-135m-instruct.json").read_text())["prompts"]
KV_BYTES = 256 << 20
V = 32  # the tiny model's vocabulary
TINY = ModelConfig(family="llama", vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64, max_position=128)
PROMPT = [5, 7, 9, 12, 30, 2, 17, 9, 22, 14, 3, 26]  # every token once but 9: some ngram drafts, not always
K = 3  # drafted tokens per block; max_tokens = K + 2 lets the first verification step emit tokens 2..5
BATCH = 512  # seeds run as one batch (the engine's largest batch bucket)
SETTINGS = {  # the sampling shapes under test
    "temperature": dict(temperature=1.0),
    "top_k_top_p": dict(temperature=0.9, top_k=8, top_p=0.9),
}


# ----------------------------------------------------------------------------- tiny vocabulary
def _write_tiny(dest: Path, weights) -> Path:
    """An Orbax checkpoint of the tiny model with a 32-word tokenizer (t0 .. t31)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from jaxinfer.loaders import orbax_io

    tokdir = dest.parent / (dest.name + "-tokenizer")
    tokdir.mkdir()
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(tokdir / "tokenizer.json"))
    (tokdir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t2", "eos_token": "t1"}))
    return orbax_io.save(dest, TINY, weights, tokdir)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """(target dir, draft dir, target weights): a random V = 32 Llama whose next-token
    distributions are sharp-ish (top token 0.3 .. 0.7), and a draft equal to it plus noise, so
    drafts are accepted often but not always."""
    root = tmp_path_factory.mktemp("tiny-vocab")
    w = init_weights(llama.weight_specs(TINY), TINY, jax.random.key(0), scale=0.3)
    leaves, tree = jax.tree.flatten(w)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [a + 0.25 * jax.random.normal(kk, a.shape, a.dtype) for a, kk in zip(leaves, keys)]
    return _write_tiny(root / "target", w), _write_tiny(root / "draft", jax.tree.unflatten(tree, noisy)), w


def _exact_marginals(w, settings: dict, n: int = 4) -> np.ndarray:
    """f64[n, V]: the exact marginal distribution of generated tokens 1..n after PROMPT,
    from the model's own logits (a full forward pass over every continuation) shaped by an
    independent numpy implementation of temperature / top-k / top-p."""
    seqs = np.array([PROMPT + list(c) for c in np.ndindex(*(V,) * (n - 1))], np.int32)  # every t1..t_{n-1}
    fwd = jax.jit(lambda t: llama.unembed(w, llama.forward(w, t, jnp.zeros(t.shape[0], jnp.int32), None,
                                                           cfg=TINY)[0], TINY))
    logits = np.concatenate([np.asarray(fwd(jnp.asarray(seqs[i:i + 4096]))) for i in range(0, len(seqs), 4096)])
    P = len(PROMPT)
    kw = dict(temperature=settings["temperature"], top_k=settings.get("top_k", 0), top_p=settings.get("top_p", 1.0),
              min_p=0.0)
    joint = np.ones(1)  # probability of each prefix t1..tj, flattened
    out = []
    for j in range(n):
        # rows whose tokens after j are all 0 hold each distinct prefix of length j exactly once
        stride = V ** (n - 1 - j)
        rows = logits[::stride, P - 1 + j] if j < n - 1 else logits[:, P - 1 + j]
        cond = np.stack([ref_probs(r, **kw) for r in rows])  # f64[V**j, V]
        nxt = joint[:, None] * cond
        out.append(nxt.sum(axis=0))
        joint = nxt.reshape(-1)
    return np.stack(out)


def _sample_tokens(llm, settings: dict, n_samples: int, seed0: int = 0) -> np.ndarray:
    """i32[n_samples, K + 2]: the engine's tokens after PROMPT, one seed per row."""
    toks = []
    for start in range(seed0, seed0 + n_samples, BATCH):
        params = [SamplingParams(max_tokens=K + 2, seed=s, ignore_eos=True, **settings)
                  for s in range(start, start + BATCH)]
        toks += [o.outputs[0].token_ids for o in llm.generate([PROMPT] * BATCH, params, use_tqdm=False)]
    return np.array(toks)


def _cells(expected: np.ndarray, n: int) -> np.ndarray:
    """bool[V]: tokens with a cell of their own; the others (expected below 1% or 20 times)
    are pooled into one, which keeps the degrees of freedom, and so the power, where the mass is."""
    return (expected >= 0.01) & (expected * n >= 20)


def _chi2_pvalue(samples: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square of samples (token ids) against the probabilities expected f64[V]."""
    n = len(samples)
    counts = np.bincount(samples, minlength=V).astype(np.float64)
    big = _cells(expected, n)
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum()) * n
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a token with probability 0 was sampled"
    if keep.sum() == 1:  # one possible outcome (top-p kept a single token), and only it was sampled
        return 1.0
    return float(scipy.stats.chisquare(obs[keep], exp[keep]).pvalue)


def _tiny_llm(target, spec: dict | None):
    return LLM(str(target), progress=False, max_num_seqs=BATCH, max_num_batched_tokens=8192, num_gpu_blocks_override=2048, block_size=16,
               speculative_config=spec)


def _spec(method: str, draft) -> dict:
    spec = {"method": method, "num_speculative_tokens": K, "disable_by_batch_size": BATCH}
    return spec | ({"model": str(draft)} if method == "draft_model" else {})


ALPHA = 1e-3  # per position and setting; the samples are seeded, so each outcome is reproducible
N_SLOW = 24 * BATCH  # samples per setting in the slow test


@pytest.mark.parametrize("setting", ["top_k_top_p"])
def test_draft_model_samples_the_exact_distribution(tiny_vocab, setting):
    """The default run's check, on 512 seeds: tokens 1..4 after the prompt (2..4 come from a
    verification step that accepted some drafts and resampled after a rejection)."""
    target, draft, w = tiny_vocab
    llm = _tiny_llm(target, _spec("draft_model", draft))
    pool = llm.engine.state.draft_kv[0][0]
    got = _sample_tokens(llm, SETTINGS[setting], BATCH)
    assert pool.is_deleted()  # the draft's pools are donated to the steps, never copied
    st = llm.engine.spec_stats
    assert st.drafted > 0 and 0 < st.accepted < st.drafted  # drafts both accepted and rejected
    want = _exact_marginals(w, SETTINGS[setting])
    for j in range(4):
        assert _chi2_pvalue(got[:, j], want[j]) > ALPHA, f"token {j + 1}"


@pytest.mark.slow  # about a minute per method on an idle 2-core CPU
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculative_sampling_matches_plain_distribution(tiny_vocab, method):
    """N_SLOW seeds per setting: enough to catch a 2% bias (see the power check below)."""
    target, draft, w = tiny_vocab
    llm = _tiny_llm(target, _spec(method, draft))
    for setting, params in SETTINGS.items():
        before = llm.engine.spec_stats.accepted
        got = _sample_tokens(llm, params, N_SLOW)
        assert llm.engine.spec_stats.accepted > before
        want = _exact_marginals(w, params)
        for j in range(4):
            assert _chi2_pvalue(got[:, j], want[j]) > ALPHA, f"{setting}: token {j + 1}"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_chi_square_catches_a_two_percent_bias(tiny_vocab, setting):
    """Power check at the slow test's sample size: a sampler that moves 2% of the probability
    from the most likely token to the second (of any generated position) fails the same test,
    and its exact power (noncentral chi-square) is at least 0.9."""
    *_, w = tiny_vocab
    want = _exact_marginals(w, SETTINGS[setting])
    n = N_SLOW
    rng = np.random.default_rng(0)
    for j in range(4):
        p = want[j]
        a, b = np.argsort(p)[::-1][:2]
        biased = p.copy()
        biased[a] -= 0.02
        biased[b] += 0.02
        assert _chi2_pvalue(rng.choice(V, n, p=biased), p) < ALPHA  # the biased sampler fails
        assert _chi2_pvalue(rng.choice(V, n, p=p), p) > ALPHA  # an exact one passes
        big = _cells(p, n)
        cells = big.sum() + (~big).any()
        lam = n * sum((biased[t] - p[t]) ** 2 / p[t] for t in (a, b))
        crit = scipy.stats.chi2.isf(ALPHA, cells - 1)
        assert scipy.stats.ncx2.sf(crit, cells - 1, lam) >= 0.9, f"token {j + 1}: too few samples"


# ----------------------------------------------------------------------------- bad configs
@pytest.mark.parametrize("cfg,msg", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "draft_model needs model"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 16\]"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "quantization": "fp8"}, "quantization must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "quantization applies to draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model applies to medusa, eagle and draft_model"),
])
def test_bad_draft_config_is_one_clear_error(cfg, msg):
    with pytest.raises(InvalidRequest, match=msg):
        SpeculativeConfig.parse(cfg, 30)


def test_draft_with_another_vocabulary_is_refused(tiny_gguf, tiny_vocab, capsys):
    from jaxinfer.cli import main

    draft = tiny_vocab[1]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(InvalidRequest, match=r"vocabulary of 32 tokens; the target's has 49152"):
        LLM(str(tiny_gguf), progress=False, speculative_config=spec)
    assert main(["generate", "--model", str(tiny_gguf), "--prompt", "hi", "--speculative-config", json.dumps(spec)]) == 2
    err = capsys.readouterr().err
    assert "vocabulary of 32 tokens" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- real SmolLM2, greedy
def _greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def _golden_ids(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=len(GOLDEN[0]["greedy_ids"]), ignore_eos=True,
                        skip_special_tokens=False)
    return [o.outputs[0].token_ids for o in llm.generate([c["prompt_ids"] for c in GOLDEN], sp, use_tqdm=False)]


def test_random_draft_gives_the_goldens(smollm2_gguf, tiny_gguf):
    """A random draft (a tiny Llama with SmolLM2's vocabulary) is rejected nearly always, and
    the output is still the transformers goldens token for token."""
    llm = LLM(str(smollm2_gguf), max_model_len=1024, progress=False, kv_cache_memory_bytes=KV_BYTES,
              speculative_config={"method": "draft_model", "model": str(tiny_gguf), "num_speculative_tokens": 2,
                                  "disable_by_batch_size": 16})
    assert _golden_ids(llm) == [c["greedy_ids"] for c in GOLDEN]
    st = llm.engine.spec_stats
    assert st.steps > 0 and st.drafted > 0 and st.accepted < st.drafted / 4


DRAFT_INT8 = {"method": "draft_model", "model": "smollm2-135m-instruct", "quantization": "int8",
              "num_speculative_tokens": 3, "disable_by_batch_size": 16}


@pytest.fixture(scope="module")
def int8_draft_llm(smollm2_gguf):
    return LLM(str(smollm2_gguf), max_model_len=1024, progress=False, kv_cache_memory_bytes=KV_BYTES,
               speculative_config=DRAFT_INT8 | {"model": str(smollm2_gguf)})


@pytest.mark.slow  # a second copy of SmolLM2 drafting: compiles take minutes on 2 cores
def test_int8_draft_gives_the_goldens(int8_draft_llm):
    assert _golden_ids(int8_draft_llm) == [c["greedy_ids"] for c in GOLDEN]
    st = int8_draft_llm.engine.spec_stats
    assert st.accepted > st.drafted / 2  # the quantized model agrees with the float one mostly
    summary = st.summary()
    assert len(summary["spec_acceptance_by_position"]) == 3 and summary["spec_acceptance_by_position"][0] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
def test_int8_draft_batched_mixed_acceptance_equals_plain(int8_draft_llm, smollm2_llm, batch):
    from tests.test_spec_engine import MIXED

    prompts = MIXED[:batch]
    sp = _greedy(40)
    want = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, sp, use_tqdm=False)]
    before = int8_draft_llm.engine.spec_stats.summary()
    outs = int8_draft_llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    st = int8_draft_llm.engine.spec_stats
    assert st.accepted > before["spec_accepted_tokens"]
    if batch > 1:  # the open prompts reject some (the one batch-1 prompt, a copy, may accept all)
        assert st.drafted - before["spec_drafted_tokens"] > st.accepted - before["spec_accepted_tokens"]
    assert sum(o.metrics.spec_accepted_tokens for o in outs) == st.accepted - before["spec_accepted_tokens"]


@pytest.mark.slow
def test_blocks_end_at_max_tokens_stop_strings_and_eos(int8_draft_llm, smollm2_llm):
    prompt = "Repeat after me ten times: apple banana cherry apple banana cherry apple banana cherry"
    full = smollm2_llm.generate([prompt], _greedy(60), use_tqdm=False)[0].outputs[0]
    for n in (5, 6, 7, 13):
        a = smollm2_llm.generate([prompt], _greedy(n), use_tqdm=False)[0].outputs[0]
        b = int8_draft_llm.generate([prompt], _greedy(n), use_tqdm=False)[0]
        assert b.outputs[0].token_ids == a.token_ids and len(a.token_ids) == n
        assert b.outputs[0].finish_reason == "length" and b.metrics.num_generated_tokens == n
    stop = full.text[len(full.text) // 2:][:7]
    a = smollm2_llm.generate([prompt], _greedy(60, stop=[stop]), use_tqdm=False)[0]
    b = int8_draft_llm.generate([prompt], _greedy(60, stop=[stop]), use_tqdm=False)[0]
    assert a.outputs[0].finish_reason == "stop"
    assert (b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason) == \
        (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason)
    assert b.metrics.num_generated_tokens == a.metrics.num_generated_tokens
    conv = [{"role": "user", "content": "Copy exactly: one two three four."}]
    a = smollm2_llm.chat(conv, _greedy(64), use_tqdm=False)[0]
    b = int8_draft_llm.chat(conv, _greedy(64), use_tqdm=False)[0]
    assert a.outputs[0].finish_reason == "stop"
    assert (b.outputs[0].token_ids, b.outputs[0].finish_reason, b.outputs[0].text) == \
        (a.outputs[0].token_ids, a.outputs[0].finish_reason, a.outputs[0].text)
    assert b.metrics.num_generated_tokens == a.metrics.num_generated_tokens == len(a.outputs[0].token_ids)
    assert b.metrics.spec_accepted_tokens > 0


@pytest.mark.slow
def test_draft_equal_to_target_accepts_everything(smollm2_gguf, smollm2_llm):
    """q = p: every draft is accepted, greedy or sampled (min(1, p/q) = 1), and greedy
    output equals decoding without speculation; the preemption / prefix-cache / int8-KV setting
    of the ngram test runs too."""
    kw = dict(max_model_len=256, progress=False, num_gpu_blocks_override=12, block_size=16, kv_cache_dtype="int8", max_num_seqs=4)
    spec = {"method": "draft_model", "model": str(smollm2_gguf), "num_speculative_tokens": 3}
    plain = LLM(str(smollm2_gguf), **kw)
    llm = LLM(str(smollm2_gguf), speculative_config=spec, **kw)
    from tests.test_spec_engine import MIXED

    prompts = [MIXED[0], MIXED[4], MIXED[0], MIXED[6]]
    sp = _greedy(48, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    assert llm.engine.stats["preemptions"] > 0 and llm.engine.stats["cached_prompt_tokens"] > 0
    st = llm.engine.spec_stats
    assert st.drafted > 0 and st.accepted == st.drafted
    outs = llm.generate(prompts[:2], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=1, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert st.accepted == st.drafted
