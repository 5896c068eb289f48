"""NVMeTier under faults: on-disk corruption and failing backends affect only their keys."""

from __future__ import annotations

import asyncio
import errno
import os
import time

import pytest

from kvtier.errors import StorageError
from kvtier.io import NVMeTier, RowIO

from .conftest import GROUP_NBYTES, hashes, key, payload
from .faults import Fault, FaultyRowIO

ROW0 = 5 * 4096  # row of group 0
N = 4


async def _fill(tier: NVMeTier, slots, n: int = N, group_id: int = 0):
    buf = slots(n)
    rows = [
        (key(i, group_id), 0, 4, buf.fill(i, payload(key(i, group_id), GROUP_NBYTES[group_id])))
        for i in range(n)
    ]
    assert await tier.write_rows(rows) == [None] * n
    return buf


async def _read_all(tier: NVMeTier, slots, n: int = N, group_id: int = 0):
    out = slots(n)
    results = await tier.read_rows([(key(i, group_id), out[i]) for i in range(n)])
    for i, r in enumerate(results):
        if isinstance(r, tuple):
            data = payload(key(i, group_id), GROUP_NBYTES[group_id])
            assert bytes(out[i][: len(data)]) == data
    return results


def _segment(tier: NVMeTier, group_id: int = 0, n: int = 0):
    return tier.directory / f"g{group_id}" / f"{n}.kvrows"


