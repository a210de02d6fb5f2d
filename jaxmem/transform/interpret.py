"""The jaxpr re-emitting interpreter.

``Interpreter(options).run(closed_jaxpr, args)`` evaluates a closed jaxpr on ``args``
(values or tracers of any enclosing transformation) and returns the outputs.  Per jaxpr
level it

1. inlines ``jit`` / ``closed_call`` bodies (:func:`~jaxmem.transform.graph.inline_calls`; a
   ``jit``'s shardings become sharding constraints on the body's inputs and outputs),
2. runs the matchers on the flat jaxpr (language-model heads first, then attention,
   normalisations, dropout, max pools, products, then activation subgraphs, each on the
   equations the earlier ones left),
3. walks the equations in order: a matched set is re-emitted as its op at its last
   equation (a reader of a statistic it also produces waits for it); higher-order
   primitives are entered (their bodies go through 1-3 again and
   are re-built with ``lax.scan`` / ``lax.switch`` / ``lax.while_loop`` /
   ``jax.checkpoint`` / ``jax.shard_map`` (same mesh, specs and manual axes); a ``scan`` body without effects or a checkpoint of its
   own runs under ``jax.checkpoint(policy=scan_policy)``,
   :mod:`~jaxmem.transform.scan_policy`); every other equation is bound unchanged
   (``primitive.bind(*invals, **params)``) under its own source location (an ``add`` of two
   values a selective op can recompute is recorded as recomputable too; a product's output
   scaled by a parameter is materialised first: :mod:`~jaxmem.transform.scaled`).

Not entered (re-emitted unchanged, reported with the reason): ``custom_jvp_call`` /
``custom_vjp_call`` bodies (their derivative rules must stay theirs; a ``custom_jvp`` with
an elementwise body is still part of an activation subgraph) and ``jit`` calls with their
own layouts or compiler options.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import jax
import numpy as np
from jax import lax

from jaxmem._compat import core, scan_counts
from jaxmem.transform.graph import (
    Graph,
    bind_eqn,
    call_location,
    context,
    inline_calls,
    location,
    name_stack,
)
from jaxmem.transform.match import Match, aval_str
from jaxmem.transform.match_fused import recomputed_body
from jaxmem.transform.options import Options
from jaxmem.transform.report import Row, amend, record
from jaxmem.transform.scaled import materialised, scaled_products
from jaxmem.transform.scan_policy import has_remat, scan_policy

__all__ = ["Interpreter"]

#: higher-order primitives whose bodies are re-emitted unchanged for now
_NOT_ENTERED = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "shard_map",
                "jit", "pjit", "custom_lin", "custom_transpose_call"}
#: the parameters of a ``shard_map`` equation that re-building it reads
_SHARD_MAP_PARAMS = ("mesh", "in_specs", "out_specs", "jaxpr", "check_vma", "newly_manual_axes")


#: The reason of the ``"gradient"`` row (see :func:`record_inner_gradient`).
INNER_GRADIENT = (
    "the function computes a gradient itself: its backward pass is already written out as "
    "plain equations, and jaxmem changes only what a differentiation *of the transformed "
    "function* keeps. For a training step, transform the loss instead: "
    "jax.grad(jaxmem.transform(loss)) inside the step. (An inner gradient that is part of a "
    "loss, e.g. a gradient penalty, is fine.)")


def reverse_mode_eqn(jaxpr: core.Jaxpr):
    """The first equation of ``jaxpr`` (bodies included) that JAX's reverse mode wrote (name
    stack ``transpose(...)``: a ``jax.grad`` / ``jax.vjp`` inside the function), else None."""
    for eqn in jaxpr.eqns:
        if "transpose(" in str(eqn.source_info.name_stack):
            return eqn
        for sub in core.jaxprs_in_params(eqn.params):
            found = reverse_mode_eqn(sub)
            if found is not None:
                return found
    return None


def record_inner_gradient(eqn: core.JaxprEqn) -> None:
    """The ``"gradient"`` row of a traced function that differentiates inside (a whole
    training step handed to :func:`jaxmem.transform`), at the first backward equation
    (``eqn``, from :func:`reverse_mode_eqn`)."""
    record(Row("gradient", f"reverse-mode equations ({eqn.primitive.name} under name "
               f"stack '{eqn.source_info.name_stack}')", "", False, INNER_GRADIENT,
               location(eqn), name_stack(eqn), ""))


class Interpreter:
    """Re-emits jaxprs with jaxmem's memory-lean ops (see the module docstring)."""

    def __init__(self, options: Options):
        self.options = options

    def run_outermost(self, closed: core.ClosedJaxpr, args: Sequence[Any]):
        """:meth:`run` on the traced function itself, which first records its ``"gradient"``
        row if it differentiates inside. Returns ``(outputs, first reverse-mode equation or
        None)``."""
        inner_gradient = reverse_mode_eqn(closed.jaxpr)
        if inner_gradient is not None:
            record_inner_gradient(inner_gradient)
        return self.run(closed, args), inner_gradient

    # ------------------------------------------------------------------ one level
    def run(self, closed: core.ClosedJaxpr, args: Sequence[Any], path: str = "") -> list:
        flat = inline_calls(closed, args)
        return self.eval(flat.jaxpr, flat.consts, args, path)

    def plan(self, graph: Graph, path: str) -> dict[int, Match]:
        from jaxmem.transform.match_attention import match_attention
        from jaxmem.transform.match_dot import match_product
        from jaxmem.transform.match_dropout import match_dropout
        from jaxmem.transform.match_elementwise import match_activations
        from jaxmem.transform.match_fused import (
            FUSE_PRODUCTS,
            fuse_activation_products,
            in_recomputed_body,
        )
        from jaxmem.transform.match_norm import match_norms

        opts = self.options
        found: list = []
        taken: set[int] = set()

        def add(item):
            if isinstance(item, Match):
                if item.eqns & taken:
                    return
                taken.update(item.eqns)
            found.append(item)

        if opts.logits_chunk is not None:
            from jaxmem.transform.match_logits import match_logits
            for item in match_logits(graph, taken, path, opts.logits_chunk):
                add(item)
        if opts.attention:
            for item in match_attention(graph, path, opts.attention_chunk):
                add(item)
        if opts.norms:
            for item in match_norms(graph, taken, path):
                add(item)
        if opts.dropout:
            for item in match_dropout(graph, taken, path):
                add(item)
        if opts.pools:
            from jaxmem.transform.match_pool import match_pools
            for item in match_pools(graph, taken, path):
                add(item)
        products: set[int] = set()  # equations re-emitted as selective bilinear ops
        if opts.products:
            for i in range(len(graph.jaxpr.eqns)):
                if i not in taken:
                    item = match_product(graph, i, path,
                                         recompute=opts.norms and opts.conv_recompute,
                                         project=opts.projections and opts.norms
                                         and opts.attention,
                                         computed_weights=opts.computed_weights)
                    if item is not None:
                        add(item)
                        if isinstance(item, Match):
                            products |= item.eqns
        if opts.activations:
            for item in match_activations(graph, taken, path, opts.fewbit, products,
                                          opts.products and opts.gated_products):
                add(item)
            if products and FUSE_PRODUCTS and in_recomputed_body():
                found = fuse_activation_products(graph, found)
        if opts.products and opts.biases:
            from jaxmem.transform.match_bias import match_biases
            for item in match_biases(graph, taken, path):
                add(item)
        if opts.mlp_chunk is not None and opts.products and opts.activations:
            from jaxmem.transform.match_mlp import chunk_mlps
            found = chunk_mlps(graph, found, opts.mlp_chunk)
        plan: dict[int, Match] = {}
        for item in found:
            if isinstance(item, Match):
                plan[item.anchor] = item
                record(item.row)
            else:
                record(item)
        return plan

    def eval(self, jaxpr: core.Jaxpr, consts, args, path: str) -> list:
        from jaxmem.selective.attention import projections_seen
        from jaxmem.transform.match_attention import projected_row

        graph = Graph.build(jaxpr, consts)
        plan = self.plan(graph, path)
        scaled = (scaled_products(graph)
                  if self.options.products and self.options.scaled_products else {})
        skip = set()
        for m in plan.values():
            skip |= m.eqns - {m.anchor}
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, core.Literal) else env[v]

        def write(vs, xs):
            for v, x in zip(vs, xs):
                if not isinstance(v, core.DropVar):
                    env[v] = x

        write(jaxpr.constvars, consts)
        write(jaxpr.invars, args)

        def ready(vs) -> bool:
            return all(isinstance(v, core.Literal) or v in env for v in vs)

        def run_item(i):
            eqn = jaxpr.eqns[i]
            m = plan.get(i)
            if m is not None:
                attends = m.row.kind == "attention"   # its row says what the core keeps
                with context(eqn), (projections_seen() if attends else nullcontext([])) as seen:
                    outs = m.emit(*[read(v) for v in m.inputs])
                if any(seen):
                    amend(m.row, projected_row(m.row, seen))
                write(m.outputs, outs)
            else:
                write(eqn.outvars, self.eqn(eqn, [read(v) for v in eqn.invars], path,
                                            scaled.get(i, ())))

        def inputs(i):
            m = plan.get(i)
            return m.inputs if m is not None else jaxpr.eqns[i].invars

        # A match runs where its last equation was; a statistic it also produces (a batch
        # norm's mean, read by the running average) may be read earlier in the original
        # order: such readers wait until the match has run.
        pending: list[int] = []
        for i in range(len(jaxpr.eqns)):
            if i in skip:
                continue
            if not ready(inputs(i)):
                pending.append(i)
                continue
            run_item(i)
            progress = bool(pending)
            while progress:
                progress = False
                for j in list(pending):
                    if ready(inputs(j)):
                        pending.remove(j)
                        run_item(j)
                        progress = True
        if pending:  # pragma: no cover - a matcher produced a cyclic plan
            raise RuntimeError("jaxmem.transform: equations left unscheduled: "
                               f"{[jaxpr.eqns[i].primitive.name for i in pending]}")
        return [read(v) for v in jaxpr.outvars]

    # --------------------------------------------------------- higher-order primitives
    def eqn(self, eqn, invals: list, path: str, materialise: tuple = ()) -> list:
        """``eqn`` re-emitted on ``invals`` (entered, re-built as a gated product, or bound
        unchanged with the operands at ``materialise`` materialised first:
        :func:`~jaxmem.transform.scaled.materialised`)."""
        name = eqn.primitive.name
        method = getattr(self, "_" + name, None) if _enterable(eqn) else None
        if method is None:
            if name in _NOT_ENTERED or any(True for _ in core.jaxprs_in_params(eqn.params)):
                record(Row("higher-order", name + _named(eqn), "", False,
                           _WHY_NOT.get(name, "not entered yet: its body is re-emitted "
                                              "unchanged"), call_location(eqn),
                           name_stack(eqn), path))
            if (name == "mul" and self.options.products and self.options.gated_products
                    and _gated(eqn, invals)):
                return [_gated_product(eqn, invals, path)]
            outs = bind_eqn(eqn, materialised(eqn, invals, materialise, path)
                            if materialise else invals)
            if name == "add" and self.options.products and self.options.residual_adds:
                _record_add(outs, invals)
            elif name == "name" and len(outs) == 1 and len(invals) == 1:
                _record_name(outs, invals)
            elif name in _RELAYOUTS and self.options.projections:
                _record_relayout(eqn, outs, invals)
            return outs
        record(Row("higher-order", name + _named(eqn), "entered", True, _entered_note(eqn),
                   call_location(eqn), name_stack(eqn), path))
        with context(eqn):
            return method(eqn, invals, _join(path, name))

    def _closed_call(self, eqn, invals, path):
        return self.run(eqn.params["call_jaxpr"], invals, path)

    def _remat2(self, eqn, invals, path):
        p = eqn.params
        body = core.ClosedJaxpr(p["jaxpr"], ())

        def fn(*a):
            # a body without a policy is recomputed whole in the backward pass
            with recomputed_body(p["policy"] is None):
                return self.run(body, a, path)

        return list(jax.checkpoint(fn, prevent_cse=p["prevent_cse"], policy=p["policy"])(
            *invals))

    _checkpoint = _remat2

    def _shard_map(self, eqn, invals, path):
        """The body converted per device, inside a ``shard_map`` of the same mesh, specs,
        manual axes and varying-axes checking."""
        p = eqn.params
        body = core.ClosedJaxpr(p["jaxpr"], ())

        def fn(*a):
            return tuple(self.run(body, a, path))

        f = jax.shard_map(fn, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                          out_specs=tuple(p["out_specs"]), axis_names=p["newly_manual_axes"],
                          check_vma=p["check_vma"])
        return list(f(*invals))

    def _scan(self, eqn, invals, path):
        p = eqn.params
        nc, ncar = scan_counts(p)
        consts, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]
        body = p["jaxpr"]

        def step(carry, x):
            out = self.run(body, [*consts, *carry, *x], path)
            return out[:ncar], out[ncar:]

        if _scan_policy_applies(body):
            # stacked residuals cost their full size: recompute the cheap ones (scan_policy);
            # a body with effects, or already under a checkpoint, runs as written
            step = jax.checkpoint(step, policy=scan_policy, prevent_cse=False)
        carry, ys = lax.scan(step, list(init), list(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]

    def _cond(self, eqn, invals, path):
        index, ops = invals[0], invals[1:]
        branches = [(lambda *a, _b=b, _k=k: self.run(_b, a, f"{path}[{_k}]"))
                    for k, b in enumerate(eqn.params["branches"])]
        return list(lax.switch(index, branches, *ops))

    def _while(self, eqn, invals, path):
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]

        def cond(c):
            return self.run(p["cond_jaxpr"], [*cconsts, *c], path + ".cond")[0]

        def body(c):
            return self.run(p["body_jaxpr"], [*bconsts, *c], path)

        return list(lax.while_loop(cond, body, list(init)))


