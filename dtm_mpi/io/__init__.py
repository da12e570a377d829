"""Files: program inputs and outputs (``arrays``), and the sharded tensor store with its
checkpoints: the format-neutral protocol (``checkpoint``, ``data_write``, ``restore_read``,
``commit``, ``store``, ``manifest``, ``plan``, ``hashing``) over a shard backend (``backend``;
parallel HDF5 through ``h5`` and ``files``), the store tools' public API (``tools``) and option
parsers (``options``). The on-disk format is specified in io/FORMAT.md at the top of the
repository. Communicators come from the caller (:mod:`dtm_mpi.comm.handles`).

Nothing here runs MPI or opens files at import time."""
