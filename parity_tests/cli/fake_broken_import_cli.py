"""A bench section whose own import fails (a real failure, not 'not implemented')."""
import jaxmem.this_module_does_not_exist_either  # noqa: F401


def run(quick=False, models=None, progress=None):  # pragma: no cover
    raise AssertionError
