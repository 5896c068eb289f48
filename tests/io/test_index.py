"""RowIndex (pure state): a hypothesis state machine checks that no row is ever lost or shared."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import OffloadKey
from kvtier.io._index import RowIndex, RowRef

KEYS = [OffloadKey(bytes([i + 1]), i % 2) for i in range(6)]


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = RowIndex(
            {0: 4096, 1: 8192}, capacity_bytes=10 * 4096, rows_per_segment={0: 2, 1: 2}
        )
        self.reserved: list[tuple[OffloadKey, RowRef, int]] = []
        self.pinned: list[RowRef] = []
        self.published: dict[OffloadKey, int] = {}

    @rule(g=st.sampled_from([0, 1]))
    def add_segment(self, g: int) -> None:
        plan = self.index.plan_segment(g)
        if plan is not None:
            self.index.commit_segment(g, *plan)

    @rule(k=st.sampled_from(KEYS))
    def begin(self, k: OffloadKey) -> None:
        ref = self.index.take_free(k.group_id) or self.index.evict(k.group_id, {k})
        if ref is not None:
            assert ref.group_id == k.group_id
            self.reserved.append((k, ref, self.index.begin_write(k)))

    @precondition(lambda self: self.reserved)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def complete(self, i: int, ok: bool) -> None:
        k, ref, seq = self.reserved.pop(i % len(self.reserved))
        if ok:
            if self.index.finish_write(k, ref, seq, 0, 1):
                assert seq > self.published.get(k, 0)
                self.published[k] = seq
        else:
            self.index.fail_write(k, ref, seq)

    @rule(k=st.sampled_from(KEYS))
    def pin(self, k: OffloadKey) -> None:
        entry = self.index.pin(k)
        if entry is not None:
            self.pinned.append(entry.ref)

    @precondition(lambda self: self.pinned)
    @rule(i=st.integers(0, 100))
    def unpin(self, i: int) -> None:
        self.index.unpin(self.pinned.pop(i % len(self.pinned)))

    @rule(k=st.sampled_from(KEYS))
    def drop(self, k: OffloadKey) -> None:
        self.index.drop(k)

    @rule(k=st.sampled_from(KEYS))
    def discard(self, k: OffloadKey) -> None:
        self.index.discard(k)  # writes in flight for k will not publish it

    @rule(k=st.sampled_from(KEYS))
    def touch(self, k: OffloadKey) -> None:
        self.index.touch(k)

    @invariant()
    def every_row_in_exactly_one_state(self) -> None:
        all_rows = Counter(
            RowRef(g, seg, i)
            for g in (0, 1)
            for seg, n in self.index.segments(g).items()
            for i in range(n)
        )
        free = [r for g in (0, 1) for r in self.index._free[g]]
        visible = [self.index.lookup(k).ref for k in KEYS if self.index.lookup(k) is not None]
        reserved = [r for _, r, _ in self.reserved]
        zombies = list(self.index._zombies)
        held = Counter(free + visible + reserved + zombies)
        assert held == all_rows
        assert not set(self.pinned) & set(free)
        assert set(zombies) <= set(self.pinned)

    @invariant()
    def capacity_and_keys(self) -> None:
        assert self.index.bytes_used <= self.index.capacity_bytes
        keys = self.index.keys()
        assert len(self.index) == len(keys)
        for k in keys:
            assert self.index.lookup(k).seq == self.published[k]


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase


def test_rebuild_highest_seq_wins_and_lru_follows_seq() -> None:
    index = RowIndex({0: 4096}, capacity_bytes=1 << 20, rows_per_segment={0: 4})
    a, b = OffloadKey(b"a", 0), OffloadKey(b"b", 0)
    index.rebuild(
        {(0, 0): 4, (0, 3): 2},
        [
            (RowRef(0, 0, 0), a, 0, 1, 5),
            (RowRef(0, 0, 1), a, 0, 2, 9),
            (RowRef(0, 3, 1), b, 1, 2, 7),
        ],
    )
    assert index.lookup(a).ref == RowRef(0, 0, 1)
    assert index.lookup(a).stop == 2
    assert index.keys() == [b, a]  # by seq: b (7) is less recently used than a (9)
    assert index.free_rows(0) == 4 + 2 - 2
    assert index.take_free(0) == RowRef(0, 0, 0)  # the stale duplicate row is free
    assert index.plan_segment(0)[0] == 4  # numbering continues after the highest
    assert index.begin_write(a) == 10  # sequence numbers continue too
