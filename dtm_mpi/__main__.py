"""``python -m dtm_mpi ...``: the ``dtm`` command; under MPI an unhandled error aborts the job."""

from __future__ import annotations

import sys

from dtm_mpi.cli import run

if __name__ == "__main__":
    sys.exit(run())
