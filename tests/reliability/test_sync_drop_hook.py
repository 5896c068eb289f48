"""Failed-sync drops handed to the writer at once
(``NVMeTier.on_sync_drop``), rows failed when their segment's fdatasync failed during
their batch (``NVMeTier._sync_failures``), and the sequence jump on any invalid row.

Areas: rows wrongly failed or wrongly published (reclaim at the start of a batch, growth
of a new segment during a batch, the AIO backend), the writer's reports across close and
reopen, ``aclose(hard=True)`` and ``BackgroundEngine``, and which opens jump.

Faults only through ``row_io_wrapper`` (a real backend underneath) or real files. A test
headed "Regression" guards against a bug the tier once had (the snapshot of the
failed-sync count is taken per run, when its write is submitted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import pathlib
import threading
from collections.abc import Sequence
from typing import Any

import pytest

import kvtier
from kvtier.errors import NotDurableError, StorageError
from kvtier.io import AioRowIO, NVMeTier, RowIO
from kvtier.io._aio import aio_supported
from kvtier.io._format import TRAILER_NBYTES
from kvtier.io._index import SEQ_JUMP
from kvtier.io._rowio import probe_direct_io

from ..io.conftest import GROUP_NBYTES, Slots, hashes, key, payload, tier_kwargs
from ._model import Gpu, chunks, engine_config, load_check, nvme_config, store_ok
from .gated_io import (
    ROW0,
    LateHolder,
    LateIO,
    SyncGateIO,
    SyncHolder,
    engine_tier,
    failed_durable_store,
    gated_engine,
    nvme_stat,
    payload_matches,
    row_writes,
    until_true,
    until_true_blocking,
)


async def _tier(root: pathlib.Path, **over: Any) -> NVMeTier:
    tier = NVMeTier(**tier_kwargs(root, **over))
    await tier.open()
    return tier


class BlankGateIO(SyncGateIO):
    """SyncGateIO whose next trailer-only write (a blanking, boxed handles) waits on a gate;
    it records whether a row write started after an fdatasync had raised."""

    def __init__(self, inner: RowIO, **kw: Any) -> None:
        super().__init__(inner, **kw)
        self.blank_gate: threading.Event | None = None
        self.blank_entered = threading.Event()
        self.sync_raised = threading.Event()
        self.row_writes_after_raise = 0

    def fdatasync(self, handle: Any) -> None:
        try:
            super().fdatasync(handle)
        except OSError:
            self.sync_raised.set()
            raise

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        gate = None
        if nbytes == TRAILER_NBYTES:
            with self.lock:
                gate, self.blank_gate = self.blank_gate, None
        elif self.sync_raised.is_set():
            with self.lock:
                self.row_writes_after_raise += 1
        if gate is not None:
            self.blank_entered.set()
            gate.wait(20)
        return super().pwritev(handle, bufs, file_offset)


class BlankHolder(SyncHolder):
    io: BlankGateIO | None  # type: ignore[assignment]

    def __call__(self, inner: RowIO) -> RowIO:
        self.io = BlankGateIO(inner, **self.kw)
        return self.io


async def _failing_flush(tier: NVMeTier, io: SyncGateIO) -> tuple[asyncio.Future[None], Any]:
    """A tier flush whose fdatasync waits on a gate and then fails (EIO)."""
    io.sync_gate = gate = threading.Event()
    io.sync_entered.clear()
    io.fdatasync_error = 1
    flush = asyncio.ensure_future(tier.flush())
    await until_true(io.sync_entered.is_set, "the sync to start")
    return flush, gate


# ====================================================================== rows wrongly failed


# Regression: write_batch snapshots the segment's failed-sync count when the row's write
# starts, not before its first reclaim. A batch held in that reclaim (blanking a stale row)
# while another caller's fdatasync fails reserves its row and writes it only afterwards, so
# the row is not failed: the next good sync makes it durable (README: only "a row whose
# write overlapped" the failed sync is failed).
async def test_row_reserved_and_written_after_the_failed_sync_returned_is_published(
    tmp_path: pathlib.Path,
) -> None:
    holder = BlankHolder(box_handles=True)  # blanking goes through pwritev (a trailer write)
    tier = await _tier(tmp_path / "nvme", row_io_wrapper=holder, grow_ahead=False)
    try:
        io = holder.io
        assert isinstance(io, BlankGateIO)
        buf = Slots(2, 8 * 4096)
        assert await tier.write_rows(row_writes(buf, [0, 1])) == [None, None]
        tier.discard(key(1))  # its row is blanked by the next batch's reclaim
        flush, gate = await _failing_flush(tier, io)
        io.blank_gate = blank = threading.Event()
        write = asyncio.ensure_future(tier.write_rows(row_writes(buf, [2])))
        await until_true(io.blank_entered.is_set, "key 2's batch to blank key 1's row")
        gate.set()  # the sync fails before key 2's batch has even reserved a row
        with pytest.raises(StorageError):
            await flush
        assert io.sync_raised.is_set()
        assert not tier.contains(key(0))  # dropped by the failed sync
        io.sync_gate = None
        blank.set()
        (result,) = await write
        assert io.row_writes_after_raise == 1  # key 2's row: written after the sync raised
        assert result is None, result
        await tier.flush()  # a good sync covers key 2's row
        assert tier.contains(key(2))
    finally:
        await tier.close()


async def test_row_grown_into_a_new_segment_during_another_segments_failed_sync_is_published(
    tmp_path: pathlib.Path,
) -> None:
    holder = SyncHolder()
    root = tmp_path / "nvme"
    tier = await _tier(
        root, row_io_wrapper=holder, grow_ahead=False, segment_nbytes=4096 + 2 * ROW0
    )
    try:
        io = holder.io
        assert isinstance(io, SyncGateIO)
        buf = Slots(2, 8 * 4096)
        assert await tier.write_rows(row_writes(buf, [0, 1])) == [None, None]  # g0/0 is full
        flush, gate = await _failing_flush(tier, io)
        io.allocate_gate = grow = threading.Event()
        write = asyncio.ensure_future(tier.write_rows(row_writes(buf, [2])))
        await until_true(io.allocate_entered.is_set, "key 2's batch to grow g0/1")
        gate.set()  # g0/0's sync fails while key 2's batch waits for its new segment
        with pytest.raises(StorageError):
            await flush
        io.sync_gate = None
        io.allocate_gate = None
        grow.set()
        assert await write == [None]  # its row is in g0/1, which no failed sync covered
        ref = tier._index.lookup(key(2))
        assert ref is not None
        assert ref.ref.segment == 1
        assert hashes(tier) == [b"hash-2"]
        await tier.flush()
    finally:
        await tier.close()
    tier = await _tier(root, segment_nbytes=4096 + 2 * ROW0)
    try:
        assert hashes(tier) == [b"hash-2"]
        out = Slots(1, 8 * 4096)
        assert await tier.read_rows([(key(2), out[0])]) == [(0, 4)]
        assert payload_matches(out[0], key(2))
    finally:
        await tier.close()


class KeyLateIO(SyncGateIO):
    """SyncGateIO whose row write of the key whose payload starts with ``late_prefix`` waits on
    ``late_gate`` after its bytes were written."""

    def __init__(self, inner: RowIO, **kw: Any) -> None:
        super().__init__(inner, **kw)
        self.late_prefix = b""
        self.late_gate = threading.Event()
        self.late_entered = threading.Event()
        self.arm_prefix = b""  # its row write arms the sync gate and one fdatasync EIO
        self.arm_gate = threading.Event()

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        n = super().pwritev(handle, bufs, file_offset)
        first = memoryview(bufs[0]).cast("B")
        if self.arm_prefix and bytes(first[: len(self.arm_prefix)]) == self.arm_prefix:
            with self.lock:
                self.sync_gate, self.fdatasync_error = self.arm_gate, 1
        if self.late_prefix and bytes(first[: len(self.late_prefix)]) == self.late_prefix:
            self.late_entered.set()
            self.late_gate.wait(20)
        return n


class KeyLateHolder(SyncHolder):
    io: KeyLateIO | None  # type: ignore[assignment]

    def __call__(self, inner: RowIO) -> RowIO:
        self.io = KeyLateIO(inner, **self.kw)
        return self.io


async def test_row_of_a_segment_grown_during_its_batch_whose_sync_then_fails_is_not_published(
    tmp_path: pathlib.Path,
) -> None:
    """Keys 4 and 3 (two batches) wait for g0/1 to grow; key 4 lands first, a flush syncs
    g0/1 and fails while key 3's row is written there: key 3's batch began before g0/1
    existed (no count in its snapshot), and is failed all the same."""
    holder = KeyLateHolder()
    tier = await _tier(
        tmp_path / "nvme", row_io_wrapper=holder, grow_ahead=False, segment_nbytes=4096 + 2 * ROW0
    )
    try:
        io = holder.io
        assert isinstance(io, KeyLateIO)
        bufs = [Slots(1, 8 * 4096) for _ in range(3)]
        assert await tier.write_rows(row_writes(bufs[0], [0])) == [None]
        assert await tier.write_rows(row_writes(bufs[1], [1])) == [None]  # g0/0 is full
        await tier.flush()
        io.allocate_gate = grow = threading.Event()
        a = asyncio.ensure_future(tier.write_rows(row_writes(bufs[0], [4])))
        await until_true(io.allocate_entered.is_set, "g0/1 to grow")
        gate = io.arm_gate  # armed by key 4's row write (after g0/1's creation synced)
        io.arm_prefix = payload(key(4), GROUP_NBYTES[0])[:64]
        io.sync_entered.clear()
        flush = asyncio.ensure_future(tier.flush())  # waits for key 4's batch, then syncs
        io.late_prefix = payload(key(3), GROUP_NBYTES[0])[:64]
        b = asyncio.ensure_future(tier.write_rows(row_writes(bufs[2], [3])))
        await asyncio.sleep(0.01)
        io.allocate_gate = None
        grow.set()
        assert await a == [None]
        await until_true(io.sync_entered.is_set, "g0/1's sync to start")
        await until_true(io.late_entered.is_set, "key 3's bytes to be written")
        gate.set()
        with pytest.raises(StorageError):
            await flush
        io.sync_gate = None
        io.late_gate.set()
        (result,) = await b
        assert not tier.contains(key(4))  # dropped: published in g0/1 since its last sync
        assert isinstance(result, StorageError), result
        assert result.kind == "eio", result
        assert not tier.contains(key(3))
        await tier.flush()
        assert not tier.contains(key(3))
        assert hashes(tier) == [b"hash-0", b"hash-1"]
    finally:
        await tier.close()


async def _row_written_during_a_failing_sync(
    tier: NVMeTier, io: LateIO, buf: Slots
) -> BaseException | None:
    """Key 0 published; key 1's bytes written while the sync fails, published after it."""
    assert await tier.write_rows(row_writes(buf, [0])) == [None]
    flush, gate = await _failing_flush(tier, io)
    io.after_write_gate = late = threading.Event()
    write = asyncio.ensure_future(tier.write_rows(row_writes(buf, [1])))
    await until_true(io.after_write_entered.is_set, "key 1's bytes to be written")
    gate.set()
    with pytest.raises(StorageError):
        await flush
    io.sync_gate = None
    late.set()
    (result,) = await write
    return result


