"""Exact, shard-local data dependencies ("ties") for backward rules that recompute.

A backward rule that recomputes something from its residuals (``xhat`` from a stored ``x``,
attention probabilities from ``q, k``, a re-laid-out convolution kernel) must not let XLA
schedule that work in the forward pass, where its result would stay alive until the backward
pass. :func:`tie` returns its argument unchanged, bit for bit, but computed from one element of
a cotangent, so it exists only once that cotangent does:

    tie(x, g) = x - z,    z = 0 * [isnan(g_0)]   (always +0.0, not folded by XLA:CPU)

``[isnan(g_0)]`` is 0 or 1 even for an infinite or NaN ``g_0``, so ``z`` is an exact ``+0.0``
and ``x - (+0.0) == x`` for every float (``-0.0``, ``inf`` and ``NaN`` included); integer and
boolean arrays add ``[z != 0]`` (always 0 / ``False``); PRNG keys are tied through their data.
``lax.optimization_barrier`` would say the same without arithmetic, but XLA:CPU removes it
before scheduling, so it moves nothing (measured: batch norm keeps 8 B/element instead of 4).
XLA:GPU is the other way round: it folds ``[isnan(g_0)] * 0`` to zero (the dependency is gone,
and e.g. exact attention's backward reuses the forward's T x S softmax) but keeps the barrier.
So the tie is lowered per platform: the arithmetic on CPU, the barrier elsewhere.

Under SPMD sharding the element ``g_0`` lives on one device, so a plain ``x - z`` would make
XLA broadcast it to every device (one collective per tie). The tie is therefore a
``custom_partitioning`` op: every shard computes ``z`` from the first element of its *own*
shard of ``g`` and keeps ``x``'s sharding, so ties add no communication under data, fully
sharded or tensor parallelism; on one device, and inside a fully manual ``shard_map``, it is
the arithmetic above. It works under ``jit``, ``vmap``, ``grad`` (of any order: the tangent of
``tie(x, g)`` is that of ``x``), ``lax.scan`` and ``jax.checkpoint``.

:func:`zeros_after` is ``tie(zeros, g)``, a buffer that starts as zeros (a backward
accumulator): an exact ``+0.0`` (``0 - (+0.0)``) that XLA cannot create before ``g`` exists,
where a constant ``zeros`` may be created at the start of the program and held through the
whole forward pass.

:func:`vary_like` and :func:`typed_struct` carry ``shard_map``'s varying-axes types through
custom rules (a parameter replicated over an axis that the activation varies over).
:func:`laid_out_like` returns a parameter unchanged with its non-unit axes sharded like the
activation's, so a parameter that FSDP splits is gathered once and shared by every use.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["after", "barrier_off_cpu", "laid_out_like", "tie", "tie_elementwise", "tie_on_cpu",
           "together", "typed_struct", "vary_like", "varying_axes", "zeros_after",
           "zeros_created_after"]


# --------------------------------------------------------------------------- arithmetic
def _zero(dep):
    """``+0.0`` (float32) computed from ``dep``'s first element (of this shard)."""
    first = lax.slice(dep, (0,) * dep.ndim, (1,) * dep.ndim)
    if not jnp.issubdtype(first.dtype, jnp.inexact):  # isnan of an int folds to a constant
        first = first.astype(jnp.float32)
    return jnp.reshape(jnp.isnan(first), ()).astype(jnp.float32) * jnp.float32(0.0)


def _arith(x, dep):
    """``x`` exactly, data-dependent on ``dep`` (both non-empty arrays, ``dep.ndim >= 1``).

    Per platform, chosen when the program is lowered: on CPU the arithmetic of
    :func:`_arith_cpu` (XLA:CPU drops ``optimization_barrier`` before scheduling); elsewhere
    (XLA:GPU folds ``[isnan(g_0)] * 0`` to a constant, which removes the dependency) an
    ``optimization_barrier`` over ``(x, dep)``, which XLA:GPU keeps through scheduling.
    Inside ``shard_map``, ``x`` is first made varying over the mesh axes ``dep`` varies over
    (the arithmetic's result varies over both; the branches must have one type)."""
    return lax.platform_dependent(vary_like(x, dep), dep, cpu=_arith_cpu,
                                  default=_arith_barrier)


