"""Environment options: parsed once, frozen, bad values named."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtm_mpi.comm.buffers import tune_allocator
from dtm_mpi.config import (
    ENV_VARS,
    Config,
    EnvVar,
    FaultKind,
    FaultSpec,
    GpuAwareMode,
    get_config,
    launcher_node_ranks,
    load_config,
)
from dtm_mpi.errors import ConfigError
from dtm_mpi.kernels import sources
from dtm_mpi.kernels.backends import BackendKind
from dtm_mpi.kernels.devices import ArrayBackend


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
        ({"DTM_FAULT": "1:allreduce:explode"}, "KIND must be one of raise, hang, exit, corrupt"),
        ({"DTM_DETERMINISTIC": "maybe"}, "DTM_DETERMINISTIC"),
        ({"DTM_DETERMINISTIC_MATMUL": "exact"}, "DTM_DETERMINISTIC_MATMUL: expected full or fast"),
        ({"DTM_MAX_MSG_ELEMS": "0"}, "DTM_MAX_MSG_ELEMS: must be >= 1"),
        ({"DTM_GPU_AWARE_MPI": "perhaps"}, "DTM_GPU_AWARE_MPI"),
        ({"DTM_LOG": "loud"}, "DTM_LOG"),
        ({"DTM_CKPT_VERIFY": "some"}, "DTM_CKPT_VERIFY: expected manifest or full"),
        ({"DTM_CKPT_HASH_THREAD": "two"}, "DTM_CKPT_HASH_THREAD: expected auto, 1/true"),
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


@pytest.mark.parametrize(
    ("raw", "want"), [("1", "yes"), ("true", "yes"), ("0", "no"), ("off", "no"), ("auto", "auto")]
)
def test_gpu_aware_accepts_numeric_aliases(raw: str, want: str) -> None:
    assert load_config({"DTM_GPU_AWARE_MPI": raw}).gpu_aware_mpi.value == want


@pytest.mark.parametrize(
    ("raw", "want"), [("1", 1), ("4", 4), (" 2 ", 2), ("all", 0), ("ALL", 0), ("16", 16)]
)
def test_ckpt_ranks_per_file(raw: str, want: int) -> None:
    """Ranks sharing one data file of a checkpoint: an integer >= 1, or ``all`` (stored as 0:
    every rank of the job in one file, as ``plan_save`` reads it)."""
    assert load_config({"DTM_CKPT_RANKS_PER_FILE": raw}).ckpt_ranks_per_file == want
    assert load_config({}).ckpt_ranks_per_file == 1  # the default: one file per rank


# --- one parser for yes/no variables ----------------------------------------------------------

_YES_NO = [
    ("DTM_FUSE", "fuse", True),
    ("DTM_MALLOPT", "mallopt", True),
    ("DTM_DETERMINISTIC", "deterministic", False),
]


@pytest.mark.parametrize(("name", "field", "default"), _YES_NO)
@pytest.mark.parametrize("raw", ["0", "false", "no", "off", "FALSE", " Off "])
def test_yes_no_off_words(name: str, field: str, default: bool, raw: str) -> None:
    assert getattr(load_config({name: raw}), field) is False


@pytest.mark.parametrize(("name", "field", "default"), _YES_NO)
@pytest.mark.parametrize("raw", ["1", "true", "yes", "on", "True", " ON "])
def test_yes_no_on_words(name: str, field: str, default: bool, raw: str) -> None:
    assert getattr(load_config({name: raw}), field) is True


@pytest.mark.parametrize(("name", "field", "default"), _YES_NO)
def test_yes_no_default_and_bad_value(name: str, field: str, default: bool) -> None:
    assert getattr(load_config({}), field) is default
    assert getattr(load_config({name: ""}), field) is default  # empty: as if unset
    with pytest.raises(ConfigError) as info:
        load_config({name: "maybe"})
    message = str(info.value)
    assert message.startswith(f"{name}: ") and "'maybe'" in message
    for word in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        assert word in message


def test_kernel_dir() -> None:
    assert load_config({}).kernel_dir is None
    assert load_config({"DTM_KERNEL_DIR": "  "}).kernel_dir is None
    assert load_config({"DTM_KERNEL_DIR": " /opt/k "}).kernel_dir == "/opt/k"


@pytest.fixture
def fresh_config(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """``monkeypatch`` whose environment changes :func:`get_config` sees (its cache cleared
    before and after)."""
    get_config.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    get_config.cache_clear()


@pytest.mark.parametrize("raw", ["false", "no", "off", "0"])
def test_fuse_false_turns_fusion_off(fresh_config: pytest.MonkeyPatch, raw: str) -> None:
    """Regression: ``DTM_FUSE=false`` left fusion on (only 0/off/no were understood)."""
    gpu = ArrayBackend(BackendKind.CUDA, device=0, ops=object())
    fresh_config.setenv("DTM_FUSE", "1")
    assert gpu.fuses
    get_config.cache_clear()
    fresh_config.setenv("DTM_FUSE", raw)
    assert not gpu.fuses
    assert not ArrayBackend(BackendKind.NUMPY).fuses  # the reference never fuses


def test_fuse_bad_value_is_an_error(fresh_config: pytest.MonkeyPatch) -> None:
    fresh_config.setenv("DTM_FUSE", "fast")
    with pytest.raises(ConfigError, match=r"^DTM_FUSE: expected one of .*got 'fast'"):
        _ = ArrayBackend(BackendKind.CUDA, device=0, ops=object()).fuses


def test_mallopt_off(fresh_config: pytest.MonkeyPatch) -> None:
    fresh_config.setenv("DTM_MALLOPT", "false")
    assert tune_allocator() is False


def test_kernel_dir_from_config(fresh_config: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / sources.HEADER).write_text("// header\n")
    fresh_config.setenv("DTM_KERNEL_DIR", str(tmp_path))
    sources.kernel_dir.cache_clear()
    try:
        assert sources.kernel_dir() == tmp_path
    finally:
        sources.kernel_dir.cache_clear()


# --- every variable in one place, and in README.md's table ------------------------------------

README = Path(__file__).parents[1] / "README.md"


def _readme_table() -> dict[str, str]:
    """The rows of README.md's "Configuration" table: variable -> default (backticks off)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`DTM_"):
            name = cells[0].strip("`")
            assert name not in rows, f"README.md lists {name} twice"
            rows[name] = cells[1].strip("`")
    return rows


