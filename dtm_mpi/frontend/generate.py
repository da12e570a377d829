"""Text generation with a key/value cache: :func:`generate` runs a Llama's decode step
(:meth:`~dtm_mpi.frontend.llm.Llama.decode`, traced once with
:func:`~dtm_mpi.frontend.trace.forward_step`; the caches are its state) one position a step
through :func:`~dtm_mpi.frontend.fit.fit`: first the prompt's tokens, then each chosen token.
The logits of every step come back whole on every rank, where the next token is chosen (the
largest logit, or sampled with a temperature and top-k from a seeded generator: every rank
draws the same), so it runs on simulated ranks and under mpirun on any mesh alike."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtm_mpi.config import get_config
from dtm_mpi.errors import UsageError

__all__ = ["Sampling", "generate"]


@dataclass(frozen=True, slots=True)
class Sampling:
    """``greedy`` (the largest logit; the first of equal ones), else sampling from
    ``softmax(logits / temperature)`` over the ``top_k`` largest (0: all), seeded."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.greedy and not self.temperature > 0:
            raise UsageError(f"--temperature must be > 0; got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0; got {self.top_k}")


def _choose(logits: np.ndarray, how: Sampling, rng: np.random.Generator) -> np.ndarray:
    if how.greedy:
        out: np.ndarray = logits.argmax(-1)
        return out
    z = logits.astype(np.float64) / how.temperature
    if 0 < how.top_k < z.shape[-1]:
        cut = np.sort(z, axis=-1)[:, -how.top_k][:, None]
        z = np.where(z < cut, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])


def generate(
    model: Any,
    weights: Mapping[str, Any],
    prompt: np.ndarray,
    max_new: int,
    *,
    sizes: Mapping[str, int] | None = None,
    sim: int | None = None,
    sampling: Sampling | None = None,
    context: int | None = None,
    eos: int | None = None,
) -> np.ndarray:
    """The ``max_new`` tokens ``[B, max_new]`` after each prompt of ``prompt`` ``[B, P]``
    (int ids), from ``model`` (a :class:`~dtm_mpi.frontend.llm.Llama` laid out for the mesh
    of the axis sizes ``sizes``) with its ``weights``; ``sim`` simulated ranks, else the MPI
    job's (every rank calls it and gets the tokens). A prompt longer than ``context`` (the
    model's positions) less ``max_new`` is an error. With ``eos``, a sequence that chose it
    repeats it."""
    from dtm_mpi.frontend.fit import fit
    from dtm_mpi.frontend.mesh import Mesh
    from dtm_mpi.frontend.step_trace import Input
    from dtm_mpi.frontend.trace import forward_step

    ids = np.asarray(prompt)
    if ids.ndim != 2 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UsageError(
            f"the prompt must be integer ids [B, P] with P >= 1; got {ids.dtype}{list(ids.shape)}"
        )
    if max_new < 1:
        raise UsageError(f"--max-new must be >= 1; got {max_new}")
    b, p = ids.shape
    length = p + max_new
    limit = context or int(getattr(model.config, "max_position_embeddings", length))
    if length > limit:
        raise UsageError(
            f"the prompt ({p} tokens) and --max-new {max_new} need {length} positions; the model has {limit}"
        )
    vocab = int(model.config.vocab_size)
    if ids.min() < 0 or ids.max() >= vocab:
        raise UsageError(f"the prompt has ids outside the vocabulary 0 .. {vocab - 1}")
    how = sampling or Sampling()
    sizes = dict(sizes or {"dp": 1, "tp": 1})
    batch = "dp" if sizes.get("dp", 1) > 1 else None
    step = forward_step(
        model,
        lambda m, ids, pos: m.decode(ids, pos, length),
        mesh=Mesh("m", **sizes),
        inputs={"ids": Input((b, 1), "i32", (batch, None)), "pos": Input((1,), "i32")},
        name="decode",
    )
    tokens = np.zeros((b, length), np.int32)
    tokens[:, :p] = ids
    done = np.zeros(b, bool)
    rng = np.random.default_rng(how.seed)

    # Simulated ranks are threads of this process and only rank 0 sees the logits: a rank
    # asks for position s's token only once it is chosen (under MPI each rank chooses its own
    # before its next step, so it never waits).
    ready = threading.Condition()
    decided = [p - 1]  # the last position whose token is known
    wait_s = get_config().timeout_s

    def feed(s: int, regions: Mapping[str, Any]) -> dict[str, np.ndarray]:
        with ready:
            if not ready.wait_for(lambda: decided[0] >= s, timeout=wait_s):
                raise UsageError(
                    f"generation: the token of position {s} was not chosen within {wait_s:g} s"
                )
            return {"ids": tokens[:, s : s + 1][regions["ids"]], "pos": np.array([s], np.int32)}

    def chosen(s: int, named: dict[str, np.ndarray]) -> None:
        if s + 1 < p:  # still reading the prompt
            return
        nxt = _choose(named["output"][:, 0, :], how, rng).astype(np.int32)
        if eos is not None:
            nxt = np.where(done, eos, nxt)
            done[:] |= nxt == eos
        with ready:
            tokens[:, s + 1] = nxt
            decided[0] = s + 1
            ready.notify_all()

    fit(
        step,
        feed,
        steps=length - 1,
        sim=sim,
        mesh=sizes,
        values=weights,
        on_tensors=chosen,
        quiet=True,
    )
    out: np.ndarray = tokens[:, p:]
    return out
