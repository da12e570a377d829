#!/usr/bin/env bash
# make gpu-features: the run features on a GPU backend -- the `--backend cuda|hip` column of
# docs/RUNTIME.md's features x modes table (tests/runtime/test_gpu_run_features.py under
# mpirun at 2 ranks: async checkpoints resumed on another mesh, a stop on a signal, a live
# resize, deterministic mode with overlapped allreduces, an injected fault, the progress line).
# Run it after jobs/gpu-check.sh when device time is left: about 2-4 minutes on one GPU,
# bounded to 300 s. Needs what jobs/gpu-check.sh needs; its log goes to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source jobs/gpu-env.sh
say() { printf '[gpu-features] %s\n' "$*"; }
source jobs/gpu-mpi.sh
mpi_works || { say "no usable MPI on this machine: stopping"; exit 2; }
say "the run features on the GPU backend at 2 ranks"
timeout 300 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/runtime/test_gpu_run_features.py 2>&1 | tee "$OUT/gpu-features.log" | tail -25
status=${PIPESTATUS[0]}
say "done (status $status); log in $OUT/gpu-features.log"
exit "$status"
