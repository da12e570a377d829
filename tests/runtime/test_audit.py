"""The replica audit on simulated ranks: its replica groups from the layouts (and a
pipeline's stages), the verdict by majority, a bit flipped in one rank's state (``DTM_FAULT=
RANK:state:flip``) caught at the next audit and named on every rank, no checkpoint written
after it, and the option's checks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.cli import run
from dtm_mpi.config import ConfigError, load_config
from dtm_mpi.io.store import list_checkpoints
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.runtime.audit import Audited, divergences, replica_groups
from dtm_mpi.sharding.mesh import MeshShape

ROOT = Path(__file__).resolve().parents[2]
DP_STEP = str(ROOT / "examples" / "dp_step.dtm")

STATE = """dtm 1.0
module a
mesh @m = [dp=2, tp=2]
entry func @f(state %rep: f32[6] init zeros, state %col: f32[4,6]{-,tp} init zeros,
              %x: f32[2] init zeros) -> f32[6] updates %rep on @m {
  return %rep
}
"""


def test_replica_groups_are_the_ranks_on_the_same_block() -> None:
    module = parse_module(STATE, "a.dtm")
    verify_module(module)
    entry = module.entry
    assert entry is not None
    mesh = MeshShape((("dp", 2), ("tp", 2)))
    audited, alone = replica_groups(entry, mesh)
    assert audited == (
        Audited(0, "rep", ((0, 1, 2, 3),)),  # replicated: every rank holds the same block
        Audited(1, "col", ((0, 2), (1, 3))),  # split over tp: the dp replicas of each block
    )
    assert alone == ()  # (%x is no state: not audited)
    # a pipeline's stage holds its tensors on its ranks only: dp=2 x pp=2, %rep on pp=1
    pp = MeshShape((("pp", 2), ("dp", 2)))
    text = STATE.replace("[dp=2, tp=2]", "[pp=2, dp=2]").replace("{-,tp}", "{-,dp}")
    module = parse_module(text, "a.dtm")
    verify_module(module)
    assert module.entry is not None
    audited, alone = replica_groups(module.entry, pp, {"rep": ("pp", 1), "col": ("pp", 0)})
    assert audited == (Audited(0, "rep", ((2, 3),)),)
    assert alone == ("col",)  # split over the stage's only replica axis: no replica


def test_the_verdict_names_the_odd_rank_by_majority() -> None:
    a = (Audited(0, "w", ((0, 1, 2),)), Audited(1, "b", ((0, 1),)))
    same = np.array([[5, 7], [5, 7], [5, 0]])  # rank 2 holds no b
    assert divergences(same, a) == []
    odd = np.array([[5, 7], [6, 7], [5, 0]])
    (found,) = divergences(odd, a)
    assert found.startswith("w on rank(s) 1 differs from its replicas on ranks 0, 1, 2")
    assert "00000004 on 2 of 3; rank 1 00000005" in found
    two = np.array([[5, 7], [5, 8], [5, 0]])  # two replicas: no majority, both named
    (found,) = divergences(two, a)
    assert (
        found
        == "b differs across its replicas on ranks 0, 1 (no majority: rank 0 00000006, rank 1 00000007)"
    )


@pytest.fixture(autouse=True)
def _no_audit_left(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``--audit-every`` sets DTM_AUDIT_EVERY for the process (and the processes it starts):
    recorded here first, so that it is gone again after the test."""
    from dtm_mpi.config import get_config

    monkeypatch.setenv("DTM_AUDIT_EVERY", "0")
    monkeypatch.delenv("DTM_FAULT", raising=False)
    get_config.cache_clear()
    yield
    monkeypatch.undo()
    get_config.cache_clear()


def dtm(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("victim", [0, 2, 3])
def test_a_flipped_state_bit_is_caught_at_the_next_audit_on_every_rank(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    victim: int,
) -> None:
    """dp=4: rank ``victim``'s block of a state tensor gets one bit flipped after step 0;
    the audit every 3 steps names it after step 3, the majority's and its checksums, and the
    checkpoint due after step 4 is never written (the one after step 2 was, and verifies)."""
    from dtm_mpi.config import get_config

    monkeypatch.setenv("DTM_FAULT", f"{victim}:state:flip")
    get_config.cache_clear()
    store = tmp_path / "store"
    try:
        code, out = dtm(
            capsys, "run", DP_STEP, "--sim", "4", "--steps", "8", "--audit-every", "3",
            "--store", str(store), "--checkpoint-every", "4",
        )  # fmt: skip
    finally:
        monkeypatch.delenv("DTM_FAULT")
        get_config.cache_clear()
    assert code != 0, out
    assert "replica audit after step 3: " in out, out
    assert f" on rank(s) {victim} differs from its replicas on ranks 0, 1, 2, 3" in out, out
    assert "on 3 of 4" in out and "Traceback" not in out, out
    assert list_checkpoints(store) == []  # due after step 4: never reached


def test_an_audit_before_every_checkpoint(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The audit runs before each checkpoint too (a period longer than the run's): the
    flip after step 0 is caught before the first save."""
    from dtm_mpi.config import get_config

    monkeypatch.setenv("DTM_FAULT", "1:state:flip")
    get_config.cache_clear()
    store = tmp_path / "store"
    try:
        code, out = dtm(
            capsys, "run", DP_STEP, "--sim", "2", "--mesh", "dp=2", "--steps", "6",
            "--audit-every", "100", "--store", str(store), "--checkpoint-every", "2",
        )  # fmt: skip
    finally:
        monkeypatch.delenv("DTM_FAULT")
        get_config.cache_clear()
    assert code != 0 and "replica audit after step 2: " in out, out
    assert "no majority" in out and list_checkpoints(store) == [], out


def test_a_clean_run_audits_and_ends_with_the_unaudited_bits(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:

    outs = []
    for audit in ("0", "1"):
        out = tmp_path / f"{audit}.npz"
        code, text = dtm(
            capsys, "run", DP_STEP, "--sim", "4", "--steps", "5", "--audit-every", audit,
            "-o", str(out),
        )  # fmt: skip
        assert code == 0, text
        outs.append(dict(np.load(out)))
    assert all(outs[0][k].tobytes() == outs[1][k].tobytes() for k in outs[0])


def test_the_options_are_checked() -> None:
    assert load_config({"DTM_AUDIT_EVERY": "100"}).audit_every == 100
    with pytest.raises(ConfigError, match="DTM_AUDIT_EVERY: must be >= 0"):
        load_config({"DTM_AUDIT_EVERY": "-1"})
    with pytest.raises(ConfigError, match="KIND flip goes with WHERE state"):
        load_config({"DTM_FAULT": "1:step:flip"})
    with pytest.raises(ConfigError, match="KIND flip goes with WHERE state"):
        load_config({"DTM_FAULT": "1:state:raise"})
