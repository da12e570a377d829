"""What a training run reports beside its metrics: throughput, model FLOPs utilisation (MFU)
and memory, each step, in the progress line, :attr:`FitResult.timings
<dtm_mpi.frontend.fit.FitResult.timings>` and a JSON-lines metrics file
(``fit(metrics_file=...)``, ``examples/llama.py --metrics FILE``), which ``dtm plot metrics``
draws.

* **tokens/s**: the tokens of a step (the elements of its first integer fed input: ``B x T``
  for token ids; else its rows) over the step's wall time on rank 0 (the time between two
  steps' reports: the step, its feeding, and a checkpoint where one is saved).
* **MFU**: the step's model FLOPs over the time, over the peak. The FLOPs are *counted* from
  the traced step's IR, not estimated: every op with a FLOP count in its registry entry
  (:attr:`~dtm_mpi.ir.registry.OpDef.flops`: the contractions, ``2 M N K`` for a matmul)
  over the global shapes, forward and backward, so for a transformer they are torchtitan's
  ``6 N`` per token plus the attention's ``12 L H d T`` (its score and value products), with
  the output projection counted as it runs. Deterministic mode's exact sums and the backward's
  recomputation are not model FLOPs and are not counted. The peak (:func:`peak_flops`): on
  the CPU, this machine's measured GEMM rate in the step's dtype (the best provider's
  ``large`` class of :mod:`dtm_mpi.kernels.gemm`, measured once per machine at one thread)
  times the ranks (simulated ranks: times the cores they can use, at most); on a GPU, the
  device's dense peak from :data:`GPU_PEAKS` for the dtype.
* **memory**: rank 0's peak resident set (``getrusage``), in GiB; on a GPU its memory pool's
  bytes in use as well.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.event_file import EventWriter

if TYPE_CHECKING:
    from dtm_mpi.frontend.trace import TracedStep
    from dtm_mpi.ir.nodes import Function, Module, Op

__all__ = [
    "GPU_PEAKS",
    "PLOTTED",
    "Peak",
    "RunMeter",
    "StepCost",
    "module_flops",
    "peak_flops",
    "plot_metrics",
    "read_metrics",
    "step_cost",
]

GPU_PEAKS: dict[str, dict[str, float]] = {
    # dense (no sparsity) peak FLOP/s per device, from the vendors' data sheets
    "H200": {"bf16": 989e12, "f16": 989e12, "f32": 67e12, "f64": 67e12},
    "H100": {"bf16": 989e12, "f16": 989e12, "f32": 67e12, "f64": 67e12},
    "A100": {"bf16": 312e12, "f16": 312e12, "f32": 19.5e12, "f64": 19.5e12},
    "MI300X": {"bf16": 1307e12, "f16": 1307e12, "f32": 163.4e12, "f64": 163.4e12},
    "MI250X": {"bf16": 383e12, "f16": 383e12, "f32": 95.7e12, "f64": 95.7e12},
}
"""Peak FLOP/s by device name (a substring of the name the runtime reports) and dtype."""


@dataclass(frozen=True, slots=True)
class StepCost:
    """What one step of a traced step computes: ``tokens`` (or samples) and model ``flops``
    (all ranks together), and the dtype its contractions run in."""

    tokens: int
    flops: int
    dtype: str


def _counted(f: Function) -> Iterator[tuple[Op, int, str]]:
    """Each op of ``f`` with its FLOPs (0 where its registry entry counts none) and its first
    operand's dtype, in order: the one walk over a function's types the counts share."""
    from dtm_mpi.ir.registry import OPS

    types = {p.name: p.type for p in f.params}
    for op in f.body:
        fn = OPS[op.name].flops
        operands = [types[n] for n in op.operands]
        n = fn(operands, op.result_types) if fn is not None else 0
        yield op, n, operands[0].dtype.value if operands else ""
        types.update(zip(op.results, op.result_types, strict=True))


def _function_flops(module: Module, f: Function, seen: dict[str, int]) -> int:
    from dtm_mpi.ir.registry import OPS, OpKind

    if f.name in seen:
        return seen[f.name]
    total = 0
    for op, n, _ in _counted(f):
        callee = (
            module.function(str(op.attr("callee"))) if OPS[op.name].kind is OpKind.CALL else None
        )
        if callee is not None:
            total += _function_flops(module, callee, seen)
        total += n
    seen[f.name] = total
    return total


def module_flops(module: Module) -> int:
    """The floating-point operations of one run of ``module``'s entry function (the global
    shapes; a call counts its callee's), from the ops' registry entries."""
    entry = module.entry
    if entry is None:
        raise UsageError(f"module {module.name} has no entry function")
    return _function_flops(module, entry, {})


def _contraction_dtype(module: Module) -> str:
    """The dtype of the step's largest contraction (what its FLOPs run in)."""
    best, dtype = 0, "f32"
    for f in module.functions:
        for _, n, first in _counted(f):
            if n > best:
                best, dtype = n, first
    return dtype


def step_cost(step: TracedStep) -> StepCost:
    """The tokens and model FLOPs of one step of ``step`` (module doc)."""
    tokens = 1
    for name in step.inputs:
        t = step.input_type(name)
        if not t.dtype.is_float and t.shape:
            tokens = math.prod(t.shape)
            break
    else:
        if step.inputs and step.input_type(step.inputs[0]).shape:
            tokens = step.input_type(step.inputs[0]).shape[0]
    # model FLOPs: the step without recomputation's repeats (its identity, where it has one)
    flops = module_flops(step.identity if step.identity is not None else step.module)
    return StepCost(tokens, flops, _contraction_dtype(step.module))


