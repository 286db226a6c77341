"""``jaxinfer.einsum.einsum`` emits the program ``jnp.einsum`` does, op for op: the same jaxpr
for every equation the models and kernels' references contract, and for the edge cases it
hands back to ``jnp.einsum``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.einsum import _plan, einsum

F32, BF16, I8 = jnp.float32, jnp.bfloat16, jnp.int8
CASES = [  # (equation, x shape, w shape, dtype)
    ("BTD,DF->BTF", (2, 3, 8), (8, 5), F32),
    ("BTD,DF->BTF", (1, 1, 8), (8, 5), BF16),
    ("BTD,VD->BTV", (2, 3, 8), (11, 8), F32),
    ("BTD,DNH->BTNH", (2, 3, 8), (8, 4, 5), F32),
    ("BTZ,ZD->BTD", (2, 3, 8), (8, 4), F32),
    ("BTNH,NHD->BTD", (2, 3, 4, 5), (4, 5, 8), F32),  # two contracted names, sorted
    ("BKMS,BKSH->BKMH", (2, 3, 4, 6), (2, 3, 6, 5), F32),
    ("BKMH,BKHS->BKMS", (2, 3, 4, 5), (2, 3, 5, 6), F32),
    ("BKMH,BKSH->BKMS", (2, 3, 4, 5), (2, 3, 6, 5), F32),
    ("TKGH,TKLH->TKGL", (2, 3, 4, 5), (2, 3, 6, 5), F32),  # batch names in the output's order
    ("TKGH,KTLH->KTGL", (2, 3, 4, 5), (3, 2, 6, 5), F32),  # ... which is neither operand's
    ("XKGL,XKLH->XKGH", (2, 3, 4, 6), (2, 3, 6, 5), F32),
    ("MKD,MK->MD", (3, 4, 8), (3, 4), F32),
    ("MK,MKD->MD", (3, 4), (3, 4, 8), F32),  # swapped operands spare the transpose
    ("ij,jk->ki", (3, 4), (4, 5), F32),  # a transpose after the dot
    ("bij,bjk->bik", (2, 3, 4), (2, 4, 5), I8),
    ("BTD,DF->BTF", (2, 3, 8), (1, 5), F32),  # size 1 against 8: jnp.einsum broadcasts
    ("ij,jk->i", (3, 4), (4, 5), F32),  # k summed away: jnp.einsum's
    ("ii,ij->j", (3, 3), (3, 4), F32),  # a repeated name: jnp.einsum's
    ("...d,df->...f", (2, 3, 8), (8, 5), F32),  # an ellipsis: jnp.einsum's
]


@pytest.mark.parametrize("eq,xs,ws,dt", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_the_same_program_as_jnp_einsum(eq, xs, ws, dt):
    x, w = jax.ShapeDtypeStruct(xs, dt), jax.ShapeDtypeStruct(ws, dt)
    want = str(jax.make_jaxpr(lambda a, b: jnp.einsum(eq, a, b))(x, w))
    got = str(jax.make_jaxpr(lambda a, b: einsum(eq, a, b))(x, w))
    assert got == want


def test_mixed_and_weak_dtypes_are_jnp_einsums():
    x, w = jnp.ones((2, 3), F32), jnp.ones((3, 4), BF16)
    assert str(jax.make_jaxpr(lambda a, b: einsum("ij,jk->ik", a, b))(x, w)) == \
        str(jax.make_jaxpr(lambda a, b: jnp.einsum("ij,jk->ik", a, b))(x, w))
    weak = jnp.asarray(2.0)  # a Python float's weak type
    got = einsum("i,i->", jnp.broadcast_to(weak, (3,)), jnp.ones(3, BF16))
    assert got.dtype == jnp.einsum("i,i->", jnp.broadcast_to(weak, (3,)), jnp.ones(3, BF16)).dtype


def test_values_equal_jnp_einsum():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3, 4, 5), np.float32), rng.standard_normal((4, 5, 8), np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a, b: einsum("BTNH,NHD->BTD", a, b))(x, w)),
                                  np.asarray(jax.jit(lambda a, b: jnp.einsum("BTNH,NHD->BTD", a, b))(x, w)))


def test_plans_are_made_once_per_equation():
    _plan.cache_clear()
    for _ in range(3):
        jax.make_jaxpr(lambda a, b: einsum("BTD,DF->BTF", a, b))(jnp.ones((1, 2, 3)), jnp.ones((3, 4)))
    assert _plan.cache_info().misses == 1 and _plan.cache_info().hits == 2
