"""A bench section that raises (CLI tests)."""


def run(quick=False, models=None, progress=None):
    raise RuntimeError("section exploded on purpose")