# Regression (minor): the error of a row failed because its segment's fdatasync failed during
# the batch carries the errno and a __cause__, not only StorageError(kind, message), as the
# keys the same failure dropped carry errno EIO (as_storage_error of the OSError).
async def test_row_failed_by_a_failed_sync_during_its_write_carries_the_syncs_errno(
    tmp_path: pathlib.Path,
) -> None:
    holder = LateHolder()
    tier = await _tier(tmp_path / "nvme", row_io_wrapper=holder, grow_ahead=False)
    try:
        io = holder.io
        assert isinstance(io, LateIO)
        result = await _row_written_during_a_failing_sync(tier, io, Slots(2, 8 * 4096))
        assert isinstance(result, StorageError), result
        assert result.kind == "eio", result
        assert result.errno == errno.EIO, result
    finally:
        await tier.close()


# ====================================================================== AIO backend


class AioSyncGate:
    """A submitting wrapper of a real AioRowIO: its fdatasync can wait on a gate and fail once
    (EIO); its next row write can be held, after the kernel wrote it, until a gate opens."""

    def __init__(self, inner: AioRowIO) -> None:
        self.inner = inner
        self.name, self.direct = inner.name, inner.direct
        self.sync_gate: threading.Event | None = None
        self.sync_entered = threading.Event()
        self.fdatasync_error = 0
        self.after_write_gate: threading.Event | None = None
        self.after_write_entered = threading.Event()
        self.lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def fdatasync(self, handle: Any) -> None:
        gate = self.sync_gate
        if gate is not None:
            self.sync_entered.set()
            gate.wait(20)
        with self.lock:
            if self.fdatasync_error:
                self.fdatasync_error -= 1
                raise OSError(errno.EIO, "injected EIO on fdatasync (aio)")
        self.inner.fdatasync(handle)

    def submit_preadv(
        self, handle: Any, bufs: Sequence[memoryview], off: int
    ) -> concurrent.futures.Future[int]:
        return self.inner.submit_preadv(handle, bufs, off)

    def submit_pwritev(
        self, handle: Any, bufs: Sequence[memoryview], off: int
    ) -> concurrent.futures.Future[int]:
        inner = self.inner.submit_pwritev(handle, bufs, off)
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        gate = None
        if nbytes > TRAILER_NBYTES:
            with self.lock:
                gate, self.after_write_gate = self.after_write_gate, None
        if gate is None:
            return inner
        out: concurrent.futures.Future[int] = concurrent.futures.Future()

        def run() -> None:
            try:
                res = inner.result(10)
            except BaseException as exc:
                out.set_exception(exc)
                return
            self.after_write_entered.set()
            gate.wait(20)
            out.set_result(res)

        t = threading.Thread(target=run, daemon=True)
        self._threads.append(t)
        t.start()
        return out


