"""h5py stays inside the HDF5 backend, read from the source with ``ast`` (nothing imported):

* only the HDF5 backend's modules (:data:`HDF5_MODULES`: ``dtm_mpi.io.h5`` and
  ``dtm_mpi.io.ckpt_files``) import h5py -- at module level or inside a function, by
  ``import``, ``from ... import`` or ``importlib.import_module``/``__import__`` of a literal;
* those modules are imported only by each other and by the modules of :data:`HDF5_USERS`, each
  with its reason (the adapter ``Hdf5Backend``; the reader of a user's ``.h5`` input file);
  everything else -- the protocol, the store tools, ``dtm ckpt``/``dtm store`` -- goes through
  the backend interface (:mod:`dtm_mpi.io.backend`);
* :data:`PENDING` lists the modules outside ``dtm_mpi.io`` that still import h5py, each with
  the backend call that replaces it. An entry of :data:`HDF5_USERS` or :data:`PENDING` whose
  module no longer makes that import fails: remove it.

And, importing them: the protocol, the tools and the CLI modules do not import h5py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dtm_mpi"

HDF5_MODULES = ("dtm_mpi.io.h5", "dtm_mpi.io.ckpt_files")
"""The HDF5 backend's modules: the only importers of h5py."""

HDF5_USERS: dict[str, str] = {
    "dtm_mpi.io.backend": "Hdf5Backend: the adapter between the protocol and the HDF5 modules",
    "dtm_mpi.io.arrays": "a user's -i x.h5 input is HDF5 whatever the store: h5.read_top_datasets",
}
"""The modules besides :data:`HDF5_MODULES` that may import them, and why."""

PENDING: dict[str, str] = {
    "dtm_mpi.comm.world": "describe_world(): the h5py line from io.backend.HDF5.describe()",
}
"""Modules that still import h5py, outside this seam's files, and what replaces it."""


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Every module ``module`` imports (dotted, with its line): ``from P import m`` is
    ``P.m`` when that is a module of the package, else ``P``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}" if base else up
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules else base, node.lineno))
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            name = (
                f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            )
            arg = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
            ):
                found.append((arg.value, node.lineno))
    return found


def _edges() -> list[tuple[str, str, int]]:
    modules = _modules()
    return [
        (m, target, line) for m, p in modules.items() for target, line in _imports(m, p, modules)
    ]


def _is_h5py(target: str) -> bool:
    return target == "h5py" or target.startswith("h5py.")


def _where(module: str, line: int) -> str:
    return f"{_modules()[module].relative_to(ROOT)}:{line} ({module})"


def test_h5py_is_imported_only_by_the_hdf5_backend() -> None:
    bad = [
        _where(m, line)
        for m, t, line in _edges()
        if _is_h5py(t) and m not in HDF5_MODULES and m not in PENDING
    ]
    assert not bad, (
        "h5py imported outside the HDF5 backend's modules (go through dtm_mpi.io.backend):\n"
        + "\n".join(bad)
    )


def test_the_hdf5_modules_are_reached_only_through_the_backend() -> None:
    allowed = set(HDF5_MODULES) | set(HDF5_USERS)
    bad = [
        f"{_where(m, line)} imports {t}"
        for m, t, line in _edges()
        if t in HDF5_MODULES and m not in allowed
    ]
    assert not bad, (
        "the HDF5 backend's modules imported past the seam (use the ShardBackend interface, dtm_mpi.io.tools or dtm_mpi.io.verification):\n"
        + "\n".join(bad)
    )


def test_every_exception_is_still_needed() -> None:
    edges = _edges()
    h5py_users = {m for m, t, _ in edges if _is_h5py(t)}
    assert set(HDF5_MODULES) <= h5py_users, "the scan finds the backend's own h5py imports"
    stale = [f"{m}: {why}" for m, why in PENDING.items() if m not in h5py_users]
    assert not stale, "no longer imports h5py: remove it from PENDING:\n" + "\n".join(stale)
    reaching = {m for m, t, _ in edges if t in HDF5_MODULES}
    stale = [f"{m}: {why}" for m, why in HDF5_USERS.items() if m not in reaching]
    assert not stale, (
        "no longer imports the HDF5 modules: remove it from HDF5_USERS:\n" + "\n".join(stale)
    )


def test_the_protocol_the_tools_and_the_cli_do_not_import_h5py() -> None:
    names = [
        "dtm_mpi.io.backend",
        "dtm_mpi.io.checkpoint",
        "dtm_mpi.io.commit",
        "dtm_mpi.io.data_write",
        "dtm_mpi.io.restore_read",
        "dtm_mpi.io.store",
        "dtm_mpi.io.verification",
        "dtm_mpi.io.tools",
        "dtm_mpi.io.arrays",
        "dtm_mpi.cli_store",
    ]
    code = f"import sys\nfor n in {names!r}: __import__(n)\nprint('h5py' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["False"], out.stdout + out.stderr
