"""Fixtures shared with the NVMe tier tests: ``slots`` (page-aligned slot buffers)."""

from __future__ import annotations

from ..io.conftest import slots

__all__ = ["slots"]
