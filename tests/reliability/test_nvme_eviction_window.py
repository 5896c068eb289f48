"""The NVMe tier's eviction window.

A full tier evicts the least recently used key of the writer's own group,
instead of the least recently used key, when that key is among the first
``window = min(eviction_window, len(lru) // 32)`` evictable keys, and hands
its row to the writer, who overwrites it in place; a write batch publishes
its keys in call order; ``kvtier bench``'s full-tier leg checks only the new
keys still on NVMe and reloads the others from the fresh-tier leg's tier.

Faults only through ``row_io_wrapper`` (RowIO wrappers) and real subprocesses
(``python -m tests.reliability.test_nvme_eviction_window crash ROOT LOG KNOWN`` runs
a child that writes forever until the test SIGKILLs it). The existing suites
fill tiers of fewer than 64 keys almost everywhere, where the window collapses
to strict LRU: the tests here use 64 keys and more.

A test marked ``xfail(strict=True, reason="BUG: ...")`` proves a bug; a test headed
"Regression" guards against a bug the tier once had.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import pathlib
import random
import sys
import threading
from collections.abc import Sequence
from typing import Any

import pytest

import kvtier
from kvtier import OffloadKey
from kvtier.errors import ConfigError, StorageError
from kvtier.io import NVMeTier, RowIO
from kvtier.io._index import RowIndex, RowRef

from ..cli.cli_runs import bench_fails
from ..io.conftest import GROUP_NBYTES, Slots, key, payload, tier_kwargs
from ..io.faults import DelegatingRowIO
from ._faultio import kill_child, rig_factory, until_set
from ._model import Gpu, chunks_for, engine_config, load_check, nvme_config, store_ok
from ._model import key as model_key
from .gated_io import read_payload, visible_payloads
from .row_states import check_row_states

TRAILER = 4096
ROW = {g: -(-n // 4096) * 4096 + TRAILER for g, n in GROUP_NBYTES.items()}  # 20480, 8192, 16384


# ====================================================================== helpers


def _tag(k: OffloadKey) -> bytes:
    """What a row's trailer holds of its key: the hash, zero padded (no prefix matches)."""
    return k.block_hash + b"\0"


class _Rig(DelegatingRowIO):
    """Real I/O; fails or holds the row writes whose trailer names a key; holds row reads.

    A row buffer handed to ``pwritev`` is a whole row with its sealed trailer
    in its last 4 KiB, so the key a write is for can be read from it.
    """

    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner)
        self.fail: set[bytes] = set()  # tags: EIO, nothing written
        self.hold: set[bytes] = set()  # tags: the first such write waits for ``release``
        self.release = threading.Event()
        self.held = threading.Event()
        self.hold_reads = False
        self.reads_release = threading.Event()
        self.read_held = threading.Event()
        self.blanked = 0  # 4 KiB writes past a header: trailers zeroed
        self._lock = threading.Lock()

    def _trailers(self, bufs: Sequence[memoryview]) -> list[bytes]:
        out = []
        for b in bufs:
            mv = memoryview(b)
            if mv.nbytes > TRAILER:
                out.append(bytes(mv[mv.nbytes - TRAILER : mv.nbytes - TRAILER + 160]))
        return out

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        if nbytes == TRAILER and file_offset > 0:
            with self._lock:
                self.blanked += 1
        trailers = self._trailers(bufs)
        if any(tag in t for tag in self.fail for t in trailers):
            raise OSError(errno.EIO, "injected EIO on a row write")
        hit = [tag for tag in list(self.hold) if any(tag in t for t in trailers)]
        if hit:
            self.hold.difference_update(hit)
            self.held.set()
            assert self.release.wait(30)
        return self.inner.pwritev(handle, bufs, file_offset)

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        if self.hold_reads and sum(memoryview(b).nbytes for b in bufs) > TRAILER:
            self.read_held.set()
            assert self.reads_release.wait(30)
        return self.inner.preadv(handle, bufs, file_offset)


def _rigged(holder: list[_Rig]) -> Any:
    return rig_factory(_Rig, holder)


async def _write_all(tier: NVMeTier, buf: Slots, keys: Sequence[OffloadKey], salt: int = 0) -> None:
    """Write ``keys`` in calls of 8 (mixed groups in a call), then flush."""
    for b in range(0, len(keys), 8):
        part = keys[b : b + 8]
        rows = [
            (k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id], salt)))
            for i, k in enumerate(part)
        ]
        assert await tier.write_rows(rows) == [None] * len(part)
    await tier.flush()


async def _write(tier: NVMeTier, buf: Slots, k: OffloadKey, salt: int = 0, i: int = 0) -> Any:
    return await tier.write_rows(
        [(k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id], salt)))]
    )


