"""Token files (dtm_mpi/frontend/token_data.py, ``dtm data prepare``): text files tokenized
into a nanoGPT-style .bin with its side file; :class:`~dtm_mpi.frontend.TokenLoader` gives the
same batch at the same step whatever rows a rank asks for, visits every window once an epoch,
and a run trained on one mesh and resumed on another equals the uninterrupted run; bad input
is one error naming the file."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.token_data import prepare_tokens, read_token_file
from tests.pipeline_case import VOCAB, T, gpt, lm_loss
from tests.test_cli_run import dtm as dtm_cli
from tests.test_cli_run import one_line_error

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None,
    reason="token files are written with the `tokenizers` package (the llm extra; make setup installs it)",
)

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "<eot>"]


def word_tokenizer(d: Path) -> Path:
    """A word-level tokenizer over :data:`WORDS` (ids 0..9), whitespace split."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eot>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = d / "tokenizer.json"
    tok.save(str(path))
    return path


def texts(d: Path, n: int = 2, words: int = 400) -> list[Path]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        p = d / f"doc{i}.txt"
        p.write_text(" ".join(WORDS[j] for j in rng.integers(0, 9, words)), encoding="utf-8")
        out.append(p)
    return out


def test_prepare_writes_the_tokens_and_a_side_file_that_describes_them(tmp_path: Path) -> None:
    tok = word_tokenizer(tmp_path)
    docs = texts(tmp_path)
    train, val = prepare_tokens(docs, tok, tmp_path / "tokens.bin", val_fraction=0.1, eot=9)
    want = []
    for p in docs:
        want += [WORDS.index(w) for w in p.read_text().split()] + [9]
    assert val is not None and train.tokens + val.tokens == len(want) == 802
    assert val.path.name == "tokens.val.bin" and val.tokens == 80
    got = np.fromfile(tmp_path / "tokens.bin", dtype="<u2")
    np.testing.assert_array_equal(got, want[: train.tokens])
    np.testing.assert_array_equal(np.fromfile(val.path, dtype="<u2"), want[train.tokens :])
    meta = json.loads((tmp_path / "tokens.bin.json").read_text())
    assert meta["format"] == "dtm-tokens-1" and meta["dtype"] == "uint16"
    assert meta["tokens"] == train.tokens and meta["vocab_size"] == len(WORDS)
    assert meta["sha256"] == hashlib.sha256((tmp_path / "tokens.bin").read_bytes()).hexdigest()
    assert meta["split"] == "train" and meta["sources"] == [str(p) for p in docs]
    assert read_token_file(tmp_path / "tokens.bin", verify=True) == train


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = word_tokenizer(tmp_path)
    docs = [str(p) for p in texts(tmp_path)]
    out = str(tmp_path / "t.bin")
    code, got, _ = dtm_cli(
        capsys, "data", "prepare", *docs, "--tokenizer", str(tok), "-o", out, "--quiet"
    )
    assert code == 0 and f"{out}: 800 uint16 tokens, vocabulary 10" in got
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = dtm_cli(capsys, "data", "prepare", *docs, "--tokenizer", str(bad), "-o", out)
    assert code == 2
    assert "bad.json: not a tokenizer the `tokenizers` package reads" in one_line_error(err)


def test_bad_files_are_one_error_naming_the_file(tmp_path: Path) -> None:
    tok = word_tokenizer(tmp_path)
    docs = texts(tmp_path)
    with pytest.raises(UsageError, match=r"nope\.txt: no such text file"):
        prepare_tokens([tmp_path / "nope.txt"], tok, tmp_path / "x.bin")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(UsageError, match=r"latin1\.txt: not UTF-8 text \(byte 3\)"):
        prepare_tokens([tmp_path / "latin1.txt"], tok, tmp_path / "x.bin")
    with pytest.raises(UsageError, match="--eot 99 is not an id"):
        prepare_tokens(docs, tok, tmp_path / "x.bin", eot=99)
    prepare_tokens(docs, tok, tmp_path / "t.bin")
    with (tmp_path / "t.bin").open("ab") as f:  # a torn copy: one token too many
        f.write(b"\x01\x00")
    with pytest.raises(UsageError, match=r"t\.bin: 1602 bytes, but its side file says 800"):
        dtm.TokenLoader(tmp_path / "t.bin", context=4, batch=2)
    prepare_tokens(docs, tok, tmp_path / "t.bin")
    data = bytearray((tmp_path / "t.bin").read_bytes())
    data[10] ^= 1
    (tmp_path / "t.bin").write_bytes(bytes(data))
    dtm.TokenLoader(tmp_path / "t.bin", context=4, batch=2)  # the size agrees: opens
    with pytest.raises(UsageError, match="SHA-256 differs from the side file's"):
        dtm.TokenLoader(tmp_path / "t.bin", context=4, batch=2, verify=True)
    (tmp_path / "t.bin.json").unlink()
    with pytest.raises(UsageError, match=r"no side file t\.bin\.json"):
        dtm.TokenLoader(tmp_path / "t.bin", context=4, batch=2)
    prepare_tokens(docs, tok, tmp_path / "t.bin")
    with pytest.raises(UsageError, match=r"make 159 windows of 5 .* fewer than a batch of 200"):
        dtm.TokenLoader(tmp_path / "t.bin", context=5, batch=200)


