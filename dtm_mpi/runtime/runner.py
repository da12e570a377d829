"""Running one :class:`~dtm_mpi.runtime.request.RunRequest` (``dtm run``, :func:`~dtm_mpi.frontend.fit.fit`) -- on N
simulated ranks in this process (``--sim N``), or on the ranks of ``mpirun``/``srun``
(:mod:`dtm_mpi.runtime.mpirun`). Both take the same steps from :mod:`dtm_mpi.runtime.request`:
the paths, the module, its capabilities and output keys (phase ``load``), the plan and the
memory limit (``plan``), the inputs and ``init store`` parameters (``inputs``), the summary and
the ``-o`` file (``output``)."""

from __future__ import annotations

from collections.abc import Callable

from dtm_mpi.runtime.request import RunRequest

__all__ = ["run_request"]


def run_request(make: Callable[[], RunRequest], sim: int | None) -> int:
    """Run the request ``make`` builds: on ``sim`` simulated ranks in this process, else on
    every rank of the job (collective; every rank first builds its own request and all agree
    that it is valid before any may exit, phase ``arguments``). The one place that decides the
    mode. Returns the exit code (0; 75 when stopped on a signal after saving), or raises / ends
    the job with one error."""
    if sim is None:
        from dtm_mpi.runtime.mpirun import run_under_mpi

        return run_under_mpi(make)
    request = make()
    assert request.sim == sim, "the request's --sim is the mode it runs in"
    return _run_simulated(request)


# --- the simulator ---------------------------------------------------------------------------


def _run_simulated(request: RunRequest) -> int:
    from dtm_mpi.comm.abort import stop_signals_caught
    from dtm_mpi.config import get_config
    from dtm_mpi.console import write_line
    from dtm_mpi.errors import RunStopped
    from dtm_mpi.runtime.request import (
        deliver_outputs,
        given_inputs,
        load_run,
        plan_run,
        read_store_globals,
        store_params,
    )
    from dtm_mpi.runtime.simulate import run_simulated

    assert request.sim is not None
    module = load_run(request)
    given = {} if request.resume else given_inputs(request, module)
    plan_run(module, request, request.sim)
    missing = [] if request.resume else store_params(module, given)
    if missing:
        assert request.store is not None
        given.update(read_store_globals(request.store, module, missing))
    try:
        with stop_signals_caught("dtm run") as stop:  # a signal: stop after a step, saved
            result = run_simulated(
                module,
                request.sim,
                binding=request.binding,
                inputs=given,
                steps=request.steps,
                backend=request.device.backend,
                timeout_s=get_config().timeout_s,
                hooks=request.hooks,
                checkpoint=request.checkpoint,
                progress=request.progress,
                stop=stop,
                pipeline=request.pipeline,
            )
    except RunStopped as stopped:  # every rank after the same step, the state saved
        write_line(f"dtm run: {stopped}")
        return int(stopped.code)  # type: ignore[arg-type]
    deliver_outputs(request, result.outputs())
    return 0
