"""Shared fixtures: the real checkpoints (fetched once into $JAXINFER_HOME) and CPU setup."""

import ctypes
import ctypes.util
import gc
import importlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

# the object stores on 127.0.0.1 (object_stores, store), for the tests that read and write buckets
pytest_plugins = ["tests.storage_servers"]

# Every test process keeps its executables in JAX's persistent compilation cache, where an
# ``LLM`` keeps them: tests build the same tiny models' steps again and again, in both workers
# and from one run to the next, and loading one back costs a fraction of compiling it. The
# counts tests make of an engine's executables are of lowerings, which a cache hit still does.
from jaxinfer.llm import enable_compilation_cache  # noqa: E402

enable_compilation_cache()

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if os.name == "posix" else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Hand freed memory back to the system after each test. XLA's CPU buffers come from
    glibc's heap, which keeps what a finished engine freed (three engines built and dropped
    left 1.5 GB; ``malloc_trim`` brought it to 0.3 GB). With that and the session fixtures, a
    test worker reached 12.6 GB and was OOM-killed on 24 GB."""
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()  # the module's fixtures are gone; so are their cycles
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require(module: str):
    """``pytest.importorskip(module)``, except under CI=true, where the reference extra is
    installed: there a missing module fails the run instead of skipping tests quietly."""
    if not on_ci():
        return pytest.importorskip(module)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"CI=true and {module!r} cannot be imported ({e}); install the reference extra",
                    pytrace=False)


def require_native(library: str) -> None:
    """Skip the calling test where the native library ``library`` (a key of
    ``cpu_kernels.LIBRARIES``) is not loaded: this CPU lacks its instructions, an environment
    variable turns it off, or it did not build. Under CI=true a CPU that has the instructions
    but no library fails the test with the build's error instead: a broken toolchain must not
    pass as a CPU without AVX-512."""
    from jaxinfer import cpu_kernels

    state = cpu_kernels.library_status(library)
    if state.loaded:
        return
    if state.failed and on_ci():
        pytest.fail(f"CI=true and this CPU runs {library}, but {state.reason}", pytrace=False)
    pytest.skip(state.reason)


@pytest.fixture
def int8_kernels():
    require_native("int8_gemv")


@pytest.fixture
def f32_kernels():
    require_native("f32_gemv")


@pytest.fixture
def attention_kernels():
    require_native("paged_attention")


@pytest.fixture
def amx_kernel():
    from jaxinfer import cpu_kernels

    require_native("int8_amx")
    if not cpu_kernels.amx_available():
        pytest.skip("Linux does not grant this process AMX's tile state")


@pytest.fixture
def f32_packed_kernel(f32_kernels):
    from jaxinfer import cpu_kernels

    if not cpu_kernels.f32_packed_available():
        pytest.skip("f32_gemm_packed needs AVX-512F")


@pytest.fixture(scope="session")
def smollm2_gguf():
    from jaxinfer import registry

    return registry.fetch("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf():
    from jaxinfer import registry

    return registry.fetch("gemma-3-270m", progress=False)


def require_reference():
    """The independent reference (torch + transformers): skip without it, fail under CI."""
    require("torch")
    return require("transformers")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    """The real SmolLM2 loaded once for the whole session (float32, CPU). Page pools of
    512 MB, not the default 2 GB: a test worker holds its session fixtures to the end, and two
    workers with 2 GB pools each, besides the tests' own engines, crowded 24 GB (OOM kill)."""
    from jaxinfer import LLM

    return LLM(str(smollm2_gguf), max_model_len=1024, progress=False, kv_cache_memory_bytes=512 << 20)


@pytest.fixture(scope="session")
def gemma3_llm(gemma3_gguf):
    """The real Gemma 3 270M loaded once for the whole session (float32, CPU). 16 slots in
    512 MB of pools: the default 64 slots' window pools alone would take most of 512 MB, and the
    default 2 GB, held by a worker to the end of the session, helped crowd 24 GB."""
    from jaxinfer import LLM

    return LLM(str(gemma3_gguf), max_model_len=1024, progress=False, kv_cache_memory_bytes=512 << 20, max_num_seqs=16)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, smollm2_gguf):
    """A tiny random Llama GGUF carrying SmolLM2's real tokenizer."""
    from tests.tiny_gguf import write_tiny_llama

    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_llama(path, smollm2_gguf, layers=2, d=64, heads=4, kv_heads=2, ff=128, context=512)
    return path


@pytest.fixture(scope="session")
def tiny_llm(tiny_gguf):
    from jaxinfer import LLM

    return LLM(str(tiny_gguf), progress=False, max_num_seqs=8, kv_cache_memory_bytes=64 << 20)  # 131,072 tokens
