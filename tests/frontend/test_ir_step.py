"""Training an IR forward (``dtm run FILE.dtm --train OPT``) on simulated ranks: the step the
reverse pass and optimizer make from the file, microbatches numbered by ``microbatch_index``,
pipeline stages cut at ``--split`` values or evenly, every schedule equal to gradient
accumulation on one stage, and every bad forward or option a located one-line error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.cli import run
from dtm_mpi.errors import UsageError, VerifyError
from dtm_mpi.frontend.ir_step import IrTraining, ir_step_stages, ir_train_step, parse_optimizer
from dtm_mpi.frontend.optim import SGD, AdamW
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.ir.nodes import Module

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "examples" / "mlp_train.dtm")


def load(text: str, name: str = "t.dtm") -> Module:
    module = parse_module(text, name)
    verify_module(module)
    return module


def dtm(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def train(
    capsys: pytest.CaptureFixture[str], out: Path, ranks: int, *args: str
) -> dict[str, np.ndarray]:
    code, _, err = dtm(capsys, "run", MLP, "--sim", str(ranks), "-o", str(out), *args)
    assert code == 0, err
    return dict(np.load(out))


def test_parse_optimizer() -> None:
    assert parse_optimizer("sgd:lr=0.05,momentum=0.9") == SGD(0.05, 0.9)
    assert parse_optimizer("adamw:lr=1e-3,betas=0.8/0.99") == AdamW(1e-3, (0.8, 0.99))
    for bad, why in [
        ("rmsprop:lr=1", "one of sgd, adam, adamw"),
        ("sgd", "sgd needs lr=..."),
        ("sgd:lr=x", "lr='x' is not a number"),
        ("sgd:lr=0.1,nesterov=1", "got 'nesterov=1'"),
        ("adam:betas=0.9", "betas are two numbers"),
        ("sgd:lr=-1", "lr must be"),
    ]:
        with pytest.raises(UsageError, match=why):
            parse_optimizer(bad)


def test_the_step_is_the_forward_its_reverse_pass_and_the_update() -> None:
    step = ir_train_step(load(Path(MLP).read_text()), IrTraining(SGD(0.1)))
    assert step.params == ("w0", "w1", "w2", "w3") and step.metrics == ("loss",)
    entry = step.module.entry
    assert entry is not None and step.module.version == (1, 2)
    assert [r.updates for r in entry.results] == [None, "%w0", "%w1", "%w2", "%w3"]
    # the text is canonical: printed and parsed again it is the same module
    assert load(step.text) == step.module


def test_microbatches_are_numbered_over_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With lr 0 the weights stay: the loss of a step of 4 microbatches (one stage) is the
    mean of the losses of steps 0-3 unsplit (microbatch_index = step there)."""
    module = load(Path(MLP).read_text())
    plain = ir_train_step(module, IrTraining(SGD(0.0), axis="none"))  # no pipeline axis
    assert plain.pipeline is None
    from dtm_mpi.runtime.simulate import run_simulated

    single = run_simulated(plain.module, 1, steps=4)
    losses = [float(r[0]) for r in single.results]
    out = train(capsys, tmp_path / "a.npz", 1, "--train", "sgd:lr=0", "--microbatches", "4")
    assert float(out["result0"]) == pytest.approx(np.mean(losses), rel=1e-6)
    assert len(set(losses)) == 4  # each microbatch drew its own rows


@pytest.mark.parametrize(
    ("mesh", "schedule", "extra"),
    [
        ("pp=2", "gpipe", ()),
        ("pp=2", "1f1b", ("--split", "%h1")),
        ("pp=2", "zb-h1", ()),
        ("pp=2", "interleaved", ("--chunks", "2")),
        ("pp=2,dp=2", "1f1b", ()),
        ("pp=3", "1f1b", ()),
    ],
)
def test_every_schedule_trains_as_one_stage_does(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    mesh: str,
    schedule: str,
    extra: tuple[str, ...],
) -> None:
    common = ("--train", "sgd:lr=0.1,momentum=0.9", "--microbatches", "4", "--steps", "5")
    want = train(capsys, tmp_path / "one.npz", 1, *common)
    ranks = int(np.prod([int(a.split("=")[1]) for a in mesh.split(",")]))
    got = train(
        capsys, tmp_path / "pp.npz", ranks, *common, "--mesh", mesh, "--schedule", schedule, *extra
    )
    assert sorted(got) == sorted(want)
    for key in want:
        if "dp" in mesh:  # the dp sums in another order: float32 rounding
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
        else:  # the same sums in the same order
            assert got[key].tobytes() == want[key].tobytes(), key
    assert float(want["result0"]) < 0.95  # it learns (1.11 at the start)


