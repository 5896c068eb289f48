"""The options of a ``kvtier bench`` run (:class:`BenchConfig`) and its tiers' segment size."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BenchConfig:
    """Options of ``kvtier bench`` (see the CLI for their meaning)."""

    layout: str = "gemma-3-270m"
    size_bytes: int = 1 << 30
    blocks_per_chunk: int = 16
    tokens_per_block: int = 16
    batch_chunks: int = 32
    io_threads: int = 4
    direct_io: str = "auto"
    io_backend: str = "auto"
    request_nbytes: int = 4 << 20
    repeat: int = 3
    inflight_batches: int = 4
    root: str | None = None
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    nvme: bool = True
    seed: int = 0
    block_order: str = "random"
    gc_freeze: bool = True
    """Freeze the set-up heap before the phases, as a serving process does after start-up."""


_SEGMENT_NBYTES = 256 << 20
"""Segment file size of the bench's tiers (the first one per group is allocated whole)."""
