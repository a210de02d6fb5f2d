"""Exact (bitwise) weight transfer between ``torch_ref.models`` and ``jaxmem.models``.

The JAX path of a torch parameter is its module path (``layer1_0.conv1`` ->
``('layer1_0', 'conv1')``) plus the flax variable name; per module type:

=====================  ==========================  =========================================
torch module           torch tensor                flax variable (layout)
=====================  ==========================  =========================================
``nn.Conv2d``          ``weight`` (O, I, kh, kw)   ``params/.../kernel`` (kh, kw, I, O)
                       ``bias`` (O,)               ``params/.../bias``
``nn.Linear``          ``weight`` (out, in)        ``params/.../kernel`` (in, out)
                       ``bias``                    ``params/.../bias``
``nn.BatchNorm2d/1d``  ``weight``, ``bias``        ``params/.../scale``, ``params/.../bias``
                       ``running_mean/var``        ``batch_stats/.../mean``, ``.../var``
``nn.LayerNorm``       ``weight``, ``bias``        ``params/.../scale``, ``params/.../bias``
``nn.Embedding``       ``weight`` (n, d)           ``params/.../embedding`` (n, d)
any other module       a raw ``nn.Parameter`` p    ``params/.../p`` (same layout)
=====================  ==========================  =========================================

``num_batches_tracked`` is torch-only bookkeeping (unused with a fixed momentum) and is skipped.
Transposes are pure permutations, so values are copied bit for bit both ways. Modules with
parameters of any other type (e.g. ``nn.Conv1d``, ``nn.MultiheadAttention``) are rejected
with a ``TypeError`` naming them; name/shape mismatches raise ``ValueError`` naming the
offending parameter.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

# per supported module type: (torch attribute, flax collection, flax name, torch->jax, jax->torch)
_Perm = Callable[[np.ndarray], np.ndarray]


def _ident(a: np.ndarray) -> np.ndarray:
    return a


def _conv_t2j(a: np.ndarray) -> np.ndarray:
    return np.transpose(a, (2, 3, 1, 0))  # OIHW -> HWIO


def _conv_j2t(a: np.ndarray) -> np.ndarray:
    return np.transpose(a, (3, 2, 0, 1))  # HWIO -> OIHW


def _dense_t(a: np.ndarray) -> np.ndarray:
    return np.transpose(a, (1, 0))


_BN_RULES = [("weight", "params", "scale", _ident, _ident),
             ("bias", "params", "bias", _ident, _ident),
             ("running_mean", "batch_stats", "mean", _ident, _ident),
             ("running_var", "batch_stats", "var", _ident, _ident)]

_RULES: list[tuple[type, list[tuple[str, str, str, _Perm, _Perm]]]] = [
    (nn.Conv2d, [("weight", "params", "kernel", _conv_t2j, _conv_j2t),
                 ("bias", "params", "bias", _ident, _ident)]),
    (nn.Linear, [("weight", "params", "kernel", _dense_t, _dense_t),
                 ("bias", "params", "bias", _ident, _ident)]),
    (nn.modules.batchnorm._BatchNorm, _BN_RULES),
    (nn.LayerNorm, [("weight", "params", "scale", _ident, _ident),
                    ("bias", "params", "bias", _ident, _ident)]),
    (nn.Embedding, [("weight", "params", "embedding", _ident, _ident)]),
]

_SKIP_BUFFERS = {"num_batches_tracked"}


def _module_rules(name: str, mod: nn.Module):
    own_params = dict(mod.named_parameters(recurse=False))
    own_buffers = {k: v for k, v in mod.named_buffers(recurse=False) if v is not None}
    for cls, rules in _RULES:
        if isinstance(mod, cls):
            if isinstance(mod, (nn.Conv2d,)) and (mod.groups != 1 or mod.padding_mode != "zeros"):
                raise TypeError(f"torch_to_jax: module {name or '<root>'!r} ({type(mod).__name__}) "
                                "with groups != 1 or non-zero padding_mode is not supported")
            out = []
            for attr, coll, jname, t2j, j2t in rules:
                t = own_params.get(attr, own_buffers.get(attr))
                if t is not None:
                    out.append((attr, t, coll, jname, t2j, j2t))
            known = {r[0] for r in rules} | _SKIP_BUFFERS
            extra = (set(own_params) | set(own_buffers)) - known
            if extra:
                raise TypeError(f"torch_to_jax: module {name or '<root>'!r} ({type(mod).__name__}) "
                                f"has unsupported tensors {sorted(extra)}")
            return out
    # Not a known layer: only plain containers holding raw nn.Parameters are supported.
    if type(mod).__module__.startswith("torch.nn.modules") and (own_params or own_buffers):
        raise TypeError(
            f"torch_to_jax: module {name or '<root>'!r} of type {type(mod).__name__} is not "
            "supported (supported: Conv2d, Linear, BatchNorm, LayerNorm, Embedding, and raw "
            "nn.Parameters of custom modules)")
    if own_buffers:
        raise TypeError(f"torch_to_jax: module {name or '<root>'!r} ({type(mod).__name__}) has "
                        f"buffers {sorted(own_buffers)} that have no JAX counterpart")
    return [(attr, p, "params", attr, _ident, _ident) for attr, p in own_params.items()]


def _entries(torch_model: nn.Module):
    """Yield ``(torch_name, tensor, (collection, *path), t2j, j2t)`` for every transferred tensor."""
    if not isinstance(torch_model, nn.Module):
        raise TypeError(f"torch_model must be a torch.nn.Module, got {type(torch_model).__name__}")
    for name, mod in torch_model.named_modules():
        path = tuple(name.split(".")) if name else ()
        for attr, t, coll, jname, t2j, j2t in _module_rules(name, mod):
            tname = f"{name}.{attr}" if name else attr
            yield tname, t, (coll, *path, jname), t2j, j2t


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _flatten(tree: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    out: dict[tuple, Any] = {}
    if hasattr(tree, "items"):
        for k, v in tree.items():
            out.update(_flatten(v, prefix + (str(k),)))
    else:
        out[prefix] = tree
    return out


def torch_to_jax(torch_model: nn.Module) -> dict[str, dict]:
    """Variables ``{'params': ..., ['batch_stats': ...]}`` for the JAX twin of ``torch_model``.

    Values are numpy-backed ``jax.Array``s equal bit for bit to the torch tensors (kernels
    transposed). The result can be passed straight to ``jax_model.apply``.
    """
    import jax.numpy as jnp

    out: dict[str, dict] = {}
    for _tname, t, path, t2j, _ in _entries(torch_model):
        if t.dtype == torch.bfloat16:  # numpy has no bf16: go through f32 (exact) and back
            arr = jnp.asarray(np.ascontiguousarray(t2j(t.detach().cpu().float().numpy())),
                              dtype=jnp.bfloat16)
        else:
            arr = jnp.asarray(np.ascontiguousarray(t2j(t.detach().cpu().numpy())))
        _set(out, path, arr)
    if "params" not in out:
        out["params"] = {}
    return out


def grads_to_jax(torch_model: nn.Module, *, missing: str = "error") -> dict:
    """The ``.grad`` of every torch parameter, laid out like the JAX twin's ``params`` tree.

    For comparing gradients across frameworks: ``grads_to_jax(m)`` has the structure of
    ``jax.grad(loss)(variables['params'])``. ``missing`` says what to do with a parameter
    whose ``.grad`` is ``None``: ``'error'`` (ValueError naming it) or ``'zeros'``.
    """
    import jax.numpy as jnp

    if missing not in ("error", "zeros"):
        raise ValueError(f"grads_to_jax: missing must be 'error' or 'zeros', got {missing!r}")
    out: dict = {}
    for tname, t, path, t2j, _ in _entries(torch_model):
        if path[0] != "params":
            continue
        g = t.grad
        if g is None:
            if missing == "error":
                raise ValueError(f"grads_to_jax: torch parameter {tname!r} has no .grad "
                                 "(not reached by backward, or requires_grad=False)")
            g = torch.zeros_like(t)
        g = g.detach().cpu()
        arr = g.float().numpy() if g.dtype == torch.bfloat16 else g.numpy()
        _set(out, path[1:], jnp.asarray(np.ascontiguousarray(t2j(arr))))
    return out


def _path_str(path: tuple) -> str:
    return "/".join(path)


def _stage(variables: Any, torch_model: nn.Module, who: str):
    """Match ``variables`` to ``torch_model``'s tensors: ``[(tensor, torch-layout array)]``."""
    if not hasattr(variables, "items") or "params" not in variables:
        raise TypeError(f"{who}: variables must be a mapping with a 'params' entry "
                        f"(what model.init returns), got {type(variables).__name__}")
    flat = _flatten(dict(variables.items()))
    entries = list(_entries(torch_model))
    expected = {path for _, _, path, _, _ in entries}
    missing = [(tn, p) for tn, _, p, _, _ in entries if p not in flat]
    if missing:
        tn, p = missing[0]
        raise ValueError(f"{who}: variables lack {_path_str(p)!r} (for torch {tn!r}); "
                         f"{len(missing)} missing in all")
    unexpected = sorted(p for p in flat if p not in expected and p[0] in ("params", "batch_stats"))
    if unexpected:
        raise ValueError(f"{who}: variable {_path_str(unexpected[0])!r} has no counterpart "
                         f"in {type(torch_model).__name__} ({len(unexpected)} unexpected in all)")
    staged = []
    for tname, t, path, _, j2t in entries:
        arr = np.asarray(flat[path])
        if arr.ndim != t.dim():
            raise ValueError(f"{who}: shape mismatch for {_path_str(path)!r} -> torch {tname!r}: "
                             f"JAX shape {tuple(arr.shape)}, torch shape {tuple(t.shape)}")
        arr = j2t(arr)
        if tuple(arr.shape) != tuple(t.shape):
            raise ValueError(f"{who}: shape mismatch for {_path_str(path)!r} -> torch "
                             f"{tname!r}: JAX gives {tuple(arr.shape)} after layout transpose, "
                             f"torch expects {tuple(t.shape)}")
        if arr.dtype.kind in "iub" and t.is_floating_point():
            raise TypeError(f"{who}: {_path_str(path)!r} has dtype {arr.dtype}, cannot be loaded "
                            f"into torch {tname!r} of dtype {t.dtype}")
        staged.append((t, arr))
    return staged


