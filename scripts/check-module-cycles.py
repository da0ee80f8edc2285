#!/usr/bin/env python3
"""Import circles between the top-level modules of each crate.

A crate's top-level modules are the files and folders under src/ (`src/plan.rs`,
`src/graph/`). Module A uses B when A's source, outside its `#[cfg(test)]` modules, names
`crate::B` (in a `use` or a path). The script prints every strongly connected set of two or
more modules and fails when a crate has one that is not listed in scripts/module-cycles.allow
(one line per circle: `crate: a b c`, the modules of a circle that is known and being taken
apart). A circle that shrinks or disappears passes (and the script says so, so the allow list
can be tightened); a new or larger one fails.

usage: scripts/check-module-cycles.py [--write-allow]
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOW = os.path.join(ROOT, "scripts", "module-cycles.allow")


def modules(src):
    mods = {}
    for name in os.listdir(src):
        p = os.path.join(src, name)
        if name.endswith(".rs") and name not in ("lib.rs", "main.rs"):
            mods[name[:-3]] = [p]
        elif os.path.isdir(p):
            files = []
            for d, _, fs in os.walk(p):
                files += [os.path.join(d, f) for f in fs if f.endswith(".rs")]
            mods.setdefault(name, []).extend(files)
    return mods


def strip_comments(text):
    """Comments and `#[cfg(test)]` modules out (a test may use any module)."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod \w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while depth and j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def edges(mods):
    out = {m: set() for m in mods}
    for m, files in mods.items():
        text = strip_comments("".join(open(f, encoding="utf-8").read() for f in files))
        used = set(re.findall(r"\bcrate::(\w+)", text))
        # `use crate::{a, b::c}` groups
        for group in re.findall(r"\bcrate::\{([^}]*)\}", text):
            used |= set(re.findall(r"(?:^|,)\s*(\w+)", group))
        out[m] = {u for u in used if u in mods and u != m}
    return out


def sccs(graph):
    index, low, stack, on, res, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                res.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return res


def main():
    allow = {}
    if os.path.exists(ALLOW):
        for line in open(ALLOW):
            line = line.split("#")[0].strip()
            if line:
                crate, mods = line.split(":", 1)
                allow.setdefault(crate.strip(), []).append(set(mods.split()))
    found, bad = {}, False
    crates = os.path.join(ROOT, "crates")
    for crate in sorted(os.listdir(crates)):
        src = os.path.join(crates, crate, "src")
        if not os.path.isdir(src):
            continue
        for comp in sccs(edges(modules(src))):
            found.setdefault(crate, []).append(comp)
            known = [a for a in allow.get(crate, []) if set(comp) <= a]
            if known:
                extra = "" if set(comp) == known[0] else f" (smaller than allowed: {' '.join(sorted(known[0] - set(comp)))} left it)"
                print(f"{crate}: known circle {' '.join(comp)}{extra}")
            else:
                bad = True
                print(f"{crate}: NEW import circle between modules {' '.join(comp)}")
    if "--write-allow" in sys.argv:
        with open(ALLOW, "w") as f:
            f.write("# Known import circles between top-level modules (scripts/check-module-cycles.py).\n")
            f.write("# Each is to be taken apart (issue: folders by concern without import circles);\n")
            f.write("# the check fails on any circle not contained in a line here.\n")
            for crate, comps in sorted(found.items()):
                for comp in comps:
                    f.write(f"{crate}: {' '.join(comp)}\n")
        print(f"wrote {os.path.relpath(ALLOW, ROOT)}")
        return 0
    if not found:
        print("no import circles")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
