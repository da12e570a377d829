"""Files: program inputs and outputs (``arrays``), and the sharded tensor store with its
checkpoints in parallel HDF5 (``checkpoint``, ``store``, ``manifest``, ``plan``, ``hashing``,
``h5``). The on-disk format is specified in io/FORMAT.md at the top of the repository.

Nothing here runs MPI or opens files at import time."""
