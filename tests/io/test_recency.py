"""NVMe recency follows call order, whatever order the calls' writes finish in.

A write batch may wait (for its segment file to grow, for a write slot, for
a slow device) and publish after the batch of a later call. Rows still rank
by the call that wrote them (its sequence number, taken at the call), and a
touch ranks a key at the time of the touch; a restart ranks rows by their
sequence numbers.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtier import OffloadKey
from kvtier.io import NVMeTier
from kvtier.io._key_index import KeyIndex
from kvtier.io._rows import RowRef
from tests.io.conftest import GROUP_NBYTES, key, payload, tier_kwargs
from tests.io.faults import DelegatingRowIO

SEEDS = range(20)


@pytest.mark.parametrize("seed", SEEDS)
def test_key_index_ranks_rows_by_call_order_and_touches(seed: int) -> None:
    """Random calls, publications in any order, touches in between: the LRU is the model's."""
    rng = random.Random(seed)
    index = KeyIndex({0: 8192, 1: 8192})
    clock = 0  # the model's time: each call and each touch is one event
    last_use: dict[OffloadKey, int] = {}  # visible key -> time of its call or last touch
    in_flight: list[tuple[int, list[tuple[OffloadKey, int]]]] = []  # (call time, keys+seqs)
    row = 0
    for i in range(12):
        clock += 1
        keys = [key(10 * i + j, rng.randrange(2)) for j in range(rng.randrange(1, 4))]
        in_flight.append((clock, [(k, index.begin_write(k)) for k in keys]))
        # publish some calls in flight, in random order; touch visible keys
        while in_flight and rng.random() < 0.5:
            call_time, writes = in_flight.pop(rng.randrange(len(in_flight)))
            for k, seq in writes:
                visible, _ = index.publish(k, RowRef(k.group_id, 0, row), seq, 0, 1)
                row += 1
                assert visible
                last_use[k] = call_time
        if last_use and rng.random() < 0.5:
            clock += 1
            k = rng.choice(list(last_use))
            index.touch(k)
            last_use[k] = clock
    for call_time, writes in in_flight:
        for k, seq in writes:
            index.publish(k, RowRef(k.group_id, 0, row), seq, 0, 1)
            row += 1
            last_use[k] = call_time
    assert index.lru_keys() == sorted(last_use, key=lambda k: last_use[k])


class HeldWrites(DelegatingRowIO):
    """Row writes to a group's segment files wait for that group's event while armed."""

    def __init__(self, inner: Any, events: dict[int, threading.Event]) -> None:
        super().__init__(inner)
        self.events = events
        self.armed = False
        self.group_of: dict[int, int] = {}

    def open(self, path: Any, create: bool) -> Any:
        handle = self.inner.open(path, create)
        self.group_of[id(handle)] = int(Path(path).parent.name[1:])
        return handle

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        if self.armed and file_offset > 0:  # rows (a header sits at offset 0)
            event = self.events.get(self.group_of.get(id(handle), -1))
            if event is not None and not event.wait(30):
                raise TimeoutError("the test never released the writes")
        return self.inner.pwritev(handle, bufs, file_offset)


@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
@pytest.mark.parametrize("seed", SEEDS)
async def test_tier_evicts_the_first_call_whatever_order_its_writes_finish(
    tmp_path: Path, slots: Any, seed: int, restart: bool
) -> None:
    """Three awaited-later calls of three groups finish in a random order; a
    filler that needs exactly the first call's room evicts the first call,
    also in a tier reopened after the writes (ranked by sequence numbers)."""
    rng = random.Random(seed)
    groups = [0, 1, 2]
    rng.shuffle(groups)
    events = {g: threading.Event() for g in groups}
    wrappers: list[HeldWrites] = []

    def wrap(inner: Any) -> HeldWrites:
        wrappers.append(HeldWrites(inner, events))
        return wrappers[-1]

    layout = {"groups": {str(g): {"layers": [f"l{g}"]} for g in range(3)}}
    probe = NVMeTier(**tier_kwargs(tmp_path / "probe", layout_description=layout))
    row = {g: probe.row_nbytes(g) for g in range(3)}
    capacity = 2 * sum(row.values())
    kwargs = tier_kwargs(
        tmp_path / "nvme",
        layout_description=layout,
        capacity_bytes=capacity,
        eviction_window=1,
        io_threads=4,  # a thread for each group's held write, and one more
        row_io_wrapper=wrap,
    )
    tier = NVMeTier(**kwargs)
    await tier.open()
    try:
        buf = slots(8, 32 * 1024)
        calls = [[key(10 * i + j, g) for j in range(2)] for i, g in enumerate(groups)]
        (io,) = wrappers
        io.armed = True
        tasks = []
        n = 0
        for keys in calls:  # issued in call order: sequence numbers in call order
            rows = []
            for k in keys:
                rows.append((k, 0, 4, buf.fill(n, payload(k, GROUP_NBYTES[k.group_id]))))
                n += 1
            tasks.append(asyncio.ensure_future(tier.write_rows(rows)))
            await asyncio.sleep(0)
        order = list(range(3))
        rng.shuffle(order)  # the calls' writes finish in this order
        for i in order:
            events[groups[i]].set()
            assert await tasks[i] == [None, None]
        io.armed = False
        if restart:
            await tier.close()
            tier = NVMeTier(**kwargs)
            await tier.open()
            assert set(tier.keys()) == {k for keys in calls for k in keys}
        first = calls[0]
        filler = [key(100 + j, first[0].group_id) for j in range(2)]
        rows = [
            (k, 0, 4, buf.fill(6 + j, payload(k, GROUP_NBYTES[k.group_id])))
            for j, k in enumerate(filler)
        ]
        assert await tier.write_rows(rows) == [None, None]
        visible = set(tier.keys())
        assert not visible & set(first), (groups, order)
        assert visible >= set(calls[1] + calls[2] + filler), (groups, order)
    finally:
        await tier.close()
