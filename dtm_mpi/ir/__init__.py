"""The DTM IR: types, parser, printer, op registry, verifier and module hash (pure: no MPI,
no devices, no files)."""

from __future__ import annotations

from dtm_mpi.errors import DiagnosticError, ParseError
from dtm_mpi.ir.hashing import module_hash
from dtm_mpi.ir.lexer import Source
from dtm_mpi.ir.nodes import Function, Module, Op
from dtm_mpi.ir.parser import parse_module, parse_optional_module
from dtm_mpi.ir.printer import print_module
from dtm_mpi.ir.verify import verify_errors, verify_module

__all__ = [
    "Function",
    "load_module",
    "Module",
    "Op",
    "check_text",
    "module_hash",
    "parse_module",
    "parse_optional_module",
    "print_module",
    "verify_errors",
    "verify_module",
]


def check_text(text: str, file: str = "<input>") -> tuple[Module | None, list[DiagnosticError]]:
    """Parse and verify ``text``; the module (None if it did not parse) and every diagnostic,
    each with its source line attached."""
    source = Source(text, file)
    try:
        module = parse_module(text, file)
    except ParseError as err:
        return None, [err]
    errors: list[DiagnosticError] = list(verify_errors(module))
    for diag in errors:
        if diag.source_line is None:
            diag.with_source(source.line_text(diag.span.line))
    return module, errors


def load_module(text: str, file: str = "<input>") -> Module:
    """Parse and verify; raise the first diagnostic (source line attached)."""
    module, errors = check_text(text, file)
    if errors:
        raise errors[0]
    assert module is not None
    return module
