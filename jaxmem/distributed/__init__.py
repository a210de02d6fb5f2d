"""jaxmem on JAX's distributed engine: meshes, sharded train steps, collectives accounting."""
from jaxmem.distributed.hlo import KINDS, Collectives, collectives, compiled_collectives

__all__ = ["KINDS", "Collectives", "collectives", "compiled_collectives"]