async def _reopened(root: pathlib.Path, **over: Any) -> tuple[dict[OffloadKey, bytes | None], int]:
    """Open the namespace (room for every row by default), read every key, close."""
    tier = NVMeTier(**tier_kwargs(root, **over))
    await tier.open()
    try:
        return await visible_payloads(tier), int(tier.stats()["invalid_rows_at_open"])
    finally:
        await tier.close()


async def _close_and_reopen(tier: NVMeTier, root: pathlib.Path) -> dict[OffloadKey, bytes | None]:
    """Close ``tier``; a reopen finds exactly the keys and bytes it held, and no invalid row."""
    expect = await visible_payloads(tier)
    await tier.close()
    found, invalid = await _reopened(root)
    assert found == expect
    assert invalid == 0
    return found


def _check_own_bytes(found: dict[OffloadKey, bytes | None], salt: dict[OffloadKey, int]) -> None:
    for k, data in found.items():
        assert data == payload(k, GROUP_NBYTES[k.group_id], salt.get(k, 0)), k


# ====================================================================== configuration


@pytest.mark.parametrize("bad", [0, -1, True, False, 2.5, "32", None, 32.0])
def test_a_bad_eviction_window_raises_config_error_and_creates_nothing(tmp_path, bad) -> None:
    root = tmp_path / "nvme"
    with pytest.raises(ConfigError):
        kvtier.NVMeConfig(root=str(root), capacity_bytes=1 << 20, eviction_window=bad)
    with pytest.raises(ConfigError):
        NVMeTier(**tier_kwargs(root, eviction_window=bad))
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []


async def test_the_engine_hands_eviction_window_to_its_tier(tmp_path) -> None:
    gpu = Gpu()
    for window in (1, 7, 32):
        nv = nvme_config(tmp_path / f"w{window}", eviction_window=window)
        assert nv.eviction_window == window
        async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4, nv)) as engine:
            assert engine._nvme is not None
            assert engine._nvme._index.eviction_window == window
    assert kvtier.NVMeConfig(root=str(tmp_path), capacity_bytes=1).eviction_window == 32


# ====================================================================== the index


@pytest.mark.parametrize(("n", "own_at", "expect_own"), [
    (63, 1, False),  # 63 // 32 == 1: strict LRU
    (64, 1, True),  # window 2: the second key
    (64, 2, False),  # ... but not the third
    (95, 2, False),
    (96, 2, True),  # window 3
    (2048, 31, True),  # window min(32, 64) = 32: the 32nd key
    (2048, 32, False),  # not the 33rd
])  # fmt: skip
def test_window_size_follows_the_key_count_and_caps_at_eviction_window(
    n: int, own_at: int, expect_own: bool
) -> None:
    index = RowIndex({0: 4096, 1: 4096}, n * 4096, {0: 4096, 1: 4096}, {0: 64, 1: 64}, 32, 32)
    keys = [OffloadKey(f"k{i}".encode(), 0 if i == own_at else 1) for i in range(n)]
    for k in keys:
        ok, ref = index.reserve(k.group_id, set())
        assert ok
        assert ref is None
        while (ref := index.take_free(k.group_id)) is None:
            index.commit_growth(index.plan_growth(k.group_id))
        assert index.finish_write(k, ref, index.begin_write(k), 0, 1)
    own_row = index.lookup(keys[own_at]).ref
    ok, ref = index.reserve(0, set())
    assert ok
    if expect_own:
        assert ref == own_row
        assert index.lookup(keys[own_at]) is None
        assert index.lookup(keys[0]) is not None
        assert index.stale_rows == 0
    else:
        assert ref is None
        assert index.lookup(keys[0]) is None
        assert index.lookup(keys[own_at]) is not None
        assert index.stale_rows == 1
    assert index.evictions == 1


