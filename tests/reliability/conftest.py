"""Fixtures: ``slots`` (page-aligned slot buffers), ``tmpfs`` and ``ext4`` (small real mounts)."""

from __future__ import annotations

from ..io.conftest import slots
from .full_fs import ext4, tmpfs

__all__ = ["ext4", "slots", "tmpfs"]
