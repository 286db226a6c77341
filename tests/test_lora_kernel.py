"""The LoRA delta op (``pallas_kernels.lora``): the XLA reference against a case worked by hand,
then the Pallas kernel (interpret mode) against the reference over dtypes, slot counts, ranks and
block sizes, rows of no adapter (-1) among them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora import BlockSizes, lora_delta_kernel, lora_delta_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def test_reference_by_hand():
    x = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    a = jnp.zeros((2, 2, 1)).at[:, 0, 0].set(jnp.array([1.0, 0.0])).at[:, 1, 0].set(jnp.array([0.0, 1.0]))
    b = jnp.zeros((2, 1, 3)).at[0, 0].set(jnp.array([1.0, 2.0, 3.0])).at[1, 0].set(jnp.array([-1.0, 0.0, 1.0]))
    out = lora_delta_reference(x, a, b, jnp.array([0, 1, -1]))
    # row 0: slot 0 reads x[0, 0] = 1 -> [1, 2, 3]; row 1: slot 1 reads x[1, 1] = 4 -> [-4, 0, 4]; row 2: none
    np.testing.assert_array_equal(out, [[1.0, 2.0, 3.0], [-4.0, 0.0, 4.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M,I,S,R,O,blocks", [(13, 64, 3, 8, 256, None), (64, 128, 8, 16, 384, BlockSizes(16, 128)),
                                              (5, 32, 1, 4, 128, None)])
def test_kernel_equals_reference(dtype, M, I, S, R, O, blocks):
    k = jax.random.split(jax.random.key(M * S), 4)
    x = jax.random.normal(k[0], (M, I), dtype)
    a = (jax.random.normal(k[1], (I, S, R)) * I**-0.5).astype(dtype)
    b = jax.random.normal(k[2], (S, R, O), dtype)
    slots = jax.random.randint(k[3], (M,), -1, S)
    want = lora_delta_reference(x, a, b, slots)
    got = lora_delta_kernel(x, a, b, slots, block_sizes=blocks, interpret=True)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOL[dtype] * 4,
                               rtol=TOL[dtype])
    assert not np.asarray(got)[np.asarray(slots) < 0].any()


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="must equal"):
        lora_delta_reference(jnp.zeros((4, 8)), jnp.zeros((16, 2, 4)), jnp.zeros((2, 4, 8)), jnp.zeros(4, jnp.int32))
