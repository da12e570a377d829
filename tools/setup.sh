#!/usr/bin/env bash
# make setup: idempotent, non-interactive environment build for dtm_mpi.
#
# 1. MPI + parallel HDF5: use what is present (HPC modules, or MPICC / HDF5_DIR set); else, as
#    root on Debian/Ubuntu, install openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config.
# 2. .venv with setuptools>=77, cython, pkgconfig, numpy, mpi4py (wheel; loads the system MPI).
# 3. h5py 3.16.0 built against parallel HDF5 without build isolation (an isolated build compiles
#    mpi4py from source with -O3 -g and needs ~20 GB of RAM).
# 4. dtm_mpi in editable mode with [test,dev,train,interop]; fail unless h5py.get_config().mpi is true.
# Also (optional): hipcc + ROCm device libraries for the AMD kernel builds (as root on Debian),
# Slurm (slurmctld slurmd slurm-client munge, as root on Debian) for the tests against a real
# scheduler, and the NVRTC and CPU PyTorch wheels.
# What does not depend on each other runs side by side (each line says when it starts): the
# system packages beside the venv's first installs, the optional wheels and the optional system
# packages beside the h5py build (the CPU-bound part, about 100 s); the package's own install
# waits for all of them.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
H5PY_VERSION=3.16.0
MPI4PY_VERSION=4.1.2
say() { printf '[setup %3ss] %s\n' "$SECONDS" "$*"; }
die() {
  printf '[setup] error: %s\n' "$*" >&2
  for pid in ${system_pid:-} ${optional_pid:-} ${optional_system_pid:-}; do kill "$pid" 2>/dev/null || true; done
  exit 1
}

have_parallel_hdf5() {
  [ -n "${HDF5_DIR:-}" ] && return 0
  pkg-config --exists hdf5-openmpi 2>/dev/null && return 0
  command -v h5pcc >/dev/null 2>&1 && return 0
  return 1
}

# --- 1. system packages (run beside the venv's first installs; h5py's build waits for them) ---
# MPI + parallel HDF5: use what is present (HPC modules, or MPICC / HDF5_DIR set); else, as root
# on Debian/Ubuntu, install openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config.
system_packages() {
MPICC=${MPICC:-$(command -v mpicc || true)}
if [ -z "$MPICC" ] || ! have_parallel_hdf5; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian packages: openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed"
    apt-get install -y -qq openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config >/dev/null \
      || die "apt-get install of Open MPI / parallel HDF5 failed"
    command -v mpicc >/dev/null || die "mpicc still missing after installing openmpi"
  else
    die "need mpicc and a parallel HDF5 (load your site's MPI and HDF5 modules, or set MPICC and HDF5_DIR); not root, so cannot apt-get install them"
  fi
fi
have_parallel_hdf5 || die "no parallel HDF5 found (pkg-config hdf5-openmpi, h5pcc or HDF5_DIR)"
}
system_packages &
system_pid=$!

# --- 1b, 1c: optional system packages, installed while h5py builds (apt after apt: one lock) --
optional_system_packages() {
# --- 1b. HIP toolchain for the AMD kernel build checks (optional) ---------------------------
# tests/kernels/test_hip_sources.py compiles kernels/*.cu with hipcc and hipRTC for AMD GPUs (no
# GPU needed). Without the tools those tests skip with a reason; DTM_SETUP_HIP=0 skips this.
if [ "${DTM_SETUP_HIP:-1}" != 0 ] && ! command -v hipcc >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
   && apt-cache show hipcc >/dev/null 2>&1; then
  say "installing Debian packages for the HIP kernel checks: hipcc libamdhip64-dev rocm-device-libs"
  export DEBIAN_FRONTEND=noninteractive
  hip_pkgs=(hipcc libamdhip64-dev rocm-device-libs)
  apt-get install -y -qq --no-install-recommends "${hip_pkgs[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends "${hip_pkgs[@]}" >/dev/null 2>&1; } \
    || say "warning: could not install the HIP toolchain; the hipcc/hipRTC kernel checks will skip"
fi

# --- 1c. Slurm for the tests against a real scheduler (optional) ----------------------------
# tests/test_slurm.py starts a private single-node cluster (its own munge key, config and ports
# on loopback, in a temporary directory; never a system Slurm) and submits the job scripts of
# jobs/ to it. Without the packages, or without root, those tests skip with a reason;
# DTM_SETUP_SLURM=0 skips this. Debian's packages are not started here (no init in CI).
if [ "${DTM_SETUP_SLURM:-1}" != 0 ] && ! command -v slurmctld >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
   && apt-cache show slurmctld >/dev/null 2>&1; then
  say "installing Debian packages for the Slurm tests: slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  slurm_pkgs=(slurmctld slurmd slurm-client munge)
  apt-get install -y -qq "${slurm_pkgs[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${slurm_pkgs[@]}" >/dev/null 2>&1; } \
    || say "warning: could not install Slurm; the tests against a real Slurm will skip"
