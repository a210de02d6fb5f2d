"""jaxmem on JAX's distributed engine: meshes, sharded train steps, collectives accounting.

Example (8 devices, fully sharded data parallel)::

    mesh = jaxmem.distributed.mesh(data=8)
    step = jaxmem.distributed.train_step(loss_fn, optax.adam(1e-3), mesh, mode="fsdp")
    params, opt_state = step.init(params)
    params, opt_state, loss = step(params, opt_state, batch)
    print(jaxmem.distributed.collectives(step.lower(params, opt_state, batch)
                                         .compile().as_text()))
"""
from jaxmem.distributed.hlo import KINDS, Collectives, collectives, compiled_collectives
from jaxmem.distributed.sharding import (
    MODES,
    TP_RULES,
    batch_sharding,
    mesh,
    param_shardings,
    path_str,
    replicated,
    update_shardings,
)
from jaxmem.distributed.steps import TrainStep, train_step

__all__ = ["KINDS", "MODES", "TP_RULES", "Collectives", "TrainStep", "batch_sharding",
           "collectives", "compiled_collectives", "mesh", "param_shardings", "path_str",
           "replicated", "train_step", "update_shardings"]
