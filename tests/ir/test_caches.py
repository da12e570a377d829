"""The printer's template cache and the verifier's rule cache never change an answer: ops whose
attributes compare equal but print differently (``1`` and ``1.0``, ``0.0`` and ``-0.0``) are
printed apart, and a cached rule never hides an error of a later op."""

from __future__ import annotations

from dtm_mpi.ir import check_text, module_hash, parse_module, print_module

HEAD = "dtm 1.0\nmodule t\nmesh @m = [dp=2]\n"


def test_equal_comparing_literals_print_apart() -> None:
    text = HEAD + (
        "entry func @f() -> f32[2] {\n"
        "  %a = constant [1, 2] : f32[2]\n"
        "  %b = constant [1.0, 2.0] : f32[2]\n"
        "  %c = random normal seed 1 mean 0.0 : f32[2]\n"
        "  %d = random normal seed 1 mean -0.0 : f32[2]\n"
        "  %e = add %a, %b : f32[2]\n"
        "  return %e\n}\n"
    )
    printed = print_module(parse_module(text))
    assert "constant [1, 2] :" in printed
    assert "constant [1.0, 2.0] :" in printed
    assert "mean 0.0 :" in printed and "mean -0.0 :" in printed
    # the same module with the two constants swapped hashes differently
    swapped = (
        text.replace("[1, 2]", "[X]").replace("[1.0, 2.0]", "[1, 2]").replace("[X]", "[1.0, 2.0]")
    )
    assert module_hash(parse_module(swapped)) != module_hash(parse_module(text))


def test_cached_rule_does_not_hide_a_later_error() -> None:
    body = "".join(f"  %g{i} = gelu %x : f32[4,8]{{dp,-}}\n" for i in range(5))
    text = HEAD + (
        "entry func @f(%x: f32[4,8]{dp,-}) -> f32[4,8]{dp,-} {\n"
        + body
        + "  %bad = gelu %x : f32[4,8]\n"
        + "  return %g0\n}\n"
    )
    _, errors = check_text(text, "t.dtm")
    assert len(errors) == 1
    assert errors[0].span.line == 10
    assert "result type is f32[4,8] but the rule gives f32[4,8]{dp,-}" in str(errors[0])


def test_cached_rule_is_per_function_mesh() -> None:
    text = (
        "dtm 1.0\nmodule t\nmesh @a = [dp=2]\nmesh @b = [tp=2]\n"
        "func @g(%x: f32[4]) -> f32[4] partial(sum: dp) on @a {\n"
        "  %y = redistribute %x : f32[4] partial(sum: dp)\n  return %y\n}\n"
        "entry func @f(%x: f32[4]) -> f32[4] on @b {\n"
        "  %y = redistribute %x : f32[4] partial(sum: dp)\n  return %x\n}\n"
    )
    _, errors = check_text(text, "t.dtm")
    assert len(errors) == 1 and errors[0].span.line == 10, [str(e) for e in errors]
    assert "mesh @b does not declare" in str(errors[0])
