"""Whether MPI takes device buffers ("GPU-aware MPI"), decided in layers; the first layer
that answers wins:

1. **setting**: ``--gpu-aware-mpi yes|no|auto`` on the command line, else
   ``DTM_GPU_AWARE_MPI`` (:mod:`dtm_mpi.config`); ``auto`` defers to the layers below;
2. **vendor query**: the MPI library's own answer, looked up with ctypes in the loaded MPI
   library. Open MPI: ``MPIX_Query_cuda_support()`` (cuda) or ``MPIX_Query_rocm_support()``
   (hip, Open MPI 5); 1 is yes and 0 a definite no. MPICH (4.0+):
   ``MPIX_GPU_query_support(gpu_type, &ok)`` with ``MPIX_GPU_SUPPORT_CUDA = 0`` and
   ``MPIX_GPU_SUPPORT_HIP = 2`` (MPICH's ``mpi.h``/``mpix.h``); 0 is a no for MPICH itself, but
   not for its derivatives (Intel MPI, MVAPICH, Cray MPICH), which enable device buffers their
   own way. A missing symbol, an error code or an unknown MPI is "unknown", never "no";
3. **probe**: a child interpreter, started without the launcher's environment so that it
   initialises MPI alone (a singleton), sends a device buffer to itself on ``COMM_SELF`` and
   checks the bytes. A child that crashes or hangs while MPI moves the buffer means "no"; a
   child that cannot reach that point (no CuPy, no device, MPI will not start alone) means
   "unknown". The job itself never touches a device buffer to find out;
4. **default**: no (staging through host memory is always correct).

:func:`decide_gpu_aware` is the pure decision over the layers' answers; :func:`detect_gpu_aware`
runs the layers lazily (the probe only when the layers above do not know);
:func:`agree_gpu_aware` makes every rank use the same decision: aware only if every rank is.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dtm_mpi.config import Config, GpuAwareMode, get_config
from dtm_mpi.errors import UsageError

__all__ = [
    "Answer",
    "GpuAwareness",
    "MPIX_GPU_SUPPORT",
    "agree_gpu_aware",
    "combine_gpu_aware",
    "decide_gpu_aware",
    "detect_gpu_aware",
    "mpi_symbol",
    "mpi_vendor",
    "parse_gpu_aware_mode",
    "probe_env",
    "probe_gpu_aware",
    "query_vendor",
    "read_probe",
    "setting_answer",
]

MPIX_GPU_SUPPORT = {"cuda": 0, "ze": 1, "hip": 2}
"""MPICH's ``MPIX_GPU_SUPPORT_CUDA``, ``_ZE`` and ``_HIP`` (type ids, not flags)."""

PROBE_TIMEOUT_S = 30.0


def _openmpi_major(library_version: str) -> int | None:
    """The major version of an ``Open MPI vX.Y.Z`` library string, or None."""
    import re

    m = re.search(r"Open MPI v(\d+)\.", library_version)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class GpuAwareness:
    """The decision: ``aware``; ``source`` the layer that decided (``setting``, ``vendor
    query``, ``probe`` or ``default``); ``detail`` why. ``agreed``: the same on every rank
    (from :func:`agree_gpu_aware`)."""

    aware: bool
    source: str
    detail: str
    agreed: bool = False

    def __str__(self) -> str:
        return f"{'yes' if self.aware else 'no'} ({self.source})"

    def describe(self) -> str:
        """One line for the run log: ``yes (vendor query: ...)``."""
        return f"{'yes' if self.aware else 'no'} ({self.source}: {self.detail})"


@dataclass(frozen=True, slots=True)
class Answer:
    """One layer's answer: ``aware`` True/False, or None when this layer does not know."""

    aware: bool | None
    detail: str


# --- layer 1: the setting ---------------------------------------------------------------------

_WORDS = {
    "yes": GpuAwareMode.YES,
    "1": GpuAwareMode.YES,
    "true": GpuAwareMode.YES,
    "on": GpuAwareMode.YES,
    "no": GpuAwareMode.NO,
    "0": GpuAwareMode.NO,
    "false": GpuAwareMode.NO,
    "off": GpuAwareMode.NO,
    "auto": GpuAwareMode.AUTO,
}


