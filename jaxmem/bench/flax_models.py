"""Small Flax models written the way Flax users write them, with their full train steps.

These are *not* jaxmem's zoo: they use the idioms of widely copied Flax code, so that the one
way in (``jaxmem.linen.convert`` / ``jaxmem.nnx.convert``) is judged on code it has never
seen:

* ``linen_resnet`` — ImageNet-style ResNet: activation held in a field (``act = nn.relu``),
  a ``functools.partial(nn.BatchNorm, use_running_average=not train, ...)`` norm factory
  (optional ``axis_name``), ``nn.max_pool`` stem, explicit ``padding=[(3, 3), (3, 3)]``, and
  the model is *constructed inside the loss function*.
* ``linen_lm`` / ``linen_lm_scan`` — causal transformer LM: ``nn.Embed`` (tied output via
  ``attend``), ``nn.MultiHeadDotProductAttention`` with ``nn.make_causal_mask`` and attention
  dropout, ``nn.Dropout(rate)(x, deterministic=not train)``, ``nn.LayerNorm``, ``nn.gelu``
  MLP, ``deterministic`` keyword at call time; ``linen_lm_scan`` stacks its blocks with
  ``nn.scan(nn.remat(Block), variable_axes={'params': 0}, split_rngs=..., length=L)``.
* ``nnx_cnn`` — MNIST-style ``nnx.Conv``/``nnx.BatchNorm``/``nnx.Dropout``/``nnx.Linear`` with
  ``functools.partial(nnx.max_pool, ...)`` held as an attribute, trained with
  ``nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)`` under ``nnx.jit``.
* ``nnx_vit`` — ViT: ``nnx.Conv`` patch embedding, ``nnx.MultiHeadAttention``,
  ``nnx.LayerNorm``, ``nnx.gelu`` MLP, ``nnx.Dropout``.
* ``nnx_scan`` — residual MLP stack whose layers are created with ``nnx.vmap`` over split
  rng keys and applied with ``nnx.scan``.

``STEPS[name](convert=None, depth=None, seed=0, batch_size=None)`` builds a :class:`Case`:
the model (passed through ``convert`` when given: a function ``module -> module``, e.g.
``jaxmem.linen.convert``), its initial train state, a batch, the jitted FULL train step
(gradient and optax update) and the eval step. Building with the same ``seed`` gives the same
parameters, batch and dropout keys whatever ``convert`` is, so a converted case can be
compared leaf by leaf with the untouched one.

Uniform handles for measuring (:attr:`Case.pure_step` / :attr:`Case.pure_args`): a pure
function of arrays (the NNX step is split/merged around ``nnx.merge``) to give to
``jax.jit`` / ``jaxmem.measure.compiled_memory``; :meth:`Case.loss_of_params` is the training
loss as a function of the parameters alone (for gradients and residual bytes).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = [
    "STEPS",
    "Case",
    "LinenLM",
    "NnxCNN",
    "NnxScanStack",
    "NnxViT",
    "ResNet",
    "ResNetBlock",
]

ModuleDef = Any


# ----------------------------------------------------------------------------------------
# Linen ResNet
# ----------------------------------------------------------------------------------------


class ResNetBlock(nn.Module):
    """Basic residual block: conv-norm-act-conv-norm (+ projected shortcut), act."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm()(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    """ImageNet-style ResNet: 7x7/2 conv stem, BN, ReLU, 3x3/2 max-pool, stages, mean, Dense."""

    stage_sizes: Sequence[int]
    num_classes: int = 10
    num_filters: int = 8
    act: Callable = nn.relu
    dtype: Any = jnp.float32
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5, dtype=self.dtype, axis_name=self.axis_name)
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)],
                 name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2**i, strides=strides, conv=conv,
                                norm=norm, act=self.act)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)


# ----------------------------------------------------------------------------------------
# Linen transformer LM
# ----------------------------------------------------------------------------------------


class MlpBlock(nn.Module):
    """Dense -> gelu -> Dense -> Dropout."""

    hidden: int
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        d = x.shape[-1]
        h = nn.Dense(self.hidden)(x)
        h = nn.gelu(h)
        h = nn.Dense(d)(h)
        return nn.Dropout(rate=self.dropout_rate)(h, deterministic=deterministic)


class Block(nn.Module):
    """Pre-LN causal self-attention block."""

    num_heads: int
    mlp_ratio: int = 4
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads,
                                            dropout_rate=self.dropout_rate)(
            h, h, mask=mask, deterministic=deterministic)
        h = nn.Dropout(rate=self.dropout_rate)(h, deterministic=deterministic)
        x = x + h
        h = nn.LayerNorm()(x)
        h = MlpBlock(self.mlp_ratio * x.shape[-1], self.dropout_rate)(
            h, deterministic=deterministic)
        return x + h


class ScanBlock(nn.Module):
    """``Block`` in ``nn.scan``'s ``(carry, x) -> (carry, y)`` form."""

    num_heads: int
    mlp_ratio: int = 4
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, x, deterministic: bool):
        y = Block(self.num_heads, self.mlp_ratio, self.dropout_rate, name="block")(
            x, deterministic=deterministic)
        return y, None