def test_every_split_of_the_rows_reads_the_same_batch(tmp_path: Path) -> None:
    prepare_tokens(texts(tmp_path), word_tokenizer(tmp_path), tmp_path / "t.bin")
    loader = dtm.TokenLoader(tmp_path / "t.bin", context=7, batch=6, seed=3)
    tokens = np.fromfile(tmp_path / "t.bin", dtype="<u2")
    seen: list[int] = []
    for step in range(loader.per_epoch + 2):
        whole = loader(
            step, {"ids": (slice(0, 6), slice(0, 7)), "labels": (slice(0, 6), slice(0, 7))}
        )
        parts = [
            loader(step, {"ids": (slice(a, b), slice(0, 7))})["ids"]
            for a, b in ((0, 2), (2, 3), (3, 6))
        ]
        np.testing.assert_array_equal(np.concatenate(parts), whole["ids"])
        w = loader.windows_of(step)
        np.testing.assert_array_equal(
            whole["ids"], np.stack([tokens[i * 7 : i * 7 + 7] for i in w])
        )
        np.testing.assert_array_equal(
            whole["labels"], np.stack([tokens[i * 7 + 1 : i * 7 + 8] for i in w])
        )
        assert whole["ids"].dtype == np.int32
        if step < loader.per_epoch:
            seen += list(w)
    assert len(seen) == len(set(seen)) == loader.per_epoch * 6  # each window once an epoch
    other = dtm.TokenLoader(tmp_path / "t.bin", context=7, batch=6, seed=4)
    assert not np.array_equal(other.windows_of(0), loader.windows_of(0))
    with pytest.raises(UsageError, match="gives 'ids' and 'labels'"):
        loader(0, {"x": (slice(0, 6), slice(0, 7))})
    with pytest.raises(
        UsageError, match="context dim reaches 9, longer than the loader's context of 7"
    ):
        loader(0, {"ids": (slice(0, 6), slice(0, 9))})


def test_training_resumed_on_another_mesh_continues_the_stream(tmp_path: Path) -> None:
    """The small GPT on token files: 4 steps at dp=2 x tp=2 equal 2 steps there, then 2 more
    resumed from the checkpoint at dp=1 x tp=2 (the loader follows the step)."""
    rng = np.random.default_rng(1)
    docs = tmp_path / "doc.txt"
    docs.write_text(" ".join(WORDS[j] for j in rng.integers(0, VOCAB - 1, 3000)))
    prepare_tokens([docs], word_tokenizer(tmp_path), tmp_path / "t.bin")
    loader = dtm.TokenLoader(
        tmp_path / "t.bin", context=T, batch=8, seed=5, names={"tgt": "labels"}
    )
    step = dtm.train_step(
        gpt(),
        lm_loss,
        mesh=dtm.Mesh(dp=2, tp=2),
        inputs={k: dtm.Input((8, T), "i32", ("dp", None)) for k in ("ids", "tgt")},
        optimizer=dtm.optim.AdamW(lr=1e-2),
    )
    full = dtm.fit(step, loader, steps=4, sim=4, mesh={"dp": 2, "tp": 2}, quiet=True)
    save = dtm.CheckpointPolicy(str(tmp_path / "s"), every=2)
    dtm.fit(step, loader, steps=2, sim=4, mesh={"dp": 2, "tp": 2}, checkpoint=save, quiet=True)
    again = dtm.CheckpointPolicy(str(tmp_path / "s"), resume=True)
    rest = dtm.fit(
        step, loader, steps=4, sim=2, mesh={"dp": 1, "tp": 2}, checkpoint=again, quiet=True
    )
    np.testing.assert_allclose(
        [m["loss"] for m in rest.metrics], [m["loss"] for m in full.metrics[2:]], rtol=1e-10
    )