async def test_aio_row_written_during_a_failing_sync_is_failed_and_never_vouched_for(
    tmp_path: pathlib.Path,
) -> None:
    if not aio_supported() or not probe_direct_io(tmp_path):
        pytest.skip("no Linux AIO or O_DIRECT here")
    made: list[AioSyncGate] = []

    def wrap(inner: RowIO) -> RowIO:
        assert isinstance(inner, AioRowIO)
        made.append(AioSyncGate(inner))
        return made[-1]  # type: ignore[return-value]

    tier = await _tier(
        tmp_path / "nvme", io_backend="aio", direct_io="on", row_io_wrapper=wrap, grow_ahead=False
    )
    try:
        assert tier._aio is made[0]  # the submitting path
        io = made[0]
        buf = Slots(2, 8 * 4096)
        assert await tier.write_rows(row_writes(buf, [0])) == [None]
        io.sync_gate = gate = threading.Event()
        io.fdatasync_error = 1
        flush = asyncio.ensure_future(tier.flush())
        await until_true(io.sync_entered.is_set, "the sync to start")
        io.after_write_gate = late = threading.Event()
        write = asyncio.ensure_future(tier.write_rows(row_writes(buf, [1])))
        await until_true(io.after_write_entered.is_set, "key 1's bytes to be written")
        gate.set()
        with pytest.raises(StorageError):
            await flush
        io.sync_gate = None
        late.set()
        (result,) = await write
        assert isinstance(result, StorageError), result
        assert result.kind == "eio", result
        assert hashes(tier) == []
        await tier.flush()
        assert hashes(tier) == []
        assert tier.stats()["failures_eio"] == 2  # key 0 dropped, key 1 failed
        assert await tier.write_rows(row_writes(buf, [1])) == [None]  # a later write succeeds
        await tier.flush()
    finally:
        await tier.close()
    tier = await _tier(tmp_path / "nvme", io_backend="aio", direct_io="on")
    try:
        assert hashes(tier) == [b"hash-1"]
        out = Slots(1, 8 * 4096)
        assert await tier.read_rows([(key(1), out[0])]) == [(0, 4)]
        assert payload_matches(out[0], key(1))
    finally:
        await tier.close()


