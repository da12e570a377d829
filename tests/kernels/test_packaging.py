"""Installed wheels carry the kernel sources: setup.cfg's data_files cover every file of
kernels/, and the loader looks where pip puts them (<prefix>/share/dtm_mpi/kernels)."""

from __future__ import annotations

import configparser
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_data_files_cover_every_kernel_source() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    entries = cfg["options.data_files"]
    assert "share/dtm_mpi/kernels" in entries
    globs = [
        g.strip()
        for g in entries["share/dtm_mpi/kernels"].replace("\n", ",").split(",")
        if g.strip()
    ]
    shipped = {p.resolve() for g in globs for p in ROOT.glob(g)}
    sources = {p.resolve() for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh")}
    assert sources and sources <= shipped, sorted(str(p) for p in sources - shipped)


def test_loader_looks_in_the_installed_location() -> None:
    from dtm_mpi.kernels import sources

    places = sources._candidates()
    assert Path(sys.prefix) / "share" / "dtm_mpi" / "kernels" in places
    assert places.index(ROOT / "kernels") < places.index(
        Path(sys.prefix) / "share" / "dtm_mpi" / "kernels"
    )
