"""Prototype, not shipped: the CPU -> NVMe leg with Linux AIO writes instead of the I/O threads.

kvtier's posix backend runs each request on a worker thread, which needs the
GIL after every ``pwritev``. Here the leg's row writes go through a Linux AIO
context instead (``io_submit`` of a ``IOCB_CMD_PWRITEV`` per run from the event
loop, completions reaped by one thread blocked in ``io_getevents``), so up to
``--depth`` requests sit in the kernel whatever holds the GIL. Sealing
(checksums, trailers) is unchanged. Compared side by side, per pass: a raw
write with threads, a raw write with AIO (same depth), the leg with threads,
the leg with AIO; ``--busy-percent`` adds a Python thread of the process that
runs bytecode that share of every 10 ms during the legs (a serving thread).

x86_64 and aarch64 Linux only; needs O_DIRECT (AIO is synchronous otherwise).

    python benchmarks/aio_ab.py --passes 4 --busy-percent 50
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import uvloop
from write_ab import _busy_thread

import kvtier
import kvtier.io._batches as batches
import kvtier.io._files as files
from kvtier._shapes import model_shape
from kvtier.bench import BenchConfig, _Baselines, _batches, _chunks
from kvtier.layout import round_up

# io_setup, io_destroy, io_getevents, io_submit
_NR = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}[platform.machine()]
_PWRITEV = 8
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Iocb(ctypes.Structure):  # struct iocb, little-endian layout
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("key", ctypes.c_uint32),
        ("rw_flags", ctypes.c_int32),
        ("lio_opcode", ctypes.c_uint16),
        ("reqprio", ctypes.c_int16),
        ("fildes", ctypes.c_uint32),
        ("buf", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("offset", ctypes.c_int64),
        ("reserved2", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):  # struct io_event
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class AioRing:
    """One AIO context: ``submit`` from any thread, a reaper thread completes the futures."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        if _syscall(_NR[0], depth, ctypes.byref(self._ctx)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[concurrent.futures.Future[int], Any]] = {}
        self._waiting: collections.deque[_Iocb] = collections.deque()
        self.inflight = 0
        self._next_id = 0
        self._stop = False
        self._reaper = threading.Thread(target=self._reap, name="aio-reaper", daemon=True)
        self._reaper.start()

    def pwritev(
        self, fd: int, bufs: Sequence[memoryview], offset: int
    ) -> concurrent.futures.Future[int]:
        """Queue one vectored write; the future gets the bytes written or an OSError."""
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        iov = (_Iovec * len(bufs))(
            *[_Iovec(ctypes.addressof(ctypes.c_char.from_buffer(b)), len(b)) for b in bufs]
        )
        cb = _Iocb(lio_opcode=_PWRITEV, fildes=fd, buf=ctypes.addressof(iov), nbytes=len(bufs))
        cb.offset = offset
        with self._lock:
            self._next_id += 1
            cb.data = self._next_id
            self._pending[cb.data] = (fut, (cb, iov, bufs))  # alive until completion
            if self.inflight >= self.depth:
                self._waiting.append(cb)
                return fut
            self.inflight += 1
        self._submit(cb)
        return fut

    def _submit(self, cb: _Iocb) -> None:
        ptr = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(cb))
        if _syscall(_NR[3], self._ctx, 1, ptr) != 1:
            err = ctypes.get_errno()
            with self._lock:
                fut = self._pending.pop(cb.data)[0]
                self.inflight -= 1
            fut.set_exception(OSError(err, f"io_submit: {os.strerror(err)}"))

    def _reap(self) -> None:
        events = (_Event * self.depth)()
        timeout = (ctypes.c_long * 2)(0, 100_000_000)  # 100 ms: notices close()
        while not self._stop:
            n = _syscall(_NR[2], self._ctx, 1, self.depth, events, timeout)
            if n <= 0:
                continue
            with self._lock:
                done = [(self._pending.pop(events[k].data)[0], events[k].res) for k in range(n)]
                self.inflight -= n
                refill = []
                while self._waiting and self.inflight < self.depth:
                    refill.append(self._waiting.popleft())
                    self.inflight += 1
            for cb in refill:
                self._submit(cb)
            for fut, res in done:
                if res < 0:
                    fut.set_exception(OSError(-res, os.strerror(-res)))
                else:
                    fut.set_result(res)

    def close(self) -> None:
        """Stop the reaper (after the caller waited for every future) and destroy the context."""
        self._stop = True
        self._reaper.join()
        _syscall(_NR[1], self._ctx)