# ====================================================================== engine: reports


async def test_closed_engine_detaches_the_drop_hook_and_a_reopened_one_reports_nothing_stale(
    tmp_path: pathlib.Path,
) -> None:
    holder = SyncHolder()
    opened = gated_engine(tmp_path, holder, ["p0", "p1"])
    async with opened as (gpu, engine, tier, io, [k0, k1]):
        await store_ok(engine, gpu, [k1])
        await engine.flush()  # k1 durable
        await failed_durable_store(engine, gpu, io, k0)  # drops k0
        writer = engine._writer
        assert writer is not None
        assert set(writer._failed) == {k0.key}
        assert tier.on_sync_drop is not None
    assert tier.on_sync_drop is None  # detach() broke the tier -> writer reference
    async with kvtier.TransferEngine(
        gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))
    ) as e2:
        w2 = e2._writer
        assert w2 is not None
        assert w2._failed == {}
        assert engine_tier(e2).on_sync_drop == w2._sync_dropped
        assert e2.lookup([k0.key, k1.key]) == [kvtier.Residency.MISS, kvtier.Residency.NVME]
        await e2.flush()  # nothing stale from the first engine
        res = await load_check(e2, gpu, [k1])
        assert res.loaded == (k1.key,)


async def test_hard_close_during_a_failing_sync_with_a_row_written_during_it_restarts_clean(
    tmp_path: pathlib.Path,
) -> None:
    gpu = Gpu()
    holder = LateHolder()
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=holder))
    k0, k1, k2 = chunks(["q0", "q1", "q2"], group_id=0)
    engine = kvtier.TransferEngine(gpu.layout, cfg)
    await engine.start()
    try:
        tier = engine_tier(engine)
        io = holder.io
        assert isinstance(io, LateIO)
        await store_ok(engine, gpu, [k2])
        await engine.flush()  # k2 durable
        await store_ok(engine, gpu, [k0])
        await until_true(lambda: tier.contains(k0.key), "k0 on NVMe")
        io.sync_gate = gate = threading.Event()
        io.fdatasync_error = 1
        first = asyncio.ensure_future(engine.flush())
        await until_true(io.sync_entered.is_set, "the sync to start")
        io.after_write_gate = late = threading.Event()
        await store_ok(engine, gpu, [k1])
        await until_true(io.after_write_entered.is_set, "k1's bytes to be written")
        close = asyncio.ensure_future(engine.aclose(hard=True))
        await asyncio.sleep(0.01)
        gate.set()
        with pytest.raises(StorageError):
            await first
        io.sync_gate = None
        late.set()
        await asyncio.wait_for(close, 20)  # the final sync succeeds
    finally:
        gate.set()
        late.set()
        await engine.aclose()
    async with kvtier.TransferEngine(
        gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))
    ) as e2:
        # k0 was dropped and k1 failed (its row overlapped the failed sync): both blanked
        assert e2.lookup([k0.key, k1.key, k2.key]) == [
            kvtier.Residency.MISS,
            kvtier.Residency.MISS,
            kvtier.Residency.NVME,
        ]
        res = await load_check(e2, gpu, [k0, k1, k2])
        assert res.loaded == (k2.key,)


