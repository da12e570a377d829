"""Reference runs shared by the tests of one session: a command whose output (its stdout and the
file it writes) is a function of its arguments and environment alone runs once per session,
and each test that asks gets a copy. Several tests compare against the same uninterrupted
run on one simulated rank; each ran it again, a process start and a training each time.
pytest-xdist's workers share the cache (the ``shared_tmp`` fixture): the first to ask runs
the command under a lock, the others wait for it and copy."""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

from tests.mpi_env import mpirun_env

OUT = "{out}"
"""The placeholder in a shared command for the file it writes."""


def shared_run(root: Path, cmd: list[str], out: Path, timeout_s: float = 150, **env: str) -> str:
    """The merged stdout and stderr of ``cmd`` (run with :func:`mpirun_env` plus ``env``;
    it must succeed), with the file it wrote at :data:`OUT` copied to ``out``; run once per
    session under ``root`` for each distinct command and ``env``."""
    blob = json.dumps([cmd, out.suffix, sorted(env.items())]).encode()
    key = hashlib.sha256(blob).hexdigest()[:20]
    home = root / "shared-runs"
    home.mkdir(parents=True, exist_ok=True)
    made, text = home / f"{key}{out.suffix}", home / f"{key}.txt"  # (np.savez adds .npz)
    with (home / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        if not text.exists():
            proc = subprocess.run(
                [made.as_posix() if part == OUT else part for part in cmd],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=mpirun_env(**env),
                check=False,
            )
            said = proc.stdout + proc.stderr
            assert proc.returncode == 0, said
            text.write_text(said, encoding="utf-8")
    said = text.read_text(encoding="utf-8")
    assert made.exists(), f"{' '.join(cmd)} wrote no {made}:\n{said}"
    shutil.copyfile(made, out)
    return said
