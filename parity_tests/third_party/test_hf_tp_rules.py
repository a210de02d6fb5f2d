"""Tensor parallel layouts of Hugging Face Flax models (the tiny configs of ``_models``):
every dense kernel of every transformer layer is split over ``'model'`` by
:data:`jaxmem.distributed.TP_RULES`, Megatron-style -- a column-parallel kernel (its bias split
too) along its output features, whatever order the model stores its axes in (GPT-2's
``FlaxConv1D`` keeps ``(out, in)``), and a row-parallel kernel along its input features (its
bias whole)."""
from __future__ import annotations

import re
import sys

import jax
import numpy as np
import pytest

_transformers = pytest.importorskip("transformers")
if not hasattr(_transformers, "FlaxPreTrainedModel"):   # transformers 5 dropped Flax
    pytest.skip(f"transformers {_transformers.__version__} has no Flax models",
                allow_module_level=True)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/transform")
from _models import CASES

from jaxmem import distributed as jd

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

#: a transformer layer's path: BERT / RoBERTa / ViT ``layer/0``, GPT-2 ``h/0``, T5
#: ``block/0``, CLIP ``layers/0``
_LAYER = re.compile(r"(^|/)(layer|h|block|layers)/\d+/")


@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2", "vit", "t5", "clip"])
def test_every_layer_kernel_split_megatron_style(name):
    params = CASES[name]().params
    specs = {jd.path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(
        jd.param_shardings(params, jd.mesh(data=1, model=1), "tp"))[0]}
    shapes = {jd.path_str(p): np.shape(a)
              for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    kernels = [p for p, s in shapes.items()
               if p.endswith("/kernel") and len(s) == 2 and _LAYER.search(p)]
    assert kernels
    for path in kernels:
        spec = tuple(specs[path]) + (None,) * 2
        assert "model" in spec[:2], f"{path} {shapes[path]} replicated"
        bias = path[: -len("kernel")] + "bias"
        if bias not in shapes or len(set(shapes[path])) == 1:
            continue
        split = shapes[path][spec.index("model")]
        if tuple(specs[bias]) == ("model",):       # column-parallel: outputs split
            assert split == shapes[bias][0], (path, shapes[path], specs[path])
        else:                                       # row-parallel: inputs split
            assert tuple(specs[bias]) == () and split != shapes[bias][0], \
                (path, shapes[path], specs[path])
