#!/usr/bin/env bash
# make gpu-check: the prepared device check for a machine with a GPU (minutes, not hours).
#
#   0. a preflight (device, NVRTC with the fp16 header, cuBLAS, cuRAND; retried once with
#      CUDA_PATH at nvcc's toolkit), so a missing part stops the run in seconds;
#   1. the `gpu` tests (every RawKernel against float64 numpy, poisoned outputs, odd sizes;
#      then whole examples on the GPU against the numpy backend under mpirun);
#   2. `dtm bench kernels`: each RawKernel's bandwidth against a device-to-device copy and
#      against CuPy's composed equivalent;
#   3. `dtm bench comm --backend cuda` at 2 ranks: collectives on device buffers (GPU-aware
#      MPI or staging, as detected) against raw mpi4py on the same buffers;
#   4. a short table last. Results go to $OUT (default ./gpu-check-out) as CSV and logs.
#
# Needs: a Python with numpy, mpi4py, h5py, xxhash, crc32c (else carried in .whl/, see
# jobs/gpu-wheels.sh), pytest, pytest-timeout and CuPy (PY; default
# .venv/bin/python when it exists, else python3 — a GPU image's own Python usually has them
# all); dtm_mpi is imported from this checkout. MPI: the machine's own `mpirun` and mpi4py;
# where either is missing or broken, the Open MPI (and mpi4py) wheels of jobs/gpu-wheels.sh,
# carried in .whl/, are unpacked into /tmp (MPI_FROM_WHEEL=1 forces that). About 5 minutes on
# one GPU: each step is bounded (45 + 180 + 150 + 100 + 100 s at most) so the whole fits one
# 10-minute command.
set -uo pipefail
cd "$(dirname "$0")/.."
source jobs/gpu-env.sh
BACKEND=${BACKEND:-cuda}
say() { printf '[gpu-check] %s\n' "$*"; }

# Preflight (seconds): the device, then each CUDA part the checks need — NVRTC with the fp16
# header (every RawKernel), cuBLAS (matmul), cuRAND (the benchmark's inputs) — so a missing
# toolkit part stops here with its error instead of failing every test and benchmark.
preflight() {
  timeout 45 "$PY" - <<'PYEOF'
import os
from dtm_mpi.kernels.backends import BackendKind, backend_problem, probe_devices
p = probe_devices()
kind = BackendKind(os.environ.get("BACKEND", "cuda"))
why = backend_problem(kind, p)
print(f"[gpu-check] probe: {p}")
if why:
    raise SystemExit(f"[gpu-check] {why}")
import cupy as cp
import numpy as np
from dtm_mpi.kernels import launch
from dtm_mpi.kernels.devices import open_backend
dev = open_backend(kind)
print(f"[gpu-check] {dev.description}; CuPy {cp.__version__}, numpy {np.__version__}, CUDA path {cp.cuda.get_cuda_path()}")
y = launch.softmax(cp.ones((2, 3), dtype=cp.float16)).get()
assert np.allclose(y, 1 / 3, atol=1e-3), y
assert float((cp.arange(8, dtype=cp.float16) * 2).sum()) == 56.0
assert float((cp.ones((4, 4), "f") @ cp.ones((4, 4), "f"))[0, 0]) == 4.0
cp.random.default_rng(0).standard_normal(4, dtype=cp.float32)
print("[gpu-check] preflight ok: NVRTC + fp16 header, cuBLAS, cuRAND")
PYEOF
}
if ! preflight; then
  toolkit=""
  for root in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc 2>/dev/null || echo /nonexistent/bin/nvcc)")")")" /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$root" ] && [ -f "$root/include/cuda_fp16.h" ]; then toolkit=$root; break; fi
  done
  if [ -z "${CUDA_PATH:-}" ] && [ -n "$toolkit" ]; then
    say "retrying with CUDA_PATH=$toolkit (a toolkit's headers for NVRTC)"
    export CUDA_PATH="$toolkit"
    preflight || { say "no usable GPU backend: stopping"; exit 2; }
  else
    say "no usable GPU backend: stopping"; exit 2
  fi
fi

# MPI for the examples test and bench comm: the machine's, else the carried wheels.
source jobs/gpu-mpi.sh
"$PY" -c 'from mpi4py import MPI; print("[gpu-check] MPI library:", MPI.Get_library_version().splitlines()[0])' 2>/dev/null || true

status=0
say "1/3 gpu tests: every kernel against float64 numpy"
timeout 180 "$PY" -m pytest -q -m gpu -k "not examples" -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# Whole programs under mpirun, numpy against the GPU; staged buffers (no GPU-aware probe per
# run: bench comm below shows the detection).
say "1b/3 gpu tests: whole examples at 2 ranks against the numpy backend"
DTM_GPU_AWARE_MPI=${DTM_GPU_AWARE_MPI:-no} timeout 150 "$PY" -m pytest -q -m gpu -k examples -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/gpu-examples.log" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || status=1

say "2/3 dtm bench kernels"
timeout 100 "$PY" -m dtm_mpi bench kernels --backend "$BACKEND" --rows 16384 --cols 4096 --repeat 3 --csv "$OUT/kernels.csv" 2>&1 | tee "$OUT/kernels.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

say "3/3 dtm bench comm on device buffers (2 ranks)"
if mpi_works; then
  timeout 100 mpirun --timeout 95 --bind-to none -n 2 "$PY" -m mpi4py -m dtm_mpi bench comm \
    --backend "$BACKEND" --sizes 8,64K,1M,16M --repeat 5 --csv "$OUT/comm.csv" 2>&1 | tee "$OUT/comm.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  say "no usable MPI on this machine: bench comm skipped"
fi

say "summary"
for log in gpu-tests gpu-examples; do grep -E "passed|failed|error" "$OUT/$log.log" | tail -1 | sed "s/^/$log: /"; done
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
