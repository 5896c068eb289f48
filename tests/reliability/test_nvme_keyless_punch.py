"""A keyless group punches other groups' rows on a full filesystem.

A write whose group has no key of its own to
take when its segments cannot grow (ENOSPC below ``capacity_bytes``) punches
free rows of other groups, then evicts and punches their least recently used
evictable keys (``RowIndex.take_for_disk``), enough for one row
(``RowIndex.growth_nbytes``), and grows again (``_disk_space.on_full_disk``);
skipped where punching is unsupported, and after ``_PUNCH_MISSES`` rounds in a
row that gave the growth nothing (``tier._punch_frees``), until any
allocation succeeds again. Rows that punch for room are serialized with
allocations once the filesystem was full (``tier._punch_lock``) and punch up
to two rounds of keys per row. At open, rows the extents do not cover whole
count as punched (``_files._rows_without_blocks``), by ``lseek(SEEK_DATA)``
where FIEMAP is not answered (``_files.data_extents``, tmpfs), and the free
rows ``lseek`` cannot vouch for are punched (``test_nvme_punch_lock.py``). A
write that fails with 'enospc' or 'short_write' punches its row
(``RowIndex.fail_write(hole=True)``).

Real seams only: small real tmpfs and ext4 loop mounts (root only; skipped
elsewhere), another tenant that fills the filesystem from the test (or, at the
moment a growth allocates, from a ``row_io_wrapper`` RowIO wrapper), the
``GrowthRig`` RowIO wrapper of test_nvme_late_reservation.py with wrapped segment
handles whose ``fd`` fails or waits when ``_files._punch_hole`` asks for it
(the only seam of a punch: it calls ``fallocate`` through libc, not through
the RowIO), held row reads (pins), and a real child process killed with SIGKILL
(``python -m tests.reliability.test_nvme_keyless_punch crash ROOT LOG``).

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
from typing import Any

import pytest

from kvtier import OffloadKey
from kvtier.io import NVMeTier
from kvtier.io import _files as files

from ..io.conftest import Slots
from ._faultio import kill_child, rig_factory
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
from .growth_rig import FS, PunchRig, fill_with_a, open_tier, reopened_copy, row_blocks
from .row_states import check_settled_rows

C = MID


def _punch_rig(holder: list[PunchRig]) -> Any:
    return rig_factory(PunchRig, holder)


async def _full_of_a(
    root: Any, groups: dict[int, int], buf: Slots
) -> tuple[NVMeTier, PunchRig, Slots, list[OffloadKey]]:
    """A tier with the punch rig (capacity 16 MiB) whose filesystem group A filled with keys.

    Returns:
        ``(tier, rig, buf, A's keys held)``.
    """
    holder: list[PunchRig] = []
    tier = await open_tier(root, groups, capacity_bytes=16 << 20, row_io_wrapper=_punch_rig(holder))
    return tier, holder[0], buf, await fill_with_a(tier, buf)


# =============================================================== regressions


# Regression: after a reopen on tmpfs, _files.data_extents (lseek SEEK_DATA) reports
# fallocated but never written free rows as holes; RowIndex.rebuild counts them punched and
# RowIndex.take_for_disk(keys=False) skips them, so on_full_disk must not evict other groups'
# KEYS while those rows hold a whole step of pages. The open punches such free rows
# (_blanking.punch_unsure).
async def test_after_a_reopen_on_tmpfs_a_keyless_group_evicts_no_key_while_free_rows_hold_pages(
    tmpfs, slots
) -> None:
    """Group A grows one whole step (127 rows, 1 MiB: the 6 MiB tmpfs had four steps free)
    and stores 3 keys; another tenant fills the filesystem; reopen. Group B, with no key,
    writes one row: A's 124 free rows hold 1 MiB of pages (st_blocks), so punching them
    gives B its row and no key of A needs to go."""
    mnt = tmpfs(6 << 20)
    root = mnt / "nvme"
    groups = {A: NB[A], B: NB[B]}
    tier = await open_tier(root, groups, capacity_bytes=16 << 20)
    buf = slots(2, SLOT)
    a_keys = [fs_key(i, A) for i in range(3)]
    for k in a_keys:
        assert await tier.write_rows(key_rows(buf, [k])) == [None]
    assert tier._index.segments(A) == {0: (127, 127)}  # a whole step
    await tier.close()
    fill_fs(mnt)
    tier = await open_tier(root, groups, capacity_bytes=16 << 20)
    try:
        # lseek cannot tell A's 124 allocated, never written rows from punched ones: the
        # open punches them (_blanking.punch_unsure), which gives B its room
        assert row_blocks(tier) == 3 * ROW[A] == tier._index.held_nbytes
        assert await tier.write_rows(key_rows(buf, [fs_key("b", B)])) == [None]
        check_settled_rows(tier._index)
        lost = [k for k in a_keys if k not in set(tier.keys())]
        assert lost == [], (lost, tier.stats()["disk_full_evictions"])
    finally:
        await tier.close()


# Regression: tier._punch_frees, once False, does not stay False for the tier's lifetime,
# where after another tenant has twice taken what the punches gave back, a group with no key
# fails every write for good again. Any later allocation that succeeds (a growth, or a punched
# row's blocks) turns punching back on.
async def test_punching_turns_back_on_after_a_tenant_took_the_punched_space_twice(
    tmpfs, slots
) -> None:
    """Group A fills the 1 MiB tmpfs with keys. Group B, with no key, writes twice while
    another tenant takes what every punch gives back right before the growth allocates:
    both rows fail with 'enospc' (expected). The tenant leaves; A writes until the
    filesystem is full of its keys again; group C, with no key, then writes one row."""
    mnt = tmpfs(FS)
    holder: list[PunchRig] = []
    groups = {A: NB[A], B: NB[B], C: NB[C]}
    tier = await open_tier(
        mnt / "nvme", groups, capacity_bytes=16 << 20, row_io_wrapper=_punch_rig(holder)
    )
    rig = holder[0]
    buf = slots(2, SLOT)
    try:
        await fill_with_a(tier, buf)
        rig.tenant = mnt
        for i in range(2):
            got = await tier.write_rows(key_rows(buf, [fs_key(f"b{i}", B)]))
            assert error_kinds(got) == ["enospc"]
        rig.tenant = None
        for path in rig.tenant_files:  # the tenant leaves
            os.unlink(path)
        check_settled_rows(tier._index)
        before = tier.stats()["disk_full_evictions"]
        n = 0
        while tier.stats()["disk_full_evictions"] == before:  # A fills it again
            assert await tier.write_rows(key_rows(buf, [fs_key(f"again{n}", A)])) == [None]
            n += 1
            assert n < 2000
        got = await tier.write_rows(key_rows(buf, [fs_key("c", C)]))
        assert error_kinds(got) == [None], (error_kinds(got), tier._punch_frees)
    finally:
        await tier.close()


# Regression: the blocks punched for one keyless group's row are that row's: another keyless
# group's concurrent growth must not take them, failing the row with 'enospc' (a miss). Rows
# punch for room one at a time (tier._punch_lock, the growth inside it), and a row may punch
# a second round of keys when a growth tried before another row's punch took the first.
async def test_concurrent_keyless_groups_never_take_each_others_punched_space(tmpfs, slots) -> None:
    """Three times, on a fresh tier: group A fills the 1 MiB tmpfs with keys, then four
    groups with no key (rows of 8, 8, 40 and 8 KiB) write 2-4 keys each in four
    concurrent write_rows calls (no other tenant). Every row should be stored (A has
    some 120 keys to punch) and punching should stay on."""
    mnt = tmpfs(FS)
    groups = {A: NB[A], B: NB[B], C: NB[C], BIG: NB[BIG], SMALL: NB[SMALL]}
    batches = {B: 4, C: 3, BIG: 2, SMALL: 4}
    buf = slots(16, SLOT)
    kinds, frees = [], []
    for trial in range(3):
        root = mnt / f"nvme{trial}"
        tier = await open_tier(root, groups, capacity_bytes=64 << 20)
        try:
            await fill_with_a(tier, buf)
            calls, first = [], 0
            for g, n in batches.items():
                keys = [fs_key(f"k{g}-{i}", g) for i in range(n)]
                calls.append(tier.write_rows(key_rows(buf, keys, first=first)))
                first += n
            outs = await asyncio.wait_for(asyncio.gather(*calls), 30)
            kinds.append([error_kinds(o) for o in outs])
            frees.append(tier._punch_frees)
            check_settled_rows(tier._index)
        finally:
            await tier.close()
        shutil.rmtree(root)
    assert kinds == [[[None] * n for n in batches.values()]] * 3, kinds
    assert frees == [True] * 3


# ===================================================================== what holds


async def test_concurrent_keyless_groups_with_many_keys_while_reads_pin_the_oldest(
    tmpfs, slots
) -> None:
    """Group A fills the 1 MiB tmpfs with keys; reads of A's three oldest keys are held
    (pinned). Four groups with no key (rows of 40, 8, 8 and 8 KiB) then write 2-4 keys
    each, in four concurrent write_rows calls. Nothing hangs; a row fails with 'enospc'
    at most, the others are stored; the pinned keys are not evicted and read back their
    bytes; A's keys that went are its oldest unpinned ones, in LRU order; the index adds
    up; no row holding blocks lies past the filesystem; every key reads back its bytes,
    before and after a reopen."""
    mnt = tmpfs(FS)
    root = mnt / "nvme"
    holder: list[PunchRig] = []
    groups = {A: NB[A], B: NB[B], C: NB[C], BIG: NB[BIG], SMALL: NB[SMALL]}
    tier = await open_tier(root, groups, capacity_bytes=64 << 20, row_io_wrapper=_punch_rig(holder))
    rig = holder[0]
    buf = slots(20, SLOT)
    held_a = await fill_with_a(tier, buf)
    pinned = held_a[:3]
    rig.hold_reads = True
    reads = asyncio.ensure_future(tier.read_rows([(k, buf[17 + i]) for i, k in enumerate(pinned)]))
    assert await asyncio.to_thread(rig.read_held.wait, 10)
    batches = {B: 4, C: 3, BIG: 2, SMALL: 4}
    calls, first = [], 0
    for g, n in batches.items():
        calls.append(
            tier.write_rows(key_rows(buf, [fs_key(f"k{g}-{i}", g) for i in range(n)], first=first))
        )
        first += n
    outs = await asyncio.wait_for(asyncio.gather(*calls), 30)
    keys = set(tier.keys())
    assert set(pinned) <= keys  # pinned: never evicted
    assert not tier._index._pending
    rig.hold_reads = False
    rig.reads_release.set()
    got = await asyncio.wait_for(reads, 10)
    assert got == [(0, 4)] * 3
    for i, k in enumerate(pinned):
        assert bytes(buf[17 + i][: NB[A]]) == key_data(k)
    # some rows may fail with 'enospc' (see the bug above); the others are stored
    for (g, n), out in zip(batches.items(), outs, strict=True):
        assert set(error_kinds(out)) <= {None, "enospc"}, error_kinds(out)
        stored = {fs_key(f"k{g}-{i}", g) for i in range(n) if out[i] is None}
        assert stored <= keys
    lost = [k for k in held_a if k not in keys]
    assert lost == [k for k in held_a[3:] if k not in keys]
    assert lost == held_a[3 : 3 + len(lost)]  # the oldest unpinned ones
    assert tier.stats()["disk_full_evictions"] >= len(lost)
    check_settled_rows(tier._index)
    assert tier._index.held_nbytes <= FS
    snap = await fs_snapshot(tier)
    assert all(data == key_data(k) for k, data in snap.items())
    await tier.close()
    found, st = await reopened(root, groups)
    assert found == snap
    assert st["invalid_rows_at_open"] == 0


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
async def test_a_failed_punch_of_the_evicted_keys_leaves_no_key_and_the_next_round_punches_more(
    tmpfs, slots, err
) -> None:
    """Group A fills the 1 MiB tmpfs; group B, with no key, writes. The punch of the A
    keys evicted for it fails (EIO or ENOSPC from fallocate, through the handle): their
    trailers are zeroed instead (a crash now finds neither key), the failure is counted,
    the growth still fails, and a second round punches the next two keys of A: B's row
    is stored, A lost its four oldest keys, in LRU order, and the index adds up. B's next
    row reuses B's own key's row and evicts no other key of A."""
    root = tmpfs(FS) / "nvme"
    groups = {A: NB[A], B: NB[B]}
    tier, rig, buf, held_a = await _full_of_a(root, groups, slots(2, SLOT))
    rig.punch_errno, rig.punch_faults = err, 1
    got = await asyncio.wait_for(tier.write_rows(key_rows(buf, [fs_key("b0", B)])), 20)
    assert error_kinds(got) == [None]
    assert rig.punch_faults == 0
    assert tier.stats()["reclaim_failures"] == 1
    gone = [k for k in held_a if k not in set(tier.keys())]
    assert gone == held_a[: len(gone)]
    assert len(gone) == 4  # two rounds of one 8 KiB row, a header and a page
    check_settled_rows(tier._index)
    await tier.flush()
    found, _ = await reopened_copy(tier, root, groups)
    assert not set(gone) & set(found)
    got = await asyncio.wait_for(tier.write_rows(key_rows(buf, [fs_key("b1", B)])), 20)
    assert error_kinds(got) == [None]
    assert [k for k in held_a if k not in set(tier.keys())] == gone  # no other key of A
    check_settled_rows(tier._index)
    snap = await fs_snapshot(tier)
    assert all(data == key_data(k) for k, data in snap.items())
    await tier.close()
    found, _ = await reopened(root, groups)
    assert found == snap


async def test_discard_read_drain_and_close_while_the_punch_for_a_keyless_row_waits(
    tmpfs, slots
) -> None:
    """The punch of the A keys evicted for B's row is held. Meanwhile: reads of those
    keys are MISSes ('missing'), A's key read before the punch started reads its bytes,
    the B key being written is discarded, a drain and a close wait (no hang). Released:
    the write completes (its key discarded: not visible), the index adds up, and a
    reopen finds A's other keys with their bytes and neither taken key."""
    root = tmpfs(FS) / "nvme"
    groups = {A: NB[A], B: NB[B]}
    tier, rig, buf, held_a = await _full_of_a(root, groups, slots(4, SLOT))
    rig.hold_punch = True
    b = fs_key("b", B)
    write = asyncio.ensure_future(tier.write_rows(key_rows(buf, [b])))
    assert await asyncio.to_thread(rig.punch_held.wait, 10)
    taken = [k for k in held_a if k not in set(tier.keys())]
    assert taken == held_a[:2]
    got = await tier.read_rows([(k, buf[1 + i]) for i, k in enumerate(taken)])
    assert error_kinds(got) == ["missing", "missing"]  # type: ignore[arg-type]
    assert await tier.read_rows([(held_a[2], buf[3])]) == [(0, 4)]
    assert bytes(buf[3][: NB[A]]) == key_data(held_a[2])
    tier.discard(b)
    drain = asyncio.ensure_future(tier.drain())
    close = asyncio.ensure_future(tier.close())
    await asyncio.sleep(0.2)
    assert not write.done()
    assert not drain.done()
    assert not close.done()
    rig.punch_release.set()
    assert error_kinds(await asyncio.wait_for(write, 20)) == [None]
    await asyncio.wait_for(asyncio.gather(drain, close), 20)
    assert b not in set(tier.keys())
    check_settled_rows(tier._index)
    found, _ = await reopened(root, groups)
    assert set(found) == set(held_a[2:])
    assert all(found[k] == key_data(k) for k in found)


async def test_a_tenant_taking_every_punch_evicts_two_rounds_per_row_then_stops(
    tmpfs, slots
) -> None:
    """Another tenant takes whatever a punch gives back before each growth allocates:
    group B's rows fail with 'enospc' (no hang); each failed row evicts at most two
    rounds of A's keys (two 8 KiB keys each: a row, a new segment's header and a page),
    and after two such rows no more keys of A are evicted. The index adds up and every
    key of A left reads back its bytes."""
    mnt = tmpfs(FS)
    holder: list[PunchRig] = []
    groups = {A: NB[A], B: NB[B]}
    tier = await open_tier(
        mnt / "nvme", groups, capacity_bytes=16 << 20, row_io_wrapper=_punch_rig(holder)
    )
    rig = holder[0]
    buf = slots(2, SLOT)
    held_a = await fill_with_a(tier, buf)
    rig.tenant = mnt
    lost = []
    for i in range(5):
        got = await asyncio.wait_for(tier.write_rows(key_rows(buf, [fs_key(f"b{i}", B)])), 20)
        assert error_kinds(got) == ["enospc"]
        lost.append(sum(k not in set(tier.keys()) for k in held_a))
    assert lost == [4, 8, 8, 8, 8], lost
    assert tier.stats()["failures_enospc"] == 5
    check_settled_rows(tier._index)
    snap = await fs_snapshot(tier)
    assert all(data == key_data(k) for k, data in snap.items())
    await tier.close()


async def test_a_short_write_punches_its_row_and_fails_that_key_alone(tmpfs, slots) -> None:
    """A row write that comes back short (with room on the filesystem) fails that key
    alone with 'short_write'; its row is punched (held_nbytes drops by a row, and so do
    the blocks the files hold) and given back as a free punched row (a free row that
    holds blocks goes to the next write first); nothing else is lost and a reopen finds
    the same keys with their bytes."""
    mnt = tmpfs(4 << 20)
    root = mnt / "nvme"
    holder: list[PunchRig] = []
    groups = {A: NB[A]}
    tier = await open_tier(root, groups, capacity_bytes=16 << 20, grow_ahead=False,
                       row_io_wrapper=_punch_rig(holder))  # fmt: skip
    rig = holder[0]
    buf = slots(3, SLOT)
    for i in range(3):
        assert await tier.write_rows(key_rows(buf, [fs_key(i, A)])) == [None]
    held0, blocks0 = tier._index.held_nbytes, row_blocks(tier)
    bad = fs_key("short", A)
    rig.short.add(trailer_tag(bad))
    got = await tier.write_rows(key_rows(buf, [fs_key(3, A), bad]))  # one run: bad is its last row
    assert error_kinds(got) == [None, "short_write"]
    assert tier._index.held_nbytes == held0 - ROW[A]
    assert row_blocks(tier) == blocks0 - ROW[A]
    assert len(tier._index._holed) == 1
    check_settled_rows(tier._index)
    rig.short.clear()
    assert await tier.write_rows(key_rows(buf, [bad])) == [None]
    # a free row that holds its blocks goes first; the punched row waits, free, punched
    assert tier._index.held_nbytes == held0 - ROW[A]
    assert len(tier._index._holed) == 1
    assert row_blocks(tier) == blocks0 - ROW[A]
    check_settled_rows(tier._index)
    snap = await fs_snapshot(tier)
    assert set(snap) == {bad} | {fs_key(i, A) for i in range(4)}
    assert all(data == key_data(k) for k, data in snap.items())
    await tier.close()
    found, _ = await reopened(root, groups)
    assert found == snap


async def test_ext4_keyless_group_punches_keys_and_reopen_counts_the_holes_exactly(
    ext4, slots
) -> None:
    """A real ext4 loop mount filled by group A's keys and another tenant. Groups B and
    BIG, with no key, write (one row per call, then a call of 3 keys): every write
    succeeds, A's keys go in LRU order, the blocks the segment files hold (st_blocks)
    are what the index says its rows hold, and a reopen (FIEMAP) counts the same
    punched rows and finds every key with its bytes."""
    mnt = ext4(8 << 20)
    root = mnt / "nvme"
    groups = {A: NB[A], B: NB[B], BIG: NB[BIG]}
    tier = await open_tier(root, groups, capacity_bytes=64 << 20)
    buf = slots(4, SLOT)
    for i in range(40):
        assert await tier.write_rows(key_rows(buf, [fs_key(f"a{i}", A)])) == [None]
    os.sync()
    fill_fs(mnt)
    held_a = await fill_with_a(tier, buf)
    got = []
    for k in [fs_key("b0", B), fs_key("g0", BIG), fs_key("b1", B)]:
        got += await tier.write_rows(key_rows(buf, [k]))
    got += await tier.write_rows(key_rows(buf, [fs_key(f"g{i}", BIG) for i in (1, 2, 3)]))
    assert error_kinds(got) == [None] * 6
    keys = set(tier.keys())
    lost = [k for k in held_a if k not in keys]
    assert lost
    assert lost == held_a[: len(lost)]
    check_settled_rows(tier._index)
    await tier.flush()
    os.sync()
    ix = tier._index
    assert abs(row_blocks(tier) - ix.held_nbytes) <= 4096 * len(tier._segments), (
        row_blocks(tier),
        ix.held_nbytes,
    )
    held, holed = ix.held_nbytes, set(ix._holed)
    snap = await fs_snapshot(tier)
    assert all(data == key_data(k) for k, data in snap.items())
    await tier.close()
    tier = await open_tier(root, groups, capacity_bytes=64 << 20)
    try:
        assert tier._index.held_nbytes == held
        assert tier._index._holed == holed
        assert await fs_snapshot(tier) == snap
        assert tier.stats()["invalid_rows_at_open"] == 0
        got = await tier.write_rows(
            key_rows(buf, [fs_key("b2", B), fs_key("g4", BIG), fs_key("a-new", A)])
        )
        assert error_kinds(got) == [None] * 3
        check_settled_rows(tier._index)
    finally:
        await tier.close()


async def test_files_data_extents_match_the_punched_rows_on_tmpfs(tmpfs) -> None:
    """``_files.data_extents`` on a tmpfs segment-like file: rows written whole are data,
    punched rows and a row punched in part are not covered whole (holes), and so are
    rows only fallocated (the documented safe side)."""
    mnt = tmpfs(1 << 20)
    spec = files.GroupSpec(0, b"\0" * 32, 4096, 4096, 8192, 1)
    path = mnt / "seg"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"\1" * (HEADER + 6 * 8192), 0)
        os.posix_fallocate(fd, HEADER + 6 * 8192, 2 * 8192)
        assert files._punch_hole(fd, spec.row_offset(1), 8192)
        assert files._punch_hole(fd, spec.row_offset(3) + 4096, 4096)
        ext = files.data_extents(fd, os.fstat(fd).st_size)
        assert ext is not None
        assert files._rows_without_blocks(spec, 8, ext) == [1, 3, 6, 7]
    finally:
        os.close(fd)


