"""The NVMe tier's row reuse.

A row evicted by LRU must not wait "unblanked" (its trailer still naming the
evicted key) in its group's free heap to be overwritten in place; the tests
whose docstrings start "Regression:" guard against the bugs that caused. A
row evicted for another group's write goes stale and is blanked in the same
write batch by zeroing its 4 KiB trailer, keeping its disk blocks (its
group's next write overwrites it in place); rows are punched only while the
rows holding blocks exceed ``disk_budget_nbytes`` (stale rows, then free rows
of the groups with the most free bytes, counted as punched at once). So an
evicted key never comes back after a crash once the write that evicted it
completed, unless its blanking failed (then only with its own bytes), and
never after a clean close.

Attacks, through ``NVMeTier``/``TransferEngine`` and faults injected only by
``row_io_wrapper`` or real subprocesses (``python -m
tests.reliability.test_nvme_row_reuse CMD ROOT`` runs a child workload that
ends with ``os._exit(0)``: a crash that keeps the page cache, like SIGKILL):

* disk blocks: stale rows blanked within the budget, reopen after a
  workload moved between groups, concurrent reclaims past the budget;
* crash recovery: evicted keys never coming back at a restart (next to
  flushed keys, discarded keys, keys evicted twice, a smaller capacity at
  reopen), SIGKILL during stores that overwrite evicted rows;
* faults: EIO on the blanking trailer write (in the evicting write, at
  close), failed ``fdatasync``, failed row writes and reads, in random
  concurrent interleavings;
* a read pinning a row while other groups' writes evict around it.

Coverage checks count evictions and the 4 KiB trailer writes that blank rows
(a counting ``RowIO`` wrapper): the evicted rows of other groups were blanked.

A test marked ``xfail(strict=True, reason="BUG ...")`` proves a bug the tier still has.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

import kvtier
from kvtier import OffloadKey
from kvtier.errors import StorageError
from kvtier.io import NVMeTier, RowIO

from ..io.conftest import GROUP_NBYTES, Slots, key, payload, tier_kwargs
from ..io.faults import CountingRowIO, DelegatingRowIO, Fault, FaultyRowIO
from ._model import Gpu, chunks_for, engine_config, load_check, nvme_config, store_ok
from .gated_io import read_payload, visible_payloads

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAILER = 4096
HEADER = 4096  # one per segment file
ROW = {g: -(-n // 4096) * 4096 + TRAILER for g, n in GROUP_NBYTES.items()}  # 20480, 8192, 16384
ENGINE_ROW0 = 12288  # a group-0 row of the reliability layout (8 KiB payload + trailer)
R = kvtier.Residency


# ====================================================================== helpers


def _name(k: OffloadKey) -> str:
    return f"{k.group_id}:{k.block_hash.decode()}"


def _blocks(directory: pathlib.Path, group_id: int | None = None) -> int:
    """Bytes of disk blocks of the segment files (one 4 KiB header each left out)."""
    return sum(
        p.stat().st_blocks * 512 - HEADER
        for p in directory.rglob("*.kvrows")
        if group_id is None or p.parent.name == f"g{group_id}"
    )


async def _write(tier: NVMeTier, buf: Slots, k: OffloadKey, salt: int = 0) -> None:
    data = payload(k, GROUP_NBYTES[k.group_id], salt)
    assert await tier.write_rows([(k, 0, 4, buf.fill(0, data))]) == [None], k


async def _reopened(root: pathlib.Path, **over: Any) -> dict[OffloadKey, bytes | None]:
    """Open the namespace, read every visible key, close."""
    tier = NVMeTier(**tier_kwargs(root, **over))
    await tier.open()
    try:
        return await visible_payloads(tier)
    finally:
        await tier.close()


def _reopen_snapshot(root: pathlib.Path, **over: Any) -> dict[OffloadKey, bytes | None]:
    return asyncio.run(_reopened(root, **over))


def _trailer_writes(io: CountingRowIO) -> int:
    """Blanked rows: 4 KiB writes past a file's header (a header is written at offset 0)."""
    return sum(1 for off, n in io.pwritev_calls if n == TRAILER and off > 0)


def _counting(holder: list[CountingRowIO]) -> Any:
    return lambda inner: holder.append(CountingRowIO(inner)) or holder[-1]


