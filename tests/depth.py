"""How deep the property tests search: one profile for the whole suite.

``ci`` (the default, ``make test``): each property runs the example count its test states (100
where it states none). ``deep`` (``make test-deep``, which passes ``--hypothesis-profile=deep``):
ten times as many. The counts are the tests' own: a profile scales them, never cuts them.
"""

from __future__ import annotations

from hypothesis import settings

PROFILES = {"ci": 100, "deep": 1000}
"""Profile -> the example count of a test that states none (hypothesis' default is 100)."""


def register_profiles() -> None:
    """Register the profiles and load ``ci`` (tests/conftest.py, before pytest's
    ``--hypothesis-profile`` loads another)."""
    for name, count in PROFILES.items():
        # no per-example deadline: a loaded machine (workers two a core, other jobs) stretches
        # any example past hypothesis' 200 ms, and a time limit is not what a property tests
        settings.register_profile(name, max_examples=count, deadline=None)
    settings.load_profile("ci")


def examples(n: int) -> int:
    """``n`` examples scaled by the loaded profile (``n`` under ``ci``)."""
    return n * settings.default.max_examples // PROFILES["ci"]
