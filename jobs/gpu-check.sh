#!/usr/bin/env bash
# make gpu-check: the prepared device check for a machine with a GPU (minutes, not hours).
#
#   1. the `gpu` tests (every RawKernel against float64 numpy, poisoned outputs, odd sizes;
#      whole examples on the GPU against the numpy backend under mpirun);
#   2. `dtm bench kernels`: each RawKernel's bandwidth against a device-to-device copy and
#      against CuPy's composed equivalent;
#   3. `dtm bench comm --backend cuda` at 2 ranks: collectives on device buffers (GPU-aware
#      MPI or staging, as detected) against raw mpi4py on the same buffers;
#   4. a short table last. Results go to $OUT (default ./gpu-check-out) as CSV and logs.
#
# Needs: a Python with numpy, mpi4py, h5py, xxhash, pytest, pytest-timeout and CuPy (PY; default
# .venv/bin/python when it exists, else python3 — a GPU image's own Python usually has them
# all); dtm_mpi is imported from this checkout. MPI: the machine's own `mpirun` and mpi4py;
# where either is missing or broken, the Open MPI (and mpi4py) wheels of jobs/gpu-wheels.sh,
# carried in .whl/, are unpacked into /tmp (MPI_FROM_WHEEL=1 forces that). About 5 minutes on
# one GPU: each step is bounded so the whole fits one 10-minute command.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-gpu-check-out}
BACKEND=${BACKEND:-cuda}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONUNBUFFERED=1
say() { printf '[gpu-check] %s\n' "$*"; }

"$PY" - <<'PYEOF' || { say "no usable GPU backend: stopping"; exit 2; }
from dtm_mpi.kernels.backends import BackendKind, backend_problem, probe_devices
import os
p = probe_devices()
kind = BackendKind(os.environ.get("BACKEND", "cuda"))
why = backend_problem(kind, p)
print(f"[gpu-check] probe: {p}")
raise SystemExit(f"[gpu-check] {why}" if why else 0)
PYEOF

# MPI for the examples test and bench comm: the machine's, else the carried wheels.
source jobs/gpu-mpi.sh
"$PY" -c 'from mpi4py import MPI; print("[gpu-check] MPI library:", MPI.Get_library_version().splitlines()[0])' 2>/dev/null || true

status=0
say "1/3 gpu tests"
timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || status=1

say "2/3 dtm bench kernels"
timeout 120 "$PY" -m dtm_mpi bench kernels --backend "$BACKEND" --rows 16384 --cols 4096 --repeat 3 --csv "$OUT/kernels.csv" 2>&1 | tee "$OUT/kernels.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

say "3/3 dtm bench comm on device buffers (2 ranks)"
if mpi_works; then
  timeout 120 mpirun --timeout 110 --bind-to none -n 2 "$PY" -m mpi4py -m dtm_mpi bench comm \
    --backend "$BACKEND" --sizes 8,64K,1M,16M --repeat 5 --csv "$OUT/comm.csv" 2>&1 | tee "$OUT/comm.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  say "no usable MPI on this machine: bench comm skipped"
fi

say "summary"
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -1
"$PY" - "$OUT" <<'PYEOF'
import csv, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("kernels.csv", "comm.csv"):
    p = out / name
    if not p.exists():
        print(f"{name}: missing")
        continue
    rows = list(csv.reader(p.open()))
    print(f"== {name}")
    for r in rows[1:]:
        if name == "kernels.csv" and not r[0].endswith("GBps"):
            continue
        print("  " + "  ".join(f"{c:>14}" for c in r))
PYEOF
say "done (status $status); files in $OUT"
exit $status