def _child(cmd: str, root: pathlib.Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.reliability.test_nvme_row_reuse", cmd, str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# =============================================================== regressions


async def test_discarded_rows_blanked_within_the_budget_are_punched_once_past_it(
    tmp_path, slots
) -> None:
    """Regression: stale rows blanked within the budget keep their disk blocks as plain free
    rows, and must still be punched, or a workload moving to another group holds disk blocks far
    above the budget (364 KiB vs 204 KiB).

    Eight group-0 keys fill the capacity and are discarded; the next write's
    reclaim zeroes their trailers (the tier is within its budget), so they
    become free rows that still hold disk blocks. The workload then moves to
    group 2 and takes the tier past its budget: ``RowIndex.take_to_punch``
    must punch those free group-0 rows, not only evicted rows (punching every
    blanked row would give 196 KiB here).
    """
    capacity = 8 * ROW[0]
    tier = NVMeTier(**tier_kwargs(tmp_path, capacity_bytes=capacity))
    await tier.open()
    budget = tier._index.disk_budget_nbytes
    buf = slots(8)
    old = [key(i, 0) for i in range(8)]
    rows = [(k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[0]))) for i, k in enumerate(old)]
    assert await tier.write_rows(rows) == [None] * 8
    await tier.flush()
    for k in old:
        tier.discard(k)
    n = 100
    for _ in range(6):  # the workload moved to group 2: twice its capacity of new keys
        rows = []
        for i in range(4):
            k = key(n, 2)
            n += 1
            rows.append((k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[2]))))
        assert await tier.write_rows(rows) == [None] * 4
        await tier.flush()
    assert tier.stats()["bytes_used"] <= capacity
    on_disk = _blocks(tier.directory)
    await tier.close()
    # README: disk blocks stay within capacity_bytes plus one growth step per group
    # (allow one row written between two reclaims and ext4 extent blocks)
    assert on_disk <= budget + ROW[0] + 3 * 4096, (on_disk, budget)


async def _evict_after_reopen(root: pathlib.Path, buf: Slots, history: bool) -> tuple[int, int]:
    """Fill group 2 (after group 0 when ``history``), close, reopen, evict one group-2 key.

    Returns the group-2 files' disk blocks before and after the eviction.
    """
    kw = tier_kwargs(root, capacity_bytes=8 * ROW[0])
    tier = NVMeTier(**kw)
    await tier.open()
    if history:
        for i in range(8):
            await _write(tier, buf, key(i, 0))
    for i in range(10):  # group 2 fills the capacity (group 0's rows are punched)
        await _write(tier, buf, key(100 + i, 2))
    await tier.flush()
    await tier.close()
    tier = NVMeTier(**kw)
    await tier.open()
    on_disk = _blocks(tier.directory)  # within the budget (+ ext4 extent blocks)
    assert on_disk <= tier._index.disk_budget_nbytes + 3 * 4096, on_disk
    before = _blocks(tier.directory, 2)
    await _write(tier, buf, key(200, 1))  # evicts one key of group 2 (fits in group 1's row)
    await tier.flush()
    after = _blocks(tier.directory, 2)
    assert tier.stats()["evictions"] == 1
    await tier.close()
    return before, after


async def test_row_evicted_within_the_budget_after_a_reopen_keeps_its_blocks(
    tmp_path, slots
) -> None:
    before, after = await _evict_after_reopen(tmp_path, slots(1), history=False)
    assert after == before


async def test_reopen_counts_punched_rows_as_holes_and_keeps_rows_evicted_within_budget(
    tmp_path, slots
) -> None:
    """Regression: after a restart that followed a workload shift, RowIndex.rebuild does not
    count punched rows as held, where over_budget would stay True and every row evicted by LRU
    would be punched instead of kept for an overwrite in place.

    The first open fills group 0, then group 2 (group 0's rows are punched, as
    designed). At reopen the tier is within its budget on disk, as in the
    control test above: the row evicted for a group-1 write keeps its blocks
    (the index learns at open which rows are holes: see the next test).
    """
    before, after = await _evict_after_reopen(tmp_path, slots(1), history=True)
    assert after == before, "a row evicted within the budget was punched"


async def test_reopen_punches_holes_not_free_rows_that_hold_blocks(tmp_path, slots) -> None:
    """Regression: RowIndex.rebuild does not count every allocated row as holding blocks,
    where after a restart that followed a workload shift the first reclaim would punch
    free rows that hold blocks (the group with most free bytes) instead of counting the
    holes.

    Five group-0 keys, then nine group-2 keys (group 0's rows are punched, as
    designed); the group-2 keys are discarded and blanked within the budget
    (their rows keep their blocks: group 2 then has the most free bytes). At
    reopen the rows holding blocks leave room for one more group-1 row in
    the budget (the scan maps the holes with FIEMAP), so one group-1 write
    punches nothing. (Nine, not ten: growth counts the rows that hold blocks,
    and ten group-2 keys fill the budget exactly.)
    """
    buf = slots(1)
    kw = tier_kwargs(tmp_path, capacity_bytes=8 * ROW[0])
    tier = NVMeTier(**kw)
    await tier.open()
    for i in range(5):
        await _write(tier, buf, key(i, 0))
    for i in range(9):
        await _write(tier, buf, key(100 + i, 2))
    await tier.flush()
    for i in range(9):
        tier.discard(key(100 + i, 2))
    await _write(tier, buf, key(300, 1))  # blanks the nine group-2 rows (within the budget)
    await tier.flush()
    assert not tier._index.over_budget
    kept = _blocks(tier.directory, 2)
    assert kept >= 9 * ROW[2]  # the blanked group-2 rows kept their blocks
    await tier.close()
    tier = NVMeTier(**kw)
    await tier.open()
    # within the budget, plus one 4 KiB block per file for ext4's extent tree (st_blocks
    # counts an extent index block once a file held more than four extents)
    files = len(list(tier.directory.rglob("*.kvrows")))
    assert _blocks(tier.directory) <= tier._index.disk_budget_nbytes + 4096 * files
    assert _blocks(tier.directory, 2) == kept
    await _write(tier, buf, key(301, 1))  # nothing evicted; group 1 grows by one 8 KiB row
    await tier.flush()
    after = _blocks(tier.directory, 2)
    await tier.close()
    assert after == kept, "free rows that hold blocks were punched within the budget"


