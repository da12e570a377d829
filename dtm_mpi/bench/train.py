"""``dtm bench train``: whole training steps, side by side with the compute floor and the peer.

For each model of :mod:`dtm_mpi.bench.train_models` (``digits``, ``gpt``, ``mlp``), measured in
the same run, each configuration its own process tree (started here, ``mpirun`` for several
ranks), one BLAS thread per process (``OMP_NUM_THREADS=1``, ``OPENBLAS_NUM_THREADS=1``,
``MKL_NUM_THREADS=1``; torch: ``set_num_threads(1)``):

* ``numpy``: the step written directly in numpy in one process (the compute floor);
* ``dtm``: the frontend's traced step in dtm's training loop (``dtm run``'s loop: the step,
  the per-step commit agreement, the data feed) at 1 rank and at every mesh shape of each
  rank count asked for (``dp`` x ``tp``);
* ``dtm-det``, ``dtm-det-fast`` (``--deterministic``): dtm at 1 rank in deterministic mode,
  its matmul's full and fast precision (``DTM_DETERMINISTIC_MATMUL``);
* ``dtm-ovl``, ``dtm-zero-ovl``, ``dtm-zero3-ovl`` (``--overlap``): each multi-rank dtm
  configuration with ``dp > 1`` again with ``DTM_OVERLAP=1`` (allreduces in buckets and the
  gathers of parameters stored sharded prefetched, on each rank's side thread), side by side
  with the same configuration without;
* ``torch``: the same model in PyTorch on CPU, one process, ``DistributedDataParallel`` over
  gloo (``dp``), and tensor parallel with DTensor over gloo (``tp``, the MLPs), where torch is
  installed (the ``bench`` extra; otherwise skipped, and said).

Every configuration runs ``rounds`` times (the order reversed every other round); a round
gives the median step time (a step's time: its slowest rank's), and the table shows the best
round (noise on a shared machine only slows a round down). Also: throughput, the share of
step time in the plan's communication (dtm: its collectives and point-to-point calls, waits
for slower ranks included), the largest peak RSS of a rank, and the last step's loss (all
implementations start from the same weights and data: equal losses say they train the same
model). More ranks than cores are marked oversubscribed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dtm_mpi.bench.train_models import MODELS, SHARDING
from dtm_mpi.errors import UsageError
from dtm_mpi.sharding.mesh import parse_mesh_binding

__all__ = ["TrainConfig", "TrainRow", "configs_for", "run_train_bench"]

TARGET_FLOOR = 1.1  # 1 rank: step time within 1.1x of the numpy floor
TARGET_SPEEDUP = 1.7  # 2 ranks, mlp, dp=2 and tp=2: speedup over 1 rank
TARGET_TORCH_2 = 1.3  # 2 ranks: faster than torch over gloo by this factor
DTM_IMPLS = tuple(SHARDING)  # dtm: plain, optimizer sharded, parameters too
SHARDED_IMPLS = tuple(i for i, axes in SHARDING.items() if any(axes))  # those needing a dp > 1
TARGET_ZERO_SPEEDUP = 1.8  # 2 ranks, mlp, dp=2 with the sharded optimizer: over 1 rank
DETERMINISTIC = {"dtm-det": "full", "dtm-det-fast": "fast"}
"""dtm in deterministic mode (``--deterministic``, 1 rank): impl -> its matmul precision
(``DTM_DETERMINISTIC_MATMUL``)."""
TARGET_DETERMINISTIC = 3.0  # 1 rank, mlp: a deterministic step / a plain one
OVERLAPPED = {f"{impl}-ovl": impl for impl in DTM_IMPLS}
"""dtm with ``DTM_OVERLAP=1`` (``--overlap``): impl -> the worker's impl it runs overlapped."""
DTM_RUNS = (*DTM_IMPLS, *DETERMINISTIC, *OVERLAPPED)  # every configuration that runs dtm's worker


@dataclass(frozen=True)
class TrainConfig:
    model: str
    impl: str  # numpy | dtm | dtm-zero (optimizer sharded) | dtm-zero3 (parameters too) | dtm-det* | *-ovl | torch-*
    ranks: int
    mesh: str  # dp=A,tp=B

    @property
    def label(self) -> str:
        return f"{self.model} {self.impl} {self.ranks} {self.mesh}"