def _patch(path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _flip(path, offset: int) -> None:
    with open(path, "rb") as f:
        f.seek(offset)
        b = f.read(1)
    _patch(path, offset, bytes([b[0] ^ 0x5A]))


async def test_corrupt_payload_byte_is_a_checksum_failure(open_tier, slots) -> None:
    tier = await open_tier()
    await _fill(tier, slots)
    _flip(_segment(tier), 4096 + 2 * ROW0 + 777)  # row 2, payload
    results = await _read_all(tier, slots)
    assert [type(r) for r in results] == [tuple, tuple, StorageError, tuple]
    assert results[2].kind == "checksum"
    assert not tier.contains(key(2))
    st = tier.stats()
    assert st["checksum_failures"] == st["failures_checksum"] == 1
    (again,) = await tier.read_rows([(key(2), slots(1)[0])])
    assert again.kind == "missing"


async def test_corrupt_trailer_byte_is_a_trailer_failure(open_tier, slots, tmp_path) -> None:
    tier = await open_tier()
    await _fill(tier, slots)
    _flip(_segment(tier), 4096 + 1 * ROW0 + 4 * 4096 + 40)  # row 1, trailer
    results = await _read_all(tier, slots)
    assert results[1].kind == "trailer"
    assert [isinstance(r, tuple) for r in results] == [True, False, True, True]
    assert tier.stats()["failures_trailer"] == 1
    await tier.close()
    # the dropped row 1 was blanked at close; a row corrupted later is counted
    # invalid at open and becomes free space
    assert bytes(_segment(tier).read_bytes()[4096 + ROW0 + 4 * 4096 :][:4096]) == bytes(4096)
    _flip(_segment(tier), 4096 + 3 * ROW0 + 4 * 4096 + 40)
    tier2 = await open_tier()
    assert tier2.stats()["invalid_rows_at_open"] == 1
    assert hashes(tier2) == [b"hash-0", b"hash-2"]


async def test_zeroed_trailer_row_is_missing_after_reopen(open_tier, slots) -> None:
    tier = await open_tier()
    await _fill(tier, slots)
    await tier.close()
    _patch(_segment(tier), 4096 + 0 * ROW0 + 4 * 4096, bytes(4096))
    tier2 = await open_tier()
    results = await _read_all(tier2, slots)
    assert results[0].kind == "missing"
    assert results[1:] == [(0, 4)] * 3
    assert tier2.stats()["invalid_rows_at_open"] == 0  # a blank trailer is a free row


async def test_truncated_segment(open_tier, slots) -> None:
    tier = await open_tier()
    await _fill(tier, slots)
    os.truncate(_segment(tier), 4096 + 2 * ROW0 + ROW0 // 2)  # cuts row 2, drops row 3
    results = await _read_all(tier, slots)
    assert results[:2] == [(0, 4)] * 2
    assert [r.kind for r in results[2:]] == ["short_read", "short_read"]
    assert tier.stats()["failures_short_read"] == 2
    assert not tier.contains(key(2))
    await tier.close()
    os.truncate(_segment(tier), 4096 + 2 * ROW0 + ROW0 // 2)
    tier2 = await open_tier()
    assert hashes(tier2) == [b"hash-0", b"hash-1"]
    assert tier2.stats()["invalid_rows_at_open"] == 1  # row 2 was cut
    # the file was extended again: all its rows are usable
    await _fill(tier2, slots)
    assert await _read_all(tier2, slots) == [(0, 4)] * N


def _wrapped(faults):
    holder: list[FaultyRowIO] = []

    def wrap(inner: RowIO) -> RowIO:
        holder.append(FaultyRowIO(inner, faults))
        return holder[0]

    return wrap, holder


def _row_offset(i: int) -> int:
    return 4096 + i * ROW0


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        (Fault("pwritev", "errno", err=errno.EIO), "eio"),
        (Fault("pwritev", "errno", err=errno.ENOSPC), "enospc"),
        (Fault("pwritev", "errno", err=errno.EINVAL), "einval"),
        (Fault("pwritev", "short", keep=4096), "short_write"),
    ],
)
async def test_write_faults_fail_only_affected_keys(open_tier, slots, fault, kind) -> None:
    fault.match = lambda op, off, n: off in (_row_offset(1), _row_offset(3))
    wrap, holder = _wrapped([fault])
    tier = await open_tier(row_io_wrapper=wrap, request_nbytes=ROW0)  # one request per row
    buf = slots(N)
    rows = [(key(i), 0, 4, buf.fill(i, payload(key(i), GROUP_NBYTES[0]))) for i in range(N)]
    results = await tier.write_rows(rows)
    assert results[0] is None
    assert results[2] is None
    for r in (results[1], results[3]):
        assert isinstance(r, StorageError)
        assert r.kind == kind
    assert hashes(tier) == [b"hash-0", b"hash-2"]
    assert tier.stats()[f"failures_{kind}"] == 2
    # the failed rows were freed: the retry reuses them, the tier still serves
    holder[0].faults.clear()
    assert await tier.write_rows([rows[1], rows[3]]) == [None, None]
    assert await _read_all(tier, slots) == [(0, 4)] * N
    assert tier.stats()["bytes_used"] == N * ROW0  # rows in use, not whole segments


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        (Fault("preadv", "errno", err=errno.EIO), "eio"),
        (Fault("preadv", "short", keep=8192), "short_read"),
    ],
)
async def test_read_faults_fail_only_affected_keys(open_tier, slots, fault, kind) -> None:
    fault.match = lambda op, off, n: off == _row_offset(2)
    wrap, _ = _wrapped([fault])
    tier = await open_tier(row_io_wrapper=wrap, request_nbytes=ROW0)
    await _fill(tier, slots)
    results = await _read_all(tier, slots)
    assert [isinstance(r, tuple) for r in results] == [True, True, False, True]
    assert results[2].kind == kind
    assert tier.stats()[f"failures_{kind}"] == 1
    assert not tier.contains(key(2))


SIX = 6  # rows of one coalesced read request (6 * 20 KiB < request_nbytes)


def _on_row(i: int):
    """Match a request whose bytes overlap row ``i`` of group 0's first segment."""
    start, stop = _row_offset(i), _row_offset(i + 1)
    return lambda op, off, n: off < stop and off + n > start


@pytest.mark.parametrize("action", ["errno", "short"])
async def test_a_failed_coalesced_read_is_retried_row_by_row_once(open_tier, slots, action) -> None:
    # one-shot: the coalesced request fails (EIO, or a short read ending in row 2), its retries not
    fault = Fault("preadv", action, err=errno.EIO, keep=2 * ROW0 + 4096, times=1, match=_on_row(3))
    wrap, holder = _wrapped([fault])
    tier = await open_tier(row_io_wrapper=wrap)
    await _fill(tier, slots, SIX)
    holder[0].reset()
    assert await _read_all(tier, slots, SIX) == [(0, 4)] * SIX
    retried = range(SIX) if fault.action == "errno" else range(2, SIX)  # the rows not read
    assert holder[0].preadv_calls == [(_row_offset(0), SIX * ROW0)] + [
        (_row_offset(i), ROW0) for i in retried
    ]
    st = tier.stats()
    assert st["read_requests"] == 1 + len(retried)
    assert sum(v for k, v in st.items() if k.startswith("failures_")) == 0
    assert hashes(tier) == [f"hash-{i}".encode() for i in range(SIX)]


