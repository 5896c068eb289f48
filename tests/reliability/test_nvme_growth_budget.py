"""Growth by held rows and the batch-end reclaim.

Growth by held rows: ``RowIndex.plan_growth`` and ``wants_growth`` measure room as
``disk_budget_nbytes - held_nbytes`` (punched rows leave room), not
``disk_budget_nbytes - allocated_nbytes``. The batch-end reclaim: ``write_batch`` ends with
``await reclaim(tier)`` when stale rows exist, so a row evicted for a write
that failed is blanked before the batch returns.

Faults only through ``row_io_wrapper``: :class:`_PunchRig` hands the tier
handle objects whose ``fd`` attribute is what ``fallocate(PUNCH_HOLE)`` and
``FIEMAP`` use; read from a ``kvtier-meta`` worker (a punch) it can raise EIO
(a failed ``fallocate``), wait (a slow one) or be missing (a backend that
cannot punch). Row writes whose trailer names a key can fail with EIO.

Disk blocks are ``st_blocks`` of the segment files minus one 4 KiB header per
file, allowing one 4 KiB ext4 extent-index block per file.

A test marked ``xfail(strict=True, reason="BUG: ...")`` proves a bug; a "Regression" test
guards against a bug the tier once had.
"""

from __future__ import annotations

import asyncio
import errno
import pathlib
import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from kvtier import OffloadKey
from kvtier.io import NVMeTier, RowIO

from ..io.conftest import GROUP_NBYTES, Slots, key, payload, tier_kwargs
from ..io.faults import DelegatingRowIO
from ._faultio import rig_factory, until_set

