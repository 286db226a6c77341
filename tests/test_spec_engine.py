"""Speculative decoding through the engine on the real checkpoints: greedy output with
speculation equals the transformers goldens and decoding without it, token for token, for
every method, batched with mixed acceptance; blocks that cross max_tokens, stop strings and
EOS end at the right token; logprobs, preemption, prefix caching and the int8 KV cache hold;
bad configurations get one clear error."""

import json
from pathlib import Path

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.speculative import SpeculativeConfig, ngram_propose
from jaxinfer.errors import InvalidRequest

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2-135m-instruct.json").read_text())["prompts"]
GEMMA = json.loads((Path(__file__).parent / "golden" / "gemma-3-270m.json").read_text())["prompts"]
KV_BYTES = 256 << 20  # page pools of 256 MB (the default 2 GB each would crowd a test worker's memory)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 16}
EARLY = {"method": "early_exit", "num_speculative_tokens": 2, "num_layers": 24, "disable_by_batch_size": 16}
MEDUSA = {"method": "medusa", "num_speculative_tokens": 3, "disable_by_batch_size": 16,
          "model": str(Path(__file__).parent.parent / "checkpoints" / "medusa-smollm2-135m-instruct")}
EAGLE = {"method": "eagle", "num_speculative_tokens": 2, "disable_by_batch_size": 16,
         "model": str(Path(__file__).parent.parent / "checkpoints" / "eagle-smollm2-135m-instruct")}
MIXED = [  # input-grounded prompts (drafts accepted) among open ones (drafts mostly rejected)
    "Copy exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
    "Tell me about the moon.",
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):\n",
    "Name three colours.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Why is the sky blue?",
    "red green blue red green blue red green blue",
    "Write a haiku about rain.",
]


@pytest.fixture(scope="module")
def ngram_llm(smollm2_gguf):
    return LLM(str(smollm2_gguf), max_model_len=1024, progress=False, speculative_config=NGRAM, kv_cache_memory_bytes=KV_BYTES)


def _greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_ngram_lookup_by_hand():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 2, 1, 3) == [9, 1]  # suffix 1 2 3 seen at 0
    assert ngram_propose([5, 1, 2, 7, 1, 2], 3, 1, 4) == [7, 1, 2]
    assert ngram_propose([1, 2, 3, 4], 2, 1, 3) == []  # nothing recurs
    assert ngram_propose([4, 4, 4], 5, 1, 2) == [4]  # the latest occurrence, cut at the end
    assert ngram_propose([3, 1, 2, 8, 3, 1, 2], 1, 2, 2) == [8]


# EAGLE's default-suite goldens are tests/test_eagle.py's engine tests (greedy output kept)
@pytest.mark.parametrize("spec", [NGRAM, pytest.param(EARLY, marks=pytest.mark.slow),
                                  pytest.param(MEDUSA, marks=pytest.mark.slow), pytest.param(EAGLE, marks=pytest.mark.slow),
                                  pytest.param({**EAGLE, "branches": 3}, marks=pytest.mark.slow)],
                         ids=["ngram", "early_exit", "medusa", "eagle", "eagle_branches"])