def test_random_index_operations_at_the_default_window_keep_every_row_accounted() -> None:
    """Writes (calls of 1-4 keys), completions, failures, pins, discards, touches, reclaims.

    Three row sizes, about 100 keys (window 3 at the default eviction_window
    and share): which keys each reserve evicts follows the rule (own group
    within the window, else strict LRU), and after every step each allocated
    row is in exactly one state and bytes_used counts exactly the rows that
    hold or will hold data.
    """
    rows = {0: 4096, 1: 8192, 2: 12288}
    windows_taken = 0
    for seed in range(4):
        rng = random.Random(seed)
        index = RowIndex(rows, 100 * 8192, dict.fromkeys(rows, 48), dict.fromkeys(rows, 8), 32)
        inflight: list[tuple[OffloadKey, RowRef, int]] = []
        pins: list[RowRef] = []
        reclaiming: list[RowRef] = []
        for _ in range(1200):
            op = rng.random()
            if len(inflight) > 6:  # writes complete: in flight they hold capacity
                op = 0.5
            if op < 0.45:
                call = list(
                    {
                        OffloadKey(b"%d" % rng.randrange(300), rng.randrange(3)): 0
                        for _ in range(rng.randint(1, 4))
                    }
                )
                protect = set(call)
                for k in call:
                    seq = index.begin_write(k)
                    g = k.group_id
                    lru = index.lru_keys()
                    pinned = set(index._pins)
                    evictable = [
                        x for x in lru if x not in protect and index.lookup(x).ref not in pinned
                    ]
                    refs = {x: index.lookup(x).ref for x in evictable}
                    need = index.bytes_used + rows[g] - index.capacity_bytes
                    window = min(32, len(lru) // 32)
                    own = [x for x in evictable[:window] if x.group_id == g]
                    expect: list[OffloadKey] | None = []
                    if need > 0 and window > 1 and own:
                        expect = own[:1]
                        windows_taken += evictable[0] != own[0]
                    elif need > 0:
                        freed = 0
                        for x in evictable:
                            expect.append(x)
                            freed += rows[x.group_id]
                            if freed >= need:
                                break
                        else:
                            expect = None
                    ok, ref = index.reserve(g, protect)
                    after = set(index.lru_keys())
                    evicted = [x for x in lru if x not in after]
                    if expect is None:
                        assert (ok, ref, evicted) == (False, None, [])
                        index.abandon_write(k, seq)
                        continue
                    assert ok
                    assert evicted == expect, (evicted, expect)
                    own_victims = [x for x in expect if x.group_id == g]
                    assert ref == (refs[own_victims[0]] if own_victims else None)
                    while ref is None and (ref := index.take_free(g)) is None:
                        index.commit_growth(index.plan_growth(g))
                    inflight.append((k, ref, seq))
            elif op < 0.7 and inflight:
                k, ref, seq = inflight.pop(rng.randrange(len(inflight)))
                if rng.random() < 0.85:
                    index.finish_write(k, ref, seq, 0, 1)
                else:
                    index.fail_write(k, ref, seq)
            elif op < 0.77 and len(index):
                entry = index.pin(rng.choice(index.lru_keys()))
                assert entry is not None
                pins.append(entry.ref)
            elif op < 0.84 and pins:
                index.unpin(pins.pop(rng.randrange(len(pins))))
            elif op < 0.89 and len(index):
                index.discard(rng.choice(index.lru_keys()))
            elif op < 0.94 and len(index):
                index.touch(rng.choice(index.lru_keys()))
            elif op < 0.97:
                reclaiming += index.take_stale()
            elif reclaiming:
                index.reclaimed(reclaiming)
                reclaiming = []
            check_row_states(index, [r for _, r, _ in inflight], reclaiming)
    assert windows_taken > 50  # the window really took keys out of LRU order


# ====================================================================== the tier


def _fill_keys(groups: Sequence[int], base: int = 0) -> list[OffloadKey]:
    return [key(base + i, g) for i, g in enumerate(groups)]


async def test_below_64_keys_a_full_tier_is_strict_lru_from_64_it_takes_its_own_group(
    tmp_path, slots
) -> None:
    """One group-1 key, then group-0 keys, all in calls of 8: a group-0 write.

    63 keys: strict LRU evicts the group-1 key (too small) and the oldest
    group-0 key (whose row the writer gets). 64 keys: the window (2) takes the
    group-0 key alone; the group-1 key stays. The fill's calls mix groups: the
    LRU follows the call order. Reopened: the evicted keys are gone,
    the rest load their own bytes.
    """
    buf = slots(8)
    for n in (63, 64):
        root = tmp_path / f"n{n}"
        holder: list[_Rig] = []
        fill = _fill_keys([1] + [0] * (n - 1))
        capacity = sum(ROW[k.group_id] for k in fill)
        tier = NVMeTier(
            **tier_kwargs(root, capacity_bytes=capacity, row_io_wrapper=_rigged(holder))
        )
        await tier.open()
        await _write_all(tier, buf, fill)
        assert tier._index.lru_keys() == fill
        holder[0].blanked = 0
        new = key(5000, 0)
        assert await _write(tier, buf, new) == [None]
        await tier.flush()
        evicted = {k for k in fill if not tier.contains(k)}
        if n == 63:
            assert evicted == {fill[0], fill[1]}
            assert holder[0].blanked == 1  # the group-1 row
        else:
            assert evicted == {fill[1]}
            assert holder[0].blanked == 0  # overwritten in place
        await tier.drain()
        check_row_states(tier._index)
        found = await _close_and_reopen(tier, root)
        assert not evicted & set(found)
        _check_own_bytes(found, {})


def _window_fill() -> list[OffloadKey]:
    """70 keys: groups 0, 1, 1, 2, then round robin (window 2 over the LRU)."""
    return _fill_keys([0, 1, 1, 2] + [i % 3 for i in range(66)])


async def _full_tier(
    root: pathlib.Path, buf: Slots, fill: list[OffloadKey]
) -> tuple[NVMeTier, _Rig]:
    holder: list[_Rig] = []
    capacity = sum(ROW[k.group_id] for k in fill)
    tier = NVMeTier(
        **tier_kwargs(
            root, capacity_bytes=capacity, grow_ahead=False, row_io_wrapper=_rigged(holder)
        )
    )
    await tier.open()
    await _write_all(tier, buf, fill)
    assert tier._index.lru_keys() == fill
    return tier, holder[0]


async def test_failed_write_into_an_own_victim_row_publishes_nothing_and_leaks_no_row(
    tmp_path, slots
) -> None:
    """A call [J1 (group 1), J2 (group 2), J3 (group 0)] on a full tier; J1's write fails.

    J1 takes key 1's row (own group, second in the LRU), J2 evicts key 0
    (strict: no group-2 key among the first two), J3 keys 2 and 3. J1's EIO
    fails it alone: it never becomes visible, key 1 stays evicted (its row,
    written nothing, is stale and blanked at close), J2 and J3 are published
    in call order, no row is lost or counted twice, and a reopen finds
    exactly the keys that were visible, with their own bytes.
    """
    root = tmp_path / "nvme"
    buf = slots(8)
    fill = _window_fill()
    tier, rig = await _full_tier(root, buf, fill)
    j1, j2, j3 = key(9001, 1), key(9002, 2), key(9003, 0)
    rig.fail.add(_tag(j1))
    rows = [
        (k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id])))
        for i, k in enumerate([j1, j2, j3])
    ]
    got = await tier.write_rows(rows)
    assert isinstance(got[0], StorageError)
    assert got[0].kind == "eio"
    assert got[1:] == [None, None]
    assert not tier.contains(j1)
    assert {k for k in fill if not tier.contains(k)} == set(fill[:4])
    assert tier._index.lru_keys()[-2:] == [j2, j3]
    assert tier.stats()["failures_eio"] == 1
    await tier.flush()
    await tier.drain()
    check_row_states(tier._index)
    assert tier._index.bytes_used == sum(ROW[k.group_id] for k in tier._index.lru_keys())
    # the tier keeps working: the stale row is blanked and reused
    assert await _write(tier, buf, key(9004, 1)) == [None]
    await tier.flush()
    check_row_states(tier._index)
    found = await _close_and_reopen(tier, root)
    assert j1 not in found
    assert not set(fill[:4]) & set(found)
    _check_own_bytes(found, {})


