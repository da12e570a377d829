"""Text generation with a key/value cache: :func:`generate` runs a Llama's decode step
(:meth:`~dtm_mpi.frontend.llm.Llama.decode`, traced once with
:func:`~dtm_mpi.frontend.trace.forward_step`; the caches are its state) one position a step
through :func:`~dtm_mpi.frontend.fit.fit`: first the prompt's tokens, then each chosen token.
The logits of every step come back whole on every rank, where the next token is chosen (the
largest logit, or sampled with a temperature and top-k from a seeded generator: every rank
draws the same), so it runs on simulated ranks and under mpirun on any mesh alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtm_mpi.config import get_config
from dtm_mpi.errors import UsageError

__all__ = ["Generation", "Sampling", "generate", "generation"]


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


@dataclass(frozen=True, slots=True)
class Generation:
    """The ``tokens`` ``[B, max_new]`` of a :func:`generation` and its times in seconds:
    ``trace_s`` (tracing the decode step), ``first_s`` (from the run's start to the first new
    token: planning, reading the weights, the prompt's positions), of which ``setup_s`` is
    the part before the first step starts (planning and reading the weights), and
    ``decode_s`` (the other new tokens, one step each)."""

    tokens: np.ndarray
    trace_s: float
    first_s: float
    decode_s: float
    setup_s: float = float("nan")

    @property
    def tokens_per_s(self) -> float:
        """New tokens a second after the first (all sequences of the batch counted)."""
        b, n = self.tokens.shape
        return b * (n - 1) / self.decode_s if n > 1 and self.decode_s > 0 else float("nan")


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
    weights: Mapping[str, Any] | None,
    prompt: np.ndarray,
    max_new: int,
    *,
    sizes: Mapping[str, int] | None = None,
    sim: int | None = None,
    sampling: Sampling | None = None,
    context: int | None = None,
    eos: int | None = None,
    store: str | None = None,
) -> np.ndarray:
    """The ``max_new`` tokens ``[B, max_new]`` after each prompt of ``prompt`` ``[B, P]``
    (int ids), from ``model`` (a :class:`~dtm_mpi.frontend.llm.Llama` laid out for the mesh
    of the axis sizes ``sizes``) with its ``weights`` (or, with ``store``, the weights of the
    store's latest checkpoint, each rank reading its blocks); ``sim`` simulated ranks, else
    the MPI job's (every rank calls it and gets the tokens). A prompt longer than ``context``
    (the model's positions) less ``max_new`` is an error. With ``eos``, a sequence that chose
    it repeats it."""
    return generation(
        model,
        weights,
        prompt,
        max_new,
        sizes=sizes,
        sim=sim,
        sampling=sampling,
        context=context,
        eos=eos,
        store=store,
    ).tokens


def generation(
    model: Any,
    weights: Mapping[str, Any] | None,
    prompt: np.ndarray,
    max_new: int,
    *,
    sizes: Mapping[str, int] | None = None,
    sim: int | None = None,
    sampling: Sampling | None = None,
    context: int | None = None,
    eos: int | None = None,
    store: str | None = None,
    on_token: Callable[[int, np.ndarray], None] | None = None,
) -> Generation:
    """:func:`generate`, with its times; ``on_token(i, ids)`` is called with each new
    position's ids ``[B]`` as it is chosen (on rank 0 of simulated ranks, on every rank
    under MPI)."""
    from dtm_mpi.frontend.fit import fit
    from dtm_mpi.frontend.mesh import Mesh
    from dtm_mpi.frontend.step_trace import Input
    from dtm_mpi.frontend.trace import forward_step
    from dtm_mpi.runtime.policies import CheckpointPolicy

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
    if weights is None and store is None:
        raise UsageError("generate needs the weights or a store whose checkpoint holds them")
    t0 = time.perf_counter()
    step = forward_step(
        model,
        lambda m, ids, pos: m.decode(ids, pos, length),
        mesh=Mesh("m", **sizes),
        inputs={"ids": Input((b, 1), "i32", (batch, None)), "pos": Input((1,), "i32")},
        name="decode",
        weights_from_store=weights is None,
    )
    t1 = time.perf_counter()
    marks: list[float] = []
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

    started: list[float] = []  # when the first step asks for its ids

    def feed(s: int, regions: Mapping[str, Any]) -> dict[str, np.ndarray]:
        if not started:
            started.append(time.perf_counter())
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
        marks.append(time.perf_counter())
        if on_token is not None:
            on_token(s + 1 - p, nxt)

    fit(
        step,
        feed,
        steps=length - 1,
        sim=sim,
        mesh=sizes,
        values=weights,
        checkpoint=CheckpointPolicy(store) if weights is None and store is not None else None,
        on_tensors=chosen,
        quiet=True,
    )
    out: np.ndarray = tokens[:, p:]
    first = marks[0] - t1 if marks else float("nan")
    rest = marks[-1] - marks[0] if len(marks) > 1 else 0.0
    setup = started[0] - t1 if started else float("nan")
    return Generation(out, t1 - t0, first, rest, setup)
