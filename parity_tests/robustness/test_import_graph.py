"""jaxmem's modules import each other without cycles (module-level imports)."""
from __future__ import annotations

import ast
import os

import jaxmem

ROOT = os.path.dirname(os.path.abspath(jaxmem.__file__))


def _modules() -> dict:
    mods = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: str, mods: dict) -> set:
    """Modules of jaxmem that ``name`` imports at module level (``from pkg import sub``
    counts as ``pkg.sub`` only: the parent package is imported first in any case)."""
    out = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            out.update(subs)
            if len(subs) < len(node.names) and base in mods:
                out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict) -> list:
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_level_import_cycle():
    mods = _modules()
    assert "jaxmem.transform.interpret" in mods and "jaxmem._glue.report" in mods
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert "jaxmem.transform.report" in graph["jaxmem._glue.report"]
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
