"""Every ``DTM_*`` environment variable is read in ``dtm_mpi/config.py`` and nowhere else: the
package's source is scanned with ``ast`` for reads of ``os.environ`` / ``os.getenv`` whose key
is a ``DTM_`` string (``os.environ.get``, ``os.environ[...]``, ``"DTM_X" in os.environ``,
``os.getenv``, ``os.environ.setdefault``/``pop``)."""

from __future__ import annotations

import ast
from pathlib import Path

import dtm_mpi

PACKAGE = Path(dtm_mpi.__file__).parent
CONFIG = PACKAGE / "config.py"


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in ("getenv", "getenvb")
    return isinstance(node, ast.Name) and node.id in ("getenv", "getenvb")


def _dtm_literal(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
        text = node.value.decode() if isinstance(node.value, bytes) else node.value
        return text if text.startswith("DTM_") else None
    if isinstance(node, ast.JoinedStr) and node.values:  # f"DTM_{x}"
        return _dtm_literal(node.values[0])
    return None


def env_reads(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, variable) of every read of a ``DTM_*`` environment variable in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        key: ast.AST | None = None
        if isinstance(node, ast.Call):
            func = node.func
            if _is_getenv(func) or (
                isinstance(func, ast.Attribute)
                and _is_environ(func.value)
                and func.attr in ("get", "setdefault", "pop", "__getitem__")
            ):
                key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        name = _dtm_literal(key)
        if name is not None:
            found.append((node.lineno, name))
    return found


def test_scanner_finds_every_form() -> None:
    source = (
        "import os\nfrom os import environ, getenv\n"
        "a = os.environ.get('DTM_A', '1')\n"
        "b = os.environ['DTM_B']\n"
        "c = 'DTM_C' in os.environ\n"
        "d = os.getenv('DTM_D')\n"
        "e = environ.get(f'DTM_{a}')\n"
        "f = getenv('DTM_F')\n"
        "g = os.environ.get('HOME')\n"
        "h = os.environ.setdefault('DTM_H', 'x')\n"
    )
    got = [name for _, name in env_reads(source, "<test>")]
    assert got == ["DTM_A", "DTM_B", "DTM_C", "DTM_D", "DTM_", "DTM_F", "DTM_H"]


def test_config_reads_its_variables_through_env_vars() -> None:
    """config.py itself looks each variable up by :data:`ENV_VARS` (no literal reads)."""
    assert env_reads(CONFIG.read_text(encoding="utf-8"), str(CONFIG)) == []


def test_no_module_but_config_reads_dtm_variables() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} reads {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != CONFIG
        for line, name in env_reads(path.read_text(encoding="utf-8"), str(path))
    ]
    assert not offenders, f"read these in dtm_mpi/config.py (a Config field): {offenders}"
