"""``dtm conformance`` (dtm_mpi/conformance.py): the vectors and the runtime pass every level a
process alone can run; a damaged vector fails its case and the command exits 1; the matrix
says which levels are claimed and why not; under mpirun L1 and L3 are claimed when every case
ran (8 ranks: every vector's declared mesh)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dtm_mpi.cli import main
from dtm_mpi.conformance import CaseResult, Level, default_vectors, matrix_text, run_conformance
from tests.mpi_env import dtm_job


def test_every_level_a_process_alone_runs_passes() -> None:
    results = run_conformance([Level.L0, Level.L1, Level.L2, Level.L3])
    assert not [r for r in results if r.ok is False], [r for r in results if r.ok is False]
    by = {lv: [r for r in results if r.level is lv] for lv in Level}
    assert len(by[Level.L0]) >= 200 and all(r.ok for r in by[Level.L0])
    assert all(r.ok for r in by[Level.L2])
    not_run = {r.name for r in results if r.ok is None}
    assert not_run and all(n.startswith("mpi/") or n.startswith("resize") for n in not_run)
    text = matrix_text(results)
    assert "L0     IR and local execution" in text and "claimed: pass" in text
    assert "not claimed" in text  # L1's MPI cases need mpirun


def test_a_damaged_vector_fails_its_case_and_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vectors = tmp_path / "io" / "vectors"
    shutil.copytree(default_vectors(), vectors)
    shutil.copytree(default_vectors().parents[1] / "examples", tmp_path / "examples")
    hashes = json.loads((vectors / "ir" / "hashes.json").read_text())
    hashes["matmul.dtm"] = "dtm-mh1:" + "0" * 64
    (vectors / "ir" / "hashes.json").write_text(json.dumps(hashes))
    frame = vectors / "wire" / "valid" / "end.json"
    doc = json.loads(frame.read_text())
    doc["values"]["error"] = "another message"
    frame.write_text(json.dumps(doc))
    assert main(["conformance", "--level", "L0,L1", "--vectors", str(vectors)]) == 1
    out = capsys.readouterr().out
    assert "L0 ir/valid/matmul.dtm: module hash" in out and "!= recorded dtm-mh1:000" in out
    assert "L1 wire/valid/end.json: decoded values differ" in out
    assert "FAIL (1)" in out


def test_the_matrix_statuses() -> None:
    rs = [
        CaseResult(Level.L0, "a", True),
        CaseResult(Level.L1, "b", True),
        CaseResult(Level.L1, "c", None, "needs mpirun"),
        CaseResult(Level.L2, "d", False, "broken"),
        CaseResult(Level.GPU, "e", None, "no GPU"),
    ]
    lines = matrix_text(rs).splitlines()
    assert lines[1].endswith("claimed: pass")
    assert lines[2].endswith("pass, not claimed: 1 not run (needs mpirun)")
    assert lines[3].endswith("FAIL (1)") and lines[4].endswith("not claimed: no GPU")
    assert "  L2 d: broken" in lines
    with pytest.raises(Exception, match="--level"):
        main(["conformance", "--level", "L9"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")
def test_under_mpirun_the_mpi_levels_are_claimed() -> None:
    got = dtm_job(8, "conformance", "--level", "L1,L3")
    assert got.returncode == 0, got.stdout + got.stderr
    lines = [ln for ln in got.stdout.splitlines() if ln[:2] in ("L1", "L3")]
    assert len(lines) == 2 and all(ln.endswith("claimed: pass") for ln in lines), got.stdout
