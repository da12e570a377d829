"""``dtm bench train`` and ``dtm bench ops``: the compute floors and the PyTorch peer train the
same models as the frontend's steps (same losses and weights from the same start), the
benchmark's table, CSV and plot, and the small-op chain (its result checked against numpy).
Timings are not asserted: speed is what the benchmarks report."""

from __future__ import annotations

import csv
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.bench.ops import run_ops_bench
from dtm_mpi.bench.train import configs_for, run_train_bench
from dtm_mpi.bench.train_models import MODELS, initial_state, numpy_floor
from dtm_mpi.errors import UsageError
from dtm_mpi.runtime.simulate import run_simulated
from dtm_mpi.runtime.step_loop import RunHooks
from tests.mpi_env import mpirun_env

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _dtm_run(
    model: str, steps: int, ranks: int, mesh: dict[str, int]
) -> tuple[list[float], dict[str, np.ndarray]]:
    spec = MODELS[model]
    step = spec.build()
    losses: list[float] = []

    def feed(s: int, regions: dict[str, tuple[slice, ...]]) -> dict[str, np.ndarray]:
        data = spec.batch_data(s)
        return {k: data[k][r] for k, r in regions.items()}

    def on_step(s: int, rank: int, metrics: dict[str, float]) -> None:
        if rank == 0:
            losses.append(metrics["loss"])

    hooks = RunHooks(feed, tuple(step.inputs), on_step=on_step, metric_names=tuple(step.metrics))
    res = run_simulated(
        step.module, ranks, binding=mesh, inputs=initial_state(step), steps=steps, hooks=hooks
    )
    return losses, res.params


