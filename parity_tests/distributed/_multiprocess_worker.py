"""One process of the 2-process ``jax.distributed`` test (see ``test_distributed_multiprocess.py``).

argv: coordinator port, process id, number of processes, output .npz path. Exit code 77 means
the platform lacks CPU collectives / jax.distributed (the reason is printed on stderr).
"""
import sys

port, pid, nproc, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

import jax

try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=120)
except Exception as e:  # noqa: BLE001 - any failure here means no gloo/distributed runtime
    print(f"SKIP: jax.distributed with gloo CPU collectives unavailable: "
          f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(77)

import numpy as np
from jax.experimental import multihost_utils

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _multiprocess_case import BATCH, case

from jaxmem import distributed as jd

params, (tok, tgt), loss_fn, optimizer = case()
mesh = jd.mesh()  # every device of every process on 'data'
step = jd.train_step(loss_fn, optimizer, mesh, mode="fsdp")
rows = BATCH // nproc
local = (tok[pid * rows:(pid + 1) * rows], tgt[pid * rows:(pid + 1) * rows])
batch = jax.tree.map(lambda a: jax.make_array_from_process_local_data(step.batch_sharding, a),
                     local)
p, s = step.init(jax.tree.map(np.asarray, params))
p, s, loss = step(p, s, batch)
# after one step from a zero trace, SGD's momentum trace is the gradient itself
grads = multihost_utils.process_allgather(s[0].trace, tiled=True)
p = multihost_utils.process_allgather(p, tiled=True)
flat = {f"grad/{jd.path_str(k)}": np.asarray(v)
        for k, v in jax.tree_util.tree_leaves_with_path(grads)}
flat.update({f"param/{jd.path_str(k)}": np.asarray(v)
             for k, v in jax.tree_util.tree_leaves_with_path(p)})
flat["loss"] = np.asarray(loss.addressable_data(0))  # replicated
flat["devices"] = np.asarray([jax.device_count(), jax.local_device_count(), jax.process_count()])
if pid == 0:
    np.savez(out, **flat)
jax.distributed.shutdown()
