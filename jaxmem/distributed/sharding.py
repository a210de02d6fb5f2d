"""Meshes and parameter/batch shardings for data, fully-sharded and tensor parallelism.

Three layouts of a parameter tree over a mesh with axes ``('data', 'model')``:

* ``"dp"`` (data parallel): every parameter replicated; the batch is split over ``'data'``.
  The gradient of the mean loss is the sum of per-device partial gradients ``sum_d g_d``:
  reduce-scattered onto :func:`update_shardings` by a train step (one all-reduce per
  parameter, XLA may combine them, when the update is replicated).
* ``"fsdp"`` (fully sharded data parallel, ZeRO-3): each parameter is split over ``'data'``
  along its largest axis divisible by the ``'data'`` size (replicated when none is); XLA
  all-gathers a parameter where it is used and reduce-scatters its gradient.
* ``"tp"`` (tensor parallel, Megatron-LM): by parameter path (the names of the zoo, GPT-2,
  BERT / RoBERTa / ViT, LLaMA-style, BART / OPT / CLIP, T5, DistilBERT, GPT-J and BLOOM
  layers), the first Dense of a pair is column-parallel (kernel ``P(None, 'model')``, bias
  ``P('model')``), the second row-parallel (kernel ``P('model', None)``), so
  ``y = (x W1) W2`` needs one all-reduce per pair; a kernel stored ``(out, in)`` (Hugging
  Face's ``FlaxConv1D`` in GPT-2: told by its bias, or by its module's other kernels) is
  split on the transposed axis, so the column-parallel layer still splits its outputs; conv
  kernels (any path with ``conv`` in a name, any case: ``Conv_0``, ``conv1``) split their
  output channels; embeddings (``Embed_0``, ``embed``, ``wte``, ...) split the vocabulary.
  Batch over ``'data'``.

Every rule is a ``(regex, PartitionSpec)`` pair matched against the ``/``-joined path of the
parameter (first match wins), as in ``param_shardings(params, mesh, rules=...)``.

Example::

    mesh = jaxmem.distributed.mesh(data=4, model=2)
    shardings = jaxmem.distributed.param_shardings(params, mesh, mode="tp")
    params = jax.device_put(params, shardings)
    batch = jax.device_put(batch, jaxmem.distributed.batch_sharding(mesh))
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["MODES", "TP_RULES", "batch_sharding", "mesh", "param_shardings", "path_str",
           "replicated", "update_shardings"]

MODES = ("dp", "fsdp", "tp")

#: Megatron-style tensor-parallel rules: (regex on the parameter path, spec). Column-parallel
#: projections first (split outputs), then row-parallel ones (split inputs).
#: Names of GPT-2 / GPT-Neo / GPT-J (``c_attn``, ``c_fc``, ``fc_in``), BERT / RoBERTa / ViT
#: (``query``, ``intermediate/dense``, ``output/dense``), DistilBERT (``q_lin``, ``lin1``),
#: LLaMA / Mistral / BART / OPT / CLIP (``q_proj``, ``fc1``, ``gate_proj``), T5 (``wi``,
#: ``wi_0``, ``wo``, ``SelfAttention/q`` .. ``/o``), BLOOM (``query_key_value``,
#: ``dense_h_to_4h``, ``self_attention/dense``).
_T5_ATTENTION = r"(SelfAttention|EncDecAttention)"
_COLUMN = (r"(c_attn|c_fc|query|key|value|q_proj|k_proj|v_proj|qkv|fc1|wi|wi_0|wi_1|up_proj"
           r"|gate_proj|intermediate/dense|q_lin|k_lin|v_lin|lin1|fc_in|query_key_value"
           rf"|dense_h_to_4h|{_T5_ATTENTION}/(q|k|v))")
_ROW = (r"(c_proj|out|o_proj|out_proj|fc2|wo|down_proj|output/dense|out_lin|lin2|fc_out"
        rf"|dense_4h_to_h|self_attention/dense|{_T5_ATTENTION}/o)")
#: Names are matched case-insensitively (``(?i)``), so Flax's auto-names (``Conv_0``,
#: ``ConvTranspose_1``, ``Embed_0``) match like user names (``conv1``, ``embed``). A conv
#: kernel (1-, 2- or 3-D convolution: rank 3, 4 or 5) is split on its last axis, the output
#: channels, by the rule of its own rank only (never on another axis).
_CONV = r"(?i)(^|/)[^/]*conv[^/]*/kernel$"
#: a dense kernel of either kind (the split of one stored ``(out, in)`` is transposed)
_DENSE_KERNEL = re.compile(rf"(?i)(^|/)({_COLUMN}|{_ROW})/kernel$")
TP_RULES: tuple[tuple[str, P], ...] = (
    (rf"(?i)(^|/){_COLUMN}/kernel$", P(None, "model")),
    (rf"(?i)(^|/){_COLUMN}/bias$", P("model")),
    (rf"(?i)(^|/){_ROW}/kernel$", P("model", None)),
    (rf"(?i)(^|/){_ROW}/bias$", P()),
    (r"(?i)(^|/)(wte|embedding|embed|tok_embeddings)(_\d+)?/embedding$", P("model", None)),
    (_CONV, P(None, None, None, None, "model")),
    (_CONV, P(None, None, None, "model")),
    (_CONV, P(None, None, "model")),
)


def mesh(data: int | None = None, model: int = 1, *, devices: Sequence | None = None) -> Mesh:
    """A 2-D ``Mesh`` with axes ``('data', 'model')`` of shape ``(data, model)``.

    ``data=None`` uses every device not taken by ``model``: ``mesh(model=2)`` on 8 devices is
    ``4 x 2``. ``devices`` defaults to ``jax.devices()`` (all processes' devices).
    """
    devs = list(jax.devices() if devices is None else devices)
    if not isinstance(model, (int, np.integer)) or isinstance(model, bool) or model < 1:
        raise ValueError(f"mesh: model must be an int >= 1, got {model!r}")
    if data is None:
        if len(devs) % model:
            raise ValueError(f"mesh: model={model} does not divide the {len(devs)} devices")
        data = len(devs) // model
    if not isinstance(data, (int, np.integer)) or isinstance(data, bool) or data < 1:
        raise ValueError(f"mesh: data must be an int >= 1 or None, got {data!r}")
    if data * model > len(devs):
        raise ValueError(f"mesh: data*model = {data}*{model} = {data * model} exceeds the "
                         f"{len(devs)} available devices")
    return Mesh(np.array(devs[:data * model]).reshape(data, model), ("data", "model"))


def _transposed(spec: P) -> P:
    """A 2-D spec with its two axes swapped."""
    return P(*reversed(tuple(spec) + (None,) * (2 - len(spec))))


def _stored_out_in(params) -> set[str]:
    """Paths of 2-D dense kernels (matched by :data:`TP_RULES`) stored as ``(out, in)``
    instead of Flax's ``(in, out)`` (Hugging Face's ``FlaxConv1D`` in GPT-2): a kernel whose
    sibling ``bias`` has the length of its first axis and not of its second; a kernel this
    cannot tell (square, no bias) when the other kernels of its module are so stored and none
    the other way (GPT-2's square ``attn/c_proj`` beside ``attn/c_attn``). Their tensor
    parallel split is then taken along the other axis, so that a column-parallel layer still
    splits its output features."""
    shapes = {path_str(p): tuple(np.shape(leaf))
              for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    found: dict[str, bool | None] = {}
    for name, shape in shapes.items():
        if len(shape) != 2 or not _DENSE_KERNEL.search(name):
            continue
        bias = shapes.get(name[: -len("kernel")] + "bias")
        a, b = shape
        if bias is not None and len(bias) == 1 and a != b and bias[0] in (a, b):
            found[name] = bias[0] == a
        else:
            found[name] = None
    module = lambda name: name.rsplit("/", 2)[0]   # 'attn' of 'attn/c_attn/kernel'
    by_module: dict[str, set[bool]] = {}
    for name, out_in in found.items():
        if out_in is not None:
            by_module.setdefault(module(name), set()).add(out_in)
    return {name for name, out_in in found.items()
            if out_in or (out_in is None and by_module.get(module(name)) == {True})}


def replicated(mesh: Mesh) -> NamedSharding:
    """``NamedSharding(mesh, P())``: a full copy on every device."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, axis: str = "data") -> NamedSharding:
    """Leading (batch) axis split over ``axis``: ``NamedSharding(mesh, P(axis))``."""
    _check_mesh(mesh, "batch_sharding")
    if axis not in mesh.axis_names:
        raise ValueError(f"batch_sharding: axis {axis!r} is not a mesh axis {mesh.axis_names}")
    return NamedSharding(mesh, P(axis))


def path_str(path) -> str:
    """``'h_0/attn/c_attn/kernel'`` for a ``jax.tree_util`` key path."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _check_mesh(mesh, who):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{who}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")


def _axis_size(mesh: Mesh, axis: str) -> int:
    return int(mesh.shape[axis]) if axis in mesh.axis_names else 1


def _fits(spec: P, shape, mesh: Mesh, exact: bool = False) -> bool:
    """Whether ``spec`` can lay out ``shape`` on ``mesh`` (``exact``: same rank only)."""
    if len(spec) > len(shape) or (exact and len(spec) != len(shape)):
        return False
    for dim, ax in zip(shape, spec):
        if ax is None:
            continue
        names = ax if isinstance(ax, tuple) else (ax,)
        if any(n not in mesh.axis_names for n in names):
            return False
        if dim % int(np.prod([mesh.shape[n] for n in names])):
            return False
    return True


def _fsdp_spec(shape, n: int) -> P:
    """Split the largest axis divisible by ``n`` (ties: the last such axis)."""
    best = None
    for i, d in enumerate(shape):
        if d % n == 0 and d >= n and (best is None or d >= shape[best]):
            best = i
    if best is None or n == 1:
        return P()
    return P(*([None] * best + ["data"]))


def _with_data(spec: P, shape, n: int) -> P:
    """``spec`` with ``'data'`` added on the largest axis it leaves unsplit whose size ``n``
    divides (ties: the last such axis); unchanged when ``'data'`` is already used or no
    axis fits."""
    used = {a for ax in spec for a in (ax if isinstance(ax, tuple) else (ax,)) if a}
    if "data" in used or n == 1:
        return spec
    full = tuple(spec) + (None,) * (len(shape) - len(spec))
    best = None
    for i, d in enumerate(shape):
        if full[i] is None and d % n == 0 and d >= n and (best is None or d >= shape[best]):
            best = i
    if best is None:
        return spec
    return P(*(full[:best] + ("data",) + full[best + 1:]))


def update_shardings(params, mesh: Mesh, mode: str = "fsdp", *,
                     rules: Sequence[tuple[str, P]] | None = None):
    """Where the optimizer update runs: each parameter's layout (:func:`param_shardings`)
    with ``'data'`` added on its largest unsplit axis that the ``'data'`` size divides.

    A data-parallel step reduce-scatters the gradient ``g = sum_d g_d`` onto this layout
    (device ``d`` keeps ``g[shard_d]``, never the whole of ``g``), updates its shard with
    the optimizer state of the same layout, and all-gathers the new parameters back to
    their own layout (``"dp"``, ``"tp"``) or keeps them sharded (``"fsdp"``, where it is
    the parameters' layout already). A parameter no axis of which fits stays as it is.
    """
    psh = param_shardings(params, mesh, mode, rules=rules)
    n = _axis_size(mesh, "data")
    return jax.tree.map(
        lambda leaf, s: NamedSharding(mesh, _with_data(s.spec, np.shape(leaf), n)), params, psh)


def param_shardings(params, mesh: Mesh, mode: str = "fsdp", *,
                    rules: Sequence[tuple[str, P]] | None = None):
    """A pytree of ``NamedSharding`` (same structure as ``params``) for ``mode``.

    Args:
      params: a parameter pytree (Flax ``params`` collection or any pytree of arrays or
        ``jax.ShapeDtypeStruct``).
      mesh: a mesh with a ``'data'`` axis (and ``'model'`` for ``"tp"``), e.g. :func:`mesh`.
      mode: ``"dp"`` (replicate), ``"fsdp"`` (split the largest axis divisible by the
        ``'data'`` size over ``'data'``) or ``"tp"`` (Megatron rules :data:`TP_RULES`,
        names matched case-insensitively).
      rules: ``(regex, PartitionSpec)`` pairs tried first on the ``/``-joined path; a spec
        whose axes do not divide the parameter's shape is skipped (the parameter falls to the
        mode's default, replication for ``"tp"``).

    Example::

        shardings = param_shardings(params, mesh, mode="fsdp")
        params = jax.device_put(params, shardings)
    """
    _check_mesh(mesh, "param_shardings")
    if mode not in MODES:
        raise ValueError(f"param_shardings: mode must be one of {MODES}, got {mode!r}")
    if mode == "tp" and "model" not in mesh.axis_names:
        raise ValueError(f"param_shardings: mode='tp' needs a 'model' mesh axis, mesh has "
                         f"{mesh.axis_names}")
    if mode in ("dp", "fsdp") and "data" not in mesh.axis_names:
        raise ValueError(f"param_shardings: mode={mode!r} needs a 'data' mesh axis, mesh has "
                         f"{mesh.axis_names}")
    user = [(re.compile(r), s, False) for r, s in (rules or ())]
    tp = [(re.compile(r), s, r == _CONV) for r, s in TP_RULES] if mode == "tp" else []
    # for kernels stored ``(out, in)``: the same rules, their splits transposed
    tp_out_in = [(rx, _transposed(s), exact) for rx, s, exact in tp]
    n_data = _axis_size(mesh, "data")
    out_in = _stored_out_in(params) if mode == "tp" else set()

    def one(path, leaf):
        shape = tuple(np.shape(leaf))
        name = path_str(path)
        for rx, spec, exact in user + (tp_out_in if name in out_in else tp):
            if rx.search(name) and _fits(spec, shape, mesh, exact):
                return NamedSharding(mesh, spec)
        if mode == "fsdp":
            return NamedSharding(mesh, _fsdp_spec(shape, n_data))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, params)