def test_greedy_equals_transformers_goldens(smollm2_gguf, spec, request):
    if spec is NGRAM:  # the module's n-gram engine, built with these very settings
        llm = request.getfixturevalue("ngram_llm")
    else:
        llm = LLM(str(smollm2_gguf), max_model_len=1024, progress=False, speculative_config=spec, kv_cache_memory_bytes=KV_BYTES)
    sp = SamplingParams(temperature=0.0, max_tokens=len(GOLDEN[0]["greedy_ids"]), ignore_eos=True,
                        skip_special_tokens=False)
    before = llm.engine.spec_stats.summary()  # the shared n-gram engine may have run already
    outs = llm.generate([c["prompt_ids"] for c in GOLDEN], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [c["greedy_ids"] for c in GOLDEN]
    st = llm.engine.spec_stats  # speculation really ran, in this test
    assert st.steps > before["spec_steps"] and st.drafted > before["spec_drafted_tokens"]
    assert st.accepted > before["spec_accepted_tokens"]


@pytest.mark.slow  # 30 s: a second real model loaded and compiled with speculation
def test_gemma_goldens_with_ngram(gemma3_gguf):
    # 8 slots: the window pools of the default 64 would take the whole 256 MB
    llm = LLM(str(gemma3_gguf), max_model_len=1024, progress=False, speculative_config=NGRAM, kv_cache_memory_bytes=KV_BYTES,
              max_num_seqs=8)
    sp = SamplingParams(temperature=0.0, max_tokens=len(GEMMA[0]["greedy_ids"]), ignore_eos=True,
                        skip_special_tokens=False)
    outs = llm.generate([c["prompt_ids"] for c in GEMMA], sp, use_tqdm=False)  # past_window crosses the window
    exact = sum(o.outputs[0].token_ids == c["greedy_ids"] for c, o in zip(GEMMA, outs))
    assert exact >= len(GEMMA) - 1  # the golden test's allowance (one near-tie prompt)
    assert llm.engine.spec_stats.accepted > 0


@pytest.mark.slow  # 40 s each: Gemma 3 loaded and compiled with an EAGLE head
@pytest.mark.parametrize("branches", [1, 2])
def test_gemma_goldens_with_an_eagle_head(gemma3_gguf, tmp_path, monkeypatch, branches):
    """A random EAGLE head on Gemma 3 (sliding-window layers; the head's own layer is global):
    its drafts are mostly rejected, and the output is still the goldens'. With two branches,
    branch 1 carries the goldens' own continuation, so the kept chain is mostly branch 1 and its
    keys reach both the full-length and the window pools."""
    import jax
    import numpy as np

    from jaxinfer.models import eagle

    from jaxinfer.loaders.gguf import GGUFCheckpoint
    from jaxinfer.models import gemma3

    ck = GGUFCheckpoint(gemma3_gguf)
    cfg = gemma3.config_from_gguf(ck.metadata, ck.tensors, dtype="float32", load_tensor=ck.load)
    eagle.save_head(tmp_path / "h", eagle.init_head(cfg, jax.random.PRNGKey(0)), np.arange(4096, dtype=np.int32),
                    cfg)
    # 8 slots: the window pools of the default 64 would take the whole 256 MB
    llm = LLM(str(gemma3_gguf), max_model_len=1024, progress=False, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=8,
              speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "h"),
                                  "disable_by_batch_size": 16, "branches": branches})
    if branches > 1:
        from jaxinfer.engine import drafting

        want = {tuple(c["prompt_ids"]): c["greedy_ids"] for c in GEMMA}
        orig = drafting.Drafter.branch_drafts

        def truth(self, R, k, rows):
            out = orig(self, R, k, rows)
            for s in self.eng.sched.slots:
                if s is not None and s.slot in rows:
                    n, d = len(s.row.token_ids), len(rows[s.slot])
                    out[s.slot, 0, :d] = (want[tuple(s.row.prompt_ids)][n: n + d] + [0] * d)[:d]
            return out

        monkeypatch.setattr(drafting.Drafter, "branch_drafts", truth)
    sp = SamplingParams(temperature=0.0, max_tokens=len(GEMMA[0]["greedy_ids"]), ignore_eos=True,
                        skip_special_tokens=False)
    outs = llm.generate([c["prompt_ids"] for c in GEMMA], sp, use_tqdm=False)
    exact = sum(o.outputs[0].token_ids == c["greedy_ids"] for c, o in zip(GEMMA, outs))
    assert exact >= len(GEMMA) - 1  # the golden test's allowance (one near-tie prompt)
    st = llm.engine.spec_stats
    assert st.drafted > 0
    if branches > 1:
        assert st.accepted > 0.5 * st.drafted, st.summary()


