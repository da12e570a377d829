"""``dtm store export|import`` (dtm_mpi/io/interop.py): every dtm dtype goes out to safetensors
and npz and comes back with the same bits (bf16 as BFLOAT16); PyTorch reads the exported file
to the same values; a name map renames and selects; bad files and names are one clear line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi.cli import main
from dtm_mpi.errors import UsageError
from dtm_mpi.io.interop import export_tensors, import_tensors, read_file_tensors
from dtm_mpi.io.store import committed_name, read_latest
from dtm_mpi.io.tensor_map import read_tensor_map
from dtm_mpi.io.tools import put_tensors, read_manifest, read_tensor
from dtm_mpi.ir.types import DType
from tests.test_cli_store import comm

pytest.importorskip("safetensors", reason="safetensors is not installed (the interop extra)")


def _values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    bf16_bits = (f32.view(np.uint32) >> 16).astype(np.uint16)  # bf16 values, as put takes them
    return {
        "a.f16": rng.standard_normal((4, 2)).astype(np.float16),
        "a.bf16": bf16_bits,
        "a.f32": f32,
        "a.f64": rng.standard_normal(6),
        "a.i8": rng.integers(-128, 128, (2, 3)).astype(np.int8),
        "a.i32": rng.integers(-(2**31), 2**31, 5).astype(np.int32),
        "a.i64": rng.integers(-(2**62), 2**62, (1, 2)).astype(np.int64),
        "a.u8": rng.integers(0, 256, 7).astype(np.uint8),
        "a.bool": rng.integers(0, 2, (2, 2)).astype(bool),
        "scalar": np.array(3.5, np.float32),
    }


def _store(tmp_path: Path, name: str = "s") -> Path:
    store = tmp_path / name
    store.mkdir()
    put_tensors(store, comm(), _values())
    return store


def _stored(store: Path) -> dict[str, tuple[DType, bytes]]:
    step = read_latest(store)
    assert step is not None
    ckpt = store / committed_name(step)
    m = read_manifest(ckpt)
    return {a.name: (a.dtype, read_tensor(ckpt, a.name, m).tobytes()) for a in m.artifacts}


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_every_dtype_goes_out_and_back_with_the_same_bits(tmp_path: Path, suffix: str) -> None:
    store = _store(tmp_path)
    out = tmp_path / f"all{suffix}"
    moved = export_tensors(store, out)
    assert len(moved.tensors) == len(_values())
    back = tmp_path / "back"
    back.mkdir()
    import_tensors(back, out, comm())
    assert _stored(back) == _stored(store)
    got = read_file_tensors(out, suffix[1:])
    assert got["a.bf16"][0] is DType.BF16 and got["a.bf16"][1].dtype == np.uint16
    np.testing.assert_array_equal(got["a.bf16"][1], _values()["a.bf16"])


def test_pytorch_reads_the_export_to_the_same_values(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the bench extra)")
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    store = _store(tmp_path)
    out = tmp_path / "w.safetensors"
    export_tensors(store, out)
    got = load_file(str(out))
    assert got["a.bf16"].dtype == torch.bfloat16 and got["a.bool"].dtype == torch.bool
    want = _values()
    f32_of_bf16 = (want["a.bf16"].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got["a.bf16"].float().numpy(), f32_of_bf16)
    for k in ("a.f16", "a.f32", "a.f64", "a.i8", "a.i32", "a.i64", "a.u8", "a.bool", "scalar"):
        np.testing.assert_array_equal(got[k].numpy(), want[k], err_msg=k)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["dtm_step"] == "0"
    # and a file PyTorch wrote comes in
    from safetensors.torch import save_file

    theirs = tmp_path / "theirs.safetensors"
    save_file({"layer.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}, str(theirs))
    mine = tmp_path / "mine"
    mine.mkdir()
    import_tensors(mine, theirs, comm())
    ckpt = mine / committed_name(0)
    value = read_tensor(ckpt, "layer.weight")
    assert read_manifest(ckpt).artifact("layer.weight").dtype is DType.BF16
    np.testing.assert_array_equal(value, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_a_name_map_renames_and_selects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = _store(tmp_path)
    table = tmp_path / "map.toml"
    table.write_text('"a.f32" = "model.embed.weight"\nscalar = "model.scale"\n')
    out = tmp_path / "m.safetensors"
    assert main(["store", "export", str(store), "-o", str(out), "--map", str(table)]) == 0
    assert "a.f32 -> model.embed.weight: f32[3,5]" in capsys.readouterr().out
    assert sorted(read_file_tensors(out, "safetensors")) == ["model.embed.weight", "model.scale"]
    back = tmp_path / "back"
    back.mkdir()
    inverse = tmp_path / "inverse.json"
    inverse.write_text('{"model.embed.weight": "w"}')
    assert main(["store", "import", str(back), str(out), "--map", str(inverse)]) == 0
    assert sorted(_stored(back)) == ["w"]
    assert _stored(back)["w"] == _stored(store)["a.f32"]
    table.write_text('nothing = "x"\n')
    with pytest.raises(UsageError, match=r"has no tensor 'nothing' \(it has: a.bf16"):
        export_tensors(store, tmp_path / "n.npz", rename={"nothing": "x"})


def test_bad_files_names_and_formats_are_one_line(tmp_path: Path, monkeypatch: Any) -> None:
    store = _store(tmp_path)
    with pytest.raises(UsageError, match="say --format safetensors or npz"):
        export_tensors(store, tmp_path / "out.bin")
    with pytest.raises(UsageError, match=r"use a \.safetensors file name"):
        export_tensors(store, tmp_path / "out.npz", fmt="safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(UsageError, match=r"bad.safetensors: not a readable safetensors file"):
        import_tensors(store, bad, comm())
    import safetensors.numpy

    odd = tmp_path / "odd.safetensors"
    safetensors.numpy.save_file({"x": np.zeros(3, np.int16)}, str(odd))
    with pytest.raises(UsageError, match=r"tensor 'x' is I16, which dtm does not store"):
        import_tensors(store, odd, comm())
    digits = tmp_path / "digits.safetensors"
    safetensors.numpy.save_file({"0.weight": np.zeros(3, np.float32)}, str(digits))
    with pytest.raises(UsageError, match=r"cannot be stored as '0.weight'.*--map"):
        import_tensors(store, digits, comm())
    (tmp_path / "twice.toml").write_text('a = "x"\nb = "x"\n')
    with pytest.raises(UsageError, match="'x' is the target of two entries"):
        main(
            [
                "store",
                "export",
                str(store),
                "-o",
                str(tmp_path / "t.npz"),
                "--map",
                str(tmp_path / "twice.toml"),
            ]
        )
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(
        UsageError, match=r"needs the safetensors package: pip install 'dtm_mpi\[interop\]'"
    ):
        export_tensors(store, tmp_path / "x.safetensors")


def test_a_map_splits_transposes_and_concatenates_both_ways(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a GPT-2-like fused c_attn [in, 3 out] (Conv1D) out as q, k, v Linear weights [out, in]
    # and back: split, transpose, then transpose and concatenate give the bits that went out
    rng = np.random.default_rng(3)
    fused = rng.standard_normal((4, 6)).astype(np.float32)
    bits = (rng.standard_normal((4, 6)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    store = tmp_path / "s"
    store.mkdir()
    put_tensors(store, comm(), {"c_attn": fused, "c_attn_bf16": bits})
    out = tmp_path / "qkv.safetensors"
    split = tmp_path / "split.toml"
    split.write_text(
        'c_attn = { to = ["q", "k", "v"], split = 1 }\n'
        'c_attn_bf16 = { to = "w_t", transpose = true }\n'
    )
    assert main(["store", "export", str(store), "-o", str(out), "--map", str(split)]) == 0
    assert "c_attn -> k: f32[4,2]" in capsys.readouterr().out
    files = read_file_tensors(out, "safetensors")
    assert sorted(files) == ["k", "q", "v", "w_t"]
    for i, name in enumerate("qkv"):
        np.testing.assert_array_equal(files[name][1], fused[:, 2 * i : 2 * i + 2])
    assert files["w_t"][0] is DType.BF16 and files["w_t"][1].shape == (6, 4)
    back = tmp_path / "back"
    back.mkdir()
    join = tmp_path / "join.json"
    join.write_text(
        '{"q": {"to": "c_attn", "concat": 1, "with": ["k", "v"]},'
        ' "w_t": {"to": "c_attn_bf16", "transpose": true}}'
    )
    assert main(["store", "import", str(back), str(out), "--map", str(join)]) == 0
    assert "q+k+v -> c_attn: f32[4,6]" in capsys.readouterr().out
    assert _stored(back) == _stored(store)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            'c_attn = { to = ["q", "k", "v"], split = 0 }',
            r"\[4,6\] does not split into 3 equal parts along dim 0",
        ),
        ('c_attn = { to = "x", split = 1 }', "split needs to = .two or more names."),
        ('c_attn = { to = "x", concat = 1, with = ["c_attn"] }', "'c_attn' is used by two entries"),
        (
            'c_attn = { to = "x", concat = 0, with = ["row"] }',
            r"row float32\[5\] does not join c_attn",
        ),
        ('c_attn = { to = "x", concat = 2, with = ["row"] }', "dim 2 is out of range for c_attn"),
        ('row = { to = "x", transpose = true }', r"transpose takes a matrix; row is \[5\]"),
        (
            'c_attn = { to = "x", transpose = true, split = 1 }',
            "give one of transpose, split, concat",
        ),
        ('c_attn = { to = "x", shuffle = true }', "unknown key 'shuffle'"),
        ("c_attn = 3", "want a name or a table"),
    ],
)
def test_bad_map_entries_are_one_line_naming_the_entry(
    tmp_path: Path, table: str, message: str
) -> None:
    store = tmp_path / "s"
    store.mkdir()
    put_tensors(
        store, comm(), {"c_attn": np.zeros((4, 6), np.float32), "row": np.zeros(5, np.float32)}
    )
    path = tmp_path / "map.toml"
    path.write_text(table + "\n")
    with pytest.raises(UsageError, match=message) as err:
        export_tensors(store, tmp_path / "o.npz", rename=read_tensor_map(path))
    assert f"--map {path}" in str(err.value)
    assert not (tmp_path / "o.npz").exists()
