"""The blocked layout of jaxmem._prims.bitpack (``blocks=k``): round trips against a plain NumPy
reference for every width, its padding in bytes, errors, transformations, the ``k`` chosen
from the mesh in context, and the mask / few-bit ops that pack in blocks (exact gradients,
one layout shared by forward and backward)."""
from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, AxisType

from jaxmem import fewbit
from jaxmem._prims import mask
from jaxmem._prims.bitpack import (
    BITS,
    GROUP,
    GROUP_BYTES,
    pack,
    packed_shape,
    padding_bytes,
    shard_axes,
    shard_blocks,
    unpack,
)


def _stream(codes, bits: int) -> list[int]:
    """Plain-Python layout of one run of codes: groups of G codes (zero codes pad the last),
    each a little-endian word of 8 * B bits written LSB byte first."""
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    c = [int(v) & ((1 << bits) - 1) for v in codes]
    c += [0] * ((-len(c)) % g)
    out = []
    for i in range(0, len(c), g):
        word = sum(v << (bits * j) for j, v in enumerate(c[i:i + g]))
        out += [(word >> (8 * k)) & 0xFF for k in range(nb)]
    return out


def _reference_blocked(codes: np.ndarray, bits: int, k: int) -> np.ndarray:
    """Each row's trailing axis cut into ``k`` blocks, each block its own stream, in order."""
    w = codes.shape[-1] // k
    rows = codes.reshape(math.prod(codes.shape[:-1]), codes.shape[-1])
    out = [[byte for i in range(k) for byte in _stream(r[i * w:(i + 1) * w], bits)]
           for r in rows]
    n = k * -(-w // GROUP[bits]) * GROUP_BYTES[bits]
    return np.asarray(out, np.uint8).reshape(codes.shape[:-1] + (n,))


_round_trip = jax.jit(
    lambda c, bits, k: (pack(c, bits, k), unpack(pack(c, bits, k), bits, c.shape, k)),
    static_argnums=(1, 2))


def _codes(shape, bits, seed):
    return np.random.default_rng(seed).integers(0, 2**bits, size=shape).astype(np.uint8)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(lead=st.lists(st.integers(0, 3), max_size=2).map(tuple), k=st.integers(1, 5),
       w=st.integers(0, 11), bits=st.sampled_from(BITS), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(["uint8", "int32", "bool"]))
def test_blocked_round_trip_matches_numpy_reference(lead, k, w, bits, seed, dtype):
    shape = lead + (k * w,)
    c = _codes(shape, 1 if dtype == "bool" else bits, seed).astype(dtype)
    p, u = _round_trip(jnp.asarray(c), bits, k)
    assert p.dtype == jnp.uint8 and p.shape == packed_shape(shape, bits, k)
    if k > 1 or (w > 0 and w % GROUP[bits] == 0):  # else blocks=1 is the flat layout
        np.testing.assert_array_equal(np.asarray(p), _reference_blocked(c, bits, k))
    assert u.shape == shape and u.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(u), c.astype(np.uint8))


@pytest.mark.parametrize("bits", BITS)
def test_odd_block_widths_every_bit_width(bits):
    for width, k in [(15, 3), (21, 7), (40, 8), (9, 9), (40, 2)]:
        c = _codes((2, 3, width), bits, seed=width * k + bits)
        p, u = _round_trip(jnp.asarray(c), bits, k)
        np.testing.assert_array_equal(np.asarray(p), _reference_blocked(c, bits, k))
        np.testing.assert_array_equal(np.asarray(u), c)


@pytest.mark.parametrize("bits", BITS)
def test_whole_group_blocks_are_the_plain_layout(bits):
    """``w % G == 0``: blocks=k writes exactly the blocks=1 bytes (no padding, same shape)."""
    g = GROUP[bits]
    c = jnp.asarray(_codes((3, 4 * g), bits, seed=bits))
    for k in (2, 4):
        np.testing.assert_array_equal(np.asarray(_round_trip(c, bits, k)[0]),
                                      np.asarray(_round_trip(c, bits, 1)[0]))
        assert packed_shape(c.shape, bits, k) == packed_shape(c.shape, bits)
        assert padding_bytes(c.shape, bits, k) == 0