def _aio_write_run(ring: AioRing) -> Any:
    async def write_run(tier: Any, run: list[Any]) -> tuple[int, BaseException | None]:
        ref = run[0].ref
        spec = tier._specs[ref.group_id]
        exc = await tier._run_checksum(files.seal_run, spec, run)
        if exc is not None:
            return 0, exc
        fd = tier._segments[(ref.group_id, ref.segment)]
        try:
            fut = ring.pwritev(fd, [j.buf for j in run], spec.row_offset(ref.row))
            return await asyncio.wrap_future(fut), None
        except OSError as err:
            return 0, err

    return write_run


def _raw_aio(base: _Baselines, ring: AioRing) -> float:
    path = os.path.join(base.root, "raw.bin")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    t0 = time.perf_counter()
    h = base.io.open(path, True)
    base.io.allocate(h, base.total)
    futs = [
        ring.pwritev(h, [base._mv(off, min(base.req, base.total - off))], off)
        for off in range(0, base.total, base.req)
    ]
    for f in futs:
        f.result()
    base.io.fdatasync(h)
    seconds = time.perf_counter() - t0
    base.io.close(h)
    return seconds


async def _leg(layout: Any, chunks: list[Any], nvme: kvtier.NVMeConfig, busy: int) -> float:
    cfg = kvtier.EngineConfig(
        len(chunks) * layout.slot_nbytes(16), 16, nvme=nvme, max_batch_chunks=32,
        write_through=False,
    )  # fmt: skip
    async with kvtier.TransferEngine(layout, cfg) as engine:
        for batch in _batches(chunks, 32):
            await engine.store(batch)
        start, stop = _busy_thread(busy) if busy else ((lambda: None), (lambda: None))
        start()
        try:
            t0 = time.perf_counter()
            await engine.store(chunks, durable=True)
            seconds = time.perf_counter() - t0
        finally:
            stop()
        assert (engine.stats().nvme or {}).get("write_failures", 0) == 0
    shutil.rmtree(nvme.root)
    return seconds


async def main(args: argparse.Namespace) -> None:
    cfg = BenchConfig(size_bytes=args.size_mib << 20)
    shape = model_shape(cfg.layout, cfg.tokens_per_block)
    num_blocks = cfg.size_bytes // shape.block_nbytes()
    layout = shape.build(num_blocks - num_blocks % 16, "cpu")
    chunks = _chunks(layout, shape, 16, 0, "random")
    tmp = tempfile.mkdtemp(prefix="kvtier-aio-", dir=args.dir)
    rows = {g: round_up(layout.group_nbytes(g, 16)) + 4096 for g in layout.group_ids}
    row_bytes = sum(rows[c.key.group_id] for c in chunks)
    base = _Baselines(cfg, tmp, row_bytes, max(rows.values()), len(chunks))
    if not base.io.direct:
        raise SystemExit("needs O_DIRECT in --dir")
    nvme = kvtier.NVMeConfig(
        root=os.path.join(tmp, "tier"),
        capacity_bytes=2 * row_bytes + len(rows) * (256 << 20),
        namespace="aio",
    )
    ring = AioRing(args.depth)
    loop = asyncio.get_running_loop()
    threads_run = batches._write_run
    seconds: dict[str, list[float]] = {k: [] for k in ("raw_thr", "raw_aio", "kv_thr", "kv_aio")}
    try:
        for p in range(args.passes + 1):  # pass 0 warms up
            t = {
                "raw_thr": await loop.run_in_executor(None, base.raw_write),
                "kv_thr": await _leg(layout, chunks, nvme, args.busy_percent),
                "raw_aio": await loop.run_in_executor(None, _raw_aio, base, ring),
            }
            batches._write_run = _aio_write_run(ring)
            try:
                t["kv_aio"] = await _leg(layout, chunks, nvme, args.busy_percent)
            finally:
                batches._write_run = threads_run
            if p:
                for k, v in t.items():
                    seconds[k].append(v)
    finally:
        ring.close()
        base.close()
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    gbps = {k: row_bytes / med(v) / 1e9 for k, v in seconds.items()}
    print(", ".join(f"{k} {v:.2f} GB/s" for k, v in gbps.items()))
    for kv, raw in (("kv_thr", "raw_thr"), ("kv_aio", "raw_aio")):
        ratio = med([r / k for r, k in zip(seconds[raw], seconds[kv], strict=True)])
        print(f"{kv} / {raw}: {ratio:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--depth", type=int, default=16, help="AIO requests in flight")
    ap.add_argument("--busy-percent", type=int, default=0, help="another thread's GIL share")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--dir", default=os.getcwd(), help="folder on the filesystem to measure")
    uvloop.run(main(ap.parse_args()))