def parse_gpu_aware_mode(text: str, what: str = "--gpu-aware-mpi") -> GpuAwareMode:
    """``yes``/``no``/``auto`` (also 1/0, true/false, on/off); :class:`UsageError` otherwise."""
    mode = _WORDS.get(text.strip().lower())
    if mode is None:
        raise UsageError(f"{what}: expected yes, no or auto, got {text!r}")
    return mode


def setting_answer(setting: str | GpuAwareMode | None, config: Config | None = None) -> Answer:
    """Layer 1: the command-line ``setting`` when given, else ``DTM_GPU_AWARE_MPI``."""
    if setting is None:
        mode = (config or get_config()).gpu_aware_mpi
        origin = f"DTM_GPU_AWARE_MPI={mode.value}"
    else:
        mode = setting if isinstance(setting, GpuAwareMode) else parse_gpu_aware_mode(setting)
        origin = f"--gpu-aware-mpi {mode.value}"
    aware = {GpuAwareMode.YES: True, GpuAwareMode.NO: False}.get(mode)
    return Answer(aware, origin)


# --- layer 2: the vendor query ----------------------------------------------------------------

_SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "MPIX_Query_cuda_support": (ctypes.c_int, ()),
    "MPIX_Query_rocm_support": (ctypes.c_int, ()),
    "MPIX_GPU_query_support": (ctypes.c_int, (ctypes.c_int, ctypes.POINTER(ctypes.c_int))),
}


def mpi_vendor(library_version: str) -> str:
    """``openmpi``, ``intel``, ``mvapich``, ``cray``, ``mpich`` or ``unknown``, from the first
    line of ``MPI_Get_library_version`` (later lines may name compilers and paths)."""
    low = (library_version.strip().splitlines() or [""])[0].lower()
    for needle, vendor in (
        ("open mpi", "openmpi"),
        ("intel", "intel"),
        ("mvapich", "mvapich"),
        ("cray", "cray"),
        ("mpich", "mpich"),
    ):
        if needle in low:
            return vendor
    return "unknown"


def _library_name(library_version: str) -> str:
    first = (library_version.strip().splitlines() or ["unknown MPI"])[0]
    return " ".join(first.split(",")[0].split())


def query_vendor(
    backend: str,
    *,
    library_version: str | None = None,
    lookup: Callable[[str], Callable[..., Any] | None] | None = None,
) -> Answer:
    """Layer 2: the MPI library's own answer for ``backend`` (``cuda`` or ``hip``). ``lookup``
    finds an MPI function by name (None when missing; default :func:`mpi_symbol`)."""
    if backend not in ("cuda", "hip"):
        return Answer(None, f"no vendor query for backend {backend!r}")
    if library_version is None or lookup is None:
        from mpi4py import MPI

        if not MPI.Is_initialized() or MPI.Is_finalized():
            return Answer(None, "MPI is not initialised: no vendor query")
        library_version = library_version or MPI.Get_library_version()
        lookup = lookup or mpi_symbol
    vendor, lib = mpi_vendor(library_version), _library_name(library_version)
    if vendor == "openmpi":
        name = "MPIX_Query_cuda_support" if backend == "cuda" else "MPIX_Query_rocm_support"
        fn = lookup(name)
        if fn is None:
            return Answer(None, f"{lib}: no {name}() in the library")
        got = int(fn())
        # Before Open MPI 5 the query answers how the library was *built* (a CUDA build with
        # CUDA switched off at run time still says 1); from 5.0 a CUDA-aware build may say 0
        # until CUDA is initialised (ompi#7963, #11070). So only the safe answer is trusted:
        # 0 before 5, 1 from 5; the other goes on to the probe.
        major = _openmpi_major(library_version)
        trusted = (got == 0) if major is not None and major < 5 else (got == 1)
        if not trusted:
            return Answer(
                None, f"{lib}: {name}() returned {got}, which this version does not settle"
            )
        return Answer(got == 1, f"{lib}: {name}() returned {got}")
    if vendor in ("mpich", "intel", "mvapich", "cray"):
        name = "MPIX_GPU_query_support"
        fn = lookup(name)
        if fn is None:
            return Answer(None, f"{lib}: no {name}() in the library")
        ok = ctypes.c_int(0)
        kind = f"MPIX_GPU_SUPPORT_{backend.upper()}"
        rc = int(fn(ctypes.c_int(MPIX_GPU_SUPPORT[backend]), ctypes.pointer(ok)))
        call = f"{name}({kind})"
        if rc != 0:
            return Answer(None, f"{lib}: {call} failed with error code {rc}")
        if ok.value:
            return Answer(True, f"{lib}: {call} says supported")
        if vendor == "mpich":
            return Answer(False, f"{lib}: {call} says not supported")
        return Answer(
            None,
            f"{lib}: {call} says not supported, but {vendor} enables device "
            "buffers its own way (not taken as a no)",
        )
    return Answer(None, f"{lib}: no vendor query known for this MPI")