def _arith_barrier(x, dep):
    return lax.optimization_barrier((x, dep))[0]


def _arith_elementwise(x, dep):
    """:func:`_arith` for a value that only elementwise ops read: on CPU the same arithmetic;
    elsewhere the ``optimization_barrier`` holds a scalar zero beside ``dep``, and ``x`` is
    multiplied by ``1 + z`` (``== 1``) where it is read (:func:`tie_elementwise`)."""
    return lax.platform_dependent(vary_like(x, dep), dep, cpu=_arith_cpu,
                                  default=_scalar_barrier)


def _scalar_barrier(x, dep):
    z = lax.optimization_barrier((jnp.zeros((), jnp.float32), dep))[0]
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x * (1 + z).astype(x.dtype)
    return _plus_false(x, z)


def _arith_cpu(x, dep):
    z = _zero(dep)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x - z.astype(x.dtype)
    return _plus_false(x, z)


def _plus_false(x, z):
    """An integer or boolean ``x`` unchanged, computed from the zero ``z``: ``x + [z != 0]``
    (``x | [z != 0]`` for booleans)."""
    flag = z != 0  # always False; not a constant XLA could fold
    if x.dtype == jnp.bool_:
        return x | flag
    return x + flag.astype(x.dtype)


# ------------------------------------------------------------- shard-local partitioning
def _rule(mesh, operand_types, result_types):
    """Shardy rule: the result has ``x``'s factors; ``dep``'s are its own."""
    del mesh, result_types
    nx, nd = (len(t.shape) for t in operand_types)
    xs = " ".join(f"x{i}" for i in range(nx))
    ds = " ".join(f"d{i}" for i in range(nd))
    return f"{xs}, {ds} -> {xs}"


def _make_tie(body, partitioned_body):
    """The tie primitive: a ``custom_partitioning`` op that runs ``body`` where the program is
    not split and, where XLA's SPMD partitioner splits it, ``partitioned_body`` on each
    shard's own operands, wrapped by :func:`_layered` (one element of a batched ``dep`` is as
    good a dependency as any, so the whole batched ``x`` is tied at once)."""
    @custom_partitioning
    def local(x, dep):
        return body(x, dep)

    def partition(mesh, arg_shapes, result_shape):
        """Keep both operands as they are sharded; each shard runs the body."""
        del result_shape
        x_sharding, dep_sharding = (a.sharding for a in arg_shapes)
        return mesh, partitioned_body, x_sharding, (x_sharding, dep_sharding)

    local.def_partition(partition=partition, infer_sharding_from_operands=_infer,
                        sharding_rule=_rule)
    return _traced_once(_layered(local, lambda batched, x, dep: batched(x, dep)))


def _traced_once(op):
    """``op`` traced once per operand types and then replayed: an inlined ``jax.jit``.

    The op is three nested custom rules (``custom_jvp`` -> ``custom_vmap`` ->
    ``custom_partitioning`` with a ``platform_dependent`` body), which Python would trace
    again at every call: a ResNet-18 train step calls it a few hundred times. ``inline=True``
    puts the cached jaxpr's equations into the caller's jaxpr, so the program (and its
    StableHLO) is the one the uncached op gives; autodiff and ``vmap`` of the call are
    cached per jaxpr as well."""
    return jax.jit(op, inline=True)


def _layered(local, batched_value):
    """``local(x, other)`` as a ``custom_vmap`` (batched: ``batched_value(op, x, other)``,
    batched like ``x``) inside a ``custom_jvp`` whose tangent is ``x``'s."""
    @jax.custom_batching.custom_vmap
    def batched(x, other):
        return local(x, other)

    @batched.def_vmap
    def batched_rule(axis_size, in_batched, x, other):
        del axis_size
        return batched_value(batched, x, other), in_batched[0]

    @jax.custom_jvp
    def op(x, other):
        return batched(x, other)

    @op.defjvp
    def op_jvp(primals, tangents):
        return op(*primals), tangents[0]

    return op