def test_background_flush_after_another_flushs_failed_sync_names_the_drop_once(
    tmp_path: pathlib.Path,
) -> None:
    gpu = Gpu()
    holder = SyncHolder()
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=holder))
    (k1,) = chunks(["r1"], group_id=0)
    bg = kvtier.BackgroundEngine(gpu.layout, cfg)
    bg.start()
    try:
        io = holder.io
        assert isinstance(io, SyncGateIO)
        gpu.write(k1)
        assert bg.store([k1]).result(10).stored == (k1.key,)
        until_true_blocking(lambda: nvme_stat(bg, "rows_written") == 1, "k1's row")
        io.fdatasync_error = 1
        with pytest.raises(StorageError) as first:
            bg.flush().result(10)
        assert not isinstance(first.value, NotDurableError)
        with pytest.raises(NotDurableError) as second:
            bg.flush().result(10)
        assert set(second.value.failed) == {k1.key}
        bg.flush().result(10)  # reported once
        assert bg.lookup([k1.key]) == [kvtier.Residency.CPU]
        res = bg.store([k1], durable=True).result(10)
        assert res.skipped == (k1.key,)
        assert bg.lookup([k1.key]) == [kvtier.Residency.CPU]
        assert nvme_stat(bg, "rows_written") == 2
        bg.flush().result(10)
    finally:
        bg.close()


# ====================================================================== blind opens


async def test_blanked_rows_at_open_do_not_make_it_blind_a_corrupt_trailer_does(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "nvme"
    tier = await _tier(root)
    buf = Slots(3, 8 * 4096)
    assert await tier.write_rows(row_writes(buf, [0, 1, 2])) == [None, None, None]
    tier.discard(key(1))  # blanked by close
    seq = tier._index._seq
    await tier.close()
    tier = await _tier(root)
    try:
        assert tier.stats()["invalid_rows_at_open"] == 0
        assert tier._index._seq == seq  # a blank row is free space, not an invalid one
        assert hashes(tier) == [b"hash-0", b"hash-2"]
        seg = tier.directory / "g0" / "0.kvrows"
    finally:
        await tier.close()
    # a real corrupt trailer on disk (key 2's row, row 2): every open now jumps
    with open(seg, "r+b") as f:
        f.seek(4096 + 2 * ROW0 + ROW0 - TRAILER_NBYTES + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    tier = await _tier(root)
    try:
        assert tier.stats()["invalid_rows_at_open"] == 1
        entry = tier._index.lookup(key(0))
        assert entry is not None
        assert tier._index._seq == entry.seq + SEQ_JUMP  # above the highest seq read
        assert hashes(tier) == [b"hash-0"]
        assert await tier.write_rows(row_writes(buf, [3])) == [None]
        await tier.flush()
    finally:
        await tier.close()
    tier = await _tier(root)
    try:
        out = Slots(1, 8 * 4096)
        assert await tier.read_rows([(key(3), out[0])]) == [(0, 4)]
        assert payload_matches(out[0], key(3))
        assert await tier.read_rows([(key(0), out[0])]) == [(0, 4)]
        assert payload_matches(out[0], key(0))
    finally:
        await tier.close()
