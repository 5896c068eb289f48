"""The baselines of the NVMe phases, run with the engine's backend options.

A raw sequential write, rewrite and read of one file (each also with every
request hashed with kvtier's row checksum) and one file per chunk, with the
same backend, request size, thread count and direct-I/O mode as the tier; and
the page-cache eviction that makes their reads, and kvtier's, cold.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from kvtier._slots import HostRegion
from kvtier.bench.config import BenchConfig
from kvtier.io import AioRowIO
from kvtier.io._format import payload_checksum
from kvtier.layout import round_up


def _whole(done: int, want: int, what: str) -> None:
    """Check that a baseline request moved all its bytes (an ``assert`` would vanish under -O)."""
    if done != want:
        raise RuntimeError(f"bench {what}: {done} of {want} bytes")


class _Baselines:
    """Raw sequential file I/O and file-per-chunk I/O with the engine's backend options."""

    def __init__(
        self, cfg: BenchConfig, root: str, total: int, row_nbytes: int, nrows: int
    ) -> None:
        from kvtier.io import select_backend

        self.io = select_backend(
            cfg.io_backend, cfg.direct_io, root, 4 * cfg.io_threads, cfg.io_threads
        )
        self.root = root
        self.total = round_up(total)
        self.row_nbytes = row_nbytes
        self.nrows = nrows
        self.req = cfg.request_nbytes
        self.pool = concurrent.futures.ThreadPoolExecutor(
            cfg.io_threads, thread_name_prefix="bench-io"
        )
        # As large as the data set: every request reads or writes memory of its
        # own, as kvtier's slots do (a few reused buffers would stay cache-hot).
        self.buf = HostRegion(round_up(max(self.total, row_nbytes * nrows)), pin=False)
        self.buf.prefault()
        self.threads = cfg.io_threads
        # As many hashing threads as the tier has checksum workers.
        self.hash_pool = concurrent.futures.ThreadPoolExecutor(
            max(1, min(cfg.io_threads, os.cpu_count() or 1)), thread_name_prefix="bench-hash"
        )

    def _mv(self, offset: int, n: int) -> memoryview:
        return self.buf.buffer(0, self.buf.nbytes)[offset : offset + n]

    def _parallel(self, fn: Callable[[int, int], None], count: int) -> float:
        t0 = time.perf_counter()
        futs = [self.pool.submit(fn, i % self.threads, i) for i in range(count)]
        for f in futs:
            f.result()
        return time.perf_counter() - t0

    def _sequential(self, h: Any, write: bool, checksum: bool = False) -> float:
        """One pass of ``req``-byte requests over the file (I/O threads, or the AIO context).

        ``checksum``: every request's bytes are also hashed with kvtier's row
        checksum (xxh3-64) on ``hash_pool``, before the request is issued
        (write: hashing runs ahead, each request goes out once its hash is
        done) or after it completed (read), the least a writer or reader that
        checks its data must add to the disk's ceiling.
        """
        offsets = range(0, self.total, self.req)
        sizes = [min(self.req, self.total - off) for off in offsets]

        def hash_of(i: int) -> concurrent.futures.Future[int]:
            return self.hash_pool.submit(payload_checksum, self._mv(offsets[i], sizes[i]))

        t0 = time.perf_counter()
        hashes = [hash_of(i) for i in range(len(offsets))] if checksum and write else []
        if isinstance(self.io, AioRowIO):  # the same requests, queued in the kernel
            submit = self.io.submit_pwritev if write else self.io.submit_preadv
            futs = []
            for i, (off, n) in enumerate(zip(offsets, sizes, strict=True)):
                if hashes:
                    hashes[i].result()
                futs.append(submit(h, [self._mv(off, n)], off))
            for i, fut in enumerate(futs):
                _whole(fut.result(), sizes[i], "raw request")
                if checksum and not write:
                    hashes.append(hash_of(i))
        else:
            op = self.io.pwritev if write else self.io.preadv

            def one(worker: int, i: int) -> None:
                if checksum and write:
                    hashes[i].result()
                _whole(op(h, [self._mv(offsets[i], sizes[i])], offsets[i]), sizes[i], "raw request")
                if checksum and not write:  # verified on the hashing threads, as kvtier does
                    hashes.append(hash_of(i))

            self._parallel(one, len(offsets))
        for fut in hashes:
            fut.result()
        return time.perf_counter() - t0

    def raw_write(self, checksum: bool = False) -> float:
        """Seconds to write ``raw.bin`` afresh (``checksum``: see :meth:`_sequential`)."""
        path = os.path.join(self.root, "raw.bin")
        # A fresh file every repeat, like kvtier's fresh tier: overwriting blocks
        # that an earlier repeat already wrote would skip the allocation work.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        t0 = time.perf_counter()  # file creation counts, as it does for kvtier's segments
        h = self.io.open(path, True)
        self.io.allocate(h, self.total)
        self._sequential(h, write=True, checksum=checksum)
        self.io.fdatasync(h)
        dt = time.perf_counter() - t0
        self.io.close(h)
        return dt

    def raw_rewrite(self, checksum: bool = False) -> float:
        """Seconds to write ``raw.bin`` again in place (its blocks are written already).

        ``checksum``: see :meth:`_sequential`.
        """
        h = self.io.open(os.path.join(self.root, "raw.bin"), True)
        t0 = time.perf_counter()
        self._sequential(h, write=True, checksum=checksum)
        self.io.fdatasync(h)
        dt = time.perf_counter() - t0
        self.io.close(h)
        return dt

    def raw_read(self, checksum: bool = False) -> float:
        """Seconds to read ``raw.bin`` from the disk (``checksum``: see :meth:`_sequential`)."""
        path = os.path.join(self.root, "raw.bin")
        _drop_cache(path, self.io.direct)
        h = self.io.open(path, False)
        dt = self._sequential(h, write=False, checksum=checksum)
        self.io.close(h)
        return dt

    def files_write(self) -> float:
        d = os.path.join(self.root, "files")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)

        def one(worker: int, i: int) -> None:
            tmp = os.path.join(d, f"{i}.tmp")
            h = self.io.open(tmp, True)
            n = self.io.pwritev(h, [self._mv(i * self.row_nbytes, self.row_nbytes)], 0)
            _whole(n, self.row_nbytes, "chunk file write")
            self.io.fdatasync(h)
            self.io.close(h)
            os.rename(tmp, os.path.join(d, f"{i}.kv"))

        return self._parallel(one, self.nrows)

    def files_read(self) -> float:
        d = os.path.join(self.root, "files")
        for i in range(self.nrows):
            _drop_cache(os.path.join(d, f"{i}.kv"), self.io.direct)

        def one(worker: int, i: int) -> None:
            h = self.io.open(os.path.join(d, f"{i}.kv"), False)
            n = self.io.preadv(h, [self._mv(i * self.row_nbytes, self.row_nbytes)], 0)
            _whole(n, self.row_nbytes, "chunk file read")
            self.io.close(h)

        return self._parallel(one, self.nrows)

    def close(self) -> None:
        self.pool.shutdown()
        self.hash_pool.shutdown()
        if isinstance(self.io, AioRowIO):
            self.io.shutdown()
        self.buf.close()


def _drop_tree_cache(root: str) -> None:
    """Evict every file under ``root`` from the page cache (buffered I/O only)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            _drop_cache(os.path.join(dirpath, f), False)


def _drop_cache(path: str, direct: bool) -> None:
    """Evict a file from the page cache (no-op for O_DIRECT, which bypasses it)."""
    if direct or not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