def mpi_symbol(name: str) -> Callable[..., Any] | None:
    """The MPI library function ``name`` (one of the queries above) from the MPI library this
    process has loaded, or None. Looks in the process's global namespace (mpi4py loads the
    library globally), then in each ``libmpi*`` mapped into the process, then in what
    ``ctypes.util.find_library('mpi')`` names; never loads a second MPI library
    (``RTLD_NOLOAD``)."""
    restype, argtypes = _SIGNATURES[name]
    for lib in _mpi_libraries():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
            return fn  # type: ignore[no-any-return]
    return None


def _mpi_libraries() -> Iterator[Any]:
    yield ctypes.CDLL(None)
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if os.path.basename(path).startswith("libmpi") and path not in paths:
                    paths.append(path)
    except OSError:  # not Linux
        pass
    from ctypes.util import find_library

    found = find_library("mpi")
    for path in [*paths, *([found] if found else [])]:
        try:
            yield ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:  # not loaded in this process: not the MPI we run on
            continue


# --- layer 3: the probe -----------------------------------------------------------------------

_PROBE_SCRIPT = r"""
import sys
backend, device = sys.argv[1], sys.argv[2]
def say(text):
    print(text, flush=True)
try:
    import cupy
    built = "hip" if cupy.cuda.runtime.is_hip else "cuda"
    if built != backend:
        say(f"unknown: CuPy is built for {built}, not {backend}")
        sys.exit(0)
    if cupy.cuda.runtime.getDeviceCount() < 1:
        say("unknown: no device is visible")
        sys.exit(0)
    if device != "-":
        cupy.cuda.Device(int(device)).use()
    a = cupy.arange(1 << 16, dtype=cupy.uint32) * 2654435761
    b = cupy.zeros_like(a)
    s = cupy.arange(1 << 10, dtype=cupy.float32)
    t = cupy.zeros_like(s)
    cupy.cuda.runtime.deviceSynchronize()
except Exception as exc:
    say(f"unknown: no usable device: {type(exc).__name__}: {exc}")
    sys.exit(0)
say("stage: mpi")
from mpi4py import MPI
say("stage: transfer")
try:
    MPI.COMM_SELF.Sendrecv([a, MPI.UINT32_T], 0, 7, [b, MPI.UINT32_T], 0, 7)
    MPI.COMM_SELF.Allreduce([s, MPI.FLOAT], [t, MPI.FLOAT], op=MPI.SUM)
    cupy.cuda.runtime.deviceSynchronize()
    same = bool((a == b).all()) and bool((s == t).all())
except Exception as exc:
    say(f"result: no: MPI refused a device buffer: {type(exc).__name__}: {exc}")
    sys.exit(0)
say("result: yes" if same else "result: no: the bytes that arrived differ from those sent")
"""

_LAUNCHER_PREFIXES = (
    "OMPI_",
    "PMIX_",
    "PMI_",
    "PRTE_",
    "HYDRA_",
    "HYDI_",
    "MPI_LOCAL",
    "SLURM_",
    "PALS_",
    "FLUX_",
)
_KEEP = (
    "OMPI_MCA_pml",
    "OMPI_MCA_btl",
    "OMPI_MCA_mtl",
    "OMPI_MCA_coll",
    "OMPI_MCA_osc",
    "OMPI_MCA_opal_cuda",
    "OMPI_MCA_mpi_cuda",
    "OMPI_MCA_opal_common_ucx",
    "OMPI_MCA_accelerator",
    "OMPI_MCA_smsc",
)