async def _crash(tier: NVMeTier) -> None:
    """A crash with the page cache kept (as SIGKILL): no final reclaim, no sync."""
    await tier.drain()
    await tier._release()
    tier._state = "closed"


async def _evict_by_a_failed_write(
    root: pathlib.Path, buf: Slots, window: int
) -> tuple[set[OffloadKey], set[OffloadKey]]:
    """A full tier; one call [J (group 1, EIO), N (group 2)]; flush; a crash.

    Returns the keys evicted by the call (as the live tier saw them) and the
    keys a reopen finds.
    """
    holder: list[_Rig] = []
    fill = _window_fill()
    capacity = sum(ROW[k.group_id] for k in fill)
    tier = NVMeTier(
        **tier_kwargs(
            root,
            capacity_bytes=capacity,
            grow_ahead=False,
            row_io_wrapper=_rigged(holder),
            eviction_window=window,
        )
    )
    await tier.open()
    await _write_all(tier, buf, fill)
    j, n = key(9500, 1), key(9501, 2)
    holder[0].fail.add(_tag(j))
    got = await tier.write_rows(
        [(k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id]))) for i, k in enumerate([j, n])]
    )
    assert isinstance(got[0], StorageError)
    assert got[1] is None
    await tier.flush()
    evicted = {k for k in fill if not tier.contains(k)}
    visible = set(tier.keys())
    await _crash(tier)
    found, _ = await _reopened(root, capacity_bytes=capacity)
    _check_own_bytes(found, {})
    assert visible <= set(found)
    return evicted, set(found)