def _infer(mesh, arg_shapes, result_shape):
    del mesh, result_shape
    return arg_shapes[0].sharding


def _barrier_off_cpu(x, dep):
    """An ``optimization_barrier`` over ``(x, dep)`` off CPU; ``x`` as it is on CPU."""
    return lax.platform_dependent(vary_like(x, dep), dep, cpu=lambda x, dep: x,
                                  default=_arith_barrier)


def _arith_on_cpu(x, dep):
    """The arithmetic of :func:`_arith_cpu` on CPU; ``x`` as it is elsewhere."""
    return lax.platform_dependent(vary_like(x, dep), dep, cpu=_arith_cpu,
                                  default=lambda x, dep: x)


#: the tie: each shard ties its ``x`` to its own ``dep`` (``_arith`` looked up when the op is
#: traced; traces are replayed per operand types, so a patch of it needs ``jax.clear_caches()``)
_tie = _make_tie(lambda x, dep: _arith(x, dep), lambda x, dep: _arith(x, dep))
#: :func:`tie_elementwise`: the tie with a scalar barrier off CPU
_tie_elementwise = _make_tie(lambda x, dep: _arith_elementwise(x, dep),
                             lambda x, dep: _arith_elementwise(x, dep))
#: :func:`tie_on_cpu`: the arithmetic on CPU (on every shard), nothing elsewhere
_tie_on_cpu = _make_tie(_arith_on_cpu, _arith_on_cpu)
#: :func:`after`: a barrier on XLA:GPU where the program is not split, nothing elsewhere
_after = _make_tie(_barrier_off_cpu, lambda x, dep: x)
#: :func:`after` with ``split=True``: a barrier on XLA:GPU, on every shard where XLA's SPMD
#: partitioner splits the program too
_after_split = _make_tie(_barrier_off_cpu, _barrier_off_cpu)


def _tie_leaf(a, dep, op):
    if a is None:
        return None
    if jnp.issubdtype(jnp.result_type(a), jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_tie_leaf(jax.random.key_data(a), dep, op),
                                        impl=jax.random.key_impl(a))
    a = jnp.asarray(a)
    if a.size == 0:
        return a
    if a.ndim == 0:  # the partitioning rule wants ranked operands
        return op(a.reshape(1), dep).reshape(())
    return op(a, dep)


def tie(x, dep):
    """``x`` unchanged (bit for bit), but computed only once ``dep`` is.

    Args:
      x: an array or a pytree of arrays (``None`` leaves, PRNG keys, integer and boolean
        arrays allowed) -- typically residuals that a backward rule recomputes from.
      dep: an array or pytree of arrays, typically the incoming cotangent; its first
        non-empty leaf is the dependency (an empty ``dep`` leaves ``x`` as it is: there is
        nothing to recompute for).

    Returns:
      ``x`` with the same structure, shapes, dtypes, values and sharding. The dependency is
      local to each shard (no communication); derivatives pass through to ``x``.
    """
    return _map_tie(x, dep, _tie, "tie")


def tie_elementwise(x, dep):
    """:func:`tie` for a value that only elementwise ops read before anything else does (a
    smooth activation's input in its derivative, the factors of a recomputed gated product,
    a normalisation's input in its recomputed output): bit for bit ``x``, computed only
    once ``dep`` is. On XLA:CPU it is :func:`tie`. Off CPU the barrier holds a scalar,
    ``z = barrier(0, dep)``, and the result is ``x * (1 + z)`` (``1 + z == 1`` exactly, so
    every float, ``-0.0``, ``inf`` and ``NaN`` included, is unchanged; integers and booleans
    add ``[z != 0]``), which XLA fuses into the elementwise op that reads ``x``. A barrier
    over ``x`` itself makes ``x`` a buffer of its own: where ``x`` is a slice of a larger
    buffer -- one factor out of XLA:GPU's merged ``[x W | x V]`` GEMM -- the barrier copied it
    (measured: 4 MiB per factor at Llama's peak on the H100 plan). Not for a value a product
    reads directly: XLA moves a scalar factor out of a ``dot`` and would then merge the
    recomputed product with the forward's (attention's ``q k^T``, kept whole)."""
    return _map_tie(x, dep, _tie_elementwise, "tie")


