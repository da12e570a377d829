"""``dtm ckpt verify`` on damaged HDF5 *metadata* (not only data): a flipped byte in a data
file's or the main file's object headers, heaps and B-trees is reported like any other damage
-- ``DAMAGED <file>: tensor 't' shard 's': ...`` or ``INVALID <checkpoint>: ...``, exit 1 --
never an internal error with a traceback; and when the HDF5 library itself crashes or loops on
the damage, the verification (run in a child process) names the tensor, shard and file it was
reading and checks the rest. Also: ``--all`` counts damaged checkpoints, not problems; a store
path that is a file is a one-line storage error.

Single process, stores saved on the self communicator (one data file, ``data-000000.h5``)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.errors import StorageError
from dtm_mpi.io.ckpt_files import MAIN_FILE, Verifier
from dtm_mpi.io.store import committed_name
from dtm_mpi.io.tools import CheckStatus, verify_isolated
from dtm_mpi.io.verification import VerifyItem
from tests.io.io_helpers import flip_byte
from tests.test_cli_run import dtm
from tests.test_cli_store import DATA, STORED, comm, make_store

FLIPS_DATA = 40
FLIPS_MAIN = 25


def _data_ranges(path: Path) -> list[tuple[int, int]]:
    """[start, end) of every dataset's contiguous data in the HDF5 file ``path``."""
    import h5py

    out: list[tuple[int, int]] = []

    def visit(_: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and obj.id.get_offset() is not None:
            start = int(obj.id.get_offset())
            out.append((start, start + int(obj.id.get_storage_size())))

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return out


def metadata_offsets(path: Path) -> list[int]:
    """Every byte offset of ``path`` that is HDF5 metadata (superblock, object headers,
    heaps, B-trees, attributes), not dataset data."""
    ranges = _data_ranges(path)
    return [i for i in range(path.stat().st_size) if not any(a <= i < b for a, b in ranges)]


def object_header(path: Path, dataset: str) -> int:
    """The file address of ``dataset``'s object header."""
    import h5py

    with h5py.File(path, "r") as f:
        return int(h5py.h5g.get_objinfo(f.id, dataset.encode()).objno[0])


def flip_at(path: Path, offset: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with one committed checkpoint (step 1)."""
    return make_store(tmp_path_factory.mktemp("good") / "s", steps=(1,))


def _damaged_copy(good: Path, where: Path, file: str, offset: int, mask: int) -> Path:
    shutil.copytree(good, where)
    flip_at(where / committed_name(1) / file, offset, mask)
    return where


def _check_report(code: int, out: str, err: str, ckpt: Path, where: str) -> set[str]:
    """The verify run's output is a clean report; returns the tensors it names damaged."""
    assert "Traceback" not in err and "internal error" not in err, (where, err)
    assert code in (0, 1), (where, code, out, err)
    if code == 0:
        assert out.startswith(f"ok {ckpt}: "), (where, out)
        return set()
    lines = out.splitlines()
    assert lines, (where, err)
    named: set[str] = set()
    for line in lines:
        if line.startswith("INVALID "):
            assert line.startswith(f"INVALID {ckpt}: "), (where, line)
            continue
        assert line.startswith(f"DAMAGED {ckpt}/"), (where, line)
        assert " tensor '" in line and " shard '" in line, (where, line)
        named.add(line.split(" tensor '", 1)[1].split("'", 1)[0])
    assert len(err.strip().splitlines()) == 1 and "dtm ckpt verify: 1 of 1 checkpoint(s)" in err, (
        where,
        err,
    )
    return named


def test_a_damaged_dataset_object_header_is_reported_naming_tensor_shard_and_file(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The version byte of each shard dataset's object header (HDF5 refuses the header):
    verify names that tensor, its shard and the data file, and only that tensor."""
    data = good / committed_name(1) / DATA
    for k, name in enumerate(STORED):
        bad = _damaged_copy(
            good, tmp_path / f"s{k}", DATA, object_header(data, f"/shards/{name}/0"), 0x06
        )
        ckpt = bad / committed_name(1)
        code, out, err = dtm(capsys, "ckpt", "verify", str(bad))
        named = _check_report(code, out, err, ckpt, name)
        assert code == 1 and named == {name}, (name, out, err)
        assert f"DAMAGED {ckpt / DATA}: tensor {name!r} shard '{name}:shard:0': " in out, out
        shutil.rmtree(bad)


@pytest.mark.parametrize(("file", "flips"), [(DATA, FLIPS_DATA), (MAIN_FILE, FLIPS_MAIN)])
def test_flipped_metadata_bytes_are_reported_never_an_internal_error(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], file: str, flips: int
) -> None:
    """Seeded flips over every metadata byte of the file: each run ends with a report (ok
    when HDF5 never reads the byte), and together they find damage."""
    offsets = metadata_offsets(good / committed_name(1) / file)
    rng = np.random.default_rng(5 if file == DATA else 6)
    picks = rng.choice(offsets, size=flips, replace=False).tolist()
    masks = rng.integers(1, 256, size=flips).tolist()
    found = 0
    for k, (offset, mask) in enumerate(zip(picks, masks, strict=True)):
        bad = _damaged_copy(good, tmp_path / f"s{k}", file, offset, mask)
        code, out, err = dtm(capsys, "ckpt", "verify", str(bad))
        _check_report(
            code, out, err, bad / committed_name(1), f"{file} byte {offset} ^ {mask:#04x}"
        )
        found += code == 1
        shutil.rmtree(bad)
    assert found >= flips // 10, f"only {found} of {flips} flips were found"


def _patched_check(monkeypatch: pytest.MonkeyPatch, crash: str, hang: str) -> None:
    """Make the verification crash (SIGSEGV, as HDF5 does on some damage) at shard
    ``crash`` and loop at shard ``hang``: the child is a fork (as in a process without MPI),
    so the patch applies there."""
    import dtm_mpi.io.tools as tools

    monkeypatch.setattr(tools, "_in_mpi", lambda: False)
    original = Verifier.check

    def check(self: Verifier, item: VerifyItem) -> object:
        if item.shard == crash:
            os.kill(os.getpid(), signal.SIGSEGV)
        if item.shard == hang:
            time.sleep(3600)
        return original(self, item)

    monkeypatch.setattr(Verifier, "check", check)


def test_a_crash_or_a_hang_of_hdf5_is_reported_as_that_shards_damage(
    good: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = good / committed_name(1)
    _patched_check(monkeypatch, "v:shard:0", "mask:shard:0")
    start = time.monotonic()
    got = verify_isolated(ckpt, timeout_s=4)
    assert time.monotonic() - start < 60
    assert got.status is CheckStatus.DAMAGED, got
    assert len(got.problems) == 2, got.problems
    crash, hang = got.problems
    assert crash.startswith(
        f"{ckpt / DATA}: tensor 'v' shard 'v:shard:0': the HDF5 library crashed (SIGSEGV)"
    ), crash
    assert hang.startswith(
        f"{ckpt / DATA}: tensor 'mask' shard 'mask:shard:0': no progress within 4 s"
    ), hang


def test_the_rest_is_verified_after_a_crash(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash at one shard does not hide damage in a later one."""
    bad = tmp_path / "s"
    shutil.copytree(good, bad)
    ckpt = bad / committed_name(1)
    flip_byte(ckpt / DATA, "/shards/mask/0", 0)
    _patched_check(monkeypatch, "v:shard:0", "-")
    got = verify_isolated(ckpt, timeout_s=30)
    assert [p.split(" shard ")[0].rsplit(" ", 1)[1] for p in got.problems] == ["'v'", "'mask'"], (
        got.problems
    )


def test_a_crash_reading_the_main_file_is_an_invalid_checkpoint(
    good: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dtm_mpi.io.tools as tools

    def crash(*_: object) -> None:
        os.kill(os.getpid(), signal.SIGSEGV)

    monkeypatch.setattr(tools, "_in_mpi", lambda: False)  # a fork: the patch applies
    monkeypatch.setattr(tools, "read_manifest", crash)
    ckpt = good / committed_name(1)
    got = verify_isolated(ckpt, timeout_s=30)
    assert got.status is CheckStatus.INVALID
    assert got.problems == (
        f"{MAIN_FILE} cannot be read: the HDF5 library crashed (SIGSEGV) reading it",
    )


@pytest.mark.parametrize("mpi", [False, True], ids=["fork", "spawned"])
def test_in_an_mpi_process_the_child_is_a_new_interpreter(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mpi: bool
) -> None:
    """Where the caller has initialised MPI the verification child is spawned (a fork of an
    MPI process is unsafe) and finds the same damage."""
    import dtm_mpi.io.tools as tools

    monkeypatch.setattr(tools, "_in_mpi", lambda: mpi)
    spawned: list[int] = []
    real = tools._spawn_child
    monkeypatch.setattr(tools, "_spawn_child", lambda *a: spawned.append(1) or real(*a))
    bad = tmp_path / "s"
    shutil.copytree(good, bad)
    ckpt = bad / committed_name(1)
    assert verify_isolated(ckpt, timeout_s=60).status is CheckStatus.OK
    flip_byte(ckpt / DATA, "/shards/mask/0", 0)
    got = verify_isolated(ckpt, timeout_s=60)
    assert (
        got.status is CheckStatus.DAMAGED and len(got.problems) == 1 and "'mask'" in got.problems[0]
    ), got
    assert bool(spawned) == mpi


def test_in_mpi_never_initialises_mpi() -> None:
    import subprocess
    import sys

    code = "from dtm_mpi.io.tools import _in_mpi as m; a = m(); from mpi4py import MPI; MPI.COMM_WORLD.Get_rank(); print(a, m())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True"]


def test_verify_all_counts_damaged_checkpoints_not_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store(tmp_path / "s", steps=(1, 2))
    flip_byte(store / committed_name(2) / DATA, "/shards/w/0", 3)
    flip_byte(store / committed_name(2) / DATA, "/shards/v/0", 3)
    code, out, err = dtm(capsys, "ckpt", "verify", str(store), "--all")
    assert code == 1
    assert out.count("DAMAGED ") == 2 and f"ok {store / committed_name(1)}: " in out, out
    assert err == f"dtm ckpt verify: 1 of 2 checkpoint(s) of {store} failed (2 problem(s))\n", err


def test_a_store_path_that_is_a_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "afile"
    path.write_text("x")
    with pytest.raises(StorageError) as info:
        make_store(path)
    assert str(info.value) == f"store {path}: is a file, not a directory", str(info.value)
    with pytest.raises(StorageError) as info:
        make_store(path / "sub")
    assert (
        str(info.value)
        == f"store {path / 'sub'}: cannot be created: {path} is a file, not a directory"
    )
    assert comm() is not None
