"""rowconv against PyTorch: ``torch_ref.rowconv`` == ``torch.nn``, and ``jaxmem.rowconv`` ==
``torch_ref.rowconv`` on transferred weights (float64). Skipped as a whole without torch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import rowconv as rc

torch = pytest.importorskip("torch")

from torch_ref.rowconv import Residual as TorchResidual
from torch_ref.rowconv import RowSequential as TorchRowSequential
from torch_ref.rowconv import tile_ranges as torch_tile_ranges


def _torch_stack():
    tnn = torch.nn
    torch.manual_seed(0)
    return tnn.Sequential(
        tnn.Conv2d(3, 4, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
        tnn.Conv2d(4, 6, 5, stride=2, padding=2, groups=2), tnn.Tanh(),
        tnn.AvgPool2d(3, 1, 1), tnn.Conv2d(6, 2, 3, padding=(0, 1), dilation=2)).double()


def _torch_res_stack():
    """Residual blocks (identity and strided projection shortcut), dilation, pooling."""
    tnn = torch.nn
    torch.manual_seed(1)
    return tnn.Sequential(
        tnn.Conv2d(3, 4, 3, padding=1), tnn.ReLU(),
        TorchResidual(tnn.Sequential(tnn.Conv2d(4, 4, 3, padding=1), tnn.ReLU(),
                                     tnn.Conv2d(4, 4, 3, padding=2, dilation=2))),
        TorchResidual(tnn.Sequential(tnn.Conv2d(4, 6, 3, stride=2, padding=1), tnn.Tanh(),
                                     tnn.Conv2d(6, 6, 3, padding=1)),
                      tnn.Sequential(tnn.Conv2d(4, 6, 1, stride=2))),
        tnn.MaxPool2d(3, 2, 1), tnn.Conv2d(6, 2, 5, padding=2)).double()


_STACKS = {"plain": _torch_stack, "residual": _torch_res_stack}


@pytest.mark.parametrize("stack", sorted(_STACKS))
@pytest.mark.parametrize("mode", ["overlap", "share"])
@pytest.mark.parametrize("rows", [2, 5])
def test_torch_ref_equals_torch_nn(torch_device, rows, mode, stack):
    seq = _STACKS[stack]().to(torch_device)
    x = torch.randn(2, 3, 97, 11, dtype=torch.double, device=torch_device, requires_grad=True)
    y0 = seq(x)
    g = torch.randn_like(y0)
    ref = torch.autograd.grad(y0, [x] + list(seq.parameters()), g)
    y = TorchRowSequential(seq, rows, mode)(x)
    got = torch.autograd.grad(y, [x] + list(seq.parameters()), g)
    torch.testing.assert_close(y, y0, rtol=1e-10, atol=1e-10)
    assert len(got) == len(ref) == 1 + len(list(seq.parameters()))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("stack", sorted(_STACKS))
def test_torch_ref_share_tiny_tiles(stack):
    """One output row per tile: carries span several tiles; still exact."""
    seq = _STACKS[stack]()
    x = torch.randn(1, 3, 29, 11, dtype=torch.double, requires_grad=True)
    y0 = seq(x)
    g = torch.randn_like(y0)
    ref = torch.autograd.grad(y0, [x] + list(seq.parameters()), g)
    for rows in (y0.shape[2], 3):
        y = TorchRowSequential(seq, rows, "share")(x)
        got = torch.autograd.grad(y, [x] + list(seq.parameters()), g)
        torch.testing.assert_close(y, y0, rtol=1e-10, atol=1e-10)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("stack", sorted(_STACKS))
def test_torch_ref_share_computes_every_row_once(stack):
    """2PS: the new rows of every map over all tiles partition it (nothing recomputed),
    while OverL computes more rows than the map has (the recomputed halos)."""
    mods = list(_STACKS[stack]())
    _, heights, plan = torch_tile_ranges(mods, 97, 5, "share")
    for m, h in enumerate(heights):
        spans = [(r[m][1], r[m][2]) for r in plan]
        assert spans[0][0] == 0 and all(a <= b for a, b in spans)
        assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
        assert spans[-1][1] <= h
    assert plan[-1][-1][2] == heights[-1]
    _, heights, ov = torch_tile_ranges(mods, 97, 5, "overlap")
    assert sum(r[0][1] - r[0][0] for r in ov) > heights[0]


def test_torch_ref_rejects_bad_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        TorchRowSequential(_torch_stack(), 2, "halo")


def test_torch_ref_rejects_train_bn():
    seq = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3))
    with pytest.raises(ValueError, match="eval mode"):
        TorchRowSequential(seq.train(), 2)(torch.randn(1, 3, 16, 8))


def test_jaxmem_equals_torch_ref_on_transferred_weights():
    seq = _torch_stack()
    layers = [rc.Conv(4, 3, padding=1), rc.Act(jax.nn.relu), rc.Pool("max", 2),
              rc.Conv(6, 5, strides=2, padding=2, feature_group_count=2), rc.Act(jnp.tanh),
              rc.Pool("avg", 3, 1, 1), rc.Conv(2, 3, kernel_dilation=2, padding=((0, 0), (1, 1)))]
    params = []
    for layer, m in zip(layers, seq):
        if isinstance(layer, rc.Conv):
            params.append({"kernel": jnp.asarray(m.weight.detach().numpy().transpose(2, 3, 1, 0)),
                           "bias": jnp.asarray(m.bias.detach().numpy())})
        else:
            params.append({})
    xt = torch.randn(2, 3, 131, 11, dtype=torch.double, requires_grad=True)
    _assert_jaxmem_equals_torch_ref(seq, layers, params, xt, [seq[0].weight],
                                    lambda gp: [gp[0]["kernel"]])


def _assert_jaxmem_equals_torch_ref(seq, layers, params, xt, leaves, param_grads):
    """Both modes, 3 tiles, float64: ``rc.apply`` on the transferred ``params`` gives
    ``torch_ref``'s output, input gradient and the gradients of the torch ``leaves``
    (``param_grads(jax_grads)`` lists the matching JAX ones; HWIO kernels -> OIHW)."""
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)
        xj = jnp.asarray(xt.detach().numpy().transpose(0, 2, 3, 1))
        for mode in rc.MODES:
            yt = TorchRowSequential(seq, 3, mode)(xt)
            gt = torch.autograd.grad(yt.square().sum(), [xt, *leaves])

            def loss(x, p, mode=mode):
                y = rc.apply(layers, p, x, rows=3, mode=mode)
                return jnp.sum(jnp.square(y)), y

            # output and gradients from one compiled program (compared by tolerance)
            (_, yj), (gx, gp) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
                xj, p64)
            np.testing.assert_allclose(np.asarray(yj).transpose(0, 3, 1, 2),
                                       yt.detach().numpy(), rtol=1e-10, atol=1e-10)
            np.testing.assert_allclose(np.asarray(gx).transpose(0, 3, 1, 2), gt[0].numpy(),
                                       rtol=1e-9, atol=1e-9)
            for gj, gtt in zip(param_grads(gp), gt[1:], strict=True):
                gj = np.asarray(gj)
                gj = gj.transpose(3, 2, 0, 1) if gj.ndim == 4 else gj
                np.testing.assert_allclose(gj, gtt.numpy(), rtol=1e-9, atol=1e-9)


def _conv_params(m):
    return {"kernel": jnp.asarray(m.weight.detach().numpy().transpose(2, 3, 1, 0)),
            "bias": jnp.asarray(m.bias.detach().numpy())}


def test_jaxmem_share_equals_torch_ref_share_residual():
    """Residual blocks, both modes: jaxmem == torch_ref on transferred weights (float64)."""
    seq = _torch_res_stack()
    relu, tanh = rc.Act(jax.nn.relu), rc.Act(jnp.tanh)
    layers = [rc.Conv(4, 3, padding=1), relu,
              rc.Residual([rc.Conv(4, 3, padding=1), relu,
                           rc.Conv(4, 3, kernel_dilation=2, padding=2)]),
              rc.Residual([rc.Conv(6, 3, strides=2, padding=1), tanh, rc.Conv(6, 3, padding=1)],
                          [rc.Conv(6, 1, strides=2, padding=0)]),
              rc.Pool("max", 3, 2, 1), rc.Conv(2, 5, padding=2)]
    r1, r2 = seq[2], seq[3]
    params = [_conv_params(seq[0]), {},
              {"branch": [_conv_params(r1.branch[0]), {}, _conv_params(r1.branch[2])],
               "shortcut": []},
              {"branch": [_conv_params(r2.branch[0]), {}, _conv_params(r2.branch[2])],
               "shortcut": [_conv_params(r2.shortcut[0])]},
              {}, _conv_params(seq[5])]
    xt = torch.randn(2, 3, 131, 9, dtype=torch.double, requires_grad=True)
    leaves = [seq[0].weight, r1.branch[2].weight, r2.shortcut[0].weight, seq[5].bias]
    _assert_jaxmem_equals_torch_ref(
        seq, layers, params, xt, leaves,
        lambda gp: [gp[0]["kernel"], gp[2]["branch"][2]["kernel"],
                    gp[3]["shortcut"][0]["kernel"], gp[5]["bias"]])


def test_torch_ref_share_saves_less_than_untiled():
    """2PS saves the input, the parameters and the carried boundary rows (visible to
    saved-tensor hooks), far less than the untiled graph's activations."""
    from torch_ref.measure import saved_bytes
    seq = _torch_res_stack()
    x = torch.randn(1, 3, 128, 16, dtype=torch.double, requires_grad=True)
    full = saved_bytes(lambda: seq(x).square().sum()).total_bytes
    tiled = saved_bytes(lambda: TorchRowSequential(seq, 8, "share")(x).square().sum()).total_bytes
    ov = saved_bytes(lambda: TorchRowSequential(seq, 8, "overlap")(x).square().sum()).total_bytes
    assert ov < tiled < full / 2
