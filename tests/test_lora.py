"""LoRA adapters (``jaxinfer.lora``) against transformers + PEFT float32 on tiny checkpoints:
each adapter alone, several adapters and base rows in one batch, the errors, and the prefix
cache keeping adapters apart."""

from __future__ import annotations


import numpy as np
import pytest

from tests import family_testing as ft
from tests.lora_testing import peft_reference, write_adapter
from tests.test_families import FAMILIES

pytestmark = pytest.mark.reference

KW = dict(max_model_len=128, progress=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=8)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama 3, two adapters over every projection (ranks 4 and 8, the second rsLoRA),
    and PEFT's outputs for each and for the base model."""
    root = tmp_path_factory.mktemp("lora_llama")
    base = ft.write_tiny(root / "base", "llama")
    a = write_adapter(base, root / "a", r=4, alpha=8, seed=1)
    b = write_adapter(base, root / "b", r=8, alpha=4, rslora=True, seed=2, targets=["q_proj", "v_proj", "down_proj"])
    return {"base": base, "a": a, "b": b,
            "ref": {k: peft_reference(base, None if k == "base" else p) for k, p in
                    (("base", None), ("a", a), ("b", b))}}


def lora(name, i, path):
    from jaxinfer import LoRARequest

    return LoRARequest(name, i, str(path))


def test_one_adapter_equals_peft(llama):
    from jaxinfer import LLM

    llm = LLM(str(llama["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, **KW)
    for name, i in (("a", 1), ("b", 2)):
        got = ft.outputs_of(llm.generate([list(p) for p in ft.PROMPTS], _greedy(), use_tqdm=False,
                                         lora_request=lora(name, i, llama[name])))
        ft.assert_matches(got, llama["ref"][name], what=f"adapter {name}")
        # the adapter changes the outputs: the comparison above is not the base model's
        assert np.abs(np.subtract(got[0]["prompt_logprobs"], llama["ref"]["base"][0]["prompt_logprobs"])).max() > 0.05
    ft.assert_matches(ft.generate(llm), llama["ref"]["base"], what="base rows of a LoRA engine")


def _greedy():
    from jaxinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=ft.MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)


def _adapters(root, base):
    """Three adapters of two ranks: every projection (r 4), rsLoRA on three (r 8), and the
    MLP of the first and last layers only (r 8)."""
    return {"a": write_adapter(base, root / "a", r=4, alpha=8, seed=1),
            "b": write_adapter(base, root / "b", r=8, alpha=4, rslora=True, seed=2,
                               targets=["q_proj", "v_proj", "down_proj"]),
            "c": write_adapter(base, root / "c", r=8, alpha=16, seed=3, targets=["gate_proj", "up_proj", "o_proj"],
                               layers=[0, 2])}


def check_mixed(base, adapters, refs, **kw):
    """Every prompt under each adapter and under none, all in one ``generate`` (one batch of
    rows of three adapters and base rows), each equal to transformers + PEFT."""
    from jaxinfer import LLM

    llm = LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=8, **(KW | {"max_num_seqs": 16} | kw))
    names = [None, *adapters]
    prompts = [list(p) for _ in names for p in ft.PROMPTS]
    reqs = [None if n is None else lora(n, list(adapters).index(n) + 1, adapters[n]) for n in names for _ in ft.PROMPTS]
    got = ft.outputs_of(llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=reqs))
    P = len(ft.PROMPTS)
    for j, n in enumerate(names):
        ft.assert_matches(got[j * P : (j + 1) * P], refs["base" if n is None else n], what=f"adapter {n} in a mixed batch")
    assert llm.engine.lora.swaps == len(adapters)
    return llm


def test_mixed_batch_equals_peft(llama, tmp_path):
    adapters = {"a": llama["a"], "b": llama["b"],
                "c": write_adapter(llama["base"], tmp_path / "c", r=8, alpha=16, seed=3,
                                   targets=["gate_proj", "up_proj", "o_proj"], layers=[0, 2])}
    refs = dict(llama["ref"], c=peft_reference(llama["base"], adapters["c"]))
    check_mixed(llama["base"], adapters, refs)


@pytest.mark.slow  # three references and an engine per family: a minute or two each
@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_mixed_batch_equals_peft_other_families(model_type, tmp_path):
    base = ft.write_tiny(tmp_path / "base", model_type, FAMILIES.get(model_type, {}))
    adapters = _adapters(tmp_path, base)
    refs = {"base": peft_reference(base, None)} | {n: peft_reference(base, p) for n, p in adapters.items()}
    check_mixed(base, adapters, refs)