@pytest.mark.parametrize("batch", [1, pytest.param(8, marks=pytest.mark.slow)])
def test_batched_mixed_acceptance_equals_plain(ngram_llm, smollm2_llm, batch):
    sp = _greedy(40)
    prompts = MIXED[:batch]
    want = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, sp, use_tqdm=False)]
    before = ngram_llm.engine.spec_stats.summary()
    got = [o.outputs[0].token_ids for o in ngram_llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    after = ngram_llm.engine.spec_stats
    assert after.accepted > before["spec_accepted_tokens"]
    assert after.drafted - before["spec_drafted_tokens"] > after.accepted - before["spec_accepted_tokens"]  # some rejected


def test_blocks_end_at_max_tokens_stop_strings_and_eos(ngram_llm, smollm2_llm):
    prompt = "Repeat after me ten times: apple banana cherry apple banana cherry apple banana cherry"
    full = smollm2_llm.generate([prompt], _greedy(60), use_tqdm=False)[0].outputs[0]
    # max_tokens that lands inside an accepted block
    for n in (5, 6, 7, 13):
        a = smollm2_llm.generate([prompt], _greedy(n), use_tqdm=False)[0].outputs[0]
        b = ngram_llm.generate([prompt], _greedy(n), use_tqdm=False)[0]
        assert b.outputs[0].token_ids == a.token_ids and len(a.token_ids) == n
        assert b.outputs[0].finish_reason == "length" and b.metrics.num_generated_tokens == n
    # a stop string in the middle of the repeated text
    stop = full.text[len(full.text) // 2:][:7]
    a = smollm2_llm.generate([prompt], _greedy(60, stop=[stop]), use_tqdm=False)[0].outputs[0]
    b = ngram_llm.generate([prompt], _greedy(60, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason) and a.finish_reason == "stop"
    # EOS: a chat answer that ends by itself
    conv = [{"role": "user", "content": "Copy exactly: one two three four."}]
    a = smollm2_llm.chat(conv, _greedy(64), use_tqdm=False)[0].outputs[0]
    b = ngram_llm.chat(conv, _greedy(64), use_tqdm=False)[0].outputs[0]
    assert a.finish_reason == "stop" and (b.token_ids, b.finish_reason, b.text) == (a.token_ids, a.finish_reason, a.text)


@pytest.mark.slow
def test_chained_blocks_equal_host_built_ones(smollm2_gguf, smollm2_llm, monkeypatch):
    """EAGLE verification steps dispatched before the host read the previous one (each row
    moved on by the unread step's accepted drafts on device, ``verify.chain_block``) give what
    host-built blocks give: the same tokens, finish reasons and acceptance counts, with
    max_tokens and a stop string landing inside blocks, one request at a time and three at
    once; and plain decoding's tokens."""
    from jaxinfer.engine import drafting

    llm = LLM(str(smollm2_gguf), max_model_len=1024, progress=False, speculative_config=EAGLE, kv_cache_memory_bytes=KV_BYTES)
    prompts = [MIXED[0], MIXED[4], MIXED[2]]
    half = smollm2_llm.generate([MIXED[4]], _greedy(48), use_tqdm=False)[0].outputs[0].text
    params = [_greedy(37), _greedy(48, stop=[half[len(half) // 2:][:6]]), _greedy(9)]
    want = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text)
            for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    assert want[1][1] == "stop"
    chained = []
    orig = drafting.Drafter.chained_block
    monkeypatch.setattr(drafting.Drafter, "chained_block", lambda self, *a: chained.append(1) or orig(self, *a))

    def run(chain: bool):
        monkeypatch.setattr(drafting.Drafter, "chains", lambda self: chain)
        llm.engine.spec_stats.__init__(EAGLE["num_speculative_tokens"])
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
        outs += llm.generate(prompts, params, use_tqdm=False)
        st = llm.engine.spec_stats
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs], \
            (st.drafted, st.accepted, st.by_position, st.drafted_by_position)

    got, stats = run(True)
    assert len(chained) > 20
    assert got == want * 2
    assert (got, stats) == run(False) and stats[1] > 0


def test_logprobs_of_accepted_tokens_equal_plain(ngram_llm, smollm2_llm):
    prompt = MIXED[0]
    sp = _greedy(24, logprobs=3)
    a = smollm2_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    b = ngram_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for pa, pb in zip(a.logprobs, b.logprobs):
        assert list(pa) == list(pb)
        for t in pa:
            assert abs(pa[t].logprob - pb[t].logprob) < 1e-3 and pa[t].rank == pb[t].rank
    assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-2


@pytest.mark.slow  # 2 min on 2 cores: two engines with int8 KV compiled
def test_preemption_prefix_cache_and_int8_kv(smollm2_gguf):
    """A pool too small for every row preempts; the repeated prompts hit the prefix cache; the
    KV cache is int8. Speculation on and off agree under the same engine settings."""
    kw = dict(max_model_len=256, progress=False, num_gpu_blocks_override=12, block_size=16, kv_cache_dtype="int8", max_num_seqs=4)
    plain = LLM(str(smollm2_gguf), **kw)
    spec = LLM(str(smollm2_gguf), speculative_config=NGRAM, **kw)
    prompts = [MIXED[0], MIXED[4], MIXED[0], MIXED[6]]
    sp = _greedy(48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert spec.engine.stats["preemptions"] > 0 and spec.engine.stats["cached_prompt_tokens"] > 0
    assert spec.engine.allocator.num_used == 0 or spec.engine.allocator.check_invariants() is None


def test_sampled_rows_run_and_report_acceptance(ngram_llm):
    outs = ngram_llm.generate([MIXED[0]] * 3, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=32, seed=5),
                              use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)
    toks = [o.outputs[0].token_ids for o in outs]
    assert toks[1] == toks[0] and toks[2] == toks[0]  # same prompt and seed: same tokens in any slot
    m = outs[0].metrics
    assert m.spec_drafted_tokens >= m.spec_accepted_tokens >= 0


@pytest.mark.parametrize("cfg,msg", [
    ({"method": "medusa2", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 16\]"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "early_exit", "num_speculative_tokens": 2}, "needs num_layers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown field"),
    ("{not json", "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "branches": 2}, "branches applies to eagle"),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "h", "branches": 0}, r"branches must be in \[1, 8\]"),
])
def test_bad_config_is_one_clear_error(cfg, msg):
    with pytest.raises(InvalidRequest, match=msg):
        SpeculativeConfig.parse(cfg, 30)


_EAGLE = {"method": "eagle", "num_speculative_tokens": 2, "model": "h"}


@pytest.mark.parametrize("spec,mesh,lora,msg", [
    (NGRAM, (2, 1, 1), False, "speculative decoding is not supported with data_parallel_size > 1"),
    (EARLY, (1, 2, 1), False, "early_exit is not supported with pipeline_parallel_size > 1"),
    (dict(_EAGLE, branches=2), (1, 2, 1), False, "branches > 1 is not supported with pipeline_parallel_size > 1"),
    (_EAGLE, (1, 1, 2), False, "method eagle does not run with tensor parallelism yet"),
    (NGRAM, None, True, "speculative decoding with LoRA adapters"),
    (None, (2, 1, 1), True, "LoRA adapters .* data_parallel_size > 1"),
    (None, (1, 2, 1), True, "LoRA adapters .* pipeline_parallel_size > 1"),
])
def test_options_that_do_not_compose_are_refused_in_one_place(spec, mesh, lora, msg):
    """The engine step composes speculation, pipeline stages, tensor parallelism and adapters;
    what it does not is refused by one check, with the reason."""
    from types import SimpleNamespace

    from jaxinfer.engine.config import check_combination

    m = None if mesh is None else SimpleNamespace(shape=dict(zip(("data", "stage", "model"), mesh)))
    with pytest.raises(InvalidRequest, match=msg):
        check_combination(None if spec is None else SpeculativeConfig.parse(spec, 30), m, lora=lora)


@pytest.mark.parametrize("spec,mesh", [(NGRAM, (1, 2, 1)), ({"method": "medusa", "num_speculative_tokens": 2,
                                                             "model": "h"}, (1, 2, 2)), (NGRAM, (1, 1, 2))])
def test_speculation_composes_with_pipeline_stages_and_tensor_parallelism(spec, mesh):
    from types import SimpleNamespace

    from jaxinfer.engine.config import check_combination

    m = SimpleNamespace(shape=dict(zip(("data", "stage", "model"), mesh)))
    check_combination(SpeculativeConfig.parse(spec, 30), m, lora=False)


def test_early_exit_layers_checked_against_the_model(smollm2_gguf):
    with pytest.raises(InvalidRequest, match=r"num_layers must be in \[1, 29\]"):
        LLM(str(smollm2_gguf), progress=False, kv_cache_memory_bytes=KV_BYTES,
            speculative_config={"method": "early_exit", "num_speculative_tokens": 2, "num_layers": 30})


@pytest.mark.parametrize("cmd", ["generate", "batch", "bench", "warmup"])
def test_cli_bad_speculative_config_exits_2(cmd, tmp_path, capsys):
    from jaxinfer.cli import main

    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    args = {"generate": ["generate", "--prompt", "hi"], "batch": ["batch", str(src), "-o", str(tmp_path / "o.jsonl")],
            "bench": ["bench"], "warmup": ["warmup"]}[cmd]
    assert main(args + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}']) == 2
    err = capsys.readouterr().err
    assert "num_speculative_tokens must be in [1, 16], got 0" in err and err.count("\n") == 1


def test_cli_generate_with_speculation_reports_acceptance(smollm2_gguf, capsys):
    from jaxinfer.cli import main

    assert main(["generate", "--model", str(smollm2_gguf), "--prompt", MIXED[6], "--max-tokens", "16", "--json",
                 "--speculative-config", json.dumps(NGRAM)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec_drafted_tokens"] >= out["spec_accepted_tokens"] > 0


def test_grammar_constrained_rows_speculate_within_their_grammar(ngram_llm, smollm2_llm):
    """Drafts of a row under a JSON schema are cut to what the grammar allows and every block
    position is masked by the grammar's state there: the same tokens as without speculation,
    valid JSON, and drafts really accepted."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    conv = [{"role": "user", "content": 'Copy this JSON exactly: {"name": "Alice Johnson", "age": 30}'}]
    sp = SamplingParams(temperature=0, max_tokens=40, guided_decoding={"json": schema})
    a = smollm2_llm.chat(conv, sp, use_tqdm=False)[0].outputs[0]
    before = ngram_llm.engine.spec_stats.accepted
    b = ngram_llm.chat(conv, sp, use_tqdm=False)[0]
    assert b.outputs[0].token_ids == a.token_ids and b.outputs[0].text == a.text
    assert json.loads(b.outputs[0].text)["age"] == 30
    assert ngram_llm.engine.spec_stats.accepted > before and b.metrics.spec_accepted_tokens > 0
