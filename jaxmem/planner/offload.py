"""Host offload of a chunk's residuals: keep them in host memory between forward and backward.

:func:`offload_chunk` runs a chunk ``f`` once forward; the values its backward needs, other than
the chunk's own inputs, are copied from device memory to host memory (``pinned_host``) right
after they are produced and copied back once the chunk's backward starts. By default only the
outputs of matmuls and convolutions move and the elementwise work between them is recomputed
(the same expressions: values and gradients are the untouched chunk's up to the rounding of
another fusion). Device memory then holds the chunk's inputs (as with full recomputation)
while the moved bytes ``R`` live on the host; the price is two transfers of ``R`` bytes (see
:func:`transfer_seconds`). :func:`offload_policy` is the plain ``jax.checkpoint`` policy for
the same placement, which XLA:GPU schedules without the ties :func:`offload_chunk` adds.

JAX lowers the memory placement only for GPU and TPU. On CPU the device memory *is* host
memory: the copies lower to nothing (no ``host_*`` bytes).

Compiled bytes with offload (``m = jit(...).lower(...).compile().memory_analysis()``)::

    device = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes
    host   = m.host_argument_size_in_bytes + m.host_output_size_in_bytes
             + m.host_temp_size_in_bytes - m.host_alias_size_in_bytes
"""
from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from jaxmem._compat import core, saved_residuals
from jaxmem._prims.ties import barrier_off_cpu
from jaxmem.planner.trace import itemsize

__all__ = ["HOST_KIND", "compiled_bytes", "host_offload_kind", "offload_available",
           "offload_chunk", "offload_policy", "residual_bytes", "transfer_seconds"]

#: The memory kind residuals are offloaded to. JAX's checkpoint machinery maps only
#: ``pinned_host`` to its host memory space (``unpinned_host`` maps to device memory).
HOST_KIND = "pinned_host"
_PLACED_PLATFORMS = ("gpu", "tpu")   # platforms where JAX lowers device_put memory kinds
_KEY_PRIMS = frozenset({"random_seed", "random_wrap", "random_split", "random_fold_in",
                        "random_clone"})
_DOT_PRIMS = frozenset({"dot_general", "conv_general_dilated"})


def _device(device: Any) -> Any:
    if device is None:
        return jax.devices()[0]
    if not isinstance(device, jax.Device):
        raise TypeError(f"device must be a jax.Device or None, got {device!r} "
                        f"({type(device).__name__})")
    return device


def offload_available(device: Any = None) -> tuple[bool, str]:
    """Whether ``device`` (default: ``jax.devices()[0]``) can hold residuals in a separate
    host memory, and why (a one-line reason naming the platform)."""
    d = _device(device)
    plat = d.platform
    if plat == "cpu":
        return False, "CPU: host memory is the device memory; offloading saves nothing"
    if plat not in _PLACED_PLATFORMS:
        return False, (f"{plat}: JAX places values in host memory only on GPU and TPU; "
                       "offloading would be a no-op")
    try:
        kinds = [m.kind for m in d.addressable_memories()]
        default = d.default_memory().kind
    except Exception as e:  # noqa: BLE001  # pragma: no cover - backends without memories
        return False, f"{plat}: device reports no memory kinds ({type(e).__name__}: {e})"
    if default != "device":
        return False, (f"{plat}: default memory kind is {default!r}, not 'device'; "
                       "residuals already live there")
    if HOST_KIND in kinds:
        return True, f"{plat}: residuals can move from 'device' to {HOST_KIND!r} memory"
    return False, f"{plat}: no {HOST_KIND!r} memory among the device's memories {kinds}"


def host_offload_kind(device: Any = None) -> str | None:
    """The memory kind residuals can be offloaded to on ``device`` (``'pinned_host'`` on GPU and
    TPU), or ``None`` where host memory is the device memory (CPU) or no host kind exists."""
    return HOST_KIND if offload_available(device)[0] else None


def _check_dst(dst: Any) -> str:
    if not isinstance(dst, str) or dst != HOST_KIND:
        raise ValueError(f"dst must be {HOST_KIND!r} (the only host memory kind JAX offloads "
                         f"checkpoint residuals to), got {dst!r}")
    return dst


