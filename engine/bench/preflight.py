"""Checks made before a run allocates anything.

The layout's shape and the data set's blocks, the memory the data set needs,
and for the NVMe phases the folder's free space and whether the I/O backend
and direct-I/O mode work there.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

from kvtier._shapes import ModelShape, model_shape
from kvtier.bench.config import _SEGMENT_NBYTES, BenchConfig
from kvtier.io import AioRowIO
from kvtier.io._tier import GROW_NBYTES
from kvtier.layout import round_up


def _mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def preflight(cfg: BenchConfig) -> tuple[ModelShape, int]:
    """Check that a run of ``cfg`` can work before anything is allocated; its shape and blocks.

    The data set is ``--size`` rounded down to whole chunks, at least one
    chunk per group. Checked: the memory it needs (on a CPU device about
    3x the data set plus a slot per chunk: the KV cache, the plain-copy
    buffers and the CPU tier) against ``MemAvailable``; with NVMe phases,
    that the folder takes a temporary directory, its free space (about 4x
    the rows, plus a growth step per group for each of two tiers) and that
    the I/O backend and direct-I/O mode work there
    (:func:`kvtier.io.select_backend`; for ``aio``, two contexts).

    Returns:
        ``(shape, num_blocks)``: the layout's shape and blocks per tensor.

    Raises:
        InvalidArgumentError: unknown layout or a bad layout file.
        ConfigError: not enough memory or disk; the folder is not writable;
            the backend or direct-I/O mode does not work there.
    """
    from kvtier.errors import ConfigError
    from kvtier.io import select_backend

    shape = model_shape(cfg.layout, cfg.tokens_per_block)
    bpc = cfg.blocks_per_chunk
    num_blocks = max(bpc, cfg.size_bytes // shape.block_nbytes())
    num_blocks -= num_blocks % bpc
    groups = shape.groups()
    item = shape.dtype.itemsize
    group_nbytes = [sum(math.prod(shape.layers[i].page_shape) for i in g) * item for g in groups]
    data = num_blocks * shape.block_nbytes()
    chunks = num_blocks // bpc
    slot = round_up(max(group_nbytes) * bpc) + 4096
    rows = chunks * sum(round_up(n * bpc) + 4096 for n in group_nbytes)
    host = chunks * len(groups) * slot + (3 * data if cfg.device == "cpu" else data)
    host += 512 << 20  # the process itself: Python, torch, the engines' threads
    available = _mem_available()
    if available is not None and host > available:
        floor = num_blocks == bpc  # one chunk per group: --size is not what sets it
        advice = (
            f"one chunk per group is the least a run moves: pass a smaller --blocks-per-chunk "
            f"(now {bpc})"
            if floor
            else "pass a smaller --size"
        )
        raise ConfigError(
            f"kvtier bench: {shape.name} at {data / 2**30:.2f} GiB per phase needs about "
            f"{host / 2**30:.1f} GiB of memory, {available / 2**30:.1f} GiB is available: " + advice
        )
    if not cfg.nvme:
        return shape, num_blocks
    folder = cfg.root or os.getcwd()
    try:
        probe = tempfile.mkdtemp(prefix="kvtier-bench-probe-", dir=folder)
    except OSError as exc:
        raise ConfigError(f"kvtier bench: cannot write in {folder}: {exc} (see --dir)") from exc
    try:
        # raw.bin, the file-per-chunk files and two tiers at once (tier{r}, tier{r}-e2e),
        # each tier with up to one growth step per group beyond its rows (NVMeTier).
        capacity = 2 * rows + len(groups) * _SEGMENT_NBYTES
        step = min(_SEGMENT_NBYTES - 4096, GROW_NBYTES, capacity // (4 * len(groups)))
        least = 2 * len(groups) * step  # each group's first segment file, in two tiers
        need = 4 * rows + least
        free = shutil.disk_usage(probe).free
        if need > free:
            advice = (
                "pass a smaller --size or another --dir"
                if least <= free
                else f"no --size fits: any run needs about {least / 2**30:.1f} GiB (a segment "
                "file per group in two tiers); pass another --dir, or --no-nvme"
            )
            raise ConfigError(
                f"kvtier bench: the NVMe phases need about {need / 2**30:.1f} GiB of free "
                f"space in {folder}, which has {free / 2**30:.1f} GiB: {advice}"
            )
        # The run holds two backends at once (the baselines' and the tier's): for
        # "aio", two kernel contexts must fit under fs.aio-max-nr.
        ios = [select_backend(cfg.io_backend, cfg.direct_io, probe, 4 * cfg.io_threads)]
        if isinstance(ios[0], AioRowIO):
            try:
                ios.append(AioRowIO(4 * cfg.io_threads))
            except OSError as exc:
                raise ConfigError(
                    f"kvtier bench --io-backend aio: the run needs two AIO contexts of "
                    f"{4 * cfg.io_threads} requests: {exc} (fewer --io-threads?)"
                ) from exc
        for io in ios:
            if isinstance(io, AioRowIO):
                io.shutdown()
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return shape, num_blocks