fi
return 0
}

# --- 2. virtual environment and build prerequisites ------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PY --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# pip's output goes to a log, shown only when the step fails (PIPLOG: another log, for a pip
# running beside this one).
LOG="$VENV/setup.log"
pipq() {
  local log=${PIPLOG:-$LOG}
  if ! "$VPY" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    return 1
  fi
}
need() { "$VPY" - "$@" <<'PYEOF'
import sys
from importlib import metadata
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        got = metadata.version(name)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if want and got != want:
        sys.exit(1)
PYEOF
}
need "setuptools" && "$VPY" -c 'import setuptools,sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' \
  || { say "upgrading pip/setuptools"; pipq --upgrade pip "setuptools>=77" wheel; }
need cython pkgconfig numpy \
  || { say "installing cython pkgconfig numpy"; pipq cython pkgconfig numpy; }

# --- 3. optional wheels, installed beside the h5py build (it takes the CPU, they take the disk)
# NVRTC for the CUDA kernel checks: tests/kernels/test_cu_sources.py compiles the loader's exact
# text with NVRTC, the compiler CuPy uses (no GPU needed); the wheel matches the CUDA 13.0
# toolkit's headers. Without it that test skips with a reason; DTM_SETUP_NVRTC=0 skips this.
# PyTorch (CPU) for the peer of `dtm bench train` (the 'bench' extra): a pinned CPU build (a
# plain `torch` would pull a CUDA build of several GB); without it the torch peer and its tests
# skip with a reason. Hugging Face transformers with it: the numerics of record the LLM layers
# parity tests check against (tests/frontend/test_llm_parity.py skips without it); the same
# switch skips it. Neither shares a package with h5py; the
# package's own install (step 5) waits for them.
# MKL and BLIS (the 'blas' extra): the GEMM providers DTM_GEMM=auto measures against numpy's
# BLAS (about 700 MB of MKL libraries); without them numpy's is the only one and their tests
# skip with a reason. DTM_SETUP_BLAS=0 skips this.
NVRTC_WHEEL=nvidia-cuda-nvrtc==13.0.88
TORCH_PIN=torch==2.13.0
TRANSFORMERS_PIN=transformers==5.25.0
BLAS_PINS="mkl==2026.2.1 blis==1.3.4"
optional_wheels() {
  if [ "${DTM_SETUP_NVRTC:-1}" != 0 ] && [ "$(uname -s)" = Linux ] && ! need "$NVRTC_WHEEL"; then
    say "installing $NVRTC_WHEEL (NVRTC, for the CUDA kernel checks)"
    PIPLOG="$VENV/setup-optional.log" pipq "$NVRTC_WHEEL" || say "warning: could not install $NVRTC_WHEEL; the NVRTC kernel check will skip"
  fi
  if [ "${DTM_SETUP_TORCH:-1}" != 0 ] && ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
    say "installing $TORCH_PIN (CPU; the PyTorch peer of dtm bench train)"
    PIPLOG="$VENV/setup-optional.log" pipq "$TORCH_PIN" || say "warning: could not install $TORCH_PIN; the PyTorch peer of dtm bench train will skip"
  fi
  if [ "${DTM_SETUP_TORCH:-1}" != 0 ] && ! "$VPY" -c 'import transformers' >/dev/null 2>&1; then
    say "installing $TRANSFORMERS_PIN (the numerics of record for the LLM layers)"
    PIPLOG="$VENV/setup-optional.log" pipq "$TRANSFORMERS_PIN" || say "warning: could not install $TRANSFORMERS_PIN; the Hugging Face parity tests will skip"
  fi
  if [ "${DTM_SETUP_BLAS:-1}" != 0 ] && ! { "$VPY" -c 'import blis' >/dev/null 2>&1 && { [ -e "$VENV/lib/libmkl_rt.so.2" ] || [ -e "$VENV/lib/libmkl_rt.so.3" ]; }; }; then
    say "installing $BLAS_PINS (GEMM providers measured against numpy's BLAS)"
    # shellcheck disable=SC2086
    PIPLOG="$VENV/setup-optional.log" pipq $BLAS_PINS || say "warning: could not install $BLAS_PINS; DTM_GEMM=auto will have numpy's BLAS only"
  fi
  return 0
}
optional_wheels &
optional_pid=$!