def offload_policy(dst: str = "pinned_host", *, only_dots: bool = False) -> Callable[..., Any]:
    """A ``jax.checkpoint`` policy that offloads every residual computed inside the chunk from
    ``'device'`` to ``dst`` memory (``Offloadable(src="device", dst=dst)``) instead of keeping it
    on device or recomputing it.

    ``only_dots=True`` offloads only the outputs of ``dot_general`` and convolutions (batched
    ones included) and recomputes everything else from them in the backward pass: fewer bytes
    to move (GPT block, d_model 64, ctx 64, batch 16: 3.25 MiB instead of 12.3 MiB) for
    recomputed elementwise work.

    On XLA:GPU (H100 plan, jax 0.10.2) this policy alone saves little or nothing: the copies
    back and the weight gradients are scheduled freely, so restored residuals of several layers
    are live at once (the planner's GPT 4x64 b16, every unit offloaded: 33.3 MiB against 28.2
    stored). :func:`offload_chunk` orders them.

    Kept on device instead (``Saveable``): PRNG key values (outputs of ``random_seed``,
    ``random_wrap``, ``random_split``, ..., a few bytes each) and values already placed by a
    ``device_put`` or computed from host-memory inputs (their source is not ``'device'``).
    """
    dst = _check_dst(dst)
    if not isinstance(only_dots, bool):
        raise TypeError(f"only_dots must be a bool, got {only_dots!r}")
    move = Offloadable(src="device", dst=dst)

    def policy(prim, *avals, **params):
        del params
        if only_dots and prim.name not in _DOT_PRIMS:
            return Recompute
        if prim.name in _KEY_PRIMS or prim.name == "device_put":
            return Saveable
        for a in avals:
            dt = getattr(a, "dtype", None)
            if dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.extended):
                return Saveable
            if getattr(a, "memory_space", core.MemorySpace.Device) == core.MemorySpace.Host:
                return Saveable
        return move

    policy.__name__ = f"offload_{'dots' if only_dots else 'all'}_to_{dst}"
    policy.__qualname__ = policy.__name__
    return policy


@jax.tree_util.register_pytree_node_class
class _Stash:
    """A chunk's VJP residuals: ``leaves`` (arrays, some in host memory), which of them were
    ``moved`` to host memory, and the VJP's tree structure (static)."""

    def __init__(self, leaves, moved, treedef):
        self.leaves, self.moved, self.treedef = list(leaves), tuple(moved), treedef

    def tree_flatten(self):
        return (self.leaves,), (self.moved, self.treedef)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


def _movable(x: Any, inputs: set[int]) -> bool:
    """Whether residual ``x`` goes to host memory: not one of the chunk's own inputs (the
    device holds those anyway), not a PRNG key or empty, not in host memory already."""
    if id(x) in inputs or not hasattr(x, "dtype") or not getattr(x, "size", 0):
        return False
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return False
    return getattr(jax.typeof(x), "memory_space", core.MemorySpace.Device) \
        != core.MemorySpace.Host