def tie_on_cpu(x, dep):
    """:func:`tie` on XLA:CPU, ``x`` as it is elsewhere: for a value whose tie helps only
    XLA:CPU's plan. A normalisation's backward reads the mean ``mu`` broadcast to the input's
    shape, which the forward's ``x - mu`` broadcasts too; XLA:CPU merges the two and keeps
    the forward's input-sized broadcast until the backward pass (measured: one extra
    ``f32[8,32,32,16]`` at the peak of a ResNet-18 train step that differentiates only its
    batch norms), where XLA:GPU fuses each broadcast into its reader and the barrier of
    :func:`tie` costs a few KB of its plan instead. Same arguments and result as :func:`tie`."""
    return _map_tie(x, dep, _tie_on_cpu, "tie_on_cpu")


def after(x, dep, *, everywhere: bool = False, split: bool = False):
    """``x`` unchanged (bit for bit), scheduled after ``dep`` on XLA:GPU inside
    ``shard_map``: an ``optimization_barrier`` over ``(x, dep)`` where ``x`` or ``dep``
    varies over a manual mesh axis; nothing on XLA:CPU, nothing outside ``shard_map`` (one
    device: measured, the barrier after every dense weight gradient cost a ViT train step
    4.8 MiB of its H100 plan and saved nothing on ResNet-50, BERT or GPT-2) unless
    ``everywhere`` (then on one device too), and nothing where XLA's SPMD partitioner splits
    the program.

    For an order that helps XLA:GPU only: a backward's input gradient made to wait for the
    weight gradient (``jaxmem.selective.linear``), a bias add's cotangent for the bias
    gradient (``jaxmem.selective.bias_add``, ``everywhere``). On XLA:CPU the arithmetic tie
    costs a buffer there (measured: a vmapped sync BatchNorm 4.5 -> 12.5 B/element per
    layer); under SPMD a use of the whole reduced weight gradient turns its reduce-scatter
    into an all-reduce, unless ``dep`` is already laid out as it will be reduced
    (:func:`jaxmem._prims.grad_layout.reduced_here`): ``split=True`` then keeps the barrier
    on every shard of a split program too. Same arguments and result as :func:`tie`."""
    if split:
        return _map_tie(x, dep, _after_split, "after")
    if not everywhere and not any(varying_axes(a) for a in jax.tree.leaves((x, dep))
                                  if a is not None):
        return x
    return _map_tie(x, dep, _after, "after")


# ------------------------------------------------------------- both, from one barrier
def barrier_off_cpu(tree):
    """``tree`` unchanged (bit for bit), each leaf available only once all are: one
    ``optimization_barrier`` over its leaves off CPU; as it is on CPU (XLA:CPU drops the
    barrier before scheduling). No partitioning rule of its own: the barrier passes XLA's
    SPMD partitioner as it is (:func:`together` is the two-array op that is split per shard)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    out = lax.platform_dependent(*leaves, cpu=lambda *a: list(a),
                                 default=lambda *a: list(lax.optimization_barrier(list(a))))
    return jax.tree_util.tree_unflatten(treedef, out)


def _together_off_cpu(a, b):
    """``(a, b)`` out of one ``optimization_barrier`` off CPU; as they are on CPU."""
    return barrier_off_cpu((a, b))


def _together_rule(mesh, operand_types, result_types):
    """Shardy rule: each result has its own operand's factors."""
    del mesh, result_types
    na, nb = (len(t.shape) for t in operand_types)
    fa = tuple(f"a{i}" for i in range(na))
    fb = tuple(f"b{i}" for i in range(nb))
    return SdyShardingRule((fa, fb), (fa, fb))


def _together_partition(mesh, arg_shapes, result_shape):
    """Split by XLA's SPMD partitioner: each shard passes its operands on, no barrier."""
    del result_shape
    sa, sb = (s.sharding for s in arg_shapes)
    return mesh, lambda a, b: (a, b), (sa, sb), (sa, sb)


