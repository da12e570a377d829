"""The package's layering, read from the source with ``ast`` (nothing is imported):

* no import cycle among the modules of ``dtm_mpi``;
* no upward import: ``dtm_mpi.plan`` and ``dtm_mpi.sharding`` import neither ``dtm_mpi.kernels``
  nor ``dtm_mpi.comm``, and ``dtm_mpi.comm`` imports none of the layers given communicators
  (``runtime``, ``io``, ``frontend``, ``bench``);
* no ``mpi4py`` import outside ``dtm_mpi.comm`` and ``dtm_mpi.bench``.

What counts as an import: every ``import``/``from ... import`` statement anywhere in a module --
at module level *and* inside functions (a lazy import is still a dependency: it runs the moment
the function does, and hiding a cycle behind one only moves the partially initialised module
problem to run time) -- plus ``importlib.import_module("...")``/``__import__("...")`` with a
literal name. One kind of lazy import is excused, by name, in :data:`PLUGIN_LOADS`: a registry
loading the modules that register into it on first use (the registry is complete before any
caller can see it; the plug-ins import the registry, never the other way at import time).
Each excused edge must still exist (a stale excuse fails), and no module-level edge is ever
excused. Imports under ``if TYPE_CHECKING:`` count for the upward and mpi4py rules (they
still couple the layers) but not for cycles (they never run). An edge goes to the module named
(``from dtm_mpi.io import files`` -> ``dtm_mpi.io.ckpt_files`` when that is a module, else the package
``dtm_mpi.io``); the implicit import of parent packages' ``__init__`` is not an edge (every
submodule would otherwise depend on the facade, and the facade on them).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dtm_mpi"

MPI_ALLOWED = ("dtm_mpi.comm", "dtm_mpi.bench")
PURE = ("dtm_mpi.plan", "dtm_mpi.sharding")
ABOVE_PURE = ("dtm_mpi.kernels", "dtm_mpi.comm")
COMM = ("dtm_mpi.comm",)
ABOVE_COMM = ("dtm_mpi.runtime", "dtm_mpi.io", "dtm_mpi.frontend", "dtm_mpi.bench")

_BACKEND = "a backend's kernels load on first use"
PLUGIN_LOADS: dict[tuple[str, str], str] = {
    ("dtm_mpi.ir.registry", "dtm_mpi.ir.ops"): "the op table loads the op definitions",
    ("dtm_mpi.kernels.dispatch", "dtm_mpi.kernels.numpy_backend"): _BACKEND,
    ("dtm_mpi.kernels.dispatch", "dtm_mpi.kernels.cuda_backend"): _BACKEND,
}
"""Lazy imports excused from the cycle rule (see the module's docstring)."""


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # importing module
    target: str  # imported module (dotted; may be outside dtm_mpi)
    line: int
    lazy: bool  # inside a function
    type_only: bool  # under ``if TYPE_CHECKING:``


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every module of the package at ``root``."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: dict[str, Path]) -> None:
        self.module, self.is_package, self.modules = module, is_package, modules
        self.found: list[Import] = []
        self.depth = 0  # function nesting
        self.type_only = 0

    def _add(self, target: str, node: ast.AST) -> None:
        line = getattr(node, "lineno", 0)
        self.found.append(Import(self.module, target, line, self.depth > 0, self.type_only > 0))

    def _base(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = self.module if self.is_package else self.module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._base(node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.modules else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self._add(arg.value, node)
        self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._function(node)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._function(node)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.type_only += 1
            for stmt in node.body:
                self.visit(stmt)
            self.type_only -= 1
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)


def collect_imports(root: Path) -> list[Import]:
    modules = module_names(root)
    found: list[Import] = []
    for name, path in modules.items():
        c = _Collector(name, path.name == "__init__.py", modules)
        c.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        found += c.found
    return found


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The package module ``target`` names (its nearest enclosing module), or None outside."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def _excused(imp: Import, target: str, excused: dict[tuple[str, str], str]) -> bool:
    return imp.lazy and (imp.source, target) in excused


def import_cycles(root: Path, excused: dict[tuple[str, str], str] | None = None) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself) of the run-time import graph, less the ``excused`` lazy edges: each one is a
    cycle."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in collect_imports(root):
        target = _resolve(imp.target, modules)
        if target is not None and not imp.type_only and not _excused(imp, target, excused or {}):
            graph[imp.source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle_text(comp: list[str], root: Path) -> str:
    members = set(comp)
    edges = sorted(
        {
            f"{i.source} -> {i.target} (line {i.line}{', lazy' if i.lazy else ''})"
            for i in collect_imports(root)
            if not i.type_only
            and i.source in members
            and _resolve(i.target, module_names(root)) in members
        }
    )
    return " <-> ".join(comp) + ": " + "; ".join(edges)


def upward_imports(
    root: Path, lower: tuple[str, ...] = PURE, upper: tuple[str, ...] = ABOVE_PURE
) -> list[Import]:
    return [
        i for i in collect_imports(root) if _within(i.source, lower) and _within(i.target, upper)
    ]


def mpi4py_imports(root: Path) -> list[Import]:
    return [
        i
        for i in collect_imports(root)
        if _within(i.target, ("mpi4py",)) and not _within(i.source, MPI_ALLOWED)
    ]


def _where(imports: list[Import]) -> str:
    return "; ".join(
        sorted(
            {
                f"{i.source} line {i.line} imports {i.target}{' (lazily)' if i.lazy else ''}"
                for i in imports
            }
        )
    )


# --- the rules, on dtm_mpi -----------------------------------------------------------------------


def test_no_import_cycle() -> None:
    cycles = import_cycles(ROOT, PLUGIN_LOADS)
    assert not cycles, "import cycles: " + " | ".join(_cycle_text(c, ROOT) for c in cycles)


def test_every_excused_plugin_load_is_still_a_lazy_import() -> None:
    modules = module_names(ROOT)
    lazy = {(i.source, _resolve(i.target, modules)) for i in collect_imports(ROOT) if i.lazy}
    eager = {
        (i.source, _resolve(i.target, modules))
        for i in collect_imports(ROOT)
        if not i.lazy and not i.type_only
    }
    for edge, why in PLUGIN_LOADS.items():
        assert edge in lazy, (
            f"{edge[0]} no longer imports {edge[1]} lazily ({why}): remove the excuse"
        )
        assert edge not in eager, f"{edge[0]} imports {edge[1]} at module level: never excused"


def test_no_upward_import_from_plan_or_sharding() -> None:
    found = upward_imports(ROOT)
    assert not found, "plan/ and sharding/ must not import kernels/ or comm/: " + _where(found)


def test_no_upward_import_from_comm() -> None:
    found = upward_imports(ROOT, COMM, ABOVE_COMM)
    assert not found, "comm/ must not import the layers it serves: " + _where(found)


def test_mpi4py_only_in_comm_and_bench() -> None:
    found = mpi4py_imports(ROOT)
    assert not found, "mpi4py is imported outside dtm_mpi/comm and dtm_mpi/bench: " + _where(found)


def test_the_graph_sees_the_package() -> None:
    """The checker reads what it should: known edges of the real package are found."""
    imports = {(i.source, i.target) for i in collect_imports(ROOT)}
    assert ("dtm_mpi.io.checkpoint", "dtm_mpi.comm.objects") in imports
    assert any(s.startswith("dtm_mpi.comm.") and t.startswith("mpi4py") for s, t in imports)


# --- the checker itself, on a made-up package ---------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "dtm_mpi"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


@pytest.mark.parametrize("lazy", [False, True])
def test_checker_finds_a_cycle(tmp_path: Path, lazy: bool) -> None:
    back = "def f():\n    from dtm_mpi import a\n" if lazy else "from dtm_mpi import a\n"
    root = _package(tmp_path, {"a.py": "import dtm_mpi.b\n", "b.py": back, "c.py": ""})
    assert import_cycles(root) == [["dtm_mpi.a", "dtm_mpi.b"]]


def test_checker_excuses_only_named_lazy_edges(tmp_path: Path) -> None:
    lazy = "def load():\n    import dtm_mpi.plugin\n"
    root = _package(tmp_path, {"registry.py": lazy, "plugin.py": "import dtm_mpi.registry\n"})
    excuse = {("dtm_mpi.registry", "dtm_mpi.plugin"): "plug-ins"}
    assert import_cycles(root, excuse) == []
    assert import_cycles(root) == [["dtm_mpi.plugin", "dtm_mpi.registry"]]
    eager = _package(
        tmp_path / "b",
        {"registry.py": "import dtm_mpi.plugin\n", "plugin.py": "import dtm_mpi.registry\n"},
    )
    assert import_cycles(eager, excuse) == [["dtm_mpi.plugin", "dtm_mpi.registry"]]


def test_checker_ignores_type_checking_for_cycles(tmp_path: Path) -> None:
    b = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"
    root = _package(tmp_path, {"a.py": "from dtm_mpi.b import Y\n", "b.py": b})
    assert import_cycles(root) == []


def test_checker_finds_upward_and_mpi4py(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "plan/p.py": "def f():\n    from dtm_mpi.kernels import registry\n",
            "kernels/registry.py": "",
            "sharding/s.py": "from ..comm.x import y\n",
            "comm/x.py": "from mpi4py import MPI\n",
            "bench/b.py": "import mpi4py\n",
            "io/f.py": "import importlib\nM = importlib.import_module('mpi4py.MPI')\n",
            "runtime/r.py": "def g():\n    from mpi4py import MPI\n",
        },
    )
    up = sorted((i.source, i.target) for i in upward_imports(root))
    assert up == [
        ("dtm_mpi.plan.p", "dtm_mpi.kernels.registry"),
        ("dtm_mpi.sharding.s", "dtm_mpi.comm.x"),
    ]
    mpi = sorted((i.source, i.target) for i in mpi4py_imports(root))
    assert mpi == [("dtm_mpi.io.f", "mpi4py.MPI"), ("dtm_mpi.runtime.r", "mpi4py")]
