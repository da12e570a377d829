"""The models of ``dtm bench train``, each three ways: written with the frontend (the traced
training step dtm runs), written directly in numpy in one process (the compute floor: forward,
hand-derived backward, optimizer), and written in PyTorch (the peer; :mod:`.train_torch`).

* ``digits``: the digits classifier of ``examples/digits.py`` (batch 64, 64 -> 256 -> 10,
  gelu, bias, cross-entropy, AdamW): tiny matmuls, so the cost per op shows.
* ``gpt``: the character GPT of ``examples/gpt.py`` (batch 24, context 64, width 96, 4 heads,
  2 blocks, a 96-symbol vocabulary, AdamW, global-norm clipping at 1.0).
* ``mlp``: a large MLP (batch 512, 1024 -> 4096 -> 1024, gelu, no bias, mean-squared error,
  SGD): a few large matmuls, so the BLAS shows.

The data are synthetic batches of the models' shapes (a pool of four, cycled: the same on
every implementation), as the step's speed does not depend on their values. Every
implementation starts from the same weights: the frontend step's initial state.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "GPT",
    "MLP",
    "MLP_LR",
    "MODELS",
    "SHARDING",
    "ModelDef",
    "initial_state",
    "mlp_numpy_step",
    "numpy_floor",
]

Arr = np.ndarray
POOL = 4
GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


@dataclass(frozen=True)
class ModelDef:
    name: str
    describe: str
    batch: int
    tokens: int  # tokens per sample (1: samples are not sequences)
    build: Callable[..., Any]  # (shard, params: None | "dp": optimizer / parameters sharded)
    data: Callable[[int], dict[str, Arr]]  # batch number -> global arrays by input name

    def batch_data(self, i: int) -> dict[str, Arr]:
        """Batch ``i`` (global arrays by input name): one of a pool of ``POOL``, made once
        (generating the MLP's batch takes longer than some steps)."""
        return _pooled(self.name, i % POOL)


# --- the frontend models -------------------------------------------------------------------

SHARDING: dict[str, tuple[str | None, str | None]] = {
    "dtm": (None, None),
    "dtm-zero": ("dp", None),
    "dtm-zero3": (None, "dp"),
}
"""dtm's configurations: impl -> what :attr:`ModelDef.build` takes (the optimizer's shard axis,
ZeRO-1/2; the parameters' shard axis, ZeRO-3)."""


def _digits_step(shard: str | None = None, params: str | None = None) -> Any:
    from dtm_mpi import frontend as dtm
    from dtm_mpi.frontend import functional as fn

    model = dtm.nn.Sequential(
        dtm.nn.ColumnParallelLinear(64, 256), fn.gelu, dtm.nn.RowParallelLinear(256, 10)
    )

    def loss(m: Any, x: dtm.Tensor, y: dtm.Tensor) -> dtm.Tensor:
        return fn.cross_entropy(m(x), y)

    inputs = {"x": dtm.Input((64, 64), "f32", ("dp", None)), "y": dtm.Input((64,), "i32", ("dp",))}
    return dtm.train_step(
        model,
        loss,
        mesh=dtm.Mesh(dp=2, tp=2),
        inputs=inputs,
        optimizer=dtm.optim.AdamW(lr=3e-3, weight_decay=1e-4, shard=shard),
        name="digits",
        shard_params=params,
    )


GPT = {"vocab": 96, "context": 64, "dim": 96, "heads": 4, "layers": 2, "batch": 24}


def gpt_loss(m: Any, ids: Any, tgt: Any) -> Any:
    """A GPT's next-token loss: the cross-entropy of its logits for every position."""
    from dtm_mpi.frontend import functional as fn

    logits = m(ids)
    return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def _gpt_step(shard: str | None = None, params: str | None = None) -> Any:
    from dtm_mpi import frontend as dtm

    g = GPT
    model = dtm.nn.GPT(g["vocab"], g["context"], g["dim"], g["heads"], g["layers"])
    spec = dtm.Input((g["batch"], g["context"]), "i32", ("dp", None))
    return dtm.train_step(
        model,
        gpt_loss,
        mesh=dtm.Mesh(dp=2, tp=2),
        inputs={"ids": spec, "tgt": spec},
        clip_norm=1.0,
        optimizer=dtm.optim.AdamW(lr=3e-3, weight_decay=0.01, shard=shard),
        name="gpt",
        shard_params=params,
    )


MLP = {"batch": 512, "n_in": 1024, "hidden": 4096}
MLP_LR = 0.01


def _mlp_step(shard: str | None = None, params: str | None = None) -> Any:
    from dtm_mpi import frontend as dtm
    from dtm_mpi.frontend import functional as fn

    m = MLP
    model = dtm.nn.Sequential(
        dtm.nn.ColumnParallelLinear(m["n_in"], m["hidden"], bias=False),
        fn.gelu,
        dtm.nn.RowParallelLinear(m["hidden"], m["n_in"], bias=False),
    )

    def loss(mod: Any, x: dtm.Tensor, t: dtm.Tensor) -> dtm.Tensor:
        d: dtm.Tensor = mod(x) - t
        return (d * d).mean()

    spec = dtm.Input((m["batch"], m["n_in"]), "f32", ("dp", None))
    return dtm.train_step(
        model,
        loss,
        mesh=dtm.Mesh(dp=2, tp=2),
        inputs={"x": spec, "t": spec},
        optimizer=dtm.optim.SGD(MLP_LR, shard=shard),
        name="mlp",
        shard_params=params,
    )


def _digits_data(i: int) -> dict[str, Arr]:
    rng = np.random.default_rng([7, i])
    return {
        "x": rng.random((64, 64), dtype=np.float32),
        "y": rng.integers(0, 10, 64).astype(np.int32),
    }


def _gpt_data(i: int) -> dict[str, Arr]:
    rng = np.random.default_rng([8, i])
    ids = rng.integers(0, GPT["vocab"], (GPT["batch"], GPT["context"] + 1)).astype(np.int32)
    return {"ids": np.ascontiguousarray(ids[:, :-1]), "tgt": np.ascontiguousarray(ids[:, 1:])}


def _mlp_data(i: int) -> dict[str, Arr]:
    rng = np.random.default_rng([9, i])
    shape = (MLP["batch"], MLP["n_in"])
    return {
        "x": rng.standard_normal(shape, dtype=np.float32),
        "t": rng.standard_normal(shape, dtype=np.float32),
    }


_DIGITS = ModelDef(
    "digits", "digits MLP 64->256->10, batch 64, AdamW", 64, 1, _digits_step, _digits_data
)
_GPT = ModelDef(
    "gpt",
    "GPT 2 blocks, width 96, 4 heads, context 64, batch 24, AdamW + clipping",
    GPT["batch"],
    GPT["context"],
    _gpt_step,
    _gpt_data,
)
_MLP = ModelDef(
    "mlp", "MLP 1024->4096->1024, batch 512, SGD", MLP["batch"], 1, _mlp_step, _mlp_data
)
MODELS: dict[str, ModelDef] = {m.name: m for m in (_DIGITS, _GPT, _MLP)}


@functools.cache
def _pooled(model: str, i: int) -> dict[str, Arr]:
    out = MODELS[model].data(i)
    for a in out.values():
        a.flags.writeable = False
    return out


def initial_state(step: Any) -> dict[str, Arr]:
    """The traced step's initial state (weights and optimizer state) as global arrays by
    name: what every implementation starts from."""
    from dtm_mpi.plan.program import compile_plan, mesh_for
    from dtm_mpi.runtime.simulate import initial_blocks

    plan = compile_plan(step.module, mesh_for(step.module, 1, {"dp": 1, "tp": 1}))
    names = [p.name.lstrip("%") for p in plan.entry_plan.function.params]
    blocks = initial_blocks(plan, 0, {}, fed=step.inputs)
    return {k: b for k, b in zip(names, blocks, strict=True) if k not in step.inputs}


# --- the numpy floors ----------------------------------------------------------------------


def _gelu_fwd(h: Arr) -> tuple[Arr, Arr]:
    th = np.tanh(np.float32(GELU_C) * (h + np.float32(GELU_A) * (h * h * h)))
    return 0.5 * h * (1.0 + th), th


def _gelu_bwd(h: Arr, th: Arr) -> Arr:
    return 0.5 * (1.0 + th) + 0.5 * h * (1.0 - th * th) * np.float32(GELU_C) * (  # type: ignore[no-any-return]
        1.0 + np.float32(3 * GELU_A) * h * h
    )


class _AdamW:
    """AdamW as the frontend's optimizer writes it, in place."""

    def __init__(
        self,
        params: dict[str, Arr],
        lr: float,
        wd: float,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
    ) -> None:
        self.lr, self.wd, self.b1, self.b2, self.eps = lr, wd, b1, b2, eps
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0

    def update(self, params: dict[str, Arr], grads: dict[str, Arr]) -> None:
        self.t += 1
        b1, b2 = self.b1, self.b2
        bc1, bc2 = 1.0 - b1**self.t, 1.0 - b2**self.t
        for k, p in params.items():
            g = grads[k]
            m, v = self.m[k], self.v[k]
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * (g * g)
            step = (m / bc1) / (np.sqrt(v / bc2) + self.eps)
            if self.wd:
                step += self.wd * p
            np.subtract(p, self.lr * step, out=p)


def _cross_entropy(logits: Arr, labels: Arr) -> tuple[float, Arr]:
    """Mean cross-entropy of ``logits`` [N, C] and its gradient."""
    n = logits.shape[0]
    s = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(s)
    se = e.sum(axis=1, keepdims=True)
    rows = np.arange(n)
    loss = float(np.mean(np.log(se[:, 0]) - s[rows, labels]))
    grad = e / se
    grad[rows, labels] -= 1.0
    grad *= np.float32(1.0 / n)
    return loss, grad


class DigitsFloor:
    def __init__(self, state: dict[str, Arr]) -> None:
        self.p = {
            k: state[k].copy()
            for k in ("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias")
        }
        self.opt = _AdamW(self.p, 3e-3, 1e-4)

    def step(self, batch: dict[str, Arr]) -> float:
        p = self.p
        x, y = batch["x"], batch["y"]
        h = x @ p["layers.0.weight"] + p["layers.0.bias"]
        a, th = _gelu_fwd(h)
        logits = a @ p["layers.1.weight"] + p["layers.1.bias"]
        loss, gl = _cross_entropy(logits, y)
        grads = {"layers.1.weight": a.T @ gl, "layers.1.bias": gl.sum(axis=0)}
        gh = (gl @ p["layers.1.weight"].T) * _gelu_bwd(h, th)
        grads["layers.0.weight"] = x.T @ gh
        grads["layers.0.bias"] = gh.sum(axis=0)
        self.opt.update(p, grads)
        return loss


class MlpFloor:
    def __init__(self, state: dict[str, Arr]) -> None:
        self.w1 = state["layers.0.weight"].copy()
        self.w2 = state["layers.1.weight"].copy()

    def step(self, batch: dict[str, Arr]) -> float:
        return mlp_numpy_step(batch["x"], batch["t"], self.w1, self.w2, MLP_LR)


def mlp_numpy_step(x: Arr, t: Arr, w1: Arr, w2: Arr, lr: float) -> float:
    """The MLP's training step (``x @ w1``, gelu, ``@ w2``, mean-squared error against
    ``t``, SGD) written directly in numpy; updates ``w1`` and ``w2`` in place."""
    h = x @ w1
    a, th = _gelu_fwd(h)
    d = a @ w2 - t
    loss = float(np.mean(d * d))
    gy = d * np.float32(2.0 / d.size)
    gw2 = a.T @ gy
    gw1 = x.T @ ((gy @ w2.T) * _gelu_bwd(h, th))
    w1 -= np.float32(lr) * gw1
    w2 -= np.float32(lr) * gw2
    return loss


def _ln_fwd(x: Arr, g: Arr, b: Arr, eps: float = 1e-5) -> tuple[Arr, tuple[Arr, Arr]]:
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    r = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + np.float32(eps))
    xh = xc * r
    return xh * g + b, (xh, r)


