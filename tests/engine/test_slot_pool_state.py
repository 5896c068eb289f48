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
