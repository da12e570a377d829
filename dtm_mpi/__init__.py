"""dtm_mpi: the Distributed Tensor Machine on MPI.

Importing this package does no MPI, GPU or file work: MPI is initialised only when a
communication session is created (or when launched as ``python -m mpi4py``).
"""

from dtm_mpi._version import __version__
from dtm_mpi.config import Config, get_config
from dtm_mpi.errors import DtmError

__all__ = ["Config", "DtmError", "__version__", "get_config"]