def _together_infer(mesh, arg_shapes, result_shape):
    del mesh, result_shape
    return tuple(s.sharding for s in arg_shapes)


@custom_partitioning
def _together_local(a, b):
    return _together_off_cpu(a, b)


_together_local.def_partition(partition=_together_partition,
                              infer_sharding_from_operands=_together_infer,
                              sharding_rule=_together_rule)


@jax.custom_batching.custom_vmap
def _together_batched(a, b):
    return _together_local(a, b)


@_together_batched.def_vmap
def _together_vmap(axis_size, in_batched, a, b):
    del axis_size
    return _together_batched(a, b), tuple(in_batched)


@jax.custom_jvp
def _together_op(a, b):
    return _together_batched(a, b)


@_together_op.defjvp
def _together_jvp(primals, tangents):
    return _together_op(*primals), tuple(tangents)


_together = _traced_once(_together_op)


def together(a, b):
    """``(a, b)`` unchanged (bit for bit), each available only once both are: on XLA:GPU,
    where XLA's SPMD partitioner does not split the program, one ``optimization_barrier``
    over ``(a, b)``; nothing on XLA:CPU and nothing where the program is split.

    For a bilinear layer's backward pass on one device: its input gradient ``a = g W^T``
    and weight gradient ``b``. Everything that reads the weight gradient -- the optimizer's
    in-place update of a donated weight -- then follows the product that reads the weight,
    so XLA need not copy the weight to keep it intact for that product (measured on the H100
    plan: a donated adamw step of Hugging Face's GPT-2 copied its four MLP output
    projections and kept them through the step). ``None`` or an empty array on either side
    returns both as they are."""
    if a is None or b is None:
        return a, b
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.size == 0 or b.size == 0:
        return a, b
    ra, rb = a.reshape(1) if a.ndim == 0 else a, b.reshape(1) if b.ndim == 0 else b
    ra, rb = _together(ra, rb)  # the partitioning rule wants ranked operands
    return ra.reshape(a.shape), rb.reshape(b.shape)


def _map_tie(x, dep, op, who):
    """``op`` applied to every leaf of ``x`` with the first non-empty leaf of ``dep``."""
    leaves = [d for d in jax.tree.leaves(dep) if d is not None]
    for d in leaves:
        if not hasattr(d, "shape") or not hasattr(d, "dtype"):
            raise TypeError(f"{who}: dep must be an array or a pytree of arrays, got a leaf "
                            f"of type {type(d).__name__}")
    d = next((d for d in leaves if d.size > 0), None)
    if d is None:
        return x
    if jnp.issubdtype(d.dtype, jax.dtypes.prng_key):
        d = jax.random.key_data(d)
    if d.ndim == 0:
        d = d.reshape(1)
    return jax.tree.map(lambda a: _tie_leaf(a, d, op), x, is_leaf=lambda a: a is None)


def zeros_after(shape, dtype, after):
    """``zeros(shape, dtype)`` that XLA cannot compute before ``after`` exists.

    A constant zeros buffer has no operands, so XLA's scheduler is free to create it at the
    start of the program (and to merge it with equal constants): an accumulator meant for
    the backward pass would then live through the whole forward pass. This is
    ``tie(zeros, after)``: every element is ``0 - z`` with ``z = 0 * [isnan(a)]`` of the
    first element ``a`` of ``after`` (of this shard), an exact ``+0`` for every ``a``
    (``inf`` and ``NaN`` included) that XLA does not fold; no communication under sharding.
    An empty ``after`` gives a plain ``jnp.zeros``.
    """
    return tie(jnp.zeros(shape, dtype), after)


def zeros_created_after(shape, dtype, after):
    """``zeros(shape, dtype)`` whose buffer XLA can *create* only once ``after`` exists: a
    scalar ``+0`` tied to ``after`` (:func:`tie`: exact, no communication) and then
    broadcast, so the full-size buffer is made by an op with an operand that exists only
    after ``after``. :func:`zeros_after` ties the full-size zeros, which is enough on
    XLA:CPU; on XLA:GPU the tie is an ``optimization_barrier``, which orders only its
    *output*: the operand-free zeros broadcast in front of it is still scheduled at program
    start there (measured on the H100 plan: every segment's backward accumulator and forward
    output buffer of a row-tiled VGG-16 at 1024², 15 MiB of a 32.5 MiB temp; the row buffers
    of attention cores run in query chunks, 1 MiB per layer of a GPT block)."""
    return jnp.broadcast_to(tie(jnp.zeros((), dtype), after), shape)


