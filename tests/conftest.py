"""Shared fixtures: the real checkpoints (fetched once into $JAXINFER_HOME) and CPU setup."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    from jaxinfer import registry

    return registry.fetch("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf():
    from jaxinfer import registry

    return registry.fetch("gemma-3-270m", progress=False)


def require_reference():
    """Skip unless the independent reference (torch + transformers) is installed."""
    pytest.importorskip("torch")
    return pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    """The real SmolLM2 loaded once for the whole session (float32, CPU)."""
    from jaxinfer import LLM

    return LLM(str(smollm2_gguf), max_model_len=1024, progress=False)