def test_stages_cut_at_split_values_or_evenly_by_parameters() -> None:
    module = load(Path(MLP).read_text())
    even = ir_step_stages(module, IrTraining(SGD(0.1), microbatches=2), 3)
    # 2,048 + 4,096 + 4,096 + 512 elements: the largest stage as small as can be (4,608)
    assert [p.params for p in even.passes] == [("%w0",), ("%w1",), ("%w2", "%w3")]
    assert even.microbatch is not None  # microbatch_index: fed to the stage that draws data
    cut = ir_step_stages(module, IrTraining(SGD(0.1), splits=("%a0",)), 2)
    assert [p.params for p in cut.passes] == [("%w0",), ("%w1", "%w2", "%w3")]
    # what crosses the cut: the activation, and the targets (a skip connection to the loss)
    assert [(r.value, r.src, r.dst) for r in cut.partition.routes] == [
        ("%h0", 0, (1,)),
        ("%y", 0, (1,)),
    ]
    four = ir_step_stages(module, IrTraining(SGD(0.1)), 4)  # one weight each
    assert [p.params for p in four.passes] == [("%w0",), ("%w1",), ("%w2",), ("%w3",)]


@pytest.mark.parametrize(
    ("ranks", "args", "message"),
    [
        (2, ("--split", "%zz"), "--split %zz: @loss makes no value %zz"),
        (2, ("--split", "%w1"), "%w1 is a parameter of @loss"),
        (3, ("--split", "%a2", "--split", "%a0"), "follow the forward order"),
        (2, ("--split", "%a0", "--split", "%a1"), "cuts @loss into 3 stages; the run has 2"),
        (5, (), "cannot be cut into 5 stages by its parameters"),
        (2, ("--schedule", "zigzag"), "zigzag"),
        (2, ("--schedule", "interleaved"), "interleaved"),
    ],
)
def test_bad_options_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], ranks: int, args: tuple[str, ...], message: str
) -> None:
    mesh = f"pp={ranks}"
    argv = ["run", MLP, "--sim", str(ranks), "--mesh", mesh, "--train", "sgd:lr=0.1", *args]
    code, _, err = dtm(capsys, *argv)
    assert code != 0 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--microbatches", "2"),
            "--microbatches: these train the entry function; give --train OPT",
        ),
        (("--schedule", "gpipe", "--chunks", "2"), "--schedule, --chunks: these train"),
        (("--train", "sgd:lr=0.1", "--microbatches", "0"), "--microbatches must be >= 1; got 0"),
        (("--train", "sgd:lr=0.1", "--chunks", "-1"), "--chunks must be >= 1; got -1"),
    ],
)
def test_pipeline_options_alone_or_out_of_range_are_refused(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    code, _, err = dtm(capsys, "run", MLP, "--sim", "1", *args)
    assert code != 0 and message in err, err


FORWARD = """dtm 1.2
module f
mesh @m = [pp=1, dp=1]
entry func @loss(state %w: f32[4,4] init zeros, %x: f32[2,4]) -> (f32[], f32[]) on @m {
  %y = matmul %x, %w : f32[2,4]
  %s = sum %y dims [0, 1] : f32[]
  return %s, %s
}
"""


def test_a_bad_forward_is_located_in_the_file() -> None:
    module = load(FORWARD, "f.dtm")
    with pytest.raises(VerifyError, match=r"f\.dtm:4:49: .*%x of @loss.*floating state parameter"):
        ir_train_step(module, IrTraining(SGD(0.1)))
    updating = (
        FORWARD.replace("%x: f32[2,4]", "state %x: f32[2,4] init ones")
        .replace("-> (f32[], f32[])", "-> (f32[], f32[4,4] updates %w)")
        .replace("return %s, %s", "return %s, %w")
    )
    with pytest.raises(VerifyError, match=r"f\.dtm:4:\d+.*@loss updates %w itself"):
        ir_train_step(load(updating, "f.dtm"), IrTraining(SGD(0.1)))
    two = FORWARD.replace("%x: f32[2,4]", "state %x: f32[2,4] init ones")
    with pytest.raises(VerifyError, match="a pipelined step reports its loss only"):
        ir_train_step(load(two, "f.dtm"), IrTraining(SGD(0.1)))
    assert ir_train_step(load(two, "f.dtm"), IrTraining(SGD(0.1), axis="none")).metrics == (
        "loss",
        "result1",
    )


@pytest.mark.parametrize(
    ("ranks", "mesh", "schedule"),
    [(2, "pp=2,dp=1", "zb-h1"), (4, "pp=2,dp=2", "1f1b"), (3, "pp=1,dp=3", "gpipe")],
)
def test_in_deterministic_mode_ir_stages_have_the_same_bits_on_every_mesh(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    ranks: int,
    mesh: str,
    schedule: str,
) -> None:
    """DTM_DETERMINISTIC=1: each microbatch's passes run exact sums (over dp too) and the
    gradients add in microbatch order, so any pp x dp gives one rank's bits (3 microbatches:
    no power of two needed, there is no whole-batch step to match)."""
    from dtm_mpi.config import get_config

    monkeypatch.setenv("DTM_DETERMINISTIC", "1")
    get_config.cache_clear()
    common = ("--train", "adam:lr=0.01", "--microbatches", "3", "--steps", "3")
    try:
        want = train(capsys, tmp_path / "one.npz", 1, *common)
        got = train(
            capsys, tmp_path / "many.npz", ranks, *common, "--mesh", mesh, "--schedule", schedule
        )
    finally:
        monkeypatch.delenv("DTM_DETERMINISTIC")
        get_config.cache_clear()
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k].tobytes() != want[k].tobytes()]
    assert not differ, differ