def probe_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the launcher's wiring (Open MPI, PMIx, PMI, Hydra, Slurm, PALS,
    Flux), so that the child initialises MPI alone; the Open MPI transport settings that
    decide how device buffers move are kept."""
    env = {
        k: v
        for k, v in environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) or k.startswith(_KEEP)
    }
    env["OMPI_MCA_ess_singleton_isolated"] = "1"  # Open MPI 4: no daemon for a singleton
    return env


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals have no name
        return f"signal {number}"


def read_probe(
    rc: int | None, stdout: str, stderr: str, timed_out: bool, timeout_s: float
) -> Answer:
    """The probe child's outcome as an answer (pure)."""
    lines = [ln.strip() for ln in stdout.splitlines()]
    for ln in lines:
        if ln == "result: yes":
            return Answer(True, "a device buffer sent to itself on COMM_SELF arrived intact")
        if ln.startswith("result: no"):
            return Answer(False, ln.removeprefix("result: no:").strip())
        if ln.startswith("unknown:"):
            return Answer(None, "probe: " + ln.removeprefix("unknown:").strip())
    errors = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    telling = [ln for ln in errors if "Signal:" in ln or "rror" in ln] or errors[-2:]
    tail = " | ".join(telling[:2])[:300]
    how = (
        f"hung for {timeout_s:g} s"
        if timed_out
        else f"died with {_signal_name(-rc)}"
        if rc is not None and rc < 0
        else f"exited with code {rc}"
    )
    if "stage: transfer" in lines:
        return Answer(
            False,
            f"the probe child {how} while MPI moved a device buffer (MPI "
            f"treats device memory as host memory){': ' + tail if tail else ''}",
        )
    where = "starting MPI alone" if "stage: mpi" in lines else "before it reached MPI"
    return Answer(None, f"the probe child {how} {where}{': ' + tail if tail else ''}")


def probe_gpu_aware(
    backend: str,
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
    device: int | None = None,
    python: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Answer:
    """Layer 3: run the probe in a child interpreter (its own session, killed with everything
    it started at ``timeout_s``). Nothing here can crash or hang this process."""
    if backend not in ("cuda", "hip"):
        return Answer(None, f"no probe for backend {backend!r}")
    cmd = [
        python or sys.executable,
        "-c",
        _PROBE_SCRIPT,
        backend,
        "-" if device is None else str(device),
    ]
    env = probe_env(os.environ if environ is None else environ)
    try:
        child = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
        )
    except OSError as exc:
        return Answer(None, f"probe: cannot start {cmd[0]}: {exc}")
    timed_out = False
    out, err = "", ""
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_session(child)
        with contextlib.suppress(subprocess.TimeoutExpired):  # a grandchild holds the pipes
            out, err = child.communicate(timeout=5.0)
    finally:  # whatever ends the wait (the launcher's SIGTERM, Ctrl-C): no child outlives it
        if child.poll() is None:
            _kill_session(child)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5.0)
    return read_probe(child.returncode, out, err, timed_out, timeout_s)