TRAILER = 4096
HEADER = 4096  # one per segment file
EXTENT_BLOCK = 4096  # ext4 extent-index block, one per file allowed
ROW = {g: -(-n // 4096) * 4096 + TRAILER for g, n in GROUP_NBYTES.items()}  # 20480, 8192, 16384


# ====================================================================== helpers


class _Handle:
    """A segment handle: the backend's, plus an ``fd`` the rig controls."""

    __slots__ = ("_rig", "inner")

    def __init__(self, inner: Any, rig: _PunchRig) -> None:
        self.inner = inner
        self._rig = rig

    @property
    def fd(self) -> int:
        return self._rig.fd_of(self.inner)


class _PunchRig(DelegatingRowIO):
    """Real I/O; controls hole punching (``mode``) and fails chosen row writes.

    ``mode`` for a punch (``fd`` read on a ``kvtier-meta`` worker): ``ok``;
    ``fail`` (EIO, as a failed ``fallocate(PUNCH_HOLE)``); ``hold`` (the next
    punch waits for ``release``, then proceeds; later ones run); ``nofd`` (the
    backend cannot punch: ``_punch_hole`` reports it unsupported).
    """

    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner)
        self.mode = "ok"
        self.held = threading.Event()
        self.release = threading.Event()
        self.punches = 0  # punch attempts
        self.blanks = 0  # 4 KiB writes past a header: trailers zeroed
        self.fail_rows: set[bytes] = set()  # tags: EIO on a row write naming that key
        self.fail_blanks = False  # EIO on trailer blanks
        self._lock = threading.Lock()

    def fd_of(self, inner: Any) -> int:
        if threading.current_thread().name.startswith("kvtier-meta"):
            with self._lock:
                self.punches += 1
                mode = self.mode
                if mode == "hold":
                    self.mode = "ok"
            if mode == "fail":
                raise OSError(errno.EIO, "injected EIO on fallocate(PUNCH_HOLE)")
            if mode == "nofd":
                raise AttributeError("fd")
            if mode == "hold":
                self.held.set()
                assert self.release.wait(30)
        return inner

    def open(self, path: Any, create: bool) -> Any:
        return _Handle(self.inner.open(path, create), self)

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        return self.inner.preadv(handle.inner, bufs, file_offset)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        if nbytes == TRAILER and file_offset > 0:
            with self._lock:
                self.blanks += 1
            if self.fail_blanks:
                raise OSError(errno.EIO, "injected EIO on a trailer blank")
        if self.fail_rows and nbytes > TRAILER:
            for b in bufs:
                mv = memoryview(b)
                tail = bytes(mv[mv.nbytes - TRAILER : mv.nbytes - TRAILER + 160])
                if any(tag in tail for tag in self.fail_rows):
                    raise OSError(errno.EIO, "injected EIO on a row write")
        return self.inner.pwritev(handle.inner, bufs, file_offset)

    def fdatasync(self, handle: Any) -> None:
        self.inner.fdatasync(handle.inner)

    def allocate(self, handle: Any, nbytes: int) -> None:
        self.inner.allocate(handle.inner, nbytes)

    def close(self, handle: Any) -> None:
        self.inner.close(handle.inner)


def _rigged(holder: list[_PunchRig]) -> Any:
    return rig_factory(_PunchRig, holder)


def _disk(directory: pathlib.Path, group_id: int | None = None) -> tuple[int, int]:
    """(bytes of disk blocks of the segment files minus one header each, number of files)."""
    files = [
        p
        for p in directory.rglob("*.kvrows")
        if group_id is None or p.parent.name == f"g{group_id}"
    ]
    return sum(p.stat().st_blocks * 512 - HEADER for p in files), len(files)


async def _until(event: threading.Event) -> None:
    await until_set(event, "the held punch never started")


def _rows(buf: Slots, keys: Sequence[OffloadKey], first: int = 0) -> list[Any]:
    return [
        (k, 0, 4, buf.fill(first + i, payload(k, GROUP_NBYTES[k.group_id])))
        for i, k in enumerate(keys)
    ]


async def _write_all(tier: NVMeTier, buf: Slots, keys: Sequence[OffloadKey], per: int = 8) -> None:
    for b in range(0, len(keys), per):
        part = keys[b : b + per]
        assert await tier.write_rows(_rows(buf, part)) == [None] * len(part)
    await tier.flush()


# ========================================================== growth by held rows: what holds


@pytest.mark.parametrize("grow_ahead", [True, False])
async def test_shifting_mixed_workloads_keep_blocks_within_the_budget_between_batches(
    tmp_path, slots, grow_ahead
) -> None:
    """Concurrent calls, three row sizes, the workload moving between groups 16 times.

    Between batches (all tasks done) the rows holding blocks stay within the
    budget plus one row (a growth takes at least one row), the index never
    counts fewer blocks than the files hold, and after close the files are
    within the budget.
    """
    rng = random.Random(11)
    tier = NVMeTier(**tier_kwargs(tmp_path, capacity_bytes=48 * ROW[0], grow_ahead=grow_ahead))
    await tier.open()
    index = tier._index
    budget = index.disk_budget_nbytes
    buf = slots(32)
    n = 0
    punched_seen = 0
    for _ in range(16):
        g = rng.choice([0, 1, 2])
        for _ in range(4):
            calls = []
            for c in range(3):
                ks = []
                for _ in range(rng.randint(1, 8)):
                    ks.append(key(n, g if rng.random() < 0.8 else rng.choice([0, 1, 2])))
                    n += 1
                calls.append(tier.write_rows(_rows(buf, ks, 8 * c)))
            for res in await asyncio.gather(*calls):
                assert res == [None] * len(res)
            await tier.drain()
            blocks, files = _disk(tier.directory)
            assert index.held_nbytes <= budget + max(ROW.values())
            assert blocks <= budget + max(ROW.values()) + EXTENT_BLOCK * files, (blocks, budget)
            assert blocks <= index.held_nbytes + EXTENT_BLOCK * files  # never undercounted
            punched_seen = max(punched_seen, index.allocated_nbytes - index.held_nbytes)
    assert punched_seen > 0  # the workload moved: rows were punched
    assert tier.stats()["reclaim_failures"] == 0
    await tier.close()
    blocks, files = _disk(tier.directory)
    assert blocks <= budget + EXTENT_BLOCK * files, (blocks, budget)


async def test_reopen_counts_punched_rows_as_holes_and_grows_a_new_group_in_whole_steps(
    tmp_path, slots
) -> None:
    """After a shift from group 0 to group 2 and a close, the scan maps the holes.

    The index's held rows match the blocks the files hold, and the first
    write of group 1 grows a whole step (the point of growth by held rows),
    staying within the budget.
    """
    kw = tier_kwargs(tmp_path, capacity_bytes=24 * ROW[0], grow_ahead=False)
    tier = NVMeTier(**kw)
    await tier.open()
    buf = slots(8)
    await _write_all(tier, buf, [key(i, 0) for i in range(24)])
    await _write_all(tier, buf, [key(100 + i, 2) for i in range(30)])
    assert tier._index.allocated_nbytes > tier._index.held_nbytes  # group 0's rows punched
    await tier.close()
    kw.update(capacity_bytes=28 * ROW[0])  # a little more room at the restart
    tier = NVMeTier(**kw)
    await tier.open()
    index = tier._index
    blocks, files = _disk(tier.directory)
    assert blocks - EXTENT_BLOCK * files <= index.held_nbytes <= blocks
    assert index.held_nbytes < index.allocated_nbytes  # the holes were found
    step = index._grow_rows[1]
    # counting allocated rows there would be no room for a step; held rows leave it
    assert (index.disk_budget_nbytes - index.allocated_nbytes) // ROW[1] < step
    assert (index.disk_budget_nbytes - index.held_nbytes) // ROW[1] >= step
    assert await tier.write_rows(_rows(buf, [key(300, 1)])) == [None]
    assert index.segments(1) == {0: (index.segments(1)[0][0], step)}  # a whole step
    await tier.flush()
    blocks, files = _disk(tier.directory)
    assert blocks <= index.disk_budget_nbytes + EXTENT_BLOCK * files
    await tier.close()


async def test_punching_unsupported_leaves_no_punched_rows_and_grows_one_row_past_the_budget(
    tmp_path, slots
) -> None:
    """A backend that cannot punch: ``_can_punch`` turns False, no row counts as punched.

    Growth past the budget then takes one row at a time (held equals
    allocated), and every write succeeds.
    """
    holder: list[_PunchRig] = []
    tier = NVMeTier(
        **tier_kwargs(
            tmp_path, capacity_bytes=24 * ROW[0], grow_ahead=False, row_io_wrapper=_rigged(holder)
        )
    )
    await tier.open()
    rig = holder[0]
    rig.mode = "nofd"
    index = tier._index
    buf = slots(8)
    await _write_all(tier, buf, [key(i, 0) for i in range(24)])
    await _write_all(tier, buf, [key(100 + i, 2) for i in range(30)], per=1)
    assert rig.punches > 0
    assert tier._can_punch is False
    assert not index._holed
    assert index.held_nbytes == index.allocated_nbytes
    assert index.over_budget  # expected where holes cannot be punched
    before = index.allocated_nbytes
    assert await tier.write_rows(_rows(buf, [key(200 + i, 1) for i in range(3)])) == [None] * 3
    assert index.allocated_nbytes - before <= 3 * ROW[1]  # one row per write, no step
    await tier.close()
    again = NVMeTier(**tier_kwargs(tmp_path, capacity_bytes=64 << 20))
    await again.open()
    assert {k.group_id for k in list(again.keys())} == {1, 2}  # evicted group-0 keys stay gone
    await again.close()


async def test_failed_punches_never_raise_and_the_tier_recovers_within_the_budget(
    tmp_path, slots
) -> None:
    """fallocate(PUNCH_HOLE) fails with EIO during a workload shift, then works again.

    Writes all succeed and never raise, the failures are counted, the index
    never counts fewer blocks than the files hold, and once punching works
    the next write and close bring the files back within the budget.
    """
    holder: list[_PunchRig] = []
    tier = NVMeTier(
        **tier_kwargs(tmp_path, capacity_bytes=24 * ROW[0], row_io_wrapper=_rigged(holder))
    )
    await tier.open()
    rig = holder[0]
    index = tier._index
    buf = slots(8)
    await _write_all(tier, buf, [key(i, 0) for i in range(24)])
    rig.mode = "fail"
    await _write_all(tier, buf, [key(100 + i, 2) for i in range(30)], per=3)
    await tier.drain()
    assert rig.punches > 0
    assert tier.stats()["reclaim_failures"] > 0
    assert tier._can_punch  # an error is not "unsupported"
    blocks, files = _disk(tier.directory)
    assert blocks <= index.held_nbytes + EXTENT_BLOCK * files  # never undercounted
    assert index.over_budget
    rig.mode = "ok"
    assert await tier.write_rows(_rows(buf, [key(200, 1)])) == [None]
    await tier.drain()
    assert index.held_nbytes <= index.disk_budget_nbytes + ROW[1]
    await tier.close()
    blocks, files = _disk(tier.directory)
    assert blocks <= index.disk_budget_nbytes + EXTENT_BLOCK * files


# ========================================================= growth by held rows: regressions


async def test_growth_during_an_in_flight_punch_does_not_grow_past_the_budget(
    tmp_path, slots
) -> None:
    """Regression: growth is not planned into room that an in-flight punch only promised
    (take_to_punch/mark_punched count rows as punched before the I/O): while the files
    are over the budget, another group must not grow a whole step instead of one row.
    Growth plans against RowIndex.growth_held_nbytes.

    Reopen with a smaller capacity: 48 rows of group 0 are evicted (stale), over budget.

    The first write's reclaim counts them all as punched before its
    ``fallocate(PUNCH_HOLE)`` (held here) runs. Meanwhile a group-1 write
    would grow its first segment while the files are far over the budget (the
    stale rows still hold their blocks), and must not plan a whole step (10
    rows) rather than one row as growth past the budget does. A write batch
    waits for the reclaims in flight before it writes (``settle_evictions``),
    so the group-1 write does not grow at all until the punch has run; the
    index-level rule is also checked by the RowIndex state machine in
    tests/io/test_index.py. The test passes without waiting for the held
    punch to time out (30 s).
    """
    buf = slots(8)
    kw = tier_kwargs(tmp_path, capacity_bytes=96 * ROW[0], grow_ahead=False, segment_nbytes=8 << 20)
    tier = NVMeTier(**kw)
    await tier.open()
    await _write_all(tier, buf, [key(i, 0) for i in range(96)])
    await tier.close()

    holder: list[_PunchRig] = []
    kw.update(capacity_bytes=48 * ROW[0], row_io_wrapper=_rigged(holder))
    tier = NVMeTier(**kw)
    await tier.open()
    rig = holder[0]
    index = tier._index
    budget = index.disk_budget_nbytes
    assert index.over_budget
    assert index.stale_rows == 48
    step = index._grow_rows[1]
    assert step >= 4
    rig.mode = "hold"
    a = asyncio.ensure_future(tier.write_rows(_rows(buf, [key(500, 0)])))
    b: asyncio.Future[list[BaseException | None]] | None = None
    try:
        await _until(rig.held)  # 48 stale rows count as punched; their blocks are still there
        over, _ = _disk(tier.directory)
        assert over > budget
        # A write batch settles the evictions in flight (waits for the held
        # punch) before it writes, and so before it grows: the group-1
        # write must not grow while the files are over the budget and the punch
        # is only promised.
        b = asyncio.ensure_future(tier.write_rows(_rows(buf, [key(600, 1)], 1)))
        for _ in range(30):
            await asyncio.sleep(0.01)
            assert _disk(tier.directory, 1)[0] == 0, "group 1 grew while the punch was held"
        assert not b.done()  # it waits for the punch in flight
    finally:
        rig.release.set()
        assert await a == [None]
        if b is not None:
            assert await b == [None]
        await tier.close()
    blocks, files = _disk(tier.directory)
    assert blocks <= budget + EXTENT_BLOCK * files  # it heals once the punch has run


async def test_evicted_key_stays_gone_after_a_failed_punch_and_a_restart(tmp_path, slots) -> None:
    """Regression: a failed fallocate(PUNCH_HOLE) (EIO) does not leave the evicted key's
    trailer: blank_rows zeroes the trailers of the failed row and the rest, then raises
    the punch's error, so the key does not come back after a restart.

    Over the budget, evicted rows are punched; the punch fails with EIO.

    The row write path works (a 4 KiB trailer write succeeds); were the stale row
    freed with its old trailer, evicted keys would be visible again after a clean
    close and reopen with room for every key.
    """
    holder: list[_PunchRig] = []
    kw = tier_kwargs(tmp_path, capacity_bytes=24 * ROW[0], row_io_wrapper=_rigged(holder))
    tier = NVMeTier(**kw)
    await tier.open()
    rig = holder[0]
    buf = slots(8)
    first = [key(i, 0) for i in range(24)]
    await _write_all(tier, buf, first)
    rig.mode = "fail"
    second = [key(100 + i, 2) for i in range(30)]
    await _write_all(tier, buf, second, per=1)
    assert tier.stats()["reclaim_failures"] > 0
    kept = set(tier.keys())
    await tier.close()
    again = NVMeTier(**tier_kwargs(tmp_path, capacity_bytes=64 << 20))
    await again.open()
    back = set(again.keys()) - kept
    await again.close()
    assert not back, sorted(k.block_hash for k in back)


# ==================================================================== the batch-end reclaim


async def test_a_batch_without_stale_rows_blanks_nothing_and_a_replacement_is_blanked_at_once(
    tmp_path, slots
) -> None:
    """The batch-end reclaim runs only for stale rows: fresh keys write no trailer blank.

    Rewriting a key leaves its old row stale: it is blanked before the
    call returns (one 4 KiB write), not by the next batch.
    """
    holder: list[_PunchRig] = []
    tier = NVMeTier(**tier_kwargs(tmp_path, grow_ahead=False, row_io_wrapper=_rigged(holder)))
    await tier.open()
    rig = holder[0]
    buf = slots(8)
    for b in range(4):
        ks = [key(8 * b + i, i % 3) for i in range(8)]
        assert await tier.write_rows(_rows(buf, ks)) == [None] * 8
    assert rig.blanks == 0
    assert tier._index.stale_rows == 0
    assert await tier.write_rows(_rows(buf, [key(3, 0)])) == [None]  # a rewrite
    assert rig.blanks == 1
    assert tier._index.stale_rows == 0
    await tier.close()
    assert rig.blanks == 1  # not blanked again at close


async def test_failed_write_into_an_own_evicted_row_with_a_failing_blank_never_raises(
    tmp_path, slots
) -> None:
    """Strict LRU hands the writer its own group's evicted row; the row write fails (EIO).

    The batch-end reclaim blanks it before the call returns; when that blank
    fails too, write_rows returns the write's error (never raises) and counts
    the failed blanking, and the tier keeps working.
    """
    holder: list[_PunchRig] = []
    tier = NVMeTier(
        **tier_kwargs(
            tmp_path, capacity_bytes=8 * ROW[0], grow_ahead=False, row_io_wrapper=_rigged(holder)
        )
    )
    await tier.open()
    rig = holder[0]
    buf = slots(8)
    await _write_all(tier, buf, [key(i, 0) for i in range(8)])
    bad = key(50, 0)
    rig.fail_rows.add(bad.block_hash + b"\0")
    blanks = rig.blanks
    (err,) = await tier.write_rows(_rows(buf, [bad]))
    assert err is not None
    assert getattr(err, "kind", None) == "eio"
    assert tier._index.stale_rows == 0
    assert rig.blanks == blanks + 1
    assert key(0, 0) not in set(tier.keys())
    # the same with the batch-end blank failing too (EIO): counted, never raised
    rig.fail_blanks = True
    bad2 = key(51, 0)
    rig.fail_rows.add(bad2.block_hash + b"\0")
    failures = tier.stats()["reclaim_failures"]
    (err2,) = await tier.write_rows(_rows(buf, [bad2]))
    assert err2 is not None
    assert getattr(err2, "kind", None) == "eio"
    assert tier.stats()["reclaim_failures"] == failures + 1
    assert tier._index.stale_rows == 0
    rig.fail_blanks = False
    rig.fail_rows.clear()
    assert await tier.write_rows(_rows(buf, [key(52, 0)])) == [None]
    await tier.close()


async def test_close_while_batches_end_with_a_reclaim_returns_and_keeps_every_result(
    tmp_path, slots
) -> None:
    """Many concurrent calls, each rewriting keys (stale rows at every batch end), then close.

    close() waits for the batch-end reclaims; every call gets its results,
    nothing raises, and after a reopen only the newest bytes of each key are
    found (no replaced row comes back).
    """
    holder: list[_PunchRig] = []
    kw = tier_kwargs(tmp_path, row_io_wrapper=_rigged(holder))
    tier = NVMeTier(**kw)
    await tier.open()
    buf = slots(32)
    keys = [key(i, i % 3) for i in range(8)]
    await _write_all(tier, buf, keys)
    calls = [
        asyncio.ensure_future(
            tier.write_rows(
                [
                    (k, 0, 4, buf.fill(4 * c + i, payload(k, GROUP_NBYTES[k.group_id], c + 1)))
                    for i, k in enumerate(keys[c % 2 * 4 : c % 2 * 4 + 4])
                ]
            )
        )
        for c in range(6)
    ]
    await asyncio.sleep(0)
    await tier.close()
    for call in calls:
        assert await call == [None] * 4
    assert tier._index.stale_rows == 0
    again = NVMeTier(**tier_kwargs(tmp_path, capacity_bytes=64 << 20))
    await again.open()
    assert set(again.keys()) == set(keys)
    out = slots(1)
    for i, k in enumerate(keys):
        (got,) = await again.read_rows([(k, out[0])])
        assert got == (0, 4)
        salt = 5 if i < 4 else 6  # the last call of each half wrote last
        assert bytes(out[0][: GROUP_NBYTES[k.group_id]]) == payload(
            k, GROUP_NBYTES[k.group_id], salt
        )
    await again.close()
