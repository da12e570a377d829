# Sourced by jobs/gpu-check.sh and jobs/gpu-features.sh (from the checkout's root): the Python
# (PY; default .venv/bin/python when it exists, else python3), dtm_mpi from this checkout, the
# output folder ($OUT, default gpu-check-out), and the environment the device checks run in.
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# crc32c (every frame's checksum) is not in the lent H200 image: the wheel jobs/gpu-wheels.sh
# puts in .whl/ is unpacked into /tmp/dtm-site when the Python cannot import it
if ! "$PY" -c 'import crc32c' >/dev/null 2>&1; then
  whl=$(ls .whl/crc32c-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$whl" ] && "$PY" -m zipfile -e "$whl" /tmp/dtm-site; then
    export PYTHONPATH="$PYTHONPATH:/tmp/dtm-site"
  else
    echo "[gpu-env] the Python cannot import crc32c and no .whl/crc32c-*.whl is carried" >&2
  fi
fi
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONUNBUFFERED=1
export CUPY_TF32=0  # exact float32 matmul: the examples are compared with rtol 1e-4