def _kill_session(child: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # MPI's helpers too
        os.killpg(child.pid, signal.SIGKILL)


_PROBED: dict[tuple[str, int | None], Answer] = {}


def _probe_once(backend: str, device: int | None = None) -> Answer:
    """:func:`probe_gpu_aware` on ``device`` (this rank's GPU: a GPU in exclusive-process
    mode refuses a second context, and probing device 0 from every rank crowds it), once per
    process, backend and device; bounded by half of ``DTM_TIMEOUT`` (the peers wait for this
    rank's handshake meanwhile)."""
    from dtm_mpi.config import get_config

    key = (backend, device)
    if key not in _PROBED:
        limit = max(1.0, min(PROBE_TIMEOUT_S, get_config().timeout_s / 2))
        _PROBED[key] = probe_gpu_aware(backend, device=device, timeout_s=limit)
    return _PROBED[key]


def _asked(layer: Callable[[str], Answer], backend: str, what: str) -> Answer:
    """A layer's answer; a layer that fails does not know (this runs on one rank before any
    agreement: raising here would end the job instead of staging)."""
    try:
        return layer(backend)
    except Exception as exc:
        return Answer(None, f"{what} failed: {type(exc).__name__}: {exc}")


# --- the decision -----------------------------------------------------------------------------


def decide_gpu_aware(
    setting: Answer, vendor_query: Answer | None = None, probe: Answer | None = None
) -> GpuAwareness:
    """The first layer that answers decides; None: the layer did not run (pure)."""
    layers = (("setting", setting), ("vendor query", vendor_query), ("probe", probe))
    for source, answer in layers:
        if answer is not None and answer.aware is not None:
            return GpuAwareness(answer.aware, source, answer.detail)
    asked = "; ".join(f"{s}: {a.detail}" for s, a in layers if a is not None)
    return GpuAwareness(
        False, "default", f"no layer knows ({asked}); staging through host memory is always correct"
    )


def detect_gpu_aware(
    setting: str | GpuAwareMode | None,
    backend: str,
    *,
    config: Config | None = None,
    vendor_query: Callable[[str], Answer] = query_vendor,
    probe: Callable[[str], Answer] | None = None,
    device: int | None = None,
) -> GpuAwareness:
    """This rank's decision for ``backend``: the layers in order, each run only when those
    above do not know. ``setting``: the ``--gpu-aware-mpi`` value (None: the environment);
    ``device``: this rank's GPU (where the probe runs). Local: combine ranks with
    :func:`agree_gpu_aware`."""
    first = setting_answer(setting, config)
    if first.aware is not None:
        return decide_gpu_aware(first)
    second = _asked(vendor_query, backend, "the vendor query")
    if second.aware is not None:
        return decide_gpu_aware(first, second)
    probing = probe if probe is not None else (lambda b: _probe_once(b, device))
    return decide_gpu_aware(first, second, _asked(probing, backend, "the probe"))


def combine_gpu_aware(ranks: list[GpuAwareness]) -> GpuAwareness:
    """The job's decision from every rank's (in rank order): aware only if every rank is;
    otherwise the layer of the first rank that is not, and the ranks that are not (pure)."""
    no = [r for r, a in enumerate(ranks) if not a.aware]
    if not no:
        first = ranks[0]
        same = all(a.source == first.source for a in ranks)
        detail = (
            first.detail
            if len(ranks) == 1 or same
            else f"every rank ({', '.join(sorted({a.source for a in ranks}))})"
        )
        return GpuAwareness(True, first.source, detail, agreed=True)
    shown = "; ".join(f"rank {r}: {ranks[r].source}: {ranks[r].detail}" for r in no[:4])
    more = f"; and {len(no) - 4} more" if len(no) > 4 else ""
    names = ", ".join(map(str, no))
    detail = (
        ranks[0].detail
        if len(ranks) == 1
        else f"not GPU-aware on rank(s) {names} of {len(ranks)}: {shown}{more}"
    )
    return GpuAwareness(False, ranks[no[0]].source, detail, agreed=True)


def agree_gpu_aware(
    session_or_comm: Any, local: GpuAwareness, *, timeout_s: float | None = None
) -> GpuAwareness:
    """The same decision on every rank (:func:`combine_gpu_aware` of every rank's ``local``),
    over an :class:`~dtm_mpi.comm.mpi_session.MpiSession` (its deadline) or an mpi4py
    communicator (``timeout_s``, default ``DTM_TIMEOUT``). A bounded wait.

    Collective: call on all ranks."""
    from dtm_mpi.comm.mpi_session import MpiSession
    from dtm_mpi.comm.objects import allgather_obj

    if isinstance(session_or_comm, MpiSession):
        session_or_comm.check()
        comm, phase = session_or_comm.comm, session_or_comm.phase
        limit = session_or_comm.timeout_s if timeout_s is None else timeout_s
    else:
        comm, phase = session_or_comm, "gpu-aware mpi"
        limit = get_config().timeout_s if timeout_s is None else timeout_s
    mine = (local.aware, local.source, local.detail)
    everyone = allgather_obj(comm, mine, timeout_s=limit, what="gpu-aware agreement", phase=phase)
    return combine_gpu_aware([GpuAwareness(bool(a), str(s), str(d)) for a, s, d in everyone])
