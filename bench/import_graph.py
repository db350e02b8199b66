"""python -m bench.import_graph [--cycles]: reco's import graph in three figures (modules, internal import
edges, cycles), lazy and TYPE_CHECKING imports included, read with grimp (import-linter's graph builder).
The layers themselves are checked by `lint-imports` (pyproject.toml); this prints what a review compares.
"""

from __future__ import annotations

import argparse

import grimp
import networkx as nx


def strongly_connected(graph: grimp.ImportGraph) -> list[set[str]]:
    """The import cycles: strongly connected components of more than one module."""
    g = nx.DiGraph()
    g.add_nodes_from(graph.modules)
    g.add_edges_from((m, d) for m in graph.modules for d in graph.find_modules_directly_imported_by(m))
    return [c for c in nx.strongly_connected_components(g) if len(c) > 1]


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
