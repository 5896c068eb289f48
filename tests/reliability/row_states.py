"""Checks that every allocated row of a RowIndex is in exactly one state and the bytes add up."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.io._index import RowIndex, RowRef


def check_row_states(
    index: RowIndex, reserved: Sequence[RowRef] = (), reclaiming: Sequence[RowRef] = ()
) -> None:
    """Every allocated row in one state; bytes_used: the rows that hold or will hold data."""
    free = [r for heap in index._free.values() for r in heap]
    stale = list(index._stale)
    visible = [e.ref for e in index._lru.values()]
    zombies = list(index._zombies)
    every = free + stale + visible + zombies + list(reserved) + list(reclaiming)
    assert len(every) == len(set(every)), "a row in two states"
    allocated = {
        RowRef(g, s, i)
        for g, segs in index._segments.items()
        for s, (_, n) in segs.items()
        for i in range(n)
    }
    assert set(every) == allocated, set(every) ^ allocated
    rows = index.row_nbytes
    assert index.allocated_nbytes == sum(rows(r.group_id) for r in allocated)
    used = sum(rows(r.group_id) for r in visible + zombies + list(reserved))
    assert index.bytes_used == used, (index.bytes_used, used)
    assert index.bytes_used <= index.capacity_bytes


def check_settled_rows(index: RowIndex) -> None:
    """Nothing in flight: every allocated row in exactly one state; bytes_used adds up."""
    check_row_states(index)
    assert not index._pins
    assert not index._pending
