"""Property test of the slot state machine (hypothesis RuleBasedStateMachine)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier._policy import ARCPolicy, LRUPolicy
from kvtier._slots import SlotPool, SlotState
from tests.engine.helpers import key

KEYS = [key(i, i % 3) for i in range(12)]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(4, LRUPolicy())
        self.writing: set = set()
        self.resident: set = set()
        self.pins: dict = {}

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True))
    def reserve(self, ks: list) -> None:
        new = [k for k in ks if self.pool.get(k) is None]
        entries, rejected, evicted = self.pool.reserve(
            [(k, 0, 1, 100) for k in new], protect=set(ks)
        )
        assert len(entries) + len(rejected) == len(new)
        for v in evicted:
            assert v in self.resident
            assert not self.pins.get(v)
            assert v not in ks
            self.resident.discard(v)
        self.writing |= {e.key for e in entries}

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), ok=st.booleans())
    def finish(self, data: st.DataObject, ok: bool) -> None:
        k = data.draw(st.sampled_from(sorted(self.writing, key=lambda x: x.block_hash)))
        self.writing.discard(k)
        if ok:
            self.pool.commit(k)
            self.resident.add(k)
        else:
            self.pool.abort(k)

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.resident, key=lambda x: x.block_hash)))
        self.pool.pin(k)
        self.pins[k] = self.pins.get(k, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        k = data.draw(
            st.sampled_from(
                sorted((k for k, v in self.pins.items() if v), key=lambda x: x.block_hash)
            )
        )
        self.pool.unpin(k)
        self.pins[k] -= 1

    @invariant()
    def counts_add_up(self) -> None:
        pool = self.pool
        total = sum(pool.count(s) for s in SlotState)
        assert total == pool.num_slots
        assert pool.count(SlotState.WRITING) == len(self.writing)
        assert pool.count(SlotState.PINNED) == sum(1 for v in self.pins.values() if v)
        slots = [e.slot for e in pool.entries()]
        assert len(slots) == len(set(slots))


class ARCPoolMachine(PoolMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(4, ARCPolicy(4))


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestARCPool = ARCPoolMachine.TestCase
TestARCPool.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_drop_frees_a_resident_slot_without_counting_an_eviction() -> None:
    import pytest

    from kvtier._slots import SlotStateError

    pool = SlotPool(2, LRUPolicy())
    pool.reserve([(key(1, 0), 0, 1, 10), (key(2, 0), 0, 1, 10)], protect=())
    pool.commit(key(1, 0))
    pool.drop(key(1, 0))
    assert pool.get(key(1, 0)) is None
    assert pool.free_count == 1
    assert pool.evictions == 0
    assert list(pool.policy.candidates()) == []
    with pytest.raises(SlotStateError):
        pool.drop(key(2, 0))  # still writing
    pool.commit(key(2, 0))
    pool.pin(key(2, 0))
    with pytest.raises(SlotStateError):
        pool.drop(key(2, 0))  # pinned


def test_host_region_maps_a_shared_descriptor() -> None:
    import os

    from kvtier._slots import HostRegion

    fd = os.memfd_create("test")
    try:
        os.ftruncate(fd, 8192)
        first, second = HostRegion(8192, pin=False, fd=fd), HostRegion(8192, pin=False, fd=fd)
        first.tensor[4096] = 42
        assert int(second.tensor[4096]) == 42
        first.close()
        second.close()
    finally:
        os.close(fd)