@pytest.mark.parametrize(
    ("model", "ranks", "mesh"),
    [
        ("digits", 2, {"dp": 2, "tp": 1}),
        ("mlp", 2, {"dp": 1, "tp": 2}),
        ("gpt", 1, {"dp": 1, "tp": 1}),
    ],
)
def test_the_numpy_floor_trains_the_same_model_as_the_frontend_step(
    model: str, ranks: int, mesh: dict[str, int]
) -> None:
    steps = 3
    losses, params = _dtm_run(model, steps, ranks, mesh)
    floor = numpy_floor(model, initial_state(MODELS[model].build()))
    mine = [floor.step(MODELS[model].batch_data(s)) for s in range(steps)]
    np.testing.assert_allclose(mine, losses, rtol=2e-5)
    weights = (
        floor.p
        if hasattr(floor, "p")
        else {"layers.0.weight": floor.w1, "layers.1.weight": floor.w2}
    )
    for k, w in weights.items():
        # Adam's first steps move each weight by about lr x the sign of its gradient: a
        # gradient near zero whose sign float reassociation flips lands 2 lr away, so a few
        # in a thousand may differ by more; every other weight agrees to 1e-3 of the scale
        scale = float(np.max(np.abs(params[k])))
        off = np.abs(w - params[k]) > 1e-3 * scale
        assert int(off.sum()) <= max(1, off.size // 1000), (k, int(off.sum()))


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (the optional 'bench' extra)")
@pytest.mark.parametrize("model", ["digits", "gpt", "mlp"])
def test_the_torch_peer_trains_the_same_model(model: str) -> None:
    from dtm_mpi.bench.train_torch import TorchPeer, torch_module

    torch_module().set_num_threads(1)
    steps = 3
    losses, _ = _dtm_run(model, steps, 1, {"dp": 1, "tp": 1})
    peer = TorchPeer(model, initial_state(MODELS[model].build()), "single", 0, 1)
    mine = [peer.step(MODELS[model].batch_data(s)) for s in range(steps)]
    np.testing.assert_allclose(mine, losses, rtol=1e-4)


def test_configs_cover_every_mesh_shape_and_the_peers() -> None:
    got = {(c.impl, c.ranks, c.mesh) for c in configs_for(["mlp"], [1, 2, 4], torch=True)}
    assert (
        ("dtm", 4, "dp=2,tp=2") in got
        and ("dtm", 4, "dp=1,tp=4") in got
        and ("dtm", 4, "dp=4,tp=1") in got
    )
    assert ("torch-ddp", 2, "dp=2,tp=1") in got and ("torch-tp", 2, "dp=1,tp=2") in got
    # the sharded optimizer where there is a dp to shard over
    assert ("dtm-zero", 2, "dp=2,tp=1") in got and ("dtm-zero", 4, "dp=2,tp=2") in got
    assert ("dtm-zero3", 2, "dp=2,tp=1") in got  # the parameters sharded too
    assert not any(i.startswith("dtm-zero") and m.startswith("dp=1,") for i, _, m in got)
    assert ("numpy", 1, "dp=1,tp=1") in got
    assert not any(c.impl.startswith("torch") for c in configs_for(["gpt"], [1], torch=False))
    assert not any(c.impl == "torch-tp" for c in configs_for(["gpt"], [2], torch=True))
    det = configs_for(["mlp"], [1, 2], torch=False, deterministic=True)
    assert {(c.impl, c.ranks) for c in det if "det" in c.impl} == {
        ("dtm-det", 1),
        ("dtm-det-fast", 1),
    }
    assert not any("det" in c.impl for c in configs_for(["mlp"], [1], torch=False))
    ovl = configs_for(["mlp"], [1, 2], torch=False, overlap=True)
    assert {(c.impl, c.mesh) for c in ovl if c.impl.endswith("-ovl")} == {
        ("dtm-ovl", "dp=2,tp=1"),
        ("dtm-zero-ovl", "dp=2,tp=1"),
        ("dtm-zero3-ovl", "dp=2,tp=1"),
    }  # only where a dp gives gradients to overlap and parameters to prefetch
    assert not any(c.impl.endswith("-ovl") for c in configs_for(["mlp"], [2], torch=False))


def test_an_overlapped_configuration_runs_its_impl_with_dtm_overlap_and_the_others_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dtm_mpi.bench.train import TrainConfig, _command, _env

    monkeypatch.setenv("DTM_OVERLAP", "1")  # the caller's setting: each configuration sets its own
    ovl, plain = (TrainConfig("mlp", i, 2, "dp=2,tp=1") for i in ("dtm-zero3-ovl", "dtm-zero3"))
    assert _env(ovl)["DTM_OVERLAP"] == "1" and _env(plain)["DTM_OVERLAP"] == "0"
    cmd = _command(ovl, 2, 1, "out", ["mpirun"])
    assert cmd[cmd.index("--impl") + 1] == "dtm-zero3"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")
def test_bench_train_measures_every_configuration_and_writes_csv_and_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in mpirun_env().items():
        monkeypatch.setenv(k, v)
    out_csv, png = tmp_path / "train.csv", tmp_path / "train.png"
    report, rows = run_train_bench(
        models=["digits"],
        ranks=[2],
        steps=2,
        warmup=1,
        rounds=1,
        csv_path=str(out_csv),
        plot_path=str(png),
        torch=HAS_TORCH,
        timeout_s=300,
        deterministic=True,
        overlap=True,
    )
    assert all(not r.error for r in rows), report
    impls = {(r.config.impl, r.config.mesh) for r in rows}
    assert {
        ("numpy", "dp=1,tp=1"),
        ("dtm", "dp=1,tp=1"),
        ("dtm", "dp=2,tp=1"),
        ("dtm", "dp=1,tp=2"),
        ("dtm-zero", "dp=2,tp=1"),
        ("dtm-zero3", "dp=2,tp=1"),
        ("dtm-det", "dp=1,tp=1"),  # deterministic mode, full and fast matmul
        ("dtm-det-fast", "dp=1,tp=1"),
        ("dtm-ovl", "dp=2,tp=1"),  # DTM_OVERLAP=1, side by side
        ("dtm-zero-ovl", "dp=2,tp=1"),
        ("dtm-zero3-ovl", "dp=2,tp=1"),
    } <= impls
    losses = [r.loss for r in rows]
    np.testing.assert_allclose(losses, losses[0], rtol=1e-4)  # every implementation, the same model
    for r in rows:
        assert r.step_s > 0 and r.peak_rss > 0
        if r.config.impl == "dtm" and r.config.ranks > 1:
            assert 0.0 < r.comm_share < 1.0, r
    # the sharded optimizer keeps half of AdamW's state per rank at dp=2 (the 10-wide bias
    # splits evenly; 64x256, 256, 256x10 too)
    plain = next(r for r in rows if r.config.impl == "dtm" and r.config.mesh == "dp=2,tp=1")
    assert plain.opt_state == 2 * 4 * (64 * 256 + 256 + 256 * 10 + 10), plain.opt_state
    for impl in ("dtm-zero", "dtm-zero3"):
        zero = next(r for r in rows if r.config.impl == impl)
        assert zero.opt_state * 2 == plain.opt_state, (impl, zero.opt_state)
        assert (
            f"digits: dp=2,tp=1 {impl} optimizer state per rank, unsharded / sharded 2.00" in report
        )
    table = list(csv.DictReader(out_csv.open()))
    assert len(table) == len(rows) and {
        "step_ms",
        "samples_per_s",
        "comm_share",
        "peak_rss_mib",
        "opt_state_kib_per_rank",
        "loss",
    } <= set(table[0])
    assert "targets:" in report and "digits: 1 rank / numpy floor" in report
    assert "digits: 1 rank, deterministic (fast matmul) / plain" in report
    assert "digits: 2 ranks dp=2,tp=1 dtm-zero3, overlapped / not" in report
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_train_refuses_bad_arguments() -> None:
    with pytest.raises(UsageError, match="unknown model"):
        run_train_bench(models=["resnet"])
    with pytest.raises(UsageError, match="--steps"):
        run_train_bench(models=["mlp"], steps=0)
    with pytest.raises(UsageError, match="not found"):
        run_train_bench(models=["mlp"], mpirun=["no-such-launcher"])


def test_bench_ops_reports_the_overhead_per_op_of_a_checked_chain() -> None:
    out = run_ops_bench(ops=60, sizes=(8, 64), repeat=2)
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == [8, 64]
    for r in rows:
        dtm_us, numpy_us, over = (float(x) for x in r[1:4])
        assert dtm_us > 0 and numpy_us > 0 and abs(dtm_us - numpy_us - over) < 0.02
        assert r[4] in ("met", "MISSED")
