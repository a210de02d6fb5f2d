"""Rules of the attention part (exact): ``softmax`` that stores its output once,
``flax.linen.dot_product_attention`` / ``flax.nnx.dot_product_attention`` and
``nn.MultiHeadDotProductAttention`` through :mod:`jaxmem.fewbit.flax_attention` (when
available), and the model zoo's :class:`jaxmem.models.SelfAttention`."""
from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp

from jaxmem._glue import patch as _gpatch
from jaxmem._glue import report as _report

SOFTMAX_MODULES = ("jax.nn", "flax.linen", "flax.linen.activation", "flax.nnx",
                   "flax.nnx.nn.activations")
DPA_MODULES = ("flax.linen", "flax.linen.attention", "flax.nnx",
               "flax.nnx.nn.attention")


def _softmax_rule(opts, orig):
    _att = importlib.import_module("jaxmem.selective.attention")

    def softmax(x, axis=-1, where=None, **kw):
        if kw or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return orig(x, axis=axis, where=where, **kw)
        return _att.softmax(x, axis=axis, where=where)
    return softmax


def _flax_attention():
    try:
        return importlib.import_module("jaxmem.fewbit.flax_attention")
    except ImportError:
        return None


def _dpa_rule(opts, orig):
    fa = _flax_attention()
    import flax.nnx as nnx_mod
    nnx_orig = getattr(nnx_mod, "dot_product_attention", None)
    nnx_orig = getattr(nnx_orig, "_jaxmem_original", nnx_orig)
    name = "nnx_dot_product_attention" if orig is nnx_orig else "dot_product_attention"
    fn = getattr(fa, name, None) if fa is not None else None
    if fn is None:
        return (None, "unsupported", "jaxmem.fewbit.flax_attention is not available")
    return fn


def _zoo_handler(m, next_fun, args, kwargs):
    if kwargs or len(args) != 1:
        _report.record(kind="module", target=type(m).__name__, technique="attention",
                       status="fallback", reason="extra arguments")
        return next_fun(*args, **kwargs)
    _report.record(kind="module", target=type(m).__name__, technique="attention",
                   status="converted")
    return _zoo_attention(m, args[0])


def _dense(x, params, dtype):
    """``flax.linen.Dense`` arithmetic (promote, dot over the last axis, + bias)."""
    from flax.linen.dtypes import promote_dtype
    kernel, bias = params["kernel"], params.get("bias")
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=dtype)
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


def _zoo_attention(m, x):
    """:class:`jaxmem.models.SelfAttention` computed from its own ``c_attn`` / ``c_proj``
    parameters with the same arithmetic, the attention by :func:`jaxmem.selective.attention`."""
    from jaxmem.selective.attention import attention
    b, t, d = x.shape
    if d % m.n_head:
        raise ValueError(f"SelfAttention: d_model={d} is not divisible by n_head={m.n_head}")
    p = m.variables["params"]
    hd = d // m.n_head
    qkv = _dense(x, p["c_attn"], m.dtype)
    q, k, v = (a.reshape(b, t, m.n_head, hd) for a in jnp.split(qkv, 3, axis=-1))
    y = attention(q, k, v, causal=bool(m.causal), scale=1.0 / math.sqrt(hd))
    return _dense(y.reshape(b, t, d), p["c_proj"], m.dtype)


def _is_zoo(m):
    try:
        from jaxmem.models.transformer import SelfAttention
    except ImportError:  # pragma: no cover
        return False
    return type(m) is SelfAttention


def _mhdpa_handler(m, next_fun, args, kwargs):
    fa = _flax_attention()
    handler = getattr(fa, "linen_attention_handler", None) if fa is not None else None
    if handler is None:
        _report.record(kind="module", target=type(m).__name__, technique="attention",
                       status="unsupported",
                       reason="jaxmem.fewbit.flax_attention is not available")
        return next_fun(*args, **kwargs)
    return handler(m, next_fun, args, kwargs)


def _register():
    import flax.linen as nn
    _gpatch.register("softmax", "attention", [f"{m}.softmax" for m in SOFTMAX_MODULES],
                     _softmax_rule)
    _gpatch.register("dot_product_attention", "attention",
                     [f"{m}.dot_product_attention" for m in DPA_MODULES], _dpa_rule,
                     records=True)
    _gpatch.register_module("attention", _is_zoo, _zoo_handler)
    _gpatch.register_module("attention",
                            lambda m: isinstance(m, nn.MultiHeadDotProductAttention),
                            _mhdpa_handler)


_register()