# ====================================================================== SIGKILL


CRASH_GROUPS = {A: NB[A], B: NB[B], C: NB[C], BIG: NB[BIG]}


async def _crash_child(root: str, log_path: str) -> None:
    """On a full tiny tmpfs (group A fills it before "ready"), write rows of groups B, C and
    BIG while every key of theirs is being read (pinned, reads slowed): their rows keep
    taking A's keys (punched). Rewrites of earlier keys (a new salt), A's rows too, a
    flush now and then; each key logged before its write."""
    holder: list[PunchRig] = []
    tier = NVMeTier(**groups_kwargs(root, CRASH_GROUPS, capacity_bytes=64 << 20, grow_ahead=False,
                          row_io_wrapper=_punch_rig(holder)))  # fmt: skip
    await tier.open()
    holder[0].read_delay = 0.01
    buf = Slots(24, SLOT)
    rng = random.Random(os.getpid())
    salt: dict[OffloadKey, int] = {}
    n = 0
    with open(log_path, "a") as log:

        def logged(k: OffloadKey) -> None:
            log.write(json.dumps([k.block_hash.decode(), k.group_id, salt[k]]) + "\n")

        while tier.stats()["disk_full_evictions"] == 0:
            k = fs_key(f"{os.getpid()}-a{n}", A)
            n += 1
            salt[k] = 0
            logged(k)
            log.flush()
            await tier.write_rows(key_rows(buf, [k], salt))
        print("ready", flush=True)
        while True:
            calls = []
            for c, g in enumerate((B, C, BIG, A)):
                keys = []
                for _ in range(rng.randint(1, 3)):
                    old = [k for k in salt if k.group_id == g]
                    if old and rng.random() < 0.2:
                        k = rng.choice(old)
                        if k in keys:
                            continue
                        salt[k] += 1
                    else:
                        k = fs_key(f"{os.getpid()}-{n}", g)
                        n += 1
                        salt[k] = 0
                    keys.append(k)
                    logged(k)
                calls.append(tier.write_rows(key_rows(buf, keys, salt, first=4 * c)))
            log.flush()
            mine = [k for k in list(tier.keys()) if k.group_id != A][:8]
            reads = tier.read_rows([(k, buf[16 + i]) for i, k in enumerate(mine)])
            await asyncio.gather(reads, *calls)
            if rng.random() < 0.3:
                await tier.flush()


