import jax
import pytest

NDEV = 8


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    if jax.device_count() != NDEV:
        pytest.fail(f"the multidevice tests need {NDEV} host devices, found {jax.device_count()}: "
                    "run them through parity_tests/distributed/test_distributed_multidevice.py")