class LinenLM(nn.Module):
    """Decoder-only LM; ``scan=True`` stacks the blocks with ``nn.scan(nn.remat(...))``;
    ``remat=True`` (unrolled) puts each block under ``nn.remat`` with the same default policy,
    naming each block ``block_i/block``: the scanned model's like-for-like unrolled twin."""

    vocab_size: int = 64
    num_layers: int = 2
    d_model: int = 32
    num_heads: int = 4
    max_len: int = 16
    dropout_rate: float = 0.1
    scan: bool = False
    remat: bool = False

    @nn.compact
    def __call__(self, tokens, *, deterministic: bool = True):
        embed = nn.Embed(self.vocab_size, self.d_model)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                         (1, self.max_len, self.d_model))
        x = embed(tokens) + pos[:, : tokens.shape[1]]
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
        if self.scan:
            stack = nn.scan(nn.remat(ScanBlock, static_argnums=(2,)),
                            variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True},
                            in_axes=nn.broadcast, length=self.num_layers)
            x, _ = stack(self.num_heads, dropout_rate=self.dropout_rate, name="blocks")(
                x, deterministic)
        elif self.remat:
            block = nn.remat(ScanBlock, static_argnums=(2,))
            for i in range(self.num_layers):
                x, _ = block(self.num_heads, dropout_rate=self.dropout_rate,
                             name=f"block_{i}")(x, deterministic)
        else:
            for i in range(self.num_layers):
                x = Block(self.num_heads, dropout_rate=self.dropout_rate, name=f"block_{i}")(
                    x, deterministic=deterministic)
        x = nn.LayerNorm(name="ln_f")(x)
        return embed.attend(x)


# ----------------------------------------------------------------------------------------
# NNX models
# ----------------------------------------------------------------------------------------