def test_explain_shows_the_stages_and_the_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = dtm(
        capsys, "explain", MLP, "--train", "sgd:lr=0.1", "--mesh", "pp=2",
        "--microbatches", "4", "--schedule", "zb-h1", "--split", "%h2",
    )  # fmt: skip
    assert code == 0, err
    assert "schedule zb-h1: 2 rank(s), 2 stage(s), 4 microbatch(es); predicted bubble" in out
    assert "w0, w1" in out and "w2, w3" in out
    assert "rank 1 |" in out


TP_FORWARD = """dtm 1.2
module tp_train
mesh @m = [pp=1, tp=1]
entry func @loss(state %w0: f32[32,64]{-,tp} init normal(seed=1, std=0.17),
                 state %w1: f32[64,32]{tp,-} init normal(seed=2, std=0.125),
                 state %w2: f32[32,64]{-,tp} init normal(seed=3, std=0.17),
                 state %w3: f32[64,8]{tp,-} init normal(seed=4, std=0.125)) -> f32[] on @m {
  %mb = microbatch_index : i64[]
  %x = random normal seed 11 offset %mb : f32[16,32]
  %teacher = random normal seed 12 std 0.2 : f32[32,8]
  %y = matmul %x, %teacher : f32[16,8]
  %h0 = matmul %x, %w0 : f32[16,64]{-,tp}
  %a0 = tanh %h0 : f32[16,64]{-,tp}
  %p1 = matmul %a0, %w1 : f32[16,32] partial(sum: tp)
  %h1 = allreduce sum %p1 on tp : f32[16,32]
  %a1 = tanh %h1 : f32[16,32]
  %h2 = matmul %a1, %w2 : f32[16,64]{-,tp}
  %a2 = tanh %h2 : f32[16,64]{-,tp}
  %p3 = matmul %a2, %w3 : f32[16,8] partial(sum: tp)
  %p = allreduce sum %p3 on tp : f32[16,8]
  %d = sub %p, %y : f32[16,8]
  %d2 = mul %d, %d : f32[16,8]
  %loss = mean %d2 dims [0, 1] : f32[]
  return %loss
}
"""


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_tensor_parallel_forward_pipelines_over_pp_x_tp(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, schedule: str
) -> None:
    """Megatron's column- and row-parallel pair written in IR, cut into 2 stages over pp=2 x
    tp=2: the stages' passes keep the tp allreduces (and their adjoints)."""
    path = tmp_path / "tp_train.dtm"
    path.write_text(TP_FORWARD)
    common = ("--train", "adam:lr=0.01", "--microbatches", "2", "--steps", "4")
    outs = []
    for ranks, mesh in ((1, "pp=1,tp=1"), (4, "pp=2,tp=2")):
        out = tmp_path / f"{ranks}.npz"
        argv = ["run", str(path), "--sim", str(ranks), "--mesh", mesh, "--schedule", schedule]
        code, _, err = dtm(capsys, *argv, *common, "-o", str(out))
        assert code == 0, err
        outs.append(dict(np.load(out)))
    assert sorted(outs[0]) == sorted(outs[1]) and "opt.m.w3" in outs[0]
    for key, want in outs[0].items():
        np.testing.assert_allclose(outs[1][key], want, rtol=2e-5, atol=2e-6, err_msg=key)


CALLS = """dtm 1.2
module calls
mesh @m = [pp=1]
func @layer(%x: f32[8,16], %w: f32[16,16]) -> f32[8,16] on @m {
  %h = matmul %x, %w : f32[8,16]
  %a = tanh %h : f32[8,16]
  return %a
}
entry func @loss(state %w0: f32[16,16] init normal(seed=1, std=0.2),
                 state %w1: f32[16,16] init normal(seed=2, std=0.2)) -> f32[] on @m {
  %mb = microbatch_index : i64[]
  %x = random normal seed 3 offset %mb : f32[8,16]
  %a0 = call @layer(%x, %w0) : f32[8,16]
  %a1 = call @layer(%a0, %w1) : f32[8,16]
  %l = mean %a1 dims [0, 1] : f32[]
  return %l
}
"""


def test_a_split_at_a_calls_result_starts_the_stage_at_the_call() -> None:
    """A call's result is made by the call: the stage starts at the call's first inlined op
    (not at the callee's last), so each call's weight stays on one stage."""
    stages = ir_step_stages(load(CALLS, "calls.dtm"), IrTraining(SGD(0.1), splits=("%a1",)), 2)
    assert [p.params for p in stages.passes] == [("%w0",), ("%w1",)]
    names = [op.name for op in stages.partition.stages[1].ops]
    assert names[:2] == ["matmul", "tanh"], names
