"""The exception hierarchy: diagnostics render file:line:col with a caret; distributed errors
name ranks and phases; storage errors name tensor, shard and file."""

from __future__ import annotations

import subprocess
import sys

from dtm_mpi.errors import (
    CommError,
    DiagnosticError,
    DtmError,
    HandshakeError,
    IntegrityError,
    LayoutError,
    ParseError,
    PoisonedError,
    RankFailure,
    RemoteFailureError,
    SourceSpan,
    StorageError,
    UsageError,
    VerifyError,
    VersionError,
)


def test_diagnostic_renders_location_line_and_caret() -> None:
    err = VerifyError("bad thing", SourceSpan("m.dtm", 3, 7, 4), "  %x = exp %p : f32[4]")
    text = str(err)
    lines = text.splitlines()
    assert lines[0] == "m.dtm:3:7: verify error: bad thing"
    assert lines[1] == "    %x = exp %p : f32[4]"
    assert lines[2] == "        ^~~~"
    assert isinstance(err, ValueError) and isinstance(err, DtmError) and err.agreed


def test_diagnostic_without_source_is_one_line() -> None:
    assert str(ParseError("x", SourceSpan("f", 1, 1))) == "f:1:1: parse error: x"
    assert issubclass(VersionError, ParseError) and issubclass(ParseError, DiagnosticError)


def test_remote_failure_lists_every_rank_and_phase() -> None:
    err = RemoteFailureError(
        "step", (RankFailure(1, "step", "disk full"), RankFailure(3, "step", "nan in loss"))
    )
    assert str(err) == (
        "step failed on rank(s) 1, 3: rank 1 (step): disk full; rank 3 (step): nan in loss"
    )
    assert err.agreed and err.phase == "step" and isinstance(err, CommError)


def test_poison_keeps_the_original_cause() -> None:
    cause = CommError("allreduce timed out", rank=2, phase="forward")
    err = PoisonedError(cause)
    assert err.cause is cause and "allreduce timed out" in str(err)
    assert not err.agreed and HandshakeError.agreed and LayoutError.agreed


def test_integrity_error_names_tensor_shard_file() -> None:
    err = IntegrityError("hash mismatch", tensor="w1", shard="w1:shard:3", file="ck.h5")
    assert str(err) == "ck.h5: tensor 'w1' shard 'w1:shard:3': hash mismatch"
    assert isinstance(err, StorageError) and isinstance(err, OSError)
    assert isinstance(UsageError("x"), ValueError)


def test_importing_dtm_mpi_does_not_touch_mpi() -> None:
    code = (
        "import sys, dtm_mpi, dtm_mpi.cli, dtm_mpi.ir, dtm_mpi.comm.abort;"
        "dtm_mpi.ir.parse_module('dtm 1.0\\nmodule m\\n');"
        "bad = [m for m in ('mpi4py.MPI', 'h5py', 'cupy') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
