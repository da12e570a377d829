"""The peer of ``dtm bench pipeline``: ``torch.distributed.pipelining`` over gloo on the same
GPT (the benchmark's weights, parameter for parameter: :func:`~dtm_mpi.bench.train_torch._gpt_module`),
the same stages (blocks cut evenly, stage ``s`` on rank ``s % ranks``), microbatches and
schedule, in the same processes after dtm's runs: ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` (two stages per rank) and, for ``zb-h1``,
``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's zero-bubble schedule that
takes one; it splits the backward into input- and weight-gradient parts as ZB-H1 does).
AdamW, as many threads per rank as dtm's ranks' BLAS. Needs torch (the ``train`` extra)."""

from __future__ import annotations

import importlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtm_mpi.bench.rss import RssPeak

__all__ = ["TorchPipelines", "TorchTiming", "torch_available"]

_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
}


@dataclass(frozen=True, slots=True)
class TorchTiming:
    schedule: str
    ms_per_step: float
    first_loss: float


def torch_available() -> bool:
    try:
        importlib.import_module("torch.distributed.pipelining")
    except ImportError:
        return False
    return True


def _rendezvous_file() -> str:
    """A fresh path for torch's file rendezvous (a TCP port picked here could be taken by
    another job before torch binds it)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="dtm-torch-rdv-")
    os.close(fd)
    os.remove(path)
    return path


class _Run:
    """One schedule's stages, optimizer and step on this rank."""

    def __init__(self, peer: TorchPipelines, name: str) -> None:
        torch, pipelining = peer.torch, peer.pipelining
        from dtm_mpi.bench.train_torch import _gpt_module

        chunks = 2 if name == "interleaved" else 1
        p, rank, layers = peer.p, peer.rank, peer.dims["layers"]
        n = p * chunks
        stages = []
        for k in range(chunks):
            s = rank + k * p
            blocks = (s * layers // n, (s + 1) * layers // n)
            module = _gpt_module(peer.state, peer.dims, blocks, first=s == 0, last=s == n - 1)
            stages.append(pipelining.PipelineStage(module, s, n, torch.device("cpu")))
        cls = getattr(pipelining, _CLASSES[name])
        single = name in ("gpipe", "1f1b")
        self.schedule = cls(
            stages[0] if single else stages, peer.microbatches, loss_fn=peer.loss_fn
        )
        params = [q for st in stages for q in st.submod.parameters()]
        self.opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        self.first = any(st.is_first for st in stages)
        self.last = any(st.is_last for st in stages)
        self.peer = peer

    def step(self) -> list[Any]:
        losses: list[Any] = []
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step(
            *((self.peer.ids,) if self.first else ()),
            **({"target": self.peer.tgt, "losses": losses} if self.last else {}),
        )
        self.opt.step()
        return losses


class TorchPipelines:
    """torch's pipelines on the ranks of ``world`` (collective methods): :meth:`time` each
    schedule, then (after dtm's memory steps, the allocator set to return freed memory)
    :meth:`rss`; :meth:`close` ends torch's process group."""

    def __init__(
        self,
        world: Any,
        state: dict[str, np.ndarray],
        dims: dict[str, int],
        data: dict[str, np.ndarray],
        *,
        microbatches: int,
        threads: int,
    ) -> None:
        from dtm_mpi.bench.train_torch import torch_module

        self.torch = torch = torch_module()
        self.pipelining = importlib.import_module("torch.distributed.pipelining")
        self.world, self.state, self.dims, self.microbatches = world, state, dims, microbatches
        self.rank, self.p = int(world.Get_rank()), int(world.Get_size())
        where = world.bcast(_rendezvous_file() if self.rank == 0 else None, root=0)
        torch.set_num_threads(threads)
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{where}", rank=self.rank, world_size=self.p
        )
        f, vocab = torch.nn.functional, dims["vocab"]

        def loss_fn(logits: Any, tgt: Any) -> Any:
            return f.cross_entropy(logits.reshape(-1, vocab), tgt.reshape(-1).long())

        self.loss_fn = loss_fn
        self.ids = torch.from_numpy(data["ids"].copy())
        self.tgt = torch.from_numpy(data["tgt"].copy())
        self.runs: dict[str, _Run] = {}

    def time(self, name: str, *, steps: int, warmup: int) -> TorchTiming:
        """Schedule ``name``'s median step time (the slowest rank's) and first loss."""
        from mpi4py import MPI

        run = self.runs[name] = _Run(self, name)
        walls: list[float] = []
        first_loss = float("nan")
        for i in range(warmup + steps):
            self.world.Barrier()
            start = time.perf_counter()
            losses = run.step()
            wall = self.world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if i >= warmup:
                walls.append(wall)
            if i == 0:
                mine = (
                    sum(float(x.detach()) for x in losses) / self.microbatches if run.last else None
                )
                first_loss = next(x for x in self.world.allgather(mine) if x is not None)
        return TorchTiming(name, statistics.median(walls) * 1e3, first_loss)

    def rss(self, name: str) -> float:
        """What one more step of ``name`` takes above the process's RSS (MiB, the most of any
        rank)."""
        from mpi4py import MPI

        with RssPeak() as peak:
            self.runs[name].step()
        return float(self.world.allreduce(peak.above, op=MPI.MAX)) / 2**20

    def close(self) -> None:
        self.torch.distributed.destroy_process_group()
