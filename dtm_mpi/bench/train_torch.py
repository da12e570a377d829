"""The models of ``dtm bench train`` in PyTorch (the peer), from the same initial weights:
one process, ``DistributedDataParallel`` over gloo (``dp``), and tensor parallel with DTensor
over gloo (``tp``: the MLPs, column- then row-parallel, as Megatron and the frontend split
them). Needs the optional ``bench`` extra (torch); imported only when it runs."""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any

import numpy as np

from dtm_mpi.bench.train_models import GPT, MLP_LR

__all__ = ["TorchPeer", "torch_module"]


def torch_module() -> Any:
    """The torch module (typed as Any: the optional extra may be absent where mypy runs)."""
    torch = importlib.import_module("torch")
    importlib.import_module("torch.distributed")
    return torch


def _t(a: np.ndarray) -> Any:
    return torch_module().from_numpy(np.array(a, copy=True))


def _mlp_module(state: dict[str, np.ndarray], bias: bool) -> Any:
    """``Sequential(Linear, gelu(tanh), Linear)`` with the frontend's ``[in, out]`` weights
    transposed into torch's ``[out, in]``."""
    torch = torch_module()

    w1, w2 = state["layers.0.weight"], state["layers.1.weight"]
    net = torch.nn.Sequential(
        torch.nn.Linear(w1.shape[0], w1.shape[1], bias=bias),
        torch.nn.GELU(approximate="tanh"),
        torch.nn.Linear(w2.shape[0], w2.shape[1], bias=bias),
    )
    with torch.no_grad():
        net[0].weight.copy_(_t(w1.T))
        net[2].weight.copy_(_t(w2.T))
        if bias:
            net[0].bias.copy_(_t(state["layers.0.bias"]))
            net[2].bias.copy_(_t(state["layers.1.bias"]))
    return net


def _gpt_module(
    state: dict[str, np.ndarray],
    dims: dict[str, int] = GPT,
    blocks: tuple[int, int] | None = None,
    first: bool = True,
    last: bool = True,
) -> Any:
    """The frontend's GPT of ``dims`` (``GPT``'s keys), or a pipeline stage of it: its
    ``blocks`` (lo, hi), after the embeddings when ``first``, before the head when ``last``
    (a stage's input and output are then the residual stream)."""
    torch = torch_module()

    base: Any = torch.nn.Module
    lo, hi = blocks if blocks is not None else (0, dims["layers"])

    def mine(key: str) -> bool:
        if key.startswith("blocks."):
            return lo <= int(key.split(".")[1]) < hi
        return first if key in ("tok.weight", "pos") else last

    class Gpt(base):  # type: ignore[misc]
        """The frontend's GPT, parameter for parameter (the projections ``[D, D]``, heads side by side),
        each projection one GEMM over all heads."""

        def __init__(self) -> None:
            super().__init__()
            weights = {k: v for k, v in state.items() if not k.startswith("opt.") and mine(k)}
            self.p = torch.nn.ParameterDict(
                {k.replace(".", "__"): torch.nn.Parameter(_t(v)) for k, v in weights.items()}
            )
            c = dims["context"]
            self.register_buffer("mask", torch.tril(torch.ones(c, c, dtype=torch.bool)))

        def w(self, name: str) -> Any:
            return self.p[name.replace(".", "__")]

        def forward(self, x: Any) -> Any:
            f = torch.nn.functional
            d, h = dims["dim"], dims["heads"]
            e = d // h
            if first:  # token ids in
                x = self.w("tok.weight")[x.long()] + self.w("pos")[: x.shape[1]]
            b, t = x.shape[0], x.shape[1]
            for i in range(lo, hi):
                pre = f"blocks.{i}."
                a = f.layer_norm(
                    x, (d,), self.w(pre + "ln1.weight"), self.w(pre + "ln1.bias"), 1e-5
                )
                wq, wk, wv = (self.w(pre + "attn." + n) for n in ("wq", "wk", "wv"))
                q, k, v = ((a @ w).view(b, t, h, e).transpose(1, 2) for w in (wq, wk, wv))
                s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(e))
                s = s.masked_fill(~self.mask[:t, :t], -1e9)
                o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h * e)
                x = x + o @ self.w(pre + "attn.wo") + self.w(pre + "attn.bo")
                m = f.layer_norm(
                    x, (d,), self.w(pre + "ln2.weight"), self.w(pre + "ln2.bias"), 1e-5
                )
                u = f.gelu(
                    m @ self.w(pre + "mlp.up.weight") + self.w(pre + "mlp.up.bias"),
                    approximate="tanh",
                )
                x = x + u @ self.w(pre + "mlp.down.weight") + self.w(pre + "mlp.down.bias")
            if not last:
                return x
            x = f.layer_norm(x, (d,), self.w("ln.weight"), self.w("ln.bias"), 1e-5)
            return x @ self.w("head.weight")

    return Gpt()


class TorchPeer:
    """One rank's training step of ``model`` in PyTorch: ``mode`` ``single`` (one process),
    ``ddp`` (data parallel over the ``ranks`` processes) or ``tp`` (tensor parallel).
    ``.step(batch) -> loss`` takes the *global* batch and uses this rank's part."""

    def __init__(
        self, model: str, state: dict[str, np.ndarray], mode: str, rank: int, ranks: int
    ) -> None:
        torch = torch_module()
        dist = importlib.import_module("torch.distributed")

        self.model, self.mode, self.rank, self.ranks = model, mode, rank, ranks
        net = _gpt_module(state) if model == "gpt" else _mlp_module(state, bias=model == "digits")
        if mode == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(net)
        elif mode == "tp":
            if model == "gpt":
                raise NotImplementedError("tensor-parallel GPT in torch is not set up here")
            tp = importlib.import_module("torch.distributed.tensor.parallel")
            mesh = importlib.import_module("torch.distributed.device_mesh").init_device_mesh(
                "cpu", (ranks,)
            )
            net = tp.parallelize_module(
                net, mesh, {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()}
            )
        elif mode != "single":
            raise ValueError(f"unknown torch mode {mode!r}")
        self.net = net
        if model == "mlp":
            self.opt = torch.optim.SGD(net.parameters(), lr=MLP_LR)
        else:
            wd = 1e-4 if model == "digits" else 0.01
            self.opt = torch.optim.AdamW(
                net.parameters(), lr=3e-3, weight_decay=wd, eps=1e-8, foreach=False
            )
        self.dist = dist

    def _part(self, a: np.ndarray) -> Any:
        """This rank's rows of a global batch array (data parallel), else all of it."""
        torch = torch_module()

        if self.mode == "ddp":
            n = a.shape[0] // self.ranks
            a = a[self.rank * n : (self.rank + 1) * n]
        with warnings.catch_warnings():  # the batch is read-only, and torch only reads it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(a))

    def step(self, batch: dict[str, np.ndarray]) -> float:
        torch = torch_module()

        f = torch.nn.functional
        self.opt.zero_grad(set_to_none=True)
        if self.model == "mlp":
            d = self.net(self._part(batch["x"])) - self._part(batch["t"])
            loss = (d * d).mean()
        elif self.model == "digits":
            loss = f.cross_entropy(self.net(self._part(batch["x"])), self._part(batch["y"]).long())
        else:
            logits = self.net(self._part(batch["ids"]))
            loss = f.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), self._part(batch["tgt"]).long().reshape(-1)
            )
        loss.backward()
        if self.model == "gpt":
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
        self.opt.step()
        value = loss.detach()
        if self.mode == "ddp":  # the global batch's loss, as the other implementations give
            self.dist.all_reduce(value)
            value /= self.ranks
        return float(value)
