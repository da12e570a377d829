#!/usr/bin/env bash
# Check IR files on every rank of an mpirun job (all ranks must agree; errors end the job).
#   jobs/mpirun_check.sh 4 examples/*.dtm
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: jobs/mpirun_check.sh RANKS FILE...}; shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
exec mpirun --timeout 300 --bind-to none -n "$n" .venv/bin/python -m mpi4py -m dtm_mpi check "$@"
