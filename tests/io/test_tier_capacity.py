"""NVMeTier capacity: one LRU over the rows of all groups, lazily grown files, small filesystems."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import pathlib
import random
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvtier import OffloadKey
from kvtier.errors import StorageError
from kvtier.io import NVMeTier, RowIO
from tests.reliability._faultio import until_set

from ._child import start_child
from .conftest import GROUP_NBYTES, key, payload, tier_kwargs
from .faults import CountingRowIO

SIX = {g: 4096 * (1 + g % 3) - 100 for g in range(6)}  # rows of 8, 12 and 16 KiB
SIX_LAYOUT = {"groups": {str(g): {"layers": [f"l{g}"]} for g in range(6)}}
SIX_CAPACITY = 30 * 4096  # about 10 rows of the six groups together


def _file_nbytes(tier: NVMeTier) -> tuple[int, int, int]:
    """(apparent size, disk usage, number) of a tier's segment files."""
    files = [p.stat() for p in tier.directory.glob("g*/*.kvrows")]
    return sum(f.st_size for f in files), sum(f.st_blocks * 512 for f in files), len(files)


async def test_six_groups_share_capacity_with_one_lru(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    over: dict[str, Any] = {
        "group_nbytes": SIX,
        "layout_description": SIX_LAYOUT,
        "capacity_bytes": SIX_CAPACITY,
    }
    tier = NVMeTier(**tier_kwargs(root, **over))
    await tier.open()
    row = {g: tier.row_nbytes(g) for g in SIX}
    step = {g: max(1, SIX_CAPACITY // (4 * 6) // row[g]) * row[g] for g in SIX}  # growth steps
    rng = random.Random(11)
    phases = (
        [i % 6 for i in range(36)]  # round robin
        + [rng.choice([0, 1]) for _ in range(30)]  # the mix shifts to groups 0, 1 ...
        + [rng.choice([4, 5]) for _ in range(30)]  # ... then to 4, 5
        + [rng.randrange(6) for _ in range(40)]  # random, with reads
    )
    model: OrderedDict[OffloadKey, int] = OrderedDict()  # global LRU: key -> row bytes
    evicted = 0
    buf, out = slots(1), slots(1)
    for i, g in enumerate(phases):
        k = key(i, g)
        while sum(model.values()) + row[g] > SIX_CAPACITY:
            model.popitem(last=False)
            evicted += 1
        model[k] = row[g]
        assert await tier.write_rows([(k, 0, 4, buf.fill(0, payload(k, SIX[g])))]) == [None]
        if i >= 96 and i % 3 == 0:  # a read hit makes a key most recently used
            hit = rng.choice(list(model))
            assert await tier.read_rows([(hit, out[0])]) == [(0, 4)]
            assert bytes(out[0][: SIX[hit.group_id]]) == payload(hit, SIX[hit.group_id])
            model.move_to_end(hit)
        st = tier.stats()
        assert st["bytes_used"] == sum(model.values()) <= SIX_CAPACITY
        assert tier.keys() == sorted(model, key=lambda k: k.group_id)  # LRU order per group
        assert st["evictions"] == evicted
        await tier.drain()  # growth ahead runs in the background, next to the writes
        size, on_disk, files = _file_nbytes(tier)
        # (stats once it ended: a growth ahead first sizes itself against the free space)
        assert size == tier.stats()["bytes_allocated"] + 4096 * files
        # headers, plus one 4 KiB block per file for ext4's extent tree: st_blocks counts
        # an extent index block once a file holds more than four (written or unwritten) extents
        assert on_disk <= SIX_CAPACITY + sum(step.values()) + 2 * 4096 * files, i
        assert size <= 6 * (SIX_CAPACITY + max(step.values()) + 4096)  # holes: at most per group
    assert files == 6  # one lazily grown file per group, not six 1 MiB files
    assert evicted > 100
    await tier.flush()
    await tier.close()
    proc = start_child("dump", str(root), json.dumps(over))
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    got = json.loads(stdout)
    expect = {
        f"{k.group_id}:{k.block_hash.decode()}": [
            0,
            4,
            hashlib.sha256(payload(k, SIX[k.group_id])).hexdigest(),
        ]
        for k in model
    }
    assert got == expect  # exactly the keys not evicted, with their bytes


async def test_reopen_with_a_smaller_capacity_evicts_the_oldest(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    buf = slots(6)
    keys = [key(i, i % 3) for i in range(6)]
    rows = [
        (k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id]))) for i, k in enumerate(keys)
    ]
    for r in rows:  # one call each: the sequence numbers give the LRU order
        assert await tier.write_rows([r]) == [None]
    await tier.close()
    keep = keys[3:]
    small = sum(tier.row_nbytes(k.group_id) for k in keep)
    tier = NVMeTier(**tier_kwargs(root, capacity_bytes=small))
    await tier.open()
    assert set(tier.keys()) == set(keep)
    assert tier.stats()["bytes_used"] == small
    assert tier.stats()["evictions"] == 3
    await tier.close()  # blanks the evicted rows
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    assert set(tier.keys()) == set(keep)  # the evicted keys do not come back
    out = slots(3)
    got = await tier.read_rows([(k, out[i]) for i, k in enumerate(keep)])
    assert got == [(0, 4)] * 3
    await tier.close()


class _SlowWrites(CountingRowIO):
    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner)
        self.slow = threading.Event()
        self.writing = threading.Event()  # a slowed row write started

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        if self.slow.is_set() and sum(len(b) for b in bufs) > 4096:  # rows, not blanked trailers
            self.writing.set()
            time.sleep(0.2)
        return super().pwritev(handle, bufs, file_offset)