def test_padding_bytes():
    """Stored minus dense bytes: 3 rows of 40 3-bit codes in 8 blocks of 5 store 3 * 8 * 3 =
    72 bytes for 45 dense ones; 1-bit, 8 channels in 8 blocks: 1 byte per element."""
    assert padding_bytes((3, 40), 3, 8) == 72 - 45
    assert padding_bytes((3, 40), 3, 2) == 3 * 2 * 3 * 3 - 45
    assert padding_bytes((8, 8, 8, 8), 1, 8) == 8**4 - 8**4 // 8
    assert padding_bytes((3, 40), 3) == 0 and padding_bytes((7,), 1) == 0
    assert padding_bytes((3, 5), 3) == 0  # flat layout: 15 codes -> 2 groups = 6 bytes
    for shape, bits, k in [((5, 12), 1, 4), ((2, 21), 3, 7), ((4, 6), 4, 3), ((3, 10), 2, 5)]:
        rows, g, nb = math.prod(shape[:-1]), GROUP[bits], GROUP_BYTES[bits]
        stored = math.prod(packed_shape(shape, bits, k))
        assert stored == rows * k * -(-(shape[-1] // k) // g) * nb
        assert 0 <= padding_bytes(shape, bits, k) < rows * k * nb
        packed = jax.eval_shape(functools.partial(pack, bits=bits, blocks=k),
                                jax.ShapeDtypeStruct(shape, jnp.uint8))
        assert stored == packed.size


def test_bad_blocks():
    c = jnp.zeros((2, 12), jnp.uint8)
    with pytest.raises(ValueError, match=r"blocks=5 must divide the trailing axis of shape "
                                         r"\(2, 12\) \(size 12\)"):
        pack(c, 3, blocks=5)
    with pytest.raises(ValueError, match="blocks=5 must divide"):
        unpack(jnp.zeros((2, 15), jnp.uint8), 3, (2, 12), blocks=5)
    with pytest.raises(ValueError, match="blocks=5 must divide"):
        packed_shape((2, 12), 3, 5)
    for bad in (0, -2, 1.5, True, "2", None):
        with pytest.raises(ValueError, match=r"blocks must be an int >= 1, got"):
            pack(c, 1, blocks=bad)
    with pytest.raises(ValueError, match="at least one axis"):
        pack(jnp.zeros((), jnp.uint8), 1, blocks=2)
    # a blocked residual read back as unblocked (or with another k) is refused
    p = pack(c, 1, blocks=4)
    with pytest.raises(ValueError, match=r"packed has shape \(2, 4\), expected \(3,\)"):
        unpack(p, 1, (2, 12))
    with pytest.raises(ValueError, match="in 2 blocks"):
        unpack(p, 1, (2, 12), blocks=2)


def test_blocked_jit_vmap_scan():
    c = jnp.asarray(_codes((3, 5, 10), 3, seed=4))
    p = jax.jit(pack, static_argnums=(1, 2))(c, 3, 2)
    np.testing.assert_array_equal(np.asarray(p), _reference_blocked(np.asarray(c), 3, 2))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(unpack, static_argnums=(1, 2, 3))(p, 3, c.shape, 2)), np.asarray(c))
    pv = jax.vmap(lambda ci: pack(ci, 3, 5))(c)
    np.testing.assert_array_equal(np.asarray(pv), np.asarray(pack(c, 3, 5)))
    uv = jax.vmap(lambda pi: unpack(pi, 3, c.shape[1:], 5))(pv)
    np.testing.assert_array_equal(np.asarray(uv), np.asarray(c))

    def body(carry, ci):
        return carry, unpack(pack(ci, 1, 2), 1, ci.shape, 2)

    _, us = jax.lax.scan(body, 0, c & 1)
    np.testing.assert_array_equal(np.asarray(us), np.asarray(c & 1))


# ---------------------------------------------------------------- k from the mesh in context
def _mesh(*sizes, names=("data", "model"), kind=AxisType.Auto):
    return AbstractMesh(tuple(sizes), names[:len(sizes)], axis_types=(kind,) * len(sizes))


