"""jaxmem._prims.tree: the one walker over rowconv's layer/geometry/plan trees."""
from __future__ import annotations

from types import SimpleNamespace as N

from jaxmem import rowconv
from jaxmem._prims.tree import walk


def _node(name, branch=None, shortcut=None):
    return N(name=name, branch=branch, shortcut=shortcut)


def test_pre_order_with_branch_then_shortcut():
    tree = [_node("a"),
            _node("b", branch=[_node("c"), _node("d", branch=[_node("e")], shortcut=[])],
                  shortcut=[_node("f")]),
            _node("g", branch=[_node("h")], shortcut=None),
            _node("i", branch=None, shortcut=[_node("never")])]  # no branch: no shortcut
    assert [n.name for n in walk(tree)] == list("abcdefghi")
    assert list(walk([])) == []


def test_walks_rowconv_residual_blocks():
    """rowconv.Residual holds ``branch`` / ``shortcut`` lists: its trees walk the same way."""
    inner = rowconv.Residual([rowconv.Conv(4, 3)])  # identity shortcut (None)
    layers = [rowconv.Conv(4, 3),
              rowconv.Residual([rowconv.Conv(4, 3), inner], [rowconv.Conv(4, 1)]),
              rowconv.Conv(4, 3)]
    got = list(walk(layers))
    assert got == [layers[0], layers[1], layers[1].branch[0], inner, inner.branch[0],
                   layers[1].shortcut[0], layers[2]]