_ENTERED = {"closed_call", "remat2", "checkpoint", "scan", "cond", "while", "shard_map"}


def _record_add(outs: list, invals: list) -> None:
    """``a + b`` of two values a selective op can recompute (a ResNet block's
    ``bn3(c3) + shortcut``) is recorded as recomputable too
    (:func:`jaxmem._prims.recipes.combine`): the ReLU after it then records the block output,
    and the next block's convolution recomputes its input for its kernel gradient from the
    norms' residuals instead of keeping it (exact: the same ``add`` of bit-identical
    values). Anything else records nothing."""
    from jaxmem._prims.recipes import combine
    if len(outs) == 1 and len(invals) == 2:
        combine(outs[0], lax.add, *invals)


def _gated(eqn, invals: list) -> bool:
    """Whether ``mul(a, b)`` is a product :func:`jaxmem.selective.gated_product` keeps less
    for: two traced floating-point factors of the equation's own shape (of more than one
    row: :func:`~jaxmem.transform.match_elementwise.gate_shaped`) and dtype, one of them a
    value a re-emitted activation or norm can recompute."""
    from jaxmem.selective.gated import recomputable_factor
    from jaxmem.transform.match_elementwise import gate_shaped
    out = eqn.outvars[0].aval
    return (len(invals) == 2 and gate_shaped(out.shape) and np.issubdtype(out.dtype, np.inexact)
            and all(isinstance(x, core.Tracer) and np.shape(x) == out.shape
                    and x.dtype == out.dtype for x in invals)
            and any(recomputable_factor(x) for x in invals))


