"""Every example program parses, verifies, round-trips and hashes stably."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtm_mpi.ir import check_text, module_hash, parse_module, print_module

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.dtm"))


def test_the_named_examples_exist() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"tp_mlp", "dp_step", "attention", "collectives"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_verifies_and_round_trips(path: Path) -> None:
    module, errors = check_text(path.read_text(), str(path))
    assert errors == [], "\n".join(map(str, errors))
    assert module is not None and module.entry is not None
    again = parse_module(print_module(module))
    assert again == module
    assert module_hash(again) == module_hash(module)


def test_collectives_example_uses_every_collective() -> None:
    module, _ = check_text((EXAMPLES[0].parent / "collectives.dtm").read_text())
    assert module is not None
    used = {op.name for f in module.functions for op in f.body}
    assert {"allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all"} <= used


def test_pipeline_example_pairs_send_and_recv() -> None:
    module, _ = check_text((EXAMPLES[0].parent / "pipeline.dtm").read_text())
    assert module is not None
    used = [op.name for f in module.functions for op in f.body]
    assert used.count("send") == used.count("recv") == 1