@pytest.mark.parametrize("times", [2, 1_000_000], ids=["transient", "persistent"])
async def test_eio_on_one_row_of_a_coalesced_read_loses_only_that_row(
    open_tier, slots, times
) -> None:
    # transient: the coalesced request and the row's own retry fail, then the fault is gone
    fault = Fault("preadv", "errno", err=errno.EIO, times=times, match=_on_row(3))
    wrap, _ = _wrapped([fault])
    tier = await open_tier(row_io_wrapper=wrap)
    await _fill(tier, slots, SIX)
    results = await _read_all(tier, slots, SIX)
    assert [isinstance(r, tuple) for r in results] == [True, True, True, False, True, True]
    assert isinstance(results[3], StorageError)
    assert results[3].kind == "eio"
    st = tier.stats()
    assert st["failures_eio"] == 1
    assert st["read_requests"] == 1 + SIX
    assert hashes(tier) == [f"hash-{i}".encode() for i in range(SIX) if i != 3]
    # the healthy rows still load (one coalesced request each side of the dropped row)
    again = await _read_all(tier, slots, SIX)
    assert [isinstance(r, tuple) for r in again] == [True, True, True, False, True, True]
    assert again[3].kind == "missing"
    await tier.close()
    tier2 = await open_tier()  # restarted, the fault gone
    assert hashes(tier2) == [f"hash-{i}".encode() for i in range(SIX) if i != 3]
    after = await _read_all(tier2, slots, SIX)
    assert [isinstance(r, tuple) for r in after] == [True, True, True, False, True, True]
    assert after[3].kind == "missing"


async def test_a_checksum_failure_in_a_coalesced_read_is_not_retried(open_tier, slots) -> None:
    wrap, holder = _wrapped([])
    tier = await open_tier(row_io_wrapper=wrap)
    await _fill(tier, slots, SIX)
    _flip(_segment(tier), _row_offset(4) + 100)  # row 4, payload
    holder[0].reset()
    results = await _read_all(tier, slots, SIX)
    assert [isinstance(r, tuple) for r in results] == [True] * 4 + [False, True]
    assert results[4].kind == "checksum"
    assert holder[0].preadv_calls == [(_row_offset(0), SIX * ROW0)]  # the request succeeded


async def test_torn_write_is_detected_on_read(open_tier, slots) -> None:
    torn = Fault("pwritev", "torn", keep=4 * 4096, match=lambda op, off, n: off == _row_offset(1))
    wrap, _ = _wrapped([torn])
    tier = await open_tier(row_io_wrapper=wrap, request_nbytes=ROW0)
    await _fill(tier, slots)  # the backend claims success for the torn row
    results = await _read_all(tier, slots)
    assert results[1].kind == "trailer"
    assert [isinstance(r, tuple) for r in results] == [True, False, True, True]


async def test_failed_growth_ahead_fails_no_key_and_on_demand_growth_reports_it(
    open_tier, slots
) -> None:
    fault = Fault("allocate", "errno", err=errno.ENOSPC)  # every allocation fails
    wrap, _ = _wrapped([fault])
    tier = await open_tier(row_io_wrapper=wrap)
    await tier.drain()
    assert fault.hits == len(GROUP_NBYTES)  # each group's first segment, tried ahead once
    stats = tier.stats()
    assert stats["segments"] == 0
    assert stats["bytes_allocated"] == 0
    assert not [k for k, v in stats.items() if k.startswith("failures_") and v]  # no key failed
    assert not list(tier.directory.glob("g*/*"))  # temporary files removed
    buf = slots(1)
    row = (key(0), 0, 4, buf.fill(0, payload(key(0), GROUP_NBYTES[0])))
    (err,) = await tier.write_rows([row])
    assert err.kind == "enospc"  # the write that needed a row reports it
    assert tier.stats()["failures_enospc"] == 1
    await tier.drain()
    # the on-demand step, then one row; no more growth ahead for that group
    assert fault.hits == len(GROUP_NBYTES) + 2
    fault.times = fault.hits  # room again
    assert await tier.write_rows([row]) == [None]
    await tier.drain()
    assert tier.stats()["segments"] == 1  # the on-demand growth; growth ahead may resume
    out = slots(1)
    assert await tier.read_rows([(key(0), out[0])]) == [(0, 4)]


