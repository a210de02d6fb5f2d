"""jaxmem._prims.checks: argument checks shared by the parts (and jax-free)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jaxmem._prims.checks import as_int, check_bits, int_tuple, positive_int


def test_check_bits_accepts_ints_of_the_allowed_set():
    assert check_bits(3) == 3 and type(check_bits(np.int64(2))) is int
    assert check_bits(8, (1, 2, 4, 8)) == 8


@pytest.mark.parametrize("bad", [0, 5, -1, 1.5, 2.0, True, np.bool_(True), "2", None])
def test_check_bits_refusals_name_argument_value_and_range(bad):
    with pytest.raises(ValueError, match=r"^bits must be an integer in 1\.\.4, got "):
        check_bits(bad)
    with pytest.raises(ValueError, match=r"^nbits must be one of \(1, 2, 4, 8\), got "):
        check_bits(bad if bad != 2.0 else 3, (1, 2, 4, 8), "nbits")


def test_as_int():
    assert as_int(3) == 3 and as_int(np.int32(-2)) == -2
    for v in (True, np.bool_(False), 1.0, "1", None, [1]):
        assert as_int(v) is None


def test_int_tuple_and_positive_int():
    assert int_tuple("f", "strides", 2, 3) == (2, 2, 2)
    assert int_tuple("f", "strides", (1, np.int64(2)), 2) == (1, 2)
    assert int_tuple("f", "pad", 0, 2, minimum=0) == (0, 0)
    for bad in [0, (1,), (1, 0), (1, 2.0), "ab", None, (True, 1)]:
        with pytest.raises(ValueError, match=r"^f: strides must be a positive int or a sequence "
                                             r"of 2 such ints, got "):
            int_tuple("f", "strides", bad, 2)
    with pytest.raises(ValueError, match="an int >= 0"):
        int_tuple("f", "pad", -1, 2, minimum=0)
    assert positive_int("f", "n", np.int8(4)) == 4
    with pytest.raises(ValueError, match="f: n must be a positive int, got 0"):
        positive_int("f", "n", 0)


def test_imports_no_jax():
    """torch_ref loads jaxmem.fewbit.tables' checks: the module must not pull in jax."""
    code = ("import sys; import jaxmem._prims.checks; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)
