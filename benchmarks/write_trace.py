"""Where the CPU -> NVMe leg spends its time, against a raw write, request by request.

Each pass runs a raw sequential write (``kvtier bench``'s ``raw_sequential``:
the same RowIO backend, request size, 4 threads, O_DIRECT mode, a fresh
``fallocate``d file, ``fdatasync``) and then the leg (``kvtier bench``'s
``nvme_write``: every chunk stored into the CPU tier, not timed, then
``store(chunks, durable=True)``), both through a tracing RowIO wrapper (the
engine's ``NVMeConfig(row_io_wrapper=...)`` seam) that takes the clock around
every ``pwritev``, ``fdatasync`` and ``allocate``. Per pass and side it prints:

- ``GB/s``: bytes over the timed region (raw: from file creation to the end
  of its ``fdatasync``; leg: the ``store`` call);
- ``first ms``: from the start of the timed region to the first request;
- ``tail ms``: from the end of the last request to the end of the region;
- ``requests`` and their mean size;
- ``per-thread GB/s``: bytes over the summed time spent inside ``pwritev``
  (the syscall plus taking the GIL back: what one I/O thread moves while busy);
- ``in flight``: the share of the region with 0..4 requests in flight.

    python benchmarks/write_trace.py --passes 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import uvloop
from write_ab import leg_setup

import kvtier
from kvtier.bench.data import _batches
from kvtier.io import RowIO

_EVENTS: list[tuple[str, float, float, int]] = []
"""``(kind, start, end, bytes)`` of every traced call (``w``rite, ``s``ync, ``a``llocate)."""


class _Tracing:
    """A RowIO that records the start and end of each call of the RowIO it wraps."""

    def __init__(self, inner: RowIO) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        t0 = time.perf_counter()
        n = self._inner.pwritev(handle, bufs, file_offset)
        _EVENTS.append(("w", t0, time.perf_counter(), n))
        return n

    def fdatasync(self, handle: Any) -> None:
        t0 = time.perf_counter()
        self._inner.fdatasync(handle)
        _EVENTS.append(("s", t0, time.perf_counter(), 0))

    def allocate(self, handle: Any, nbytes: int) -> None:
        t0 = time.perf_counter()
        self._inner.allocate(handle, nbytes)
        _EVENTS.append(("a", t0, time.perf_counter(), nbytes))


def _report(side: str, t0: float, t1: float, nbytes: int) -> None:
    writes = [e for e in _EVENTS if e[0] == "w" and e[1] >= t0]
    syncs = [e[2] - e[1] for e in _EVENTS if e[0] == "s" and e[1] >= t0]
    edges = sorted([(e[1], 1) for e in writes] + [(e[2], -1) for e in writes])
    share: dict[int, float] = {}
    depth, prev = 0, t0
    for t, step in edges:
        share[depth] = share.get(depth, 0.0) + t - prev
        prev, depth = t, depth + step
    share[depth] = share.get(depth, 0.0) + t1 - prev
    busy = sum(e[2] - e[1] for e in writes)
    moved = sum(e[3] for e in writes)
    first = min(e[1] for e in writes) - t0
    print(
        f"  {side}: {nbytes / (t1 - t0) / 1e9:5.2f} GB/s, first {1e3 * first:5.2f} ms,"
        f" tail {1e3 * (t1 - max(e[2] for e in writes)):5.2f} ms, {len(writes)} requests of"
        f" {moved / len(writes) / 2**20:.2f} MiB, per-thread {moved / busy / 1e9:.2f} GB/s,"
        f" syncs {len(syncs)} ({1e3 * sum(syncs):.2f} ms), in flight "
        + " ".join(f"{k}:{100 * v / (t1 - t0):.0f}%" for k, v in sorted(share.items())),
        flush=True,
    )


async def main(args: argparse.Namespace) -> None:
    layout, chunks, tmp, groups, row_bytes, base = leg_setup(
        args.size_mib, args.dir, "kvtier-trace-"
    )
    base.io = _Tracing(base.io)
    nvme = kvtier.NVMeConfig(
        root=os.path.join(tmp, "tier"),
        capacity_bytes=2 * row_bytes + groups * (256 << 20),
        namespace="trace",
        segment_nbytes=256 << 20,
        row_io_wrapper=_Tracing,
    )
    engine_cfg = kvtier.EngineConfig(
        len(chunks) * layout.slot_nbytes(16), 16, nvme=nvme, max_batch_chunks=32,
        write_through=False,
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    gc.collect()
    gc.freeze()  # as kvtier bench does
    try:
        for p in range(args.passes):
            print(f"pass {p + 1}")
            _EVENTS.clear()
            # raw_write times itself from file creation; take its start from its allocate
            seconds = await loop.run_in_executor(None, base.raw_write)
            t1 = max(e[2] for e in _EVENTS)
            _report("raw ", t1 - seconds, t1, row_bytes)
            async with kvtier.TransferEngine(layout, engine_cfg) as engine:
                for batch in _batches(chunks, 32):
                    await engine.store(batch)
                _EVENTS.clear()
                t0 = time.perf_counter()
                await engine.store(chunks, durable=True)
                _report("leg ", t0, time.perf_counter(), row_bytes)
            shutil.rmtree(nvme.root)
    finally:
        base.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", default=os.getcwd(), help="where the temporary files go")
    uvloop.run(main(parser.parse_args()))
