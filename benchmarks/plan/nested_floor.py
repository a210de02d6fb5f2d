"""What nested (two-level) recomputation keeps on a target's plan: ResNet-50 / ViT at a given
batch, compiled as hand-built nestings of the planner's units (bench_plan.py's cases).

    .venv/bin/python benchmarks/plan/nested_floor.py resnet|vit TARGET SPEC...

SPEC = ``grouping:inner:fence``: grouping ``unit`` (each top unit alone), ``stage`` (ResNet
stages / ViT stem, blocks, head) or ``k<n>`` (runs of n top units, one checkpointed chunk
each); inner ``plain`` (the top units run plainly inside), ``each`` / ``parts`` (each top
unit checkpointed with its children -- every child, or the bottleneck parts -- checkpointed
again inside); fence ``u`` (plain jax.checkpoint) or ``f`` (the planner's lax.cond fence).
Figures of docs/plan.md ("Nested recomputation"): batch 64 (``BATCH`` below), target h100.
"""
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_plan import resnet_case, vit_case
from resnet_floor import _bottleneck_part

from jaxmem.measure import compiled_memory
from jaxmem.planner import trace as T

MIB = 2**20
BATCH = 64
which = sys.argv[1]; target = sys.argv[2]; specs = sys.argv[3:]
case = {"resnet": resnet_case, "vit": vit_case}[which]
name, loss, args = case(False, BATCH)
tr = T.trace(loss, args)
top = T.choose_units(tr)
fine = T.choose_units(tr, max_units=10_000, finer=1)
jx = tr.closed.jaxpr
rec = T.POLICIES["recompute"]
def cm(f):
    t = time.time(); c = compiled_memory(jax.value_and_grad(f), *args, target=target)
    return f"{c.total_bytes/MIB:.2f} MiB (temp {c.temp_bytes/MIB:.2f}) [{time.time()-t:.0f}s]"
def children(u, grouping="each"):
    groups = []
    for s in (s for s in fine if u.start <= s.start and s.stop <= u.stop):
        k = s.label if grouping == "each" else _bottleneck_part(s.label)
        if groups and groups[-1][0] == k:
            g = groups[-1][1]; groups[-1] = (k, T.Unit(g.label, g.start, s.stop, g.depth))
        else:
            groups.append((k, s))
    return [g for _, g in groups]
def span(node):
    if isinstance(node, T.Unit): return node.start, node.stop
    return span(node[1][0])[0], span(node[1][-1])[1]
def build(node, fence):
    # node: Unit (plain) or ("ck", [nodes]) checkpointed chunk
    if isinstance(node, T.Unit):
        ins, outs = T.chunk_io(jx, node.start, node.stop)
        return T.chunk_fn(jx, node.start, node.stop, ins, outs), ins, outs
    a, b = span(node)
    ins, outs = T.chunk_io(jx, a, b)
    subs = [build(n, fence) for n in node[1]]
    def f(*vals):
        env = dict(zip(ins, vals))
        for g, si, so in subs:
            env.update(zip(so, g(*[env[v] for v in si])))
        return [env[v] for v in outs]
    return T._checkpointed(f, rec, fence), ins, outs
def step_of(nodes, fence):
    built = [build(n, fence) for n in nodes]
    def step(*a):
        env = dict(zip(jx.constvars, tr.closed.consts))
        env.update(zip(jx.invars, jax.tree_util.tree_leaves(a)))
        for g, si, so in built:
            env.update(zip(so, g(*[env[v] for v in si])))
        return env[jx.outvars[0]]
    return step
labels = [u.label for u in top]
def unit_node(u, inner):
    if inner == "plain": return ("ck", [u])
    ch = children(u, inner)
    return ("ck", [("ck", [c]) for c in ch]) if len(ch) > 1 else ("ck", [u])
def groups_by(key):
    out = []
    for u in top:
        k = key(u.label)
        if out and out[-1][0] == k: out[-1][1].append(u)
        else: out.append((k, [u]))
    return [g for _, g in out]
def stage(l):
    return l.split("_")[0] if l.startswith("layer") else ("pre" if l in ("conv1","bn1","patch_embed") else "post")
for spec in specs:
    # spec: "<grouping>:<inner>:<fence>" grouping: unit|stage|k<n>; inner: plain|each|parts
    grouping, inner, fence = spec.split(":")
    fence = fence == "f"
    if grouping == "unit":
        nodes = [unit_node(u, inner) for u in top]
    else:
        if grouping == "stage": gs = groups_by(stage)
        else:
            k = int(grouping[1:]); gs = [top[i:i+k] for i in range(0, len(top), k)]
        nodes = [("ck", [unit_node(u, inner) for u in g]) if len(g) > 1 else unit_node(g[0], inner) for g in gs]
    print(spec, cm(step_of(nodes, fence)), flush=True)
