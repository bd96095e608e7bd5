#!/usr/bin/env python3
"""Fails naming a cycle among the launcher crate's top-level modules (src/*: issue 47's "0 module
cycles"; docs/architecture.md lists their layers). A module depends on another where its non-test
code names `crate::other` (comments aside); test code (a `tests.rs` file, a `#[cfg(test)] mod` and what follows
it) is left out: a test may reach across layers. The crates themselves cannot form a cycle
(cargo refuses one).
    python3 scripts/module-cycles.py   (run by scripts/test.sh)"""
import glob, os, re, sys

os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
deps = {}
for path in glob.glob("src/**/*.rs", recursive=True):
    top = path[len("src/"):].split("/")[0].removesuffix(".rs")
    if top in ("main", "lib") or os.path.basename(path) == "tests.rs":
        continue
    text = open(path).read()
    cut = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    if cut:
        text = text[: cut.start()]
    # A doc comment's link names a module without using it.
    text = re.sub(r"//.*", "", text)
    deps.setdefault(top, set()).update(m for m in re.findall(r"\bcrate::(\w+)", text) if m != top)
graph = {m: sorted(d for d in ds if d in deps) for m, ds in deps.items()}

state, stack, cycles = {}, [], []


def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in graph[m]:
        if state.get(d) == "open":
            cycles.append(stack[stack.index(d):] + [d])
        elif d not in state:
            visit(d)
    stack.pop()
    state[m] = "done"


for m in sorted(graph):
    if m not in state:
        visit(m)
if cycles:
    print("module cycles in src/ (a lower layer must not name a higher one):", file=sys.stderr)
    for c in cycles:
        print("  " + " -> ".join(c), file=sys.stderr)
    sys.exit(1)
print(f"modules: {len(graph)} top-level modules of src/, no cycle")
