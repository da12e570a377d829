"""The only package that touches MPI. Nothing here initialises MPI at import time: mpi4py is
imported lazily inside functions, so ``import dtm_mpi.comm`` is free."""
