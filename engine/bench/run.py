"""A whole ``kvtier bench`` run and its progress steps.

:func:`run_bench` checks the run (:func:`~kvtier.bench.preflight.preflight`),
builds the data set, freezes the set-up heap and runs the copy phases, the
NVMe phases and the scheduling overhead, collected into one JSON-able result.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from rich.markup import escape

import kvtier
from kvtier._shapes import ModelShape
from kvtier.bench.config import BenchConfig
from kvtier.bench.copy_phases import _copy_phases, _scheduling_overhead
from kvtier.bench.data import _chunks
from kvtier.bench.nvme_phases import _NVME_STEPS_PER_REPEAT, _nvme_phases
from kvtier.bench.preflight import preflight
from kvtier.bench.timing import LagMonitor, Phase
from kvtier.layout import KVLayout, round_up


def bench_steps(cfg: BenchConfig) -> int:
    """How many times :func:`run_bench` calls its ``progress`` callback for ``cfg``.

    Set-up, the copy phases and the scheduling overhead, plus
    ``_NVME_STEPS_PER_REPEAT`` per repeat with ``cfg.nvme``: the total of a
    progress bar whose ``n``-th call starts step ``n``.
    """
    return 3 + (_NVME_STEPS_PER_REPEAT * cfg.repeat if cfg.nvme else 0)


async def run_bench(
    cfg: BenchConfig, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Run every phase and return the figures (JSON-able).

    With ``cfg.gc_freeze`` the heap left by the set-up is frozen for the
    phases and unfrozen afterwards (see :mod:`kvtier.bench`), unless the
    caller's heap was frozen already (``gc.get_freeze_count() > 0``).

    Args:
        cfg: options; ``size_bytes`` is the KV cache size (bytes) moved per phase.
        progress: called with a short description as each step starts, never
            inside a timed region: :func:`bench_steps` times in all.

    Returns:
        ``{"config", "machine", "layout", "phases": {name: summary},
        "loop_lag_p99_ms", "gc_frozen_objects", ...}``.

    Raises:
        InvalidArgumentError: a bad layout file (:func:`preflight`).
        ConfigError: the run would not fit, or cannot write (:func:`preflight`).
        AssertionError: a round trip changed bytes or a phase failed keys.
    """
    shape, num_blocks = preflight(cfg)
    progress(f"allocating {escape(shape.name)}: {num_blocks} blocks")
    layout = shape.build(num_blocks, cfg.device)
    chunks = _chunks(layout, shape, cfg.blocks_per_chunk, cfg.seed, cfg.block_order)
    # A caller that froze its heap already manages the collector: leave it alone.
    freeze = cfg.gc_freeze and gc.get_freeze_count() == 0
    if freeze:
        gc.collect()  # garbage frozen now would never be freed
        gc.freeze()
    try:
        return await _run_phases(
            cfg, shape, layout, chunks, num_blocks, gc.get_freeze_count(), progress
        )
    finally:
        if freeze:
            gc.unfreeze()


async def _run_phases(
    cfg: BenchConfig,
    shape: ModelShape,
    layout: KVLayout,
    chunks: list[kvtier.Chunk],
    num_blocks: int,
    frozen: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    report = {
        name: Phase(name, 0)
        for name in (
            "store",
            "load",
            "nvme_write",
            "nvme_write_full",
            "nvme_write_e2e",
            "nvme_read",
        )
    }
    progress("copy phases")
    await _copy_phases(cfg, layout, chunks, report)
    lag = LagMonitor()
    io_info: dict[str, Any] = {}
    if cfg.nvme:
        io_info = await _nvme_phases(cfg, layout, chunks, report, lag, progress)
    else:
        for name in ("nvme_write", "nvme_write_full", "nvme_write_e2e", "nvme_read"):
            del report[name]
    progress("scheduling overhead")
    overhead = await _scheduling_overhead(cfg, shape, len(chunks))
    bpc = cfg.blocks_per_chunk
    return {
        # the block size in effect (a layout file's own tokens_per_block wins)
        "config": {**asdict(cfg), "tokens_per_block": shape.tokens_per_block},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "device": cfg.device,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "layout": {
            "name": shape.name,
            "groups": len(layout.group_ids),
            "num_blocks": num_blocks,
            "tokens_per_block": shape.tokens_per_block,  # a layout file's own, if it sets one
            "chunks": len(chunks),
            "slot_nbytes": layout.slot_nbytes(bpc),
            "sum_sized_slot_nbytes": round_up(
                sum(layout.group_nbytes(g, bpc) for g in layout.group_ids)
            )
            + 4096,
        },
        "io": io_info,
        "gc_frozen_objects": frozen,
        "phases": {name: p.summary() for name, p in report.items()},
        "scheduling_overhead_us_per_chunk": overhead,
        "loop_lag_p99_ms": round(lag.p99_ms(), 3),
    }
