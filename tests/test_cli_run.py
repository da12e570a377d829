"""``dtm run --sim`` and ``dtm explain`` through the console entry point
(:func:`dtm_mpi.cli.run`): results and state equal the single-process reference, inputs
override initialisers, and every bad command line is a one-line error with exit code 2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.cli import run
from dtm_mpi.config import get_config
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.ir.nodes import Module
from dtm_mpi.runtime.reference import run_reference

ROOT = Path(__file__).parent.parent
TP_MLP = str(ROOT / "examples" / "tp_mlp.dtm")
RTOL, ATOL = 2e-5, 2e-6


def load(path: str) -> Module:
    module = parse_module(Path(path).read_text(encoding="utf-8"), path)
    verify_module(module)
    return module


def dtm(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dtm: error: "), err
    assert "Traceback" not in err
    return lines[0]


def x_input(seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((64, 256)).astype(np.float32)


# --- running ---------------------------------------------------------------------------------


def test_run_tp_mlp_matches_reference(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    code, stdout, err = dtm(
        capsys, "run", TP_MLP, "--sim", "4", "--mesh", "dp=2,tp=2", "--steps", "3", "-o", str(out)
    )
    assert code == 0, err
    assert f"wrote {out}" in stdout
    params, history = run_reference(load(TP_MLP), steps=3)
    with np.load(out) as data:
        got = {k: data[k] for k in data.files}
    assert {"result0", "result1", "result2", "w1", "w2"} <= set(got)
    assert set(got) == {"result0", "result1", "result2", "x", "target", "w1", "w2"}
    for i, want in enumerate(history[-1]):
        assert got[f"result{i}"].shape == want.shape and got[f"result{i}"].dtype == want.dtype
        np.testing.assert_allclose(got[f"result{i}"], want, rtol=RTOL, atol=ATOL)
    for name in ("w1", "w2", "x", "target"):
        np.testing.assert_allclose(got[name], params[f"%{name}"], rtol=RTOL, atol=ATOL)
    # three SGD steps moved the weights: the state was carried
    _, one_step = run_reference(load(TP_MLP), steps=1)
    assert not np.allclose(got["w1"], one_step[-1][1], rtol=0, atol=0)
    # the last step's updated weights are the state written out
    np.testing.assert_array_equal(got["result1"], got["w1"])
    np.testing.assert_array_equal(got["result2"], got["w2"])


def test_input_overrides_initialiser(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    x = x_input()
    np.save(tmp_path / "x.npy", x)
    base, given = tmp_path / "base.npz", tmp_path / "given.npz"
    args = ("run", TP_MLP, "--sim", "2", "--mesh", "dp=1,tp=2")
    assert dtm(capsys, *args, "-o", str(base))[0] == 0
    code, _, err = dtm(capsys, *args, "-i", str(tmp_path / "x.npy"), "-o", str(given))
    assert code == 0, err
    params, history = run_reference(load(TP_MLP), {"x": x}, steps=1)
    with np.load(base) as b, np.load(given) as g:
        np.testing.assert_array_equal(g["x"], x)
        assert not np.allclose(b["result0"], g["result0"])
        assert not np.allclose(b["w1"], g["w1"])
        np.testing.assert_allclose(g["result0"], history[0][0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(g["w1"], params["%w1"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(g["w2"], params["%w2"], rtol=RTOL, atol=ATOL)


def test_inputs_from_npz_and_h5(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    x, target = x_input(1), x_input(2)
    np.savez(tmp_path / "in.npz", x=x)
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["target"] = target
    out = tmp_path / "out.npz"
    code, _, err = dtm(
        capsys,
        "run",
        TP_MLP,
        "--sim",
        "1",
        "-i",
        str(tmp_path / "in.npz"),
        "-i",
        str(tmp_path / "t.h5"),
        "-o",
        str(out),
    )
    assert code == 0, err
    _, history = run_reference(load(TP_MLP), {"x": x, "target": target}, steps=1)
    with np.load(out) as g:
        np.testing.assert_array_equal(g["target"], target)
        np.testing.assert_allclose(g["result0"], history[0][0], rtol=RTOL, atol=ATOL)


# --- usage errors: exit 2, one line ----------------------------------------------------------


def _npy(tmp_path: Path, name: str, value: np.ndarray) -> str:
    path = tmp_path / f"{name}.npy"
    np.save(path, value)
    return str(path)


def _npz(tmp_path: Path, name: str, **arrays: np.ndarray) -> str:
    path = tmp_path / f"{name}.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return str(path)


def _dir(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.mkdir()
    return str(path)


USAGE_CASES = {
    "unknown-input": (
        lambda p: ["-i", _npy(p, "nope", x_input())],
        "input 'nope' matches no parameter",
    ),
    "wrong-shape": (lambda p: ["-i", _npy(p, "x", np.zeros((3, 3), np.float32))], "shape [3, 3]"),
    "wrong-dtype": (
        lambda p: ["-i", _npy(p, "x", np.zeros((64, 256), np.complex64))],
        "dtype complex64",
    ),
    "int-for-float": (lambda p: ["-i", _npy(p, "x", np.zeros((64, 256), np.int32))], None),
    "missing-file": (lambda p: ["-i", str(p / "missing.npy")], "does not exist"),
    "directory-input": (lambda p: ["-i", _dir(p, "d.npy")], "is a directory"),
    "unknown-suffix": (lambda p: ["-i", str(p / "x.csv")], "unknown type '.csv'"),
    "input-twice": (
        lambda p: ["-i", _npy(p, "x", x_input()), "-i", _npz(p, "more", x=x_input())],
        "given twice",
    ),
    "mesh-bad-axis": (lambda p: ["--mesh", "dp=2,zz=2"], "axis 'zz'"),
    "mesh-bad-size": (lambda p: ["--mesh", "dp=two"], "is not a positive integer"),
    "mesh-product": (lambda p: ["--mesh", "dp=2,tp=1"], "the product of the axis sizes"),
    "steps-0": (lambda p: ["--steps", "0"], "--steps must be >= 1"),
    "bad-option": (lambda p: ["--bogus"], "unrecognized arguments"),
}


@pytest.mark.parametrize(("extra", "needle"), list(USAGE_CASES.values()), ids=list(USAGE_CASES))
def test_run_usage_errors(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    extra: Callable[[Path], list[str]],
    needle: str | None,
) -> None:
    args = extra(tmp_path)
    code, out, err = dtm(capsys, "run", TP_MLP, "--sim", "4", *args)
    if needle is None:  # accepted: an int array converts to a float parameter
        assert code == 0, err
        return
    assert code == 2, err
    assert needle in one_line_error(err)
    assert out == ""  # refused before running


def test_mesh_product_must_equal_sim(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = dtm(capsys, "run", TP_MLP, "--sim", "3", "--mesh", "dp=2,tp=2")
    assert code == 2
    msg = one_line_error(err)
    assert "has 4 rank(s), but the job has 3" in msg


def test_output_must_be_npz(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    code, _, err = dtm(capsys, "run", TP_MLP, "--sim", "1", "-o", str(target))
    assert code == 2
    assert "use a .npz file name" in one_line_error(err)
    assert list(tmp_path.iterdir()) == []


def test_output_checked_before_running(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = dtm(capsys, "run", TP_MLP, "--sim", "1", "-o", str(tmp_path / "out.txt"))
    assert code == 2
    assert out == ""  # nothing was run, so no result summary


def test_output_directory_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = dtm(capsys, "run", TP_MLP, "--sim", "1", "-o", str(tmp_path / "no" / "o.npz"))
    assert code == 2
    assert "does not exist" in one_line_error(err)


def test_output_is_a_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "out.npz").mkdir()
    code, _, err = dtm(capsys, "run", TP_MLP, "--sim", "1", "-o", str(tmp_path / "out.npz"))
    assert code == 2, err
    one_line_error(err)


def test_run_without_sim_runs_on_the_launchers_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --sim and outside mpirun, MPI runs a single-rank job (singleton init)."""
    code, out, _ = dtm(capsys, "run", TP_MLP, "--steps", "1")
    assert code == 0
    assert "result0" in out and "w2" in out


