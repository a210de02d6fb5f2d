"""LM heads -> a row-chunked head: no ``tokens x vocab`` array is kept or formed whole.

Matched, however it was spelled (optax's ``softmax_cross_entropy_with_integer_labels``,
``softmax_cross_entropy`` of one-hot labels, ``jax.nn.log_softmax`` + ``take_along_axis``,
a hand-written log-sum-exp, logits reshaped to ``(B*T, V)`` first)::

    z = dot_general(h, W)     h (*R, d): the rows' features (R the leading, free axes; N =
                              prod(R) rows), contracted on its trailing axes; W the same for
                              every row (d x V, or V x d for a tied embedding), V > d
    ...                       row-local equations on z: elementwise (other operands aligned
                              with the rows, or the same for every row), reductions, argmax,
                              top_k and cumulative ops within a row, gathers and slices
                              within a row (``take_along_axis``, ``[..., 0]``),
                              ``checkpoint_name``, broadcasts, reshapes,
                              squeezes and transposes that keep the rows leading, products
                              batched over the rows (``einsum("nv,nv->n")``)
    l = ...                   the region's outputs: at most one element per row (per-token
                              losses, log-normalisers, label logits, argmax)

where every value of more than ``d`` elements per row is used inside the region only.  The
region is re-emitted as one function of a chunk of rows (each equation re-bound on one row
and ``vmap``-ed over the chunk) and computed ``logits_chunk`` rows at a time by
:func:`jaxmem.losses.row_chunks.map_row_chunks`: each chunk under ``jax.checkpoint`` inside a
``lax.scan``, its logits formed again in the backward pass.  Every output row is the same
arithmetic on the same row as before (float rounding of the matmul's blocking aside);
gradients w.r.t. ``W`` and the bias are summed over chunks in another order.  Costs the
head's matmul once more in the backward pass (``2 N d V`` FLOPs).

A product whose rows feed a softmax-like reduction (an ``exp`` and a sum or max within a
row) but cannot be chunked gets a report row with the reason.
"""
from __future__ import annotations

import math

import jax

from jaxmem.transform.graph import Graph, is_literal, location, name_stack
from jaxmem.transform.match import Match, aval_str, is_float
from jaxmem.transform.report import Row

__all__ = ["match_logits"]

_ELEMENTWISE = frozenset((
    "add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "nextafter", "and", "or",
    "xor", "not", "neg", "exp", "exp2", "log", "log1p", "expm1", "abs", "sign", "sqrt",
    "rsqrt", "cbrt", "tanh", "logistic", "erf", "erfc", "integer_pow", "square", "is_finite",
    "eq", "ne", "lt", "le", "gt", "ge", "select_n", "convert_element_type", "stop_gradient",
    "copy", "copy_p", "reduce_precision", "floor", "ceil", "round", "clamp", "sin", "cos",
    "name"))   # checkpoint_name: an identity that names its value for remat policies
_REDUCTIONS = frozenset(("reduce_max", "reduce_min", "reduce_sum", "reduce_prod", "reduce_and",
                         "reduce_or", "argmax", "argmin"))