def test_env_vars_cover_every_config_field() -> None:
    names = [v.name for v in ENV_VARS]
    assert len(set(names)) == len(names)
    assert sorted(v.field for v in ENV_VARS) == sorted(f.name for f in dataclasses.fields(Config))


@pytest.mark.parametrize("var", ENV_VARS, ids=[v.name for v in ENV_VARS])
def test_stated_default_is_the_config_default(var: EnvVar) -> None:
    default = getattr(Config(), var.field)
    if var.default == "—":
        assert default in (None, ()), (
            f"{var.name} is unset by default, but the field is {default!r}"
        )
    else:
        assert var.parse(var.name, var.default) == default
        assert getattr(load_config({var.name: var.default}), var.field) == default


def test_readme_table_matches_config() -> None:
    """README.md's table lists exactly the variables Config reads, each with its default."""
    table = _readme_table()
    stated = {v.name: v.default for v in ENV_VARS}
    assert sorted(table) == sorted(stated), "README.md's Configuration table and ENV_VARS differ"
    for name, default in stated.items():
        assert table[name] == default, (
            f"README.md gives {name} default {table[name]!r}, Config {default!r}"
        )


def test_readme_table_is_in_env_vars_order() -> None:
    assert list(_readme_table()) == [v.name for v in ENV_VARS]


@pytest.mark.parametrize(
    ("raw", "want"), [("auto", None), ("", None), (" AUTO ", None), ("1", True), ("off", False)]
)
def test_ckpt_hash_thread(raw: str, want: bool | None) -> None:
    assert load_config({"DTM_CKPT_HASH_THREAD": raw}).ckpt_hash_thread is want


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4),
        ({"MPI_LOCALNRANKS": "3", "SLURM_NTASKS_PER_NODE": "8"}, 3),
        ({"SLURM_NTASKS_PER_NODE": "2(x3)"}, 2),
        ({"SLURM_NTASKS_PER_NODE": "5,3"}, 5),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "0", "SLURM_NTASKS_PER_NODE": "x"}, None),
    ],
)
def test_launcher_node_ranks(env: dict[str, str], want: int | None) -> None:
    assert launcher_node_ranks(env) == want


@pytest.mark.parametrize(
    ("local_size", "env", "cpus", "want"),
    [
        (1, {}, 2, None),  # alone on its node: the library decides
        (3, {"OMP_NUM_THREADS": "2"}, 2, None),  # the user decided
        (3, {"OPENBLAS_NUM_THREADS": "1"}, 2, None),
        (3, {"OMP_NUM_THREADS": " "}, 2, "share"),  # (blank: not set)
        (3, {}, 2, "share"),  # unbound: the node's CPUs divided, at least 1
        (2, {}, 1, 1),  # bound to one CPU: that one
    ],
)
def test_a_rank_s_blas_threads_are_its_share_of_the_node(
    local_size: int, env: dict[str, str], cpus: int, want: int | str | None
) -> None:
    import os

    from dtm_mpi.config import blas_threads_share

    node = os.cpu_count() or 1
    bound = node if cpus >= 2 else 1  # "2": the whole node (as under --bind-to none)
    got = blas_threads_share(local_size, env, cpus=bound)
    assert got == (max(1, node // local_size) if want == "share" else want)


@pytest.mark.parametrize(("raw", "want"), [("", "full"), ("full", "full"), (" FAST ", "fast")])
def test_the_deterministic_matmul_precision(raw: str, want: str) -> None:
    assert load_config({"DTM_DETERMINISTIC_MATMUL": raw}).deterministic_matmul == want
    assert load_config({}).deterministic_matmul == "full"