async def test_rows_in_flight_or_pinned_are_never_evicted(open_tier, slots) -> None:
    row = 2 * 4096  # group 1
    holder: list[_SlowWrites] = []
    tier = await open_tier(
        capacity_bytes=2 * row,
        row_io_wrapper=lambda inner: holder.append(_SlowWrites(inner)) or holder[0],
    )
    buf = slots(4)
    assert await tier.write_rows([(key(9, 1), 0, 4, buf[3])]) == [None]  # creates the segment
    tier.discard(key(9, 1))
    holder[0].slow.set()
    first = [(key(i, 1), 0, 4, buf.fill(i, payload(key(i, 1), 4096))) for i in range(2)]
    slow = asyncio.get_running_loop().create_task(tier.write_rows(first))
    await until_set(holder[0].writing, "the slowed row write never started")
    late = (key(2, 1), 0, 4, buf.fill(2, payload(key(2, 1), 4096)))
    (err,) = await tier.write_rows([late])  # both rows are in flight: no room
    assert isinstance(err, StorageError)
    assert err.kind == "capacity"
    assert await slow == [None, None]
    assert tier.stats()["failures_capacity"] == 1
    assert tier.stats()["evictions"] == 0
    # a pinned key (read in flight) is skipped; the next oldest goes
    out = slots(1)
    read = asyncio.get_running_loop().create_task(tier.read_rows([(key(0, 1), out[0])]))
    await asyncio.sleep(0)  # the read pinned key 0
    assert await tier.write_rows([late]) == [None]
    assert await read == [(0, 4)]
    assert tier.contains(key(0, 1))
    assert not tier.contains(key(1, 1))


# -- a small filesystem ---------------------------------------------------------

SMALL_FS_NBYTES = 8 << 20


class _SmallFilesystem(CountingRowIO):
    """Stand-in for a full filesystem: ENOSPC once the files would exceed a byte budget.

    A file that grows must fit, with the disk blocks the files hold (``st_blocks``:
    punched rows give theirs back), within ``limit``.
    """

    def __init__(self, inner: RowIO, limit: int = SMALL_FS_NBYTES) -> None:
        super().__init__(inner)
        self.limit = limit
        self.sizes: dict[Any, int] = {}
        self._budget = threading.Lock()

    def _held(self) -> int:
        return sum(
            os.fstat(h).st_blocks * 512 if isinstance(h, int) else size
            for h, size in self.sizes.items()
        )

    def _grow(self, handle: Any, nbytes: int) -> None:
        with self._budget:
            old = self.sizes.get(handle, 0)
            if nbytes > old and self._held() + nbytes - old > self.limit:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.sizes[handle] = max(old, nbytes)

    def allocate(self, handle: Any, nbytes: int) -> None:
        self._grow(handle, nbytes)
        self.inner.allocate(handle, nbytes)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        self._grow(handle, file_offset + sum(memoryview(b).nbytes for b in bufs))
        return super().pwritev(handle, bufs, file_offset)

    def close(self, handle: Any) -> None:
        with self._budget:
            self.sizes.pop(handle, None)
        self.inner.close(handle)


@pytest.fixture(params=["tmpfs", "rowio"])
def small_fs(request, tmp_path) -> Iterator[tuple[pathlib.Path, Any]]:
    """An 8 MiB filesystem: a real tmpfs mount (root only), or a RowIO that runs out of space.

    Yields ``(root, row_io_wrapper or None)``.
    """
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = False
    if request.param == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS_NBYTES}", "tmpfs", str(mnt)]
        if os.geteuid() == 0:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                mounted = subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
        if not mounted:
            pytest.skip("cannot mount a tmpfs here (needs root); the rowio variant covers it")
    try:
        yield mnt / "nvme", (None if mounted else _SmallFilesystem)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