async def test_a_key_evicted_for_a_write_that_fails_does_not_come_back_after_a_crash(
    tmp_path, slots
) -> None:
    """Regression (a common path with the window, where a writer takes its own group's
    row): a key evicted for a write that then fails must not keep its trailer until the
    NEXT write batch or close (fail_write only marks its row stale), or after the batch
    and a flush a crash brings the evicted key back; a row evicted for another group is
    blanked in the evicting batch whatever the write does. write_batch blanks stale rows
    before it returns.

    GUARANTEES.md: "a key evicted from NVMe does not come back (the writer overwrites
    its own group's evicted row in the same write; another group's row has its trailer
    zeroed in the write batch that evicted it)". The same call and crash under strict LRU
    (eviction_window=1: J's victim is key 0, of another group) holds; with the window
    (J's victim is key 1, its own group's, handed over to be overwritten in place) the
    write fails, and key 1's row must be blanked before the crash, or key 1 is back."""
    buf = slots(8)
    evicted, found = await _evict_by_a_failed_write(tmp_path / "strict", buf, 1)
    assert evicted == {key(0, 0), key(1, 1)}  # evicted for J and N: both blanked
    assert not evicted & found, sorted(map(_name, evicted & found))
    evicted, found = await _evict_by_a_failed_write(tmp_path / "window", buf, 32)
    assert evicted == {key(0, 0), key(1, 1)}  # J took key 1 (own), N key 0 (strict)
    assert not evicted & found, sorted(map(_name, evicted & found))


async def test_two_concurrent_writes_of_a_key_the_older_finishing_last_never_wins(
    tmp_path, slots
) -> None:
    """K (salt 1) is held in its write; K (salt 2) is written and published meanwhile.

    Both take their group's oldest rows in place (window). The older write
    finishes last: its row must not be published (lower sequence number), is
    blanked, and a reopen finds K with salt 2 only.
    """
    root = tmp_path / "nvme"
    buf = slots(8)
    fill = _window_fill()
    tier, rig = await _full_tier(root, buf, fill)
    k = key(7000, 1)
    rig.hold.add(_tag(k))
    first = asyncio.ensure_future(_write(tier, buf, k, salt=1, i=0))
    await until_set(rig.held)
    assert await _write(tier, buf, k, salt=2, i=1) == [None]
    assert await read_payload(tier, buf, k, 2) == payload(k, GROUP_NBYTES[1], 2)
    rig.release.set()
    assert await first == [None]
    assert await read_payload(tier, buf, k, 2) == payload(k, GROUP_NBYTES[1], 2)
    assert not tier.contains(fill[1])
    assert not tier.contains(fill[2])
    assert tier.contains(fill[0])
    await tier.flush()
    await tier.drain()
    check_row_states(tier._index)
    found = await _close_and_reopen(tier, root)
    assert found[k] == payload(k, GROUP_NBYTES[1], 2)
    _check_own_bytes(found, {k: 2})


async def test_a_row_pinned_by_a_read_is_skipped_and_the_next_own_key_in_the_window_goes(
    tmp_path, slots
) -> None:
    """LRU: P (group 0, read in flight), X (group 1), Q (group 0), ...; a group-0 write.

    P is pinned: skipped without counting; X is the first evictable key, Q
    the second: within the window (2), so Q goes, in place. P reads back its
    own bytes, X stays.
    """
    root = tmp_path / "nvme"
    buf = slots(8)
    fill = _fill_keys([0, 1, 0] + [1 + i % 2 for i in range(63)])
    tier, rig = await _full_tier(root, buf, fill)
    p, x, q = fill[:3]
    rig.hold_reads = True
    read = asyncio.ensure_future(read_payload(tier, buf, p, 3))
    await until_set(rig.read_held)
    rig.blanked = 0
    new = key(8000, 0)
    assert await _write(tier, buf, new) == [None]
    assert tier.contains(p)
    assert tier.contains(x)
    assert not tier.contains(q)
    assert rig.blanked == 0
    rig.reads_release.set()
    assert await read == payload(p, GROUP_NBYTES[0])
    rig.hold_reads = False
    assert await read_payload(tier, buf, new) == payload(new, GROUP_NBYTES[0])
    await tier.flush()
    await tier.drain()
    check_row_states(tier._index)
    found = await _close_and_reopen(tier, root)
    assert q not in found
    assert {p, x, new} <= set(found)


async def test_discard_during_an_in_place_write_keeps_both_the_key_and_its_victim_away(
    tmp_path, slots
) -> None:
    root = tmp_path / "nvme"
    buf = slots(8)
    fill = _window_fill()
    tier, rig = await _full_tier(root, buf, fill)
    j = key(9100, 1)
    rig.hold.add(_tag(j))
    write = asyncio.ensure_future(_write(tier, buf, j))
    await until_set(rig.held)
    tier.discard(j)
    rig.release.set()
    assert await write == [None]
    assert not tier.contains(j)
    assert not tier.contains(fill[1])  # its victim: group 1, in place
    await tier.flush()
    await tier.drain()
    check_row_states(tier._index)
    assert tier._index.bytes_used == sum(ROW[k.group_id] for k in tier._index.lru_keys())
    found = await _close_and_reopen(tier, root)
    assert j not in found
    assert fill[1] not in found


