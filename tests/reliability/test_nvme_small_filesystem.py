"""Growth bounded by a small filesystem's free space.

A group's segments grow by a whole step (ahead of need or on
demand) only while ``statvfs`` shows ``_FREE_STEPS`` (4) such steps free, else
by one row (``_growth.claim_growth``); a growth that fails with ENOSPC or
EDQUOT while another group's growth is in flight waits for it and tries once
more (``_disk_space.on_full_disk``); growth-ahead failures log at INFO once per
group. So one group's first step does not take a whole small filesystem,
where another group, with no row and no key to take, would fail every write.

Real seams only: small real tmpfs mounts (root; the ``tmpfs`` fixture of
``test_nvme_disk_full``), a filler that fills and frees such a filesystem
from another thread the way another tenant would, the real engine, and a real
child process killed with SIGKILL
(``python -m tests.reliability.test_nvme_small_filesystem crash ROOT LOG``).

A test marked ``xfail(strict=True, reason="BUG: ...")`` proves a bug; a "Regression"
comment heads a test that guards against a bug the tier once had.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import sys
import threading

import pytest

import kvtier
from kvtier import OffloadKey
from kvtier.io import NVMeTier

from ..io.conftest import Slots
from ._faultio import kill_child
from ._model import Gpu, chunks_for, engine_config, load_check, nvme_config, store_ok
from ._model import key as model_key
from .full_fs import (
    BIG,
    MID,
    NB,
    SLOT,
    SMALL,
    A,
    B,
    error_kinds,
    fill_fs,
    free_nbytes,
    fs_key,
    fs_snapshot,
    groups_kwargs,
    key_data,
    key_rows,
    reopened,
)
from .growth_rig import GrowthRig, growth_rig, open_tier
from .row_states import check_settled_rows

C = MID
FIVE = {g: NB[g] for g in (BIG, SMALL, C, A, B)}  # rows of 40, 8, 8, 8 and 8 KiB
# capacity_bytes / (4 x 5 groups) = 640 KiB: a step of 80 rows of 8 KiB or 16 rows of 40 KiB
FIVE_CAP = 12800 << 10
FIVE_FILE = (640 + 4) << 10  # a first segment file: one step and its 4 KiB header


# =============================================================== regressions


# Regression: a group that starts writing after another group filled the filesystem with its
# KEYS (not with a growth step: every growth here is bounded by the free-space check) has no
# row and no key of its own, and capacity_bytes is not reached; it must not fail every write
# with 'enospc', for good (a reopen too). A write whose group has no key of its own to take
# punches free rows of other groups, then their least recently used keys, enough for its row,
# and grows (_disk_space.on_full_disk, RowIndex.take_for_disk); later writes of that group reuse
# its own keys' rows as every group does on a full filesystem, so a group gets as many rows
# as its largest call holds keys.
@pytest.mark.parametrize("grow_ahead", [False, True])
@pytest.mark.parametrize("per_call", [1, 8])
async def test_a_group_that_starts_after_another_filled_the_filesystem_takes_its_oldest_keys(
    tmpfs, slots, grow_ahead, per_call
) -> None:
    mnt = tmpfs((1 << 20) + 4096)
    root = mnt / "nvme"
    tier = await open_tier(
        root, {A: NB[A], B: NB[B]}, capacity_bytes=16 << 20, grow_ahead=grow_ahead
    )
    buf = slots(8, SLOT)
    a_keys = [fs_key(i, A) for i in range(140)]
    for k in a_keys:  # group A alone: about 127 rows fit, then it reuses its oldest keys
        assert await tier.write_rows(key_rows(buf, [k])) == [None]
    assert tier.stats()["disk_full_evictions"] > 0  # the filesystem is full of A's keys
    held_a = [k for k in a_keys if k in set(tier.keys())]

    async def write_b(prefix: str) -> list[OffloadKey]:
        keys = [fs_key(f"{prefix}{i}", B) for i in range(8)]
        got: list[BaseException | None] = []
        for i in range(0, 8, per_call):
            got += await tier.write_rows(key_rows(buf, keys[i : i + per_call]))
        assert error_kinds(got) == [None] * 8, error_kinds(got)  # not all 'enospc'
        return keys

    late = await write_b("b")
    keys = set(tier.keys())
    assert set(late[-per_call:]) <= keys  # the last call's keys: one row each
    lost_a = [k for k in held_a if k not in keys]
    assert lost_a
    assert lost_a == held_a[: len(lost_a)]  # A's OLDEST keys went, in LRU order
    assert tier._index.held_nbytes <= (1 << 20) + 4096  # punched rows hold no blocks
    check_settled_rows(tier._index)
    snap = await fs_snapshot(tier)
    await tier.close()
    assert all(data == key_data(k) for k, data in snap.items())
    tier = await open_tier(
        root, {A: NB[A], B: NB[B]}, capacity_bytes=16 << 20, grow_ahead=grow_ahead
    )
    assert set(tier.keys()) == keys  # the punched rows came back as free space, nothing more
    again = await write_b("c")
    assert set(again[-per_call:]) <= set(tier.keys())
    # A writes again: the rows punched for B are free rows of A, which tmpfs (no FIEMAP) does
    # not tell from rows with blocks; found at open by lseek(SEEK_DATA), they are allocated
    # before a write (else every write of A into one failed with 'short_write')
    a_new = [fs_key(f"a{i}", A) for i in range(12)]
    got = [(await tier.write_rows(key_rows(buf, [k])))[0] for k in a_new]
    assert error_kinds(got) == [None] * 12, error_kinds(got)
    assert set(a_new) <= set(tier.keys())
    check_settled_rows(tier._index)
    snap = await fs_snapshot(tier)
    await tier.close()
    assert all(data == key_data(k) for k, data in snap.items())


async def test_a_write_into_a_hole_the_index_did_not_know_of_punches_that_row(tmpfs, slots) -> None:
    """A free row that holds no blocks although the index counts it as holding them (punched
    from outside the tier here; a row punched in an earlier session on a filesystem that
    says nothing of holes at open), on a full filesystem: the write into it fails (a short
    write or ENOSPC, for that key only), and the row is punched, so that it is allocated
    before it is handed out again. Were its trailer blanked instead, that would fail with
    ENOSPC too, the row would stay "holding blocks" and every later write of the group
    would take it and fail the same way."""
    mnt = tmpfs(1 << 20)
    tier = await open_tier(mnt / "nvme", {A: NB[A]}, capacity_bytes=16 << 20)
    buf = slots(1, SLOT)
    n = 0
    while tier.stats()["disk_full_evictions"] == 0:  # the filesystem is full of A's keys
        assert await tier.write_rows(key_rows(buf, [fs_key(n, A)])) == [None]
        n += 1
        assert n < 1000
    tier.discard(fs_key(n - 1, A))  # two rows blanked by the next write, then free
    tier.discard(fs_key(n - 2, A))
    assert await tier.write_rows(key_rows(buf, [fs_key("x", A)])) == [None]  # takes one of them
    free = [r for r in tier._index._free[A] if r not in tier._index._holed]
    assert len(free) == 1  # a free row holding its blocks
    spec, ref = tier._specs[A], free[0]
    seg = os.open(tier.directory / f"g{A}" / f"{ref.segment}.kvrows", os.O_RDWR)
    try:  # another hand punches the free row; then another tenant takes the space
        libc = ctypes.CDLL(None, use_errno=True)
        punch = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        off, size = ctypes.c_int64(spec.row_offset(ref.row)), ctypes.c_int64(spec.row_nbytes)
        assert libc.fallocate(seg, punch, off, size) == 0
    finally:
        os.close(seg)
    fill_fs(mnt)
    got = [(await tier.write_rows(key_rows(buf, [fs_key(f"h{i}", A)])))[0] for i in range(6)]
    kinds = error_kinds(got)
    assert kinds[0] in ("short_write", "enospc"), kinds  # the write into the hole
    assert kinds[1:] == [None] * 5, kinds  # not the same failure, for good
    assert tier.stats()["failures_short_write"] + tier.stats()["failures_enospc"] == 1
    check_settled_rows(tier._index)
    snap = await fs_snapshot(tier)
    await tier.close()
    assert all(data == key_data(k) for k, data in snap.items())


# Regression: the free-space check counts growths of other groups in flight. Groups that grow
# at the same time (one write_rows call with a key per group, or the growth ahead that open()
# starts for every group) must not all read statvfs before any of them allocates, all see four
# steps free and all grow a whole step: with five groups on a filesystem of four steps (and
# their headers), four steps would take it all and the fifth group, with no segment, no row
# and no key to take, would fail every write with 'enospc' for good. Growths are sized one at
# a time, against the free space less what the growths sized and not yet done claimed
# (_growth.claim_growth)
@pytest.mark.parametrize("grow_ahead", [False, True])
async def test_five_groups_growing_at_once_on_four_free_steps_all_keep_storing(
    tmpfs, slots, grow_ahead
) -> None:
    mnt = tmpfs(4 * FIVE_FILE + (12 << 10))  # 8 KiB of it taken at open; four steps free
    holder: list[GrowthRig] = []
    tier = await open_tier(mnt / "nvme", FIVE, capacity_bytes=FIVE_CAP, grow_ahead=grow_ahead,
                       row_io_wrapper=growth_rig(holder))  # fmt: skip
    holder[0].alloc_delay = 0.05  # a fallocate that takes 50 ms, as on a real disk
    assert free_nbytes(mnt) >= 4 * (640 << 10)  # the check lets a whole step through
    buf = slots(len(FIVE), SLOT)
    failed = dict.fromkeys(FIVE, 0)
    for i in range(12):
        got = await tier.write_rows(key_rows(buf, [fs_key(i, g) for g in FIVE]))
        for g, r in zip(FIVE, got, strict=True):
            failed[g] += r is not None
    held = {g: sum(k.group_id == g for k in list(tier.keys())) for g in FIVE}
    segments = {g: tier._index.segments(g) for g in FIVE}
    await tier.close()
    assert all(n == 0 for n in failed.values()), (failed, segments)
    assert min(held.values()) > 0, (held, segments)


# ===================================================================== what holds


@pytest.mark.parametrize("grow_ahead", [False, True])
async def test_groups_starting_together_on_small_filesystems_all_keep_storing(
    tmpfs, slots, grow_ahead
) -> None:
    """Three and four groups of unequal rows (40 and 8 KiB) that all write from the start,
    on tmpfs mounts of one to a few growth steps: no write ever fails, every group holds
    keys once the filesystem is full, nothing is allocated past the filesystem or
    capacity_bytes, every key reads back its bytes, and a reopen of the full filesystem
    keeps every group storing (disk-full evictions of its own keys)."""
    rng = random.Random(14)
    for groups, size in (((BIG, SMALL, A), 700 << 10), ((BIG, SMALL, A, B), 2 << 20)):
        spec = {g: NB[g] for g in groups}
        mnt = tmpfs(size)
        root = mnt / "nvme"
        tier = await open_tier(root, spec, capacity_bytes=64 << 20, grow_ahead=grow_ahead)
        buf = slots(len(groups), SLOT)
        for i in range(90):
            order = rng.sample(groups, len(groups))
            got = await tier.write_rows(key_rows(buf, [fs_key(i, g) for g in order]))
            assert got == [None] * len(order), error_kinds(got)
        st = tier.stats()
        held = {g: sum(k.group_id == g for k in list(tier.keys())) for g in groups}
        assert st["disk_full_evictions"] > 0  # the filesystem filled up
        assert min(held.values()) >= 3, held
        assert tier._index.held_nbytes <= size  # rows holding blocks (punched ones do not)
        assert st["bytes_used"] <= st["capacity_bytes"]
        check_settled_rows(tier._index)
        snap = await fs_snapshot(tier)
        await tier.close()
        assert all(data == key_data(k) for k, data in snap.items())
        tier = await open_tier(root, spec, capacity_bytes=64 << 20, grow_ahead=grow_ahead)
        for i in range(20):
            got = await tier.write_rows(key_rows(buf, [fs_key(f"r{i}", g) for g in groups]))
            assert got == [None] * len(groups), error_kinds(got)
        snap = await fs_snapshot(tier)
        await tier.close()
        assert {k.group_id for k in snap} == set(groups)
        assert all(data == key_data(k) for k, data in snap.items())


async def test_concurrent_calls_while_another_tenant_fills_and_frees_the_filesystem(
    tmpfs, slots
) -> None:
    """Four groups (40 and 8 KiB rows) write one key each first, then four concurrent
    write_rows calls per round (one per group) while a thread fills the 3 MiB tmpfs to
    the last page and frees it again, three times. Nothing hangs (waiting for another
    group's growth), the only failures are 'enospc', the index adds up after every
    round, and once the space is back for good every write succeeds and grows again;
    every key reads back its bytes."""
    groups = (BIG, SMALL, A, B)
    spec = {g: NB[g] for g in groups}
    mnt = tmpfs(3 << 20)
    tier = await open_tier(mnt / "nvme", spec, capacity_bytes=32 << 20, grow_ahead=True)
    buf = slots(4 * 6, SLOT)
    for g in groups:
        assert await tier.write_rows(key_rows(buf, [fs_key("first", g)])) == [None]
    loop = asyncio.get_running_loop()
    kinds: set[str | None] = set()
    n = 0
    for cycle in range(3):
        filled = threading.Event()

        def tenant(name: str = f"filler{cycle}", done: threading.Event = filled) -> None:
            path = fill_fs(mnt, name)
            done.set()
            threading.Event().wait(0.05)
            os.unlink(path)

        job = loop.run_in_executor(None, tenant)
        for _ in range(12):
            calls = []
            for j, g in enumerate(groups):
                keys = [fs_key(n + i, g) for i in range(3)]
                n += 3
                calls.append(tier.write_rows(key_rows(buf, keys, first=6 * j)))
            outs = await asyncio.wait_for(asyncio.gather(*calls), 20)
            kinds.update(k for out in outs for k in error_kinds(out))
        await asyncio.wait_for(job, 20)
        assert filled.is_set()
        check_settled_rows(tier._index)
    assert kinds <= {None, "enospc"}, kinds
    for i in range(20):  # the space is back: every group stores again
        got = await tier.write_rows(key_rows(buf, [fs_key(f"after{i}", g) for g in groups]))
        assert got == [None] * len(groups), error_kinds(got)
    st = tier.stats()
    assert tier._index.held_nbytes <= 3 << 20  # rows holding blocks (punched ones do not)
    assert st["bytes_used"] <= st["capacity_bytes"]
    snap = await fs_snapshot(tier)
    await tier.close()
    assert {k.group_id for k in snap} == set(groups)
    assert all(data == key_data(k) for k, data in snap.items())


async def test_a_large_filesystem_grows_by_whole_steps_even_with_a_huge_capacity(
    tmp_path, slots
) -> None:
    """capacity_bytes of 1 TiB on the ordinary test filesystem (far above its free
    space): the step is bounded by segment_nbytes (1 MiB), so the free-space check lets
    whole steps through: 300 keys per group grow each group by three whole steps of 127
    rows (381 rows; growths of one row would have allocated 300)."""
    if free_nbytes(tmp_path) < 64 << 20:
        pytest.skip("the test filesystem has under 64 MiB free")
    groups = {A: NB[A], B: NB[B]}
    tier = await open_tier(tmp_path / "nvme", groups, capacity_bytes=1 << 40, grow_ahead=False)
    buf = slots(10, SLOT)
    for i in range(0, 300, 10):
        for g in groups:
            got = await tier.write_rows(key_rows(buf, [fs_key(i + j, g) for j in range(10)]))
            assert got == [None] * 10
    segs = {g: tier._index.segments(g) for g in groups}
    await tier.close()
    for g in groups:
        assert sorted(segs[g].values()) == [(127, 127)] * 3, segs


async def test_engine_with_two_groups_on_a_small_tmpfs_serves_both(tmpfs) -> None:
    """A TransferEngine (write-through) whose NVMe tier sits on a 1 MiB tmpfs (capacity_bytes
    64 MiB: a step of 8 MiB would be the whole filesystem eight times): both groups store
    from the start; both groups' keys reach NVMe, no NVMe write fails, and every key on
    NVMe loads its exact bytes after its CPU copy was evicted."""
    mnt = tmpfs(1 << 20)
    gpu = Gpu(num_blocks=256)
    nv = nvme_config(mnt / "root", capacity_bytes=64 << 20, segment_nbytes=4 << 20)
    keys = [model_key(f"s{i}", i % 2) for i in range(240)]
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 16, nv)) as engine:
        tier = engine._nvme
        assert tier is not None
        for b in range(0, len(keys), 4):
            await store_ok(engine, gpu, chunks_for(keys[b : b + 4]))
            await engine.flush()
        nv_stats = engine.stats().nvme
        on_nvme = [k for k in keys if k in set(tier.keys())]
        res = await load_check(engine, gpu, chunks_for(on_nvme[-8:]))
    assert {k.group_id for k in on_nvme} == {0, 1}
    assert nv_stats["disk_full_evictions"] > 0
    assert not [k for k, v in nv_stats.items() if k.startswith("failures_") and v], nv_stats
    assert len(res.loaded) == len(on_nvme[-8:])


# ====================================================================== SIGKILL


CRASH_GROUPS = {g: NB[g] for g in (BIG, SMALL, A)}


async def _crash_child(root: str, log_path: str) -> None:
    """Write forever into a tier of three groups on a full tiny tmpfs: three concurrent
    write_rows calls per round, rewrites of earlier keys (a new salt), a flush now and then;
    log each key before its write."""
    tier = NVMeTier(**groups_kwargs(root, CRASH_GROUPS, capacity_bytes=64 << 20, grow_ahead=True))
    await tier.open()
    buf = Slots(12, SLOT)
    rng = random.Random(os.getpid())
    salt: dict[OffloadKey, int] = {}
    n = 0
    with open(log_path, "a") as log:
        print("ready", flush=True)
        while True:
            calls, taken = [], set()
            for c in range(3):
                keys = []
                for _ in range(rng.randint(1, 4)):
                    if salt and rng.random() < 0.2:
                        k = rng.choice(list(salt))
                        if k in taken:
                            continue
                        salt[k] += 1
                    else:
                        k = fs_key(f"{os.getpid()}-{n}", rng.choice(list(CRASH_GROUPS)))
                        n += 1
                        salt[k] = 0
                    keys.append(k)
                    taken.add(k)
                    log.write(json.dumps([k.block_hash.decode(), k.group_id, salt[k]]) + "\n")
                calls.append(tier.write_rows(key_rows(buf, keys, salt, first=4 * c)))
            log.flush()
            await asyncio.gather(*calls)
            if rng.random() < 0.3:
                await tier.flush()


def test_sigkill_while_three_groups_write_on_a_tiny_tmpfs(tmpfs, tmp_path) -> None:
    """Two SIGKILLs of the child above (the same root on a 640 KiB tmpfs), then a reopen:
    every key found reads back the exact bytes of one of its logged writes, or is not
    found at all (a MISS); each reopen still stores a key of every group."""
    mnt = tmpfs(640 << 10)
    root = mnt / "nvme"
    written: dict[tuple[bytes, int], set[int]] = {}
    checked = 0
    for it in range(2):
        log_path, err_path = tmp_path / f"log{it}", tmp_path / f"err{it}"
        log_path.write_text("")
        args = ["tests.reliability.test_nvme_small_filesystem", "crash", str(root), str(log_path)]
        assert kill_child(args, err_path, 1.2), err_path.read_text()[-3000:]
        for line in log_path.read_text().splitlines():
            try:
                h, g, s = json.loads(line)
            except ValueError:
                continue  # the line the kill cut
            written.setdefault((h.encode(), g), set()).add(s)
        found, _ = asyncio.run(reopened(root, CRASH_GROUPS))
        for k, data in found.items():
            salts = written.get((k.block_hash, k.group_id))
            assert salts is not None, k
            if data is not None:
                assert any(data == key_data(k, s) for s in salts), k
                checked += 1

        async def store_each(it: int = it) -> list[str | None]:
            tier = await open_tier(root, CRASH_GROUPS, capacity_bytes=64 << 20)
            try:
                buf = Slots(1, SLOT)
                out = [(await tier.write_rows(key_rows(buf, [fs_key(f"x{it}", g)])))[0]
                       for g in CRASH_GROUPS]  # fmt: skip
                buf.close()
                return error_kinds(out)
            finally:
                await tier.close()

        assert asyncio.run(store_each()) == [None] * len(CRASH_GROUPS)
    assert checked > 20


if __name__ == "__main__" and sys.argv[1:2] == ["crash"]:
    asyncio.run(_crash_child(sys.argv[2], sys.argv[3]))
