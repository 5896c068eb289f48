"""A full NVMe tier whose groups have very unequal row sizes.

DeepSeek-V3.2 (``engine/_shapes.py``, ``deepseek-v3.2``) stores two KV cache
groups per chunk: the MLA latent (656 B/token) and the sparse-attention
indexer's keys (132 B/token), about 5x apart. Here group 0 has rows of 40 KiB
(9 pages of payload + the trailer) and group 1 rows of 8 KiB (1 page + the
trailer), 5x apart, and the tiers hold a few hundred keys, so that the
eviction window (``min(eviction_window, keys // 32)``) is open.

Attacks, through ``NVMeTier`` only; faults only through ``row_io_wrapper``
(a RowIO wrapper around the real backend) and a real subprocess killed with
SIGKILL (``python -m tests.reliability.test_nvme_unequal_rows crash ROOT LOG``
runs the child). A "crash" in-process is a copy of the namespace folder taken
while the tier is live: the files as the page cache holds them, which is what
a SIGKILL leaves.

The two tests whose docstrings start "Regression:" guard against bugs the tier once had.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import pathlib
import random
import shutil
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier import OffloadKey
from kvtier.errors import StorageError
from kvtier.io import NVMeTier, RowIO

from ..io.conftest import Slots, payload, tier_kwargs
from ..io.faults import DelegatingRowIO
from ._faultio import check_found, kill_child, kill_log, rig_factory, snapshot, until_set
from .row_states import check_row_states  # nothing in flight: every row in one state

TRAILER = 4096
HEADER = 4096
BIG, SMALL = 0, 1
G = {BIG: 9 * 4096 - 100, SMALL: 100}  # payload bytes: MLA-like and indexer-like
ROW = {BIG: 40960, SMALL: 8192}  # 5x apart
LAYOUT: dict[str, Any] = {"groups": {"0": {"layers": ["mla"]}, "1": {"layers": ["indexer"]}}}
SLOT = ROW[BIG]


def _kw(root: pathlib.Path | str, **over: Any) -> dict[str, Any]:
    return tier_kwargs(root, group_nbytes=G, layout_description=LAYOUT, **over)


def _key(i: int, group_id: int) -> OffloadKey:
    return OffloadKey(f"unequal-{i}".encode(), group_id)


def _tag(k: OffloadKey) -> bytes:
    """What a row's trailer holds of its key: the hash, zero padded."""
    return k.block_hash + b"\0"


def _data(k: OffloadKey, salt: int = 0) -> bytes:
    return payload(k, G[k.group_id], salt)


def _blocks(directory: pathlib.Path) -> int:
    """Bytes of disk blocks of the segment files (their 4 KiB headers left out)."""
    return sum(p.stat().st_blocks * 512 - HEADER for p in directory.rglob("*.kvrows"))


class _Rig(DelegatingRowIO):
    """Real I/O; EIO on the row writes of chosen keys; holds the first blanking write on demand.

    A row buffer handed to ``pwritev`` ends with its sealed trailer, so the
    key a row write is for can be read from it; a blanking write is one
    4 KiB buffer past a segment's header.
    """

    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner)
        self.fail: set[bytes] = set()
        self.hold_blank = False
        self.blank_held = threading.Event()
        self.blank_release = threading.Event()
        self.hold_rows: set[bytes] = set()  # row writes naming these tags wait for rows_release
        self.rows_held = threading.Event()
        self.rows_release = threading.Event()
        self.blanks = 0
        self._lock = threading.Lock()

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        if nbytes == TRAILER and file_offset > 0:
            with self._lock:
                self.blanks += 1
                hold, self.hold_blank = self.hold_blank, False
            if hold:
                self.blank_held.set()
                assert self.blank_release.wait(30)
            return self.inner.pwritev(handle, bufs, file_offset)
        trailers = []
        for b in bufs:
            mv = memoryview(b)
            trailers.append(bytes(mv[mv.nbytes - TRAILER : mv.nbytes - TRAILER + 160]))
        if any(tag in t for tag in self.fail for t in trailers):
            raise OSError(errno.EIO, "injected EIO on a row write")
        if any(tag in t for tag in self.hold_rows for t in trailers):
            self.rows_held.set()
            assert self.rows_release.wait(30)
        return self.inner.pwritev(handle, bufs, file_offset)


