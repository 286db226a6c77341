"""The family registry: every listed family file builds the one ModelFamily it is found by,
checkpoints are matched to exactly one family, and unknown names are refused with the list."""

import pytest

from jaxinfer.errors import CheckpointError
from jaxinfer.models import registry
from jaxinfer.models.family import ModelFamily


def test_every_listed_family_builds_its_own_family_object():
    families = registry.all_families()
    assert [f.name for f in families] == list(registry.FAMILIES)
    assert all(isinstance(f, ModelFamily) for f in families)
    assert {"glm4", "granite"} <= set(registry.FAMILIES)


def test_each_hf_architecture_belongs_to_one_family():
    seen: dict[str, str] = {}
    for f in registry.all_families():
        for arch in f.hf_architectures:
            assert arch not in seen, f"{arch} listed by {seen[arch]} and {f.name}"
            seen[arch] = f.name
            assert registry.family_for_hf({"architectures": [arch]}, "ckpt") is f


def test_unknown_names_are_refused_with_what_is_known(tmp_path):
    with pytest.raises(ValueError, match="unknown model family 'nope' .*known: llama"):
        registry.model_family("nope")
    with pytest.raises(CheckpointError, match="unsupported architecture FooForCausalLM .*Glm4ForCausalLM"):
        registry.family_for_hf({"architectures": ["FooForCausalLM"]}, tmp_path)
    with pytest.raises(CheckpointError, match="unsupported architecture 'foo'"):
        registry.family_for_gguf("foo", tmp_path)


def test_gguf_llama_goes_to_mixtral_only_with_experts():
    assert registry.family_for_gguf("llama", "x", {"general.architecture": "llama", "llama.expert_count": 8}).name == "mixtral"
    assert registry.family_for_gguf("llama", "x", {"general.architecture": "llama"}).name == "llama"