def jax_to_torch(variables: Any, torch_model: nn.Module) -> nn.Module:
    """Load JAX ``variables`` (``{'params': ..., 'batch_stats': ...}``) into ``torch_model``
    in place (and return it). Exact: values are copied bit for bit (kernels transposed).

    Raises ``ValueError`` naming the parameter on a missing / unexpected variable or a shape
    mismatch, ``TypeError`` on an unsupported module or a non-float dtype. A float dtype
    different from the torch tensor's (e.g. bf16 params) is cast to the torch dtype. Nothing
    is written unless every tensor matches.
    """
    staged = _stage(variables, torch_model, "jax_to_torch")
    with torch.no_grad():
        for t, arr in staged:
            if arr.dtype.kind == "V" or arr.dtype.name == "bfloat16":  # numpy has no bf16
                arr = arr.astype(np.float32)  # exact; cast back to the torch dtype below
            src = torch.from_numpy(np.array(arr, copy=True, order="C"))  # writable copy
            t.copy_(src.to(device=t.device, dtype=t.dtype))
    return torch_model


def check_compatible(variables: Any, torch_model: nn.Module) -> None:
    """Raise (as :func:`jax_to_torch` would) unless ``variables`` fit ``torch_model`` exactly
    (names and shapes); writes nothing."""
    _stage(variables, torch_model, "check_compatible")


def init_twins(jax_model: Any, torch_model: nn.Module, key: Any, *args: Any, **kwargs: Any):
    """Initialise both twins identically: ``variables = jax_model.init(key, *args, **kwargs)``
    (flax's initialisers), loaded into ``torch_model`` with :func:`jax_to_torch`.

    Returns ``variables``. The converse (torch's initialisers) is ``torch_to_jax(torch_model)``.
    """
    variables = dict(jax_model.init(key, *args, **kwargs).items())
    jax_to_torch(variables, torch_model)
    return variables


__all__ = ["check_compatible", "grads_to_jax", "init_twins", "jax_to_torch", "torch_to_jax"]