# ------------------------------------------------------------------ shard_map types
def varying_axes(a) -> frozenset:
    """The ``shard_map`` mesh axes over which ``a`` varies (empty outside ``shard_map``)."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(t, "vma", ()))


def vary_like(a, like):
    """``a`` marked as varying over every manual (``shard_map``) axis that ``like`` varies
    over (``lax.pcast(..., to="varying")``); ``a`` itself outside ``shard_map`` or when it
    already varies over them. ``None`` stays ``None``.

    Autodiff transposes that cast into a sum over the axes, so a replicated parameter fed to
    a custom rule together with a per-device activation gets the summed gradient, as it does
    through plain JAX operations."""
    if a is None or like is None:
        return a
    missing = tuple(sorted(varying_axes(like) - varying_axes(a)))
    return lax.pcast(a, missing, to="varying") if missing else a


def typed_struct(a) -> jax.ShapeDtypeStruct:
    """``jax.ShapeDtypeStruct`` of ``a`` that keeps its ``shard_map`` varying axes (so
    ``jax.linear_transpose`` and friends trace with ``a``'s exact type)."""
    shape, dtype = jnp.shape(a), jnp.result_type(a)
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None and getattr(mat, "varying", None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=t.sharding, manual_axis_type=mat)
    return jax.ShapeDtypeStruct(shape, dtype)


# --------------------------------------------------- parameters laid out like the activation
def _like_rule(mesh, operand_types, result_types):
    """Shardy rule: the result's non-unit axes are ``x``'s factors (``p``'s are its own)."""
    del mesh, result_types
    p_t, x_t = operand_types
    pf = tuple(f"p{i}" for i in range(len(p_t.shape)))
    xf = tuple(f"x{i}" for i in range(len(x_t.shape)))
    rf = tuple(f"x{i}" if d != 1 else f"r{i}" for i, d in enumerate(p_t.shape))
    return SdyShardingRule((pf, xf), (rf,))


def _like_sharding(mesh, p_shape, x_sharding):
    spec = tuple(x_sharding.spec) + (None,) * (len(p_shape) - len(x_sharding.spec))
    return NamedSharding(mesh, PartitionSpec(*(a if d != 1 else None
                                               for a, d in zip(spec, p_shape))))


def _like_partition(mesh, arg_shapes, result_shape):
    """Each shard takes its part of ``p`` in the result's layout (``p`` is resharded once)."""
    out = result_shape.sharding
    return mesh, lambda p, x: p, out, (out, arg_shapes[1].sharding)


def _like_infer(mesh, arg_shapes, result_shape):
    del result_shape
    return _like_sharding(mesh, arg_shapes[0].shape, arg_shapes[1].sharding)


@custom_partitioning
def _like_local(p, x):
    del x
    return p


_like_local.def_partition(partition=_like_partition, infer_sharding_from_operands=_like_infer,
                          sharding_rule=_like_rule)


#: batched: ``p`` as it is
_like = _traced_once(_layered(_like_local, lambda batched, p, x: p))


def laid_out_like(p, x):
    """``p`` (shape ``1`` or ``x.shape[i]`` on each axis) unchanged, bit for bit, with its
    non-unit axes sharded as ``x``'s: ``p[i] -> p[i]``, derivative passed through.

    A parameter split where ``x`` is whole (FSDP splits parameters over the batch axis) is
    gathered once here, and every use of the result -- the forward pass, this norm's backward
    pass and a following bilinear layer's recomputation of ``y`` -- shares that copy; XLA
    would otherwise gather the parameter again at each use.  Where ``x`` is split along the
    feature axes each device keeps its part (no communication)."""
    if p is None or p.ndim != x.ndim or p.size == 0:
        return p
    return _like(p, x)
