"""Generated elementwise kernels without a GPU: the generated source names and types are
stable and checked, and the source compiles with nvcc for sm_80 and sm_90 (when nvcc is on
PATH) exporting the kernel under its generated name."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.errors import KernelError
from dtm_mpi.ir.registry import OPS, Trait, ops_with
from dtm_mpi.kernels.fused import Expr, FusedInput, fused_name, fused_source
from dtm_mpi.kernels.sources import INCLUDE_LINE, kernel_dir, kernel_files, kernel_source

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
BIAS_GELU_MUL = Expr("mul", (Expr("gelu", (Expr("add", (0, 1)),)), 2))


def test_sources_are_found_and_the_header_inlined() -> None:
    assert (kernel_dir() / "dtm_common.cuh").is_file()
    names = {p.name for p in kernel_files()}
    assert {"softmax.cu", "layer_norm.cu", "quant.cu", "fused_elementwise.cu"} <= names
    for p in kernel_files():
        text = kernel_source(p.name)
        assert not any(ln.strip() == INCLUDE_LINE for ln in text.splitlines()), p.name
        assert "dtm_load" in text and text.count("#include <cuda_fp16.h>") >= 1, p.name


def test_kernel_dir_override_and_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dtm_mpi.config import get_config
    from dtm_mpi.kernels import sources

    (tmp_path / "dtm_common.cuh").write_text("// header\n")
    (tmp_path / "x.cu").write_text(f"{INCLUDE_LINE}\n// body\n")
    (tmp_path / "bad.cu").write_text("// no include\n")
    monkeypatch.setenv("DTM_KERNEL_DIR", str(tmp_path))
    get_config.cache_clear()
    sources.kernel_dir.cache_clear()
    sources.kernel_source.cache_clear()
    try:
        assert sources.kernel_dir() == tmp_path
        assert "// header" in sources.kernel_source("x.cu")
        with pytest.raises(KernelError, match=r"bad\.cu: does not include dtm_common\.cuh"):
            sources.kernel_source("bad.cu")
        with pytest.raises(KernelError, match="cannot read kernel source"):
            sources.kernel_source("missing.cu")
    finally:
        monkeypatch.delenv("DTM_KERNEL_DIR")
        get_config.cache_clear()
        sources.kernel_dir.cache_clear()
        sources.kernel_source.cache_clear()


def test_missing_sources_name_every_place_looked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from dtm_mpi.kernels import sources

    monkeypatch.setattr(sources, "_candidates", lambda: [tmp_path / "a", tmp_path / "b"])
    sources.kernel_dir.cache_clear()
    try:
        with pytest.raises(KernelError, match=r"not found; looked in .*a, .*b .*DTM_KERNEL_DIR"):
            sources.kernel_dir()
    finally:
        sources.kernel_dir.cache_clear()


def test_generated_source_is_typed_and_named_by_content() -> None:
    ins = [FusedInput(F16), FusedInput(F16, lastdim=True), FusedInput(F16)]
    name, code = fused_source(BIAS_GELU_MUL, ins, F16, "TEMPLATE")
    assert name == fused_name(BIAS_GELU_MUL, ins, F16) and name.startswith("dtm_fused_")
    assert fused_name(BIAS_GELU_MUL, ins, F32) != name  # the types are part of the key
    assert "const __half* __restrict__ in1" in code and "__half* __restrict__ out0" in code
    assert "dtm_load(in1 + (i % cols))" in code and "dtm_load(in0 + i)" in code
    assert "dtm_gelu_tanh((v0 + v1))" in code and "#define DTM_FUSED_ACC float" in code
    _, code64 = fused_source(Expr("exp", (0,)), [FusedInput(F64)], F64, "T")
    assert "#define DTM_FUSED_ACC double" in code64
    assert code.endswith("TEMPLATE")


@pytest.mark.parametrize(
    ("expr", "ins", "out", "match"),
    [
        (Expr("pow", (0, 1)), [FusedInput(F32)] * 2, F32, "'pow' with 2 operand"),
        (Expr("exp", (3,)), [FusedInput(F32)], F32, "refers to input 3 of 1"),
        (Expr("exp", (0,)), [FusedInput(np.dtype(np.int32))], F32, "input 0 has dtype int32"),
        (Expr("exp", (0,)), [FusedInput(F32)], np.dtype(np.int8), "output dtype int8"),
    ],
)
def test_generation_errors(expr: Expr, ins: list[FusedInput], out: np.dtype, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(KernelError, match=match):
        fused_source(expr, ins, out, "")


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_generated_kernels_compile_for_sm80_and_sm90(tmp_path: Path) -> None:
    """Every elementwise op alone in every float type, and a bias+gelu+mul chain with a
    broadcast input in mixed types, compile into one PTX per architecture."""
    template = kernel_source("fused_elementwise.cu")
    units: list[tuple[str, str]] = []
    for dt in (F16, F32, F64):
        for op in sorted(ops_with(Trait.FUSIBLE)):
            n = OPS[op].arity
            units.append(
                fused_source(Expr(op, tuple(range(n))), [FusedInput(dt)] * n, dt, template)
            )
    units.append(
        fused_source(
            BIAS_GELU_MUL, [FusedInput(F16), FusedInput(F32, True), FusedInput(F64)], F16, template
        )
    )
    # one translation unit per kernel would take minutes: put them all in one file, each
    # behind its own defines (the template's include guards make the header appear once)
    parts = []
    for _name, code in units:
        defines, _, body = code.partition(template)
        parts.append(
            f"{defines}\n{body}{_template_body(template)}\n#undef DTM_FUSED_NAME\n#undef DTM_FUSED_PARAMS\n#undef DTM_FUSED_ACC\n#undef DTM_FUSED_BODY\n"
        )
    src = tmp_path / "fused_all.cu"
    src.write_text(_template_header(template) + "\n".join(parts))
    for arch in ("sm_80", "sm_90"):
        ptx = tmp_path / f"{arch}.ptx"
        proc = subprocess.run(
            [str(NVCC), "-std=c++17", f"-arch={arch}", "--ptx", "-o", str(ptx), str(src)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        text = ptx.read_text()
        for name, _ in units:
            assert f".entry {name}(" in text, f"{name} missing for {arch}"


def _template_header(template: str) -> str:
    """The inlined header part of the template (everything before the kernel's own text)."""
    return template[: template.index("// ---- fused_elementwise.cu ----")]


def _template_body(template: str) -> str:
    """The template's own text without its default-setting block (the defines come first)."""
    own = template[template.index("// ---- fused_elementwise.cu ----") :]
    return own[own.index("DTM_KERNEL DTM_FUSED_NAME") :]