class NnxCNN(nnx.Module):
    """MNIST-style CNN: (conv-BN-relu-pool) x2, dropout, Linear-relu-Linear."""

    def __init__(self, *, channels: int = 8, num_classes: int = 10, image: int = 16,
                 dropout_rate: float = 0.1, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, channels, kernel_size=(3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(channels, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(channels, 2 * channels, kernel_size=(3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(2 * channels, momentum=0.9, rngs=rngs)
        self.pool = functools.partial(nnx.max_pool, window_shape=(2, 2), strides=(2, 2))
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        feats = 2 * channels * (image // 4) ** 2
        self.linear1 = nnx.Linear(feats, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, num_classes, rngs=rngs)

    def __call__(self, x):
        x = self.pool(nnx.relu(self.bn1(self.conv1(x))))
        x = self.pool(nnx.relu(self.bn2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(x)
        x = nnx.relu(self.linear1(x))
        return self.linear2(x)


class NnxMlp(nnx.Module):
    def __init__(self, dim: int, hidden: int, dropout_rate: float, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.fc2(nnx.gelu(self.fc1(x))))


class NnxEncoderBlock(nnx.Module):
    def __init__(self, dim: int, num_heads: int, dropout_rate: float, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=num_heads, in_features=dim,
                                           dropout_rate=dropout_rate, decode=False, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp = NnxMlp(dim, 4 * dim, dropout_rate, rngs=rngs)

    def __call__(self, x):
        x = x + self.dropout(self.attn(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


class NnxViT(nnx.Module):
    """ViT: conv patch embedding + class token + position embedding, encoder, head."""

    def __init__(self, *, image: int = 16, patch: int = 4, channels: int = 3, dim: int = 32,
                 depth: int = 2, num_heads: int = 4, num_classes: int = 10,
                 dropout_rate: float = 0.1, rngs: nnx.Rngs):
        n = (image // patch) ** 2
        self.patch_embed = nnx.Conv(channels, dim, kernel_size=(patch, patch),
                                    strides=(patch, patch), padding="VALID", rngs=rngs)
        self.cls_token = nnx.Param(jnp.zeros((1, 1, dim)))
        self.pos_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, n + 1, dim)))
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        self.blocks = nnx.List([NnxEncoderBlock(dim, num_heads, dropout_rate, rngs=rngs)
                                for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, num_classes, rngs=rngs)

    def __call__(self, x):
        x = self.patch_embed(x)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        cls = jnp.broadcast_to(self.cls_token[...], (b, 1, c))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...]
        x = self.dropout(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


class NnxResLayer(nnx.Module):
    def __init__(self, dim: int, dropout_rate: float, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x):
        return x + self.dropout(nnx.gelu(self.linear(self.norm(x))))


class NnxScanStack(nnx.Module):
    """Linear -> L residual (LN, Linear, gelu, Dropout) layers under ``nnx.scan`` -> Linear.

    The L layers are created with ``nnx.vmap`` over L split rng keys (stacked parameters).
    """

    def __init__(self, *, din: int = 16, dim: int = 32, num_layers: int = 4,
                 num_classes: int = 10, dropout_rate: float = 0.1, rngs: nnx.Rngs):
        self.num_layers = num_layers
        self.embed = nnx.Linear(din, dim, rngs=rngs)
        keys = jax.random.split(rngs.params(), num_layers)
        dkeys = jax.random.split(rngs.dropout(), num_layers)

        @nnx.vmap(in_axes=(0, 0), out_axes=0)
        def create(key, dkey):
            return NnxResLayer(dim, dropout_rate, rngs=nnx.Rngs(params=key, dropout=dkey))

        self.layers = create(keys, dkeys)
        self.head = nnx.Linear(dim, num_classes, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(h, layer):
            return layer(h)

        return self.head(forward(self.embed(x), self.layers))


# ----------------------------------------------------------------------------------------
# Cases: model + state + batch + jitted full train step + eval step
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One model with its batch and steps (see the module docstring).

    Linen: ``state = {'params', 'opt_state', ['batch_stats']}``;
    ``train_step(state, batch, rng) -> (state, loss)``; ``eval_step(state, batch) ->
    (loss, logits)``; ``loss_fn(params, state, batch, rng, train) -> (loss, (logits,
    new_batch_stats or None))``.

    NNX: ``model`` and ``optimizer`` are live objects; ``train_step(model, optimizer, batch)
    -> loss`` (``nnx.jit``, updates them in place); ``eval_step(model, batch) -> (loss,
    logits)``; ``loss_fn(model, batch) -> (loss, logits)`` in the model's current mode.
    """

    name: str
    api: str
    model: Any
    state: Any
    batch: tuple
    train_step: Callable
    eval_step: Callable
    loss_fn: Callable
    tx: Any
    rng: Any = None
    optimizer: Any = None
    depth: int | None = None
    graphdef: Any = None
    step_fn: Callable | None = None

    # ---- uniform handles -------------------------------------------------------------
    @property
    def pure_step(self) -> Callable:
        """A pure function of arrays running one full train step (gradient + update); not
        jitted, so that every call traces (``jax.jit`` it, or give it to ``jaxmem.report`` /
        ``jaxmem.measure.compiled_memory``)."""
        if self.api == "linen":
            return self.step_fn
        graphdef, step = self.graphdef, _nnx_step_body

        def pure(state, *batch):
            model, optimizer = nnx.merge(graphdef, state)
            model.train()
            loss = step(model, optimizer, batch, self.loss_fn)
            return nnx.state((model, optimizer)), loss

        return pure

    @property
    def pure_args(self) -> tuple:
        if self.api == "linen":
            return (self.state, self.batch, self.rng)
        return (nnx.split((self.model, self.optimizer))[1], *self.batch)

    def params(self):
        """The trainable parameters (a pytree of arrays)."""
        if self.api == "linen":
            return self.state["params"]
        return nnx.state(self.model, nnx.Param)

    def loss_of_params(self, train: bool = True) -> tuple[Callable, Any]:
        """``(f, params)`` with ``f(params) -> (loss, logits)``, the loss in train/eval mode."""
        if self.api == "linen":
            state, batch, rng = self.state, self.batch, self.rng

            def f(params):
                loss, (logits, _) = self.loss_fn(params, state, batch, rng, train)
                return loss, logits

            return f, state["params"]
        graphdef, params, rest = nnx.split(self.model, nnx.Param, ...)
        batch = self.batch

        def g(params):
            # fresh Variables for the non-trainable state (BatchStat, RNG counts): the
            # model mutates them at this trace level
            model = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))
            model.train() if train else model.eval()
            return self.loss_fn(model, batch)

        return g, params


def _ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _linen_case(name, *, make_model, variables, batch, tx, rng, apply_batch, depth):
    """Build a Linen :class:`Case`.

    ``make_model()`` is called inside the loss (the model is built where it is used);
    ``apply_batch(model, variables, batch, rng, train, mutable)`` returns logits (and the
    mutated collections when ``mutable``); the loss is the mean cross entropy.
    """
    params = variables["params"]
    extra = {k: v for k, v in variables.items() if k != "params"}

    def loss_fn(params, state, batch, rng, train):
        model = make_model()
        v = {"params": params, **{k: state[k] for k in extra}}
        if train and extra:
            logits, updates = apply_batch(model, v, batch, rng, True, list(extra))
        else:
            logits = apply_batch(model, v, batch, rng, train, False)
            updates = None
        return _ce(logits, batch[-1]), (logits, updates)

    def train_step(state, batch, rng):
        (loss, (_, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state, batch, rng, True)
        upd, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = dict(state, params=optax.apply_updates(state["params"], upd),
                   opt_state=opt_state)
        if updates is not None:
            new.update(updates)
        return new, loss

    @jax.jit
    def eval_step(state, batch):
        loss, (logits, _) = loss_fn(state["params"], state, batch, None, False)
        return loss, logits

    state = {"params": params, "opt_state": jax.jit(tx.init)(params), **extra}
    return Case(name=name, api="linen", model=make_model(), state=state, batch=batch,
                train_step=jax.jit(train_step), step_fn=train_step, eval_step=eval_step,
                loss_fn=loss_fn, tx=tx, rng=rng, depth=depth)


def _nnx_step_body(model, optimizer, batch, loss_fn):
    (loss, _), grads = nnx.value_and_grad(lambda m: loss_fn(m, batch), has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


def _nnx_case(name, *, model, batch, tx, depth):
    def loss_fn(model, batch):
        logits = model(batch[0])
        return _ce(logits, batch[-1]), logits

    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        model.train()
        return _nnx_step_body(model, optimizer, batch, loss_fn)

    @nnx.jit
    def eval_step(model, batch):
        model.eval()
        return loss_fn(model, batch)

    graphdef, _ = nnx.split((model, optimizer))
    return Case(name=name, api="nnx", model=model, state=None, batch=batch,
                train_step=train_step, eval_step=eval_step, loss_fn=loss_fn, tx=tx,
                optimizer=optimizer, depth=depth, graphdef=graphdef)


def _identity(m):
    return m


@functools.partial(jax.jit, static_argnums=(0, 3))
def _linen_init(module, key, x, kwargs):
    """``module.init(key, x, **dict(kwargs))`` as one compiled program (an eager init compiles
    each initialiser op on its own); equal modules (Linen modules compare by their fields)
    share one trace and compile."""
    return module.init(key, x, **dict(kwargs))


def linen_resnet(*, convert=None, depth=None, seed=0, batch_size=None, width=8,
                 image=32, axis_name=None) -> Case:
    """``depth`` = residual blocks per stage (two stages); default 1."""
    convert = convert or _identity
    depth = 1 if depth is None else depth
    b = batch_size or 4
    kx, ky, ki, kd = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (b, image, image, 3))
    y = jax.random.randint(ky, (b,), 0, 10)

    def make_model():
        return convert(ResNet(stage_sizes=(depth, depth), num_classes=10, num_filters=width,
                              axis_name=axis_name))

    variables = _linen_init(ResNet(stage_sizes=(depth, depth), num_filters=width), ki, x,
                            (("train", False),))

    def apply_batch(model, v, batch, rng, train, mutable):
        return model.apply(v, batch[0], train=train, mutable=mutable)

    return _linen_case("linen_resnet", make_model=make_model, variables=variables,
                       batch=(x, y), tx=optax.sgd(0.1, momentum=0.9), rng=kd,
                       apply_batch=apply_batch, depth=depth)


def _linen_lm(scan, *, remat=False, convert=None, depth=None, seed=0, batch_size=None, d_model=32,
              seq=16, vocab=64) -> Case:
    convert = convert or _identity
    depth = 2 if depth is None else depth
    b = batch_size or 4
    kx, ki, kd = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(kx, (b, seq + 1), 0, vocab)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ref = LinenLM(vocab_size=vocab, num_layers=depth, d_model=d_model, max_len=seq, scan=scan,
                 remat=remat)
    variables = _linen_init(ref, ki, inputs, (("deterministic", True),))
    model = convert(ref)

    def apply_batch(model_, v, batch, rng, train, mutable):
        return model_.apply(v, batch[0], deterministic=not train,
                            rngs={"dropout": rng} if train else None)

    name = "linen_lm_scan" if scan else "linen_lm_remat" if remat else "linen_lm"
    return _linen_case(name, make_model=lambda: model,
                       variables=variables, batch=(inputs, targets),
                       tx=optax.adamw(1e-3, weight_decay=1e-4), rng=kd,
                       apply_batch=apply_batch, depth=depth)


def linen_lm(**kw) -> Case:
    """Unrolled causal LM; ``depth`` = number of blocks (default 2)."""
    return _linen_lm(False, **kw)


def linen_lm_remat(**kw) -> Case:
    """Unrolled causal LM with ``nn.remat`` on every block (the twin of ``linen_lm_scan``; not
    in :data:`STEPS`)."""
    return _linen_lm(False, remat=True, **kw)


def linen_lm_scan(**kw) -> Case:
    """Causal LM with ``nn.scan(nn.remat(Block))``; ``depth`` = scan length (default 2)."""
    return _linen_lm(True, **kw)


def nnx_cnn(*, convert=None, depth=None, seed=0, batch_size=None, image=16, channels=8) -> Case:
    """MNIST-style CNN (no depth knob)."""
    convert = convert or _identity
    b = batch_size or 8
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (b, image, image, 1))
    y = jax.random.randint(ky, (b,), 0, 10)
    model = convert(NnxCNN(channels=channels, image=image,
                           rngs=nnx.Rngs(params=seed + 1, dropout=seed + 2)))
    return _nnx_case("nnx_cnn", model=model, batch=(x, y),
                     tx=optax.adamw(1e-3, weight_decay=1e-4), depth=None)


def nnx_vit(*, convert=None, depth=None, seed=0, batch_size=None, image=16, dim=32) -> Case:
    """ViT; ``depth`` = encoder blocks (default 2)."""
    convert = convert or _identity
    depth = 2 if depth is None else depth
    b = batch_size or 4
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (b, image, image, 3))
    y = jax.random.randint(ky, (b,), 0, 10)
    model = convert(NnxViT(image=image, dim=dim, depth=depth,
                           rngs=nnx.Rngs(params=seed + 1, dropout=seed + 2)))
    return _nnx_case("nnx_vit", model=model, batch=(x, y),
                     tx=optax.adamw(1e-3, weight_decay=1e-4), depth=depth)


def nnx_scan(*, convert=None, depth=None, seed=0, batch_size=None, dim=32) -> Case:
    """Scanned residual MLP stack; ``depth`` = scan length (default 4)."""
    convert = convert or _identity
    depth = 4 if depth is None else depth
    b = batch_size or 8
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (b, 16))
    y = jax.random.randint(ky, (b,), 0, 10)
    model = convert(NnxScanStack(din=16, dim=dim, num_layers=depth,
                                 rngs=nnx.Rngs(params=seed + 1, dropout=seed + 2)))
    return _nnx_case("nnx_scan", model=model, batch=(x, y),
                     tx=optax.adamw(1e-3, weight_decay=1e-4), depth=depth)


STEPS: dict[str, Callable[..., Case]] = {
    "linen_resnet": linen_resnet,
    "linen_lm": linen_lm,
    "linen_lm_scan": linen_lm_scan,
    "nnx_cnn": nnx_cnn,
    "nnx_vit": nnx_vit,
    "nnx_scan": nnx_scan,
}