async def test_segment_creation_enospc(open_tier, slots) -> None:
    # the step and its one-row retry both fail (a step that does not fit is tried
    # again as one row before the write fails or evicts)
    fault = Fault("allocate", "errno", err=errno.ENOSPC, times=2)
    wrap, _ = _wrapped([fault])
    tier = await open_tier(row_io_wrapper=wrap, grow_ahead=False)  # creation on demand
    buf = slots(2)
    (err,) = await tier.write_rows([(key(0), 0, 4, buf.fill(0, payload(key(0), GROUP_NBYTES[0])))])
    assert err.kind == "enospc"
    assert fault.hits == 2
    assert tier.stats()["bytes_used"] == 0
    assert not list((tier.directory / "g0").glob("*"))  # the temp files were removed
    assert await tier.write_rows([(key(0), 0, 4, buf[0])]) == [None]
    # one failure only: the one-row retry creates the segment and the write succeeds
    fault.times = fault.hits + 1
    (ok,) = await tier.write_rows([(key(1, 1), 0, 4, buf.fill(1, payload(key(1, 1), 4096)))])
    assert ok is None
    assert fault.hits == 3
    assert tier.stats()["failures_enospc"] == 1


async def test_flush_failure_keeps_segments_dirty(open_tier, slots) -> None:
    wrap, holder = _wrapped([])
    tier = await open_tier(row_io_wrapper=wrap)
    await _fill(tier, slots)
    # segments created ahead of need in the background sync their new file: let them
    # finish, so that the one fault hits the flush's fdatasync (CI saw it taken by one)
    await tier.drain()
    holder[0].faults.append(Fault("fdatasync", "errno", err=errno.EIO, times=1))
    with pytest.raises(StorageError) as info:
        await tier.flush()
    assert info.value.kind == "eio"
    # the keys written since the segment's last good sync are not known durable
    assert not any(tier.contains(key(i)) for i in range(N))
    assert tier.stats()["failures_eio"] == N
    await tier.flush()  # the retry syncs the same segment again and succeeds
    assert holder[0].faults[0].hits == 1
    await _fill(tier, slots)  # written again, into rows of their own
    await tier.flush()
    assert all(tier.contains(key(i)) for i in range(N))


class SlowRowIO(FaultyRowIO):
    def pwritev(self, handle, bufs, file_offset):
        time.sleep(0.2)
        return super().pwritev(handle, bufs, file_offset)


async def test_cancelled_writer_leaves_tier_consistent(open_tier, slots) -> None:
    tier = await open_tier(row_io_wrapper=SlowRowIO)
    buf = slots(2)
    rows = [(key(i), 0, 4, buf.fill(i, payload(key(i), GROUP_NBYTES[0]))) for i in range(2)]
    task = asyncio.get_running_loop().create_task(tier.write_rows(rows))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not tier.contains(key(0))  # still in flight
    await tier.drain()
    assert tier.contains(key(0))
    assert tier.contains(key(1))
    assert await _read_all(tier, slots, 2) == [(0, 4)] * 2


async def test_concurrent_flushes_and_writes(open_tier, slots) -> None:
    wrap, _ = _wrapped([])
    tier = await open_tier(row_io_wrapper=wrap)
    buf = slots(8)

    async def one(i: int) -> None:
        k = key(i, i % 3)
        data = payload(k, GROUP_NBYTES[i % 3])
        assert await tier.write_rows([(k, 0, 4, buf.fill(i, data))]) == [None]
        await tier.flush()

    await asyncio.gather(*(one(i) for i in range(8)))
    assert len(tier.keys()) == 8
    await tier.flush()  # nothing new: no sync needed, returns at once
