"""Environment options: parsed once, frozen, bad values named."""

from __future__ import annotations

import dataclasses

import pytest

from dtm_mpi.config import Config, FaultKind, FaultSpec, GpuAwareMode, load_config
from dtm_mpi.errors import ConfigError


def test_defaults() -> None:
    cfg = load_config({})
    assert cfg == Config()
    assert cfg.timeout_s == 300.0 and cfg.faults == () and not cfg.deterministic


def test_all_options() -> None:
    cfg = load_config(
        {
            "DTM_TIMEOUT": "2.5",
            "DTM_FAULT": "1:allreduce:hang, 2:handshake:exit",
            "DTM_DETERMINISTIC": "yes",
            "DTM_MAX_MSG_ELEMS": "16",
            "DTM_GPU_AWARE_MPI": "NO",
            "DTM_LOG": "debug",
            "DTM_CKPT_VERIFY": "Full",
            "DTM_CKPT_RANKS_PER_FILE": "4",
        }
    )
    assert cfg.timeout_s == 2.5
    assert cfg.faults == (
        FaultSpec(1, "allreduce", FaultKind.HANG),
        FaultSpec(2, "handshake", FaultKind.EXIT),
    )
    assert cfg.fault_at(2, "handshake") == FaultSpec(2, "handshake", FaultKind.EXIT)
    assert cfg.fault_at(0, "handshake") is None
    assert cfg.deterministic and cfg.max_msg_elems == 16
    assert cfg.gpu_aware_mpi is GpuAwareMode.NO and cfg.log_level == "debug"
    assert cfg.ckpt_verify_full and not Config().ckpt_verify_full
    assert cfg.ckpt_ranks_per_file == 4 and Config().ckpt_ranks_per_file == 1


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().timeout_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"DTM_TIMEOUT": "soon"}, "DTM_TIMEOUT: expected a number"),
        ({"DTM_TIMEOUT": "-1"}, "DTM_TIMEOUT: must be a finite number > 0"),
        ({"DTM_TIMEOUT": "nan"}, "DTM_TIMEOUT: must be a finite number > 0"),
        ({"DTM_FAULT": "1:allreduce"}, "DTM_FAULT: expected RANK:WHERE:KIND"),
        ({"DTM_FAULT": "x:allreduce:raise"}, "RANK must be an integer"),
        ({"DTM_FAULT": "1::raise"}, "WHERE is empty"),
        ({"DTM_FAULT": "1:allreduce:explode"}, "KIND must be one of raise, hang, exit"),
        ({"DTM_DETERMINISTIC": "maybe"}, "DTM_DETERMINISTIC"),
        ({"DTM_MAX_MSG_ELEMS": "0"}, "DTM_MAX_MSG_ELEMS: must be >= 1"),
        ({"DTM_GPU_AWARE_MPI": "perhaps"}, "DTM_GPU_AWARE_MPI"),
        ({"DTM_LOG": "loud"}, "DTM_LOG"),
        ({"DTM_CKPT_VERIFY": "some"}, "DTM_CKPT_VERIFY: expected manifest or full"),
        (
            {"DTM_CKPT_RANKS_PER_FILE": "0"},
            "DTM_CKPT_RANKS_PER_FILE: expected an integer >= 1 or all, got '0'",
        ),
        (
            {"DTM_CKPT_RANKS_PER_FILE": "-1"},
            "DTM_CKPT_RANKS_PER_FILE: expected an integer >= 1 or all, got '-1'",
        ),
        (
            {"DTM_CKPT_RANKS_PER_FILE": "x"},
            "DTM_CKPT_RANKS_PER_FILE: expected an integer >= 1 or all, got 'x'",
        ),
        ({"DTM_CKPT_RANKS_PER_FILE": ""}, "DTM_CKPT_RANKS_PER_FILE"),
        ({"DTM_CKPT_RANKS_PER_FILE": "1.5"}, "DTM_CKPT_RANKS_PER_FILE"),
        (
            {"DTM_CKPT_RANKS_PER_FILE": "\u00b2"},
            "DTM_CKPT_RANKS_PER_FILE",
        ),  # a digit to str.isdigit, not to int()
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config(env)


@pytest.mark.parametrize(("raw", "want"), [("1", "yes"), ("true", "yes"), ("0", "no"), ("off", "no"), ("auto", "auto")])  # fmt: skip
def test_gpu_aware_accepts_numeric_aliases(raw: str, want: str) -> None:
    assert load_config({"DTM_GPU_AWARE_MPI": raw}).gpu_aware_mpi.value == want


@pytest.mark.parametrize(("raw", "want"), [("1", 1), ("4", 4), (" 2 ", 2), ("all", 0), ("ALL", 0), ("16", 16)])  # fmt: skip
def test_ckpt_ranks_per_file(raw: str, want: int) -> None:
    """Ranks sharing one data file of a checkpoint: an integer >= 1, or ``all`` (stored as 0:
    every rank of the job in one file, as ``plan_save`` reads it)."""
    assert load_config({"DTM_CKPT_RANKS_PER_FILE": raw}).ckpt_ranks_per_file == want
    assert load_config({}).ckpt_ranks_per_file == 1  # the default: one file per rank
