#!/usr/bin/env bash
# make demo: the main job on 4 local ranks. Checks every example module, reports the runtime
# (MPI library, parallel HDF5, node-local ranks), explains the tensor-parallel MLP's plan on a
# 2x2 mesh, then trains it for 5 steps under mpirun on 4 ranks and prints the result summary.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RANKS=${RANKS:-4}
MESH=${MESH:-dp=2,tp=2}
STEPS=${STEPS:-5}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export DTM_TIMEOUT=${DTM_TIMEOUT:-120}

echo "== dtm check examples/*.dtm"
"$PY" -m dtm_mpi check examples/*.dtm
for f in examples/*.dtm; do printf '  %-36s %s\n' "$f" "$("$PY" -m dtm_mpi hash "$f")"; done
echo "== mpirun -n $RANKS dtm info"
mpirun --timeout 120 --bind-to none -n "$RANKS" "$PY" -m mpi4py -m dtm_mpi info
echo "== dtm explain examples/tp_mlp.dtm --mesh $MESH"
"$PY" -m dtm_mpi explain examples/tp_mlp.dtm --mesh "$MESH" | sed -n '1,12p;/^totals/,$p'
out=$(mktemp -d)/tp_mlp.npz
echo "== mpirun -n $RANKS dtm run examples/tp_mlp.dtm --mesh $MESH --steps $STEPS -o $out"
mpirun --timeout 300 --bind-to none -n "$RANKS" "$PY" -m mpi4py -m dtm_mpi run \
  examples/tp_mlp.dtm --mesh "$MESH" --steps "$STEPS" -o "$out"
"$PY" - "$out" <<'PY'
import sys
import numpy as np
data = np.load(sys.argv[1])
print(f"loss after the last step: {float(data['result0']):.6f}; "
      f"|w1| {float(np.linalg.norm(data['w1'])):.4f}, |w2| {float(np.linalg.norm(data['w2'])):.4f}")
PY
