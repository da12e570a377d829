"""TensorBoard event files written without TensorBoard (dtm_mpi/frontend/event_file.py): the
framing and the Event messages read back by our reader and by TensorBoard's own (where it is
installed), from a writer and from ``fit(tensorboard=DIR)`` across a resume."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.event_file import EventWriter, encode_event, read_events
from tests.frontend.test_run_report import CFG as LLAMA_CFG
from tests.frontend.test_run_report import _loader, _step, fit_llama


def _only_file(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*"))


def test_a_writers_scalars_read_back_with_their_steps(tmp_path: Path) -> None:
    w = EventWriter(tmp_path / "tb")
    w.scalars(0, {"loss": 2.5, "lr": 1e-3})
    w.scalars(7, {"loss": 1.25, "grad_norm": math.inf})
    w.scalars(-1, {"x": -0.5})  # (an int64 step below zero: ten-byte varint)
    w.close()
    (path,) = _only_file(tmp_path / "tb")
    events = read_events(path)
    assert events[0]["file_version"] == "brain.Event:2"
    assert [e.get("step") for e in events[1:]] == [0, 7, -1]
    assert events[1]["scalars"] == {"loss": 2.5, "lr": np.float32(1e-3)}
    assert events[2]["scalars"] == {"loss": 1.25, "grad_norm": math.inf}
    assert all(isinstance(e["wall_time"], float) for e in events)


def test_the_record_framing_is_tensorflows(tmp_path: Path) -> None:
    """Length, masked CRC32C of the length, data, masked CRC32C of the data (the known
    masked CRC of TFRecord's empty record checks the mask and the polynomial)."""
    w = EventWriter(tmp_path)
    w.close()
    (path,) = _only_file(tmp_path)
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    assert len(raw) == 16 + n and raw[12 : 12 + n] == encode_event(
        struct.unpack_from("<d", raw, 13)[0]
    )
    from dtm_mpi.frontend.event_file import _masked_crc

    crc = 0xE3069283  # CRC32C's check value: crc32c(b"123456789")
    want = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF  # TensorFlow's mask
    assert _masked_crc(b"123456789") == want
    assert struct.unpack_from("<I", raw, 8)[0] == _masked_crc(raw[:8])


def test_a_damaged_or_cut_file_is_one_error_naming_the_file_and_record(tmp_path: Path) -> None:
    w = EventWriter(tmp_path)
    w.scalars(1, {"loss": 1.0})
    w.close()
    (path,) = _only_file(tmp_path)
    raw = bytearray(path.read_bytes())
    first = 16 + struct.unpack_from("<Q", raw)[0]
    damaged = tmp_path / "damaged.tfevents"
    raw[first + 20] ^= 0x01
    damaged.write_bytes(bytes(raw))
    with pytest.raises(
        UsageError,
        match=rf"damaged.tfevents: the data checksum of the record at byte {first} is wrong",
    ):
        read_events(damaged)
    cut = tmp_path / "cut.tfevents"
    cut.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(UsageError, match=rf"cut.tfevents: the record at byte {first} is cut short"):
        read_events(cut)


def test_a_directory_that_is_a_file_is_one_error_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    step = _step(dtm.nn.Llama(LLAMA_CFG, axis=None))
    with pytest.raises(UsageError, match=r"tensorboard directory .*f: not a directory"):
        dtm.fit(step, _loader, steps=1, sim=1, quiet=True, tensorboard=tmp_path / "f")


def test_fit_writes_each_steps_figures_and_a_resumed_run_a_second_file(tmp_path: Path) -> None:
    step = _step(dtm.nn.Llama(LLAMA_CFG, axis=None))
    tb, store = tmp_path / "tb", str(tmp_path / "s")
    got = fit_llama(step, store, 2, tensorboard=tb)
    (first,) = _only_file(tb)
    events = read_events(first)[1:]
    assert [e["step"] for e in events] == [0, 1]
    for e, m, t in zip(events, got.metrics, got.timings, strict=True):
        scalars = e["scalars"]
        assert isinstance(scalars, dict)
        assert scalars["loss"] == np.float32(m["loss"]) and scalars["lr"] == np.float32(m["lr"])
        assert scalars["tokens_per_s"] == np.float32(t["tokens_per_s"]) > 0
        assert {"mfu", "rss_gib", "step_s"} <= set(scalars)
    fit_llama(step, store, 3, resume=True, tensorboard=tb)
    files = _only_file(tb)
    assert len(files) == 2
    assert sorted(e["step"] for f in files for e in read_events(f)[1:]) == [0, 1, 2]

    # TensorBoard's own reader, where TensorBoard is installed
    pytest.importorskip(
        "tensorboard", reason="tensorboard is not installed (the test extra has it)"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert "loss" in acc.Tags()["scalars"]
    losses = [(s.step, s.value) for s in acc.Scalars("loss")]
    assert [s for s, _ in losses] == [0, 1, 2]
    assert losses[0][1] == pytest.approx(got.metrics[0]["loss"], rel=1e-6)
