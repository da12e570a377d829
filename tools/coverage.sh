#!/usr/bin/env bash
# make coverage: line coverage of dtm_mpi/ over both suites, every process included.
#
# coverage.py starts in every Python process the suites start ([run] patch = subprocess in
# pyproject.toml): pytest-xdist's workers, `dtm` subprocesses, and each rank that mpirun, srun
# or a Slurm job launches (they inherit the environment). Each process writes its own data
# file under $COVERAGE_DIR (parallel = true); they are combined at the end. A process that MPI
# aborts or SIGKILLs writes nothing (its lines count only where another process ran them).
#
#   COVERAGE_DIR   where the data files and the reports go (default ./coverage-out)
#   RANKS          the MPI suite's rank counts (default "2 3 4")
#   PYTEST_ARGS    extra arguments for the single-process suite (e.g. "-n 2")
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
export COVERAGE_DIR=${COVERAGE_DIR:-$PWD/coverage-out}
RANKS=${RANKS:-2 3 4}
rm -rf "$COVERAGE_DIR"
mkdir -p "$COVERAGE_DIR"
export COVERAGE_RCFILE=$PWD/pyproject.toml
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
unset PYTHONDONTWRITEBYTECODE
case $VENV in /*) venv_dir=$VENV ;; *) venv_dir=$PWD/$VENV ;; esac
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$venv_dir/pycache}

status=0
echo "== coverage: single-process suite"
# shellcheck disable=SC2086
"$PY" -m coverage run -m pytest -q -m "not mpi" ${PYTEST_ARGS:-} tests || status=$?
for n in $RANKS; do
  echo "== coverage: MPI suite, $n ranks"
  mpirun --timeout 900 --bind-to none -n "$n" "$PY" -m coverage run -m mpi4py -m pytest -q \
    --with-mpi -m mpi --timeout-method=thread tests || status=$?
done
"$PY" -m coverage combine -q "$COVERAGE_DIR"
"$PY" -m coverage report --skip-covered --sort=cover | tail -n 40 | tee "$COVERAGE_DIR/report.txt"
"$PY" -m coverage report --format=total > "$COVERAGE_DIR/total.txt"
echo "line coverage of dtm_mpi/: $(cat "$COVERAGE_DIR/total.txt")% (suites exit status $status)"
exit "$status"
