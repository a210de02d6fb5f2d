"""torch_ref.olla: torch.fx importer, PyTorch-order baseline, reordered re-execution."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from jaxmem.schedule import optimize, simulate, validate_plan
from torch_ref.olla import fx_to_graph, pytorch_peak, reorder, trace_training_step


def _mlp_case():
    from torch_ref.models import MLP

    torch.manual_seed(0)
    model = MLP(16, (32, 32, 10))
    return model, torch.nn.functional.cross_entropy, torch.randn(4, 16), torch.randint(0, 10, (4,))


def _conv_case():
    from torch_ref.models import ConvChain

    torch.manual_seed(1)
    return ConvChain(3, 4), torch.nn.functional.mse_loss, torch.randn(2, 4, 8, 8), \
        torch.randn(2, 4, 8, 8)


@pytest.mark.parametrize("case", [_mlp_case, _conv_case], ids=["mlp", "convchain"])
@pytest.mark.parametrize("donate", [False, True])
def test_reordered_fx_graph_reproduces_the_step(case, donate):
    model, loss_fn, x, y = case()
    gm, step, args = trace_training_step(model, loss_fn, x, y, lr=0.05)
    n_params = len(args) - 2
    fxg = fx_to_graph(gm, donate=range(n_params) if donate else ())
    g = fxg.graph
    assert pytorch_peak(fxg) == simulate(g, g.program_order)
    plan = optimize(g, time_limit=2)
    validate_plan(g, plan)
    assert plan.peak <= plan.baseline_peak
    gm2 = reorder(fxg, plan.order)
    ref = step(*args)
    out_fx, out_new = gm(*args), gm2(*args)
    assert len(out_new) == len(ref) == n_params + 1
    for a, b, c in zip(ref, out_fx, out_new):
        assert torch.equal(a, b) and torch.equal(b, c)
    # the reordered module really runs in the planned order
    order_ops = [n.name for n in gm2.graph.nodes if n.op == "call_function" and n not in fxg.views]
    planned = [fxg.node_of[v].name for v in plan.order if v.startswith("op:")]
    assert [o for o in order_ops if o in set(planned)] == planned
    # SGD really updated the weights
    p0 = [p.detach() for p in model.parameters()]
    grads = torch.autograd.grad(loss_fn(model(x), y), list(model.parameters()))
    for new, old, gr in zip(out_new[:n_params], p0, grads):
        torch.testing.assert_close(new, old - 0.05 * gr, rtol=1e-5, atol=1e-6)


def test_importer_sizes_views_and_persistence():
    model, loss_fn, x, y = _mlp_case()
    gm, _step, args = trace_training_step(model, loss_fn, x, y)
    fxg = fx_to_graph(gm)
    g = fxg.graph
    # every placeholder is persistent unless donated
    assert g.persistent_bytes() == sum(a.numel() * a.element_size() for a in args)
    fxd = fx_to_graph(gm, donate=[0])
    assert fxd.graph.persistent_bytes() == g.persistent_bytes() - args[0].numel() * 4
    # views (t, view, expand, detach, ...) are folded: no node, no bytes
    targets = {str(fxg.node_of[v].target) for v in g.nodes if v.startswith("op:")}
    assert not any(t.startswith(("aten.t.", "aten.view.", "aten.expand.", "aten.detach."))
                   for t in targets), targets
    # one output edge per new parameter and the loss
    outs = [e for e in g.edges.values() if e.output]
    assert len(outs) == len(args) - 2 + 1
    with pytest.raises(ValueError, match="donate"):
        fx_to_graph(gm, donate=[99])
    with pytest.raises(ValueError, match="order"):
        reorder(fxg, list(g.nodes)[::-1])


def test_torch_optimisation_reduces_the_pytorch_order_peak():
    # in-place SGD (donated weights): updating a layer's weights as soon as its gradient
    # exists frees the gradient early; PyTorch's order updates all weights at the end
    model, loss_fn, x, y = _mlp_case()
    gm, _step, args = trace_training_step(model, loss_fn, x, y)
    fxg = fx_to_graph(gm, donate=range(len(args) - 2))
    plan = optimize(fxg.graph, time_limit=3)
    assert plan.peak < pytorch_peak(fxg)
    assert plan.lower_bound <= plan.peak


def test_fake_tracing_builds_the_same_graph_without_computing():
    """tracing_mode='fake' (for steps too big to run) records the same graph: same nodes,
    edges and sizes, hence the same program-order peak; BatchNorm buffers included."""
    from torch_ref.models import resnet18

    torch.manual_seed(0)
    model = resnet18(width=0.125, num_classes=4, stem="cifar")
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 4, (2,))
    n_params = len(list(model.parameters()))
    real = fx_to_graph(trace_training_step(model, torch.nn.functional.cross_entropy, x, y)[0],
                       donate=range(n_params)).graph
    fake = fx_to_graph(trace_training_step(model, torch.nn.functional.cross_entropy, x, y,
                                           tracing_mode="fake")[0],
                       donate=range(n_params)).graph
    assert list(real.nodes) == list(fake.nodes)
    assert {k: (e.size, e.sinks) for k, e in real.edges.items()} == \
        {k: (e.size, e.sinks) for k, e in fake.edges.items()}
    assert simulate(real) == simulate(fake)
    with pytest.raises(ValueError, match="tracing_mode"):
        trace_training_step(model, torch.nn.functional.cross_entropy, x, y, tracing_mode="meta")
