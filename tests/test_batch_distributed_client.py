"""The one reach into JAX's private jax._src.distributed fails with a clear message."""

import sys

import pytest

from jaxinfer.batch import distributed
from jaxinfer.errors import InvalidRequest


def test_without_a_distributed_job_it_says_how_to_start_one():
    with pytest.raises(InvalidRequest, match="process_count > 1 needs jax.distributed"):
        distributed.coordination_client()


def test_when_jax_moves_it_the_error_names_what_moved(monkeypatch):
    import jax._src

    monkeypatch.delattr(jax._src, "distributed", raising=False)
    monkeypatch.setitem(sys.modules, "jax._src.distributed", None)  # the import now fails
    with pytest.raises(RuntimeError, match=r"no longer has jax\._src\.distributed\.global_state.*coordination_client"):
        distributed.coordination_client()
