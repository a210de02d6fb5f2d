"""torch.fx importer for jaxmem.schedule (the paper's own setting: OLLA section 5.1).

``trace_training_step(model, loss_fn, inputs, target, lr)`` captures one SGD training
step — forward, backward (``torch.func.grad_and_value``) and the update ``p - lr * g`` — with
``make_fx`` (aten level, mutations functionalised away, views kept) and
``fx_to_graph(gm)`` turns the FX graph into a :class:`jaxmem.schedule.Graph`:

* placeholders -> input nodes whose tensors are persistent (weights and the batch are
  held by the caller, as in PyTorch's training loop); ``get_attr`` -> constants;
* every other aten call -> a node; its output tensor(s) -> edges of ``numel *
  element_size`` bytes read by the nodes that use them;
* ops whose schema returns an alias of an input (``view``, ``t``, ``expand``,
  ``transpose``, ``detach``, ``getitem`` of a multi-output op, ...) share storage in
  PyTorch: they are not nodes and their readers become readers of the base tensor;
* the step's outputs are ``output=True`` edges.

:func:`reorder` rebuilds the FX graph in a planned node order (views are emitted just
before their first use), so the scheduled step can be re-executed and compared with the
original bit for bit. :func:`pytorch_peak` is the paper's baseline: the peak resident
set of PyTorch's program order.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from jaxmem.schedule import Graph, simulate

__all__ = ["FxGraph", "fx_to_graph", "pytorch_peak", "reorder", "trace_training_step"]


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * int(val.element_size())
    return 0


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    rets = schema.returns
    return bool(rets) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in rets
    )


@dataclasses.dataclass
class FxGraph:
    """An imported FX graph: ``graph`` plus the maps needed to reorder it."""

    graph: Graph
    gm: fx.GraphModule
    node_of: dict  # schedule node name -> fx.Node
    views: set  # fx nodes folded as views


def fx_to_graph(gm: fx.GraphModule, donate: Sequence[int] = ()) -> FxGraph:
    """Import ``gm`` (an aten-level FX graph with ``meta['val']``) into a Graph.

    ``donate``: indices of placeholders whose storage the step may free after its last
    use (PyTorch's in-place ``optimizer.step()`` frees nothing but overwrites the
    weights; modelling the old weights as donated to an out-of-place update gives the
    same memory). Other placeholders are persistent. Input nodes are kept first.
    """
    donate = {int(i) for i in donate}
    n_ph = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    for i in donate:
        if not 0 <= i < n_ph:
            raise ValueError(f"donate: index {i} out of range for {n_ph} placeholders")
    ph_index = 0
    g = Graph()
    root: dict[Any, Any] = {}  # fx node (or (node, i)) -> value key of its storage
    producer: dict[Any, str] = {}
    sizes: dict[Any, int] = {}
    persistent: set = set()
    readers: dict[Any, list[str]] = {}
    node_of: dict[str, fx.Node] = {}
    views: set = set()
    outputs: list = []

    def keys_of(arg) -> list:
        out = []
        fx.node.map_arg(arg, lambda n: out.append(n))
        ks = []
        for n in out:
            k = root.get(n, n)
            if isinstance(k, list):
                ks.extend(k)
            else:
                ks.append(k)
        return ks

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" or node.op == "get_attr":
            name = g.add_node(f"{'in' if node.op == 'placeholder' else 'const'}:{node.name}",
                              kind="input" if node.op == "placeholder" else "const")
            node_of[name] = node
            producer[node] = name
            sizes[node] = _nbytes(val)
            if node.op == "get_attr" or ph_index not in donate:
                persistent.add(node)
            if node.op == "placeholder":
                ph_index += 1
            root[node] = node
        elif node.op == "call_function":
            if _is_view(node):
                views.add(node)
                if node.target is operator.getitem:
                    parent, idx = node.args
                    r = root.get(parent, parent)
                    root[node] = r[idx] if isinstance(r, list) else r
                else:
                    ks = keys_of(node.args[0]) if node.args else []
                    root[node] = ks[0] if len(ks) == 1 else ks
                continue
            name = g.add_node(f"op:{len(node_of)}:{node.name}", kind="op")
            node_of[name] = node
            for k in keys_of((node.args, node.kwargs)):
                readers.setdefault(k, []).append(name)
            if isinstance(val, (tuple, list)):
                ks = []
                for i, v in enumerate(val):
                    k = (node, i)
                    producer[k] = name
                    sizes[k] = _nbytes(v)
                    ks.append(k)
                root[node] = ks
            else:
                producer[node] = name
                sizes[node] = _nbytes(val)
                root[node] = node
        elif node.op == "output":
            outputs = keys_of(node.args)
        else:
            raise NotImplementedError(
                f"fx_to_graph: node op {node.op!r} ({node.target}) is not supported; "
                "trace with make_fx so the graph is aten calls only"
            )
    out_set = set(outputs)
    for i, (k, src) in enumerate(producer.items()):
        sinks = [s for s in dict.fromkeys(readers.get(k, [])) if s != src]
        is_p = k in persistent
        g.add_edge(f"t{i}", src, sinks, sizes[k], persistent=is_p,
                   output=(k in out_set) and not is_p)
    # inputs first (a donated buffer exists from the start of the step)
    ins = [n for n in g.nodes if n.startswith("in:")]
    for a, b in itertools.pairwise(ins):
        g.add_edge(f"ctrl:{a}->{b}", a, [b], 0)
    if ins:
        for name in g.nodes:
            if not name.startswith("in:") and not g.preds(name):
                g.add_edge(f"ctrl:{ins[-1]}->{name}", ins[-1], [name], 0)
    g.validate()
    return FxGraph(g, gm, node_of, views)


def pytorch_peak(fxg: FxGraph) -> int:
    """Peak resident bytes of PyTorch's own (program) order: the paper's baseline."""
    return simulate(fxg.graph, fxg.graph.program_order)


def reorder(fxg: FxGraph, order: Sequence[str]) -> fx.GraphModule:
    """A new GraphModule whose nodes run in ``order`` (views right before first use)."""
    fxg.graph.check_order(order)
    old = fxg.gm.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def emit(n: fx.Node) -> fx.Node:
        if n in env:
            return env[n]
        if n in fxg.views:
            fx.node.map_arg((n.args, n.kwargs), emit)
            env[n] = new.node_copy(n, lambda a: env[a])
            return env[n]
        raise RuntimeError(f"internal: {n} used before it was scheduled")

    placeholders = [n for n in old.nodes if n.op == "placeholder"]
    for n in placeholders:  # keep the calling convention
        env[n] = new.node_copy(n, lambda a: env[a])
    for name in order:
        n = fxg.node_of[name]
        if n.op == "placeholder":
            continue
        fx.node.map_arg((n.args, n.kwargs), emit)
        env[n] = new.node_copy(n, lambda a: env[a])
    out = next(n for n in old.nodes if n.op == "output")
    fx.node.map_arg(out.args, emit)
    new.node_copy(out, lambda a: env[a])
    new.lint()
    return fx.GraphModule(fxg.gm, new)


def trace_training_step(
    model: torch.nn.Module,
    loss_fn: Callable,
    inputs: torch.Tensor,
    target: torch.Tensor,
    lr: float = 0.1,
    tracing_mode: str = "real",
) -> tuple[fx.GraphModule, Callable, tuple]:
    """``make_fx`` of one SGD step; returns ``(gm, step, args)`` with
    ``gm(*args) == step(*args)`` = ``(new_params..., loss, new_buffers...)``;
    ``args = (*params, x, y)``
    (pass ``donate=range(len(params))`` to :func:`fx_to_graph` for in-place SGD).
    ``tracing_mode="fake"`` records the graph on fake tensors (shapes only, nothing is
    computed: for steps too big to run here); ``"real"`` runs the step once."""
    if tracing_mode not in ("real", "fake"):
        raise ValueError(f"tracing_mode: must be 'real' or 'fake', got {tracing_mode!r}")
    from torch.fx.experimental.proxy_tensor import make_fx

    names = [n for n, _ in model.named_parameters()]
    params = [p.detach().clone() for _, p in model.named_parameters()]
    buffers = {n: b for n, b in model.named_buffers()}

    def loss_of(ps, x, y):
        state = dict(zip(names, ps))
        # buffers (BatchNorm running statistics) are updated in place by the forward:
        # work on copies inside the transformed function and return them as outputs
        bufs = {n: b.clone() for n, b in buffers.items()}
        state.update(bufs)
        out = torch.func.functional_call(model, state, (x,))
        return loss_fn(out, y), list(bufs.values())

    def step(*args):
        ps = list(args[: len(names)])
        x, y = args[len(names):]
        grads, (loss, bufs) = torch.func.grad_and_value(loss_of, has_aux=True)(ps, x, y)
        new = [p - lr * g for p, g in zip(ps, grads)]
        return (*new, loss, *bufs)

    args = (*params, inputs, target)
    # fake mode: closed-over real tensors (BatchNorm buffers) are allowed as constants
    gm = make_fx(torch.func.functionalize(step, remove="mutations"),
                 tracing_mode=tracing_mode,
                 _allow_non_fake_inputs=tracing_mode == "fake")(*args)
    return gm, step, args
