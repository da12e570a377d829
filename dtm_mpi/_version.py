"""The package version (single source: setup.cfg reads it from here)."""

__version__ = "0.1.0"
