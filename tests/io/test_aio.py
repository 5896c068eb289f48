"""The ``aio`` backend: Linux AIO submission of row requests (real files, real kernel)."""

from __future__ import annotations

import errno
import mmap
import os
import pathlib
import threading
from concurrent.futures import Future

import pytest

from kvtier.errors import AlignmentError, ConfigError, StorageError
from kvtier.io import AioRowIO, NVMeTier, select_backend
from kvtier.io._aio import AioContext, aio_supported
from kvtier.io._rowio import probe_direct_io

from .conftest import GROUP_NBYTES, hashes, key, payload, tier_kwargs
from .faults import DelegatingRowIO


@pytest.fixture
def aio_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    if not aio_supported():
        pytest.skip("no Linux AIO context here")
    if not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT here")
    return tmp_path


def _buf(nbytes: int, fill: int = 0) -> memoryview:
    mm = mmap.mmap(-1, nbytes)
    mm.write(bytes((fill + i) & 0xFF for i in range(256)) * (nbytes // 256))
    return memoryview(mm)


def _aio_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvtier-aio"]


def test_submit_round_trip_many_more_requests_than_depth(aio_dir: pathlib.Path) -> None:
    io = AioRowIO(depth=2)
    h = io.open(aio_dir / "f", create=True)
    try:
        io.allocate(h, 64 * 4096)
        out = [_buf(2 * 4096, fill=i) for i in range(20)]  # two iovecs each
        writes = [
            io.submit_pwritev(h, [b[:4096], b[4096:]], i * 2 * 4096) for i, b in enumerate(out)
        ]
        assert [f.result(timeout=10) for f in writes] == [2 * 4096] * 20
        back = [_buf(2 * 4096) for _ in range(20)]
        reads = [io.submit_preadv(h, [b], i * 2 * 4096) for i, b in enumerate(back)]
        assert [f.result(timeout=10) for f in reads] == [2 * 4096] * 20
        assert all(bytes(a) == bytes(b) for a, b in zip(out, back, strict=True))
        # What the kernel wrote is in the file (read back without AIO).
        assert os.pread(os.open(aio_dir / "f", os.O_RDONLY), 4096, 5 * 2 * 4096) == bytes(
            out[5][:4096]
        )
    finally:
        io.close(h)
        io.shutdown()


def test_short_read_past_the_end_is_a_count_not_an_error(aio_dir: pathlib.Path) -> None:
    io = AioRowIO(depth=4)
    h = io.open(aio_dir / "f", create=True)
    try:
        assert io.pwritev(h, [_buf(2 * 4096, fill=7)], 0) == 2 * 4096
        assert io.submit_preadv(h, [_buf(4 * 4096)], 0).result(timeout=10) == 2 * 4096
        assert io.submit_preadv(h, [_buf(4096)], 8 * 4096).result(timeout=10) == 0
    finally:
        io.close(h)
        io.shutdown()


def test_a_failed_request_is_an_oserror_with_its_errno(aio_dir: pathlib.Path) -> None:
    io = AioRowIO(depth=4)
    try:
        h = io.open(aio_dir / "f", create=True)
        io.close(h)  # a closed descriptor: io_submit refuses the request
        fut = io.submit_pwritev(h, [_buf(4096)], 0)
        with pytest.raises(OSError) as info:
            fut.result(timeout=10)
        assert info.value.errno == errno.EBADF
    finally:
        io.shutdown()


def test_misaligned_requests_raise_before_anything_is_queued(aio_dir: pathlib.Path) -> None:
    io = AioRowIO(depth=4)
    h = io.open(aio_dir / "f", create=True)
    try:
        for submit in (io.submit_pwritev, io.submit_preadv):
            with pytest.raises(AlignmentError, match="offset"):
                submit(h, [_buf(4096)], 512)
            with pytest.raises(AlignmentError, match="length"):
                submit(h, [_buf(2 * 4096)[: 4096 + 512]], 0)
    finally:
        io.close(h)
        io.shutdown()


def test_shutdown_waits_then_refuses_and_stops_its_thread(aio_dir: pathlib.Path) -> None:
    before = set(_aio_threads())
    ctx = AioContext(2)
    fd = os.open(aio_dir / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, 16 * 4096)
        bufs = [_buf(4096, fill=i) for i in range(8)]
        futs = [ctx.submit(True, fd, [b], i * 4096) for i, b in enumerate(bufs)]
        ctx.close()  # waits for all eight, queued ones included
        assert all(f.done() and f.result() == 4096 for f in futs)
        with pytest.raises(RuntimeError, match="closed"):
            ctx.submit(True, fd, [bufs[0]], 0)
        ctx.close()  # idempotent
    finally:
        os.close(fd)
    assert set(_aio_threads()) == before


def test_select_backend_aio_needs_o_direct(aio_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="O_DIRECT"):
        select_backend("aio", "off", aio_dir)
    io = select_backend("aio", "on", aio_dir, aio_depth=3)
    try:
        assert isinstance(io, AioRowIO)
        assert (io.name, io.direct) == ("aio", True)
    finally:
        io.shutdown()


async def test_tier_on_aio_writes_reads_and_restarts_bitwise(aio_dir, slots) -> None:
    before = set(_aio_threads())
    kw = tier_kwargs(aio_dir / "nvme", io_backend="aio", direct_io="on")
    keys = [key(i, i % 3) for i in range(9)]
    buf = slots(9)
    tier = NVMeTier(**kw)
    await tier.open()
    try:
        assert tier.stats()["backend"] == "aio"
        assert isinstance(tier._aio, AioRowIO)  # row requests are queued, not threaded
        rows = [
            (k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id]))) for i, k in enumerate(keys)
        ]
        assert await tier.write_rows(rows) == [None] * 9
        await tier.flush()
    finally:
        await tier.close()
    assert set(_aio_threads()) == before
    tier = NVMeTier(**kw)
    await tier.open()
    try:
        assert hashes(tier) == sorted(k.block_hash for k in keys)
        out = slots(9)
        got = await tier.read_rows([(k, out[i]) for i, k in enumerate(keys)])
        assert got == [(0, 4)] * 9
        for i, k in enumerate(keys):
            n = GROUP_NBYTES[k.group_id]
            assert bytes(out[i][:n]) == payload(k, n)
    finally:
        await tier.close()