def _ln_bwd(dy: Arr, g: Arr, cache: tuple[Arr, Arr]) -> tuple[Arr, Arr, Arr]:
    xh, r = cache
    dxh = dy * g
    dx = r * (dxh - dxh.mean(axis=-1, keepdims=True) - xh * (dxh * xh).mean(axis=-1, keepdims=True))
    lead = tuple(range(dy.ndim - 1))
    return dx, (dy * xh).sum(axis=lead), dy.sum(axis=lead)


class GptFloor:
    """The GPT's step as one would write it in numpy: each attention projection one GEMM over
    all heads (``[D, D]`` weights, head ``i`` in columns ``i E ..``)."""

    def __init__(self, state: dict[str, Arr]) -> None:
        names = [k for k in state if not k.startswith("opt.")]
        self.p = {k: state[k].copy() for k in names}
        self.opt = _AdamW(self.p, 3e-3, 0.01)
        c = GPT["context"]
        self.mask = np.tril(np.ones((c, c), dtype=bool))

    def step(self, batch: dict[str, Arr]) -> float:
        p, g = self.p, {k: np.zeros_like(v) for k, v in self.p.items()}
        ids, tgt = batch["ids"], batch["tgt"]
        bsz, t = ids.shape
        d, h = GPT["dim"], GPT["heads"]
        e = d // h
        scale = np.float32(1.0 / math.sqrt(e))
        x = p["tok.weight"][ids] + p["pos"][:t]
        caches = []
        for i in range(GPT["layers"]):
            pre = f"blocks.{i}."
            a_in, c1 = _ln_fwd(x, p[pre + "ln1.weight"], p[pre + "ln1.bias"])
            qkv = []
            for w in ("wq", "wk", "wv"):
                qkv.append(
                    (a_in @ p[pre + "attn." + w]).reshape(bsz, t, h, e).transpose(0, 2, 1, 3)
                )
            q, k, v = qkv
            s = np.where(self.mask, (q @ k.transpose(0, 1, 3, 2)) * scale, np.float32(-1e9))
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            pr = s / s.sum(axis=-1, keepdims=True)
            o = (pr @ v).transpose(0, 2, 1, 3).reshape(bsz, t, h * e)
            x1 = x + o @ p[pre + "attn.wo"] + p[pre + "attn.bo"]
            m_in, c2 = _ln_fwd(x1, p[pre + "ln2.weight"], p[pre + "ln2.bias"])
            u = m_in @ p[pre + "mlp.up.weight"] + p[pre + "mlp.up.bias"]
            gu, th = _gelu_fwd(u)
            x2 = x1 + gu @ p[pre + "mlp.down.weight"] + p[pre + "mlp.down.bias"]
            caches.append((a_in, c1, q, k, v, pr, o, m_in, c2, u, gu, th))
            x = x2
        xf, cf = _ln_fwd(x, p["ln.weight"], p["ln.bias"])
        logits = xf.reshape(bsz * t, d) @ p["head.weight"]
        loss, gl = _cross_entropy(logits, tgt.reshape(-1))
        g["head.weight"] = xf.reshape(bsz * t, d).T @ gl
        dx, g["ln.weight"], g["ln.bias"] = _ln_bwd(
            (gl @ p["head.weight"].T).reshape(bsz, t, d), p["ln.weight"], cf
        )
        for i in reversed(range(GPT["layers"])):
            pre = f"blocks.{i}."
            a_in, c1, q, k, v, pr, o, m_in, c2, u, gu, th = caches[i]
            # MLP
            flat = dx.reshape(-1, d)
            g[pre + "mlp.down.weight"] = gu.reshape(-1, 4 * d).T @ flat
            g[pre + "mlp.down.bias"] = flat.sum(axis=0)
            du = (dx @ p[pre + "mlp.down.weight"].T) * _gelu_bwd(u, th)
            g[pre + "mlp.up.weight"] = m_in.reshape(-1, d).T @ du.reshape(-1, 4 * d)
            g[pre + "mlp.up.bias"] = du.reshape(-1, 4 * d).sum(axis=0)
            dm, g[pre + "ln2.weight"], g[pre + "ln2.bias"] = _ln_bwd(
                du @ p[pre + "mlp.up.weight"].T, p[pre + "ln2.weight"], c2
            )
            dx = dx + dm
            # attention
            flat = dx.reshape(-1, d)
            g[pre + "attn.wo"] = o.reshape(-1, h * e).T @ flat
            g[pre + "attn.bo"] = flat.sum(axis=0)
            do = (dx @ p[pre + "attn.wo"].T).reshape(bsz, t, h, e).transpose(0, 2, 1, 3)
            dpr = do @ v.transpose(0, 1, 3, 2)
            dv = pr.transpose(0, 1, 3, 2) @ do
            ds = pr * (dpr - (dpr * pr).sum(axis=-1, keepdims=True)) * scale
            dq = ds @ k
            dk = ds.transpose(0, 1, 3, 2) @ q
            da = np.zeros_like(a_in)
            a2 = a_in.reshape(-1, d)
            for w, dw in (("wq", dq), ("wk", dk), ("wv", dv)):
                dflat = dw.transpose(0, 2, 1, 3).reshape(-1, h * e)
                g[pre + "attn." + w] = a2.T @ dflat
                da += (dflat @ p[pre + "attn." + w].T).reshape(bsz, t, d)
            dl, g[pre + "ln1.weight"], g[pre + "ln1.bias"] = _ln_bwd(da, p[pre + "ln1.weight"], c1)
            dx = dx + dl
        g["pos"][:t] = dx.sum(axis=0)
        np.add.at(g["tok.weight"], ids.reshape(-1), dx.reshape(-1, d))
        norm = math.sqrt(sum(float(np.vdot(v, v)) for v in g.values()))
        clip = min(1.0, 1.0 / (norm + 1e-6))
        if clip < 1.0:
            for grad in g.values():
                np.multiply(grad, np.float32(clip), out=grad)
        self.opt.update(p, g)
        return loss


_FLOORS: dict[str, Callable[[dict[str, Arr]], Any]] = {
    "digits": DigitsFloor,
    "gpt": GptFloor,
    "mlp": MlpFloor,
}


def numpy_floor(model: str, state: dict[str, Arr]) -> Any:
    """The model's step written directly in numpy, from ``state``: ``.step(batch) -> loss``
    (updates its weights in place)."""
    return _FLOORS[model](state)