async def test_growth_one_row_past_the_budget_punches_one_row_not_two(tmp_path, slots) -> None:
    """Regression: two concurrent reclaims (write_batch's and grow_step's) do not each count the
    same excess over the budget, so a growth one row past it punches one freed row, not two.
    """
    buf = slots(1)
    tier = NVMeTier(
        **tier_kwargs(tmp_path, capacity_bytes=3 * ROW[0] + 2 * ROW[2], grow_ahead=False)
    )
    await tier.open()
    for i in range(3):
        await _write(tier, buf, key(i, 0))
    for i in range(4):  # evict keys 0 and 1: two blanked group-0 rows that keep their blocks
        await _write(tier, buf, key(10 + i, 2))
    await _write(tier, buf, key(1, 0), salt=1)  # into key 2's row
    for i in range(4, 8):  # evict keys 10..13 (own rows: no growth)
        await _write(tier, buf, key(10 + i, 2))
    budget = tier._index.disk_budget_nbytes
    before = _blocks(tier.directory, 0), _blocks(tier.directory)
    assert before[1] + ROW[2] > budget  # the next group-2 row takes the tier past it
    assert before[1] + ROW[2] - ROW[0] <= budget  # one punched group-0 row is enough
    await _write(tier, buf, key(18, 2))  # evicts key 1 (group 0), grows group 2 by one row
    await tier.flush()
    after = _blocks(tier.directory, 0)
    await tier.close()
    assert after == before[0] - ROW[0], (before, after)


def test_a_crash_brings_back_no_evicted_key_to_push_out_a_flushed_visible_key(tmp_path) -> None:
    """Regression: after a crash, rows evicted by LRU do not come back unblanked at open with
    higher sequence numbers than an older, flushed, visible key, making RowIndex.rebuild evict
    that flushed key to fit capacity_bytes.
    """
    root = tmp_path / "nvme"
    at_crash = _child("tier-displace", root)
    flushed = key(0, 0)
    assert _name(flushed) in at_crash["visible"]  # visible, flushed and just read when it crashed
    found = _reopen_snapshot(root, capacity_bytes=4 * ROW[0])
    for k, data in found.items():  # guarantee 1 holds: whatever is found has its own bytes
        assert data == payload(k, GROUP_NBYTES[k.group_id]), k
    assert flushed in found, sorted(map(_name, found))
    # the evicted keys were blanked by the completed writes that evicted them
    assert sorted(map(_name, found)) == at_crash["visible"]


def test_engine_flushed_and_loaded_key_survives_a_crash(tmp_path) -> None:
    """Regression: a key stored, flushed and then loaded from NVMe is no MISS after a crash: the
    group-0 keys evicted after it by group-1 stores do not come back unblanked and push it out
    at open.
    """
    root = tmp_path / "nvme"
    at_crash = _child("engine-displace", root)
    assert at_crash["F"] == "nvme"
    assert at_crash["gone"]  # group-0 keys evicted by the group-1 stores...
    assert at_crash["trailers"] >= len(at_crash["gone"])  # ...and their rows blanked
    gpu = Gpu()
    f = chunks_for([_engine_key("F", 0)])[0]
    gone = [_engine_key(f"E{i}", 0) for i in at_crash["gone"]]

    async def run() -> None:
        async with kvtier.TransferEngine(gpu.layout, _engine_cfg(gpu, root)) as engine:
            assert engine.lookup([f.key]) == [R.NVME]
            res = await load_check(engine, gpu, [f])
            assert f.key in res.loaded
            assert R.NVME not in engine.lookup(gone)  # evicted keys never come back

    asyncio.run(run())


def test_discarded_key_never_comes_back_after_the_next_write_and_a_crash(tmp_path) -> None:
    """Regression: NVMeTier.discard blanks an older row of the key that an eviction left
    unblanked, so after the next write, a flush and a crash the discarded key does not come back
    with the bytes of its older write.
    """
    root = tmp_path / "nvme"
    at_crash = _child("tier-discard", root)
    visible = at_crash.pop("keys")
    assert at_crash == {"visible": False, "v2_read": True}
    k = key(1, 0)
    found = _reopen_snapshot(root)
    if k in found:  # its bytes are those of the first write (salt 0), not the last (salt 1)
        assert found[k] == payload(k, GROUP_NBYTES[0], 0)
    assert k not in found
    # nothing evicted (key 0, key 2) or discarded comes back; the rest with its own bytes
    assert sorted(map(_name, found)) == visible
    for other, data in found.items():
        assert data == payload(other, GROUP_NBYTES[other.group_id]), other


# ===================================================================== what holds