def _small_run(tmp_path: Path, **loader_kw: object) -> tuple[object, object, Path]:
    rng = np.random.default_rng(1)
    docs = tmp_path / "doc.txt"
    docs.write_text(" ".join(WORDS[j] for j in rng.integers(0, VOCAB - 1, 3000)))
    tok = word_tokenizer(tmp_path)
    prepare_tokens([docs], tok, tmp_path / "t.bin")
    kw: dict[str, object] = {"context": T, "batch": 8, "seed": 5, "names": {"tgt": "labels"}}
    kw.update(loader_kw)
    loader = dtm.TokenLoader(tmp_path / "t.bin", **kw)  # type: ignore[arg-type]
    step = dtm.train_step(
        gpt(),
        lm_loss,
        mesh=dtm.Mesh(dp=2, tp=1),
        inputs={k: dtm.Input((8, T), "i32", ("dp", None)) for k in ("ids", "tgt")},
        optimizer=dtm.optim.AdamW(lr=1e-2),
    )
    return step, loader, docs


def test_every_checkpoint_records_the_data_position_and_refuses_other_data(
    tmp_path: Path,
) -> None:
    """The checkpoint holds the token file's SHA-256 and the loader's place (readable with
    plain h5py); a resume refuses a token file that changed, another batch or seed, and
    nothing is lost: the checkpoint stays."""
    import h5py

    step, loader, docs = _small_run(tmp_path)
    store = tmp_path / "s"
    dtm.fit(step, loader, steps=3, sim=2, checkpoint=dtm.CheckpointPolicy(str(store), every=3))
    sha = read_token_file(tmp_path / "t.bin").sha256
    with h5py.File(store / "ckpt-00000003" / "checkpoint.h5", "r") as f:
        assert bytes(f["tensors/data.tokens.sha256"][()]).hex() == sha
        pos = list(f["tensors/data.tokens.position"][()])
    epoch, k = divmod(3, loader.per_epoch)  # type: ignore[attr-defined]
    assert pos == [1, loader.file.tokens, 10, T, 8, 5, epoch, k * 8]  # type: ignore[attr-defined]
    again = dtm.CheckpointPolicy(str(store), resume=True)

    other_seed = dtm.TokenLoader(
        tmp_path / "t.bin", context=T, batch=8, seed=6, names={"tgt": "labels"}
    )
    with pytest.raises(UsageError, match=r"with seed 5 \(now 6\).*same context, batch and seed"):
        dtm.fit(step, other_seed, steps=5, sim=2, checkpoint=again, quiet=True)

    # the token file regenerated from other text: its hash differs
    docs.write_text(docs.read_text() + " cat")
    prepare_tokens([docs], tmp_path / "tokenizer.json", tmp_path / "t.bin")
    changed = dtm.TokenLoader(
        tmp_path / "t.bin", context=T, batch=8, seed=5, names={"tgt": "labels"}
    )
    with pytest.raises(UsageError, match=rf"t.bin: its content hash .*trained on .*{sha[:16]}"):
        dtm.fit(step, changed, steps=5, sim=2, checkpoint=again, quiet=True)
    assert (store / "ckpt-00000003" / "checkpoint.h5").is_file()


def test_a_checkpoint_without_a_data_position_resumes_with_a_token_loader(
    tmp_path: Path,
) -> None:
    step, loader, _ = _small_run(tmp_path)
    store = str(tmp_path / "s")
    fed = {
        k: np.asarray(v)
        for k, v in loader(
            0, {"ids": (slice(0, 8), slice(0, T)), "tgt": (slice(0, 8), slice(0, T))}
        ).items()
    }  # type: ignore[operator]
    dtm.fit(
        step,
        dtm.ArrayLoader(fed, 8, shuffle=False),
        steps=1,
        sim=2,
        checkpoint=dtm.CheckpointPolicy(store, every=1),
        quiet=True,
    )
    got = dtm.fit(
        step,
        loader,
        steps=2,
        sim=2,
        checkpoint=dtm.CheckpointPolicy(store, resume=True),
        quiet=True,
    )
    assert [m["step"] for m in got.metrics] == [1.0]


