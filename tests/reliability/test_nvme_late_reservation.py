"""The NVMe tier's late reservation and punched-row fill.

A punched free row is handed to a
write only after ``posix_fallocate`` gave its blocks back (``_files.fill_row``),
free rows that hold blocks go first (``RowIndex.take_free(holes=False)``,
``RowIndex.has_row``); a write whose group has no row at hand reserves its
room only after its group grew (``reserve(evict_others=False)``,
``job.reserved = False``, the late ``reserve`` in ``_take_row``, then
``settle_evictions`` in ``_write_group``), and on a full filesystem takes its
own group's least recently used key alone (``evict_own(reserved=False)``).

Real seams only: ``row_io_wrapper`` RowIO wrappers around the real backend
(the ``FullFsRig`` of full_fs.py: ENOSPC/EDQUOT/EIO on growth, EIO on row writes, held
blanking writes and reads; here also held or slowed growth, an EIO from a
punched row's allocation through the backend's file handle, and a check after
every row write of what a restart would find on disk), small real tmpfs and
ext4 mounts (root only; skipped elsewhere), and a real child process killed
with SIGKILL (``python -m tests.reliability.test_nvme_late_reservation crash ROOT LOG``).

A test marked ``xfail(strict=True, reason="BUG: ...")`` proves a bug; a "Regression"
comment heads a test that guards against a bug the tier once had.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import shutil
import sys
from collections.abc import Sequence
from typing import Any

import pytest

from kvtier import OffloadKey
from kvtier.errors import StorageError
from kvtier.io import NVMeTier
from kvtier.io import _files as files

from ..io.conftest import Slots
from ._faultio import check_found, kill_child, kill_log, until_set
from .full_fs import (
    BIG,
    HEADER,
    MID,
    NB,
    ROW,
    SLOT,
    SMALL,
    A,
    B,
    G,
    error_kinds,
    fill_fs,
    fs_key,
    fs_snapshot,
    groups_kwargs,
    key_data,
    key_rows,
    reopened,
    trailer_tag,
)
from .growth_rig import GrowthRig, growth_rig, on_disk, open_tier, row_blocks
from .row_states import check_settled_rows

C = MID  # a third group of 8 KiB rows
EQ3 = {A: NB[A], B: NB[B], C: NB[C]}
UNEQUAL = {BIG: G[BIG], SMALL: G[SMALL]}  # rows of 40 and 8 KiB


async def _write_each(tier: NVMeTier, buf: Slots, keys: Sequence[OffloadKey]) -> None:
    for k in keys:
        assert await tier.write_rows(key_rows(buf, [k])) == [None], k


def _gone(before: set[OffloadKey], tier: NVMeTier) -> set[OffloadKey]:
    return before - set(tier.keys())


def _names(keys: set[OffloadKey] | list[OffloadKey]) -> list[bytes]:
    return sorted(k.block_hash for k in keys)


def _full_tier_kw(holder: list[GrowthRig], rows: int, **over: Any) -> dict[str, Any]:
    """capacity_bytes of ``rows`` 8 KiB rows (up to 12: every growth step is one row)."""
    return {"capacity_bytes": rows * ROW[A], "row_io_wrapper": growth_rig(holder), **over}


# =============================================================== regressions


# Regression: the late reservation of a write whose group has no row at hand protects the keys
# of its write_rows call, not only those of its own GROUP (the group's jobs that _write_group
# passes): it must not evict the resident old version of a key the same call rewrites in
# another group, or the key is gone when that rewrite fails (EIO). write_batch builds the
# call's key set once and both reservations protect it
async def test_a_late_reservation_never_evicts_a_key_its_own_call_rewrites(tmp_path, slots) -> None:
    holder: list[GrowthRig] = []
    tier = await open_tier(tmp_path / "nvme", EQ3, **_full_tier_kw(holder, 4, eviction_window=1))
    buf = slots(2, SLOT)
    b0, spare, c0, a0 = fs_key("b0", B), fs_key("spare", B), fs_key("c0", C), fs_key("a0", A)
    await _write_each(tier, buf, [b0, spare, c0, a0])
    tier.discard(spare)  # group B gets a free row: the rewrite of b0 has a row at hand
    assert tier._index.lru_keys() == [b0, c0, a0]  # b0 least recently used
    x = fs_key("x", A)  # group A has no free row: x reserves late, after A grew
    holder[0].fail.add(trailer_tag(b0))  # the rewrite of b0 fails
    got = await tier.write_rows(key_rows(buf, [b0, x], {b0: 1}))
    assert error_kinds(got) == ["eio", None]
    await tier.drain()
    check_settled_rows(tier._index)
    keys = set(tier.keys())
    snap = await fs_snapshot(tier)
    await tier.close()
    assert b0 in keys, "the failed rewrite's key was evicted for another key of its call"
    assert snap[b0] == key_data(b0)  # its old bytes
    assert keys == {b0, a0, x}  # c0, the least recently used key outside the call, went


# Regression: a write that finds no room in capacity_bytes (a row larger than capacity_bytes,
# or every other key pinned by reads) and whose group has no free row reports 'capacity'; it is
# not deferred to grow its group first, reporting the growth's error ('enospc', 'eio') when
# that fails, or allocating rows on a healthy filesystem for a key that cannot be stored.
# RowIndex.reserve(evict_others=False) tells "no room" (False, None) from "room needs other
# groups' keys" (False, DEFERRED); only the latter waits
@pytest.mark.parametrize("why", ["too_big", "pinned"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
async def test_no_room_is_reported_as_capacity_not_as_the_failed_growth(
    tmp_path, slots, why, err
) -> None:
    holder: list[GrowthRig] = []
    if why == "too_big":  # a 40 KiB row in a tier of 32 KiB
        tier = await open_tier(tmp_path / "nvme", UNEQUAL, **_full_tier_kw(holder, 4))
        new = fs_key("big", BIG)
    else:  # a full tier whose every key is being read
        tier = await open_tier(tmp_path / "nvme", EQ3, **_full_tier_kw(holder, 4))
        new = fs_key("c", C)
    rig = holder[0]
    buf = slots(6, SLOT)
    olds = [fs_key(i, (A, B)[i % 2]) for i in range(4)] if why == "pinned" else []
    await _write_each(tier, buf, olds)
    rig.full_errno = err
    rig.hold_reads = bool(olds)
    reads = asyncio.ensure_future(tier.read_rows([(k, buf[2 + i]) for i, k in enumerate(olds)]))
    try:
        if olds:
            await until_set(rig.read_held)
        (res,) = await tier.write_rows(key_rows(buf, [new]))
    finally:
        rig.reads_release.set()
    assert await reads == [(0, 4)] * len(olds)
    st = tier.stats()
    await tier.close()
    assert isinstance(res, StorageError)
    assert set(tier.keys()) == set(olds)  # nothing was evicted for it
    assert (res.kind, st["failures_capacity"]) == ("capacity", 1), res


# On a full filesystem at capacity_bytes with unequal rows, a 40 KiB write whose least recently
# used keys are one 8 KiB key then a 40 KiB key evicts BOTH, not 'one key per new row, of the
# writer's group'. That is strict LRU with unequal rows (the 8 KiB key is older), and the same
# on a healthy filesystem: the write takes the 40 KiB key's row and grows nothing. The README
# says so; this test checks that a full filesystem evicts exactly what a healthy one does.
@pytest.mark.parametrize("full", [False, True])
async def test_unequal_rows_evict_in_strict_lru_order_whether_the_filesystem_is_full_or_not(
    tmp_path, slots, full
) -> None:
    holder: list[GrowthRig] = []
    cap = 2 * ROW[BIG] + 5 * ROW[SMALL]
    kw = {"capacity_bytes": cap, "row_io_wrapper": growth_rig(holder), "eviction_window": 1}
    tier = await open_tier(tmp_path / "nvme", UNEQUAL, **kw)
    buf = slots(1, SLOT)
    s = [fs_key(f"s{i}", SMALL) for i in range(5)]
    b = [fs_key(f"b{i}", BIG) for i in range(3)]
    await _write_each(tier, buf, [s[0], b[0], *s[1:], b[1]])
    assert tier.stats()["bytes_used"] == cap  # at capacity, no free row anywhere
    if full:
        holder[0].full_errno = errno.ENOSPC
    gone: list[set[OffloadKey]] = []
    for i in range(2):  # first the LRU is s0, b0, ...; then s1..s4, b1, ...
        before = set(tier.keys())
        assert await tier.write_rows(key_rows(buf, [fs_key(f"new{i}", BIG)])) == [None]
        gone.append(_gone(before, tier))
    st = tier.stats()
    await tier.close()
    assert gone[0] == {s[0], b[0]}, _names(gone[0])  # strict LRU: s0 is older than b0
    # then 32 KiB of room are needed: s1..s4 would make it, but their rows are of no use to
    # the writer's group, which has no free row: it grows first
    if full:  # it cannot: its own least recently used key gives its row, and nothing else goes
        assert gone[1] == {b[1]}, _names(gone[1])
        assert st["disk_full_evictions"] == 1
    else:  # it grew: then strict LRU makes the room
        assert gone[1] == set(s[1:]), _names(gone[1])
        assert st["disk_full_evictions"] == 0


# ====================================================================== the late reservation


async def test_late_evictions_are_blank_before_the_deferred_row_is_written(tmp_path, slots) -> None:
    """A write of group A (no free row, the least recently used key of group B) grows A,
    then evicts B's key: while that key's blanking is held the call has not returned and
    no row of it is on disk; a crash image taken then holds at most capacity_bytes of
    valid rows (a reopen at that capacity evicts nothing), never the new key, and the
    evicted key with its own bytes or not at all."""
    holder: list[GrowthRig] = []
    root = tmp_path / "nvme"
    tier = await open_tier(root, EQ3, **_full_tier_kw(holder, 4, eviction_window=1))
    rig = holder[0]
    buf = slots(1, SLOT)
    olds = [fs_key("b0", B), fs_key("c0", C), fs_key("a0", A), fs_key("b1", B)]
    await _write_each(tier, buf, olds)
    x = fs_key("x", A)
    allocs = rig.allocs
    rig.hold_blank = True
    call = asyncio.ensure_future(tier.write_rows(key_rows(buf, [x])))
    crash = tmp_path / "crash"
    try:
        await until_set(rig.blank_held)
        await asyncio.sleep(0.05)
        assert rig.allocs == allocs + 1  # A grew before the eviction
        assert not call.done(), "the call returned before the evicted row was blank"
        assert x not in on_disk(tier.directory)
        shutil.copytree(root, crash)
    finally:
        rig.blank_release.set()
    assert await call == [None]
    assert _gone(set(olds), tier) == {olds[0]}  # B's key, the least recently used
    await tier.close()
    for where, expected in ((crash, None), (root, {*olds[1:], x})):
        found, st = await reopened(where, EQ3, capacity_bytes=4 * ROW[A])
        assert st["evictions"] == 0, "valid rows on disk exceed capacity_bytes"
        assert st["invalid_rows_at_open"] == 0
        assert all(data == key_data(k) for k, data in found.items())
        if expected is None:
            assert x not in found
            assert set(found) >= set(olds[1:])
        else:
            assert set(found) == expected


async def test_write_without_room_fails_with_capacity_before_any_growth(tmp_path, slots) -> None:
    """Every key of a full tier is being read: a write of a group with no free row finds no
    room: 'capacity', nothing grown (no growth ahead of the check, see
    test_no_room_is_reported_as_capacity_not_as_the_failed_growth), nothing evicted, no
    capacity leaked; once the reads are done the next write of that group grows once and
    evicts one key."""
    holder: list[GrowthRig] = []
    tier = await open_tier(tmp_path / "nvme", EQ3, **_full_tier_kw(holder, 4, eviction_window=1))
    rig = holder[0]
    buf = slots(6, SLOT)
    olds = [fs_key(i, (A, B)[i % 2]) for i in range(4)]
    await _write_each(tier, buf, olds)
    rig.hold_reads = True
    reads = asyncio.ensure_future(tier.read_rows([(k, buf[2 + i]) for i, k in enumerate(olds)]))
    try:
        await until_set(rig.read_held)
        allocs = rig.allocs
        got = await tier.write_rows(key_rows(buf, [fs_key("c0", C), fs_key("c1", C)]))
        assert rig.allocs == allocs  # no growth for keys that have no room
    finally:
        rig.reads_release.set()
    assert await reads == [(0, 4)] * 4
    assert error_kinds(got) == ["capacity", "capacity"]
    assert set(tier.keys()) == set(olds)
    assert tier.stats()["evictions"] == 0
    await tier.drain()
    check_settled_rows(tier._index)
    assert tier._index.free_rows(C) == 0
    rig.hold_reads = False
    allocs = rig.allocs
    assert await tier.write_rows(key_rows(buf, [fs_key("c2", C)])) == [None]
    assert rig.allocs == allocs + 1
    assert tier.stats()["evictions"] == 1
    await tier.drain()
    check_settled_rows(tier._index)
    await tier.close()


async def test_slow_growth_with_concurrent_calls_discard_drain_and_close(tmp_path, slots) -> None:
    """A full tier; the growth of group A for a write that reserves late is held.
    Meanwhile a second call of A (late too), a call of B with a row at hand, a discard of
    the first call's key, a drain and a close: B's call completes, nothing that waits for
    the growth does, nothing hangs once it is released; the discarded key never becomes
    visible, each new row evicted the least recently used key (the first call's own
    group's key, handed over), no capacity is leaked, and a reopen finds exactly the
    visible keys with their bytes."""
    holder: list[GrowthRig] = []
    root = tmp_path / "nvme"
    tier = await open_tier(root, EQ3, **_full_tier_kw(holder, 6, eviction_window=1))
    rig = holder[0]
    ix = tier._index
    buf = slots(4, SLOT)
    o = [fs_key(f"o{i}", g) for i, g in enumerate((B, C, B, C, A, A))]
    q = fs_key("q", C)
    await _write_each(tier, buf, [*o, q])  # q evicts o0: group B gets a free row
    assert ix.lru_keys() == [*o[1:], q]  # the oldest keys are not of group A
    x1, x2, y = fs_key("x1", A), fs_key("x2", A), fs_key("y", B)
    rig.hold_alloc = True
    first = asyncio.ensure_future(tier.write_rows(key_rows(buf, [x1])))
    try:
        await until_set(rig.alloc_held)
        second = asyncio.ensure_future(tier.write_rows(key_rows(buf, [x2], first=1)))
        await asyncio.sleep(0.02)  # x2 waits for A's growth too
        assert await tier.write_rows(key_rows(buf, [y], first=2)) == [None]  # evicts o1
        tier.discard(x1)
        drain = asyncio.ensure_future(tier.drain())
        close = asyncio.ensure_future(tier.close())
        await asyncio.sleep(0.05)
        assert [f.done() for f in (first, second, drain, close)] == [False] * 4
        rig.hold_alloc = False
    finally:
        rig.alloc_release.set()
    assert await first == [None]  # written, never published (discarded)
    assert await second == [None]
    await asyncio.wait_for(asyncio.gather(drain, close), 10)
    keys = {o[4], o[5], q, y, x2}  # y evicted o1, x1 o2 (then discarded), x2 o3
    assert set(tier.keys()) == keys
    assert tier.stats()["evictions"] == 4
    check_settled_rows(ix)
    found, st = await reopened(root, EQ3, capacity_bytes=6 * ROW[A])
    assert found == {k: key_data(k) for k in keys}
    assert st["evictions"] == 0


# ====================================================================== one eviction per row


@pytest.mark.parametrize("window", [1, 32])
async def test_full_tier_on_a_full_filesystem_evicts_its_own_groups_oldest_key_per_row(
    tmp_path, slots, window
) -> None:
    """Equal rows, three groups, capacity full, the filesystem full (growth fails with
    ENOSPC, or EDQUOT): every new row (single-key calls and calls of several groups)
    evicts exactly one key, the least recently used key of its own group that is not of
    the call, none of another group; with 96 keys (``window`` 32: the eviction window is
    open) and 12 (strict LRU). Then space comes back: one eviction per new row still, and
    with strict LRU the groups grow again and the least recently used key of all groups
    goes."""
    holder: list[GrowthRig] = []
    rows = 96 if window > 1 else 12
    kw = _full_tier_kw(holder, rows, eviction_window=window, segment_nbytes=64 << 20)
    tier = await open_tier(tmp_path / "nvme", EQ3, **kw)
    rig = holder[0]
    buf = slots(3, SLOT)
    rng = random.Random(window)
    await _write_each(tier, buf, [fs_key(f"o{i}", (A, B, C)[i % 3]) for i in range(rows)])
    assert tier.stats()["bytes_used"] == rows * ROW[A]
    n = 0
    for step in range(30):
        rig.full_errno = (errno.ENOSPC, errno.EDQUOT)[step % 2]
        ix = tier._index
        keys = [fs_key(f"n{n + i}", rng.choice((A, B, C))) for i in range(rng.choice((1, 1, 2, 3)))]
        n += len(keys)
        lru = ix.lru_keys()
        expected: set[OffloadKey] = set()
        for k in keys:
            own = [o for o in lru if o.group_id == k.group_id and o not in expected]
            expected.add(own[0])
        before = set(lru)
        assert await tier.write_rows(key_rows(buf, keys)) == [None] * len(keys)
        assert _gone(before, tier) == expected, step
        assert ix.bytes_used == rows * ROW[A]
    st = tier.stats()
    assert st["evictions"] == n
    assert st["failures_enospc"] == 0
    rig.full_errno = 0
    allocs = rig.allocs
    for step in range(6):  # space is back: growth, and the global LRU key goes
        ix = tier._index
        k = fs_key(f"back{step}", (A, B, C)[step % 3])
        lru = ix.lru_keys()
        assert await tier.write_rows(key_rows(buf, [k])) == [None]
        gone = _gone(set(lru), tier)
        assert len(gone) == 1
        if window == 1:
            assert gone == {lru[0]}
    assert rig.allocs > allocs or window > 1
    await tier.drain()
    check_settled_rows(tier._index)
    assert all(data == key_data(k) for k, data in (await fs_snapshot(tier)).items())
    await tier.close()


# ====================================================================== punched rows


async def _punched_group_a(tier: NVMeTier, buf: Slots) -> None:
    """Group A's free rows punched (the workload moved to B past the disk budget), every
    free row of A without blocks (as in test_nvme_disk_full.py's punched-row test)."""
    ix = tier._index
    hot = [fs_key(i, A) for i in range(3)]
    await _write_each(tier, buf, [fs_key(i, A) for i in range(16)])
    for i in range(24):
        for k in hot:
            assert await tier.read_rows([(k, buf[1])]) == [(0, 4)]
        await _write_each(tier, buf, [fs_key(100 + i, B)])
    for j in range(8):  # A's free rows that kept their blocks
        if ix.has_row(A):
            await _write_each(tier, buf, [fs_key(300 + j, A)])
    assert ix.free_rows(A) > 0
    assert not ix.has_row(A)


async def test_eio_allocating_a_punched_row_fails_that_key_only(tmpfs, slots) -> None:
    """Every free row of group A is punched. The allocation of the row (fill_row) fails
    with EIO: with room (a key discarded) that key fails with 'eio' and nothing is
    evicted; at capacity (its room reserved late) it fails the same and nothing is
    evicted either. The row stays punched (the disk blocks the files hold equal the
    index's held rows), no capacity leaks, and the next write of A allocates that row
    and succeeds."""
    mnt = tmpfs(1 << 20)
    holder: list[GrowthRig] = []
    kw = {"capacity_bytes": 16 * ROW[A], "row_io_wrapper": growth_rig(holder, wrap=True)}
    tier = await open_tier(mnt / "nvme", {A: NB[A], B: NB[B]}, **kw)
    rig = holder[0]
    ix = tier._index
    buf = slots(2, SLOT)
    await _punched_group_a(tier, buf)
    assert row_blocks(tier) == ix.held_nbytes
    tier.discard(next(k for k in ix.lru_keys() if k.group_id == B))  # room, no row of A
    for room in (True, False):
        if not room:
            await _write_each(tier, buf, [fs_key("filler", B)])
            assert ix.bytes_used == ix.capacity_bytes
            assert ix.lru_keys()[0].group_id == B  # room needs another group's key
        before, evictions = set(tier.keys()), ix.evictions
        free = ix.free_rows(A)
        rig.fill_faults = 1
        x = fs_key(f"x{room}", A)
        (res,) = await tier.write_rows(key_rows(buf, [x]))
        assert rig.fill_failed == 1 + (not room)
        assert isinstance(res, StorageError)
        assert res.kind == "eio"
        assert (set(tier.keys()), ix.evictions) == (before, evictions)
        await tier.drain()
        check_settled_rows(ix)
        assert (ix.free_rows(A), ix.has_row(A)) == (free, False)
        assert row_blocks(tier) == ix.held_nbytes
    y = fs_key("y", A)
    assert await tier.write_rows(key_rows(buf, [y])) == [None]
    assert tier.stats()["failures_eio"] == 2
    await tier.drain()
    check_settled_rows(ix)
    assert ix.held_nbytes <= ix.disk_budget_nbytes
    assert row_blocks(tier) == ix.held_nbytes
    assert all(data == key_data(k) for k, data in (await fs_snapshot(tier)).items())
    await tier.close()


async def test_punched_rows_on_a_filesystem_that_fills_and_frees_again(tmpfs, slots) -> None:
    """A real tmpfs: group A's free rows punched, then another tenant fills the
    filesystem. A's new keys (with room, and at capacity) take A's oldest keys' rows,
    one each, never another group's key; the filler goes: A's punched rows get their
    blocks back and serve new keys without evicting A's keys; blocks stay within the
    budget and match the index; a reopen finds exactly the visible keys."""
    mnt = tmpfs(1 << 20)
    root = mnt / "nvme"
    tier = await open_tier(root, {A: NB[A], B: NB[B]}, capacity_bytes=16 * ROW[A])
    ix = tier._index
    buf = slots(4, SLOT)
    await _punched_group_a(tier, buf)
    filler = fill_fs(mnt)
    tier.discard(next(k for k in ix.lru_keys() if k.group_id == B))  # room, no row of A
    for j in range(6):
        own = [k for k in ix.lru_keys() if k.group_id == A]
        before = set(tier.keys())
        k = fs_key(f"full{j}", A)
        assert await tier.write_rows(key_rows(buf, [k])) == [None]
        assert _gone(before, tier) == {own[0]}, j  # room or not: A's oldest key
    assert tier.stats()["failures_enospc"] == 0
    filler.unlink()
    holes = ix.free_rows(A)
    assert holes > 0
    assert not ix.has_row(A)
    full = tier.stats()["disk_full_evictions"]
    for j in range(holes):  # capacity evictions again, no disk-full ones
        assert await tier.write_rows(key_rows(buf, [fs_key(f"back{j}", A)])) == [None]
    await tier.drain()
    st = tier.stats()
    assert st["disk_full_evictions"] == full
    check_settled_rows(ix)
    assert ix.held_nbytes <= ix.disk_budget_nbytes
    assert row_blocks(tier) == ix.held_nbytes
    snap = await fs_snapshot(tier)
    assert all(data == key_data(k) for k, data in snap.items())
    await tier.close()
    found, st2 = await reopened(root, {A: NB[A], B: NB[B]}, capacity_bytes=16 * ROW[A])
    assert found == snap
    assert st2["evictions"] == 0


# ====================================================================== concurrency, watched


@pytest.mark.parametrize("window", [1, 32])
async def test_concurrent_deferred_writes_never_leave_more_valid_rows_than_capacity(
    tmp_path, slots, window
) -> None:
    """Rounds of 2-4 concurrent calls (rows of 40 and 8 KiB and a third group, rewrites,
    EIO on 5% of the rows) on a full tier whose groups grow one row at a time (most
    writes reserve late), with slowed growth, reads of the oldest keys in flight,
    discards, and the filesystem full in every other run of five rounds. After every row
    write, what a restart would find on disk stays within capacity_bytes; after each
    round: every row in one state, bytes_used the visible rows, blocks within the disk
    budget, every key reads its last written bytes, reads in flight got their bytes;
    only 'eio' (injected), 'capacity' (rows in flight) and 'enospc' (a group with nothing
    to take) fail."""
    holder: list[GrowthRig] = []
    groups = {**UNEQUAL, A: NB[A]}
    cap = (24 if window == 1 else 80) * ROW[SMALL]
    kw = {"capacity_bytes": cap, "row_io_wrapper": growth_rig(holder), "eviction_window": window}
    tier = await open_tier(tmp_path / "nvme", groups, grow_ahead=window > 1, **kw)
    rig = holder[0]
    rig.watch = tier.directory
    rig.alloc_delay = 0.002
    rig.read_delay = 0.002
    ix = tier._index
    buf = slots(48, SLOT)
    rng = random.Random(window)
    salt: dict[OffloadKey, int] = {}
    good: dict[OffloadKey, int] = {}
    kinds: dict[str, int] = {}
    n = 0
    for rnd in range(24):
        rig.full_errno = errno.ENOSPC if (rnd // 5) % 2 else 0
        lru = ix.lru_keys()
        calls: list[tuple[list[OffloadKey], Any]] = []
        taken: set[OffloadKey] = set()
        slot = 0
        for _ in range(rng.randint(2, 4)):
            keys: list[OffloadKey] = []
            for _ in range(rng.randint(1, 3)):
                if lru and rng.random() < 0.25:
                    k = rng.choice(lru)
                    if k in taken:
                        continue
                    salt[k] += 1
                else:
                    k = fs_key(f"w{n}", rng.choice([BIG, SMALL, SMALL, A]))
                    n += 1
                    salt[k] = 0
                if rng.random() < 0.05:
                    rig.fail.add(trailer_tag(k))
                taken.add(k)
                keys.append(k)
            calls.append((keys, tier.write_rows(key_rows(buf, keys, salt, first=slot))))
            slot += len(keys)
        oldest = [k for k in lru[:4] if k not in taken]
        reads = [tier.read_rows([(k, buf[40 + i])]) for i, k in enumerate(oldest)]
        if lru and rng.random() < 0.3:
            k = rng.choice(lru)
            if k not in taken and k not in oldest:
                tier.discard(k)
                good.pop(k, None)
        outs = await asyncio.gather(*(c for _, c in calls), *reads)
        for (keys, _), got in zip(calls, outs, strict=False):
            for k, r in zip(keys, got, strict=True):
                if r is None:
                    good[k] = salt[k]
                    continue
                assert isinstance(r, StorageError)
                injected = any(trailer_tag(x) in rig.fail for x in keys)  # in its request
                assert r.kind in ("capacity", "enospc") or (r.kind == "eio" and injected), r
                kinds[r.kind] = kinds.get(r.kind, 0) + 1
        for i, (k, got) in enumerate(zip(oldest, outs[len(calls) :], strict=True)):
            (r,) = got
            if isinstance(r, BaseException):
                assert getattr(r, "kind", "") == "missing", r
            else:
                assert bytes(buf[40 + i][: NB[k.group_id]]) == key_data(k, good[k]), k
        await tier.drain()
        # a lone key (nothing else in flight: no slack between reserved and written rows)
        k = fs_key(f"w{n}", rng.choice([BIG, SMALL, A]))
        n += 1
        salt[k] = 0
        (r,) = await tier.write_rows(key_rows(buf, [k]))
        if r is None:
            good[k] = 0
        else:
            assert isinstance(r, StorageError)
            assert r.kind == "enospc", r  # its group has no key to take
        await tier.drain()  # a growth ahead it started
        check_settled_rows(ix)
        assert ix.held_nbytes <= ix.disk_budget_nbytes
        for k, data in (await fs_snapshot(tier)).items():
            assert data == key_data(k, good[k]), k
        assert rig.worst <= cap, f"{rig.worst} bytes of valid rows on disk > {cap}"
    st = tier.stats()
    await tier.close()
    assert rig.checks > 50
    assert rig.worst > cap - ROW[BIG]  # the tier was full
    assert st["disk_full_evictions"] > 0
    assert st["failures_checksum"] == st["failures_trailer"] == 0
    assert kinds.get("eio", 0) > 0


# ====================================================================== SIGKILL


CRASH_CAP = 24 * ROW[SMALL]
CRASH_GROUPS = {**UNEQUAL, A: NB[A]}


async def _crash_child(root: str, log_path: str) -> None:
    """Write forever into a full tier whose groups grow a row at a time (late
    reservations, disk-full evictions while the filesystem is full: every other
    round, at random): three concurrent calls with rewrites and EIO on 4% of the rows,
    reads of the oldest keys in flight, discards; a flush every round. Logs each key
    before its write, each discard, the visible keys after each flush, and ``BAD`` if a
    row write ever left more valid rows on disk than capacity_bytes or a read got
    wrong bytes."""
    holder: list[GrowthRig] = []
    tier = NVMeTier(
        **groups_kwargs(
            root,
            CRASH_GROUPS,
            capacity_bytes=CRASH_CAP,
            grow_ahead=False,
            eviction_window=1,
            row_io_wrapper=growth_rig(holder),
        )
    )
    await tier.open()
    rig = holder[0]
    rig.watch = tier.directory
    buf = Slots(24, SLOT)
    rng = random.Random(os.getpid())
    salt: dict[OffloadKey, int] = {}
    good: dict[OffloadKey, int] = {}
    n = 0
    with open(log_path, "a") as log:
        print("ready", flush=True)
        while True:
            rig.full_errno = errno.ENOSPC if rng.random() < 0.5 else 0
            calls: list[list[OffloadKey]] = []
            taken: set[OffloadKey] = set()
            for _ in range(3):
                keys: list[OffloadKey] = []
                for _ in range(rng.randint(1, 4)):
                    if salt and rng.random() < 0.15:
                        k = rng.choice(list(salt))
                        if k in taken:
                            continue
                        salt[k] += 1
                    else:
                        k = OffloadKey(f"k{os.getpid()}-{n}".encode(), rng.choice((0, 1, 1, A)))
                        n += 1
                        salt[k] = 0
                    if rng.random() < 0.04:
                        rig.fail.add(trailer_tag(k))
                    taken.add(k)
                    keys.append(k)
                    log.write(json.dumps({"w": [k.block_hash.decode(), k.group_id, salt[k]]}))
                    log.write("\n")
                calls.append(keys)
            log.flush()
            lru = tier._index.lru_keys()
            oldest = [k for k in lru[:3] if k not in taken and k in good]
            writes = [
                tier.write_rows(key_rows(buf, ks, salt, first=5 * i)) for i, ks in enumerate(calls)
            ]
            reads = [tier.read_rows([(k, buf[20 + i])]) for i, k in enumerate(oldest)]
            if lru and rng.random() < 0.2:
                k = rng.choice(lru)
                if k not in taken and k not in oldest:
                    log.write(json.dumps({"d": [k.block_hash.decode(), k.group_id]}) + "\n")
                    log.flush()
                    tier.discard(k)
            outs = await asyncio.gather(*writes, *reads)
            for ks, got in zip(calls, outs, strict=False):
                for k, r in zip(ks, got, strict=True):
                    if r is None:
                        good[k] = salt[k]
            for i, (k, got) in enumerate(zip(oldest, outs[len(writes) :], strict=True)):
                (r,) = got
                if not isinstance(r, BaseException) and bytes(
                    buf[20 + i][: NB[k.group_id]]
                ) != key_data(k, good[k]):
                    log.write(json.dumps({"BAD": f"read {k}"}) + "\n")
            if rig.worst > CRASH_CAP:
                log.write(json.dumps({"BAD": f"{rig.worst} valid bytes on disk"}) + "\n")
            await tier.flush()
            vis = [[k.block_hash.decode(), k.group_id, good.get(k, -1)] for k in list(tier.keys())]
            log.write(json.dumps({"flushed": vis}) + "\n")
            log.flush()


def test_sigkill_during_late_reservations_and_disk_full_evictions(tmp_path) -> None:
    """Two SIGKILLs of the child above (same root). After each: no BAD line; a reopen at
    the child's capacity evicts nothing (valid rows <= capacity_bytes); a reopen with
    room finds only keys visible at the last flush, written after it or discarded after
    it, each with the bytes of one of its writes since (or unreadable: a row the kill
    tore), never a key evicted or replaced before the last flush."""
    root = tmp_path / "nvme"
    rng = random.Random(14)
    history: dict[tuple[str, int], set[int]] = {}
    checked = 0
    for it in range(2):
        log_path, err_path = tmp_path / f"log{it}", tmp_path / f"err{it}"
        log_path.write_text("")
        args = ["tests.reliability.test_nvme_late_reservation", "crash", str(root), str(log_path)]
        alive = kill_child(args, err_path, rng.uniform(1.0, 1.5))
        assert alive, err_path.read_text()[-3000:]
        entries, last, allowed = kill_log(log_path, err_path, history)
        assert not [e for e in entries if "BAD" in e]
        for e in entries[last + 1 :]:
            if "w" in e:
                h, g, s = e["w"]
                allowed.setdefault((h, g), set()).add(s)
        _, st = asyncio.run(reopened(root, CRASH_GROUPS, capacity_bytes=CRASH_CAP))
        assert st["evictions"] == 0, "valid rows on disk exceed capacity_bytes"
        found, _ = asyncio.run(reopened(root, CRASH_GROUPS))
        checked += check_found(found, allowed, key_data)
    assert checked > 10


# ====================================================================== ext4


async def test_ext4_a_punched_row_that_only_partly_fits_gives_its_blocks_back(ext4, slots) -> None:
    """A real ext4 loop mount: group A's free rows punched, then the filesystem filled
    and one block freed (a row needs two). A's write allocates the row, which fails
    with ENOSPC after ext4 took the one block: the row is punched again (the block goes
    back to the filesystem: FIEMAP shows no block in A's punched rows), the write takes
    A's oldest key's row instead, and a reopen counts the punched rows as holes, finds
    the visible keys and no invalid row."""
    mnt = ext4(8 << 20)
    root = mnt / "nvme"
    groups = {A: NB[A], B: NB[B]}
    tier = await open_tier(root, groups, capacity_bytes=16 * ROW[A])
    ix = tier._index
    buf = slots(2, SLOT)
    await _punched_group_a(tier, buf)
    await tier.flush()
    filler = fill_fs(mnt)
    with open(filler, "r+b") as f:  # give one block back
        f.truncate(filler.stat().st_size - 4096)
    os.sync()
    free0 = os.statvfs(mnt).f_bfree
    tier.discard(next(k for k in ix.lru_keys() if k.group_id == B))  # room, no row of A
    own = [k for k in ix.lru_keys() if k.group_id == A]
    before = set(tier.keys())
    x = fs_key("x", A)
    assert await tier.write_rows(key_rows(buf, [x])) == [None]
    assert _gone(before, tier) == {own[0]}
    await tier.flush()
    os.sync()
    assert os.statvfs(mnt).f_bfree >= free0, "the row kept the block ext4 gave it"
    holed = {r for r in ix._holed if r.group_id == A}
    assert holed
    for (g, seg), handle in tier._segments.items():
        if g != A:
            continue
        size = os.fstat(handle if isinstance(handle, int) else handle.fd).st_size
        extents = files.allocated_extents(handle, size)
        assert extents is not None
        spec = tier._specs[A]
        holes = set(files._rows_without_blocks(spec, (size - HEADER) // spec.row_nbytes, extents))
        assert {r.row for r in holed if r.segment == seg} <= holes
    snap = await fs_snapshot(tier)
    assert all(data == key_data(k) for k, data in snap.items())
    await tier.close()
    found, st = await reopened(root, groups, capacity_bytes=16 * ROW[A])
    assert found == snap
    assert st["invalid_rows_at_open"] == 0


if __name__ == "__main__" and sys.argv[1:2] == ["crash"]:
    asyncio.run(_crash_child(sys.argv[2], sys.argv[3]))


# ====================================================================== a small filesystem


# Regression: on a small filesystem the first growth step of one group (capacity_bytes /
# (4 x groups) of rows, here the whole filesystem) must leave room for another group's segment;
# that group has no key to take, so every one of its rows would fail with enospc, for good (a
# reopen too). A group grows by a whole step only while the filesystem has four such steps
# free, else by one row.
@pytest.mark.parametrize("grow_ahead", [False, True])
async def test_one_groups_growth_step_never_takes_a_small_filesystem_from_another(
    tmpfs, slots, grow_ahead
) -> None:
    mnt = tmpfs((1 << 20) + 4096)  # one step of group B (127 rows) and its header fit, no row more
    tier = await open_tier(mnt / "nvme", {A: NB[A], B: NB[B]}, capacity_bytes=16 << 20,
                       grow_ahead=grow_ahead)  # fmt: skip
    buf = slots(2, SLOT)
    failed = []
    for i in range(120):  # B first; then both, until the filesystem is full and past it
        for g in (B, A) if i else (B,):
            (got,) = await tier.write_rows(key_rows(buf, [fs_key(i, g)]))
            if got is not None:
                failed.append((g, got))
    st = tier.stats()
    keys = tier.keys()
    held = {g: sum(k.group_id == g for k in keys) for g in (A, B)}
    snap = await fs_snapshot(tier)
    await tier.close()
    assert failed == []
    assert st["disk_full_evictions"] > 0  # the filesystem did fill up
    assert min(held.values()) >= 40, held  # each group holds about half of it
    assert all(data == key_data(k) for k, data in snap.items())