async def test_keys_of_the_same_call_are_never_taken_as_own_victims(tmp_path, slots) -> None:
    """LRU: A, B (group 0), C (group 1), D (group 0), ...; one call rewrites B and adds N.

    B's job cannot evict B: it takes A (in place). N's job: B is protected,
    C and D are the first two evictable keys, D is of group 0: D goes. B
    reads back its new bytes, also after a reopen.
    """
    root = tmp_path / "nvme"
    buf = slots(8)
    fill = _fill_keys([0, 0, 1, 0] + [1 + i % 2 for i in range(62)])
    tier, rig = await _full_tier(root, buf, fill)
    a, b, c, d = fill[:4]
    n = key(9200, 0)
    rows = [
        (b, 0, 4, buf.fill(0, payload(b, GROUP_NBYTES[0], 1))),
        (n, 0, 4, buf.fill(1, payload(n, GROUP_NBYTES[0]))),
    ]
    rig.blanked = 0
    assert await tier.write_rows(rows) == [None, None]
    assert not tier.contains(a)
    assert not tier.contains(d)
    assert tier.contains(b)
    assert tier.contains(c)
    assert tier.contains(n)
    assert tier._index.lru_keys()[-2:] == [b, n]
    assert await read_payload(tier, buf, b) == payload(b, GROUP_NBYTES[0], 1)
    await tier.flush()
    await tier.drain()
    check_row_states(tier._index)
    found = await _close_and_reopen(tier, root)
    assert found[b] == payload(b, GROUP_NBYTES[0], 1)
    assert a not in found
    assert d not in found


async def test_reopen_over_capacity_then_the_window_still_reuses_rows_in_place(
    tmp_path, slots
) -> None:
    """A full tier of 100 keys reopened with room for 80: rebuild evicts the 20 oldest.

    Then 40 writes into it: every key found loads its own bytes, rows stay
    accounted, and rows were overwritten in place (fewer blanking writes than
    evictions).
    """
    root = tmp_path / "nvme"
    buf = slots(8)
    fill = _fill_keys([i % 3 for i in range(100)])
    tier, _ = await _full_tier(root, buf, fill)
    await tier.close()
    holder: list[_Rig] = []
    small = sum(ROW[k.group_id] for k in fill[20:])
    tier = NVMeTier(
        **tier_kwargs(root, capacity_bytes=small, row_io_wrapper=_rigged(holder), grow_ahead=False)
    )
    await tier.open()
    assert tier._index.lru_keys() == fill[20:]
    ev0 = tier.stats()["evictions"]
    await tier.close()  # rebuild's evictions are blanked at close
    tier = NVMeTier(
        **tier_kwargs(root, capacity_bytes=small, row_io_wrapper=_rigged(holder), grow_ahead=False)
    )
    await tier.open()
    assert tier._index.lru_keys() == fill[20:]
    rig = holder[-1]
    rig.blanked = 0
    new = _fill_keys([(i * 7) % 3 for i in range(40)], base=3000)
    await _write_all(tier, buf, new)
    evictions = tier.stats()["evictions"]
    assert evictions >= 40
    assert ev0 == 20
    assert rig.blanked < evictions // 2
    await tier.drain()
    check_row_states(tier._index)
    found = await _close_and_reopen(tier, root)
    assert not set(fill[:20]) & set(found)
    _check_own_bytes(found, {})


# ====================================================================== the engine


async def _engine_round_trip(root: pathlib.Path, window: int) -> tuple[int, int]:
    gpu = Gpu(num_blocks=64)
    holder: list[_Rig] = []
    cap = 50 * 12288 + 50 * 8192
    nv = nvme_config(root, capacity_bytes=cap, wrapper=_rigged(holder), eviction_window=window)
    rng = random.Random(3)
    keys = [model_key(f"w{i}", rng.choice([0, 0, 1])) for i in range(260)]
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4, nv)) as engine:
        for b in range(0, len(keys), 4):
            await store_ok(engine, gpu, chunks_for(keys[b : b + 4]))
            await engine.flush()
        assert engine._nvme is not None
        on_nvme = set(engine._nvme.keys())
        st = engine.stats().nvme or {}
        evictions = st["evictions"]
        assert isinstance(evictions, int)
        assert evictions >= 150
        assert st["bytes_used"] <= cap
        assert 80 <= len(on_nvme) <= 100
        for k in sorted(on_nvme, key=lambda k: k.block_hash):
            res = await load_check(engine, gpu, chunks_for([k]))
            assert k in res.loaded
        blanked = holder[0].blanked
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4, nv)) as engine:
        found = engine.lookup(keys)
        assert {
            k for k, r in zip(keys, found, strict=True) if r is kvtier.Residency.NVME
        } == on_nvme
        for k in on_nvme:
            res = await load_check(engine, gpu, chunks_for([k]))
            assert k in res.loaded
    return blanked, evictions