def offload_chunk(f: Callable[..., Any], dst: str = "pinned_host", *,
                  only_dots: bool = True) -> Callable[..., Any]:
    """``f`` with the same values and gradients whose residuals live in ``dst`` memory between
    the forward and the backward pass (reverse mode: a ``jax.custom_vjp``).

    The forward runs ``jax.vjp`` of ``jax.checkpoint(f, policy)`` -- ``dots_saveable`` with
    ``only_dots=True`` (the outputs of ``dot_general`` and convolutions are kept, the
    elementwise work between them is recomputed in the backward), ``everything_saveable``
    otherwise -- and moves every residual that is not one of ``f``'s inputs, a PRNG key or
    already in host memory to ``dst``. The backward

    1. ties the host residuals to the incoming cotangent (one ``optimization_barrier`` off
       CPU), so their copies back to the device start only once this chunk's backward does;
    2. applies the VJP, and releases all of its cotangents -- the input's and every weight
       gradient -- together (one barrier), so XLA forms the chunk's weight gradients here and
       does not keep the restored residuals until the end of the step.

    Same equations, so the same values and gradients as ``f`` (bit for bit with
    ``only_dots=False``; recomputed elementwise work is the forward's own expressions).

    Why the ties: JAX's own ``jax.checkpoint(f, policy=offload_policy())`` compiles on XLA:GPU's
    H100 plan (jax 0.10.2), but there the restoring copies and the weight gradients are
    scheduled freely and the device keeps as much as it did: the planner's GPT 4x64 b16 with
    every unit offloaded 33.3 MiB against 28.2 stored (``only_dots`` 25.0); with these ties
    16.5 MiB (ViT 4x64 18.6 -> 12.7, ResNet-50 w 0.125 14.8 -> 11.9 MiB).
    ``only_dots=True`` moves fewer bytes and keeps fewer on the device on all three (offloading
    every residual: 23.3 / 14.6 / 11.6 MiB, with 4x / 4x / 8x the host bytes).

    On CPU the copies lower to nothing and the barriers are not emitted. ``jax.jvp`` of the
    result is not defined (``custom_vjp``); ``grad``, ``vmap``, ``scan`` and an outer
    ``jax.checkpoint`` are.
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {f!r} ({type(f).__name__})")
    dst = _check_dst(dst)
    if not isinstance(only_dots, bool):
        raise TypeError(f"only_dots must be a bool, got {only_dots!r}")
    policy = (jax.checkpoint_policies.dots_saveable if only_dots
              else jax.checkpoint_policies.everything_saveable)
    kept = jax.checkpoint(f, policy=policy, prevent_cse=True)
    host = jax.memory.Space.Host

    @jax.custom_vjp
    def chunk(*args):
        return f(*args)

    def fwd(*args):
        out, vjp = jax.vjp(kept, *args)
        leaves, treedef = jax.tree_util.tree_flatten(vjp)
        inputs = {id(a) for a in jax.tree_util.tree_leaves(args)}
        moved = [_movable(x, inputs) for x in leaves]
        leaves = [jax.device_put(x, host) if m else x for x, m in zip(leaves, moved)]
        return out, _Stash(leaves, moved, treedef)

    def bwd(stash, ct):
        away = [x for x, m in zip(stash.leaves, stash.moved) if m]
        if away:
            away, ct = barrier_off_cpu((away, ct))
        it = iter(away)
        leaves = [jax.device_put(next(it), jax.memory.Space.Device) if m else x
                  for x, m in zip(stash.leaves, stash.moved)]
        grads = jax.tree_util.tree_unflatten(stash.treedef, leaves)(ct)
        return barrier_off_cpu(grads)

    chunk.defvjp(fwd, bwd)
    functools.update_wrapper(chunk, f, updated=())
    return chunk


def residual_bytes(f: Callable[..., Any], *args: Any) -> dict[str, int]:
    """Bytes ``f(*args)`` keeps for its backward pass, by where they live: ``"arguments"``
    (inputs of ``f`` kept as they are), ``"device"`` (activations in device memory) and
    ``"host"`` (activations offloaded to host memory). Sums ``size * itemsize`` over
    ``jax.ad_checkpoint``'s saved residuals of ``jax.vjp(f, *args)``."""
    if not callable(f):
        raise TypeError(f"f must be callable, got {f!r} ({type(f).__name__})")
    out = {"arguments": 0, "device": 0, "host": 0}
    for aval, why in saved_residuals(f, *args):
        n = int(math.prod(aval.shape)) * itemsize(aval.dtype)
        if str(why).startswith("from the argument"):
            out["arguments"] += n
        elif getattr(aval, "memory_space", None) == core.MemorySpace.Host:
            out["host"] += n
        else:
            out["device"] += n
    return out


def compiled_bytes(compiled: Any) -> dict[str, int]:
    """``{"device": ..., "host": ...}`` bytes of a compiled executable (arguments + outputs +
    temporaries − aliases, in device memory and in host memory)."""
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError("compiled.memory_analysis() returned None; this backend reports no "
                         "compiled memory figures")

    def get(name):
        return int(getattr(m, name, 0) or 0)

    dev = (get("argument_size_in_bytes") + get("output_size_in_bytes")
           + get("temp_size_in_bytes") - get("alias_size_in_bytes"))
    host = (get("host_argument_size_in_bytes") + get("host_output_size_in_bytes")
            + get("host_temp_size_in_bytes") - get("host_alias_size_in_bytes"))
    return {"device": dev, "host": host}


def _real(name: str, v: Any, positive: bool = False) -> float:
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) \
        and (v > 0 if positive else v >= 0)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"got {v!r}")
    return float(v)


def transfer_seconds(residual_bytes: float, bandwidth: float = 25e9,
                     latency: float = 10e-6, arrays: int = 1) -> float:
    """Time to move a chunk's residuals to host and back:
    ``2 * (arrays * latency + residual_bytes / bandwidth)`` seconds.

    ``bandwidth`` is the host <-> device copy rate in bytes/s (PCIe 4 x16 ~25e9, PCIe 5 ~50e9,
    GH200 NVLink-C2C ~400e9), ``latency`` the fixed cost of one copy, ``arrays`` the number
    of residual arrays. When the copies overlap with compute the step pays
    ``max(0, transfer_seconds - compute_seconds)``.
    """
    b = _real("residual_bytes", residual_bytes)
    bw = _real("bandwidth", bandwidth, positive=True)
    lat = _real("latency", latency)
    if not isinstance(arrays, numbers.Integral) or isinstance(arrays, bool) or arrays < 0:
        raise ValueError(f"arrays must be an int >= 0, got {arrays!r}")
    return 2.0 * (int(arrays) * lat + b / bw)
