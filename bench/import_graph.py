"""python -m bench.import_graph [--cycles]: reco's import graph in three figures (modules, internal import
edges, cycles), lazy and TYPE_CHECKING imports included, read with grimp (import-linter's graph builder).
The layers themselves are checked by `lint-imports` (pyproject.toml); this prints what a review compares.
"""

from __future__ import annotations

import argparse

import grimp


def strongly_connected(graph: grimp.ImportGraph) -> list[set[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.import_graph", description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", action="store_true", help="list the modules of every cycle")
    args = ap.parse_args()
    g = grimp.build_graph("reco")
    edges = sum(len(g.find_modules_directly_imported_by(m)) for m in g.modules)
    cycles = strongly_connected(g)
    print("| modules | internal import edges | cycles | modules in cycles |")
    print("|---|---|---|---|")
    print(f"| {len(g.modules)} | {edges} | {len(cycles)} | {sum(len(c) for c in cycles)} |")
    if args.cycles:
        for c in cycles:
            print(" -> ".join(sorted(c)))


if __name__ == "__main__":
    main()
