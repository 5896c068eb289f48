"""Rows freed by LRU eviction keep their disk blocks and are overwritten in place.

Within its disk budget the tier blanks an evicted row by zeroing its 4 KiB
trailer, not by punching a hole: its group's next write overwrites written
blocks (on ext4 1.7-1.9x a write into punched or fresh blocks; README
"Steady state"), and an evicted key never comes back after a restart, crash
or not. Past the budget (the workload moved to other groups), freed rows are
punched, so disk blocks stay within ``capacity_bytes`` plus one growth step
per group.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
from typing import Any

import pytest

from kvtier.io import NVMeTier

from ._child import EVICT_CAPACITY, EVICT_ORDER, start_child
from .conftest import GROUP_NBYTES, key, payload, tier_kwargs
from .faults import CountingRowIO

TRAILER = 4096


def _disk(directory: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Segment file -> (apparent size, bytes of disk blocks)."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_blocks * 512)
        for p in sorted(directory.rglob("*.kvrows"))
    }


def _assert_no_hole_and_no_growth(before: dict, after: dict) -> None:
    assert after.keys() == before.keys()
    for name, (size, blocks) in after.items():
        assert size == before[name][0], name  # no growth
        # no hole punched (a row is 8-20 KiB; ext4 may free a 4 KiB block of its extent tree)
        assert blocks >= before[name][1] - 4096, name


def _row(g: int) -> int:
    """Bytes of one row of group ``g``: payload padded to 4 KiB, plus the trailer."""
    return -(-GROUP_NBYTES[g] // 4096) * 4096 + TRAILER


def _counting(holder: list[CountingRowIO]) -> Any:
    return lambda inner: holder.append(CountingRowIO(inner)) or holder[-1]


async def test_evicted_rows_keep_their_blocks_and_are_overwritten_in_place(tmp_path, slots) -> None:
    holder: list[CountingRowIO] = []
    row0, row2 = _row(0), _row(2)
    tier = NVMeTier(
        **tier_kwargs(
            tmp_path, capacity_bytes=4 * row0 + 4 * row2, row_io_wrapper=_counting(holder)
        )
    )
    await tier.open()
    buf = slots(8)

    async def write(keys: list) -> None:
        for i, k in enumerate(keys):  # one call each: the LRU follows this order
            data = payload(k, GROUP_NBYTES[k.group_id])
            assert await tier.write_rows([(k, 0, 4, buf.fill(i, data))]) == [None]
        await tier.flush()

    first = [key(i, i % 2 * 2) for i in range(8)]  # groups 0 and 2 alternate
    await write(first)
    before = _disk(tier.directory)
    io = holder[0]
    io.reset()
    # group 2 first: every write evicts a key of the other group
    second = [key(100 + i, (i + 1) % 2 * 2) for i in range(8)]
    await write(second)
    assert tier.stats()["evictions"] == 8
    assert set(tier.keys()) == set(second)
    _assert_no_hole_and_no_growth(before, _disk(tier.directory))
    blanked = [n for _, n in io.pwritev_calls if n == TRAILER]
    assert 0 < len(blanked) <= 8  # a zeroed trailer per row evicted for another group
    assert len(io.pwritev_calls) - len(blanked) == 8  # and the eight rows
    out = slots(8)
    got = await tier.read_rows([(k, out[i]) for i, k in enumerate(second)])
    assert got == [(0, 4)] * 8
    for i, k in enumerate(second):
        assert bytes(out[i][: GROUP_NBYTES[k.group_id]]) == payload(k, GROUP_NBYTES[k.group_id])
    await tier.close()


async def test_an_evicted_row_is_blanked_at_once_and_keeps_its_blocks(tmp_path, slots) -> None:
    holder: list[CountingRowIO] = []
    kw = tier_kwargs(
        tmp_path,
        capacity_bytes=EVICT_CAPACITY,
        row_io_wrapper=_counting(holder),
        grow_ahead=False,
    )
    tier = NVMeTier(**kw)
    await tier.open()
    buf = slots(1)
    keys = [key(i, g) for i, g in EVICT_ORDER]
    for k in keys[:-1]:
        data = payload(k, GROUP_NBYTES[k.group_id])
        assert await tier.write_rows([(k, 0, 4, buf.fill(0, data))]) == [None]
    blocks = _disk(tier.directory)
    holder[0].reset()
    last = keys[-1]  # of group 2: evicts the first key, of group 0
    data = payload(last, GROUP_NBYTES[2])
    assert await tier.write_rows([(last, 0, 4, buf.fill(0, data))]) == [None]
    await tier.drain()
    assert tier.stats()["evictions"] == 1
    assert sorted(n for _, n in holder[0].pwritev_calls) == [TRAILER, _row(2)]
    after = _disk(tier.directory)
    g0 = [n for n in after if n.startswith("g0")]
    _assert_no_hole_and_no_growth({n: blocks[n] for n in g0}, {n: after[n] for n in g0})
    await tier.close()
    again = NVMeTier(**tier_kwargs(tmp_path, capacity_bytes=64 << 20))  # room for every key
    await again.open()
    assert set(again.keys()) == set(keys[1:])  # the evicted key stays gone
    assert again.stats()["invalid_rows_at_open"] == 0
    await again.close()


def _reopen_and_read(root: pathlib.Path) -> dict[str, Any]:
    proc = start_child("dump", str(root), json.dumps({"capacity_bytes": 64 << 20}))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return json.loads(out)


def test_an_evicted_key_does_not_come_back_after_a_crash(tmp_path) -> None:
    keys = [key(i, g) for i, g in EVICT_ORDER]
    names = {f"{k.group_id}:{k.block_hash.decode()}": k for k in keys}
    for close in (False, True):
        root = tmp_path / f"close{int(close)}"
        proc = start_child("evict", str(root), "1" if close else "0")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert json.loads(out) == {"evictions": 1}
        found = _reopen_and_read(root)  # with room for every key written
        for name, value in found.items():
            k = names[name]
            nbytes = GROUP_NBYTES[k.group_id]
            assert value == [0, 4, hashlib.sha256(payload(k, nbytes)).hexdigest()], name
        evicted = f"0:{keys[0].block_hash.decode()}"
        assert set(found) == set(names) - {evicted}


async def test_workload_moving_between_groups_punches_freed_rows_within_the_budget(
    tmp_path, slots
) -> None:
    row0 = _row(0)
    capacity = 8 * row0
    tier = NVMeTier(**tier_kwargs(tmp_path, capacity_bytes=capacity))
    await tier.open()
    budget = tier._index.disk_budget_nbytes
    buf = slots(4)
    n = 0
    for rnd in range(4):  # fill the capacity with group 0, then group 2, then back
        g = 0 if rnd % 2 == 0 else 2
        for _ in range(4):
            rows = []
            for i in range(4):
                k = key(n, g)
                n += 1
                rows.append((k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[g]))))
            assert await tier.write_rows(rows) == [None] * 4
            await tier.flush()
        assert tier.stats()["bytes_used"] <= capacity
        disk = _disk(tier.directory)
        on_disk = sum(blocks - TRAILER for _, blocks in disk.values())
        # plus one 4 KiB block per file for ext4's extent tree: st_blocks counts an
        # extent index block once a file held more than four extents (punched rows)
        assert on_disk <= budget + row0 + 4096 * len(disk), (rnd, on_disk, budget)
    await tier.close()
    disk = _disk(tier.directory)
    on_disk = sum(blocks - TRAILER for _, blocks in disk.values())
    assert on_disk <= budget + 4096 * len(disk), (on_disk, budget)


def test_allocated_extents_tell_punched_rows_from_rows_that_hold_blocks(tmp_path) -> None:
    from kvtier.io._files import _punch_hole, allocated_extents

    row = 64 << 10
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, 8 * row)  # unwritten extents hold blocks too
        os.pwrite(fd, b"x" * row, 2 * row)  # one written row among them
        assert _punch_hole(fd, 3 * row, row)
        assert _punch_hole(fd, 6 * row, 2 * row)
        extents = allocated_extents(fd, 8 * row)
        if extents is None:
            pytest.skip("this filesystem does not answer FIEMAP")
        covered = [any(lo < (i + 1) * row and hi > i * row for lo, hi in extents) for i in range(8)]
        assert covered == [True, True, True, False, True, True, False, False]
        first = allocated_extents(fd, 2 * row)  # only what maps the first two rows
        assert first
        assert all(lo < 2 * row for lo, _ in first)
    finally:
        os.close(fd)
    assert allocated_extents(object(), row) is None  # no file descriptor: not known


def test_a_row_the_extents_cover_only_in_part_counts_as_punched() -> None:
    """A punch that failed part way leaves a row with some blocks: a write into it could
    fail on a full filesystem, so it counts as punched (its blocks are allocated before
    it is written); only rows the extents cover whole hold their blocks."""
    from kvtier.io._files import GroupSpec, _rows_without_blocks

    spec = GroupSpec(0, b"d" * 16, 8192, 8192, 12288, 4)
    row, first = spec.row_nbytes, spec.row_offset(0)
    extents = [
        (0, first + row),  # header and row 0
        (first + row, first + row + 4096),  # the first page of row 1 only
        (first + 2 * row, first + 2 * row + 4096),  # row 2 in two extents that meet
        (first + 2 * row + 4096, first + 3 * row),
        (first + 4 * row + 4096, first + 5 * row),  # row 4 but its first page
    ]
    assert _rows_without_blocks(spec, 6, extents) == [1, 3, 4, 5]


async def test_where_holes_cannot_be_punched_free_rows_are_not_blanked_again(
    tmp_path, slots, monkeypatch
) -> None:
    """Regression: past the budget on a filesystem without PUNCH_HOLE, a reclaim does not
    take the same free rows and zero their (blank) trailers again, forever."""
    import kvtier.io._files as files

    monkeypatch.setattr(files, "_fallocate", False)  # as where fallocate is missing
    holder: list[CountingRowIO] = []
    tier = NVMeTier(
        **tier_kwargs(tmp_path, capacity_bytes=8 * _row(0), row_io_wrapper=_counting(holder))
    )
    await tier.open()
    buf = slots(4)
    n = 0
    for g in (0, 2, 2, 2, 2, 2, 2):  # fill with group 0, then the workload moves to group 2
        rows = []
        for i in range(4):
            k = key(n, g)
            n += 1
            rows.append((k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[g]))))
        holder[0].reset()
        assert await tier.write_rows(rows) == [None] * 4
        await tier.drain()
        trailers = [c for c in holder[0].pwritev_calls if c[1] == TRAILER and c[0] > 0]
        # at most one zeroed trailer per row freed by this call (it evicts one row per write)
        assert len(trailers) <= 4, (g, len(trailers))
        assert len({off for off, _ in trailers}) == len(trailers)
    assert tier._index.over_budget  # past the budget: the blocks stay (nothing to punch)
    assert tier.stats()["bytes_used"] <= 8 * _row(0)
    await tier.close()


async def _full_tier_blanking(root: pathlib.Path, slots: Any, window: int) -> dict[str, Any]:
    """Fill a tier with 320 keys of random groups, write 200 more; what happened."""
    rng = random.Random(7)
    first = [key(i, rng.randrange(3)) for i in range(320)]
    second = [key(1000 + i, rng.randrange(3)) for i in range(200)]
    holder: list[CountingRowIO] = []
    capacity = sum(_row(k.group_id) for k in first)
    tier = NVMeTier(
        **tier_kwargs(
            root,
            capacity_bytes=capacity,
            row_io_wrapper=_counting(holder),
            eviction_window=window,
        )
    )
    await tier.open()
    buf = slots(8)

    async def write(keys: list) -> None:
        # Calls of 8 keys (the window is 10 keys; were calls published group by
        # group, runs of one group in the LRU would stay short)
        for b in range(0, len(keys), 8):
            rows = [
                (k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id])))
                for i, k in enumerate(keys[b : b + 8])
            ]
            assert await tier.write_rows(rows) == [None] * len(rows)
        await tier.flush()

    await write(first)
    lru = tier._index.lru_keys()  # all groups, least recently used first
    holder[0].reset()
    await write(second)
    blanked = sum(n == TRAILER for _, n in holder[0].pwritev_calls)
    live = list(tier.keys())
    evictions = tier.stats()["evictions"]
    window_evictions = tier.stats()["window_evictions"]
    await tier.close()
    again = NVMeTier(**tier_kwargs(root, capacity_bytes=64 << 20))  # room for every key
    await again.open()
    reopened = set(again.keys())
    out = slots(len(reopened))
    got = await again.read_rows([(k, out[i]) for i, k in enumerate(reopened)])
    assert got == [(0, 4)] * len(reopened)
    for i, k in enumerate(reopened):
        nbytes = GROUP_NBYTES[k.group_id]
        assert bytes(out[i][:nbytes]) == payload(k, nbytes)
    await again.close()
    assert evictions == len(first) + len(second) - len(live)
    assert reopened == set(live)  # no evicted key came back
    survivors = [i for i, k in enumerate(lru) if k in reopened]  # of the fill, by age
    youngest_evicted = max(i for i, k in enumerate(lru) if k not in reopened)
    return {
        "blanked": blanked,
        "evictions": evictions,
        "window_evictions": window_evictions,
        # keys of the fill that outlived a younger key of the fill
        "bypassed": sum(i < youngest_evicted for i in survivors),
    }


async def test_a_full_tier_evicts_the_writers_group_within_the_window(tmp_path, slots) -> None:
    """A full tier evicts the oldest key of the writer's group among the oldest keys.

    Strict LRU (``eviction_window=1``) mostly frees another group's row,
    which costs a 4 KiB blanking write; the default window of 32 keys (at
    most 1/32 of them: 10 here) mostly frees a row of the writer's group,
    which is overwritten in place. Evicted keys stay gone after a restart
    either way, and every live key reads back its own bytes.
    """
    strict = await _full_tier_blanking(tmp_path / "strict", slots, 1)
    window = await _full_tier_blanking(tmp_path / "window", slots, 32)
    assert strict["bypassed"] == 0  # strict LRU: the oldest keys went first
    assert strict["window_evictions"] == 0
    # counted: evictions of the writer's own group's key past an older key of another
    assert window["window_evictions"] > window["evictions"] // 4
    assert strict["blanked"] > strict["evictions"] // 2  # 2 in 3 free another group's row
    # a victim had fewer than 10 older keys: so fewer than 10 outlived a younger one
    assert 0 < window["bypassed"] < 10
    assert window["blanked"] < strict["blanked"] // 3


async def test_a_write_call_publishes_its_keys_in_call_order(tmp_path, slots) -> None:
    """The LRU follows the order keys were given, not the order of the runs' groups.

    A call's rows are written in runs of one group each; publishing them group
    by group would leave runs of one group in the LRU, and a full tier would
    then seldom find a key of the writer's group among its oldest.
    """
    tier = NVMeTier(**tier_kwargs(tmp_path))
    await tier.open()
    buf = slots(12)
    keys = [key(i, (0, 2, 1)[i % 3]) for i in range(12)]
    rows = [
        (k, 0, 4, buf.fill(i, payload(k, GROUP_NBYTES[k.group_id]))) for i, k in enumerate(keys)
    ]
    assert await tier.write_rows(rows) == [None] * 12
    assert tier._index.lru_keys() == keys
    assert await tier.write_rows(rows[::-1]) == [None] * 12  # written again: moved to MRU
    assert tier._index.lru_keys() == keys[::-1]
    await tier.close()