def _rigged(holder: list[_Rig]) -> Any:
    return rig_factory(_Rig, holder)


def _rows(buf: Slots, keys: Sequence[OffloadKey], salt: dict[OffloadKey, int] | None = None,
          first: int = 0) -> list[tuple[OffloadKey, int, int, memoryview]]:  # fmt: skip
    salt = salt or {}
    return [(k, 0, 4, buf.fill(first + i, _data(k, salt.get(k, 0)))) for i, k in enumerate(keys)]


async def _snapshot(tier: NVMeTier) -> dict[OffloadKey, bytes | None]:
    """Every visible key's payload (None: its read failed)."""
    return await snapshot(tier, G, SLOT)


async def _reopened(root: pathlib.Path, **over: Any) -> tuple[dict[OffloadKey, bytes | None], int]:
    """Open the namespace (room for every row unless told), read every key, close."""
    over.setdefault("capacity_bytes", 64 << 20)
    tier = NVMeTier(**_kw(root, **over))
    await tier.open()
    try:
        return await _snapshot(tier), int(tier.stats()["invalid_rows_at_open"])
    finally:
        await tier.close()


# ====================================================================== a model of the rule


class _Model:
    """The documented eviction rule over keys of unequal rows, no pins, one call at a time."""

    def __init__(self, capacity: int, window: int) -> None:
        self.capacity, self.window = capacity, window
        self.lru: OrderedDict[OffloadKey, None] = OrderedDict()
        self.used = 0
        self.evictions = self.window_evictions = self.capacity_failures = 0

    def write(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Reserve every key of a call (evicting), then publish in call order; per key: ok."""
        protect = set(keys)
        ok = []
        for k in keys:
            row = ROW[k.group_id]
            need = self.used + row - self.capacity
            evictable = [x for x in self.lru if x not in protect]
            window = min(self.window, len(self.lru) // 32)
            own = [i for i, x in enumerate(evictable[:window]) if x.group_id == k.group_id]
            if need > 0 and window > 1 and own:
                del self.lru[evictable[own[0]]]
                self.evictions += 1
                self.window_evictions += own[0] > 0
                ok.append(True)
                continue
            victims: list[OffloadKey] = []
            freed = 0
            if need > 0:
                for x in evictable:
                    victims.append(x)
                    freed += ROW[x.group_id]
                    if freed >= need:
                        break
                else:
                    self.capacity_failures += 1
                    ok.append(False)
                    continue
            for x in victims:
                del self.lru[x]
                self.evictions += 1
            self.used += row - freed
            ok.append(True)
        for k, good in zip(keys, ok, strict=True):
            if good:
                if k in self.lru:  # a rewrite: the old row goes
                    del self.lru[k]
                    self.used -= ROW[k.group_id]
                self.lru[k] = None
        return ok


async def test_sequential_unequal_rows_follow_the_window_rule_and_the_counters_match(
    tmp_path, slots
) -> None:
    """About 700 calls of 1-4 keys (bursts of one group, alternation, rewrites, reads, discards).

    After every call the tier's LRU, ``bytes_used``, ``evictions`` and
    ``window_evictions`` are those of the documented rule (own group within
    the window, else strict LRU over bytes); the window really skips older
    keys; every key reads back its own bytes; a reopen finds exactly the
    visible keys (no evicted or discarded one) with their bytes.
    """
    root = tmp_path / "nvme"
    cap = 60 * ROW[BIG] + 200 * ROW[SMALL]
    tier = NVMeTier(**_kw(root, capacity_bytes=cap))
    await tier.open()
    buf = slots(6, SLOT)
    model = _Model(cap, 32)
    salt: dict[OffloadKey, int] = {}
    rng = random.Random(12)
    gone: set[OffloadKey] = set()
    n = 0
    for step in range(700):
        phase = (step // 60) % 4  # big bursts, small bursts, alternating, random
        if rng.random() < 0.15 and model.lru:
            k = rng.choice(list(model.lru))
            if rng.random() < 0.3:
                tier.discard(k)
                del model.lru[k]
                model.used -= ROW[k.group_id]
                gone.add(k)
            else:  # a read touches the key
                (got,) = await tier.read_rows([(k, buf[5])])
                assert got == (0, 4)
                assert bytes(buf[5][: G[k.group_id]]) == _data(k, salt.get(k, 0))
                model.lru.move_to_end(k)
            continue
        keys: list[OffloadKey] = []
        for j in range(rng.randint(1, 4)):
            if phase == 0:
                g = BIG
            elif phase == 1:
                g = SMALL
            elif phase == 2:
                g = (step + j) % 2
            else:
                g = rng.randrange(2)
            if rng.random() < 0.08 and model.lru:
                old = rng.choice(list(model.lru))
                if old not in keys:
                    keys.append(old)
                    salt[old] = salt.get(old, 0) + 1
                    continue
            keys.append(_key(n, g))
            n += 1
        expect = model.write(keys)
        got = await tier.write_rows(_rows(buf, keys, salt))
        assert [r is None for r in got] == expect, got
        assert tier._index.lru_keys() == list(model.lru)
        st = tier.stats()
        assert (st["bytes_used"], st["evictions"], st["window_evictions"]) == (
            model.used,
            model.evictions,
            model.window_evictions,
        )
        assert st["bytes_used"] <= cap
    assert model.window_evictions > 30  # the window really took keys out of LRU order
    assert model.evictions > 300
    await tier.flush()
    await tier.drain()
    check_row_states(tier._index)
    visible = await _snapshot(tier)
    for k, data in visible.items():
        assert data == _data(k, salt.get(k, 0)), k
    await tier.close()
    found, invalid = await _reopened(root)
    assert found == visible
    assert invalid == 0
    written = {_key(i, g) for i in range(n) for g in (BIG, SMALL)}
    assert not (written - set(visible)) & set(found)
    assert not gone & set(found)


# ====================================================================== capacity and starvation


async def test_a_big_row_that_finds_no_room_fails_with_capacity_and_evicts_nothing(
    tmp_path, slots
) -> None:
    """Small-row writes in flight hold 288 of 320 KiB; 24 KiB of small keys are visible.

    A call [s1, s2, big]: s1 fits, s2 takes the oldest key's row (its own
    group's); the big row (40 KiB) cannot fit even after evicting every
    evictable key (16 KiB) and fails with a StorageError of kind ``capacity``
    naming ``capacity_bytes``, and no key is evicted for it. Once the small
    writes land the same big row is written (it is not starved), evicting
    the five oldest small keys by call order, no more.
    """
    root = tmp_path / "nvme"
    holder: list[_Rig] = []
    cap = 4 * ROW[BIG] + 20 * ROW[SMALL]  # 160 + 160 KiB
    tier = NVMeTier(**_kw(root, capacity_bytes=cap, row_io_wrapper=_rigged(holder)))
    await tier.open()
    rig = holder[0]
    buf = slots(40, SLOT)
    old = [_key(i, SMALL) for i in range(3)]  # visible: 24 KiB
    assert await tier.write_rows(_rows(buf, old)) == [None] * 3
    await tier.drain()
    inflight = [_key(100 + i, SMALL) for i in range(36)]  # 288 KiB held by writes in flight
    rig.hold_rows.add(_tag(inflight[0]))
    held = asyncio.ensure_future(tier.write_rows(_rows(buf, inflight, first=3)))
    await until_set(rig.rows_held)
    assert tier.stats()["bytes_used"] == cap - 8192
    s1, s2, b = _key(200, SMALL), _key(201, SMALL), _key(202, BIG)
    got = await tier.write_rows(_rows(buf, [s1, s2, b]))
    assert got[:2] == [None, None]  # s1 fits, s2 takes old[0]'s row (its own group's)
    assert isinstance(got[2], StorageError)
    assert got[2].kind == "capacity"
    assert "capacity_bytes" in str(got[2])
    assert [tier.contains(k) for k in old] == [False, True, True]  # nothing evicted for b
    assert tier.contains(s1)
    assert tier.contains(s2)
    assert not tier.contains(b)
    st = tier.stats()
    assert (st["failures_capacity"], st["evictions"], st["window_evictions"]) == (1, 1, 0)
    assert st["bytes_used"] == cap
    rig.rows_release.set()
    assert await held == [None] * 36
    assert await tier.write_rows(_rows(buf, [b])) == [None]  # now it fits: not starved
    st = tier.stats()
    # old[1], old[2] and the three oldest in-flight keys: the in-flight call
    # began before s1 and s2, so its keys rank older than theirs
    assert st["evictions"] == 1 + 5
    assert [tier.contains(k) for k in [*old, s1, s2, *inflight[:4], b]] == [
        False, False, False, True, True, False, False, False, True, True,
    ]  # fmt: skip
    assert st["bytes_used"] == cap - 5 * ROW[SMALL] + ROW[BIG]
    await tier.flush()
    await tier.drain()
    check_row_states(tier._index)
    snap = await _snapshot(tier)
    assert b in snap
    for k, data in snap.items():
        assert data == _data(k), k
    await tier.close()


async def test_small_row_traffic_never_starves_the_big_row_group(tmp_path, slots) -> None:
    """Concurrent calls of small keys (4 at a time) with a big key every other call, full tier.

    Every big write succeeds and its key is visible and loads right after
    its call; over time the big group keeps a share of the tier close to
    its share of the bytes written (strict LRU would keep it; the window
    must not starve it), and the counters add up.
    """
    root = tmp_path / "nvme"
    cap = 30 * ROW[BIG] + 150 * ROW[SMALL]
    tier = NVMeTier(**_kw(root, capacity_bytes=cap))
    await tier.open()
    buf = slots(24, SLOT)
    rng = random.Random(3)
    n = published = 0
    big_written: list[OffloadKey] = []
    for rnd in range(120):
        calls = []
        for c in range(4):
            keys = [_key(n + j, SMALL) for j in range(rng.randint(1, 5))]
            n += len(keys)
            if (rnd * 4 + c) % 2 == 0:
                keys.insert(rng.randrange(len(keys) + 1), _key(n, BIG))
                n += 1
            calls.append((keys, tier.write_rows(_rows(buf, keys, first=6 * c))))
        outcomes = await asyncio.gather(*(call for _, call in calls))
        for (keys, _), got in zip(calls, outcomes, strict=True):
            assert got == [None] * len(keys), got
            published += len(keys)
            for k in keys:
                if k.group_id == BIG:
                    big_written.append(k)
                    assert tier.contains(k)
                    (res,) = await tier.read_rows([(k, buf[23])])
                    assert res == (0, 4)
                    assert bytes(buf[23][: G[BIG]]) == _data(k)
    await tier.drain()
    st = tier.stats()
    assert st["rows_resident"] == published - st["evictions"]
    assert 0 <= st["window_evictions"] <= st["evictions"]
    assert st["bytes_used"] <= cap
    written = sum(ROW[k.group_id] for k in big_written) / (
        sum(ROW[k.group_id] for k in big_written) + (published - len(big_written)) * ROW[SMALL]
    )
    held = list(tier.keys())
    big_share = sum(ROW[k.group_id] for k in held if k.group_id == BIG) / st["bytes_used"]
    assert big_share > 0.7 * written, (big_share, written)
    assert big_written[-1] in held
    check_row_states(tier._index)
    await tier.close()


# ====================================================================== random, with faults


async def test_random_concurrent_unequal_writes_with_faults_discards_and_reopen(
    tmp_path, slots
) -> None:
    """1-4 concurrent calls per round (bursts of one group or mixed), EIO on 5% of rows,
    reads and discards while the calls run, close and reopen now and then.

    After every round, with nothing in flight: rows accounted, bytes_used
    within capacity, held blocks within the budget (a growth past it left
    one row over before a fix, below), keys lost = evictions +
    discards, failure counters = failed results, every visible key reads its
    own bytes; every reopen finds exactly the keys that were visible.
    """
    root = tmp_path / "nvme"
    holder: list[_Rig] = []
    cap = 30 * ROW[BIG] + 100 * ROW[SMALL]

    def make() -> NVMeTier:
        return NVMeTier(**_kw(root, capacity_bytes=cap, row_io_wrapper=_rigged(holder)))

    tier = make()
    await tier.open()
    buf = slots(34, SLOT)
    rng = random.Random(1212)
    n = 0
    reopens = evicted_total = 0
    failed: dict[str, int] = {"eio": 0, "capacity": 0}
    for _ in range(60):
        rig = holder[-1]
        ix = tier._index
        before = set(ix.lru_keys())
        ev0 = tier.stats()["evictions"]
        f0 = {kind: tier.stats()[f"failures_{kind}"] for kind in failed}
        mode = rng.random()
        calls = []
        slot = 0
        round_keys: list[OffloadKey] = []
        for _ in range(rng.randint(1, 4)):
            keys = []
            for _ in range(rng.randint(1, 8)):
                g = BIG if mode < 0.3 else SMALL if mode < 0.6 else rng.randrange(2)
                keys.append(_key(n, g))
                n += 1
                if rng.random() < 0.05:
                    rig.fail.add(_tag(keys[-1]))
            round_keys += keys
            calls.append(
                (keys, asyncio.ensure_future(tier.write_rows(_rows(buf, keys, first=slot))))
            )
            slot += len(keys)
        await asyncio.sleep(0)
        discarded = 0
        visible = ix.lru_keys()
        for k in rng.sample(visible, min(len(visible), 3)):
            if rng.random() < 0.3:
                discarded += tier.contains(k)
                tier.discard(k)
            else:
                (got,) = await tier.read_rows([(k, buf[33])])
                if not isinstance(got, BaseException):
                    assert bytes(buf[33][: G[k.group_id]]) == _data(k), k
        published = 0
        kinds = {"eio": 0, "capacity": 0}
        for keys, fut in calls:
            for got in await fut:
                if got is None:
                    published += 1
                else:
                    assert isinstance(got, StorageError)
                    assert got.kind == "eio", got  # capacity never: nothing is pinned long
                    assert any(_tag(x) in rig.fail for x in keys)  # its own request's fault
                    kinds[got.kind] += 1
        await tier.drain()
        check_row_states(ix)
        st = tier.stats()
        assert {kind: st[f"failures_{kind}"] - f0[kind] for kind in failed} == kinds
        evicted = st["evictions"] - ev0
        evicted_total += evicted
        now = set(ix.lru_keys())
        assert len(now) == len(before) + published - evicted - discarded
        assert now <= before | set(round_keys)
        assert ix.held_nbytes <= ix.disk_budget_nbytes
        # ext4 gives a file of many extents 4 KiB extent-tree blocks (README)
        files = len(list(tier.directory.rglob("*.kvrows")))
        assert _blocks(tier.directory) <= ix.disk_budget_nbytes + 2 * 4096 * files
        for k, data in (await _snapshot(tier)).items():
            assert data == _data(k), k
        if rng.random() < 0.12:
            await tier.flush()
            keep = await _snapshot(tier)
            await tier.close()
            tier = make()
            await tier.open()
            reopens += 1
            assert await _snapshot(tier) == keep
            assert tier.stats()["invalid_rows_at_open"] == 0
    assert reopens >= 3
    assert evicted_total > 100
    await tier.close()


# ====================================================================== reopen smaller


async def test_reopen_smaller_evicts_by_sequence_within_capacity_and_they_stay_gone(
    tmp_path, slots
) -> None:
    """A full tier of mixed rows reopened with half the capacity: rebuild evicts the oldest
    writes until the rows fit (never below capacity by more than one big row), the evicted
    keys never come back (also after a clean close and a reopen with room for all)."""
    root = tmp_path / "nvme"
    cap = 20 * ROW[BIG] + 60 * ROW[SMALL]
    tier = NVMeTier(**_kw(root, capacity_bytes=cap))
    await tier.open()
    buf = slots(8, SLOT)
    rng = random.Random(5)
    order = [_key(i, rng.choice([BIG, SMALL, SMALL])) for i in range(150)]
    for b in range(0, len(order), 5):
        assert await tier.write_rows(_rows(buf, order[b : b + 5])) == [None] * len(order[b : b + 5])
    before = tier._index.lru_keys()
    await tier.close()
    half = cap // 2
    tier = NVMeTier(**_kw(root, capacity_bytes=half))
    await tier.open()
    kept = tier._index.lru_keys()
    assert kept == before[len(before) - len(kept) :]  # the newest writes, in order
    used = sum(ROW[k.group_id] for k in kept)
    assert tier.stats()["bytes_used"] == used
    assert half - ROW[BIG] < used <= half
    assert tier.stats()["evictions"] == len(before) - len(kept)
    await tier.close()
    found, invalid = await _reopened(root)
    assert set(found) == set(kept)
    assert invalid == 0
    for k, data in found.items():
        assert data == _data(k), k


# =============================================================== regressions


async def test_a_write_returns_and_writes_only_once_the_rows_it_evicted_are_blank(
    tmp_path, slots
) -> None:
    """Regression: two concurrent small-row calls A and B on a full tier whose LRU-oldest
    key is big (E). A evicts E, and B's batch, which starts right after, may take E's stale
    row in its own opening reclaim; A must not then find nothing to reclaim and return
    while E's trailer is still intact. A crash would bring E back, and since E was written
    after small keys that were read since (LRU order != sequence order), the restart's
    rebuild would drop a flushed, recently read small key to fit E.

    A batch blanks (or waits for another reclaim to blank) the rows it evicted BEFORE
    it writes its own rows, and returns only once they are blank
    (io/_blanking.py settle_evictions): while E's blanking is held, A has neither returned
    nor written its row, so a crash leaves no more valid rows than capacity_bytes and
    every flushed key survives; afterwards E stays gone.
    """
    root = tmp_path / "nvme"
    holder: list[_Rig] = []
    cap = ROW[BIG] + 10 * ROW[SMALL]
    tier = NVMeTier(**_kw(root, capacity_bytes=cap, row_io_wrapper=_rigged(holder)))
    await tier.open()
    buf = slots(4, SLOT)
    smalls = [_key(i, SMALL) for i in range(10)]
    for k in smalls:
        assert await tier.write_rows(_rows(buf, [k])) == [None]
    e = _key(100, BIG)
    assert await tier.write_rows(_rows(buf, [e])) == [None]
    await tier.flush()
    for k in smalls:  # read: E becomes the least recently used key
        assert await tier.read_rows([(k, buf[0])]) == [(0, 4)]
    await tier.drain()
    assert tier._index.lru_keys()[0] == e
    rig = holder[0]
    rig.hold_blank = True
    a, b = _key(200, SMALL), _key(201, SMALL)
    call_a = asyncio.ensure_future(tier.write_rows(_rows(buf, [a], first=1)))
    call_b = asyncio.ensure_future(tier.write_rows(_rows(buf, [b], first=2)))
    crash = tmp_path / "crash"
    try:
        await until_set(rig.blank_held)
        await asyncio.sleep(0.05)  # time for A to finish, were it not waiting
        assert not call_a.done(), "A returned before the row it evicted was blank"
        shutil.copytree(root, crash)  # what a SIGKILL now would leave
    finally:
        rig.blank_release.set()
    assert await call_a == [None]
    assert await call_b == [None]
    assert not tier.contains(e)
    await tier.close()
    found, invalid = await _reopened(crash, capacity_bytes=cap)
    assert invalid == 0
    for k, data in found.items():
        assert data == _data(k), k  # never wrong bytes
    assert set(smalls) <= set(found), "a flushed key was dropped at the restart"
    assert a not in found  # A had not written its row while E's blanking was held
    found, invalid = await _reopened(root, capacity_bytes=cap)
    assert invalid == 0
    assert set(found) == {*smalls, a, b}, "E came back after the writes that evicted it"
    for k, data in found.items():
        assert data == _data(k), k


async def test_growth_past_the_budget_ends_back_within_it(tmp_path, slots) -> None:
    """Regression: held blocks at the budget, no free big row; a call [big B, small S] where
    S evicts the LRU-oldest key, which is big (E): B grows the big group by one row past
    the budget, E's stale row is punched to make up for it, then B may take E's row
    (un-punched), leaving the grown row free. With nothing in flight the tier must not
    hold a big row past ``disk_budget_nbytes`` (README: "Row blocks stay within
    capacity_bytes plus one growth step per group"; RowIndex.over_budget: "The tier then
    punches rows ... until it is back within"): a write batch ends with a reclaim when
    the tier is past the budget (io/_writes.py write_batch)."""
    root = tmp_path / "nvme"
    cap = 20 * ROW[BIG]
    tier = NVMeTier(**_kw(root, capacity_bytes=cap, grow_ahead=False))
    await tier.open()
    buf = slots(12, SLOT)
    first = [_key(i, SMALL) for i in range(100)]
    for i in range(0, 100, 10):
        assert await tier.write_rows(_rows(buf, first[i : i + 10])) == [None] * 10
    for k in first:  # their rows become free small rows that keep their blocks
        tier.discard(k)
    bigs = [_key(200 + i, BIG) for i in range(4)]
    for k in bigs:
        assert await tier.write_rows(_rows(buf, [k])) == [None]
    smalls = [_key(300 + i, SMALL) for i in range(75)]
    for i in range(0, 75, 5):
        assert await tier.write_rows(_rows(buf, smalls[i : i + 5])) == [None] * 5
    await tier.flush()
    await tier.drain()
    ix = tier._index
    assert ix.lru_keys()[0] == bigs[0]
    assert ix.free_rows(BIG) == 0
    assert ix.bytes_used == cap - ROW[BIG]
    assert ix.held_nbytes == ix.disk_budget_nbytes  # at the budget, not past it
    got = await tier.write_rows(_rows(buf, [_key(400, BIG), _key(401, SMALL)]))
    assert got == [None, None]
    await tier.flush()
    await tier.drain()  # nothing in flight
    check_row_states(ix)
    free_small_blocks = sum(ROW[SMALL] for r in ix._free[SMALL] if r not in ix._holed)
    assert free_small_blocks >= 20 * ROW[SMALL]  # rows that could have been punched
    on_disk = _blocks(tier.directory)
    over = ix.held_nbytes - ix.disk_budget_nbytes
    await tier.close()
    assert over <= 0, f"held {over} bytes past the disk budget with nothing in flight"
    assert on_disk <= ix.disk_budget_nbytes + 3 * 4096, on_disk - ix.disk_budget_nbytes


# ====================================================================== SIGKILL


CRASH_CAP = 20 * ROW[BIG] + 60 * ROW[SMALL]


async def _crash_child(root: str, log_path: str) -> None:
    """Write forever (two concurrent calls, mixed and bursty groups, rewrites), flush every
    round, logging each key before its write and the visible keys after each flush."""
    tier = NVMeTier(**_kw(root, capacity_bytes=CRASH_CAP))
    await tier.open()
    buf = Slots(16, SLOT)
    rng = random.Random(os.getpid())
    salt: dict[OffloadKey, int] = {}
    with open(log_path, "a") as log:
        n = 0
        print("ready", flush=True)
        while True:
            calls: list[list[OffloadKey]] = []
            for _call in range(2):
                keys: list[OffloadKey] = []
                for _ in range(rng.randint(1, 6)):
                    if salt and rng.random() < 0.1:
                        k = rng.choice(list(salt))
                        if any(k in ks for ks in calls) or k in keys:
                            continue
                        salt[k] += 1
                    else:
                        k = OffloadKey(f"c{os.getpid()}-{n}".encode(), rng.choice([0, 1, 1]))
                        n += 1
                        salt[k] = 0
                    keys.append(k)
                    log.write(
                        json.dumps({"w": [k.block_hash.decode(), k.group_id, salt[k]]}) + "\n"
                    )
                log.flush()
                calls.append(keys)
            await asyncio.gather(
                *(tier.write_rows(_rows(buf, ks, salt, first=8 * i)) for i, ks in enumerate(calls))
            )
            await tier.flush()
            # keys of an earlier (killed) child: -1, any salt it wrote
            names = list(tier.keys())
            vis = [[k.block_hash.decode(), k.group_id, salt.get(k, -1)] for k in names]
            log.write(json.dumps({"flushed": vis}) + "\n")
            log.flush()


def test_sigkill_with_unequal_rows_never_gives_wrong_bytes_or_brings_back_old_keys(
    tmp_path,
) -> None:
    """3 SIGKILLs of a child writing a full tier of unequal rows (with the window open).

    After each kill a reopen at the same capacity finds only keys visible at
    the last flush or written after it (a key evicted before the last flush
    never comes back: the reopen has room for every row), each with the bytes
    of one of its writes from then on (or failing its checksum, a row torn by
    the kill); flushed keys lost are no more than the later writes evict.
    The kills accumulate on one root: later children start from what the
    earlier ones left.
    """
    root = tmp_path / "nvme"
    rng = random.Random(12)
    checked = 0
    history: dict[tuple[str, int], set[int]] = {}  # every salt written, all children
    for it in range(3):
        log_path = tmp_path / f"log{it}"
        log_path.write_text("")
        err_path = tmp_path / f"err{it}"
        args = ["tests.reliability.test_nvme_unequal_rows", "crash", str(root), str(log_path)]
        kill_child(args, err_path, rng.uniform(0.5, 1.5))
        entries, last, allowed = kill_log(log_path, err_path, history)
        for e in entries[last + 1 :]:
            h, g, s = e["w"]
            allowed.setdefault((h, g), set()).add(s)
        found, _ = asyncio.run(_reopened(root))  # room for every row: nothing hides a comeback
        after = {(e["w"][0], e["w"][1]) for e in entries[last + 1 :]}
        checked += check_found(found, allowed, _data)
        # flushed keys lost: evicted by the writes after the flush (one big row: 5 small ones)
        flushed = {(h, g) for h, g, _ in entries[last]["flushed"]}
        names = {(k.block_hash.decode(), k.group_id) for k in found}
        assert len(flushed - names - after) <= 5 * len(after)
    assert checked > 100


if __name__ == "__main__" and sys.argv[1:2] == ["crash"]:
    asyncio.run(_crash_child(sys.argv[2], sys.argv[3]))
