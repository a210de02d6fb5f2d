"""The model, batch and loss shared by the multi-process workers and the reference run."""
import jax
import numpy as np
import optax

import jaxmem.linen
from jaxmem.models import gpt

BATCH = 16


def case():
    """A tiny GPT converted with jaxmem (selective + 3-bit few-bit GELU), a fixed batch of
    ``BATCH`` sequences, its mean next-token loss and SGD with momentum (its trace state is
    sharded like the parameters; after one step from zero it is the gradient)."""
    base = gpt(vocab=64, ctx=8, d_model=32, n_head=4, n_layer=1)
    model = jaxmem.linen.convert(base, fewbit=3)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 64, (BATCH, 8)).astype(np.int32)
    tgt = np.roll(tok, -1, axis=1)
    # one compiled init rather than op by op (the same values)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tok[:1])["params"]

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return params, (tok, tgt), loss_fn, optax.sgd(0.1, momentum=0.9)
