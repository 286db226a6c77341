"""The LoRA delta op (``pallas_kernels.lora``): the XLA reference against cases worked by hand,
then the Pallas kernel (interpret mode) against the reference over dtypes, slot counts, active-set
sizes, ranks and block sizes, rows of no adapter (-1) among them; and the host's active sets
(``engine.batch.lora_arrays``, ``engine.buckets.lora_bucket``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora import BlockSizes, lora_delta_kernel, lora_delta_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _hand_stacks():
    """Three slots of rank 1 over I = 2, O = 3: slot 0 reads x[:, 0] into [1, 2, 3], slot 1
    reads x[:, 1] into [-1, 0, 1], slot 2 reads x[:, 0] + x[:, 1] into [0, 10, 0]."""
    a = jnp.zeros((2, 3, 1)).at[:, 0, 0].set(jnp.array([1.0, 0.0])).at[:, 1, 0].set(jnp.array([0.0, 1.0]))
    a = a.at[:, 2, 0].set(jnp.array([1.0, 1.0]))
    b = jnp.zeros((3, 1, 3)).at[0, 0].set(jnp.array([1.0, 2.0, 3.0])).at[1, 0].set(jnp.array([-1.0, 0.0, 1.0]))
    return a, b.at[2, 0].set(jnp.array([0.0, 10.0, 0.0]))


def test_reference_by_hand():
    x = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    a, b = _hand_stacks()
    # every slot active, in order: row 0 on slot 0 -> x[0, 0] = 1 -> [1, 2, 3]; row 1 on slot 1
    # -> x[1, 1] = 4 -> [-4, 0, 4]; row 2 on none
    out = lora_delta_reference(x, a, b, jnp.array([0, 1, 2]), jnp.array([0, 1, -1]))
    np.testing.assert_array_equal(out, [[1.0, 2.0, 3.0], [-4.0, 0.0, 4.0], [0.0, 0.0, 0.0]])
    # two of the three slots active, [2, 1]: row 0 on index 0 = slot 2 -> 1 + 2 = 3 -> [0, 30, 0];
    # row 1 on none; row 2 on index 1 = slot 1 -> x[2, 1] = 6 -> [-6, 0, 6]
    out = lora_delta_reference(x, a, b, jnp.array([2, 1]), jnp.array([0, -1, 1]))
    np.testing.assert_array_equal(out, [[0.0, 30.0, 0.0], [0.0, 0.0, 0.0], [-6.0, 0.0, 6.0]])
    # every slot active but out of order, [2, 0, 1] (the stacks are read in place, each row
    # pointed at its slot): row 0 on slot 2 -> [0, 30, 0]; row 1 on index 2 = slot 1 -> [-4, 0, 4]
    out = lora_delta_reference(x, a, b, jnp.array([2, 0, 1]), jnp.array([0, 2, -1]))
    np.testing.assert_array_equal(out, [[0.0, 30.0, 0.0], [-4.0, 0.0, 4.0], [0.0, 0.0, 0.0]])
    # one slot, padded to two by repeating it (no row points at the padding)
    out = lora_delta_reference(x, a, b, jnp.array([0, 0]), jnp.array([0, 0, -1]))
    np.testing.assert_array_equal(out, [[1.0, 2.0, 3.0], [3.0, 6.0, 9.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M,I,S,n,R,O,blocks", [(13, 64, 3, 3, 8, 256, None),
                                                (64, 128, 8, 2, 16, 384, BlockSizes(16, 128)),
                                                (64, 128, 8, 8, 16, 384, None),
                                                (5, 32, 1, 1, 4, 128, None), (20, 64, 4, 1, 8, 256, BlockSizes(8, 128))])
def test_kernel_equals_reference(dtype, M, I, S, n, R, O, blocks):
    k = jax.random.split(jax.random.key(M * S + n), 5)
    x = jax.random.normal(k[0], (M, I), dtype)
    a = (jax.random.normal(k[1], (I, S, R)) * I**-0.5).astype(dtype)
    b = jax.random.normal(k[2], (S, R, O), dtype)
    active = jax.random.permutation(k[3], S)[:n].astype(jnp.int32)
    index = jax.random.randint(k[4], (M,), -1, n)
    want = lora_delta_reference(x, a, b, active, index)
    got = lora_delta_kernel(x, a, b, active, index, block_sizes=blocks, interpret=True)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOL[dtype] * 4,
                               rtol=TOL[dtype])
    assert not np.asarray(got)[np.asarray(index) < 0].any()
    # the same as the rows' own slots in a step with every slot active in order
    slots = jnp.where(index >= 0, active[jnp.maximum(index, 0)], -1)
    whole = lora_delta_reference(x, a, b, jnp.arange(S, dtype=jnp.int32), slots)
    np.testing.assert_allclose(np.asarray(want, np.float32), np.asarray(whole, np.float32), atol=TOL[dtype] * 4,
                               rtol=TOL[dtype])


def test_shapes_are_checked():
    z = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    with pytest.raises(ValueError, match="must equal"):
        lora_delta_reference(jnp.zeros((4, 8)), jnp.zeros((16, 2, 4)), jnp.zeros((2, 4, 8)), z(2), z(4))
    with pytest.raises(ValueError, match=r"active.shape=\(3,\) must be \(n,\) with 1 <= n <= S=2"):
        lora_delta_reference(jnp.zeros((4, 8)), jnp.zeros((8, 2, 4)), jnp.zeros((2, 4, 8)), z(3), z(4))


def test_host_active_sets_are_bucketed():
    from jaxinfer.engine.batch import lora_arrays
    from jaxinfer.engine.buckets import lora_bucket, lora_buckets

    assert [lora_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert lora_buckets(8) == [1, 2, 4, 8] and lora_buckets(3) == [1, 2, 3] and lora_buckets(1) == [1]
    with pytest.raises(ValueError, match="between 1 and max_loras=2"):
        lora_bucket(3, 2)
    assert lora_arrays(np.full(5, -1, np.int32), 8) == (None, None)
    active, index = lora_arrays(np.array([5, -1, 2, 5, 7, -1], np.int32), 8)
    np.testing.assert_array_equal(active, [2, 5, 7, 7])  # three slots in use, padded to 4
    np.testing.assert_array_equal(index, [1, -1, 0, 1, 2, -1])
    assert active.dtype == index.dtype == np.int32
