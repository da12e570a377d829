"""The program hash (docs/spec/ir.md §11.3): a module's hash with its layouts erased, what a
checkpoint records of the program whose state it holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtm_mpi.errors import UsageError
from dtm_mpi.io.checkpoint import Restored
from dtm_mpi.ir import module_hash, parse_module, verify_module
from dtm_mpi.ir.hashing import program_hash
from dtm_mpi.runtime.checkpoints import check_resumable, state_hashes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def tp_mlp(text_edit: dict[str, str] | None = None) -> object:
    text = (EXAMPLES / "tp_mlp.dtm").read_text()
    for a, b in (text_edit or {}).items():
        text = text.replace(a, b)
    module = parse_module(text, "tp_mlp.dtm")
    verify_module(module)
    return module


def test_the_program_hash_is_versioned_and_erases_only_layouts() -> None:
    m = tp_mlp()
    h = program_hash(m)  # type: ignore[arg-type]
    assert re.fullmatch(r"dtm-ph1:[0-9a-f]{64}", h)
    assert h != module_hash(m)  # type: ignore[arg-type]
    # another mesh size, the same program
    resized = tp_mlp({"mesh @m = [dp=2, tp=2]": "mesh @m = [dp=4, tp=1]"})
    assert program_hash(resized) == h  # type: ignore[arg-type]
    assert module_hash(resized) != module_hash(m)  # type: ignore[arg-type]
    # another value: another program
    other = tp_mlp({"seed=1, std=0.02": "seed=9, std=0.02"})
    assert program_hash(other) != h  # type: ignore[arg-type]
    lr = tp_mlp({"constant 0.0001220703125": "constant 0.000244140625"})
    assert program_hash(lr) != h  # type: ignore[arg-type]


def test_resume_accepts_the_program_hash_and_an_earlier_versions_module_hash() -> None:
    m = tp_mlp()
    hashes = state_hashes(m)  # type: ignore[arg-type]
    assert hashes[:2] == (program_hash(m), module_hash(m))  # type: ignore[arg-type]
    assert len(hashes) == 3 and hashes[2] not in hashes[:2]  # with the accumulation axis
    for recorded in hashes:
        check_resumable(Restored(3, Path("ckpt-3"), {}, recorded), hashes, 10)
    with pytest.raises(UsageError, match=r"written by program dtm-ph1:0+; this one is dtm-ph1:"):
        check_resumable(Restored(3, Path("ckpt-3"), {}, "dtm-ph1:" + "0" * 64), hashes, 10)