def _gated_product(eqn, invals: list, path: str):
    """``mul(a, b)`` re-emitted as :func:`jaxmem.selective.gated_product`, with its row."""
    from jaxmem.selective.gated import gated_product, recomputable_factor
    which = " and ".join(n for n, x in zip("ab", invals) if recomputable_factor(x))
    record(Row("gate", f"mul {aval_str(eqn.outvars[0])}",
               "jaxmem.selective.gated_product (exact)", True,
               f"keeps the residuals of {which}'s producer instead of {which}; the product "
               "recomputable from them", call_location(eqn), name_stack(eqn), path))
    return gated_product(*invals)


def _record_name(outs: list, invals: list) -> None:
    """``checkpoint_name(x, ...)`` is ``x``: a recipe of ``x`` holds for it too
    (:func:`jaxmem._prims.recipes.then` with the identity), so a name tag between a norm and
    the layer that reads its output (``jaxmem.planner``'s layer boundaries, a user's remat
    names) does not make that layer keep a second copy."""
    from jaxmem._prims.recipes import then
    then(outs[0], _identity, invals[0])


def _identity(x):
    return x


#: equations that move, cast, repeat or scale one array exactly (bit for bit when re-run):
#: a projection recorded for the attention core stays recorded through them
#: (``broadcast_in_dim``: ``jnp.repeat`` of grouped-query keys / values)
_RELAYOUTS = {"reshape", "transpose", "squeeze", "expand_dims", "slice", "split",
              "convert_element_type", "copy", "mul", "div", "broadcast_in_dim", "neg",
              "concatenate"}
