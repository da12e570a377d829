"""Initial values of entry parameters (spec §7.3), whole or one rank's block.

``zeros``/``ones`` fill; ``normal``/``uniform`` are the seeded random tensor with offset 0,
computed from global element indices, so a rank's block equals the same block of the global
tensor whatever the layout or rank count. ``store`` values come from the latest checkpoint of
``dtm run --store DIR`` (:mod:`dtm_mpi.runtime.runner`), or from an input; not from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dtm_mpi.errors import UsageError
from dtm_mpi.ir.dtypes import as_dtype, np_dtype
from dtm_mpi.ir.nodes import InitKind, Module, Param
from dtm_mpi.ir.ops.create import random_values
from dtm_mpi.ir.types import TensorType
from dtm_mpi.kernels.numpy_backend import global_flat_index

__all__ = ["BlockSource", "check_input", "check_inputs", "init_block", "init_global"]


@runtime_checkable
class BlockSource(Protocol):
    """A global value read a block at a time (a memory-mapped checkpoint tensor,
    :class:`~dtm_mpi.io.hf_files.MappedTensor`): a rank reads only its block of it."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    def __getitem__(self, region: Any) -> np.ndarray: ...


class _Converted:
    """A block source whose blocks come converted to a parameter's dtype."""

    __slots__ = ("source", "type")

    def __init__(self, source: BlockSource, t: TensorType) -> None:
        self.source, self.type = source, t

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return np_dtype(self.type.dtype)

    def __getitem__(self, region: Any) -> np.ndarray:
        return np.array(as_dtype(np.asarray(self.source[region]), self.type), order="C")


def init_block(param: Param, offsets: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """The block of ``param``'s initial value starting at global ``offsets`` with ``shape``."""
    t = param.type
    init = param.init
    if init is None:
        raise UsageError(
            f"parameter {param.name} ({t}) has no init and no input supplies it; give it with "
            f"--input (.npy/.npz/.h5) or declare 'init ...' in the module"
        )
    dtype = np_dtype(t.dtype)
    if init.kind is InitKind.ZEROS:
        return np.zeros(tuple(shape), dtype=dtype)
    if init.kind is InitKind.ONES:
        return np.ones(tuple(shape), dtype=dtype)
    if init.kind is InitKind.STORE:
        raise UsageError(
            f"parameter {param.name} is 'init store': its value comes from a checkpoint "
            "store (--store DIR) or an input (--input)"
        )
    params = {k: float(v) for k, v in init.params if k != "seed"}
    seed = int(dict(init.params)["seed"])
    index = global_flat_index(t.shape, offsets, shape)
    values = random_values(init.kind.value, seed, 0, index, params)
    return as_dtype(values, t)


def init_global(param: Param) -> np.ndarray:
    """The whole initial value of ``param``."""
    return init_block(param, (0,) * param.type.rank, param.type.shape)


def check_input(name: str, t: TensorType, value: Any, where: str) -> Any:
    """``value`` as the global value of a parameter of type ``t``: the shape must match, and
    the dtype must convert without loss of kind (a float array for an int parameter is an
    error, an int array for a float parameter is converted). A :class:`BlockSource` stays one
    (each rank reads its block), its blocks converted."""
    if tuple(value.shape) != t.shape:
        raise UsageError(
            f"input {name} from {where} has shape {list(value.shape)}, but the parameter is "
            f"{t} (shape {list(t.shape)})"
        )
    want = np_dtype(t.dtype)
    have = value.dtype
    if (have.kind == "f" and want.kind in "iub") or (have.kind == "b" and want.kind != "b"):
        raise UsageError(
            f"input {name} from {where} has dtype {have}, which cannot become {t.dtype}"
        )
    if have.kind not in "fiub":
        raise UsageError(f"input {name} from {where} has unsupported dtype {have}")
    if not isinstance(value, np.ndarray):
        return _Converted(value, t)
    return np.array(as_dtype(value, t), order="C")  # bf16: rounded to bfloat16 values


def check_inputs(
    module: Module,
    inputs: Mapping[str, np.ndarray],
    *,
    store: bool = False,
    fed: Sequence[str] = (),
) -> dict[str, Any]:
    """The inputs that match entry parameters, checked and converted (shape, dtype); a name
    matching no parameter is an error naming the parameters, and so is a parameter without
    init that no input supplies (or an ``init store`` one, unless a ``store`` fills it) and
    a loader does not feed (``fed``)."""
    entry = module.entry
    assert entry is not None
    names = {p.name.lstrip("%"): p for p in entry.params}
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key not in names:
            raise UsageError(
                f"input {key!r} matches no parameter of @{entry.name} (parameters: "
                f"{', '.join(names) or 'none'})"
            )
        given = value if isinstance(value, BlockSource) else np.asarray(value)
        out[key] = check_input(key, names[key].type, given, "the inputs")
    for key, p in names.items():
        if (
            key in out
            or key in fed
            or (p.init is not None and (p.init.kind is not InitKind.STORE or store))
        ):
            continue
        if p.init is None:
            raise UsageError(
                f"parameter {p.name} of @{entry.name} has no init and no input supplies it; "
                f"give it with -i/--input (.npy named {key}.npy, .npz or .h5 holding {key!r})"
            )
        raise UsageError(
            f"parameter {p.name} of @{entry.name} is 'init store' and nothing supplies it; "
            f"give --store DIR (a checkpoint store holding {key!r}) or -i/--input (.npy "
            f"named {key}.npy, .npz or .h5 holding {key!r})"
        )
    return out
