"""Files: program inputs and outputs (``arrays``), and the sharded tensor store with its
checkpoints: the format-neutral protocol (``checkpoint``, ``data_write``, ``restore_read``,
``commit``, ``store``, ``manifest``, ``ckpt_plan``, ``hashing``, ``verification``) over a shard
backend selected by the name a store records (``backend``: the interface and the registry;
parallel HDF5 through ``h5`` and ``ckpt_files``, the only modules that import h5py), and the
store tools' public API (``tools``). The on-disk format is specified in io/FORMAT.md at the top of the
repository. Communicators come from the caller (:mod:`dtm_mpi.comm.handles`).

Nothing here runs MPI or opens files at import time."""