#: relayouts that cut a projection's features apart (recorded only where weights are whole)
_RESLICES = frozenset(("slice", "split", "concatenate"))


def _record_relayout(eqn, outs: list, invals: list) -> None:
    """An equation of :data:`_RELAYOUTS` applied to a projection recorded for the attention
    core (``q = split(LN(x) W + b)[0] / sqrt(d)``, :func:`jaxmem._prims.recipes.project`),
    every other operand a constant or a traced scalar -- or, for a ``mul``, any traced
    factor (a rotary embedding's per-position ``cos`` / ``sin``, which the product keeps for
    its own backward anyway): each output recorded as that equation of the recomputed
    projection, the traced operands added to the recipe's arguments
    (:func:`jaxmem._prims.recipes.extend`), so the core keeps the norm's residuals and ``W``
    instead of ``q``. An equation of several recorded parts of projections and nothing else
    traced (rotary's ``concatenate(-x2, x1)``; their sum is recorded by :func:`_record_add`)
    is recorded over all their arguments (:func:`jaxmem._prims.recipes.combine`). Anything
    else records nothing, nor a ``slice`` / ``split`` / ``concatenate`` where the
    weights are split over devices (a tensor parallel step: re-slicing a fused ``q, k, v``
    projection moves it between devices, so recomputing it would repeat the forward's
    collectives) unless the step allows that
    (:func:`jaxmem._prims.grad_layout.reslice_recomputable`)."""
    from jaxmem._prims.grad_layout import reslice_recomputable
    from jaxmem._prims.recipes import PROJECTED, combine, depth, extend
    if eqn.primitive.name in _RESLICES and not reslice_recomputable():
        return
    traced = [i for i, x in enumerate(invals) if isinstance(x, core.Tracer)]
    projected = [i for i in traced if depth(invals[i]) == PROJECTED]
    if len(projected) > 1 and len(projected) == len(traced) and len(outs) == 1:
        # rotary embeddings' ``concatenate(-x2, x1)``: parts of one projection
        fixed = tuple(None if i in projected else a for i, a in enumerate(invals))
        combine(outs[0], functools.partial(_rebound, eqn, fixed, tuple(projected), 0),
                *[invals[i] for i in projected])
        return
    if len(projected) != 1:
        return
    k = projected[0]
    others = tuple(i for i in traced if i != k)
    if any(np.size(invals[i]) != 1 for i in others) and eqn.primitive.name != "mul":
        return
    fixed = tuple(None if i in traced else a for i, a in enumerate(invals))
    extra = tuple(invals[i] for i in others)
    for j, out in enumerate(outs):
        extend(out, functools.partial(_rebound, eqn, fixed, (k, *others), j), invals[k], extra,
               elementwise=True)