wait "$system_pid" || die "the system packages could not be installed (above)"
MPICC=${MPICC:-$(command -v mpicc)}
say "mpicc: $MPICC"
optional_system_packages &
optional_system_pid=$!
need "mpi4py==$MPI4PY_VERSION" \
  || { say "installing mpi4py==$MPI4PY_VERSION"; pipq "mpi4py==$MPI4PY_VERSION"; }

# --- 4. h5py against parallel HDF5 -----------------------------------------------------------
# Its C extensions compile two at a time (setuptools' build_ext --parallel, given through an extra
# distutils configuration: pip has no flag for it).
# -O1: the extensions are Cython wrappers around libhdf5 (which does the I/O, built by Debian);
# measured here, -O1 builds in 56 s where -O2 takes 65 s (71 and 88 CPU-s).
h5py_is_mpi() { "$VPY" -c 'import h5py,sys; sys.exit(0 if h5py.get_config().mpi else 1)' 2>/dev/null; }
if ! { need "h5py==$H5PY_VERSION" && h5py_is_mpi; }; then
  say "building h5py $H5PY_VERSION against parallel HDF5 (about a minute)"
  pkgname=${HDF5_PKGCONFIG_NAME:-}
  if [ -z "$pkgname" ] && [ -z "${HDF5_DIR:-}" ] && pkg-config --exists hdf5-openmpi; then pkgname=hdf5-openmpi; fi
  (
    export CC="$MPICC" HDF5_MPI=ON CFLAGS="-O1 -g0"
    if [ -n "$pkgname" ]; then export HDF5_PKGCONFIG_NAME="$pkgname"; fi
    DIST_EXTRA_CONFIG="$VENV/h5py-build.cfg"
    printf '[build_ext]\nparallel = %s\n' "$(nproc 2>/dev/null || echo 2)" >"$DIST_EXTRA_CONFIG"
    export DIST_EXTRA_CONFIG
    pipq --force-reinstall --no-deps --no-build-isolation --no-binary=h5py --no-cache-dir \
      "h5py==$H5PY_VERSION"
  ) || die "building h5py against parallel HDF5 failed (log: $LOG)"
fi
h5py_is_mpi || die "h5py is not built with MPI (h5py.get_config().mpi is False); a serial wheel slipped in"
wait "$optional_pid" || true
wait "$optional_system_pid" || true

# --- 5. the package ---------------------------------------------------------------------------
stamp="$VENV/.dtm-installed"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  say "installing dtm_mpi (editable) with [test,dev,train,interop]"
  pipq --no-build-isolation -e ".[test,dev,train,interop]" || die "installing dtm_mpi failed"
  h5py_is_mpi || die "installing dtm_mpi replaced h5py with a serial build"
  touch "$stamp"
fi
# The GEMM providers measured once for this machine at one thread (cached; dtm info shows it),
# so that the first run does not measure them while the suite loads the machine.
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 "$VPY" -c 'from dtm_mpi.kernels.gemm import cached_choice; print("[setup] GEMM:", cached_choice().text())' \
  || say "warning: the GEMM providers could not be measured; the first run measures them"
"$VPY" -c 'import mpi4py, h5py, numpy, dtm_mpi; print("[setup] ok: dtm_mpi", dtm_mpi.__version__, "| mpi4py", mpi4py.__version__, "| h5py", h5py.__version__, "(mpi)", "| HDF5", h5py.version.hdf5_version, "| numpy", numpy.__version__)'
