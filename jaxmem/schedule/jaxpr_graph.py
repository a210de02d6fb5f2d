"""Dataflow graph of a JAX function (e.g. a training step) from its jaxpr.

``trace(fn, *args)`` runs ``jax.make_jaxpr`` and flattens the result into a list of
primitive applications, then builds a :class:`~jaxmem.schedule.graph.Graph`:

* **nodes**: one per flat input (kind ``"input"``), one per closed-over constant (kind
  ``"const"``) and one per remaining equation (kind ``"op"``, or ``"update"`` when every
  output of the equation is an output of the step — the final ``param + update`` of an
  optimizer, the paper's weight-update nodes);
* **edges**: one per value, ``size = prod(shape) * itemsize`` from its aval; readers are
  the equations that use it. Inputs are *persistent* (the caller keeps them) unless their
  position is in ``donate_argnums``; then they live from the start of the step (control
  edges keep input nodes first) until their last use. Constants are persistent. Step
  outputs are ``output=True``. Scalars given as literals are not tensors.

Nested jaxprs:

* **inlined** (their equations become nodes of the graph): ``jit``/``pjit``,
  ``closed_call``/``core_call``, ``custom_jvp_call`` and ``custom_vjp_call`` (their primal
  body; under ``grad`` the derivative rules were already applied when tracing),
  ``checkpoint``/``remat`` (recomputation appears as ordinary nodes);
* **opaque** (one node; reads every operand, writes every result; the memory used
  *inside* the body is not modelled): ``cond``, ``while``, ``scan`` and any other
  primitive carrying a sub-jaxpr. Pass ``control_flow="error"`` to refuse them instead.

Views: ``reshape``, ``squeeze``, ``expand_dims`` and same-dtype ``convert_element_type``
are bitcasts for XLA. They cost nothing here: they are not nodes, every reader of a view
becomes a reader of the underlying buffer (its lifetime stretches accordingly), and the
executor evaluates a view inside the jitted call of its reader. A view that is itself a
step output is kept as an ordinary (copying) node.

Per-device programs: a ``jax.shard_map`` is inlined and its body's values keep their
*per-device* shapes; the operands and results of the shard_map take the per-device shapes of
the body (so ``trace(jax.jit(jax.shard_map(step, ...)), *global_args)`` is the graph of one
device's step). Inside a shard_map body the collectives ``psum``, ``pmax``, ``pmin``,
``all_gather``, ``psum_scatter`` (``reduce_scatter``), ``ppermute``, ``all_to_all`` and
``axis_index`` are ordinary nodes whose output edge is the buffer they produce on one device
(``pvary``, a type-level cast, is folded away). Such a graph can be planned
(:func:`jaxmem.schedule.optimize`); running it needs the mesh, so it is not executed by
:func:`jaxmem.schedule.execute`.

Dead equations (no used outputs, no effects) are dropped, as XLA would. Equations with
side effects, callbacks and collectives outside a shard_map body raise
:class:`UnsupportedPrimitiveError`: their ordering constraints are not modelled.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem._compat import core as jcore

from .graph import Graph

__all__ = ["FlatEqn", "TracedStep", "UnsupportedPrimitiveError", "trace"]


class UnsupportedPrimitiveError(ValueError):
    """The jaxpr contains something the graph model cannot represent."""


INLINE = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
}
CONTROL_FLOW = {"cond", "while", "scan"}
#: collectives modelled as ordinary nodes inside a shard_map body (refused elsewhere)
COLLECTIVES = {"psum", "psum2", "psum_invariant", "pmax", "pmin", "all_gather",
               "all_gather_invariant", "reduce_scatter", "ppermute", "all_to_all",
               "axis_index"}
UNSUPPORTED = {"xla_pmap", "pmap", "xla_call", "pure_callback", "io_callback",
               "debug_callback"} | COLLECTIVES
VIEWS = {"reshape", "squeeze", "expand_dims"}
#: identities at the value level (they change only the varying-axes type): folded away
IDENTITIES = {"pvary", "pcast", "pbroadcast"}


@dataclasses.dataclass
class FlatEqn:
    """One primitive application with global value ids.

    ``invars`` items are ``int`` (a value id) or ``("lit", value)``; ``outvars`` are ids
    (``None`` for dropped outputs).
    """

    primitive: Any
    params: dict
    invars: list
    outvars: list
    source: Any = None  # the original JaxprEqn (for caching / messages)


def _nbytes(aval) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        itemsize = getattr(dtype, "itemsize", 0) or 0
    return int(np.prod(shape, dtype=np.int64)) * int(itemsize)


def _is_view(eqn: FlatEqn, avals: dict) -> bool:
    name = eqn.primitive.name
    if name in VIEWS:
        return True
    if name == "convert_element_type" and isinstance(eqn.invars[0], int):
        return avals[eqn.invars[0]].dtype == avals[eqn.outvars[0]].dtype if eqn.outvars[0] is not None else False
    return False


class _Flattener:
    def __init__(self, control_flow: str) -> None:
        self.avals: dict[int, Any] = {}
        self.eqns: list[FlatEqn] = []
        self.consts: dict[int, Any] = {}
        self.next_id = 0
        self.control_flow = control_flow
        self.in_shard_map = 0

    def new(self, aval) -> int:
        i = self.next_id
        self.next_id += 1
        self.avals[i] = aval
        return i

    def atom(self, env, a):
        if isinstance(a, jcore.Literal):
            return ("lit", a.val)
        return env[a]

    def run(self, jaxpr: jcore.Jaxpr, consts_ids: Sequence, in_ids: Sequence) -> list:
        env: dict = {}
        for v, i in zip(jaxpr.constvars, consts_ids):
            env[v] = i
        for v, i in zip(jaxpr.invars, in_ids):
            env[v] = i
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            ins = [self.atom(env, a) for a in eqn.invars]
            if name == "shard_map" and "jaxpr" in eqn.params:
                outs = self.shard_map(eqn, ins)
                for v, o in zip(eqn.outvars, outs):
                    if not isinstance(v, jcore.DropVar):
                        env[v] = o
                continue
            if name in IDENTITIES and len(ins) == len(eqn.outvars):
                for v, a in zip(eqn.outvars, ins):
                    if not isinstance(v, jcore.DropVar):
                        env[v] = a
                continue
            if name in UNSUPPORTED and not (self.in_shard_map and name in COLLECTIVES):
                raise UnsupportedPrimitiveError(
                    f"trace: primitive {name!r} cannot be modelled by jaxmem.schedule "
                    "(mapped or callback primitives, and collectives outside a shard_map body, "
                    "have ordering/side effects that a dataflow graph does not capture)"
                )
            effects = {e for e in eqn.effects
                       if not (self.in_shard_map and type(e).__name__ == "NamedAxisEffect")}
            if effects:
                raise UnsupportedPrimitiveError(
                    f"trace: equation {name!r} has side effects {effects}; "
                    "effects impose an order jaxmem.schedule does not model"
                )
            sub = INLINE.get(name)
            if sub is not None and sub in eqn.params:
                cj = eqn.params[sub]
                if isinstance(cj, jcore.ClosedJaxpr):
                    inner, inner_consts = cj.jaxpr, cj.consts
                else:
                    inner, inner_consts = cj, []
                if len(inner.invars) == len(ins):
                    cids = [self.const(c) for c in inner_consts]
                    # literals passed into a sub-jaxpr become constants
                    outs = self.run(inner, cids, ins)  # literals stay literals
                    for v, o in zip(eqn.outvars, outs):
                        if not isinstance(v, jcore.DropVar):
                            env[v] = o
                    continue
            if name in CONTROL_FLOW and self.control_flow == "error":
                raise UnsupportedPrimitiveError(
                    f"trace: control-flow primitive {name!r} found and control_flow='error'; "
                    "use control_flow='opaque' to schedule it as one node"
                )
            outs = []
            for v in eqn.outvars:
                if isinstance(v, jcore.DropVar):
                    outs.append(None)
                else:
                    env[v] = self.new(v.aval)
                    outs.append(env[v])
            self.eqns.append(FlatEqn(eqn.primitive, dict(eqn.params), ins, outs, eqn))
        return [self.atom(env, a) for a in jaxpr.outvars]

    def shard_map(self, eqn, ins) -> list:
        """Inline a shard_map body: operands and results take the body's per-device avals."""
        inner = eqn.params["jaxpr"]
        if isinstance(inner, jcore.ClosedJaxpr):
            inner, inner_consts = inner.jaxpr, inner.consts
        else:
            inner_consts = []
        for a, v in zip(ins, inner.invars):
            if isinstance(a, int):
                self.avals[a] = v.aval
        self.in_shard_map += 1
        try:
            outs = self.run(inner, [self.const(c) for c in inner_consts], ins)
        finally:
            self.in_shard_map -= 1
        return outs

    def const(self, value) -> int:
        aval = jcore.ShapedArray(np.shape(value), jax.numpy.result_type(value))
        i = self.new(aval)
        self.consts[i] = value
        return i


