"""The punch lock and rows found by lseek.

A write whose group has no key
of its own to take when its segments cannot grow (ENOSPC below
``capacity_bytes``) punches rows of other groups for one row under a tier-wide
``asyncio.Lock`` (``tier._punch_lock``, taken while the group's segment lock is
held, ``_disk_space.on_full_disk`` -> ``_disk_space._punch_for_row``): up to four
rounds of their free rows (``RowIndex.take_for_disk(keys=False, skip=...)``),
each followed by a one-row
growth (``_growth.grow_row``), then up to two rounds of their least recently used
keys. Once the filesystem was seen full (``tier._disk_was_full``) every
on-demand allocation (``_writes._allocate``: fill a punched row, or grow)
runs under that lock too. Background growth ahead (``_growth._grow_ahead``) does not.
At open, rows the extents do not cover whole count as punched; where FIEMAP is
not answered (tmpfs) ``lseek(SEEK_DATA)`` finds them, and the free rows it
cannot vouch for are punched at open (``_blanking.punch_unsure``).

Beyond ``test_nvme_keyless_punch.py``, these tests look at hangs between the
punch lock, segment locks, growth ahead, growth futures (``tier._growing``),
reads, discards, flushes, ``drain`` and ``close`` with many groups on a full
tmpfs and a full ext4 whose other tenant frees and takes space; an EIO of the
growth inside a punch round; an EIO of the trailer write after a failed punch;
the block accounting of "unsure" rows after a reopen; and SIGKILL of a child
process (``python -m tests.reliability.test_nvme_punch_lock crash ROOT LOG``)
while keyless groups punch with growth ahead on.

Real seams only: small real tmpfs and ext4 loop mounts (root only; skipped
elsewhere), another tenant that fills and frees the filesystem from the test,
``row_io_wrapper`` RowIO wrappers (the ``PunchRig`` of test_nvme_keyless_punch.py: wrapped segment
handles whose ``fd`` fails when ``_files._punch_hole`` asks for it; here also
an EIO of the growth after a punch, and of blanking trailer writes), and a
real child process killed with SIGKILL. Every wait is bounded
(``asyncio.wait_for``): a hang fails the test.

A test marked ``xfail(strict=True, reason="BUG: ...")`` proves a bug; a "Regression"
comment heads a test that guards against a bug the tier once had.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import os
import pathlib
import random
import sys
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from kvtier import OffloadKey
from kvtier.io import NVMeTier, RowIO

from ..io.conftest import Slots
from ._faultio import kill_child, rig_factory
from .full_fs import (
    BIG,
    MID,
    NB,
    ROW,
    SLOT,
    SMALL,
    TRAILER,
    A,
    B,
    error_kinds,
    fs_key,
    fs_snapshot,
    groups_kwargs,
    key_data,
    key_rows,
    reopened,
)
from .growth_rig import FS, PunchRig, fill_with_a, open_tier, reopened_copy, row_blocks
from .row_states import check_settled_rows

C = MID
ALL = {A: NB[A], B: NB[B], C: NB[C], BIG: NB[BIG], SMALL: NB[SMALL]}


class _Tenant:
    """Another tenant of the filesystem: files of 64 KiB chunks that fill it, or leave."""

    def __init__(self, mnt: pathlib.Path) -> None:
        self.mnt = mnt
        self.files: list[pathlib.Path] = []
        self.n = 0

    def fill(self) -> None:
        while True:
            path = self.mnt / f"tenant{self.n}"
            self.n += 1
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            self.files.append(path)
            try:
                for _ in range(16):
                    os.write(fd, b"\x5a" * 4096)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return
            finally:
                os.close(fd)

    def leave(self, n: int) -> None:
        for _ in range(min(n, len(self.files))):
            self.files.pop(random.randrange(len(self.files))).unlink()


class _EioRig(PunchRig):
    """The ``PunchRig`` rig, plus: ``grow_eio``: the next growth (``allocate``) after a punch
    fails with EIO; ``trailer_faults``: blanking trailer writes that fail with EIO."""

    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner)
        self.grow_eio = False
        self.grow_failed = 0
        self.trailer_faults = 0

    def allocate(self, handle: Any, nbytes: int) -> None:
        if self.grow_eio and self.punches:
            self.grow_eio = False
            self.grow_failed += 1
            raise OSError(errno.EIO, "injected EIO of a growth after a punch")
        super().allocate(handle, nbytes)

    def pwritev(self, handle: Any, bufs: Any, file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        if nbytes == TRAILER and file_offset > 0 and self.trailer_faults:
            self.trailer_faults -= 1
            raise OSError(errno.EIO, "injected EIO of a blanking trailer write")
        return super().pwritev(handle, bufs, file_offset)


def _eio_rig(holder: list[_EioRig]) -> Any:
    return rig_factory(_EioRig, holder)


def _check_found(
    found: Mapping[OffloadKey, bytes | None], written: Mapping[OffloadKey, set[int]]
) -> int:
    """Every key found was written and reads back the bytes of one of its writes."""
    ok = 0
    for k, data in found.items():
        assert k in written, k
        if data is not None:
            assert any(data == key_data(k, s) for s in written[k]), k
            ok += 1
    return ok


async def _open_with_eio_rig(
    root: pathlib.Path, groups: dict[int, int]
) -> tuple[NVMeTier, _EioRig]:
    """A tier (capacity_bytes 16 MiB) with the ``_EioRig`` rig; the rig."""
    holder: list[_EioRig] = []
    tier = await open_tier(root, groups, capacity_bytes=16 << 20, row_io_wrapper=_eio_rig(holder))
    return tier, holder[0]


def _call_keys(
    rng: random.Random,
    salt: dict[OffloadKey, int],
    g: int,
    rewrite: float,
    fresh: Callable[[int], OffloadKey],
) -> list[OffloadKey]:
    """One to three keys of group ``g`` for one write_rows call, none twice.

    Each is, with probability ``rewrite``, a key written before (its salt
    bumped: new bytes), else ``fresh(g)``, a new key whose salt it records.
    """
    keys: list[OffloadKey] = []
    for _ in range(rng.randint(1, 3)):
        old = [k for k in salt if k.group_id == g and k not in keys]
        if old and rng.random() < rewrite:
            k = rng.choice(old)
            salt[k] += 1
        else:
            k = fresh(g)
        keys.append(k)
    return keys


# =============================================================== regressions


# Regression: after a reopen on tmpfs, RowIndex.rebuild counts the fallocated but never
# written free rows that _files.data_extents (lseek SEEK_DATA) reports as holes as punched;
# held_nbytes must not then leave out blocks the files hold (take_to_punch skipping them and
# over_budget never seeing them, the segment files would hold more than disk_budget_nbytes
# for good). The open punches those free rows (_blanking.punch_unsure), so the count is exact.
async def test_after_a_reopen_on_tmpfs_the_files_hold_no_more_than_the_disk_budget(
    tmpfs, slots
) -> None:
    """A roomy tmpfs, capacity_bytes 1 MiB, two groups of 8 KiB rows (steps of 16 rows),
    growth ahead on. First open: group A writes 9 keys (it grew ahead to 32 rows; B grew
    its first step at open). Second open (39 unwritten rows count as punched): group B
    writes 300 keys. The blocks the segment files hold (st_blocks) should stay
    within the disk budget, as ``held_nbytes`` says they do, and stay so after a reopen."""
    mnt = tmpfs(32 << 20)
    root = mnt / "nvme"
    groups = {A: NB[A], B: NB[B]}
    cap = 1 << 20
    tier = await open_tier(root, groups, capacity_bytes=cap, grow_ahead=True)
    buf = slots(2, SLOT)
    for i in range(9):
        assert await tier.write_rows(key_rows(buf, [fs_key(i, A)])) == [None]
    await asyncio.wait_for(tier.drain(), 20)
    assert row_blocks(tier) <= tier._index.disk_budget_nbytes
    await tier.close()
    tier = await open_tier(root, groups, capacity_bytes=cap, grow_ahead=True)
    try:
        assert row_blocks(tier) == tier._index.held_nbytes  # the open punched the rest
        for i in range(300):
            assert await tier.write_rows(key_rows(buf, [fs_key(f"b{i}", B)])) == [None]
        await asyncio.wait_for(tier.drain(), 20)
        ix = tier._index
        assert ix.held_nbytes <= ix.disk_budget_nbytes  # what the index believes
        real = row_blocks(tier)
        assert real <= ix.disk_budget_nbytes, (real, ix.held_nbytes, ix.disk_budget_nbytes)
    finally:
        await tier.close()


# ===================================================================== what holds


@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
async def test_many_groups_with_growth_ahead_on_a_filling_and_freeing_filesystem_never_hang(
    request, slots, fs
) -> None:
    """Five groups (rows of 8, 8, 8, 40 and 8 KiB), steps of a few rows (capacity_bytes
    1 MiB): group A writes 40 keys, another tenant fills the filesystem, and the tier is
    reopened with growth ahead on (the other groups have no row: it fails for them at
    open, so their first rows punch A's rows for room). Then 14 rounds, each one gather
    under a 60 s bound: a write_rows call per group (new keys and rewrites), reads of
    resident keys (pins), a discard, a flush now and then, while the tenant frees some of
    its chunks (so growth ahead and on-demand growth run) or fills again. Nothing hangs
    (nor drain, nor close); rows fail with 'enospc' at most; every read and every key a
    snapshot or a reopen finds has the bytes of one of its writes; the index adds up, and
    a reopen finds the snapshot taken before close."""
    mnt = request.getfixturevalue(fs)(2 << 20 if fs == "tmpfs" else 8 << 20)
    root = mnt / "nvme"
    rng = random.Random(16)
    tier = await open_tier(root, ALL, capacity_bytes=1 << 20)
    buf = slots(40, SLOT)
    written: dict[OffloadKey, set[int]] = {}
    salt: dict[OffloadKey, int] = {}

    def new(name: str, g: int) -> OffloadKey:
        k = fs_key(name, g)
        salt[k] = 0
        written.setdefault(k, set()).add(0)
        return k

    tenant = _Tenant(mnt)
    try:
        for i in range(40):
            k = new(f"a{i}", A)
            assert await tier.write_rows(key_rows(buf, [k], salt)) == [None]
        await tier.close()
        tenant.fill()
        tier = await open_tier(root, ALL, capacity_bytes=1 << 20, grow_ahead=True)
        assert all(not tier._index.segments(g) for g in ALL if g != A)  # keyless, no rows
        kinds: list[str | None] = []
        names = itertools.count()
        for rnd in range(14):
            calls = []
            for c, g in enumerate(ALL):
                keys = _call_keys(rng, salt, g, 0.25, lambda g: new(f"r{next(names)}", g))
                for k in keys:
                    written[k].add(salt[k])
                calls.append(tier.write_rows(key_rows(buf, keys, salt, first=4 * c)))
            resident = list(tier.keys())
            reads = rng.sample(resident, min(6, len(resident)))
            read = tier.read_rows([(k, buf[24 + i]) for i, k in enumerate(reads)])
            if resident and rng.random() < 0.5:
                tier.discard(rng.choice(resident))
            extra = [tier.flush()] if rnd % 3 == 0 else []
            if rnd % 2:
                tenant.leave(rng.randint(1, 4))
            else:
                tenant.fill()
            outs = await asyncio.wait_for(asyncio.gather(read, *calls, *extra), 60)
            for i, (k, got) in enumerate(zip(reads, outs[0], strict=True)):
                if got == (0, 4):
                    data = bytes(buf[24 + i][: NB[k.group_id]])
                    assert any(data == key_data(k, s) for s in written[k]), k
                else:
                    assert error_kinds([got])[0] == "missing", got  # discarded or evicted
            for out in outs[1 : 1 + len(ALL)]:
                kinds += error_kinds(out)
        assert set(kinds) <= {None, "enospc"}, kinds
        assert kinds.count(None) > len(kinds) // 2, kinds
        await asyncio.wait_for(tier.drain(), 30)
        check_settled_rows(tier._index)
        snap = await asyncio.wait_for(fs_snapshot(tier), 30)
        assert _check_found(snap, written) == len(snap)
        assert {k.group_id for k in snap} == set(ALL)  # every group stored rows
    finally:
        await asyncio.wait_for(tier.close(), 30)
    found, st = await asyncio.wait_for(reopened(root, ALL), 30)
    assert found == snap
    assert st["invalid_rows_at_open"] == 0


async def test_an_eio_of_the_growth_inside_a_punch_round_stops_the_rounds(tmpfs, slots) -> None:
    """Group A fills the 1 MiB tmpfs with keys; group B, with no key, writes: the growth
    after the first key round's punch fails with EIO. The rounds stop there (no hang): B's
    key fails with 'eio', A lost the two keys of that round alone (its oldest),
    the row does not count as a punch that gave no room, no segment file of B is left,
    and the index adds up. The fault gone, B's next row punches again and is stored; a
    reopen finds every key left with its bytes."""
    root = tmpfs(FS) / "nvme"
    groups = {A: NB[A], B: NB[B]}
    tier, rig = await _open_with_eio_rig(root, groups)
    buf = slots(2, SLOT)
    try:
        held_a = await fill_with_a(tier, buf)
        rig.grow_eio = True
        got = await asyncio.wait_for(tier.write_rows(key_rows(buf, [fs_key("b0", B)])), 20)
        assert rig.grow_failed == 1
        assert error_kinds(got) == ["eio"]  # the growth's own error, not the first one's (enospc)
        gone = [k for k in held_a if k not in set(tier.keys())]
        assert gone == held_a[:2]
        assert tier._punch_misses == 0
        assert tier._punch_frees
        assert not list(tier.directory.glob(f"g{B}/*"))  # no segment file, no temp file
        check_settled_rows(tier._index)
        got = await asyncio.wait_for(tier.write_rows(key_rows(buf, [fs_key("b1", B)])), 20)
        assert error_kinds(got) == [None]
        check_settled_rows(tier._index)
        snap = await fs_snapshot(tier)
        assert all(data == key_data(k) for k, data in snap.items())
        assert fs_key("b1", B) in snap
    finally:
        await tier.close()
    found, _ = await reopened(root, groups)
    assert found == snap


async def test_an_eio_of_the_trailer_write_after_a_failed_punch_never_gives_wrong_bytes(
    tmpfs, slots
) -> None:
    """Group A fills the 1 MiB tmpfs; group B, with no key, writes. The punch of the two
    A keys evicted for it fails (EIO) and so does the zeroing of the first one's trailer:
    the blanking failure is counted, both rows count as holding blocks, and a second
    round punches the next two keys: B's row is stored. What a crash would leave (a copy
    of the live folder) and a reopen after close find only keys with their own bytes (an
    evicted key whose row could not be blanked may come back, documented), no more valid
    rows than the filesystem could hold, and A's next rows reuse the rows that kept their
    blocks."""
    root = tmpfs(FS) / "nvme"
    groups = {A: NB[A], B: NB[B]}
    tier, rig = await _open_with_eio_rig(root, groups)
    buf = slots(2, SLOT)
    written = {}
    try:
        held_a = await fill_with_a(tier, buf)
        written = {k: {0} for k in held_a}
        rig.punch_faults, rig.trailer_faults = 1, 1
        b = fs_key("b0", B)
        written[b] = {0}
        got = await asyncio.wait_for(tier.write_rows(key_rows(buf, [b])), 20)
        assert error_kinds(got) == [None]
        assert rig.trailer_faults == 0
        assert rig.punch_faults == 0
        assert tier.stats()["reclaim_failures"] == 1
        gone = [k for k in held_a if k not in set(tier.keys())]
        assert gone == held_a[:4]
        check_settled_rows(tier._index)
        found, _ = await reopened_copy(tier, root, groups)
        assert _check_found(found, written) == len(found)
        assert b in found
        for i in range(3):
            k = fs_key(f"again{i}", A)
            written[k] = {0}
            assert await asyncio.wait_for(tier.write_rows(key_rows(buf, [k])), 20) == [None]
        check_settled_rows(tier._index)
        snap = await fs_snapshot(tier)
        assert _check_found(snap, written) == len(snap)
    finally:
        await tier.close()
    found, st = await reopened(root, groups)
    assert found == snap
    assert st["invalid_rows_at_open"] == 0


async def test_a_keyless_row_waiting_on_the_punch_lock_while_growth_ahead_holds_segments(
    tmpfs, slots
) -> None:
    """Group A fills the 1 MiB tmpfs; the punch for group B's row is held (so B holds its
    segment lock and the punch lock). Meanwhile group C (keyless too) and group A write
    (their allocations wait on the punch lock, growth ahead of every group is asked for),
    a flush and a drain start. Released, everything completes within its bound: B's row
    is stored, C's row is stored or fails with 'enospc', A's rows are stored; the index
    adds up; a reopen finds the snapshot."""
    mnt = tmpfs(FS)
    root = mnt / "nvme"
    holder: list[_EioRig] = []
    groups = {A: NB[A], B: NB[B], C: NB[C]}
    tier = await open_tier(
        root, groups, capacity_bytes=16 << 20, grow_ahead=True, row_io_wrapper=_eio_rig(holder)
    )
    rig = holder[0]
    buf = slots(8, SLOT)
    try:
        await fill_with_a(tier, buf)
        rig.hold_punch = True
        wb = asyncio.ensure_future(tier.write_rows(key_rows(buf, [fs_key("b", B)])))
        assert await asyncio.to_thread(rig.punch_held.wait, 10)
        assert tier._punch_lock.locked()
        wc = asyncio.ensure_future(tier.write_rows(key_rows(buf, [fs_key("c", C)], first=1)))
        wa = asyncio.ensure_future(
            tier.write_rows(key_rows(buf, [fs_key(f"late{i}", A) for i in range(3)], first=2))
        )
        flush = asyncio.ensure_future(tier.flush())
        drain = asyncio.ensure_future(tier.drain())
        await asyncio.sleep(0.3)
        assert not wb.done()
        assert not drain.done()
        rig.punch_release.set()
        gb, gc, ga = await asyncio.wait_for(asyncio.gather(wb, wc, wa), 30)
        await asyncio.wait_for(asyncio.gather(flush, drain), 30)
        assert error_kinds(gb) == [None]
        assert error_kinds(gc)[0] in (None, "enospc")
        assert error_kinds(ga) == [None] * 3
        check_settled_rows(tier._index)
        snap = await fs_snapshot(tier)
        assert all(data == key_data(k) for k, data in snap.items())
    finally:
        await asyncio.wait_for(tier.close(), 30)
    found, _ = await reopened(root, groups)
    assert found == snap


# ====================================================================== SIGKILL


CRASH_GROUPS = ALL


async def _crash_child(root: str, log_path: str) -> None:
    """On a tiny tmpfs (capacity_bytes 1 MiB: steps of 6 rows of 8 KiB): group A fills
    it (first run: the other groups have no row), the tier is reopened with growth ahead
    on, then rounds of concurrent writes of every group (new keys and rewrites; keyless
    groups punch A's rows), reads of resident keys, a discard and a flush now and then;
    each key logged (with its salt) before its write."""
    tier = NVMeTier(**groups_kwargs(root, CRASH_GROUPS, capacity_bytes=1 << 20, grow_ahead=False))
    await tier.open()
    buf = Slots(40, SLOT)
    rng = random.Random(os.getpid())
    salt: dict[OffloadKey, int] = {}
    n = 0
    with open(log_path, "a") as log:

        def logged(k: OffloadKey) -> None:
            log.write(json.dumps([k.block_hash.decode(), k.group_id, salt[k]]) + "\n")

        def fresh(g: int) -> OffloadKey:
            nonlocal n
            k = fs_key(f"{os.getpid()}-{n}", g)
            n += 1
            salt[k] = 0
            return k

        while tier.stats()["disk_full_evictions"] == 0:
            k = fs_key(f"{os.getpid()}-a{n}", A)
            n += 1
            salt[k] = 0
            logged(k)
            log.flush()
            await tier.write_rows(key_rows(buf, [k], salt))
        await tier.close()  # reopened full: growth ahead of the other groups fails at open
        tier = NVMeTier(
            **groups_kwargs(root, CRASH_GROUPS, capacity_bytes=1 << 20, grow_ahead=True)
        )
        await tier.open()
        print("ready", flush=True)
        while True:
            calls = []
            for c, g in enumerate(CRASH_GROUPS):
                keys = _call_keys(rng, salt, g, 0.2, fresh)
                for k in keys:
                    logged(k)
                calls.append(tier.write_rows(key_rows(buf, keys, salt, first=4 * c)))
            log.flush()
            mine = list(tier.keys())[:8]
            reads = tier.read_rows([(k, buf[24 + i]) for i, k in enumerate(mine)])
            if mine and rng.random() < 0.3:
                tier.discard(rng.choice(mine))
            await asyncio.gather(reads, *calls)
            if rng.random() < 0.3:
                await tier.flush()


def test_sigkill_while_keyless_groups_punch_with_growth_ahead(tmpfs, tmp_path) -> None:
    """Three SIGKILLs of the child above (the same root on a 640 KiB tmpfs), each followed
    by a reopen: every key found reads back the exact bytes of one of its logged writes,
    or is a MISS; the valid rows found fit the filesystem; the reopened index adds up and
    every group stores a row."""
    mnt = tmpfs(640 << 10)
    root = mnt / "nvme"
    written: dict[OffloadKey, set[int]] = {}
    checked = 0
    for it in range(3):
        log_path, err_path = tmp_path / f"log{it}", tmp_path / f"err{it}"
        log_path.write_text("")
        args = ["tests.reliability.test_nvme_punch_lock", "crash", str(root), str(log_path)]
        assert kill_child(args, err_path, 1.5), err_path.read_text()[-3000:]
        for line in log_path.read_text().splitlines():
            try:
                h, g, s = json.loads(line)
            except ValueError:
                continue  # the line the kill cut
            written.setdefault(OffloadKey(h.encode(), g), set()).add(s)

        async def check(it: int = it) -> int:
            tier = await open_tier(root, CRASH_GROUPS, capacity_bytes=1 << 20)
            try:
                check_settled_rows(tier._index)
                found = await asyncio.wait_for(fs_snapshot(tier), 30)
                ok = _check_found(found, written)
                valid = sum(ROW[k.group_id] for k, d in found.items() if d is not None)
                assert valid <= 640 << 10
                buf = Slots(1, SLOT)
                out = []
                for g in CRASH_GROUPS:
                    k = fs_key(f"x{it}", g)
                    written.setdefault(k, set()).add(0)
                    out += await asyncio.wait_for(tier.write_rows(key_rows(buf, [k])), 20)
                buf.close()
                assert error_kinds(out) == [None] * len(CRASH_GROUPS)
                return ok
            finally:
                await asyncio.wait_for(tier.close(), 30)

        checked += asyncio.run(check())
    assert checked > 20


if __name__ == "__main__" and sys.argv[1:2] == ["crash"]:
    asyncio.run(_crash_child(sys.argv[2], sys.argv[3]))