async def test_discard_of_a_key_evicted_before_never_returns_after_close(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    holder: list[CountingRowIO] = []
    tier = NVMeTier(**tier_kwargs(root, **_DISCARD_KW, row_io_wrapper=_counting(holder)))
    await tier.open()
    k = await _discard_workload(tier, holder[0], slots(1))
    assert not tier.contains(k)
    expect = await visible_payloads(tier)
    await tier.close()
    tier = NVMeTier(**tier_kwargs(root))  # room for every row on disk
    await tier.open()
    assert await visible_payloads(tier) == expect
    assert tier.stats()["invalid_rows_at_open"] == 0
    await tier.close()


def test_key_evicted_twice_then_a_crash_never_comes_back(tmp_path) -> None:
    """Two rows of K (salt 0, then salt 1) were evicted by completed writes: both blanked.

    Were both rows kept unblanked, a crash could bring K back (with its last
    bytes); the tier blanks each in the write that evicted it.
    """
    root = tmp_path / "nvme"
    at_crash = _child("tier-twice", root)
    visible = at_crash.pop("keys")
    # evictions: key 0 and K (other group), key 2 (own row, reused), keys 10..13 (own rows), K
    assert at_crash == {"trailers": 4, "evictions": 8, "visible": False}
    found = _reopen_snapshot(root)  # room for every row on disk
    k = key(1, 0)
    for other, data in found.items():
        if other != k:
            assert data == payload(other, GROUP_NBYTES[other.group_id]), other
    if k in found:  # two rows named it (salt 0, then salt 1): the later write wins
        assert found[k] == payload(k, GROUP_NBYTES[0], 1)
    assert k not in found
    assert sorted(map(_name, found)) == visible


def test_crash_then_reopen_smaller_then_close_never_brings_evicted_keys_back(tmp_path) -> None:
    root = tmp_path / "nvme"
    visible = _child("tier-twice", root)["keys"]  # a crash after a flush
    small = _reopen_snapshot(root, capacity_bytes=2 * ROW[0])  # rebuild evicts (stale rows)
    assert 0 < len(small) < 4
    assert set(map(_name, small)) < set(visible)  # never a key evicted before the crash
    again = _reopen_snapshot(root)  # the clean close above blanked all but the kept keys
    assert again == small


async def test_engine_clean_close_never_brings_back_an_evicted_key(tmp_path) -> None:
    gpu = Gpu()
    root = tmp_path / "nvme"
    keys = [_engine_key(f"E{i}", 0) for i in range(16)] + [
        _engine_key(f"G{i}", 1) for i in range(6)
    ]
    holder: list[CountingRowIO] = []
    async with kvtier.TransferEngine(
        gpu.layout, _engine_cfg(gpu, root, _counting(holder))
    ) as engine:
        for k in keys:  # group-1 stores evict group-0 rows: blanked by those stores
            await store_ok(engine, gpu, chunks_for([k], first_block=8))
            await engine.flush()
        on_nvme = set(engine._nvme.keys())
        assert engine.stats().nvme["evictions"] >= 4
        assert any(k.group_id == 0 and k not in on_nvme for k in keys)
        assert _trailer_writes(holder[0]) > 0
    async with kvtier.TransferEngine(gpu.layout, _engine_cfg(gpu, root)) as engine:
        found = engine.lookup(keys)
        assert {k for k, r in zip(keys, found, strict=True) if r is R.NVME} == on_nvme
        for k in on_nvme:
            res = await load_check(engine, gpu, chunks_for([k], first_block=8))
            assert k in res.loaded


class _TrailerWriteEIO(DelegatingRowIO):
    """EIO on every 4 KiB write past a header (a zeroed trailer: blanking) while ``armed``."""

    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner)
        self.armed = False
        self.hits = 0

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        if self.armed and nbytes == TRAILER and file_offset > 0:
            self.hits += 1
            raise OSError(errno.EIO, "injected EIO on a trailer write")
        return self.inner.pwritev(handle, bufs, file_offset)


async def test_failed_blanking_is_counted_and_brings_back_only_own_bytes(tmp_path, slots) -> None:
    """Blanking an evicted row (in the evicting write) and a discarded row (at close) fails.

    Documented: a failed blanking is logged and counted, neither the write nor
    the close raises, and the key may come back after a restart, with its own
    bytes only.
    """
    holder: list[_TrailerWriteEIO] = []
    root = tmp_path / "nvme"
    kw = tier_kwargs(
        root,
        capacity_bytes=4 * ROW[0] + 2 * ROW[2],
        grow_ahead=False,
        row_io_wrapper=lambda inner: holder.append(_TrailerWriteEIO(inner)) or holder[-1],
    )
    tier = NVMeTier(**kw)
    await tier.open()
    buf = slots(1)
    keys = [key(i, g) for i, g in [(0, 0), (10, 2), (11, 2), (1, 0), (2, 0), (3, 0), (12, 2)]]
    for k in keys[:-1]:
        await _write(tier, buf, k)
    holder[0].armed = True
    await _write(tier, buf, keys[-1])  # evicts the first key (another group's row): EIO
    assert tier.stats()["evictions"] == 1
    assert not tier.contains(keys[0])
    assert holder[0].hits == 1
    assert tier.stats()["reclaim_failures"] == 1
    discarded = keys[1]
    tier.discard(discarded)  # blanked by the close: EIO again
    expect = await visible_payloads(tier)
    await tier.close()
    assert holder[0].hits == 2
    assert tier.stats()["reclaim_failures"] == 2
    found = await _reopened(root)
    assert {k: v for k, v in found.items() if k not in (keys[0], discarded)} == expect
    for k in (keys[0], discarded):
        if k in found:  # it may come back, with its own bytes only
            assert found[k] == payload(k, GROUP_NBYTES[k.group_id]), k