def _rebound(eqn, fixed: tuple, which: tuple, j: int, *xs):
    """Output ``j`` of ``eqn`` re-bound with operands ``which`` set to ``xs`` (the others
    ``fixed``: constants)."""
    vals = list(fixed)
    for i, x in zip(which, xs):
        vals[i] = x
    return bind_eqn(eqn, vals)[j]


def _enterable(eqn) -> bool:
    """Whether ``eqn``'s body is converted (a ``shard_map`` only with the parameters this
    module knows how to re-build it from)."""
    name = eqn.primitive.name
    if name not in _ENTERED:
        return False
    return name != "shard_map" or all(k in eqn.params for k in _SHARD_MAP_PARAMS)

_CUSTOM = ("its derivative rule is the program's own: re-emitting the body would replace "
           "that rule with the body's autodiff (not sound in general); bound unchanged")
#: why a higher-order primitive is left as it is
_WHY_NOT = {
    "custom_jvp_call": _CUSTOM, "custom_vjp_call": _CUSTOM, "custom_vjp_call_jaxpr": _CUSTOM,
    "custom_lin": _CUSTOM, "custom_transpose_call": _CUSTOM,
    "shard_map": "its parameters are not the ones this version of jaxmem re-builds a "
                 "shard_map from (another JAX version); bound unchanged",
    "jit": "a jit with its own layouts or compiler options: not inlined; bound unchanged",
    "pjit": "a jit with its own layouts or compiler options: not inlined; bound unchanged",
}


def _named(eqn) -> str:
    n = eqn.params.get("name")
    return f"[{n}]" if n else ""


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _scan_policy_applies(body) -> bool:
    """Whether a scan body is re-run under ``jax.checkpoint(policy=scan_policy)``."""
    return not body.effects and not has_remat(body.jaxpr)


def _entered_note(eqn) -> str:
    """What entering ``eqn`` did beyond converting its body (scans: the scan policy)."""
    if eqn.primitive.name != "scan":
        return ""
    body = eqn.params["jaxpr"]
    if _scan_policy_applies(body):
        return "body under jax.checkpoint(policy=scan_policy)"
    if body.effects:
        return "body has effects: runs as written (no scan policy, each effect once per step)"
    return "body already under a checkpoint: its own policy kept"