async def test_engine_store_flush_load_round_trip_on_a_full_tier_with_the_window(tmp_path) -> None:
    """260 keys of two row sizes through an engine whose NVMe tier holds about 93 rows.

    Every key on NVMe loads its exact bytes (loads promote from NVMe: 4 CPU
    slots), before and after a restart, and a restart finds exactly the keys
    that were on NVMe; with the default window and with strict LRU. The
    window blanks fewer evicted rows (it overwrites its own group's in place).
    """
    window = await _engine_round_trip(tmp_path / "w32", 32)
    strict = await _engine_round_trip(tmp_path / "w1", 1)
    assert window[0] < strict[0] - 10, (window, strict)  # 40 vs 68 blanking writes here


# ====================================================================== SIGKILL


CRASH_CAP = 40 * (ROW[0] + ROW[1] + ROW[2])  # about 120 keys: window 3


def _name(k: OffloadKey) -> str:
    return f"{k.group_id}:{k.block_hash.decode()}"


def _unname(name: str) -> OffloadKey:
    g, h = name.split(":", 1)
    return OffloadKey(h.encode(), int(g))


async def _child_crash(root: str, log_path: str, known_path: str) -> None:
    """Write calls of 1-6 keys forever (random groups, keys, salts), flush now and then.

    Logs (one ``os.write`` per line) each call before it is made
    (``{"b": [[name, salt], ...]}``) and, after each flush, every visible key
    with its salt (``{"f": {name: salt}}``).
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(obj: Any) -> None:
        os.write(fd, (json.dumps(obj) + "\n").encode())

    salts: dict[str, int] = json.loads(pathlib.Path(known_path).read_text())
    holder: list[_Rig] = []
    tier = NVMeTier(
        **tier_kwargs(
            root, capacity_bytes=CRASH_CAP, segment_nbytes=512 << 10, row_io_wrapper=_rigged(holder)
        )
    )
    await tier.open()
    assert {_name(k) for k in tier._index.lru_keys()} == set(salts), "the reopen lost or found keys"
    buf = Slots(8, 8 * 4096)
    rng = random.Random(os.getpid())
    ready = False
    while True:
        call: dict[OffloadKey, int] = {}
        for _ in range(rng.randint(1, 6)):
            call[key(rng.randrange(220), rng.randrange(3))] = rng.randrange(256)
        log({"b": [[_name(k), s] for k, s in call.items()]})
        rows = [
            (k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id], s)))
            for i, (k, s) in enumerate(call.items())
        ]
        assert await tier.write_rows(rows) == [None] * len(rows)
        for k, s in call.items():
            salts[_name(k)] = s
        if rng.random() < 0.3:
            await tier.flush()
            visible = {_name(k) for k in tier._index.lru_keys()}
            log({"f": {n: s for n, s in salts.items() if n in visible}})
        if not ready and len(tier.keys()) >= 96:
            evictions = int(tier.stats()["evictions"])
            if evictions - holder[0].blanked > 30:  # rows were overwritten in place
                print("ready", flush=True)
                ready = True


def _check_crash(
    found: dict[OffloadKey, bytes | None], log: list[Any], known: dict[str, int]
) -> dict[str, int]:
    flushes = [i for i, e in enumerate(log) if "f" in e]
    flushed: dict[str, int] = log[flushes[-1]]["f"] if flushes else dict(known)
    after = [pair for e in log[flushes[-1] + 1 if flushes else 0 :] for pair in e.get("b", [])]
    allowed: dict[str, set[int]] = {n: {s} for n, s in flushed.items()}
    for n, s in after:
        allowed.setdefault(n, set()).add(s)
    names = {_name(k): k for k in found}
    assert set(names) <= set(allowed), f"came back: {sorted(set(names) - set(allowed))}"
    now: dict[str, int] = {}
    for n, k in names.items():
        data = found[k]
        if data is None:  # a row torn by the kill (its key's trailer with other bytes)
            continue
        match = [s for s in allowed[n] if data == payload(k, GROUP_NBYTES[k.group_id], s)]
        assert match, f"{n}: bytes of none of its writes {sorted(allowed[n])}"
        if n in flushed and n not in {m for m, _ in after}:
            assert match == [flushed[n]], n
        now[n] = match[0]
    lost = [n for n in flushed if now.get(n) is None]
    # each row written after the flush evicts at most 3 rows (20 KiB over 8 KiB ones)
    assert len(lost) <= 3 * len(after) + 3, (len(lost), len(after))
    return now


def test_sigkill_while_writes_overwrite_own_group_rows_in_place(tmp_path) -> None:
    """5 SIGKILLs of a child whose full tier (about 120 keys, window 3) rewrites rows in place.

    After each kill a reopen finds only keys flushed before it or written
    after that flush (never a key evicted before the last flush), each with
    the bytes of one of its writes (a key flushed and not written since: its
    flushed bytes) or failing its checksum (a row torn by the kill); flushed
    keys lost are no more than the writes after the flush could evict.
    """
    root = tmp_path / "nvme"
    rng = random.Random(11)
    known: dict[str, int] = {}
    checked = 0
    for it in range(5):
        log_path = tmp_path / f"log{it}"
        known_path = tmp_path / f"known{it}.json"
        known_path.write_text(json.dumps(known))
        err_path = tmp_path / f"err{it}"
        args = ["tests.reliability.test_nvme_eviction_window", "crash", str(root), str(log_path)]
        kill_child([*args, str(known_path)], err_path, rng.uniform(0.01, 0.25))
        log = []
        for text in log_path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # the line the kill cut
                log.append(json.loads(text))
        found, _ = asyncio.run(_reopened(root, capacity_bytes=CRASH_CAP, segment_nbytes=512 << 10))
        known = _check_crash(found, log, known)
        checked += len(found)
    assert checked > 300


# ====================================================================== kvtier bench


_ROT_LOCK = threading.Lock()


class _FullTierRot(DelegatingRowIO):
    """Writes the first row of a new key (``full/...``) of the full-tier leg with one bit flipped.

    ``where``: ``"trailer"`` (its trailer's magic: the row is invalid at the
    next open, the key gone) or ``"payload"``. The caller's buffer is flipped
    back after the write: only the bytes on disk are wrong.
    """

    def __init__(self, inner: RowIO, where: str, hits: list[str]) -> None:
        super().__init__(inner)
        self.where, self.hits = where, hits
        self.paths: dict[Any, str] = {}

    def open(self, path: Any, create: bool) -> Any:
        handle = self.inner.open(path, create)
        self.paths[handle] = str(path)
        return handle

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        path = self.paths.get(handle, "")
        if f"-full{os.sep}" in path:
            for b in bufs:
                mv = memoryview(b)
                if mv.nbytes > TRAILER and b"full/" in bytes(
                    mv[mv.nbytes - TRAILER : mv.nbytes - TRAILER + 160]
                ):
                    with _ROT_LOCK:  # one row in the whole run (writes run on several threads)
                        if self.hits:
                            break
                        self.hits.append(path)
                    at = mv.nbytes - TRAILER if self.where == "trailer" else 100
                    mv[at] ^= 1
                    try:
                        return self.inner.pwritev(handle, bufs, file_offset)
                    finally:
                        mv[at] ^= 1
        return self.inner.pwritev(handle, bufs, file_offset)


def _bench_full_tier_rot(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> tuple[bool, list[str]]:
    hits: list[str] = []

    def wrap(io: RowIO) -> RowIO:
        return _FullTierRot(io, where, hits)

    return bench_fails(tmp_path, monkeypatch, wrap, 40 << 20), hits


def test_bench_full_tier_leg_fails_on_one_corrupt_payload(tmp_path, monkeypatch) -> None:
    detected, hits = _bench_full_tier_rot(tmp_path, monkeypatch, "payload")
    assert len(hits) == 1
    assert detected


def test_bench_full_tier_leg_fails_on_one_corrupt_trailer(tmp_path, monkeypatch) -> None:
    """Regression: the full-tier check requires exactly the new keys the live tier held,
    and no invalid row at open. Counting any new key missing at reopen as 'evicted' and
    reloading its chunk from the nvme_write leg's tier let a row written with a corrupt
    trailer (its key gone at open) pass the bench.

    20 chunks of one group (window collapsed: strict LRU evicts no new key); one row
    written with its trailer's magic flipped. Counted as new_keys_evicted (1 <= 20 // 10),
    the missing key would let the run report a figure; the bench must fail instead."""
    detected, hits = _bench_full_tier_rot(tmp_path, monkeypatch, "trailer")
    assert len(hits) == 1
    assert detected


# ====================================================================== child entry


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        asyncio.run(_child_crash(sys.argv[2], sys.argv[3], sys.argv[4]))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]}")