_ALONG_AXIS = frozenset(("top_k", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"))


class _NoMatch(Exception):
    pass


def _need(cond: bool, why: str):
    if not cond:
        raise _NoMatch(why)


def _shape(v) -> tuple:
    return tuple(v.aval.shape)


def _rows_prefix(shape: tuple, n: int) -> int | None:
    """The least ``k`` with ``prod(shape[:k]) == n`` (the row axes of a reshaped value)."""
    p = 1
    for k, s in enumerate(shape):
        p *= s
        if p == n:
            return k + 1
        if p > n:
            return None
    return None


#: backward rules of jaxmem's own selective products (:func:`jaxmem.selective.bilinear`): their
#: gradients are the product's own transposes, whatever they keep for them
_SELECTIVE_PRODUCTS = ("jaxmem.selective.linear", ("_bilinear_bwd", "_bilinear_rec_bwd"))


def _product(eqn):
    """The head's product as a ``dot_general`` equation: ``eqn`` itself, or -- ``eqn`` a
    ``custom_vjp_call`` of jaxmem's own selective product whose primal body is one
    ``dot_general`` of two of its operands (a head converted by ``jaxmem.scope()`` /
    ``jaxmem.linen.convert``) -- that body's equation read on ``eqn``'s operands and output.
    ``None`` otherwise: another ``custom_vjp`` keeps its own derivative rule."""
    if eqn.primitive.name == "dot_general":
        return eqn
    if eqn.primitive.name != "custom_vjp_call" or len(eqn.outvars) != 1:
        return None
    bwd = getattr(eqn.params.get("bwd"), "f", None)
    module, names = _SELECTIVE_PRODUCTS
    if getattr(bwd, "__module__", None) != module or getattr(bwd, "__name__", None) not in names:
        return None
    body = eqn.params["call_jaxpr"].jaxpr
    if eqn.params.get("num_consts", 0) or len(body.eqns) != 1:
        return None
    inner = body.eqns[0]
    if inner.primitive.name != "dot_general" or list(inner.outvars) != list(body.outvars):
        return None
    pos = {v: k for k, v in enumerate(body.invars)}
    if any(is_literal(v) or v not in pos for v in inner.invars):
        return None
    return inner.replace(invars=[eqn.invars[pos[v]] for v in inner.invars],
                         outvars=list(eqn.outvars))


def _no_sharding(params: dict) -> dict:
    out = dict(params)
    for key in ("sharding", "out_sharding"):
        if key in out:
            out[key] = None
    return out


class _Region:
    """The equations of one head, checked row-local, with each one's per-row form."""

    def __init__(self, graph: Graph, i: int):
        self.graph = graph
        self.dot = i
        self.product = eqn = _product(graph.jaxpr.eqns[i])
        x, w = eqn.invars
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        k = len(_shape(x)) - len(lc)
        self.ok_head = (not lb and not rb and tuple(lc) == tuple(range(k, len(_shape(x))))
                        and k >= 1 and len(_shape(w)) == 2 and len(rc) == 1
                        and not is_literal(x) and is_float(x) and is_float(w))
        self.n = math.prod(_shape(x)[:k]) if self.ok_head else 0
        self.d = math.prod(_shape(x)[k:]) if self.ok_head else 0
        self.vocab = _shape(w)[1 - rc[0]] if self.ok_head else 0
        self.k_head = k
        self.eqns: set[int] = {i}
        self.pre_slice = None        # (starts, limits, strides) of the features' rows
        if self.ok_head:
            self._row_slice(eqn)
        self.rows: dict = {}         # row-aligned variable -> its number of row axes
        self.inputs_rows: list = []  # row-aligned inputs, in first-use order
        self.inputs_free: list = []  # inputs the same for every row
        self.steps: list = []        # (eqn, per-row params, operand modes)
        self.outputs: list = []

    def _row_slice(self, eqn) -> None:
        """Logits sliced along the rows only, right after the product (next-token targets:
        ``logits[:, :-1]``): the features are sliced instead, and the rows are the slice's."""
        g, k = self.graph, self.k_head
        uses = g.uses(eqn.outvars[0])
        if len(uses) != 1 or eqn.outvars[0] in g.outvars:
            return
        j = uses[0]
        sl = g.jaxpr.eqns[j]
        if sl.primitive.name != "slice":
            return
        shape = _shape(eqn.outvars[0])
        starts, limits = tuple(sl.params["start_indices"]), tuple(sl.params["limit_indices"])
        strides = tuple(sl.params["strides"] or (1,) * len(shape))
        if (starts[k:] != (0,) * (len(shape) - k) or limits[k:] != shape[k:]
                or strides[k:] != (1,) * (len(shape) - k)):
            return
        self.pre_slice = (starts[:k], limits[:k], strides[:k])
        self.n = math.prod(_shape(sl.outvars[0])[:k])
        self.eqns.add(j)

    # ------------------------------------------------------------------ the region
    def big(self, v) -> bool:
        """More elements than the head's features (``d`` per row of the unsliced rows)."""
        return math.prod(_shape(v)) > math.prod(_shape(self.product.invars[0]))

    def grow(self, strict: bool = True, between: bool = True) -> None:
        """Every consumer of a value with more than ``d`` elements per row, and every
        equation between two region equations (``strict=False``: also when such a value is
        an output of the function, to see what the head computes; ``between=False``: the
        consumers alone)."""
        g = self.graph
        eqns = g.jaxpr.eqns
        while True:
            stack = list(self.eqns)
            while stack:
                for v in eqns[stack.pop()].outvars:
                    if type(v).__name__ == "DropVar" or not self.big(v):
                        continue
                    _need(not strict or v not in g.outvars, f"the {aval_str(v)} value is "
                          "an output of the function: it cannot be formed a chunk at a time")
                    for j in g.uses(v):
                        if j not in self.eqns:
                            self.eqns.add(j)
                            stack.append(j)
            if not between:
                return
            added = (self._between() | self._big_inputs()) - self.eqns
            if not added:
                return
            self.eqns |= added

    def _big_inputs(self) -> set[int]:
        """Producers of inputs with more than ``d`` elements per row (a one-hot of the
        labels) whose values are read inside the region only: computed per chunk too."""
        g = self.graph
        found: set[int] = set()
        for j in self.eqns:
            for v in g.jaxpr.eqns[j].invars:
                p = None if is_literal(v) else g.producer.get(v)
                if p is None or p in self.eqns or not self.big(v):
                    continue
                e = g.jaxpr.eqns[p]
                local = e.primitive.name in _ELEMENTWISE or e.primitive.name in (
                    "broadcast_in_dim", "reshape")
                if local and all(g.only_used_by(u, self.eqns) for u in e.outvars):
                    found.add(p)
        return found

    def _between(self) -> set[int]:
        """Equations that read a region value and feed a region equation."""
        g = self.graph
        eqns = g.jaxpr.eqns
        last = max(self.eqns)
        down: set[int] = set()
        stack = [self.dot]
        while stack:
            for v in eqns[stack.pop()].outvars:
                for j in g.uses(v):
                    if j not in down and j < last:
                        down.add(j)
                        stack.append(j)
        up: set[int] = set()
        stack = list(self.eqns)
        while stack:
            for v in eqns[stack.pop()].invars:
                j = None if is_literal(v) else g.producer.get(v)
                if j is not None and j not in up and j > self.dot:
                    up.add(j)
                    stack.append(j)
        return down & up

    def softmax_like(self) -> bool:
        """An ``exp`` and a sum or max within the region, and no second product that keeps
        more than one element per row (softmax weights times values: an attention)."""
        eqns = [self.graph.jaxpr.eqns[j] for j in self.eqns]
        names = [e.primitive.name for e in eqns]
        weighted = any(e.primitive.name == "dot_general" and j != self.dot
                       and math.prod(_shape(e.outvars[0])) > self.n
                       for j, e in zip(self.eqns, eqns))
        return ("exp" in names and any(n in ("reduce_sum", "reduce_max") for n in names)
                and not weighted)

    # ------------------------------------------------------------------ per-row forms
    def _input(self, v, k: int | None, why: str) -> None:
        """Record ``v`` (not produced in the region) as row-aligned with ``k`` row axes, or
        the same for every row (``k is None``); a literal is read as it is."""
        if is_literal(v):
            return
        if k is None:
            if v not in self.inputs_free:
                self.inputs_free.append(v)
            return
        _need(math.prod(_shape(v)[:k]) == self.n, why)
        old = self.rows.get(v)
        _need(old in (None, k), f"{aval_str(v)} is read with {old} and {k} row axes")
        if old is None:
            self.rows[v] = k
            self.inputs_rows.append(v)

    def _produced(self, v) -> bool:
        return not is_literal(v) and self.graph.producer.get(v) in self.eqns

    def _row_k(self, v) -> int | None:
        return self.rows.get(v) if not is_literal(v) else None

    def check(self) -> None:
        eqns = self.graph.jaxpr.eqns
        for j in sorted(self.eqns):
            eqn = eqns[j]
            name = eqn.primitive.name
            if j == self.dot:
                eqn = self.product
                x = eqn.invars[0]
                if self.pre_slice is None:
                    self._input(x, self.k_head, "features")
                else:
                    self.rows[x] = self.k_head
                    self.inputs_rows.append(x)
                self._input(eqn.invars[1], None, "")
                lc, rc = eqn.params["dimension_numbers"][0]
                params = dict(eqn.params, dimension_numbers=(
                    (tuple(a - self.k_head for a in lc), tuple(rc)), ((), ())))
                self._step(eqn, self.k_head, _no_sharding(params), ["row", "free"])
            elif name == "slice" and self.pre_slice is not None and eqn.invars[0] in (
                    eqns[self.dot].outvars):
                self._step(eqn, self.k_head, None, ["row"])   # applied to the features
            elif name in _ELEMENTWISE:
                self._elementwise(eqn)
            elif name in _REDUCTIONS or name in _ALONG_AXIS or name in ("squeeze", "transpose"):
                self._within_row(eqn)
            elif name == "slice":
                self._slice_within_rows(eqn)
            elif name == "broadcast_in_dim":
                self._broadcast(eqn)
            elif name == "reshape":
                self._reshape(eqn)
            elif name == "dot_general":
                self._batched_dot(eqn)
            elif name == "gather":
                self._gather(eqn)
            else:
                raise _NoMatch(f"a {name} reads the logits (only row-local equations can be "
                               "computed a chunk of rows at a time)")
        g = self.graph
        for j in sorted(self.eqns):
            for v in eqns[j].outvars:
                if type(v).__name__ == "DropVar":
                    continue
                if v in g.outvars or any(u not in self.eqns for u in g.uses(v)):
                    _need(math.prod(_shape(v)) <= self.n, f"{aval_str(v)} (more than one "
                          "element per row) is used after the head")
                    self.outputs.append(v)
        _need(bool(self.outputs), "nothing of the head is used")

    def _step(self, eqn, k_out: int, params: dict | None, modes: list) -> None:
        modes = ["lit" if is_literal(v) else m for v, m in zip(eqn.invars, modes)]
        for v in eqn.outvars:
            if type(v).__name__ != "DropVar":
                self.rows[v] = k_out
        self.steps.append((eqn, params, modes))

    def _region_operand(self, eqn) -> tuple:
        v = eqn.invars[0]
        _need(self._produced(v), f"{eqn.primitive.name}: unexpected operand")
        return v, self.rows[v]

    def _elementwise(self, eqn) -> None:
        out = _shape(eqn.outvars[0])
        ks = {self.rows[v] for v in eqn.invars if self._produced(v)} or {
            _rows_prefix(out, self.n)}
        _need(len(ks) == 1 and None not in ks, f"{eqn.primitive.name} mixes row layouts")
        (k,) = ks
        modes: list = []
        for v in eqn.invars:
            s = () if is_literal(v) else _shape(v)
            if is_literal(v):
                modes.append("lit")
            elif self._produced(v):
                modes.append("row")
            elif s == ():
                self._input(v, None, "")
                modes.append("free")
            elif len(s) == len(out) and s[:k] == out[:k]:
                self._input(v, k, f"{aval_str(v)} is not aligned with the rows")
                modes.append("row")
            elif len(s) == len(out) and all(a == 1 for a in s[:k]):
                self._input(v, None, "")
                modes.append(("free", s[k:]))
            else:
                raise _NoMatch(f"{eqn.primitive.name} reads {aval_str(v)}, which varies along "
                               "some row axes only")
        self._step(eqn, k, _no_sharding(eqn.params), modes)

    def _within_row(self, eqn) -> None:
        name = eqn.primitive.name
        _, k = self._region_operand(eqn)
        _need(len(eqn.invars) == 1, f"{name} with several operands")
        p = dict(eqn.params)
        if name in _REDUCTIONS:
            _need(min(p["axes"], default=k) >= k, f"{name} reduces over the rows")
            p["axes"] = tuple(a - k for a in p["axes"])
        elif name == "squeeze":
            _need(min(p["dimensions"], default=k) >= k, "squeeze of a row axis")
            p["dimensions"] = tuple(a - k for a in p["dimensions"])
        elif name == "transpose":
            perm = tuple(p["permutation"])
            _need(perm[:k] == tuple(range(k)), "transpose moves the rows")
            p["permutation"] = tuple(a - k for a in perm[k:])
        else:
            _need(isinstance(p.get("axis"), int) and p["axis"] >= k, f"{name} along the rows")
            p["axis"] = p["axis"] - k
        self._step(eqn, k, _no_sharding(p), ["row"])

    def _slice_within_rows(self, eqn) -> None:
        """A slice of the columns (``log_softmax(z)[..., 0]``): every row kept whole."""
        v, k = self._region_operand(eqn)
        shape = _shape(v)
        p = eqn.params
        strides = tuple(p["strides"] or (1,) * len(shape))
        _need(tuple(p["start_indices"][:k]) == (0,) * k
              and tuple(p["limit_indices"][:k]) == shape[:k] and strides[:k] == (1,) * k,
              "slice of the rows after other equations")
        new = dict(p, start_indices=tuple(p["start_indices"][k:]),
                   limit_indices=tuple(p["limit_indices"][k:]),
                   strides=None if p["strides"] is None else strides[k:])
        self._step(eqn, k, new, ["row"])

    def _broadcast(self, eqn) -> None:
        v = eqn.invars[0]
        dims = tuple(eqn.params["broadcast_dimensions"])
        out = _shape(eqn.outvars[0])
        if self._produced(v):
            k = self.rows[v]
        else:   # a broadcast read by the region only (a one-hot's labels)
            k = _rows_prefix(out, self.n)
            _need(k is not None, "broadcast_in_dim splits a row")
            m = sum(1 for b in dims if b < k)
            _need(m in (0, k), "broadcast_in_dim along some row axes only")
            self._input(v, k if m else None, "")
            if not m:
                p = dict(eqn.params, shape=out[k:],
                         broadcast_dimensions=tuple(b - k for b in dims))
                self._step(eqn, k, _no_sharding(p), ["free"])
                return
        _need(dims[:k] == tuple(range(k)) and out[:k] == _shape(v)[:k],
              "broadcast_in_dim moves the rows")
        p = dict(eqn.params, shape=out[k:], broadcast_dimensions=tuple(b - k for b in dims[k:]))
        self._step(eqn, k, _no_sharding(p), ["row"])

    def _reshape(self, eqn) -> None:
        v = eqn.invars[0]
        if not self._produced(v):
            k_in = _rows_prefix(_shape(v), self.n)
            _need(k_in is not None, "reshape of an input that splits a row")
            self._input(v, k_in, "")
        _need(eqn.params.get("dimensions") is None, "reshape with a transpose")
        out = _shape(eqn.outvars[0])
        k_out = _rows_prefix(out, self.n)
        _need(k_out is not None, f"reshape to {out} splits a row")
        p = dict(eqn.params, new_sizes=out[k_out:])
        self._step(eqn, k_out, _no_sharding(p), ["row"])

    def _batched_dot(self, eqn) -> None:
        """A product of a region value: rows of the left operand (free, leading) times a
        row-free right operand, or both operands batched over the rows."""
        a, b = eqn.invars
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        k = self._row_k(a) if self._produced(a) else self._row_k(b)
        if not lb and not rb and self._produced(a) and not self._produced(b):
            _need(min(lc) >= k, "dot_general contracts the rows")
            self._input(b, None, "")
            dn = ((tuple(c - k for c in lc), tuple(rc)), ((), ()))
            modes = ["row", "free"]
        else:
            _need(tuple(lb) == tuple(rb) == tuple(range(k)),
                  "dot_general is not batched over the rows")
            for v in (a, b):
                if not self._produced(v):
                    self._input(v, k, f"{aval_str(v)} is not aligned with the rows")
            _need(self.rows[a] == self.rows[b] == k, "dot_general mixes row layouts")
            dn = ((tuple(c - k for c in lc), tuple(c - k for c in rc)), ((), ()))
            modes = ["row", "row"]
        self._step(eqn, k, _no_sharding(dict(eqn.params, dimension_numbers=dn)), modes)

    def _gather(self, eqn) -> None:
        v, k = self._region_operand(eqn)
        idx = eqn.invars[1]
        dn = eqn.params["dimension_numbers"]
        sizes = tuple(eqn.params["slice_sizes"])
        rows = tuple(range(k))
        shift = lambda xs: tuple(a - k for a in xs)
        if tuple(dn.operand_batching_dims) == rows:     # take_along_axis: rows batched
            _need(tuple(dn.start_indices_batching_dims) == rows and min(
                dn.offset_dims, default=k) >= k and sizes[:k] == (1,) * k,
                "gather batched over other axes")
            if not self._produced(idx):
                self._input(idx, k, "gather indices not aligned with the rows")
            _need(self.rows.get(idx) == k, "gather indices with another row layout")
            offset = shift(dn.offset_dims)
            modes = ["row", "row"]
        else:                                            # x[..., i]: rows kept whole
            _need(not dn.operand_batching_dims and not self._produced(idx)
                  and tuple(dn.offset_dims[:k]) == rows and sizes[:k] == _shape(v)[:k]
                  and min(tuple(dn.collapsed_slice_dims) + tuple(dn.start_index_map),
                          default=k) >= k, "gather across the rows")
            self._input(idx, None, "")
            offset = shift(dn.offset_dims[k:])
            modes = ["row", "free"]
        new = jax.lax.GatherDimensionNumbers(
            offset_dims=offset, collapsed_slice_dims=shift(dn.collapsed_slice_dims),
            start_index_map=shift(dn.start_index_map), operand_batching_dims=(),
            start_indices_batching_dims=())
        p = dict(eqn.params, dimension_numbers=new, slice_sizes=sizes[k:])
        self._step(eqn, k, _no_sharding(p), modes)

    # ------------------------------------------------------------------ re-emission
    def emit(self, chunk: int):
        from jaxmem.losses.row_chunks import map_row_chunks

        rows_in, free_in, outputs = list(self.inputs_rows), list(self.inputs_free), self.outputs
        per_row = [_shape(v)[self.rows[v]:] for v in rows_in]
        steps, n = list(self.steps), self.n

        def one_row(row_vals, free_vals):
            env = dict(zip(rows_in, row_vals))
            env.update(zip(free_in, free_vals))
            for eqn, params, modes in steps:
                if params is None:   # the logits' row slice, applied to the features
                    env[eqn.outvars[0]] = env[eqn.invars[0]]
                    continue
                vals = []
                for v, mode in zip(eqn.invars, modes):
                    if mode == "lit":
                        vals.append(v.val)
                    elif isinstance(mode, tuple):
                        vals.append(env[v].reshape(mode[1]))
                    else:
                        vals.append(env[v])
                bind = eqn.primitive.get_bind_params(params)
                with eqn.ctx.manager:
                    out = eqn.primitive.bind(*vals, **bind)
                out = list(out) if eqn.primitive.multiple_results else [out]
                for v, x in zip(eqn.outvars, out):
                    if type(v).__name__ != "DropVar":
                        env[v] = x
            return tuple(env[v] for v in outputs)

        def chunk_fn(row_vals, free_vals):
            return jax.vmap(one_row, in_axes=(0, None))(row_vals, free_vals)

        pre, head_x = self.pre_slice, self.product.invars[0]

        def run(*vals):
            vals = list(vals)
            if pre is not None:
                i = rows_in.index(head_x)
                x = vals[i]
                vals[i] = jax.lax.slice(x, pre[0] + (0,) * (x.ndim - len(pre[0])),
                                        pre[1] + x.shape[len(pre[0]):],
                                        pre[2] + (1,) * (x.ndim - len(pre[0])))
            rv = [x.reshape((n,) + s) for x, s in zip(vals[:len(rows_in)], per_row)]
            outs = map_row_chunks(chunk_fn, rv, tuple(vals[len(rows_in):]), chunk)
            return [o.reshape(_shape(v)) for o, v in zip(outs, outputs)]

        return run


def match_logits(graph: Graph, taken: set[int], path: str, chunk: int) -> list:
    """Matches (and rows for softmax-like heads that could not be chunked) of the LM heads in
    ``graph`` (module docstring); ``chunk``: rows per chunk."""
    found: list = []
    used: set[int] = set(taken)
    for i, eqn in enumerate(graph.jaxpr.eqns):
        if i in used or _product(eqn) is None:
            continue
        region = _Region(graph, i)
        if not region.ok_head or region.vocab <= region.d or region.n < 2:
            continue
        x, w = region.product.invars
        what = (f"dot_general {aval_str(x)} x {aval_str(w)} -> {aval_str(eqn.outvars[0])} "
                "and the row-local equations after it")
        where, ns = location(eqn), name_stack(eqn)
        quick = _Region(graph, i)       # consumers of the logits only: is it a softmax at all?
        quick.grow(strict=False, between=False)
        if not quick.softmax_like():
            continue
        try:
            region.grow()
            _need(not (region.eqns & used), "part of it is matched already")
            region.check()
        except _NoMatch as e:
            found.append(Row("logits", what, "", False, str(e), where, ns, path))
            continue
        if not region.softmax_like():   # what joined it made it an attention
            continue
        if region.n <= chunk:
            found.append(Row("logits", what, "", False, f"{region.n} rows fit one chunk of "
                             f"{chunk} (logits_chunk): nothing to split", where, ns, path))
            continue
        anchor = max(region.eqns)
        row = Row("logits", what.replace("the row-local", f"{len(region.eqns) - 1} row-local"),
                  f"row-chunked head ({chunk} of {region.n} rows per chunk, jax.checkpoint "
                  "in lax.scan)", True,
                  f"keeps no {region.n} x {region.vocab} array; the head's product runs again "
                  "in the backward pass", where, ns, path)
        used |= region.eqns
        found.append(Match(frozenset(region.eqns), anchor,
                           region.inputs_rows + region.inputs_free, region.outputs,
                           region.emit(chunk), row))
    return found
