"""No import cycle among the modules of one package: each service's, and common's.

Modules in a cycle can be neither read nor tested one at a time, and the order they
happen to be imported in decides what exists when (a registry filled by an import at
the bottom of a module, a half-initialised class). import-linter checks what may
import what across packages; this checks the inside of each one, on the same graph
(grimp, which import-linter is built on). Imports under `if TYPE_CHECKING:` never run,
so they are left out: a Protocol's annotations may name the class they describe.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

import services

# Packages directly under `services` (each service, and the shared library), plus common.
PACKAGES = [
    "common",
    *sorted(f"services.{m.name}" for m in pkgutil.iter_modules(services.__path__) if m.ispkg),
]


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or with a self-import.

    Tarjan's algorithm, iterative so that a long import chain cannot hit the recursion
    limit; each component sorted, the components in order of their first module.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    found.append(sorted(component))
    return sorted(found)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(
        "services", "common", exclude_type_checking_imports=True, cache_dir=None
    )


def _internal_edges(graph: grimp.ImportGraph, package: str) -> dict[str, set[str]]:
    modules = {package, *graph.find_descendants(package)}
    return {
        m: {t for t in graph.find_modules_directly_imported_by(m) if t in modules} for m in modules
    }


def _describe(graph: grimp.ImportGraph, component: list[str]) -> str:
    """Each import inside one cycle, with its line, so the fix can start from it."""
    lines = []
    for importer in component:
        for imported in component:
            details = graph.get_import_details(importer=importer, imported=imported)
            for d in details:
                lines.append(f"  {importer}:{d['line_number']} {d['line_contents']}")
    return "\n".join(lines)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside(graph: grimp.ImportGraph, package: str) -> None:
    found = cycles(_internal_edges(graph, package))
    report = "\n\n".join(_describe(graph, c) for c in found)
    assert not found, f"import cycles inside {package}:\n{report}"


def test_every_service_package_is_checked() -> None:
    assert {"services.coordinator", "services.worker", "services.federation"} <= set(PACKAGES)


def test_a_cycle_is_found_and_a_chain_is_not() -> None:
    chain = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert cycles(chain) == []
    circle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(circle) == [["a", "b", "c"]]
    two = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "e"}, "e": set()}
    assert cycles(two) == [["a", "b"], ["c", "d"]]
    assert cycles({"a": {"a"}}) == [["a"]]


def test_type_checking_imports_are_not_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "cyclepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclepkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclepkg import a\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    typed = grimp.build_graph("cyclepkg", cache_dir=None)
    assert cycles(_internal_edges(typed, "cyclepkg")) == [["cyclepkg.a", "cyclepkg.b"]]
    run = grimp.build_graph("cyclepkg", exclude_type_checking_imports=True, cache_dir=None)
    assert cycles(_internal_edges(run, "cyclepkg")) == []
