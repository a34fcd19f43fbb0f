"""No import cycle between modules of the product packages, imports inside functions included.

A function-level import does not remove a cycle, it only delays it (and hides it from readers),
so the graph here holds every import statement grimp finds: module level, inside functions and
under ``TYPE_CHECKING``. ``pyproject.toml`` also has an import-linter ``acyclic_siblings``
contract (cycles between sibling modules or packages, checked by ``lint-imports``); this test
adds the module-level view and names the chain of a cycle it finds.
"""
from __future__ import annotations

import itertools
import sys
import textwrap

import grimp
import pytest

# bench is not served, but the CLI runs it (fastcosy bench) and it is installed with the project.
PRODUCT_PACKAGES = ("fastcosy_cli", "bench", "serve_app", "deployments", "cosyvoice_runtime")


def module_cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """One import chain ``a -> b -> ... -> a`` per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(root: str) -> None:  # iterative Tarjan: no recursion limit on long chains
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph.modules:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1 or module in graph.find_modules_directly_imported_by(module):
                    groups.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    cycles = []
    for group in groups:
        start = group[0]
        step = min(m for m in graph.find_modules_directly_imported_by(start) if m in group)
        back = graph.find_shortest_chain(importer=step, imported=start) if step != start else (start,)
        cycles.append((start, *back))
    return cycles


def describe(graph: grimp.ImportGraph, cycle: tuple[str, ...]) -> str:
    """``a (file:line) -> b (file:line) -> ...``: where each import of the chain is written."""
    steps = []
    for importer, imported in itertools.pairwise(cycle):
        details = graph.get_import_details(importer=importer, imported=imported)
        where = ", ".join(f"line {d['line_number']}: {d['line_contents']}" for d in details)
        steps.append(f"  {importer} -> {imported}   [{where}]")
    return "\n".join(steps)


@pytest.fixture(scope="module")
def product_graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PRODUCT_PACKAGES, cache_dir=None)


def test_product_packages_have_no_import_cycle(product_graph):
    graph = product_graph
    cycles = module_cycles(graph)
    report = "\n\n".join(describe(graph, c) for c in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) between modules (function-level imports count):\n{report}"


def test_a_cycle_through_a_function_level_import_is_found(tmp_path, monkeypatch):
    """The check itself: a cycle closed only by an import inside a function is reported, with its chain."""
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclepkg.b import helper\n")
    (pkg / "b.py").write_text(textwrap.dedent("""
        def helper():
            from cyclepkg.c import thing
            return thing
    """))
    (pkg / "c.py").write_text("import cyclepkg.a\nthing = 1\n")
    (pkg / "d.py").write_text("import cyclepkg.a\n")  # imports into the cycle, not part of it
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclepkg", cache_dir=None)
    cycles = module_cycles(graph)
    assert cycles == [("cyclepkg.a", "cyclepkg.b", "cyclepkg.c", "cyclepkg.a")]
    assert "line 3: from cyclepkg.c import thing" in describe(graph, cycles[0])
    (pkg / "c.py").write_text("thing = 1\n")  # break it
    assert module_cycles(grimp.build_graph("cyclepkg", cache_dir=None)) == []
    sys.modules.pop("cyclepkg", None)


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_graph_sees_every_product_package(product_graph, package):
    """Guards the main test against an empty graph (a renamed package would make it pass vacuously)."""
    assert len(product_graph.find_descendants(package)) >= 5
