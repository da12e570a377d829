"""The Python frontend: write a model with traced tensors, get a verified IR module with its
backward pass and optimizer, and run it (in-process on simulated ranks, or on the ranks of
``mpirun``/``srun``).

    from dtm_mpi import frontend as dtm

    mesh = dtm.Mesh(dp=2, tp=2)
    model = dtm.nn.MLP(64, 256)
    step = dtm.train_step(model, loss_fn, mesh=mesh, inputs={...}, optimizer=dtm.optim.AdamW())

The IR stays the contract: the frontend only emits modules (``step.text``); ``dtm run`` and
the run API execute them.
"""

from __future__ import annotations

from dtm_mpi.frontend import functional, hf, nn, optim
from dtm_mpi.frontend.fit import (
    ArrayLoader,
    CheckpointPolicy,
    DevicePolicy,
    FitResult,
    ResizePolicy,
    fit,
)
from dtm_mpi.frontend.generate import Sampling, generate
from dtm_mpi.frontend.mesh import Mesh
from dtm_mpi.frontend.precision import MixedPrecision
from dtm_mpi.frontend.stage_split import Pipeline
from dtm_mpi.frontend.tensor import Tensor
from dtm_mpi.frontend.token_data import TokenLoader
from dtm_mpi.frontend.trace import Input, TracedStep, eval_step, forward_step, train_step

__all__ = [
    "ArrayLoader",
    "CheckpointPolicy",
    "DevicePolicy",
    "FitResult",
    "Input",
    "Mesh",
    "MixedPrecision",
    "Pipeline",
    "ResizePolicy",
    "Sampling",
    "Tensor",
    "TokenLoader",
    "TracedStep",
    "eval_step",
    "fit",
    "forward_step",
    "functional",
    "generate",
    "hf",
    "nn",
    "optim",
    "train_step",
]