def test_shard_blocks_rule():
    """k = lcm of the split sizes s (products of mesh axes, s | W) whose shards straddle a
    byte ((W / s) % G != 0)."""
    assert shard_blocks(8, 1, (4, 2)) == 8      # 4, 2 or 1 channels per shard
    assert shard_blocks(16, 1, (2,)) == 1       # 8 per shard: whole bytes already
    assert shard_blocks(16, 1, (4, 2)) == 8
    assert shard_blocks(40, 3, (2,)) == 2       # 20 codes per shard, groups of 8
    assert shard_blocks(40, 3, (4, 2)) == 8
    assert shard_blocks(12, 1, (4, 2)) == 4     # 12 % 8: no split over all 8 devices
    assert shard_blocks(48, 3, (2,)) == 1
    assert shard_blocks(7, 2, (4, 2)) == 1      # no split divides 7
    assert shard_blocks(0, 1, (4, 2)) == 1 and shard_blocks(8, 1, ()) == 1
    assert shard_blocks(30, 4, (3, 5)) == 1     # 10, 6, 2 per shard: whole 4-bit pairs
    assert shard_blocks(30, 3, (3, 5)) == 15    # 10, 6, 2 per shard: all cut a 3-bit group
    for width, sizes in [(8, (4, 2)), (40, (4, 2)), (12, (4, 2)), (30, (3, 5))]:
        for bits in BITS:
            k = shard_blocks(width, bits, sizes)
            assert width % k == 0
            splits = {math.prod(c) for r in range(len(sizes) + 1)
                      for c in itertools.combinations(sizes, r)}
            for s in splits:  # every split lands on a block boundary or is not possible
                if width % s == 0 and (width // s) % GROUP[bits]:
                    assert k % s == 0
    with pytest.raises(ValueError, match="width must be an int >= 0, got -1"):
        shard_blocks(-1, 1)
    with pytest.raises(ValueError, match="axis_sizes must be ints >= 1"):
        shard_blocks(8, 1, (0,))
    with pytest.raises(ValueError, match="bits"):
        shard_blocks(8, 5)


def test_shard_blocks_reads_the_mesh_in_context():
    assert shard_blocks(8, 1) == 1  # no mesh
    with jax.sharding.use_abstract_mesh(_mesh(4, 2)):
        assert shard_blocks(8, 1) == 8
        with shard_axes("model"):
            assert shard_blocks(8, 1) == 2
        with shard_axes():
            assert shard_blocks(8, 1) == 1
        assert shard_blocks(8, 1) == 8
    with jax.sharding.use_abstract_mesh(_mesh(2, kind=AxisType.Manual)):
        assert shard_blocks(8, 1) == 1  # inside shard_map the arrays are per-device already
    with jax.sharding.use_abstract_mesh(_mesh(2, kind=AxisType.Explicit)):
        assert shard_blocks(8, 1) == 2
    with pytest.raises(TypeError, match="mesh axis names"), shard_axes(2):
        pass


# ------------------------------------------------- the ops that pack in blocks: exact gradients
def _ops():
    slope = jnp.asarray(0.3)
    return {
        "relu": mask.relu, "relu6": lambda x: mask.relu6(4 * x),
        "hard_tanh": lambda x: mask.hard_tanh(2 * x), "leaky_relu": mask.leaky_relu,
        "leaky_relu_array": lambda x: mask.leaky_relu(x, slope),
        "gelu3": fewbit.activation("gelu", 3), "silu2": fewbit.activation("silu", 2),
        "tanh4": fewbit.activation("tanh", 4),
    }


def _loss(op):
    return lambda x: jnp.sum(jnp.sin(op(x)) * jnp.cos(x))


_TRANSFORMS = {
    "jit": lambda f: jax.jit(jax.grad(f)),
    "vmap": lambda f: jax.jit(jax.vmap(jax.grad(f))),
    "checkpoint": lambda f: jax.jit(jax.grad(jax.checkpoint(f))),
    "scan": lambda f: jax.jit(lambda x: jax.lax.scan(lambda c, xi: (c, jax.grad(f)(xi)), 0, x)[1]),
}


def _grads_both_layouts(op, x, how):
    """(blocked, unblocked) gradients of the same transformed loss: 8 features on a 4x2 mesh
    pack in 8 blocks of one code; no mesh packs in whole groups."""
    want = _TRANSFORMS[how](_loss(op))(x)
    with jax.sharding.use_abstract_mesh(_mesh(4, 2)):
        got = _TRANSFORMS[how](_loss(op))(x)
    return got, want


@pytest.mark.parametrize("name,dtype", [(n, jnp.float32) for n in _ops()]
                         + [("relu", jnp.bfloat16), ("gelu3", jnp.float16)])
def test_ops_under_a_mesh_pack_in_blocks_with_exact_gradients(name, dtype):
    from jaxmem._compat import saved_residuals

    op = _ops()[name]
    x = jax.random.normal(jax.random.PRNGKey(3), (3, 5, 8), jnp.float32).astype(dtype)
    got, want = _grads_both_layouts(op, x, "jit")
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    bits = getattr(op, "bits", 1)
    with jax.sharding.use_abstract_mesh(_mesh(4, 2)):
        blocked = {r[0].shape for r in saved_residuals(_loss(op), x) if r[0].dtype == jnp.uint8}
    plain = {r[0].shape for r in saved_residuals(_loss(op), x) if r[0].dtype == jnp.uint8}
    assert blocked == {(3, 5, 8 * GROUP_BYTES[bits])}  # one group per channel
    assert plain == {(3, 5, 8 // GROUP[bits] * GROUP_BYTES[bits])}


@pytest.mark.parametrize("how", ["vmap", "checkpoint", "scan"])
def test_blocked_ops_under_transformations(how):
    x = jax.random.normal(jax.random.PRNGKey(4), (3, 5, 8))
    for name in ("relu", "leaky_relu_array", "gelu3"):
        got, want = _grads_both_layouts(_ops()[name], x, how)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


def test_blocks_are_fixed_when_the_op_is_called():
    """A VJP taken under a mesh and applied outside it reads the residual in its own layout."""
    x = jax.random.normal(jax.random.PRNGKey(5), (4, 40))
    dy = jax.random.normal(jax.random.PRNGKey(6), (4, 40))
    linearize = jax.jit(lambda op, x: jax.vjp(op, x)[1], static_argnums=0)
    apply = jax.jit(lambda vjp, dy: vjp(dy)[0])
    for op in (fewbit.activation("gelu", 3), mask.relu):
        want = apply(linearize(op, x), dy)
        with jax.sharding.use_abstract_mesh(_mesh(2, names=("model",))):
            vjp = linearize(op, x)
        assert {a.shape for a in jax.tree.leaves(vjp) if a.dtype == jnp.uint8} == {
            (4, 2 * packed_shape((20,), getattr(op, "bits", 1))[0])}  # 2 blocks of 20
        np.testing.assert_array_equal(np.asarray(apply(vjp, dy)), np.asarray(want))


@pytest.mark.xla_cpu  # asserts XLA:CPU's plan
@pytest.mark.parametrize("bits,k", [(1, 2), (3, 2), (3, 5)])
def test_blocked_packing_is_materialised(bits, k):
    """Per added layer XLA keeps the blocked bytes (with their padding), not the codes."""
    from jaxmem.measure import compiled_memory, slope

    b, h = 32, 250
    borders = np.linspace(-1.0, 1.0, 2**bits - 1, dtype=np.float32)

    @jax.custom_vjp
    def f(x):
        return x

    def code(x):
        c = jnp.zeros(x.shape, jnp.uint8)
        for v in borders:
            c = c + (x >= v).astype(jnp.uint8)
        return c

    f.defvjp(lambda x: (x, pack(code(x), bits, k)),
             lambda p, dy: (dy * (1 + unpack(p, bits, dy.shape, k).astype(dy.dtype)),))
    x = jnp.ones((b, h), jnp.float32)

    def loss_for(depth):
        ws = [jnp.asarray(np.random.default_rng(i).normal(size=(h, h)) / np.sqrt(h),
                          jnp.float32) for i in range(depth)]

        def loss(x):
            for w in ws:
                x = f(x @ w)
            return jnp.sum(x)

        return loss

    per_layer = slope(lambda d: compiled_memory(jax.grad(loss_for(d)), x).total_bytes, 2)
    stored = math.prod(packed_shape((b, h), bits, k))
    assert per_layer == -(-stored // 64) * 64, (per_layer, stored)