async def test_failed_fdatasync_after_an_overwrite_in_place_then_close_loses_both_keys(
    tmp_path, slots
) -> None:
    """A key written over an evicted, blanked row, then failed syncs: neither key comes back.

    Neither the new key (not known durable) nor key 10, evicted by its write.
    """
    armed: list[bool] = [False]
    holder: list[FaultyRowIO] = []
    sync_fault = Fault("fdatasync", "errno", match=lambda *_: armed[0])  # every segment's
    root = tmp_path / "nvme"
    tier = NVMeTier(
        **tier_kwargs(
            root,
            capacity_bytes=4 * ROW[0] + 2 * ROW[2],
            grow_ahead=False,
            row_io_wrapper=lambda inner: (
                holder.append(FaultyRowIO(inner, [sync_fault])) or holder[-1]
            ),
        )
    )
    await tier.open()
    buf = slots(1)
    keys = [key(i, g) for i, g in [(0, 0), (10, 2), (11, 2), (1, 0), (2, 0), (3, 0), (12, 2)]]
    for k in keys:  # the last evicts key 0: group 0's row 0 is blanked, keeps its blocks
        await _write(tier, buf, k)
    await tier.flush()
    holder[0].reset()
    new = key(20, 0)
    await _write(tier, buf, new)  # evicts key 10 (group 2); takes row 0 in place
    assert sorted(holder[0].pwritev_calls) == [
        (HEADER, ROW[0]),  # row 0 of group 0's segment
        (HEADER + ROW[2] - TRAILER, TRAILER),  # the trailer of key 10's row, in group 2's
    ]
    armed[0] = True
    with pytest.raises(StorageError):
        await tier.flush()
    armed[0] = False
    assert not tier.contains(new)  # dropped: not known durable
    expect = await visible_payloads(tier)
    assert set(expect) == set(keys[1:]) - {key(10, 2)}
    await tier.close()
    found = await _reopened(root)
    assert found == expect


class _GatedReads(DelegatingRowIO):
    """Blocks row reads (> 4 KiB) of one file offset until ``gate`` is set."""

    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner)
        self.offset: int | None = None
        self.gate = threading.Event()
        self.entered = threading.Event()

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        if file_offset == self.offset and sum(memoryview(b).nbytes for b in bufs) > TRAILER:
            self.entered.set()
            assert self.gate.wait(30)
        return self.inner.preadv(handle, bufs, file_offset)


async def test_row_pinned_by_a_read_is_never_evicted_or_overwritten_by_other_groups_writes(
    tmp_path, slots
) -> None:
    holder: list[_GatedReads] = []
    tier = NVMeTier(
        **tier_kwargs(
            tmp_path,
            capacity_bytes=4 * ROW[0],
            grow_ahead=False,
            row_io_wrapper=lambda inner: holder.append(_GatedReads(inner)) or holder[-1],
        )
    )
    await tier.open()
    io = holder[0]
    buf = slots(8)
    g0 = [key(i, 0) for i in range(4)]
    for k in g0:
        await _write(tier, buf, k)
    io.offset = 4096  # row 0 of the group-0 segment: key 0's row
    out = slots(1)
    read = asyncio.ensure_future(tier.read_rows([(g0[0], out[0])]))
    await asyncio.get_running_loop().run_in_executor(None, io.entered.wait, 10)
    # group 2 writes need room: everything but the pinned key is evicted, rows blanked
    results = []
    for i in range(6):
        k = key(100 + i, 2)
        results.append(await tier.write_rows([(k, 0, 4, buf.fill(1, payload(k, GROUP_NBYTES[2])))]))
    # then group 0 writes: they take the evicted group-0 rows in place, never the pinned one
    for i in range(3):
        k = key(200 + i, 0)
        results.append(await tier.write_rows([(k, 0, 4, buf.fill(2, payload(k, GROUP_NBYTES[0])))]))
    assert tier.contains(g0[0])
    io.gate.set()
    assert await read == [(0, 4)]
    assert bytes(out[0][: GROUP_NBYTES[0]]) == payload(g0[0], GROUP_NBYTES[0])
    assert any(r == [None] for r in results)
    for k, data in (await visible_payloads(tier)).items():
        assert data == payload(k, GROUP_NBYTES[k.group_id]), k
    await tier.close()


