"""Flax code as users write it, converted by the one way in, trains exactly like the original.

For every model of :mod:`jaxmem.bench.flax_models` (Linen ResNet built inside the loss,
Linen causal LM unrolled and under ``nn.scan(nn.remat(...))``, NNX CNN, NNX ViT, NNX
``nnx.vmap``/``nnx.scan`` stack; one block where the blocks are unrolled copies, two scan
iterations where they are scanned: :data:`DEPTH`), the model converted with ``jaxmem.linen.convert`` /
``jaxmem.nnx.convert`` (exact options: ``fewbit=None``) must give, against the untouched model
built from the same seed:

* the same logits, loss and every parameter gradient in train mode (dropout active, same rng:
  same masks; BatchNorm on batch statistics) and in eval mode: fp32, ``rtol=1e-5``,
  ``atol=1e-6 * max|ref|`` with ``max|ref|`` over the whole compared tree (an attention key
  bias has an exactly-zero gradient -- softmax ignores a per-query constant -- so its own
  maximum is rounding noise);
* the same parameters and batch statistics after one full jitted optimizer step. Adam's first
  update is ``lr * g / (|g| + eps)``: where the true gradient is exactly zero (a bias before
  BatchNorm, an attention key bias) ``g`` is rounding noise and its sign decides a step of
  size ``lr``, so there (``|g_ref| <= 1e-5 max|g_ref|``) the parameters may differ by up to
  ``2 lr``; elsewhere by ``1e-6 max|ref| + 1e-3 lr`` (+ ``rtol``);
* a ``jaxmem.report`` of the full train step with no supported layer left unconverted (no
  'fallback' and no 'unsupported' entry; smooth activations are 'approximate-not-allowed'
  under exact options, which is the contract, not a miss);
* fewer residual (activation) bytes for the training loss than the untouched model.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from jaxmem.bench.flax_models import STEPS
from jaxmem.measure import residual_bytes

NAMES = sorted(STEPS)
RTOL = 1e-5
ATOL_REL = 1e-6


def _convert(name):
    return jaxmem.nnx.convert if name.startswith("nnx") else jaxmem.linen.convert


def _assert_trees_close(ref, got, what, extra_atol=0.0):
    """Leaf-wise ``|got - ref| <= atol + rtol |ref|``, ``atol = 1e-6 max|ref| + extra_atol``
    (the maximum over every leaf of ``ref``)."""
    ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(ref)
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    assert ref_def == got_def, f"{what}: tree structures differ:\n{ref_def}\n{got_def}"
    scale = max([float(np.max(np.abs(np.asarray(a, np.float64))))
                 for _, a in ref_leaves if np.size(a)] + [1e-30])
    atol = ATOL_REL * scale + extra_atol
    for (path, a), (_, b) in zip(ref_leaves, got_leaves):
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=atol,
                                   err_msg=f"{what} at {jax.tree_util.keystr(path)}")


#: Depth of each case: one block where the blocks are unrolled copies of each other (every
#: layer kind is in the one block); two iterations for the scanned stacks (the carry passes
#: from one layer to the next). ``None``: the case's default (ResNet: one block per stage).
DEPTH = {"linen_lm": 1, "nnx_vit": 1, "nnx_scan": 2}


def _case(name, convert=None):
    return STEPS[name](convert=convert, depth=DEPTH.get(name))


def _fwd_bwd_and_step(case):
    """``(run, args)``: ``run(*args)`` gives ``(grads, (new, loss))``: loss, logits and
    parameter gradients in train and in eval mode, and the state and loss after one full
    train step.

    The step is the body the case's own jitted step runs, ``case.pure_step`` (Linen:
    ``case.step_fn``, the function ``case.train_step`` jits; NNX: the same
    ``nnx.value_and_grad`` + ``optimizer.update`` body as the ``nnx.jit`` step, on the split
    model and optimizer state, merged back by :func:`_step_result`)."""
    f_train, params = case.loss_of_params(True)
    f_eval, _ = case.loss_of_params(False)

    def run(p, *args):
        (lt, yt), gt = jax.value_and_grad(f_train, has_aux=True)(p)
        (le, ye), ge = jax.value_and_grad(f_eval, has_aux=True)(p)
        return {"train": (lt, yt, gt), "eval": (le, ye, ge)}, case.pure_step(*args)

    return run, (params, *case.pure_args)


def _step_result(case, new, loss):
    """``(loss, parameters, batch statistics)`` after the step."""
    if case.api == "linen":
        return loss, new["params"], new.get("batch_stats")
    model, _ = nnx.merge(case.graphdef, new)
    return loss, nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat)


@functools.cache
def _results(name):
    """Both models (untouched ``ref``, converted ``conv``): residual bytes, report, and
    gradients + one step of each, computed in one compiled program (one compile instead of
    two)."""
    cases = {"ref": _case(name), "conv": _case(name, _convert(name))}
    out, runs = {}, {}
    for label, case in cases.items():
        f_train, params = case.loss_of_params(True)
        res = residual_bytes(lambda p, f=f_train: f(p)[0], params)
        rep = jaxmem.report(case.pure_step, *case.pure_args) if label == "conv" else None
        out[label] = {"residual": res, "report": rep}
        runs[label] = _fwd_bwd_and_step(case)
    computed = jax.jit(lambda a: {k: runs[k][0](*a[k]) for k in runs})(
        {k: runs[k][1] for k in runs})
    for label, (grads, (new, loss)) in computed.items():
        out[label]["grads"] = grads
        out[label]["step"] = _step_result(cases[label], new, loss)
    return out


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", NAMES)
def test_outputs_loss_and_gradients_match(name, mode):
    r = _results(name)
    lr, yr, gr = r["ref"]["grads"][mode]
    lc, yc, gc = r["conv"]["grads"][mode]
    _assert_trees_close(yr, yc, f"{name} {mode} logits")
    _assert_trees_close(lr, lc, f"{name} {mode} loss")
    _assert_trees_close(gr, gc, f"{name} {mode} gradients")


@pytest.mark.parametrize("name", NAMES)
def test_one_optimizer_step_matches(name):
    r = _results(name)
    loss_r, par_r, stats_r = r["ref"]["step"]
    loss_c, par_c, stats_c = r["conv"]["step"]
    _assert_trees_close(loss_r, loss_c, f"{name} step loss")
    _assert_trees_close(stats_r, stats_c, f"{name} batch statistics after one step")
    lr = 0.1 if name == "linen_resnet" else 1e-3  # the cases' optimizers (sgd / adamw)
    grads = jax.tree_util.tree_leaves(r["ref"]["grads"]["train"][2])
    gmax = max(float(np.max(np.abs(np.asarray(g)))) for g in grads)
    leaves_r, tdef = jax.tree_util.tree_flatten_with_path(par_r)
    leaves_c, tdef_c = jax.tree_util.tree_flatten_with_path(par_c)
    assert tdef == tdef_c and len(grads) == len(leaves_r)
    scale = max(float(np.max(np.abs(np.asarray(a)))) for _, a in leaves_r)
    for (path, a), (_, b), g in zip(leaves_r, leaves_c, grads):
        a, b, g = (np.asarray(v, np.float64) for v in (a, b, g))
        tol = np.where(np.abs(g) <= 1e-5 * gmax, 2 * lr, ATOL_REL * scale + 1e-3 * lr)
        bad = np.abs(b - a) > tol + RTOL * np.abs(a)
        assert not bad.any(), (f"{name} parameters after one step at "
                               f"{jax.tree_util.keystr(path)}: {np.abs(b - a)[bad][:5]}")


@pytest.mark.parametrize("name", NAMES)
def test_report_leaves_nothing_unconverted(name):
    rep = _results(name)["conv"]["report"]
    assert rep.converted(), f"{name}: report saw no converted call:\n{rep}"
    missed = [e for e in rep.unconverted() if e.status != "approximate-not-allowed"]
    assert missed == [], f"{name}: unconverted calls:\n{rep}"
    unsupported = [e for e in rep.entries if e.status == "unsupported"]
    assert unsupported == [], f"{name}: calls reported unsupported:\n{rep}"


@pytest.mark.parametrize("name", NAMES)
def test_residual_bytes_smaller(name):
    r = _results(name)
    ref, conv = r["ref"]["residual"].activation_bytes, r["conv"]["residual"].activation_bytes
    assert conv < ref, f"{name}: converted keeps {conv} activation bytes, untouched {ref}"


def test_cases_are_reproducible_and_dropout_is_active():
    """Same seed, same parameters; train mode differs from eval mode (dropout is on)."""
    a, b = _case("linen_lm"), _case("linen_lm")
    _assert_trees_close(a.params(), b.params(), "params")
    r = _results("linen_lm")["ref"]["grads"]
    assert not np.allclose(np.asarray(r["train"][1]), np.asarray(r["eval"][1]))
    assert jnp.isfinite(r["train"][0])
