"""collectives() counts what the SPMD partitioner inserts."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem.distributed import collectives, compiled_collectives


def test_counts_data_parallel_mean_has_one_all_reduce():
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data")))
    c = compiled_collectives(lambda a: jnp.sum(a * a), x)
    assert c.counts["all-reduce"] >= 1
    assert c.counts["all-gather"] == 0
    assert c.bytes["all-reduce"] >= 4


def test_counts_nothing_for_local_elementwise():
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data")))
    c = compiled_collectives(lambda a: a * 2 + 1, x)
    assert c.total() == 0


def test_counts_all_gather_bytes_of_result():
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    x = jax.device_put(jnp.ones((16, 4), jnp.float32), NamedSharding(mesh, P("data")))
    out_sh = NamedSharding(mesh, P())
    c = compiled_collectives(jax.jit(lambda a: a + 1, out_shardings=out_sh), x)
    assert c.counts["all-gather"] == 1
    assert c.bytes["all-gather"] == 16 * 4 * 4


def test_parse_rejects_non_text():
    import pytest
    with pytest.raises(TypeError, match="compiled HLO text"):
        collectives(object())
