"""Mixed precision as a policy (dtm_mpi/frontend/precision.py): a Llama traced with
``precision=dtm.MixedPrecision(compute="bf16", reduce="f32", master="f32")`` keeps float32
masters and optimizer state, reads each parameter as a bf16 copy (casts in the IR), reduces
the gradients over dp in float32 and reports the loss in float32; over 40 steps (200 in docs/FRONTEND.md's measurement) its loss
curve follows PyTorch's -- the same policy (bf16 copies of float32 masters, torch's AdamW)
and torch.autocast bf16 -- within 1%; its checkpoints resume without the policy and back; a
model not in the master dtype and unsupported settings are one error."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import UsageError
from dtm_mpi.frontend import functional as fn

V, B, T, STEPS = 96, 4, 16, 40
HAS_TORCH = (
    importlib.util.find_spec("torch") is not None
    and importlib.util.find_spec("transformers") is not None
)
CFG = {
    "vocab_size": V,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}


def _loss(m: Any, ids: dtm.Tensor) -> dtm.Tensor:
    return fn.causal_lm_loss(m(ids), ids)


def _data() -> np.ndarray:
    """A learnable stream: each sequence counts up from a random start (mod V), with noise."""
    rng = np.random.default_rng(0)
    start = rng.integers(0, V, (STEPS, B, 1))
    ids = (start + np.arange(T)) % V
    noise = rng.random((STEPS, B, T)) < 0.1
    return np.where(noise, rng.integers(0, V, (STEPS, B, T)), ids).astype(np.int32)


def _step(model: Any, precision: dtm.MixedPrecision | None, mesh: dtm.Mesh, **kw: Any) -> Any:
    return dtm.train_step(
        model,
        _loss,
        mesh=mesh,
        inputs={"ids": dtm.Input((B, T), "i32", ("dp", None))},
        optimizer=dtm.optim.AdamW(3e-3),
        precision=precision,
        **kw,
    )


def _feed(data: np.ndarray) -> Any:
    return lambda s, r: {"ids": data[s][r["ids"]]}


def test_the_step_reads_bf16_copies_keeps_f32_masters_and_reduces_in_f32() -> None:
    mesh = dtm.Mesh(dp=2, tp=1)
    step = _step(dtm.nn.Llama(CFG, axis="tp"), dtm.MixedPrecision(), mesh)
    entry = step.module.entry
    assert entry is not None
    floats = [p for p in entry.params if p.type.dtype.is_float]
    assert floats and all(p.type.dtype.value == "f32" for p in floats)  # masters and moments
    assert any(op.name == "cast" and op.result_types[0].dtype.value == "bf16" for op in entry.body)
    assert entry.results[0].type.dtype.value == "f32"  # the loss
    body = {n: t for op in entry.body for n, t in zip(op.results, op.result_types, strict=True)}
    body.update({p.name: p.type for p in entry.params})
    dp_sums = [
        op
        for op in entry.body
        if op.name in ("allreduce", "reduce_scatter") and "dp" in tuple(op.attr("axes"))  # type: ignore[arg-type]
    ]
    assert dp_sums and all(body[op.operands[0]].dtype.value == "f32" for op in dp_sums)
    plain = _step(dtm.nn.Llama(CFG, axis="tp"), None, mesh)
    assert step.identity is not None and step.identity.entry == plain.module.entry
    assert "bf16" not in plain.text


def _torch_losses(path: Path, data: np.ndarray, mode: str) -> list[float]:
    """PyTorch on the same weights and batches: ``policy`` -- float32 masters, a bf16 copy
    for each forward and backward, the gradients back in float32, torch's AdamW (dtm's
    policy); ``autocast`` -- torch.autocast(bf16) over the float32 model; ``f32``."""
    import torch
    import transformers

    torch.manual_seed(0)
    master = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    opt = torch.optim.AdamW(master.parameters(), lr=3e-3)
    work = (
        transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", torch_dtype=torch.bfloat16
        )
        if mode == "policy"
        else master
    )
    out = []
    for s in range(STEPS):
        ids = torch.from_numpy(data[s].astype(np.int64))
        if mode == "policy":
            with torch.no_grad():
                for w, m in zip(work.parameters(), master.parameters(), strict=True):
                    w.copy_(m.to(torch.bfloat16))
            work.zero_grad()
            loss = work(ids, labels=ids).loss
            loss.backward()
            for w, m in zip(work.parameters(), master.parameters(), strict=True):
                m.grad = w.grad.float()
        else:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                loss = master(ids, labels=ids).loss
            loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def _windows(xs: list[float], n: int = 20) -> np.ndarray:
    return np.asarray(xs, np.float64).reshape(-1, n).mean(1)


@pytest.mark.skipif(
    not HAS_TORCH,
    reason="the comparison runs torch and transformers (the llm and bench extras; make setup installs both)",
)
def test_the_loss_curve_follows_pytorchs_bf16_training_within_1_percent(tmp_path: Path) -> None:
    from dtm_mpi.frontend.hf_store import write_random_model

    path = write_random_model(
        tmp_path / "hf",
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **CFG},
        seed=3,
    )
    data = _data()
    hf = dtm.hf.load(path)
    mesh = dtm.Mesh(dp=2, tp=1)
    ours = dtm.fit(
        _step(hf.model, dtm.MixedPrecision(), mesh),
        _feed(data),
        steps=STEPS,
        sim=2,
        values=hf.weights,
        quiet=True,
    )
    got = _windows([m["loss"] for m in ours.metrics])
    policy = _windows(_torch_losses(path, data, "policy"))
    autocast = _windows(_torch_losses(path, data, "autocast"))
    f32 = _windows(_torch_losses(path, data, "f32"))
    assert got[-1] < 0.8 * got[0]  # it learns the counting
    for name, want in (("policy", policy), ("autocast", autocast)):
        rel = np.abs(got - want) / want
        assert rel.max() < 0.01, (name, got, want)
    assert not np.allclose(got, f32, rtol=1e-4)  # bf16 is not float32 (the policy acted)


def test_checkpoints_move_between_mixed_and_float32_steps(tmp_path: Path) -> None:
    data = _data()
    mesh = dtm.Mesh(dp=2, tp=1)
    mixed = _step(dtm.nn.Llama(CFG, axis="tp"), dtm.MixedPrecision(), mesh)
    plain = _step(dtm.nn.Llama(CFG, axis="tp"), None, mesh)
    a = dtm.CheckpointPolicy(str(tmp_path / "a"), every=2)
    dtm.fit(mixed, _feed(data), steps=2, sim=2, checkpoint=a, quiet=True)
    again = dtm.CheckpointPolicy(str(tmp_path / "a"), resume=True)
    got = dtm.fit(plain, _feed(data), steps=4, sim=1, checkpoint=again, quiet=True)
    assert [m["step"] for m in got.metrics] == [2.0, 3.0]
    back = dtm.fit(mixed, _feed(data), steps=6, sim=2, checkpoint=again, quiet=True)
    assert [m["step"] for m in back.metrics] == [4.0, 5.0]


def test_a_pipelined_and_an_accumulating_mixed_step_train_as_the_plain_mixed_one() -> None:
    data = _data()
    want = dtm.fit(
        _step(dtm.nn.Llama(CFG, axis="tp"), dtm.MixedPrecision(), dtm.Mesh(dp=1, tp=1)),
        _feed(data),
        steps=3,
        sim=1,
        quiet=True,
    )
    acc = dtm.fit(
        _step(
            dtm.nn.Llama(CFG, axis="tp"), dtm.MixedPrecision(), dtm.Mesh(dp=1, tp=1), accumulate=2
        ),
        _feed(data),
        steps=3,
        sim=1,
        quiet=True,
    )
    piped = dtm.fit(
        _step(
            dtm.nn.Llama(CFG, axis="tp"),
            dtm.MixedPrecision(),
            dtm.Mesh(pp=1, dp=1, tp=1),
            pipeline=dtm.Pipeline(microbatches=1),
        ),
        _feed(data),
        steps=3,
        sim=2,
        mesh={"pp": 2},
        quiet=True,
    )
    for got in (acc, piped):  # bf16 rounds the microbatches' sums otherwise: 1% of the loss
        np.testing.assert_allclose(
            [m["loss"] for m in got.metrics], [m["loss"] for m in want.metrics], rtol=1e-2
        )


def test_misuse_is_one_error_naming_it() -> None:
    mesh = dtm.Mesh(dp=1, tp=1)
    with pytest.raises(
        UsageError,
        match=r"parameter 'model.embed_tokens.weight' .* is bf16; .* master weights in f32",
    ):
        _step(dtm.nn.Llama(CFG, axis="tp", dtype="bf16"), dtm.MixedPrecision(), mesh)
    with pytest.raises(
        UsageError, match="reduce='bf16': the gradients are reduced in the master dtype"
    ):
        dtm.MixedPrecision(reduce="bf16")
    with pytest.raises(UsageError, match=r"init_scale=0\.5: a number in"):
        dtm.MixedPrecision(compute="f16", init_scale=0.5)
    with pytest.raises(UsageError, match=r"compute='fp8': one of bf16, f16, f32"):
        dtm.MixedPrecision(compute="fp8")


def test_f16_with_dynamic_loss_scaling_trains_and_skips_overflowing_steps(tmp_path: Path) -> None:
    """compute='f16': the loss curve follows float32's (30 steps, 1%); a scale that
    overflows skips the step (every parameter and moment kept), halves the scale and counts
    the skip; after growth_interval finite steps the scale doubles; the checkpoint of an f16
    step resumes in a float32 one, and a float32 one's in an f16 step (its scaler fresh)."""
    data = _data()
    mesh = dtm.Mesh(dp=2, tp=1)
    f32 = dtm.fit(
        _step(dtm.nn.Llama(CFG, axis="tp"), None, mesh), _feed(data), steps=30, sim=2, quiet=True
    )
    f16 = dtm.MixedPrecision(compute="f16")
    step = _step(dtm.nn.Llama(CFG, axis="tp"), f16, mesh)
    assert step.metrics == ("loss", "loss_scale", "skipped")
    assert any(
        op.name == "cast" and op.result_types[0].dtype.value == "f16"
        for op in step.module.entry.body
    )  # type: ignore[union-attr]
    got = dtm.fit(step, _feed(data), steps=30, sim=2, quiet=True)
    np.testing.assert_allclose(
        [m["loss"] for m in got.metrics], [m["loss"] for m in f32.metrics], rtol=1e-2
    )
    assert got.metrics[-1]["skipped"] == 0 and got.metrics[-1]["loss_scale"] == 65536.0

    huge = dtm.MixedPrecision(compute="f16", init_scale=2.0**64, growth_interval=2)
    runs = [
        dtm.fit(
            _step(dtm.nn.Llama(CFG, axis="tp"), huge, mesh), _feed(data), steps=n, sim=2, quiet=True
        )
        for n in (1, 3)
    ]
    assert [m["loss_scale"] for m in runs[1].metrics] == [2.0**64, 2.0**63, 2.0**62]
    assert [m["skipped"] for m in runs[1].metrics] == [1.0, 2.0, 3.0]
    for k, v in runs[0].outputs.items():  # every step skipped: the state stays the initial one
        if k.startswith(("model.", "lm_head", "opt.")):
            assert runs[1].outputs[k].tobytes() == v.tobytes(), k
    grow = dtm.MixedPrecision(compute="f16", init_scale=2.0**10, growth_interval=2)
    scales = [
        m["loss_scale"]
        for m in dtm.fit(
            _step(dtm.nn.Llama(CFG, axis="tp"), grow, mesh), _feed(data), steps=5, sim=2, quiet=True
        ).metrics
    ]
    assert scales == [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**12]

    save = dtm.CheckpointPolicy(str(tmp_path / "s"), every=2)
    dtm.fit(step, _feed(data), steps=2, sim=2, checkpoint=save, quiet=True)
    plain = _step(dtm.nn.Llama(CFG, axis="tp"), None, mesh)
    again = dtm.CheckpointPolicy(str(tmp_path / "s"), resume=True)
    assert [
        m["step"]
        for m in dtm.fit(plain, _feed(data), steps=3, sim=2, checkpoint=again, quiet=True).metrics
    ] == [2.0]
    back = dtm.fit(step, _feed(data), steps=4, sim=2, checkpoint=again, quiet=True)  # f32's
    assert [m["step"] for m in back.metrics] == [3.0]  # (the scaler starts from its init)
    assert back.metrics[0]["loss_scale"] == 65536.0 and back.metrics[0]["skipped"] == 0.0
    with pytest.raises(
        UsageError, match="dynamic loss scaling\\) in a pipelined or accumulating step"
    ):
        _step(dtm.nn.Llama(CFG, axis="tp"), f16, mesh, accumulate=2)