def test_failed_write_leaves_no_partial_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out.npz"
    target.write_bytes(b"previous contents")

    def broken_savez(f: object, **arrays: object) -> None:
        f.write(b"PK\x03\x04 half an archive")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", broken_savez)
    code, _, err = dtm(capsys, "run", TP_MLP, "--sim", "1", "-o", str(target))
    assert code == 1
    assert "No space left on device" in err
    assert target.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npz"]  # no temporary left over
    target.unlink()
    code, _, _ = dtm(capsys, "run", TP_MLP, "--sim", "1", "-o", str(target))
    assert code == 1 and not target.exists()


# --- explain ---------------------------------------------------------------------------------


def test_explain_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = dtm(capsys, "explain", TP_MLP, "--mesh", "dp=2,tp=2")
    assert code == 0, err
    assert out.startswith("module tp_mlp on mesh [dp=2, tp=2] (4 ranks)\n")
    assert "function @train_step\n" in out and "function @forward\n" in out
    assert "allreduce sum on tp" in out
    assert "  communication steps: allreduce x4\n" in out
    assert "overlapped collectives" not in out  # DTM_OVERLAP is off by default


def test_explain_shows_the_overlapped_buckets(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DTM_OVERLAP", "1")
    get_config.cache_clear()
    try:
        code, out, err = dtm(capsys, "explain", TP_MLP, "--mesh", "dp=2,tp=2")
    finally:
        monkeypatch.delenv("DTM_OVERLAP")
        get_config.cache_clear()
    assert code == 0, err
    assert "  communication steps: allreduce x2\n" in out  # the tp one, and one bucket on dp
    assert "overlapped collectives (DTM_OVERLAP=1" in out
    assert "@train_step bucket 1: allreduce sum on dp of " in out and "ops run meanwhile" in out


def test_explain_ranks_default_to_declared_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    code, declared, _ = dtm(capsys, "explain", TP_MLP)
    assert code == 0
    assert declared.startswith("module tp_mlp on mesh [dp=2, tp=2] (4 ranks)")
    code, three, _ = dtm(capsys, "explain", TP_MLP, "-n", "3")
    assert code == 0
    assert three.startswith("module tp_mlp on mesh [dp=3, tp=1] (3 ranks)")


def test_explain_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = dtm(capsys, "explain", TP_MLP, "--max-bytes-per-rank", "1K")
    assert code == 1
    assert "totals per step" in out  # the table is printed before the refusal
    msg = one_line_error(err)
    assert "on rank 0" in msg and "(1024 bytes)" in msg
    assert dtm(capsys, "explain", TP_MLP, "--max-bytes-per-rank", "1G")[0] == 0
    code, _, err = dtm(capsys, "explain", TP_MLP, "--max-bytes-per-rank", "lots")
    assert code == 2 and "not a byte count" in err


def test_run_memory_limit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    code, stdout, err = dtm(
        capsys, "run", TP_MLP, "--sim", "2", "--max-bytes-per-rank", "64K", "-o", str(out)
    )
    assert code == 1
    assert "over --max-bytes-per-rank 64.0 KiB" in one_line_error(err)
    assert stdout == "" and not out.exists()


# --- invalid modules -------------------------------------------------------------------------

BAD = """dtm 1.0
module bad

mesh @m = [dp=2]

entry func @main(%x: f32[4]{dp} init zeros) -> f32[4]{dp} on @m {
  %e = exp %x : f32[4]{dp}
  %f = sqrt %nope : f32[4]{dp}
  return %f
}
"""


@pytest.mark.parametrize("command", [["run", "--sim", "2"], ["explain"]])
def test_invalid_module_diagnostics(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
) -> None:
    path = tmp_path / "bad.dtm"
    path.write_text(BAD, encoding="utf-8")
    code, out, err = dtm(capsys, command[0], str(path), *command[1:])
    assert code == 1
    assert out == ""
    assert f"{path}:8:13: verify error: " in err
    assert "  %f = sqrt %nope : f32[4]{dp}\n" in err
    assert "\n              ^~~~~\n" in err
    assert err.rstrip().endswith(f"dtm: error: {path}: 1 error(s), see above")


def test_unparsable_module(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "bad.dtm"
    path.write_text("dtm 1.0\nmodule m\nentry func @f() -> () {\n  %x = frob\n  return\n}\n")
    code, _, err = dtm(capsys, "run", str(path), "--sim", "1")
    assert code == 1
    assert f"{path}:4:8: parse error: unknown op 'frob'" in err


def test_missing_module_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = dtm(capsys, "run", str(tmp_path / "none.dtm"), "--sim", "1")
    assert code == 2
    one_line_error(err)


# --- byte counts and store parameters --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bytes_"), [("1K", 1024), ("1.5KiB", 1536), ("2kb", 2048), ("1500", 1500)]
)
def test_byte_counts(capsys: pytest.CaptureFixture[str], text: str, bytes_: int) -> None:
    code, _, err = dtm(capsys, "explain", TP_MLP, "--max-bytes-per-rank", text)
    assert code == 1
    assert f"({bytes_} bytes)" in one_line_error(err)


@pytest.mark.parametrize("text", ["-1", "lots", "", "12Q"])
def test_bad_byte_counts(capsys: pytest.CaptureFixture[str], text: str) -> None:
    code, _, err = dtm(capsys, "explain", TP_MLP, "--max-bytes-per-rank", text)
    assert code == 2
    assert "--max-bytes-per-rank" in one_line_error(err)


def test_infinite_byte_count(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = dtm(capsys, "explain", TP_MLP, "--max-bytes-per-rank", "inf")
    assert code == 2
    assert "--max-bytes-per-rank" in one_line_error(err)


CALLS_STATE = str(ROOT / "io" / "vectors" / "ir" / "valid" / "calls_state.dtm")


def test_store_parameter_from_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.save(tmp_path / "data.npy", data)
    out = tmp_path / "out.npz"
    code, _, err = dtm(
        capsys,
        "run",
        CALLS_STATE,
        "--sim",
        "4",
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        "2",
        "-i",
        str(tmp_path / "data.npy"),
        "-o",
        str(out),
    )
    assert code == 0, err
    params, history = run_reference(load(CALLS_STATE), {"data": data}, steps=2)
    with np.load(out) as g:
        np.testing.assert_allclose(g["w"], params["%w"], rtol=RTOL, atol=ATOL)
        assert int(g["n"]) == 2  # the i64 state counted two steps
        np.testing.assert_array_equal(g["result2"], history[-1][2])


def test_store_parameter_without_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = dtm(capsys, "run", CALLS_STATE, "--sim", "4", "--mesh", "dp=2,tp=2")
    assert code == 2
    msg = one_line_error(err)
    assert msg.count("init store") == 1


# --- the run request: refused before anything runs -------------------------------------------

CUDA_ONLY = """dtm 1.0
module cuda_only

mesh @m = [dp=2]

entry func @main(%x: f32[4]{dp} init ones) -> f32[4]{dp} on @m requires [CAP_CUDA] {
  %y = exp %x : f32[4]{dp}
  return %y
}
"""


def test_sim_refuses_a_capability_the_backend_lacks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Under mpirun such a module was refused; --sim ran it on numpy."""
    path = tmp_path / "cuda_only.dtm"
    path.write_text(CUDA_ONLY, encoding="utf-8")
    out = tmp_path / "out.npz"
    code, stdout, err = dtm(capsys, "run", str(path), "--sim", "2", "-o", str(out))
    assert code == 1, err
    msg = one_line_error(err)
    assert "module cuda_only requires CAP_CUDA" in msg and "backend numpy" in msg
    assert stdout == "" and not out.exists()  # nothing ran


RESULT_KEY = """dtm 1.0
module clash

mesh @m = [dp=2]

entry func @main(%x: f32[4]{dp} init ones, %result0: f32[4]{dp} init zeros) -> f32[4]{dp} on @m {
  %y = add %x, %result0 : f32[4]{dp}
  return %y
}
"""


def test_parameter_named_like_a_result_key_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``%result0`` was written over result 0 in the -o file (data loss)."""
    path = tmp_path / "clash.dtm"
    path.write_text(RESULT_KEY, encoding="utf-8")
    out = tmp_path / "out.npz"
    code, stdout, err = dtm(capsys, "run", str(path), "--sim", "2", "-o", str(out))
    assert code == 2, err
    msg = one_line_error(err)
    assert "parameter %result0 of @main" in msg and "'result0'" in msg
    assert stdout == "" and not out.exists()
    # a parameter named like a result that does not exist does not clash
    path.write_text(RESULT_KEY.replace("result0", "result1"), encoding="utf-8")
    code, _, err = dtm(capsys, "run", str(path), "--sim", "2", "-o", str(out))
    assert code == 0, err
    with np.load(out) as g:
        assert sorted(g.files) == ["result0", "result1", "x"]
        np.testing.assert_array_equal(g["result0"], np.ones(4, np.float32))
        np.testing.assert_array_equal(g["result1"], np.zeros(4, np.float32))


def _corrupt(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def _truncated_npz(tmp_path: Path) -> str:
    path = tmp_path / "cut.npz"
    np.savez(path, x=x_input())
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    return str(path)


CORRUPT_INPUTS = {
    "npz-garbage": lambda p: _corrupt(p, "x.npz", b"PK\x03\x04 not a zip archive\n" * 4),
    "npz-truncated": _truncated_npz,
    "npy-garbage": lambda p: _corrupt(p, "x.npy", b"\x93NUMPY garbage"),
    "h5-garbage": lambda p: _corrupt(p, "x.h5", b"not an HDF5 file" * 8),
    "npz-empty": lambda p: _corrupt(p, "x.npz", b""),
}


@pytest.mark.parametrize("make", list(CORRUPT_INPUTS.values()), ids=list(CORRUPT_INPUTS))
def test_unreadable_input_is_one_line_naming_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, make: Callable[[Path], str]
) -> None:
    """A corrupt .npz was an internal-error traceback with --sim."""
    path = make(tmp_path)
    code, stdout, err = dtm(capsys, "run", TP_MLP, "--sim", "2", "-i", path)
    assert code == 2, err
    msg = one_line_error(err)
    assert f"cannot read input file {path}: " in msg
    assert "internal error" not in err and stdout == ""


ARG_ERRORS = {
    "steps-negative": (["--steps", "-1"], "--steps must be >= 1"),
    "resume-without-store": (["--resume"], "need --store DIR"),
    "every-without-store": (["--checkpoint-every", "1"], "need --store DIR"),
    "bad-option": (["--bogus"], "unrecognized arguments"),
    "bad-mesh": (["--mesh", "dp=two"], "is not a positive integer"),
    "bad-bytes": (["--max-bytes-per-rank", "lots"], "not a byte count"),
    "sim-backend": (["--sim", "2", "--backend", "cuda"], "numpy backend only"),
    "sim-resize": (
        ["--sim", "2", "--mesh", "dp=1,tp=2", "--resize-file", "req"],
        "need the MPI runtime",
    ),
}


@pytest.mark.parametrize(("extra", "needle"), list(ARG_ERRORS.values()), ids=list(ARG_ERRORS))
def test_argument_errors_are_agreed(extra: list[str], needle: str) -> None:
    """Decided from the command line alone, so the same on every rank: marked agreed, every
    rank prints its line and exits 2 instead of one rank aborting the others (whose lines
    were then lost)."""
    from dtm_mpi.cli import main
    from dtm_mpi.errors import UsageError

    with pytest.raises(UsageError) as info:
        main(["run", TP_MLP, *extra])
    assert needle in str(info.value)
    assert info.value.agreed


def test_store_that_is_a_file_is_one_clean_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.write_text("not a directory")
    code, stdout, err = dtm(capsys, "run", CALLS_STATE, "--sim", "4", "--store", str(store))
    assert code == 2, err
    msg = one_line_error(err)
    assert f"--store {store} is not a directory" in msg and "Errno" not in msg
    assert stdout == ""


def test_no_message_mentions_an_issue_number(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = dtm(capsys, "run", CALLS_STATE, "--sim", "2", "--mesh", "dp=1,tp=2")
    assert code == 2
    msg = one_line_error(err)
    assert "issue" not in msg and "#" not in msg
    assert "--store DIR" in msg and "-i/--input" in msg


# --- init store --------------------------------------------------------------------------------


def _store_with(tmp_path: Path, **tensors: np.ndarray) -> str:
    """A checkpoint store (one committed checkpoint, step 3) holding ``tensors``, replicated."""
    from mpi4py import MPI

    from dtm_mpi.io.checkpoint import CheckpointStore
    from dtm_mpi.io.ckpt_plan import TensorSpec
    from dtm_mpi.ir.types import DType, Layout, TensorType
    from dtm_mpi.sharding.mesh import MeshShape

    path = str(tmp_path / "store")
    store = CheckpointStore(path, MPI.COMM_SELF, timeout_s=60)
    mesh = MeshShape((("r", 1),))
    items = []
    for name, v in tensors.items():
        t = TensorType(
            DType(str(v.dtype).replace("float", "f")), v.shape, Layout.replicated(v.ndim)
        )
        items.append((TensorSpec(name, t), v))
    store.save(3, mesh, items)
    store.close()
    return path


def test_init_store_from_the_store_with_sim(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = np.random.default_rng(5).standard_normal((4, 8)).astype(np.float32)
    store = _store_with(tmp_path, data=data)
    out = tmp_path / "out.npz"
    code, _, err = dtm(
        capsys,
        "run",
        CALLS_STATE,
        "--sim",
        "4",
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        "2",
        "--store",
        store,
        "-o",
        str(out),
    )
    assert code == 0, err
    params, history = run_reference(load(CALLS_STATE), {"data": data}, steps=2)
    with np.load(out) as g:
        np.testing.assert_array_equal(g["data"], data)
        np.testing.assert_allclose(g["w"], params["%w"], rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(g["result2"], history[-1][2])
    # an input still overrides the store
    other = data + 1
    np.save(tmp_path / "data.npy", other)
    code, _, err = dtm(
        capsys,
        "run",
        CALLS_STATE,
        "--sim",
        "2",
        "--mesh",
        "dp=1,tp=2",
        "--store",
        store,
        "-i",
        str(tmp_path / "data.npy"),
        "-o",
        str(out),
    )
    assert code == 0, err
    with np.load(out) as g:
        np.testing.assert_array_equal(g["data"], other)


def test_init_store_tensor_missing_from_the_store(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = _store_with(tmp_path, other=np.zeros((4, 8), np.float32))
    code, stdout, err = dtm(
        capsys, "run", CALLS_STATE, "--sim", "2", "--mesh", "dp=1,tp=2", "--store", store
    )
    assert code != 0
    msg = one_line_error(err)
    assert "data" in msg and "internal error" not in err
    assert stdout == ""