def test_sigkill_while_stores_overwrite_evicted_rows_never_gives_wrong_bytes(tmp_path) -> None:
    """A child writes forever (group mix shifting, every key its own salt per rewrite); 6 kills."""
    root = tmp_path / "nvme"
    rng = random.Random(10)
    total = 0
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.test_nvme_row_reuse", "forever", str(root)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        found = _reopen_snapshot(root, capacity_bytes=_KILL_CAPACITY)
        total += len(found)
        for k, data in found.items():
            i = int(k.block_hash.decode().split("-")[1])
            assert data in {payload(k, GROUP_NBYTES[k.group_id], s) for s in _kill_salts(i)}, k
    assert total > 0


# ---------------------------------------------------------------------- random interleavings


class _Faults(FaultyRowIO):
    """Row write / row read / fdatasync EIO, each with a probability while ``on``.

    Trailer writes (blanking) never fail here: a blanked row is known blank.
    """

    def __init__(self, inner: RowIO, rng: random.Random) -> None:
        self.on = False
        big = lambda op, off, n: self.on and n > TRAILER and rng.random() < 0.08  # noqa: E731
        sync = lambda op, off, n: self.on and rng.random() < 0.1  # noqa: E731
        super().__init__(
            inner,
            [
                Fault("pwritev", "errno", big),
                Fault("preadv", "errno", big),
                Fault("fdatasync", "errno", sync),
            ],
        )


async def _crash(tier: NVMeTier) -> None:
    """A crash with the page cache kept: no final reclaim, no sync; files and lock released."""
    await tier.drain()
    await tier._release()
    tier._state = "closed"


SEEDS = [int(x) for x in os.environ.get("REUSE10_SEEDS", "5,17,20").split(",")]


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_interleavings_never_give_wrong_bytes_across_close_and_crash(
    tmp_path, seed
) -> None:
    """Concurrent writes (shifting groups), reads, discards, flushes; faults; crash or close.

    Every read returns the key's last successfully written bytes. After a
    crash every key found has the bytes of one of its writes, a key that
    was visible (flushed) at the crash is found with those bytes or not at
    all, and a key that was not is found only if it left the tier (evicted,
    discarded, dropped, failed) after the start of the last write_rows call:
    every write blanks the stale rows before it, and the rows it evicts.
    After a clean close exactly the visible keys come back, bitwise,
    never an evicted or discarded one; a reopen with a smaller capacity keeps
    a subset, and after its clean close exactly that subset comes back.
    """
    rng = random.Random(seed)
    fault_rng = random.Random(seed + 1000)  # drawn on I/O threads
    root = tmp_path / "nvme"
    versions: dict[OffloadKey, set[bytes]] = {}  # every payload ever written per key
    salts: dict[OffloadKey, int] = {}
    buf = Slots(48, 8 * 4096)
    faults: list[_Faults] = []
    kw = tier_kwargs(
        root,
        capacity_bytes=24 * ROW[0],
        io_threads=3,
        row_io_wrapper=lambda inner: faults.append(_Faults(inner, fault_rng)) or faults[-1],
    )
    exact: dict[OffloadKey, bytes | None] | None = {}  # what the next open finds (clean close)
    crashed: dict[OffloadKey, bytes] = {}  # visible and flushed at the last crash
    # the step at which a key was last seen leaving the tier (or failing a write)
    gone_at: dict[OffloadKey, int] = {}
    step = last_write = -1  # last_write: the last step with a write_rows call
    trailers = evictions = must_be_gone = 0
    try:
        for session in range(4):
            tier = NVMeTier(**kw)
            await tier.open()
            io = faults[-1]
            found = await visible_payloads(tier)
            if exact is not None:
                assert found == exact, session
            for k, data in found.items():
                assert data in versions[k], (session, k)
                if k in crashed:  # its flushed row has the highest sequence number of the key
                    assert data == crashed[k], (session, k)
                elif exact is None:  # after a crash: blanked by a later write, unless none ran
                    assert gone_at[k] >= last_write, (session, k, gone_at[k], last_write)
            if exact is None:
                must_be_gone += sum(1 for k in versions if gone_at.get(k, step) < last_write)
            step += 1
            now = set(found)
            for k in versions:  # rows the open found beyond the capacity are stale now
                if k not in now:
                    gone_at[k] = step
            last = {k: d for k, d in found.items() if d is not None}
            io.on = True
            phase = rng.randrange(3)
            slot = 0
            for _ in range(14):
                step += 1
                before = now
                if rng.random() < 0.3:
                    phase = rng.randrange(3)
                ops: list[Any] = []
                used: set[OffloadKey] = set()
                for _ in range(rng.randint(1, 4)):
                    rows = []
                    for _ in range(rng.randint(1, 4)):
                        g = phase if rng.random() < 0.8 else rng.randrange(3)
                        k = key(rng.randrange(40), g)
                        if k in used:
                            continue
                        used.add(k)
                        salts[k] = salts.get(k, 0) + 1  # < 256: payload() keeps 8 bits
                        data = payload(k, GROUP_NBYTES[g], salts[k])
                        versions.setdefault(k, set()).add(data)
                        rows.append((k, 0, 4, buf.fill(slot % 48, data), data))
                        slot += 1
                    if rows:
                        ops.append(("w", rows))
                vis = [k for k in list(tier.keys()) if k not in used]
                for k in rng.sample(vis, min(len(vis), rng.randint(0, 3))):
                    used.add(k)
                    ops.append(("r", k, slot % 48))
                    slot += 1
                if vis and rng.random() < 0.05:
                    k = rng.choice(vis)
                    if k not in used:
                        tier.discard(k)
                        last.pop(k, None)
                results = await asyncio.gather(
                    *(
                        tier.write_rows([r[:4] for r in op[1]])
                        if op[0] == "w"
                        else tier.read_rows([(op[1], buf[op[2]])])
                        for op in ops
                    )
                )
                if any(op[0] == "w" for op in ops):
                    last_write = step
                for op, res in zip(ops, results, strict=True):
                    if op[0] == "w":
                        for row, r in zip(op[1], res, strict=True):
                            if r is None:
                                last[row[0]] = row[4]
                    elif not isinstance(res[0], BaseException):
                        k = op[1]
                        got = bytes(buf[op[2]][: GROUP_NBYTES[k.group_id]])
                        assert got == last[k], (session, k)
                if rng.random() < 0.4:
                    with contextlib.suppress(StorageError):
                        await tier.flush()
                now = set(tier.keys())
                written = {row[0] for op in ops if op[0] == "w" for row in op[1]}
                for k in (before | written) - now:
                    gone_at[k] = step
            io.on = False
            evictions += int(tier.stats()["evictions"])
            trailers += _trailer_writes(io)
            visible = {k: last[k] for k in list(tier.keys())}
            if session % 2 == 0:
                await tier.flush()  # nothing fails now: every visible key is durable
                await _crash(tier)
                exact, crashed = None, visible
                continue
            expect = await visible_payloads(tier)
            assert expect == visible
            await tier.close()
            small = NVMeTier(**{**kw, "capacity_bytes": rng.randint(3, 12) * ROW[0]})
            await small.open()
            exact, crashed = await visible_payloads(small), {}
            assert exact.items() <= expect.items(), session
            await small.close()
        assert evictions > 0
        assert trailers > 0  # rows were blanked (evicted, discarded, failed, dropped)
        assert must_be_gone > 0  # the crash check above covered keys that left the tier
    finally:
        buf.close()