@dataclass
class TrainRow:
    config: TrainConfig
    step_s: float = float("nan")
    comm_share: float = float("nan")
    peak_rss: int = 0
    opt_state: int = -1  # optimizer-state bytes on the rank holding most (-1: not dtm)
    loss: float = float("nan")
    rounds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # rounds that failed: why

    @property
    def error(self) -> str:
        """Why the configuration has no figure: every round failed (the first's error)."""
        return self.failures[0] if self.failures and not self.rounds else ""


def _meshes(ranks: int) -> list[tuple[int, int]]:
    return [
        (d, ranks // d)
        for d in sorted((d for d in range(1, ranks + 1) if ranks % d == 0), reverse=True)
    ]


def configs_for(
    models: Sequence[str],
    ranks: Sequence[int],
    torch: bool,
    deterministic: bool = False,
    overlap: bool = False,
) -> list[TrainConfig]:
    """Every configuration measured: per model, the numpy floor, dtm at each rank count and
    mesh shape, (``deterministic``) dtm's deterministic mode at 1 rank, (``overlap``) each
    multi-rank dtm configuration with ``dp > 1`` overlapped too, and (``torch``) the peer in
    one process and over gloo."""
    out: list[TrainConfig] = []
    for m in models:
        out.append(TrainConfig(m, "numpy", 1, "dp=1,tp=1"))
        if deterministic:
            out += [TrainConfig(m, impl, 1, "dp=1,tp=1") for impl in DETERMINISTIC]
        for n in ranks:
            for dp, tp in _meshes(n):
                out.append(TrainConfig(m, "dtm", n, f"dp={dp},tp={tp}"))
            for dp, tp in _meshes(n):
                if dp > 1:  # something to shard over (and, overlapped, to prefetch)
                    impls = (*SHARDED_IMPLS, *(OVERLAPPED if overlap else ()))
                    out += [TrainConfig(m, i, n, f"dp={dp},tp={tp}") for i in impls]
        if torch:
            out.append(TrainConfig(m, "torch-single", 1, "dp=1,tp=1"))
            for n in ranks:
                if n > 1:
                    out.append(TrainConfig(m, "torch-ddp", n, f"dp={n},tp=1"))
                    if m != "gpt":
                        out.append(TrainConfig(m, "torch-tp", n, f"dp=1,tp={n}"))
    return out


def _rendezvous(out: str) -> str:
    """A path next to ``out`` for torch's file rendezvous, not there yet (a TCP port picked
    here could be taken by another job before the workers bind it)."""
    path = out + ".rendezvous"
    if os.path.exists(path):
        os.remove(path)
    return path


def _env(c: TrainConfig) -> dict[str, str]:
    env = dict(os.environ)
    if c.impl in DETERMINISTIC:
        env["DTM_DETERMINISTIC"] = "1"
        env["DTM_DETERMINISTIC_MATMUL"] = DETERMINISTIC[c.impl]
    env["DTM_OVERLAP"] = "1" if c.impl in OVERLAPPED else "0"
    for k in (
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "VECLIB_MAXIMUM_THREADS",
        "NUMEXPR_NUM_THREADS",
    ):
        env[k] = "1"
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")  # more ranks than cores
    return env


def _command(c: TrainConfig, steps: int, warmup: int, out: str, mpirun: Sequence[str]) -> list[str]:
    py = [sys.executable]
    worker = [
        "-m",
        "dtm_mpi.bench.train_worker",
        "--impl",
        "dtm" if c.impl in DETERMINISTIC else OVERLAPPED.get(c.impl, c.impl),
        "--model",
        c.model,
        "--mesh",
        c.mesh,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--out",
        out,
    ]
    if c.impl in DTM_RUNS:
        return [*mpirun, "-n", str(c.ranks), *py, "-m", "mpi4py", *worker]
    if c.impl in ("torch-ddp", "torch-tp"):
        return [*mpirun, "-n", str(c.ranks), *py, *worker, "--rendezvous", _rendezvous(out)]
    return [*py, *worker]


def _run_one(
    row: TrainRow, steps: int, warmup: int, workdir: Path, mpirun: Sequence[str], timeout_s: float
) -> None:
    """One round of ``row``'s configuration, recorded in ``row`` (or its error)."""
    c = row.config
    out = workdir / f"{c.model}-{c.impl}-{c.ranks}-{c.mesh.replace(',', '_').replace('=', '')}"
    for old in workdir.glob(out.name + ".*"):
        old.unlink()
    cmd = _command(c, steps, warmup, str(out), mpirun)
    try:
        done = subprocess.run(
            cmd, env=_env(c), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        row.failures.append(f"timed out after {timeout_s:.0f} s")
        return
    if done.returncode != 0:
        text = (done.stderr + done.stdout).strip().splitlines()
        said = [ln for ln in text if "rror" in ln or "terminate" in ln or "what()" in ln][:2]
        row.failures.append(f"exit {done.returncode}: {' | '.join(said or text[-3:])}")
        return
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(c.ranks)]
    times = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    comm = [
        max(r["comm"][i] for r in ranks) if ranks[0]["comm"] else float("nan")
        for i in range(len(times))
    ]
    median = statistics.median(times)
    share = statistics.median(comm) / median if ranks[0]["comm"] and median > 0 else float("nan")
    row.rounds.append(median)
    if median <= min(row.rounds):  # the best round's figures
        row.step_s, row.comm_share, row.loss = median, share, float(ranks[0]["losses"][-1])
    row.peak_rss = max(row.peak_rss, *(int(r["rss"]) for r in ranks))
    if "opt_state_bytes" in ranks[0]:
        row.opt_state = max(int(r["opt_state_bytes"]) for r in ranks)


def torch_available() -> str | None:
    """None where torch imports, else why not."""
    try:
        import importlib

        importlib.import_module("torch")
    except Exception as exc:  # ImportError, or a broken install
        return f"torch is not installed ({type(exc).__name__}: {exc}); install the 'bench' extra"
    return None


def run_train_bench(
    models: Sequence[str] = ("digits", "gpt", "mlp"),
    ranks: Sequence[int] = (1, 2),
    steps: int = 8,
    warmup: int = 2,
    rounds: int = 2,
    csv_path: str | None = None,
    plot_path: str | None = None,
    torch: bool = True,
    mpirun: Sequence[str] = ("mpirun",),
    timeout_s: float = 600.0,
    deterministic: bool = False,
    overlap: bool = False,
) -> tuple[str, list[TrainRow]]:
    """Measure every configuration (:func:`configs_for`); returns the printed report and the
    rows (written as CSV to ``csv_path``, plotted to ``plot_path`` as PNG when given)."""
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise UsageError(f"unknown model(s) {', '.join(bad)}; known: {', '.join(MODELS)}")
    if steps < 1 or warmup < 0 or rounds < 1 or not ranks or min(ranks) < 1:
        raise UsageError("need --steps >= 1, --warmup >= 0, --rounds >= 1, ranks >= 1")
    if 1 not in ranks:
        ranks = (1, *ranks)
    why_no_torch = torch_available() if torch else "not asked for (--no-torch)"
    if shutil.which(mpirun[0]) is None:
        raise UsageError(
            f"{mpirun[0]} not found: dtm bench train starts its ranks with it (--mpirun)"
        )
    configs = configs_for(models, sorted(set(ranks)), why_no_torch is None, deterministic, overlap)
    rows = {c: TrainRow(c) for c in configs}
    workdir = Path(tempfile.mkdtemp(prefix="dtm-bench-train-"))
    try:
        for r in range(rounds):
            for c in configs if r % 2 == 0 else configs[::-1]:
                _run_one(rows[c], steps, warmup, workdir, mpirun, timeout_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = list(rows.values())
    report = _report(table, steps, warmup, rounds, why_no_torch)
    if csv_path:
        _write_csv(csv_path, table)
    if plot_path:
        report += "\n" + _plot(plot_path, table)
    return report, table


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


def _find(
    rows: Sequence[TrainRow], model: str, impl: str, ranks: int, mesh: str | None = None
) -> TrainRow | None:
    for r in rows:
        c = r.config
        if (
            c.model == model
            and c.impl == impl
            and c.ranks == ranks
            and (mesh is None or c.mesh == mesh)
            and not r.error
        ):
            return r
    return None


def _derived(rows: Sequence[TrainRow], r: TrainRow) -> tuple[float, float]:
    """(step time / numpy floor, speedup over dtm at 1 rank) of a row."""
    floor = _find(rows, r.config.model, "numpy", 1)
    one = _find(rows, r.config.model, "dtm", 1)
    vs_floor = r.step_s / floor.step_s if floor else float("nan")
    dtm = r.config.impl in DTM_IMPLS or r.config.impl in OVERLAPPED
    speedup = one.step_s / r.step_s if one and dtm else float("nan")
    return vs_floor, speedup


def _report(
    rows: Sequence[TrainRow], steps: int, warmup: int, rounds: int, why_no_torch: str | None
) -> str:
    cores = _cores()
    title = f"dtm bench train: {steps} steps after {warmup} warm-up, best round of {rounds} (round: median step, a step: its slowest rank); one BLAS thread per process; {cores} cores"
    lines = [title]
    if why_no_torch:
        lines.append(f"PyTorch peer skipped: {why_no_torch}")
    head = f"{'model':<7}{'impl':<13}{'ranks':>5} {'mesh':<10}{'step ms':>10}{'x floor':>9}{'speedup':>9}{'samples/s':>11}{'tokens/s':>11}{'comm %':>8}{'RSS MiB':>9}{'opt KiB':>9}{'loss':>10}"
    lines.append(head)
    for r in rows:
        c = r.config
        if r.error:
            lines.append(f"{c.model:<7}{c.impl:<13}{c.ranks:>5} {c.mesh:<10}  failed: {r.error}")
            continue
        vs_floor, speedup = _derived(rows, r)
        spec = MODELS[c.model]
        sps = spec.batch / r.step_s
        tokens = f"{sps * spec.tokens:>11.0f}" if spec.tokens > 1 else f"{'-':>11}"
        over = " (oversubscribed)" if c.ranks > cores else ""
        comm = f"{r.comm_share * 100:>8.1f}" if not math.isnan(r.comm_share) else f"{'-':>8}"
        sp = f"{speedup:>9.2f}" if not math.isnan(speedup) else f"{'-':>9}"
        opt = f"{r.opt_state / 1024:>9.0f}" if r.opt_state >= 0 else f"{'-':>9}"
        lines.append(
            f"{c.model:<7}{c.impl:<13}{c.ranks:>5} {c.mesh:<10}{r.step_s * 1e3:>10.2f}{vs_floor:>9.2f}{sp}{sps:>11.0f}{tokens}{comm}{r.peak_rss / 2**20:>9.0f}{opt}{r.loss:>10.5f}{over}"
        )
        if r.failures:  # some rounds failed: the figure is the others'
            lines.append(f"{'':<7}{len(r.failures)} round(s) failed: {r.failures[0]}")
    lines += _verdicts(rows)
    return "\n".join(lines)


def _verdicts(rows: Sequence[TrainRow]) -> list[str]:
    out = ["targets:"]
    models = list(dict.fromkeys(r.config.model for r in rows))
    for m in models:
        one, floor = _find(rows, m, "dtm", 1), _find(rows, m, "numpy", 1)
        if one and floor:
            ratio = one.step_s / floor.step_s
            out.append(
                f"  {m}: 1 rank / numpy floor {ratio:.2f} (target <= {TARGET_FLOOR}): {'met' if ratio <= TARGET_FLOOR else 'MISSED'}"
            )
        t1 = _find(rows, m, "torch-single", 1)
        if one and t1:
            ratio = t1.step_s / one.step_s
            out.append(
                f"  {m}: 1 rank, torch / dtm {ratio:.2f} (target >= 1.0): {'met' if ratio >= 1.0 else 'MISSED'}"
            )
        for impl, mesh in (("torch-ddp", "dp=2,tp=1"), ("torch-tp", "dp=1,tp=2")):
            t2, d2 = _find(rows, m, impl, 2), _find(rows, m, "dtm", 2, mesh)
            if t2 and d2:
                ratio = t2.step_s / d2.step_s
                out.append(
                    f"  {m}: 2 ranks {mesh}, {impl} / dtm {ratio:.2f} (target >= {TARGET_TORCH_2}): {'met' if ratio >= TARGET_TORCH_2 else 'MISSED'}"
                )
    for m in models:
        for r in rows:
            plain = _find(rows, m, "dtm", r.config.ranks, r.config.mesh)
            sharded = r.config.impl in SHARDED_IMPLS
            if r.config.model == m and sharded and plain and r.opt_state > 0:
                dp = parse_mesh_binding(r.config.mesh)["dp"]
                ratio = plain.opt_state / r.opt_state
                out.append(
                    f"  {m}: {r.config.mesh} {r.config.impl} optimizer state per rank, unsharded / sharded {ratio:.2f} (target {dp}, the dp size: met where within the uneven split)"
                )
    for m in models:
        plain = _find(rows, m, "dtm", 1)
        for impl, precision in DETERMINISTIC.items():
            det = _find(rows, m, impl, 1)
            if plain and det:
                ratio = det.step_s / plain.step_s
                verdict = (
                    f"(target <= {TARGET_DETERMINISTIC:.0f}): {'met' if ratio <= TARGET_DETERMINISTIC else 'MISSED'}"
                    if m == "mlp"
                    else "(the target is the MLP's)"
                )
                out.append(
                    f"  {m}: 1 rank, deterministic ({precision} matmul) / plain {ratio:.2f} {verdict}"
                )
    for r in rows:
        plain_impl = OVERLAPPED.get(r.config.impl)
        if plain_impl is not None and not r.error:
            c = r.config
            plain = _find(rows, c.model, plain_impl, c.ranks, c.mesh)
            if plain:
                out.append(
                    f"  {c.model}: {c.ranks} ranks {c.mesh} {plain_impl}, overlapped / not {r.step_s / plain.step_s:.2f} (below 1: the overlap pays here)"
                )
    one = _find(rows, "mlp", "dtm", 1)
    zero = _find(rows, "mlp", "dtm-zero", 2, "dp=2,tp=1")
    if one and zero:
        sp = one.step_s / zero.step_s
        out.append(
            f"  mlp: 2 ranks dp=2 sharded optimizer, speedup over 1 rank {sp:.2f} (target >= {TARGET_ZERO_SPEEDUP}): {'met' if sp >= TARGET_ZERO_SPEEDUP else 'MISSED'}"
        )
    for mesh in ("dp=2,tp=1", "dp=1,tp=2"):
        two = _find(rows, "mlp", "dtm", 2, mesh)
        if one and two:
            sp = one.step_s / two.step_s
            out.append(
                f"  mlp: 2 ranks {mesh} speedup over 1 rank {sp:.2f} (target >= {TARGET_SPEEDUP}): {'met' if sp >= TARGET_SPEEDUP else 'MISSED'}"
            )
    return out


def _write_csv(path: str, rows: Sequence[TrainRow]) -> None:
    cores = _cores()
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(
            [
                "model",
                "impl",
                "ranks",
                "mesh",
                "step_ms",
                "rounds_ms",
                "vs_numpy_floor",
                "speedup_vs_1_rank",
                "samples_per_s",
                "tokens_per_s",
                "comm_share",
                "peak_rss_mib",
                "opt_state_kib_per_rank",
                "loss",
                "threads_per_rank",
                "oversubscribed",
                "error",
            ]
        )
        for r in rows:
            c = r.config
            spec = MODELS[c.model]
            vs_floor, speedup = _derived(rows, r)
            sps = spec.batch / r.step_s if not math.isnan(r.step_s) else float("nan")
            w.writerow(
                [
                    c.model,
                    c.impl,
                    c.ranks,
                    c.mesh,
                    f"{r.step_s * 1e3:.4f}",
                    " ".join(f"{x * 1e3:.3f}" for x in r.rounds),
                    f"{vs_floor:.4f}",
                    f"{speedup:.4f}",
                    f"{sps:.2f}",
                    f"{sps * spec.tokens:.2f}",
                    f"{r.comm_share:.4f}",
                    f"{r.peak_rss / 2**20:.1f}",
                    f"{r.opt_state / 1024:.1f}" if r.opt_state >= 0 else "",
                    f"{r.loss:.6f}",
                    1,
                    int(c.ranks > cores),
                    r.error or "; ".join(r.failures),
                ]
            )


def _plot(path: str, rows: Sequence[TrainRow]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is not installed ({exc}); install the 'train' extra"
    models = list(dict.fromkeys(r.config.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r.config.model == m and not r.error]
        labels = [
            f"{r.config.impl}\n{r.config.ranks}r {r.config.mesh}"
            if r.config.ranks > 1
            else f"{r.config.impl}\n1r"
            for r in mine
        ]
        colors = [
            "#4c72b0"
            if r.config.impl in DTM_RUNS
            else "#55a868"
            if r.config.impl == "numpy"
            else "#c44e52"
            for r in mine
        ]
        ax.bar(range(len(mine)), [r.step_s * 1e3 for r in mine], color=colors)
        ax.set_xticks(range(len(mine)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("step time (ms), lower is better")
        ax.set_title(MODELS[m].describe, fontsize=8)
    fig.suptitle(
        "dtm bench train: dtm (blue), numpy floor (green), PyTorch (red); one BLAS thread per rank"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