@dataclass(frozen=True, slots=True)
class Peak:
    """The peak FLOP/s MFU divides by, and where it comes from (shown with the figure)."""

    flops_per_s: float
    source: str


def peak_flops(dtype: str, backend: str, ranks: int, *, simulated: bool = False) -> Peak:
    """The job's peak FLOP/s for contractions in ``dtype`` on ``backend`` over ``ranks``
    ranks (module doc)."""
    if backend in ("cuda", "hip"):
        return _gpu_peak(dtype, ranks)
    from dtm_mpi.kernels.gemm import cached_choice

    want = "float64" if dtype == "f64" else "float32"  # bf16 and f16 compute in float32
    rates = [
        gflops for d, cls, _, gflops in cached_choice().measured if d == want and cls == "large"
    ]
    if not rates:
        raise UsageError(f"no measured GEMM rate for {want} on this machine (dtm info shows them)")
    per_rank = max(rates) * 1e9
    used = min(ranks, os.cpu_count() or 1) if simulated else ranks
    return Peak(
        per_rank * used,
        f"measured {want} GEMM {per_rank / 1e9:.1f} GFLOP/s per rank x {used}",
    )


def _gpu_peak(dtype: str, ranks: int) -> Peak:
    import cupy  # the GPU backend's: present, or the run would have failed before

    name = str(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            per = peaks.get(dtype, peaks["f32"])
            return Peak(per * ranks, f"{key} {dtype} dense peak {per / 1e12:.0f} TFLOP/s x {ranks}")
    raise UsageError(
        f"no peak FLOP/s for GPU {name!r} in dtm_mpi's table ({', '.join(GPU_PEAKS)}): MFU "
        "cannot be computed"
    )


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux


class RunMeter:
    """Rank 0's measure of each step: wall time, tokens/s, MFU, peak memory; each step's
    figures with its metrics written as one JSON line to ``metrics_file`` (flushed: a killed
    run keeps every line it wrote; a resumed run appends) and as scalars to a TensorBoard
    event file in the directory ``tensorboard`` (:mod:`~dtm_mpi.frontend.event_file`)."""

    def __init__(
        self,
        cost: StepCost,
        peak: Peak | None,
        metrics_file: str | os.PathLike[str] | None = None,
        tensorboard: str | os.PathLike[str] | None = None,
    ) -> None:
        self.cost, self.peak = cost, peak
        self.t = time.perf_counter()
        self.out: TextIO | None = None
        self.events = EventWriter(tensorboard) if tensorboard is not None else None
        if metrics_file is not None:
            path = Path(metrics_file)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.out = path.open("a", encoding="utf-8")
            except OSError as exc:
                raise UsageError(f"metrics file {path}: {exc.strerror or exc}") from None

    def step(self, i: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """The figures of step ``i`` (reported now), and its line in the metrics file."""
        now = time.perf_counter()
        dt, self.t = max(now - self.t, 1e-9), now
        got = {
            "step_s": dt,
            "tokens_per_s": self.cost.tokens / dt,
            "rss_gib": _rss_gib(),
        }
        if self.peak is not None:
            got["mfu"] = self.cost.flops / dt / self.peak.flops_per_s
        figures = {**{k: float(v) for k, v in metrics.items()}, **got}
        if self.out is not None:
            self.out.write(json.dumps({"step": i, **figures}) + "\n")
            self.out.flush()
        if self.events is not None:
            self.events.scalars(i, figures)
        return got

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None
        if self.events is not None:
            self.events.close()
            self.events = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a metrics file (one error naming the file and line where one is not a
    JSON object with a step)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{p}: no such metrics file") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{p}:{n}: not a JSON line ({exc.msg})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("step"), int):
            raise UsageError(f"{p}:{n}: a metrics line is a JSON object with an integer step")
        out.append(doc)
    if not out:
        raise UsageError(f"{p}: no metrics lines")
    return out


PLOTTED = ("loss", "lr", "tokens_per_s", "mfu")
"""The curves ``dtm plot metrics`` draws, where the file has them (one panel each)."""


def plot_metrics(
    paths: list[str | Path], out: str | Path, keys: tuple[str, ...] = PLOTTED
) -> list[str]:
    """Draw ``keys`` of the metrics files ``paths`` (one curve per file, over the step) to
    the PNG ``out``; returns the keys drawn. matplotlib (the ``train`` extra) draws it."""
    runs = [(Path(p), read_metrics(p)) for p in paths]
    shown = [k for k in keys if any(k in line for _, lines in runs for line in lines)]
    if not shown:
        raise UsageError(
            f"the metrics files have none of {', '.join(keys)} (they have "
            f"{', '.join(sorted({k for _, lines in runs for line in lines for k in line}))})"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UsageError(f"dtm plot needs matplotlib (the 'train' extra): {exc}") from None
    fig, axes = plt.subplots(len(shown), 1, figsize=(7, 2.6 * len(shown)), squeeze=False)
    for ax, key in zip(axes[:, 0], shown, strict=True):
        for path, lines in runs:
            pts = [(line["step"], line[key]) for line in lines if key in line]
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], label=path.name, lw=1.2)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if key == "loss" and len(runs) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:
        raise UsageError(f"{out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return shown
