"""Paired A/B of the CPU -> NVMe leg: what one change of the write path is worth.

The leg is ``kvtier bench``'s ``nvme_write``: every chunk is stored into the
CPU tier (not timed), then ``store(chunks, durable=True)`` writes and syncs
their rows. Each pass runs a raw sequential write (the same RowIO backend,
4 MiB requests, 4 threads, O_DIRECT mode) right before the leg, and the ratio
leg/raw is taken per pass; the base and the variant alternate pass by pass
(ABBA), so a disk that drifts over the run hurts both alike. The variants
change the engine from outside, for measurement only:

- ``meta_on_io_pool``: file growth and hole punching back on the I/O threads
  (what kvtier did before it had the ``kvtier-meta`` worker; a negative
  difference is what the worker gains).
- ``no_checksum``: the payload checksum replaced by a constant (rows written
  this way do not verify; the leg does not read them).
- ``gc_off``: the cyclic garbage collector disabled during the leg.
- ``gc_freeze``: ``gc.freeze()`` before the leg (existing objects are no longer
  scanned by collections).
- ``busy_thread_50`` / ``busy_thread_100``: another Python thread of the
  process runs bytecode 5 ms of every 10 ms / all the time during the leg (a
  serving thread next to a ``BackgroundEngine``): kvtier's loop and I/O
  threads then wait for the GIL.
- ``aio_backend``: ``NVMeConfig(io_backend="aio")`` (row requests queued in the
  kernel through Linux AIO) instead of the posix I/O threads.

``--busy-percent P`` runs such a busy thread during the legs of BOTH sides
(the raw writes stay unloaded), e.g. ``--variant aio_backend --busy-percent 50``.

    python benchmarks/write_ab.py --variant meta_on_io_pool --pairs 16
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import uvloop

import kvtier
import kvtier.io._files as files
from kvtier._shapes import model_shape
from kvtier.bench import BenchConfig
from kvtier.bench.baselines import _Baselines
from kvtier.bench.data import _batches, _chunks
from kvtier.layout import round_up

_CHECKSUM = files.payload_checksum


def _toggle(variant: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(apply, undo) of a process-wide variant; engine-level ones are applied in ``_leg``."""
    if variant == "no_checksum":
        return (
            lambda: setattr(files, "payload_checksum", lambda _: 0),
            lambda: setattr(files, "payload_checksum", _CHECKSUM),
        )
    if variant == "gc_off":
        return gc.disable, gc.enable
    if variant == "gc_freeze":
        return gc.freeze, gc.unfreeze
    if variant.startswith("busy_thread_"):
        return _busy_thread(int(variant.rsplit("_", 1)[1]))
    return (lambda: None), (lambda: None)


def _busy_thread(percent: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(start, stop) of a thread running Python ``percent``% of every 10 ms."""
    stop = threading.Event()
    busy_s, idle_s = percent / 1e4, (100 - percent) / 1e4

    def spin() -> None:
        x = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < busy_s:
                x += 1
            if idle_s:
                time.sleep(idle_s)

    thread = threading.Thread(target=spin, name="busy-serving-thread")

    def undo() -> None:
        stop.set()
        thread.join()

    return thread.start, undo


async def _leg(
    layout, chunks, nvme: kvtier.NVMeConfig, variant: str | None, busy_percent: int = 0
) -> float:
    cfg = kvtier.EngineConfig(
        len(chunks) * layout.slot_nbytes(16),
        16,
        nvme=nvme,
        max_batch_chunks=32,
        write_through=False,
    )
    apply, undo = _toggle(variant or "")
    busy_start, busy_stop = _busy_thread(busy_percent) if busy_percent else _toggle("")
    if variant == "aio_backend":
        nvme = dataclasses.replace(nvme, io_backend="aio")
        cfg = dataclasses.replace(cfg, nvme=nvme)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        if variant == "meta_on_io_pool":
            tier = engine._writer._tier  # type: ignore[union-attr]
            tier._run_meta = tier._run  # type: ignore[method-assign]
        for batch in _batches(chunks, 32):
            await engine.store(batch)
        apply()
        busy_start()
        try:
            t0 = time.perf_counter()
            await engine.store(chunks, durable=True)
            seconds = time.perf_counter() - t0
        finally:
            busy_stop()
            undo()
        assert (engine.stats().nvme or {}).get("write_failures", 0) == 0
    shutil.rmtree(nvme.root)
    return seconds


def leg_setup(size_mib: int, where: str, prefix: str) -> tuple[Any, ...]:
    """The leg's data as ``kvtier bench`` builds it (also used by ``write_trace.py``).

    Returns:
        ``(layout, chunks, tmp, groups, row_bytes, base)``: the Gemma-3-270M
        layout of ``size_mib`` MiB, its chunks (16 blocks, random ids), a new
        temporary folder under ``where``, the number of groups, the bytes of
        all rows, and the raw-write baselines writing into ``tmp``.
    """
    cfg = BenchConfig(size_bytes=size_mib << 20)
    shape = model_shape(cfg.layout, cfg.tokens_per_block)
    num_blocks = cfg.size_bytes // shape.block_nbytes()
    layout = shape.build(num_blocks - num_blocks % 16, "cpu")
    chunks = _chunks(layout, shape, 16, 0, "random")
    tmp = tempfile.mkdtemp(prefix=prefix, dir=where)
    rows = {g: round_up(layout.group_nbytes(g, 16)) + 4096 for g in layout.group_ids}
    row_bytes = sum(rows[c.key.group_id] for c in chunks)
    base = _Baselines(cfg, tmp, row_bytes, max(rows.values()), len(chunks))
    return layout, chunks, tmp, len(rows), row_bytes, base


async def main(args: argparse.Namespace) -> None:
    layout, chunks, tmp, groups, row_bytes, base = leg_setup(args.size_mib, args.dir, "kvtier-ab-")
    nvme = kvtier.NVMeConfig(
        root=os.path.join(tmp, "tier"),
        capacity_bytes=2 * row_bytes + groups * (256 << 20),
        namespace="ab",
    )
    loop = asyncio.get_running_loop()
    ratios: dict[bool, list[float]] = {False: [], True: []}
    try:
        for p in range(args.pairs + 1):  # pass 0 warms up
            for on in (False, True) if p % 2 else (True, False):
                raw = await loop.run_in_executor(None, base.raw_write)
                leg = await _leg(
                    layout, chunks, nvme, args.variant if on else None, args.busy_percent
                )
                if p:
                    ratios[on].append(raw / leg)
    finally:
        base.close()
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    diff = med([b - a for a, b in zip(ratios[False], ratios[True], strict=True)])
    print(
        f"leg / raw: base median {med(ratios[False]):.3f}, {args.variant} median "
        f"{med(ratios[True]):.3f}; paired difference median {diff:+.3f} over {args.pairs} pairs"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--variant",
        required=True,
        choices=[
            "meta_on_io_pool",
            "no_checksum",
            "gc_off",
            "gc_freeze",
            "busy_thread_50",
            "busy_thread_100",
            "aio_backend",
            "none",
        ],
    )
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument(
        "--busy-percent", type=int, default=0, help="a busy Python thread during both legs"
    )
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--dir", default=os.getcwd(), help="folder on the filesystem to measure")
    uvloop.run(main(ap.parse_args()))
