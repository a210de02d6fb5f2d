"""jaxmem.schedule on one device's program: a shard_map step, collectives as nodes.

The mesh is abstract (``AbstractMesh``), so these run in the one-device test process: tracing
needs axis sizes, not devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from jaxmem.schedule import optimize, simulate, trace, validate_plan
from jaxmem.schedule.jaxpr_graph import UnsupportedPrimitiveError

# Auto axes: the default since jax 0.11 is Explicit, where shard_map asks its inputs to carry
# their sharding in their type
MESH = AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _ops(ts):
    return [n.split(":")[2] for n in ts.graph.nodes if n.startswith("op:")]


def _dp_step(w1, w2, x):
    """Per-device data-parallel SGD step of a 2-layer MLP: grads psum'ed over 'data'."""
    def loss(w1, w2):
        return jnp.mean(jnp.tanh(x @ w1) @ w2)

    # local gradients (weights marked as varying over 'data'), then their mean over 'data'
    w1v, w2v = jax.lax.pcast((w1, w2), "data", to="varying")
    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1v, w2v)
    g1, g2 = jax.lax.pmean(g1, "data"), jax.lax.pmean(g2, "data")
    return w1 - 0.1 * g1, w2 - 0.1 * g2


def _sharded(step, in_specs, out_specs):
    return jax.jit(jax.shard_map(step, mesh=MESH, in_specs=in_specs, out_specs=out_specs))


def test_shard_map_step_is_one_devices_graph():
    w1 = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    w2 = jax.ShapeDtypeStruct((32, 8), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 16), jnp.float32)  # 16 rows per 'data' shard
    step = _sharded(_dp_step, (P(), P(), P("data")), (P(), P()))
    ts = trace(step, w1, w2, x)
    ops = _ops(ts)
    assert ops.count("psum") + ops.count("psum_invariant") == 2, ops
    # the batch input is one device's shard: 16 x 16 f32
    in_sizes = [ts.graph.edges[ts.edge_of[i]].size for i in ts.in_ids]
    assert in_sizes == [16 * 32 * 4, 32 * 8 * 4, 16 * 16 * 4]
    # a collective's edge is the per-device buffer it produces (the gradient of w1)
    psums = [n for n in ts.graph.nodes if ":psum" in n]
    out_sizes = sorted(e.size for e in ts.graph.edges.values() if e.src in psums)
    assert out_sizes == [32 * 8 * 4, 16 * 32 * 4]
    plan = optimize(ts.graph, time_limit=5.0)
    validate_plan(ts.graph, plan)
    assert plan.peak <= simulate(ts.graph, ts.program_order)


@pytest.mark.parametrize("collective", ["all_gather", "psum_scatter", "ppermute",
                                        "all_to_all", "axis_index"])
def test_each_collective_is_a_node_with_its_output_size(collective):
    def body(x):  # x: (2, 8) per device
        if collective == "all_gather":
            y = jax.lax.all_gather(x, "data", axis=0, tiled=True)           # (8, 8)
        elif collective == "psum_scatter":
            y = jax.lax.psum_scatter(x, "data", scatter_dimension=1, tiled=True)  # (2, 2)
        elif collective == "ppermute":
            y = jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])  # (2, 8)
        elif collective == "all_to_all":
            y = jax.lax.all_to_all(x, "data", 1, 0, tiled=True)               # (8, 2)
        else:
            y = x * jax.lax.axis_index("data").astype(x.dtype)                # (2, 8)
        return jnp.sum(jnp.sin(y), keepdims=True)[None]

    f = _sharded(body, P("data"), P("data"))
    ts = trace(f, jax.ShapeDtypeStruct((8, 8), jnp.float32))
    want = {"all_gather": ("all_gather", 8 * 8 * 4), "psum_scatter": ("reduce_scatter", 16),
            "ppermute": ("ppermute", 64), "all_to_all": ("all_to_all", 64),
            "axis_index": ("axis_index", 4)}[collective]
    nodes = [n for n in ts.graph.nodes if n.endswith(":" + want[0])]
    assert len(nodes) == 1, _ops(ts)
    sizes = [e.size for e in ts.graph.edges.values() if e.src == nodes[0]]
    assert sizes == [want[1]]


def test_side_effects_inside_shard_map_are_refused():
    def body(x):
        jax.debug.print("x {}", x[0, 0])
        return jax.lax.psum(x, "data")

    f = _sharded(body, P("data"), P())
    with pytest.raises(UnsupportedPrimitiveError, match="debug_callback|side effects"):
        trace(f, jax.ShapeDtypeStruct((8, 8), jnp.float32))