# ====================================================================== child workloads

_DISCARD_KW: dict[str, Any] = {"capacity_bytes": 3 * ROW[0] + 2 * ROW[2], "grow_ahead": False}
_KILL_CAPACITY = 10 * ROW[0]


async def _discard_workload(tier: NVMeTier, io: CountingRowIO, buf: Slots) -> OffloadKey:
    """K (salt 0) is evicted, written again (salt 1), discarded; a write, a flush.

    ``io`` counts the tier's requests: every evicted or discarded row must be
    blanked (one 4 KiB trailer write) by the next write that completes.
    """
    k = key(1, 0)
    for x in (key(0, 0), k, key(2, 0)):  # rows 0, 1, 2 of group 0
        await _write(tier, buf, x)
    for i in range(4):  # the third and fourth evict key 0 then K (rows of another group)
        await _write(tier, buf, key(10 + i, 2))
    assert not tier.contains(k)
    assert tier.stats()["evictions"] == 2
    assert _trailer_writes(io) == 2  # blanked by the writes that evicted them
    await _write(tier, buf, k, salt=1)  # into key 2's row (evicted for it, own group)
    assert await read_payload(tier, buf, k) == payload(k, GROUP_NBYTES[0], 1)
    tier.discard(k)
    await _write(tier, buf, key(3, 0))  # blanks the discarded row, takes key 0's old row
    await tier.flush()
    assert _trailer_writes(io) == 3
    return k


async def _child_tier_displace(root: str, buf: Slots) -> dict[str, Any]:
    tier = NVMeTier(**tier_kwargs(root, capacity_bytes=4 * ROW[0], grow_ahead=False))
    await tier.open()
    flushed = key(0, 0)
    await _write(tier, buf, flushed)
    await tier.flush()
    for i in range(1, 4):  # the capacity is full of group 0
        await _write(tier, buf, key(i, 0))
    got = await read_payload(tier, buf, flushed)  # now the MRU
    assert got == payload(flushed, GROUP_NBYTES[0])
    for i in range(10, 13):  # each evicts the LRU key of group 0 (not the one just read)
        await _write(tier, buf, key(i, 2))
    await tier.flush()
    return {"visible": sorted(map(_name, tier.keys()))}


async def _child_tier_discard(root: str, buf: Slots) -> dict[str, Any]:
    holder: list[CountingRowIO] = []
    tier = NVMeTier(**tier_kwargs(root, **_DISCARD_KW, row_io_wrapper=_counting(holder)))
    await tier.open()
    k = await _discard_workload(tier, holder[0], buf)
    return {"visible": tier.contains(k), "v2_read": True, "keys": sorted(map(_name, tier.keys()))}