async def test_tier_on_aio_turns_a_corrupt_row_into_a_counted_miss(aio_dir, slots) -> None:
    kw = tier_kwargs(aio_dir / "nvme", io_backend="aio", direct_io="on")
    tier = NVMeTier(**kw)
    await tier.open()
    k0, k1 = key(0), key(1)
    buf = slots(2)
    try:
        rows = [(k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[0]))) for i, k in enumerate((k0, k1))]
        assert await tier.write_rows(rows) == [None, None]
    finally:
        await tier.close()
    seg = next((tier.directory / "g0").glob("*.kvrows"))
    data = bytearray(seg.read_bytes())
    first = data.index(payload(k0, 64))  # the first row's payload
    data[first + 10] ^= 0xFF
    seg.write_bytes(bytes(data))
    tier = NVMeTier(**kw)
    await tier.open()
    try:
        out = slots(2)
        got = await tier.read_rows([(k0, out[0]), (k1, out[1])])
        assert isinstance(got[0], StorageError)
        assert got[0].kind == "checksum"
        assert got[1] == (0, 4)
        assert bytes(out[1][: GROUP_NBYTES[0]]) == payload(k1, GROUP_NBYTES[0])
        assert tier.keys() == [k1]
        assert tier.stats()["checksum_failures"] == 1
    finally:
        await tier.close()


class _FaultyAio(DelegatingRowIO):
    """Delegates to a real :class:`AioRowIO`; fails or shortens queued requests on demand."""

    inner: AioRowIO

    def __init__(self, inner: AioRowIO) -> None:
        super().__init__(inner)
        self.fail_writes = self.fail_reads = False
        self.short_write = self.short_read = 0  # bytes kept, 0: off
        self.submitted = 0

    def _shorten(self, bufs: list[memoryview], keep: int) -> list[memoryview]:
        out, left = [], keep
        for b in bufs:
            if left <= 0:
                break
            out.append(b[: min(left, b.nbytes)])
            left -= out[-1].nbytes
        return out

    def submit_pwritev(self, handle: int, bufs: list[memoryview], file_offset: int) -> Future[int]:
        self.submitted += 1
        if self.fail_writes:
            return _failed(errno.EIO)
        if self.short_write:
            bufs = self._shorten(bufs, self.short_write)
        return self.inner.submit_pwritev(handle, bufs, file_offset)

    def submit_preadv(self, handle: int, bufs: list[memoryview], file_offset: int) -> Future[int]:
        self.submitted += 1
        if self.fail_reads:
            return _failed(errno.EIO)
        if self.short_read:
            bufs = self._shorten(bufs, self.short_read)
        return self.inner.submit_preadv(handle, bufs, file_offset)


