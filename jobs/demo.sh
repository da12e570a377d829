#!/usr/bin/env bash
# make demo: the main job on 4 local ranks. At this stage: check every example module (the IR
# front end), then a 4-rank MPI job that reports the runtime (MPI library, parallel HDF5,
# ranks, node-local ranks) and checks an allreduce across all ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RANKS=${RANKS:-4}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

if compgen -G "examples/*.dtm" >/dev/null; then
  echo "== dtm check examples/*.dtm"
  "$PY" -m dtm_mpi check examples/*.dtm
  for f in examples/*.dtm; do printf '  %-36s %s\n' "$f" "$("$PY" -m dtm_mpi hash "$f")"; done
fi
echo "== mpirun -n $RANKS dtm info"
mpirun --timeout 120 --bind-to none -n "$RANKS" "$PY" -m mpi4py -m dtm_mpi info
