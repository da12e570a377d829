"""Where the CUDA/HIP kernel sources (``kernels/*.cu``) are, and their text ready for NVRTC.

Looked up in order: ``DTM_KERNEL_DIR`` (a directory, for development), the checkout's
top-level ``kernels/`` next to the ``dtm_mpi`` package (a source tree or an editable install),
then the copy an installed wheel carries (``<prefix>/share/dtm_mpi/kernels``, from setup.cfg's
``data_files``). Nothing here needs a GPU: the text is what CuPy's ``RawModule`` compiles.
"""

from __future__ import annotations

import site
import sys
from functools import cache
from pathlib import Path

from dtm_mpi.errors import KernelError

__all__ = ["HEADER", "INCLUDE_LINE", "kernel_dir", "kernel_files", "kernel_source"]

HEADER = "dtm_common.cuh"
INCLUDE_LINE = f'#include "{HEADER}"'
"""Every ``.cu`` file starts with this line; :func:`kernel_source` replaces it by the
header's text (NVRTC cannot resolve includes relative to a file it never saw)."""


def _candidates() -> list[Path]:
    from dtm_mpi.config import get_config

    out = []
    env = get_config().kernel_dir
    if env is not None:
        out.append(Path(env))
    out.append(Path(__file__).resolve().parents[2] / "kernels")
    for prefix in (sys.prefix, getattr(site, "USER_BASE", None) or ""):
        if prefix:
            out.append(Path(prefix) / "share" / "dtm_mpi" / "kernels")
    return out


@cache
def kernel_dir() -> Path:
    """The directory holding the kernel sources; :class:`KernelError` naming every place
    looked at when none has them."""
    tried = _candidates()
    for d in tried:
        if (d / HEADER).is_file():
            return d
    raise KernelError(
        "the CUDA/HIP kernel sources (kernels/*.cu) were not found; looked in "
        + ", ".join(str(d) for d in tried)
        + " (set DTM_KERNEL_DIR to the checkout's kernels/ directory)"
    )


def kernel_files() -> list[Path]:
    """Every ``.cu`` source, sorted by name."""
    return sorted(kernel_dir().glob("*.cu"))


@cache
def kernel_source(name: str) -> str:
    """The text of ``kernels/<name>`` (e.g. ``"softmax.cu"``) with the common header inlined,
    as one self-contained compilation unit."""
    d = kernel_dir()
    path = d / name
    try:
        text = path.read_text()
        header = (d / HEADER).read_text()
    except OSError as exc:
        raise KernelError(f"cannot read kernel source {path}: {exc}") from None
    if INCLUDE_LINE not in text:
        raise KernelError(f"{path}: does not include {HEADER} ({INCLUDE_LINE!r} missing)")
    return text.replace(INCLUDE_LINE, f"// ---- {HEADER} ----\n{header}\n// ---- {name} ----", 1)