def _failed(code: int) -> Future[int]:
    fut: Future[int] = Future()
    fut.set_exception(OSError(code, os.strerror(code)))
    return fut


async def test_aio_request_faults_fail_only_the_rows_they_touch(aio_dir, slots) -> None:
    wrappers: list[_FaultyAio] = []

    def wrap(inner: AioRowIO) -> _FaultyAio:
        wrappers.append(_FaultyAio(inner))
        return wrappers[-1]

    tier = NVMeTier(
        **tier_kwargs(aio_dir / "nvme", io_backend="aio", direct_io="on", row_io_wrapper=wrap)
    )
    await tier.open()
    io = wrappers[0]
    try:
        row = tier.row_nbytes(0)
        buf, out = slots(6), slots(6)
        rows = [(key(i), 0, 4, buf.fill(i, payload(key(i), GROUP_NBYTES[0]))) for i in range(6)]
        # Three rows in one run: only the first 1.5 rows reach the disk.
        io.short_write = row + row // 2 // 4096 * 4096
        results = await tier.write_rows(rows[:3])
        assert results[0] is None
        assert [getattr(r, "kind", None) for r in results[1:]] == ["short_write"] * 2
        io.short_write = 0
        io.fail_writes = True
        results = await tier.write_rows(rows[3:4])
        assert [getattr(r, "kind", None) for r in results] == ["eio"]
        io.fail_writes = False
        assert await tier.write_rows(rows[4:]) == [None, None]
        assert hashes(tier) == sorted(k.block_hash for k in (key(0), key(4), key(5)))
        assert io.submitted >= 3  # the queued path, not the worker threads
        # Reads: a short read of a run is retried row by row, and here the
        # retry reads the rest; a row whose own read is short fails, and so
        # does a row whose read fails with EIO.
        io.short_read = row
        got = await tier.read_rows([(key(4), out[4]), (key(5), out[5])])
        assert got == [(0, 4), (0, 4)]
        assert bytes(out[5][: GROUP_NBYTES[0]]) == payload(key(5), GROUP_NBYTES[0])
        io.short_read = 4096
        got = await tier.read_rows([(key(5), out[5])])
        assert getattr(got[0], "kind", None) == "short_read"
        io.short_read = 0
        io.fail_reads = True
        got = await tier.read_rows([(key(0), out[0])])
        assert getattr(got[0], "kind", None) == "eio"
        io.fail_reads = False
        assert tier.keys() == [key(4)]  # failed reads drop their keys: MISS from now on
        got = await tier.read_rows([(key(4), out[4])])
        assert got == [(0, 4)]
        assert bytes(out[4][: GROUP_NBYTES[0]]) == payload(key(4), GROUP_NBYTES[0])
        st = tier.stats()
        assert (st["failures_short_write"], st["failures_eio"], st["failures_short_read"]) == (
            2,
            2,
            1,
        )
    finally:
        await tier.close()


def test_requests_queued_behind_failing_submissions_still_end(aio_dir: pathlib.Path) -> None:
    # depth 1: a good write is in the kernel, five requests on a closed
    # descriptor wait behind it. When it ends, the queued ones must be submitted
    # (and fail) one after the other, not wait for a completion that never
    # comes; close() must then return.
    ctx = AioContext(1)
    good = os.open(aio_dir / "good", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    bad = os.open(aio_dir / "bad", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.close(bad)
    try:
        big, small = _buf(64 << 20), [_buf(4096) for _ in range(5)]
        first = ctx.submit(True, good, [big], 0)  # tens of ms in the kernel
        futs = [ctx.submit(True, bad, [b], i * 4096) for i, b in enumerate(small)]
        assert first.result(timeout=5) == 64 << 20
        for f in futs:
            with pytest.raises(OSError) as info:
                f.result(timeout=5)
            assert info.value.errno == errno.EBADF
        done = threading.Event()
        closer = threading.Thread(target=lambda: (ctx.close(), done.set()))
        closer.start()
        assert done.wait(timeout=5), "close() hung on requests that had already failed"
        closer.join()
    finally:
        os.close(good)
