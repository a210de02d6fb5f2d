"""Sharded training steps in a few lines: ``train_step(loss_fn, optimizer, mesh, mode)``.

The step is plain SPMD JAX: ``jax.jit`` with ``in_shardings``/``out_shardings`` from
:func:`~jaxmem.distributed.param_shardings` and :func:`~jaxmem.distributed.batch_sharding`,
parameters and optimizer state donated. jit's semantics are those of the single-device
program (the loss is the mean over the *global* batch, BatchNorm statistics are global), so
gradients equal the one-device step; only the layout differs. jaxmem models (from
``jaxmem.linen.convert``) go in unchanged.

With ``shard_update=True`` (default) the gradient ``sum_d g_d`` is reduce-scattered onto
:func:`~jaxmem.distributed.update_shardings` (device ``d`` keeps its shard of the sum, never
a full copy), the optimizer update runs there with its state laid out alike, and the new
parameters go back to their own layout (all-gathered under ``"dp"``/``"tp"``; already
sharded under ``"fsdp"``).

The step is traced under ``jax.set_mesh(mesh)`` and a :func:`jaxmem._prims.bitpack.shard_axes`
that names the mesh axes a feature axis may be split over: none for ``"dp"``/``"fsdp"``
(activations are split by batch only) and ``"model"`` for ``"tp"``.  Packed residuals (1-bit
masks, few-bit codes, pooling positions) then take the blocked layout that keeps each device's
bytes on its own shard, without the caller setting a mesh.  The layout is fixed when the step
is traced: a function the loss jits itself keeps the layout of its first trace.

Example::

    mesh = jaxmem.distributed.mesh(data=8)
    step = jaxmem.distributed.train_step(loss_fn, optax.adam(1e-3), mesh, mode="fsdp")
    params, opt_state = step.init(params)          # placed with their shardings
    params, opt_state, loss = step(params, opt_state, batch)   # batch: host or global arrays
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem._prims.bitpack import shard_axes
from jaxmem._prims.grad_layout import gradient_layout, placed, repeated_collectives
from jaxmem.distributed.sharding import (
    MODES,
    _check_mesh,
    batch_sharding,
    param_shardings,
    update_shardings,
)

__all__ = ["TrainStep", "train_step"]

#: mesh axes that may split an activation's trailing (feature) axis, per mode
_FEATURE_AXES = {"dp": (), "fsdp": (), "tp": ("model",)}


def _key(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _placed(params, use, grad):
    """``params`` laid out as ``use`` where the loss reads them; their cotangent laid out as
    ``grad``.

    Forward: ``p -> p`` constrained to ``use`` (FSDP: replicated, XLA's all-gather of the
    shard). Backward: ``ct = sum_d ct_d`` (the devices' partial cotangents) constrained to
    ``use`` and then to ``grad``, where the transpose of a plain sharding constraint stops at
    ``use``: the sum and the slice to ``grad`` become one reduce-scatter (XLA:GPU), device
    ``d`` keeping ``(sum_d ct_d)[shard_d]`` and no full copy of the sum. The ``use``
    constraint first keeps the ``grad`` layout from spreading into the backward of the
    model's own ops. Each result is recorded with its ``p``
    (:func:`jaxmem._prims.grad_layout.placed`): where a store layout is in context (FSDP
    with ``reduce_early``) jaxmem's dense / conv layers read ``p`` instead and gather it
    themselves, and a result left without a use is never gathered."""
    def one(p, u, g):
        @jax.custom_vjp
        def place(x):
            return jax.lax.with_sharding_constraint(x, u)

        def fwd(x):
            return place(x), None

        def bwd(_, ct):
            ct = jax.lax.with_sharding_constraint(ct, u)
            return (jax.lax.with_sharding_constraint(ct, g),)

        place.defvjp(fwd, bwd)
        out = place(p)
        placed(out, p)   # jaxmem's layers reading ``out`` gather ``p`` where they run
        return out

    return jax.tree.map(one, params, use, grad)


def _by_shape(params, shardings, by_rule=None):
    """``shape -> sharding`` for the parameters' shapes whose parameters all share one
    sharding (``None`` for any other shape): what a backward rule, which sees a weight's
    shape but not its path, may assume about it (:mod:`jaxmem._prims.grad_layout`). A
    matrix used transposed (a tied embedding as the output projection) is found under its
    reversed shape with its layout transposed, where no parameter has that shape. Other
    shapes: ``by_rule(shape)`` when given (a layout that is a function of the shape alone,
    e.g. a kernel a layer reshapes), else ``None``."""
    table: dict = {}
    for leaf, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
        shape = tuple(np.shape(leaf))
        seen = table.setdefault(shape, sh)
        if seen is not None and seen.spec != sh.spec:
            table[shape] = None  # two layouts for one shape: leave it to XLA
    for shape, sh in list(table.items()):
        if len(shape) == 2 and sh is not None and shape[::-1] not in table:
            spec = tuple(sh.spec) + (None,) * (2 - len(sh.spec))
            table[shape[::-1]] = NamedSharding(sh.mesh, P(*spec[::-1]))
    if by_rule is None:
        return lambda shape: table.get(tuple(shape))
    return lambda shape: table[tuple(shape)] if tuple(shape) in table else by_rule(shape)


class TrainStep:
    """A jitted, sharded ``(params, opt_state, batch) -> (params, opt_state, loss)``.

    ``loss_fn(params, batch) -> scalar``. ``optimizer`` is an ``optax.GradientTransformation``.
    Optimizer-state leaves follow the same path/shape rules as the parameters they mirror
    (e.g. Adam's ``mu``/``nu``), scalars (``count``) are replicated.
    """

    def __init__(self, loss_fn: Callable, optimizer, mesh: Mesh, mode: str = "fsdp", *,
                 rules: Sequence | None = None, batch_axis: str = "data", donate: bool = True,
                 shard_update: bool = True, reduce_early: bool | None = None,
                 repeat_collectives: bool = False):
        if not callable(loss_fn):
            raise TypeError(f"train_step: loss_fn must be callable, got {type(loss_fn).__name__}")
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError("train_step: optimizer must be an optax.GradientTransformation "
                            f"(init/update), got {type(optimizer).__name__}")
        _check_mesh(mesh, "train_step")
        if mode not in MODES:
            raise ValueError(f"train_step: mode must be one of {MODES}, got {mode!r}")
        self.loss_fn, self.optimizer, self.mesh, self.mode = loss_fn, optimizer, mesh, mode
        self.rules = tuple(rules or ())
        self.batch_sharding = batch_sharding(mesh, batch_axis)
        self.donate = bool(donate)
        self.shard_update = bool(shard_update)
        if reduce_early not in (None, True, False):
            raise TypeError(f"train_step: reduce_early must be None, True or False, got "
                            f"{reduce_early!r}")
        if reduce_early is None:
            reduce_early = mesh.devices.flat[0].platform == "gpu"
        self.reduce_early = reduce_early
        if not isinstance(repeat_collectives, bool):
            raise TypeError(f"train_step: repeat_collectives must be True or False, got "
                            f"{repeat_collectives!r}")
        self.repeat_collectives = repeat_collectives
        self._cache: dict = {}

    # -- layouts -------------------------------------------------------------------------
    def param_shardings(self, params):
        """The parameters' shardings (see :func:`jaxmem.distributed.param_shardings`)."""
        return param_shardings(params, self.mesh, self.mode, rules=self.rules)

    def update_shardings(self, params):
        """Where the gradient lands and the update runs: :func:`update_shardings`
        (``shard_update=True``) or the parameters' own layout."""
        if not self.shard_update:
            return self.param_shardings(params)
        return update_shardings(params, self.mesh, self.mode, rules=self.rules)

    def opt_shardings(self, params):
        """The optimizer state's shardings: each leaf by its own path and shape, laid out
        like the update (:meth:`update_shardings`)."""
        shapes = jax.eval_shape(self.optimizer.init, params)
        return self.update_shardings(shapes)

    def init(self, params):
        """``(params, optimizer.init(params))`` placed with their shardings (no host copy of
        the optimizer state: it is created sharded).

        The returned parameters are always new buffers (``device_put(..., may_alias=False)``),
        also for leaves already laid out as the step wants them: the step donates what it
        is given, and the caller's ``params`` stay valid and unchanged after any number of
        steps. ``params`` is not consumed."""
        psh, osh = self.param_shardings(params), self.opt_shardings(params)
        params = jax.device_put(params, psh, may_alias=False)
        opt_state = jax.jit(self.optimizer.init, out_shardings=osh)(params)
        return params, opt_state

    # -- the step ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _tracing(self, layouts) -> Iterator[None]:
        """The context the step is traced in: the step's mesh, the mesh axes that may split
        a feature axis (none for ``"dp"``/``"fsdp"``, ``"model"`` for ``"tp"``),
        ``layouts`` (:meth:`_gradient_layouts`) and ``repeat_collectives``."""
        with jax.set_mesh(self.mesh), shard_axes(*_FEATURE_AXES[self.mode]), \
                gradient_layout(*layouts), repeated_collectives(self.repeat_collectives):
            yield

    def _gradient_layouts(self, params, psh, ush):
        """``(layout, store, gather)`` for :func:`jaxmem._prims.grad_layout.gradient_layout`:
        where the step reduces each weight gradient (``ush``, by shape) and, under
        ``"fsdp"``, keeps each weight (``psh``) and gathers it back (replicated). All
        ``None`` without ``reduce_early``."""
        if not self.reduce_early:
            return None, None, None
        # under "dp" / "fsdp" without rules a layout is a function of the shape alone
        rule = self.mode in ("dp", "fsdp") and not self.rules
        sds = lambda shape: jax.ShapeDtypeStruct(shape, np.float32)
        layout = _by_shape(params, ush,
                           (lambda s: self.update_shardings(sds(s))) if rule else None)
        if self.mode != "fsdp":
            return layout, None, None
        store = _by_shape(params, psh,
                          (lambda s: self.param_shardings(sds(s))) if rule else None)
        return layout, store, NamedSharding(self.mesh, P())

    def _loss_and_grads(self, params, batch, use, ush):
        # FSDP (ZeRO-3) gathers each parameter where the forward uses it (``use``
        # replicated), so activations keep their batch layout whatever the model's ops; the
        # gradient lands on ``ush``: a reduce-scatter of the per-device partial sums
        loss_fn = lambda p, b: self.loss_fn(_placed(p, use, ush), b)
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return loss, jax.lax.with_sharding_constraint(grads, ush)

    def _compiled_fns(self, params):
        # the packed layout depends on (mesh, mode): both are part of the key, so one
        # TrainStep never reuses a program traced for another layout
        key = (self.mesh, self.mode, self.shard_update, self.reduce_early,
               self.repeat_collectives, _key(params))
        if key not in self._cache:
            import optax

            psh = self.param_shardings(params)
            ush = self.update_shardings(params)
            osh = self.opt_shardings(params)
            rep = NamedSharding(self.mesh, P())
            use = jax.tree.map(lambda _: rep, psh) if self.mode == "fsdp" else psh

            def step(p, s, batch):
                loss, grads = self._loss_and_grads(p, batch, use, ush)
                # the update runs on each device's shard (a slice of a replicated parameter:
                # no communication); out_shardings all-gather it back to ``psh``
                p = jax.lax.with_sharding_constraint(p, ush)
                updates, s = self.optimizer.update(grads, s, p)
                return optax.apply_updates(p, updates), s, loss

            def grads_fn(p, batch):
                return self._loss_and_grads(p, batch, use, ush)

            jstep = jax.jit(step, in_shardings=(psh, osh, self.batch_sharding),
                            out_shardings=(psh, osh, rep),
                            donate_argnums=(0, 1) if self.donate else ())
            jgrads = jax.jit(grads_fn, in_shardings=(psh, self.batch_sharding),
                             out_shardings=(rep, psh))
            self._cache[key] = (jstep, jgrads, self._gradient_layouts(params, psh, ush))
        return self._cache[key]

    def __call__(self, params, opt_state, batch):
        """One optimizer step; returns ``(params, opt_state, loss)``. Donates the first two."""
        jstep, _, layouts = self._compiled_fns(params)
        with self._tracing(layouts):
            return jstep(params, opt_state, batch)

    def grads(self, params, batch):
        """``(loss, grads)`` of ``loss_fn`` with the step's shardings (grads laid out like the
        parameters)."""
        _, jgrads, layouts = self._compiled_fns(params)
        with self._tracing(layouts):
            return jgrads(params, batch)

    def lower(self, params, opt_state, batch):
        """``jax.jit(...).lower`` of the step (for ``.compile().as_text()`` /
        ``memory_analysis()``); accepts ``jax.ShapeDtypeStruct`` leaves."""
        jstep, _, layouts = self._compiled_fns(params)
        with self._tracing(layouts):
            return jstep.lower(params, opt_state, batch)


def train_step(loss_fn: Callable, optimizer, mesh: Mesh, mode: str = "fsdp", *,
               rules: Sequence | None = None, batch_axis: str = "data",
               donate: bool = True, shard_update: bool = True,
               reduce_early: bool | None = None,
               repeat_collectives: bool = False) -> TrainStep:
    """A sharded training step: ``step(params, opt_state, batch) -> (params, opt_state, loss)``.

    ``mode``: ``"dp"``, ``"fsdp"`` or ``"tp"`` (see :mod:`jaxmem.distributed.sharding`);
    ``rules`` override the per-path layout; the batch's leading axis is split over
    ``batch_axis``. Parameters and optimizer state are donated unless ``donate=False``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (a mean over the batch).
      optimizer: an ``optax.GradientTransformation``.
      mesh: a ``jax.sharding.Mesh`` (e.g. from :func:`jaxmem.distributed.mesh`).
      mode: ``"dp"``, ``"fsdp"`` or ``"tp"``.
      rules: per-path layout overrides (see :mod:`jaxmem.distributed.sharding`).
      batch_axis: the mesh axis the batch's leading axis is split over.
      donate: donate parameters and optimizer state to the step.
      shard_update: reduce-scatter the gradient onto
        :func:`~jaxmem.distributed.update_shardings` and update there, with the optimizer
        state laid out alike (default); ``False``: the gradient laid out like the
        parameters (an all-reduce under ``"dp"``) and the update with them.
      reduce_early: jaxmem's layers (dense / conv weights, biases, norm scales) reduce
        their parameter gradient onto its update layout where their backward forms it, and
        pass the input gradient on only once it exists (XLA:GPU); under ``"fsdp"`` a dense /
        conv layer takes its weight's shard, gathers it once its input exists (not with
        every other weight at the start of the step), keeps the shard for the backward and
        gathers it again there. A layer sees a
        weight's shape, not its path: shapes whose parameters disagree on a layout are
        left to XLA. Left free, XLA:GPU forms every weight gradient at
        the end of the backward pass, next to the combined reduce-scatter, and keeps every
        layer's cotangents alive until then. Values are unchanged; XLA:GPU's reductions
        are then one per parameter instead of a few combined ones, and each waits for its
        layer. ``None`` (default): on for GPU meshes; off on CPU (XLA:CPU already orders
        them; there it adds all-gathers) and TPU (not measured).
      repeat_collectives: backward rules may also recompute a value whose forward needed
        collectives, running them again, to keep fewer bytes: the attention's ``q, k, v``
        projections (``jaxmem.transform(..., projections=True)``) are recomputed in its
        backward pass instead of kept under ``"tp"`` where a fused projection is split
        three ways (GPT-2's ``c_attn``, whose column split does not follow the heads: its
        collective-permutes repeat), and under ``"fsdp"`` with ``reduce_early`` (each layer
        keeps its weight's shard: gathered once more). ``False`` (default): only
        recomputations that need no collective (``q, k, v`` projections split by heads
        under ``"tp"``: Flax's ``MultiHeadDotProductAttention``, BERT-style layers; every
        projection under ``"dp"``).

    Returns:
      A :class:`TrainStep`: ``step.init(params) -> (params, opt_state)`` places both with
      their shardings; ``step(params, opt_state, batch) -> (params, opt_state, loss)``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxmem import distributed
      >>> def loss_fn(p, batch):
      ...     return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)
      >>> step = distributed.train_step(loss_fn, optax.sgd(0.1), distributed.mesh(), "dp")
      >>> params, opt_state = step.init({"w": jnp.zeros((4, 2))})
      >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 2))}
      >>> params, opt_state, loss = step(params, opt_state, batch)
      >>> round(float(loss), 4), params["w"].shape
      (1.0, (4, 2))

    With a converted model from the zoo::

        model = jaxmem.linen.convert(jaxmem.models.gpt(), fewbit=3)
        def loss_fn(params, batch):
            logits = model.apply({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        step = train_step(loss_fn, optax.sgd(0.1), jaxmem.distributed.mesh(data=8), "fsdp")
        params, opt_state = step.init(params)
        params, opt_state, loss = step(params, opt_state, batch)
    """
    return TrainStep(loss_fn, optimizer, mesh, mode, rules=rules, batch_axis=batch_axis,
                     donate=donate, shard_update=shard_update, reduce_early=reduce_early,
                     repeat_collectives=repeat_collectives)