def test_sigkill_while_keyless_groups_punch_keys_of_another(tmpfs, tmp_path) -> None:
    """Two SIGKILLs of the child above (the same root on a 640 KiB tmpfs), each followed
    by a reopen: every key found reads back the exact bytes of one of its logged writes,
    or is a MISS; the reopened index adds up; it stores a row of every group."""
    mnt = tmpfs(640 << 10)
    root = mnt / "nvme"
    written: dict[tuple[bytes, int], set[int]] = {}
    checked = 0
    for it in range(2):
        log_path, err_path = tmp_path / f"log{it}", tmp_path / f"err{it}"
        log_path.write_text("")
        args = ["tests.reliability.test_nvme_keyless_punch", "crash", str(root), str(log_path)]
        assert kill_child(args, err_path, 1.5), err_path.read_text()[-3000:]
        for line in log_path.read_text().splitlines():
            try:
                h, g, s = json.loads(line)
            except ValueError:
                continue  # the line the kill cut
            written.setdefault((h.encode(), g), set()).add(s)

        async def check(it: int = it) -> int:
            tier = await open_tier(root, CRASH_GROUPS, capacity_bytes=64 << 20)
            try:
                check_settled_rows(tier._index)
                found = await fs_snapshot(tier)
                ok = 0
                for k, data in found.items():
                    salts = written.get((k.block_hash, k.group_id))
                    assert salts is not None, k
                    if data is not None:
                        assert any(data == key_data(k, s) for s in salts), k
                        ok += 1
                buf = Slots(1, SLOT)
                for g in CRASH_GROUPS:
                    written.setdefault((fs_key(f"x{it}", g).block_hash, g), set()).add(0)
                out = [(await tier.write_rows(key_rows(buf, [fs_key(f"x{it}", g)])))[0]
                       for g in CRASH_GROUPS]  # fmt: skip
                buf.close()
                assert error_kinds(out) == [None] * len(CRASH_GROUPS)
                return ok
            finally:
                await tier.close()

        checked += asyncio.run(check())
    assert checked > 20


if __name__ == "__main__" and sys.argv[1:2] == ["crash"]:
    asyncio.run(_crash_child(sys.argv[2], sys.argv[3]))
