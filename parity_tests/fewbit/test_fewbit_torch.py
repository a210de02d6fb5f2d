"""torch_ref.fewbit vs jaxmem.fewbit: same tables, same bytes, same gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_ref.fewbit as tfb  # noqa: E402
from jaxmem import fewbit  # noqa: E402
from torch_ref.fewbit.ops import FORWARD, MASKS  # noqa: E402

NAMES = sorted(FORWARD) + sorted(MASKS)


def _data(shape, seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=shape) * 3).astype(np.float32)
    return x, rng.normal(size=shape).astype(np.float32)


def _jax_grad(name, bits, x, dy):
    y, f = jax.vjp(fewbit.activation(name, bits), jnp.asarray(x))
    return np.asarray(y), np.asarray(f(jnp.asarray(dy))[0])


def _torch_grad(name, bits, x, dy, device="cpu"):
    xt = torch.tensor(x, device=device, requires_grad=True)
    y = tfb.activation(name, xt, bits)
    y.backward(torch.tensor(dy, device=device))
    return y.detach().cpu().numpy(), xt.grad.cpu().numpy()


@pytest.mark.parametrize("name", NAMES)
def test_gradients_equal(name, torch_device):
    x, dy = _data((3, 41), seed=len(name))
    x[0, :4] = [np.nan, np.inf, -np.inf, 0.0]
    for bits in (1, 2, 3, 4) if name in FORWARD else (1,):
        yj, gj = _jax_grad(name, bits, x, dy)
        yt, gt = _torch_grad(name, bits, x, dy, torch_device)
        np.testing.assert_allclose(gt, gj, rtol=1e-6, atol=0)
        np.testing.assert_array_equal(gt, gj)  # in fact bit-identical
        # forwards are each framework's exact activation: equal to float32 rounding
        np.testing.assert_allclose(yt[1:], yj[1:], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_gradients_equal(dtype):
    x, dy = _data((2, 24), seed=9)
    xj, dyj = jnp.asarray(x, dtype), jnp.asarray(dy, dtype)
    y, f = jax.vjp(lambda x: fewbit.gelu(x, bits=3), xj)
    gj = np.asarray(f(dyj)[0].astype(jnp.float32))
    tdt = getattr(torch, dtype)
    xt = torch.tensor(np.asarray(xj.astype(jnp.float32))).to(tdt).requires_grad_(True)
    tfb.gelu(xt, bits=3).backward(torch.tensor(np.asarray(dyj.astype(jnp.float32))).to(tdt))
    assert xt.grad.dtype == tdt
    np.testing.assert_array_equal(xt.grad.float().numpy(), gj)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_same_packed_bytes(bits):
    rng = np.random.default_rng(bits)
    for shape in [(5,), (3, 16), (2, 3, 7), (0,)]:
        c = rng.integers(0, 2**bits, size=shape).astype(np.uint8)
        pj = np.asarray(fewbit.pack(jnp.asarray(c), bits)).reshape(-1)
        pt = tfb.pack(torch.tensor(c), bits).numpy()
        np.testing.assert_array_equal(pj, pt)
        np.testing.assert_array_equal(tfb.unpack(torch.tensor(pt), bits, shape).numpy(), c)


def test_saved_bytes_density():
    from torch_ref.measure import saved_bytes
    x = torch.randn(64, 80, requires_grad=True)
    for bits in (1, 2, 3, 4):
        r = saved_bytes(lambda x: tfb.gelu(x, bits=bits).sum(), x)
        assert r.total_bytes == 64 * 80 * bits // 8, str(r)
    r0 = saved_bytes(lambda x: torch.nn.functional.gelu(x).sum(), x)
    assert r0.total_bytes >= 64 * 80 * 4


def test_converter():
    nn = torch.nn
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 16), nn.SiLU()),
                          nn.Linear(16, 16), nn.GELU(approximate="tanh"), nn.ELU(alpha=2.0),
                          nn.ReLU(), nn.Tanh(), nn.Linear(16, 1))
    ref = nn.Sequential(*[m for m in model])  # shares the modules list before conversion
    x = torch.randn(4, 8)
    y0 = model(x).detach().clone()
    _, replaced, skipped = tfb.convert(model, bits=2)
    assert sorted(replaced) == ["1", "2.1", "4", "6", "7"]
    assert skipped == ["5 (alpha=2.0)"]
    assert isinstance(model[1], tfb.FewBitActivation) and model[1].name == "gelu"
    assert model[4].name == "gelu_tanh" and model[2][1].name == "silu"
    torch.testing.assert_close(model(x), y0, rtol=0, atol=0)  # forward unchanged
    del ref
    with pytest.raises(ValueError, match="bits"):
        tfb.convert(model, bits=7)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown activation"):
        tfb.activation("swishy", torch.ones(3))
    with pytest.raises(ValueError, match="bits"):
        tfb.gelu(torch.ones(3), bits=0)
    with pytest.raises(TypeError, match="float"):
        tfb.gelu(torch.ones(3, dtype=torch.int32))
