"""``dtm run`` under real ``mpirun``: what the run request and the load and inputs phases decide
is one line on every rank -- argument errors (no rank aborts the others before their lines get
out), a corrupt input file (named, the same on every rank), a module requiring a capability the
backend lacks; ``init store`` parameters come from the store's latest checkpoint written on
another mesh, under MPI and with ``--sim``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.ir.nodes import Module
from dtm_mpi.runtime.reference import run_reference
from tests.mpi_env import mpirun_env
from tests.test_mpi_run import EXAMPLES, mpirun

pytestmark = [pytest.mark.slow]
ROOT = Path(__file__).parent.parent
MLP = str(EXAMPLES / "tp_mlp.dtm")
CALLS_STATE = str(ROOT / "io" / "vectors" / "ir" / "valid" / "calls_state.dtm")


def _lines(text: str, prefix: str = "dtm: error: ") -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for ln in text.splitlines():
        m = re.match(r"\[rank (\d+)\] (.*)", ln)
        if m and m.group(2).startswith(prefix):
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


def _mpirun_slow_last(ranks: int, *args: str) -> tuple[int, str]:
    """``mpirun`` where the last rank starts 3 s after the others."""
    env = mpirun_env(PYTHONUNBUFFERED="1", DTM_TIMEOUT="30")
    prog = [sys.executable, "-m", "mpi4py", "-m", "dtm_mpi", "run", *args]
    slow = ["sh", "-c", "sleep 3; exec " + " ".join(shlex.quote(a) for a in prog)]
    cmd = [
        "mpirun",
        "--timeout",
        "60",
        "--bind-to",
        "none",
        "-n",
        str(ranks - 1),
        *prog,
        ":",
        "-n",
        "1",
        *slow,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, check=False)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--steps", "-1"], "--steps must be >= 1"),
        (["--resume"], "need --store DIR"),
        (["--steps", "two"], "invalid int value"),
    ],
    ids=["steps-negative", "resume-without-store", "unparsable"],
)
def test_argument_errors_are_one_line_on_every_rank(args: list[str], needle: str) -> None:
    """Lines were missing in 3 of 10 runs: the first rank to exit had the launcher kill the
    others before they printed (here: always, as the last rank starts late). Now every rank
    decides, then every rank prints the same line."""
    code, text = _mpirun_slow_last(3, MLP, *args)
    assert code != 0, text
    lines = _lines(text)
    assert sorted(lines) == [0, 1, 2], text
    assert all(len(v) == 1 and v[0] == lines[0][0] for v in lines.values()), text
    assert needle in lines[0][0], text


def test_corrupt_npz_is_one_agreed_line_naming_the_file(tmp_path: Path) -> None:
    """Was a different line per rank (``BadZipFile: File is not a zip file``), without the
    file's name."""
    bad = tmp_path / "x.npz"
    np.savez(bad, x=np.zeros((64, 256), np.float32))
    bad.write_bytes(bad.read_bytes()[:200])
    code, text, _ = mpirun(2, MLP, "-i", str(bad), env={"DTM_TIMEOUT": "20"})
    assert code != 0, text
    lines = [ln for ln in text.splitlines() if re.match(r"\[rank \d\] dtm", ln)]
    assert len(lines) == 2, text
    bodies = {ln.split("] ", 1)[1] for ln in lines}
    assert len(bodies) == 1, text  # the same line on every rank
    assert (
        f"cannot read input file {bad}" in lines[0] and "inputs failed on rank(s) 0, 1" in lines[0]
    ), text
    assert "Traceback" not in text and "BadZipFile" not in text.replace(f"{bad}", ""), text


CUDA_ONLY = """dtm 1.0
module cuda_only

mesh @m = [dp=2]

entry func @main(%x: f32[4]{dp} init ones) -> f32[4]{dp} on @m requires [CAP_CUDA] {
  %y = exp %x : f32[4]{dp}
  return %y
}
"""


def test_missing_capability_refused_on_every_rank_before_running(tmp_path: Path) -> None:
    path = tmp_path / "cuda_only.dtm"
    path.write_text(CUDA_ONLY, encoding="utf-8")
    out = tmp_path / "out.npz"
    code, text, _ = mpirun(2, str(path), "-o", str(out), env={"DTM_TIMEOUT": "20"})
    assert code != 0, text
    lines = [ln for ln in text.splitlines() if "requires CAP_CUDA" in ln]
    assert sorted(ln.split("]")[0] for ln in lines) == ["[rank 0", "[rank 1"], text
    assert all("load failed" in ln and "backend numpy" in ln for ln in lines), text
    assert not out.exists() and "result0" not in text


def _load(path: str) -> Module:
    module = parse_module(Path(path).read_text(encoding="utf-8"), path)
    verify_module(module)
    return module


def test_init_store_from_a_checkpoint_written_on_another_mesh(tmp_path: Path) -> None:
    """``init store`` answered "the tensor store is issue #6"; now its value comes from the
    latest checkpoint of --store, restored onto the run's mesh (and read whole by --sim)."""
    data = np.random.default_rng(7).standard_normal((4, 8)).astype(np.float32)
    np.save(tmp_path / "data.npy", data)
    store = str(tmp_path / "store")
    code, text, _ = mpirun(
        4,
        CALLS_STATE,
        "--mesh",
        "dp=2,tp=2",
        "-i",
        str(tmp_path / "data.npy"),
        "--checkpoint-every",
        "1",
        "--store",
        store,
        env={"DTM_TIMEOUT": "60"},
    )
    assert code == 0, text
    params, history = run_reference(_load(CALLS_STATE), {"data": data}, steps=2)
    out = tmp_path / "out.npz"
    code, text, _ = mpirun(
        3, CALLS_STATE, "--steps", "2", "--store", store, "-o", str(out), env={"DTM_TIMEOUT": "60"}
    )
    assert code == 0, text
    assert "data from" in text and "issue" not in text, text
    with np.load(out) as g:
        np.testing.assert_array_equal(g["data"], data)
        np.testing.assert_allclose(g["w"], params["%w"], rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(g["result2"], history[-1][2])
    sim = tmp_path / "sim.npz"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtm_mpi",
            "run",
            CALLS_STATE,
            "--sim",
            "2",
            "--steps",
            "2",
            "--store",
            store,
            "-o",
            str(sim),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    with np.load(sim) as g:
        np.testing.assert_array_equal(g["data"], data)
        np.testing.assert_allclose(g["w"], params["%w"], rtol=2e-5, atol=2e-6)


def test_store_that_is_a_file_is_one_line_on_every_rank(tmp_path: Path) -> None:
    """Was a raw ``[Errno 17] File exists`` from inside the store."""
    store = tmp_path / "store"
    store.write_text("a file")
    code, text, _ = mpirun(
        2, MLP, "--checkpoint-every", "1", "--store", str(store), env={"DTM_TIMEOUT": "20"}
    )
    assert code != 0, text
    lines = [ln for ln in text.splitlines() if re.match(r"\[rank \d\] dtm", ln)]
    assert sorted(ln.split("]")[0] for ln in lines) == ["[rank 0", "[rank 1"], text
    assert all(f"--store {store} is not a directory" in ln for ln in lines), text
    assert "Errno" not in text and store.read_text() == "a file"