async def _child_tier_twice(root: str, buf: Slots) -> dict[str, Any]:
    """K is written (salt 0), evicted, written again (salt 1) into another row, evicted again."""
    capacity = 3 * ROW[0] + 2 * ROW[2] - 4096  # no growth past the budget: nothing punched
    holder: list[CountingRowIO] = []
    tier = NVMeTier(
        **tier_kwargs(
            root, capacity_bytes=capacity, grow_ahead=False, row_io_wrapper=_counting(holder)
        )
    )
    await tier.open()
    k = key(1, 0)
    await _write(tier, buf, key(50, 1))
    for x in (key(0, 0), k, key(2, 0)):
        await _write(tier, buf, x)
    tier.discard(key(50, 1))  # a free group-1 row for the last write (no growth)
    for i in range(4):
        await _write(tier, buf, key(10 + i, 2))  # evict key 0, then K (blanked, blocks kept)
    await _write(tier, buf, k, salt=1)  # into key 2's row; K's first row is blank
    for i in range(4, 8):  # evict keys 10..13 (own rows)
        await _write(tier, buf, key(10 + i, 2))
    await _write(tier, buf, key(51, 1))  # evicts K again: its second row is blanked too
    await tier.flush()
    return {
        "trailers": _trailer_writes(holder[0]),  # key 50 (discarded), key 0, K twice
        "evictions": tier.stats()["evictions"],
        "visible": tier.contains(k),
        "keys": sorted(map(_name, tier.keys())),
    }


def _engine_key(name: str, group_id: int) -> OffloadKey:
    from ._model import key as model_key

    return model_key(name, group_id)


def _engine_cfg(gpu: Gpu, root: str | pathlib.Path, wrapper: Any = None) -> kvtier.EngineConfig:
    nvme = nvme_config(root, capacity_bytes=16 * ENGINE_ROW0, grow_ahead=False, wrapper=wrapper)
    return engine_config(gpu, 4, nvme)


async def _child_engine_displace(root: str, _: Slots) -> dict[str, Any]:
    gpu = Gpu()
    f = chunks_for([_engine_key("F", 0)])[0]
    holder: list[CountingRowIO] = []
    cfg = _engine_cfg(gpu, root, _counting(holder))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, [f])
        await engine.flush()
        for i in range(15):  # the NVMe capacity is full of group 0; F left the CPU slots
            await store_ok(engine, gpu, chunks_for([_engine_key(f"E{i}", 0)], first_block=8))
            await engine.flush()
        res = await load_check(engine, gpu, [f])  # promoted from NVMe: F is the MRU row
        assert f.key in res.loaded
        holder[0].reset()
        for i in range(4):  # group 1 stores evict the LRU group-0 rows (E0..E2), not F
            await store_ok(engine, gpu, chunks_for([_engine_key(f"G{i}", 1)]))
            await engine.flush()
        e_keys = [_engine_key(f"E{i}", 0) for i in range(15)]
        gone = [i for i, r in enumerate(engine.lookup(e_keys)) if r is not R.NVME]
        out = {"F": engine.lookup([f.key])[0].value, "gone": gone}
        print(json.dumps({**out, "trailers": _trailer_writes(holder[0])}), flush=True)
        os._exit(0)  # inside the engine's context: no aclose (a crash)
    raise AssertionError("unreachable")


def _kill_salts(i: int) -> range:
    return range(i % 5 + 1)


async def _child_forever(root: str, buf: Slots) -> None:
    holder: list[CountingRowIO] = []
    tier = NVMeTier(
        **tier_kwargs(
            root,
            capacity_bytes=_KILL_CAPACITY,
            segment_nbytes=256 << 10,
            row_io_wrapper=_counting(holder),
        )
    )
    await tier.open()
    rng = random.Random(os.getpid())
    phase, ready = 0, False
    while True:
        if not ready and tier.stats()["evictions"] > 20 and _trailer_writes(holder[0]) > 5:
            print("ready", flush=True)  # evicted rows are blanked and overwritten in place
            ready = True
        if rng.random() < 0.1:
            phase = rng.randrange(3)
        rows, seen = [], set()
        for j in range(rng.randint(1, 6)):
            g = phase if rng.random() < 0.8 else rng.randrange(3)
            i = rng.randrange(60)
            k = key(i, g)
            if k in seen:
                continue
            seen.add(k)
            salt = rng.choice(_kill_salts(i))
            rows.append((k, 0, 4, buf.fill(j, payload(k, GROUP_NBYTES[g], salt))))
        await tier.write_rows(rows)
        if rng.random() < 0.3:
            await tier.flush()


_CHILDREN = {
    "tier-displace": _child_tier_displace,
    "tier-discard": _child_tier_discard,
    "tier-twice": _child_tier_twice,
    "engine-displace": _child_engine_displace,
    "forever": _child_forever,
}


async def _child_main(cmd: str, root: str) -> None:
    buf = Slots(8, 8 * 4096)
    out = await _CHILDREN[cmd](root, buf)
    print(json.dumps(out), flush=True)
    os._exit(0)  # no close: a crash after the last flush (the page cache stays)


if __name__ == "__main__":
    asyncio.run(_child_main(sys.argv[1], sys.argv[2]))
