"""``python -m dtm_mpi ...``: the ``dtm`` command; under MPI an unhandled error aborts the job."""

from __future__ import annotations

import sys

from dtm_mpi.comm.abort import keep_early_term

keep_early_term()  # before the rest is imported: a peer that dies meanwhile is named

from dtm_mpi.cli import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run())
