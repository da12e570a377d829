"""The environment every test that starts ``mpirun`` gives it (one definition)."""

from __future__ import annotations

import os


def mpirun_env(**extra: str) -> dict[str, str]:
    """This process's environment, with Open MPI allowed to run as root (CI runs as root) and
    to oversubscribe (more ranks than the 2 cores), plus ``extra``."""
    return {
        **os.environ,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        **extra,
    }