@dataclasses.dataclass
class TracedStep:
    """A flattened jaxpr and its dataflow :class:`Graph`.

    Attributes:
      graph: nodes ``in:k`` (flat inputs), ``const:k``, ``op:j:<prim>`` (equation j).
      eqns: the flat equations; ``node_eqn[name]`` maps op nodes to their equation.
      in_ids / out_ids: value ids of the flat inputs / outputs (outputs may be literals).
      avals: value id -> abstract value; ``consts``: id -> constant value.
      alias: value id -> id of the buffer it is a view of (identity for real buffers).
      views: value id -> (view equation, id of its operand) for folded views.
    """

    graph: Graph
    eqns: list
    node_eqn: dict
    in_ids: list
    out_ids: list
    avals: dict
    consts: dict
    alias: dict
    views: dict
    edge_of: dict
    in_tree: Any
    out_tree: Any
    donate_argnums: tuple
    donated_ids: frozenset = frozenset()

    @property
    def program_order(self) -> list[str]:
        return self.graph.program_order


def trace(
    fn: Callable,
    *args,
    donate_argnums: int | Sequence[int] = (),
    control_flow: str = "opaque",
    alias_views: bool = True,
) -> TracedStep:
    """Build the dataflow graph of ``fn(*args)`` (see the module docstring).

    Args:
      fn: a JAX-traceable function of array pytrees (a training step: forward, backward
        and optimizer update).
      donate_argnums: positional arguments whose buffers the step may free (their leaves
        are not persistent).
      control_flow: ``"opaque"`` (cond/while/scan as single nodes) or ``"error"``.
      alias_views: treat reshape-like equations as free views (default) or as copies.
      *args: example arguments of ``fn`` (array pytrees; only shapes and dtypes are used).

    Returns:
      A :class:`TracedStep`: the flat jaxpr and its :class:`Graph` (``.graph``), ready
      for :func:`optimize` and :func:`execute`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem import schedule
      >>> def step(w, x):
      ...     return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
      >>> traced = schedule.trace(step, jnp.ones((4, 4)), jnp.ones((2, 4)))
      >>> type(traced).__name__, len(traced.graph.nodes) > 0
      ('TracedStep', True)
    """
    if control_flow not in ("opaque", "error"):
        raise ValueError(f"control_flow: must be 'opaque' or 'error', got {control_flow!r}")
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    donate_argnums = tuple(int(i) for i in donate_argnums)
    for i in donate_argnums:
        if not 0 <= i < len(args):
            raise ValueError(f"donate_argnums: {i} is out of range for {len(args)} arguments")

    in_tree = jax.tree_util.tree_structure(args)
    closed, out_shape = jax.make_jaxpr(lambda *a: fn(*a), return_shape=True)(*args)
    out_tree = jax.tree_util.tree_structure(out_shape)
    donated_leaf = []
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        donated_leaf += [i in donate_argnums] * n

    fl = _Flattener(control_flow)
    in_ids = [fl.new(v.aval) for v in closed.jaxpr.invars]
    const_ids = [fl.const(c) for c in closed.consts]
    out_atoms = fl.run(closed.jaxpr, const_ids, in_ids)
    avals = fl.avals

    # ---- dead-code elimination (backwards)
    needed = {a for a in out_atoms if isinstance(a, int)}
    kept = []
    for eq in reversed(fl.eqns):
        if any(o is not None and o in needed for o in eq.outvars):
            kept.append(eq)
            needed.update(a for a in eq.invars if isinstance(a, int))
    eqns = list(reversed(kept))

    # ---- views
    out_set = {a for a in out_atoms if isinstance(a, int)}
    alias: dict[int, int] = {}
    views: dict[int, tuple] = {}
    real = []
    for eq in eqns:
        if (alias_views and _is_view(eq, avals) and isinstance(eq.invars[0], int)
                and eq.outvars[0] not in out_set):
            src = eq.invars[0]
            alias[eq.outvars[0]] = alias.get(src, src)
            views[eq.outvars[0]] = (eq, src)
        else:
            real.append(eq)

    def root(i):
        return alias.get(i, i)

    # ---- graph
    g = Graph()
    producer: dict[int, str] = {}
    readers: dict[int, list[str]] = {}
    in_nodes = []
    for k, i in enumerate(in_ids):
        name = g.add_node(f"in:{k}", kind="input")
        producer[i] = name
        in_nodes.append(name)
    for k, i in enumerate(const_ids + [c for c in fl.consts if c not in const_ids]):
        if i in producer:
            continue
        producer[i] = g.add_node(f"const:{k}", kind="const")
    node_eqn = {}
    for j, eq in enumerate(real):
        outs_all_step_outputs = bool(eq.outvars) and all(
            o is None or o in out_set for o in eq.outvars)
        name = g.add_node(f"op:{j}:{eq.primitive.name}",
                          kind="update" if outs_all_step_outputs else "op")
        node_eqn[name] = eq
        for o in eq.outvars:
            if o is not None:
                producer[o] = name
        for a in eq.invars:
            if isinstance(a, int):
                readers.setdefault(root(a), []).append(name)
    edge_of = {}
    for i, src in producer.items():
        aval = avals[i]
        is_input = i in in_ids
        donated = is_input and donated_leaf[in_ids.index(i)]
        persistent = (is_input and not donated) or i in fl.consts
        sinks = [s for s in dict.fromkeys(readers.get(i, [])) if s != src]
        is_out = i in out_set or any(root(o) == i for o in out_set)
        edge_of[i] = g.add_edge(f"v{i}", src, sinks, _nbytes(aval), persistent=persistent,
                                output=is_out and not persistent)
    # inputs first: chain input nodes and make them precede source-free op nodes
    for a, b in itertools.pairwise(in_nodes):
        g.add_edge(f"ctrl:{a}->{b}", a, [b], 0)
    if in_nodes:
        last = in_nodes[-1]
        for name in g.nodes:
            if name.startswith("op:") and not g.preds(name):
                g.add_edge(f"ctrl:{last}->{name}", last, [name], 0)
    g.validate()
    return TracedStep(
        graph=g, eqns=real, node_eqn=node_eqn, in_ids=in_ids, out_ids=out_atoms, avals=avals,
        consts=fl.consts, alias=alias, views=views, edge_of=edge_of, in_tree=in_tree,
        out_tree=out_tree, donate_argnums=donate_argnums,
        donated_ids=frozenset(i for i, d in zip(in_ids, donated_leaf) if d),
    )
