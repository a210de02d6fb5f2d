"""Entry points document Args / Returns and carry a runnable example (run here as doctests)."""
from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

#: (module, attribute) of every public entry point a user starts from.
ENTRY_POINTS = [
    ("jaxmem.linen", "convert"),
    ("jaxmem.nnx", "convert"),
    ("jaxmem.transform.api", "transform"),
    ("jaxmem._glue.report", "report"),
    ("jaxmem.selective.subset", "grad"),
    ("jaxmem.selective.subset", "train_step"),
    ("jaxmem.planner.api", "plan"),
    ("jaxmem.planner.batch", "max_batch"),
    ("jaxmem.planner.api", "conversion_time"),
    ("jaxmem.rowconv", "apply"),
    ("jaxmem.rowconv", "spatial_apply"),
    ("jaxmem.selective", "attention"),
    ("jaxmem.fewbit", "make_activation"),
    ("jaxmem.schedule", "trace"),
    ("jaxmem.schedule", "optimize"),
    ("jaxmem.schedule", "execute"),
    ("jaxmem.distributed", "train_step"),
    ("jaxmem.losses", "chunked_softmax_cross_entropy"),
]


def _obj(mod, name):
    return inspect.unwrap(getattr(importlib.import_module(mod), name))


@pytest.mark.parametrize("mod,name", ENTRY_POINTS, ids=[f"{m}.{n}" for m, n in ENTRY_POINTS])
def test_entry_point_documents_args_returns_and_example(mod, name):
    doc = inspect.getdoc(_obj(mod, name)) or ""
    for section in ("Args:", "Returns:", "Example:"):
        assert section in doc, f"{mod}.{name}: docstring has no {section!r} section"
    assert ">>> " in doc, f"{mod}.{name}: the example has no runnable >>> lines"


@pytest.mark.parametrize("mod,name", ENTRY_POINTS, ids=[f"{m}.{n}" for m, n in ENTRY_POINTS])
def test_entry_point_example_runs(mod, name):
    obj = _obj(mod, name)
    finder = doctest.DocTestFinder(recurse=False)
    tests = [t for t in finder.find(obj, name, globs={}) if t.examples]
    assert tests, f"{mod}.{name}: no doctest examples found"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{mod}.{name}: {result.failed} doctest example(s) failed"