async def test_small_filesystem_evicts_each_groups_oldest_keys_once_full(small_fs, slots) -> None:
    """A filesystem smaller than ``capacity_bytes``: once it is full, growth fails
    (ENOSPC) and each new row takes the row of its group's least recently used key
    (``disk_full_evictions``), so the tier goes on storing as an LRU cache within the
    space it got, rather than failing every such write with ``enospc`` and keeping its
    oldest keys for good."""
    root, wrapper = small_fs
    tier = NVMeTier(
        **tier_kwargs(root, capacity_bytes=64 << 20, row_io_wrapper=wrapper, segment_nbytes=2 << 20)
    )
    await tier.open()
    written: dict[int, list[OffloadKey]] = {0: [], 1: [], 2: []}  # per group, in write order
    buf = slots(12)
    for batch in range(60):  # 60 * 12 rows of 8..20 KiB: ~12 MiB > 8 MiB
        keys = [key(batch * 12 + j, j % 3) for j in range(12)]
        rows = [
            (k, 0, 4, buf.fill(j, payload(k, GROUP_NBYTES[k.group_id]))) for j, k in enumerate(keys)
        ]
        assert await tier.write_rows(rows) == [None] * 12
        for k in keys:
            written[k.group_id].append(k)
        await tier.flush()
    st = tier.stats()
    assert st["failures_enospc"] == 0
    assert st["disk_full_evictions"] > 100
    assert st["evictions"] == st["disk_full_evictions"]  # far below capacity_bytes
    resident = set(tier.keys())
    assert len(resident) == 720 - st["evictions"]
    for keys in written.values():  # each group keeps its most recently written keys
        n = sum(k in resident for k in keys)
        assert n > 0
        assert set(keys[len(keys) - n :]) <= resident
    assert not [p for p in tier.directory.rglob("*") if p.name.endswith(".tmp")]
    kept = sorted(resident, key=lambda k: k.block_hash)
    out = slots(len(kept))
    got = await tier.read_rows([(k, out[i]) for i, k in enumerate(kept)])
    assert got == [(0, 4)] * len(kept)
    for i, k in enumerate(kept):
        assert bytes(out[i][: GROUP_NBYTES[k.group_id]]) == payload(k, GROUP_NBYTES[k.group_id])
    await tier.close()
    tier = NVMeTier(**tier_kwargs(root, capacity_bytes=64 << 20, row_io_wrapper=wrapper))
    await tier.open()
    assert set(tier.keys()) == resident  # no evicted key comes back
    assert tier.stats()["invalid_rows_at_open"] == 0
    await tier.close()


async def test_full_filesystem_never_evicts_keys_of_the_same_call_and_grows_again(
    tmp_path, slots
) -> None:
    """A write that finds its filesystem full takes the row of its group's oldest key,
    but never one of the same ``write_rows`` call (those are not resident yet): with
    every older key of the group gone, the next row punches free rows of another group
    (group 0's growth step, which holds 4 keys) and grows, and no key of group 0 goes
    (the write does not fail with ``enospc``). Once space is free again, the group
    grows instead of evicting."""
    holder: list[_SmallFilesystem] = []

    def wrapper(inner: RowIO) -> RowIO:
        holder.append(_SmallFilesystem(inner, limit=512 << 10))
        return holder[-1]

    kw = tier_kwargs(tmp_path, row_io_wrapper=wrapper, segment_nbytes=256 << 10, grow_ahead=False)
    tier = NVMeTier(**kw)
    await tier.open()
    buf = slots(128)

    def rows(keys: list[OffloadKey]) -> list[Any]:
        return [
            (k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id]))) for i, k in enumerate(keys)
        ]

    other = [key(1000 + i, 0) for i in range(4)]
    assert await tier.write_rows(rows(other)) == [None] * 4
    n = 0
    while tier.stats()["disk_full_evictions"] == 0:  # fill group 1 until the filesystem is full
        assert await tier.write_rows(rows([key(n + i, 1) for i in range(8)])) == [None] * 8
        n += 8
        assert n < 1000
    resident = tier.keys()
    held = sum(k.group_id == 1 for k in resident)  # every row group 1 has
    assert 4 <= held < 128
    fresh = [key(5000 + i, 1) for i in range(held + 1)]
    free0 = tier._index.free_rows(0)
    assert free0 > 0  # group 0's step holds more rows than its 4 keys
    out = await tier.write_rows(rows(fresh))
    assert out == [None] * (held + 1)
    assert set(tier.keys()) == set(other) | set(fresh)  # no key of group 0 went
    assert tier._index.free_rows(0) == free0  # still free rows of group 0,
    assert set(tier._index._free[0]) & tier._index._holed  # some of them now punched
    assert tier.stats()["failures_enospc"] == 0
    # Space comes back: the group grows again instead of evicting its keys.
    holder[0].limit = 64 << 20
    evicted = tier.stats()["disk_full_evictions"]
    more = [key(9000 + i, 1) for i in range(8)]
    assert await tier.write_rows(rows(more)) == [None] * 8
    assert tier.stats()["disk_full_evictions"] == evicted
    assert set(fresh[:held]) | set(more) <= set(tier.keys())
    await tier.close()
