"""sfstore's version: on the ground floor, so the probe and the CLI report it without importing the package's
entry point (pyproject.toml holds the same; a test keeps the two equal)."""

from __future__ import annotations

__all__ = ["VERSION"]

VERSION = "0.1.0"
