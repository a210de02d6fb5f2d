"""Multi-device tests run in their own process (the host device count is fixed at jax import).

``test_distributed_multidevice.py`` starts ``pytest parity_tests/distributed/multidevice`` in a subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``JAXMEM_MULTIDEVICE=1``; the
main run (one device) does not collect that folder itself.
"""
import os

collect_ignore = [] if os.environ.get("JAXMEM_MULTIDEVICE") == "1" else ["multidevice"]