def test_a_token_file_from_a_larger_vocabulary_than_the_model_is_refused(tmp_path: Path) -> None:
    prepare_tokens(texts(tmp_path), word_tokenizer(tmp_path), tmp_path / "t.bin")
    with pytest.raises(
        UsageError, match=r"t.bin: .*vocabulary of 10 ids, larger than the model's 8"
    ):
        dtm.TokenLoader(tmp_path / "t.bin", context=4, batch=2, vocab_size=8)
    dtm.TokenLoader(tmp_path / "t.bin", context=4, batch=2, vocab_size=16)  # padded: fine
    with pytest.raises(UsageError, match="seed must be a whole number"):
        dtm.TokenLoader(tmp_path / "t.bin", context=4, batch=2, seed=-1)


def test_write_tokens_makes_a_token_file_from_ids(tmp_path: Path) -> None:
    from dtm_mpi.frontend.token_data import write_tokens

    ids = np.arange(100) % 7
    got = write_tokens(ids, 7, tmp_path / "x.bin", sources=["made"])
    assert read_token_file(tmp_path / "x.bin", verify=True) == got and got.dtype == "uint16"
    np.testing.assert_array_equal(got.open(), ids)
    with pytest.raises(UsageError, match="outside the vocabulary of 5"):
        write_tokens(ids, 5, tmp_path / "y.bin")
    with pytest.raises(UsageError, match="1-D integer array"):
        write_tokens(ids.astype(np.float32), 7, tmp_path / "y.bin")


def test_a_token_tensor_already_in_a_store_feeds_training_and_is_checked_on_resume(
    tmp_path: Path,
) -> None:
    """TokenLoader.from_store reads the windows of a 1-D token tensor of a checkpoint store
    (the same batches as the token file of the same ids); the run's checkpoints record its
    Merkle root, and a resume refuses the tensor once it changed."""
    from dtm_mpi.comm.handles import self_comm
    from dtm_mpi.frontend.token_data import write_tokens
    from dtm_mpi.io.tools import put_tensor

    rng = np.random.default_rng(4)
    ids = rng.integers(0, VOCAB - 1, 3000).astype(np.int32)
    from dtm_mpi.io.checkpoint import CheckpointStore

    data = tmp_path / "data"
    CheckpointStore(str(data), self_comm()).close()  # a new store
    put_tensor(data, self_comm(), "corpus", ids)
    write_tokens(ids, 10, tmp_path / "same.bin")
    kw = {"context": T, "batch": 8, "seed": 5, "names": {"tgt": "labels"}}
    stored = dtm.TokenLoader.from_store(data, "corpus", vocab_size=10, **kw)  # type: ignore[arg-type]
    plain = dtm.TokenLoader(tmp_path / "same.bin", **kw)  # type: ignore[arg-type]
    whole = {"ids": (slice(0, 8), slice(0, T)), "tgt": (slice(2, 5), slice(0, T))}
    for s in (0, 3, plain.per_epoch + 1):
        for k, v in plain(s, whole).items():
            np.testing.assert_array_equal(stored(s, whole)[k], v)
    (tmp_path / "run").mkdir()
    step, _, _ = _small_run(tmp_path / "run")
    store = str(tmp_path / "s")
    dtm.fit(
        step, stored, steps=2, sim=2, checkpoint=dtm.CheckpointPolicy(store, every=2), quiet=True
    )
    put_tensor(data, self_comm(), "corpus", ids[::-1].copy())  # the data changed
    changed = dtm.TokenLoader.from_store(data, "corpus", vocab_size=10, **kw)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"content hash .* refusing to resume on other data"):
        dtm.fit(
            step,
            changed,
            steps=4,
            sim=2,
            checkpoint=dtm.CheckpointPolicy(store, resume=True),
            quiet=True,
        )
    with pytest.raises(UsageError, match=r"no tensor 'nope'"):
        dtm.TokenLoader.from_store(data, "nope", vocab_size=10, **kw)  # type: ignore[arg-type]
    put_tensor(data, self_comm(), "floats", np.zeros(8, np.float32))
    with pytest.raises(UsageError, match="token ids are a stored 1-D integer tensor"):
        dtm.TokenLoader.from_store(data, "floats", vocab_size=10, **kw)  # type: ignore[arg-type]
