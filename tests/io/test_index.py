"""RowIndex (pure state): a hypothesis state machine checks that no row is ever lost or shared."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import OffloadKey
from kvtier.io._index import DEFERRED, RowIndex, RowRef

ROWS = {0: 4096, 1: 8192, 2: 4096}
KEYS = [OffloadKey(bytes([i + 1]), i % 3) for i in range(9)]


class IndexMachine(RuleBasedStateMachine):
    EVICTION_WINDOW = 1  # strict LRU
    WINDOW_SHARE = 32

    def __init__(self) -> None:
        super().__init__()
        self.index = RowIndex(
            ROWS,
            capacity_bytes=6 * 4096,
            rows_per_segment={0: 3, 1: 2, 2: 3},
            grow_rows={0: 2, 1: 1, 2: 1},
            eviction_window=self.EVICTION_WINDOW,
            window_share=self.WINDOW_SHARE,
        )
        self.reserved: list[tuple[OffloadKey, RowRef, int]] = []
        self.reclaiming: list[RowRef] = []
        self.pinned: list[RowRef] = []
        self.published: dict[OffloadKey, int] = {}

    @rule(k=st.sampled_from(KEYS), grow=st.sampled_from(["ok", "fails", "disk_full"]))
    def write(self, k: OffloadKey, grow: str) -> None:
        g = k.group_id
        pins = set(self.pinned)
        evictable = [
            key
            for key in self.index.lru_keys()
            if key != k and self.index.lookup(key).ref not in pins
        ]
        before = set(self.index.lru_keys())
        rows = {key: self.index.lookup(key).ref for key in evictable}
        need = self.index.bytes_used + ROWS[g] - self.index.capacity_bytes
        window = min(self.EVICTION_WINDOW, len(before) // self.WINDOW_SHARE)
        own = [key for key in evictable[:window] if key.group_id == g]
        ok, ref = self.index.reserve(g, {k})
        evicted = [key for key in evictable if key not in set(self.index.lru_keys())]
        assert before - set(self.index.lru_keys()) == set(evicted)
        if 0 < need <= ROWS[g] and window > 1 and own:
            # the oldest key of the writer's group within the window; its row is handed over
            assert evicted == own[:1]
            assert ref == rows[own[0]]
        else:
            assert evicted == evictable[: len(evicted)]  # global LRU: oldest first, any group
        if not ok:
            assert not evicted
            assert ROWS[g] > self.index.capacity_bytes - self.index.bytes_used + sum(
                ROWS[key.group_id] for key in evictable
            )
            return
        assert self.index.bytes_used <= self.index.capacity_bytes
        while ref is None and (ref := self.index.take_free(g)) is None:
            plan = self.index.plan_growth(g)
            assert plan.group_id == g
            assert plan.start < plan.stop <= plan.num_rows
            if grow == "ok":
                self.index.commit_growth(plan)
                continue
            self.index.abandon_growth(plan)
            if grow == "disk_full":  # the row of the group's oldest evictable key, if any
                pins = set(self.pinned)
                oldest = [
                    key
                    for key in self.index.lru_keys()
                    if key.group_id == g and key != k and self.index.lookup(key).ref not in pins
                ][:1]
                rows = {key: self.index.lookup(key).ref for key in oldest}
                ref = self.index.evict_own(g, {k})
                if oldest:
                    assert ref == rows[oldest[0]]
                    assert self.index.lookup(oldest[0]) is None
                    break
                assert ref is None
            self.index.unreserve(g)
            return
        assert ref.group_id == g
        self.reserved.append((k, ref, self.index.begin_write(k)))

    @rule(k=st.sampled_from(KEYS), grow=st.sampled_from(["ok", "fails", "disk_full"]))
    def write_after_growth(self, k: OffloadKey, grow: str) -> None:
        """The tier's order for a writer whose group has no row at hand: room after growth."""
        g = k.group_id
        if self.index.has_row(g):
            return
        before = self.index.lru_keys()
        ok, ref = self.index.reserve(g, {k}, evict_others=False)
        gone = [key for key in before if key not in set(self.index.lru_keys())]
        if ok:  # evicting for room is fine when a key of g hands its row over
            assert (ref is not None) == any(key.group_id == g for key in gone)
            if ref is not None:
                self.reserved.append((k, ref, self.index.begin_write(k)))
            else:
                self.index.unreserve(g)  # (the tier would grow; covered by write)
            return
        assert not gone
        if ref is not DEFERRED:  # no room at all: nothing to grow for
            assert ref is None
            return
        if grow == "fails":
            return
        if grow == "disk_full":  # no reservation was made: the row is the reservation
            used = self.index.bytes_used
            ref = self.index.evict_own(g, {k}, reserved=False)
            if ref is not None:
                assert self.index.bytes_used == used
                self.reserved.append((k, ref, self.index.begin_write(k)))
            return
        self.index.commit_growth(self.index.plan_growth(g))
        assert self.index.has_row(g)
        ok, own = self.index.reserve(g, {k})
        if ok:
            ref = own if own is not None else self.index.take_free(g, holes=False)
            assert ref is not None
            assert ref.group_id == g
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

    @precondition(lambda self: self.reserved)
    @rule()
    def complete_all(self) -> None:  # fills the tier faster than one completion at a time
        while self.reserved:
            self.complete(0, True)

    @rule()
    def take_stale(self) -> None:
        self.reclaiming += self.index.take_stale()

    @rule(nbytes=st.integers(-4096, 6 * 4096))
    def take_to_punch(self, nbytes: int) -> None:  # the tier is over its disk budget
        held = self.index.held_nbytes
        free_before = {r for g in ROWS for r in self.index._free[g]}
        taken = self.index.take_to_punch(nbytes)
        assert set(taken) <= free_before  # only free rows, never one in use
        assert not set(taken) & {r for g in ROWS for r in self.index._free[g]}
        got = sum(ROWS[r.group_id] for r in taken)
        assert self.index.held_nbytes == held - got  # counted as punched at once
        if nbytes <= 0:
            assert taken == []
        elif got < nbytes:  # every free row holding blocks, and still short
            assert not free_before - set(taken) - self.index._holed
        self.reclaiming += taken

    @precondition(lambda self: self.reclaiming)
    @rule(punched=st.booleans())
    def reclaimed(self, punched: bool) -> None:
        self.index.reclaimed(self.reclaiming, punched)
        self.reclaiming = []

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
            for g in ROWS
            for seg, (_, allocated) in self.index.segments(g).items()
            for i in range(allocated)
        )
        free = [r for g in ROWS for r in self.index._free[g]]
        visible = [self.index.lookup(k).ref for k in KEYS if self.index.lookup(k) is not None]
        reserved = [r for _, r, _ in self.reserved]
        zombies = list(self.index._zombies)
        stale = list(self.index._stale) + self.reclaiming
        held = Counter(free + visible + reserved + zombies + stale)
        assert held == all_rows
        assert not set(self.pinned) & set(free + stale)
        # a punched row is free (or being blanked) until a write takes it
        assert self.index._holed <= set(free) | set(self.reclaiming)
        holed = sum(ROWS[r.group_id] for r in self.index._holed)
        assert self.index.held_nbytes == self.index.allocated_nbytes - holed
        # counted as punched before the I/O: growth does not count on them yet
        promised = self.index._promised
        assert promised <= self.index._holed & set(self.reclaiming)
        assert self.index.growth_held_nbytes == self.index.held_nbytes + sum(
            ROWS[r.group_id] for r in promised
        )
        assert set(zombies) <= set(self.pinned)
        used = sum(ROWS[r.group_id] for r in visible + reserved + zombies)
        assert self.index.bytes_used == used
        assert self.index.allocated_nbytes == sum(ROWS[r.group_id] for r in all_rows)

    @invariant()
    def capacity_and_keys(self) -> None:
        assert self.index.bytes_used <= self.index.capacity_bytes
        keys = self.index.keys()
        assert len(self.index) == len(keys)
        assert [k.group_id for k in keys] == sorted(k.group_id for k in keys)
        for k in keys:
            assert self.index.lookup(k).seq == self.published[k]


IndexMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestIndexMachine = IndexMachine.TestCase


class WindowIndexMachine(IndexMachine):
    """The same machine where a write may evict its own group's key out of LRU order."""

    EVICTION_WINDOW = 3
    WINDOW_SHARE = 1  # so that a handful of keys opens the window


WindowIndexMachine.TestCase.settings = IndexMachine.TestCase.settings
TestWindowIndexMachine = WindowIndexMachine.TestCase


def test_rebuild_highest_seq_wins_and_lru_follows_seq() -> None:
    index = RowIndex({0: 4096}, 1 << 20, rows_per_segment={0: 4}, grow_rows={0: 4})
    a, b = OffloadKey(b"a", 0), OffloadKey(b"b", 0)
    index.rebuild(
        {(0, 0): (4, 4), (0, 3): (4, 2)},
        [
            (RowRef(0, 0, 0), a, 0, 1, 5),
            (RowRef(0, 0, 1), a, 0, 2, 9),
            (RowRef(0, 3, 1), b, 1, 2, 7),
        ],
    )
    assert index.lookup(a).ref == RowRef(0, 0, 1)
    assert index.lookup(a).stop == 2
    assert index.keys() == [b, a]  # by seq: b (7) is less recently used than a (9)
    assert index.bytes_used == 2 * 4096
    assert index.allocated_nbytes == 6 * 4096
    assert index.free_rows(0) == 6 - 3
    assert index.take_stale() == [RowRef(0, 0, 0)]  # the stale duplicate: blank it first
    assert index.take_free(0) == RowRef(0, 0, 2)
    plan = index.plan_growth(0)  # segment 3 is not full: it grows before a new one
    assert (plan.segment, plan.start, plan.stop, plan.new) == (3, 2, 4, False)
    assert index.begin_write(a) == 10  # sequence numbers continue too


def test_rebuild_over_capacity_evicts_oldest() -> None:
    index = RowIndex({0: 4096, 1: 8192}, 3 * 4096, {0: 8, 1: 8}, {0: 1, 1: 1})
    keys = [OffloadKey(bytes([i]), i % 2) for i in range(4)]  # rows 4+8+4+8 KiB
    index.rebuild(
        {(0, 0): (8, 2), (1, 0): (8, 2)},
        [(RowRef(k.group_id, 0, i // 2), k, 0, 1, 10 + i) for i, k in enumerate(keys)],
    )
    assert index.lru_keys() == keys[2:]  # the newest 4 + 8 KiB fit; 0 and 1 (oldest) went
    assert index.bytes_used == 3 * 4096
    assert index.evictions == 2
    assert sorted(index.take_stale()) == [RowRef(0, 0, 0), RowRef(1, 0, 0)]


def test_reserve_evicts_across_groups_and_hands_back_own_row() -> None:
    index = RowIndex({0: 4096, 1: 8192}, 4 * 4096, {0: 8, 1: 8}, {0: 8, 1: 8})
    a0, b1, c0 = OffloadKey(b"a", 0), OffloadKey(b"b", 1), OffloadKey(b"c", 0)
    for k in (a0, b1, c0):
        ok, ref = index.reserve(k.group_id, set())
        assert ok
        assert ref is None
        ref = index.take_free(k.group_id)
        if ref is None:
            index.commit_growth(index.plan_growth(k.group_id))
            ref = index.take_free(k.group_id)
        assert index.finish_write(k, ref, index.begin_write(k), 0, 1)
    assert index.bytes_used == 4 * 4096
    # group 1 needs 8 KiB: a (4 KiB, group 0) then b (8 KiB, its own group) are the oldest
    index.touch(c0)
    ok, own = index.reserve(1, set())
    assert ok
    assert own == RowRef(1, 0, 0)  # b's row, reserved for the writer
    assert index.lru_keys() == [c0]
    assert index.take_stale() == [RowRef(0, 0, 0)]  # a's row: blanked, then free for group 0
    d1 = OffloadKey(b"d", 1)
    assert index.finish_write(d1, own, index.begin_write(d1), 0, 1)
    assert index.bytes_used == 3 * 4096
    # a pinned or protected key is never evicted; failing evicts nothing
    index.pin(c0)
    assert index.reserve(0, set()) == (True, None)  # 4 KiB were still free
    assert index.reserve(0, {d1}) == (False, None)
    assert index.lru_keys() == [c0, d1]
    index.unreserve(0)
    big = RowIndex({0: 8192}, 4096, {0: 1}, {0: 1})
    assert big.reserve(0, set()) == (False, None)


def test_growth_steps_stay_within_the_disk_budget() -> None:
    index = RowIndex({0: 4096, 1: 4096}, 4 * 4096, {0: 16, 1: 16}, {0: 3, 1: 3})
    assert index.disk_budget_nbytes == 10 * 4096
    p1 = index.plan_growth(0)
    assert (p1.segment, p1.start, p1.stop, p1.new) == (0, 0, 3, True)
    index.commit_growth(p1)
    for _ in range(2):
        index.commit_growth(index.plan_growth(1))
    assert index.allocated_nbytes == 9 * 4096
    p2 = index.plan_growth(0)
    assert (p2.start, p2.stop) == (3, 4)  # one row left in the budget
    index.commit_growth(p2)
    p3 = index.plan_growth(0)
    assert (p3.start, p3.stop) == (4, 5)  # over budget: still one row at a time
    index.abandon_growth(p3)
    assert index.allocated_nbytes == 10 * 4096


def test_rows_punched_in_other_groups_leave_room_for_full_growth_steps() -> None:
    """A workload that moved to group 1: group 0's punched rows hold no disk blocks.

    Growth counted allocated rows (punched ones included), so once a tier
    had gone past its budget group 1 grew one row at a time, each write
    waiting for its own fallocate.
    """
    index = RowIndex({0: 4096, 1: 4096}, 4 * 4096, {0: 16, 1: 16}, {0: 3, 1: 3})
    for _ in range(3):
        index.commit_growth(index.plan_growth(0))
    assert index.allocated_nbytes == 9 * 4096
    assert index.wants_growth(1) is False  # 1 row of room: less than a step
    punched = index.take_to_punch(6 * 4096)  # the tier punches group 0's free rows
    index.reclaimed(punched, punched=True)
    assert index.held_nbytes == 3 * 4096
    assert index.wants_growth(1) is True
    plan = index.plan_growth(1)
    assert (plan.start, plan.stop) == (0, 3)  # a whole step
    index.commit_growth(plan)
    assert index.held_nbytes == 6 * 4096 <= index.disk_budget_nbytes
    again = index.plan_growth(1)
    assert (again.start, again.stop) == (3, 6)
    index.commit_growth(again)
    assert index.held_nbytes == index.disk_budget_nbytes - 1 * 4096
    last = index.plan_growth(1)
    assert (last.start, last.stop) == (6, 7)  # the budget's last row
    index.abandon_growth(last)


def test_take_to_punch_takes_the_highest_free_rows_of_the_group_with_most_free_bytes() -> None:
    index = RowIndex({0: 4096, 1: 8192}, 4 * 4096, {0: 8, 1: 8}, {0: 4, 1: 2})
    for g in (0, 1):
        index.commit_growth(index.plan_growth(g))  # group 0: 4 rows (16 KiB), 1: 2 (16 KiB)
    index.commit_growth(index.plan_growth(0))  # group 0: 8 free rows, 32 KiB
    held = index.held_nbytes
    taken = index.take_to_punch(3 * 4096 - 1)
    assert taken == [RowRef(0, 0, 7), RowRef(0, 0, 6), RowRef(0, 0, 5)]
    assert index.held_nbytes == held - 3 * 4096  # counted before the I/O
    assert index.take_free(0) == RowRef(0, 0, 0)  # the lowest rows stay, with their blocks
    index.reclaimed(taken[:2], punched=True)
    index.reclaimed(taken[2:], punched=False)  # not supported there: it holds its blocks
    assert index.held_nbytes == held - 2 * 4096
    assert index.take_to_punch(0) == []
    # punched rows are not taken again; then the next group's rows
    more = index.take_to_punch(6 * 4096)
    assert more == [RowRef(0, 0, r) for r in (5, 4, 3, 2, 1)] + [RowRef(1, 0, 1)]
    assert index.held_nbytes == held - 7 * 4096 - 8192  # group 0 but row 0, one of group 1
    assert index.take_free(0) == RowRef(0, 0, 6)  # a punched free row (the rest are taken)
    assert index.held_nbytes == held - 6 * 4096 - 8192  # the write gives it blocks again


def test_take_free_without_holes_skips_punched_rows_and_keeps_them_free() -> None:
    index = RowIndex({0: 4096}, 4 * 4096, {0: 8}, {0: 8})
    index.commit_growth(index.plan_growth(0))  # rows 0-7, free, holding blocks
    low = [index.take_free(0) for _ in range(3)]  # rows 0-2
    assert low == [RowRef(0, 0, r) for r in range(3)]
    punched = index.take_to_punch(8 * 4096)  # rows 7..3
    index.reclaimed(punched, punched=True)
    index.reclaimed([RowRef(0, 0, 1)])  # row 1 blank, holding blocks
    index.reclaimed([RowRef(0, 0, 0)], punched=True)  # row 0 punched: the lowest free row
    held = index.held_nbytes
    assert index.take_free(0, holes=False) == RowRef(0, 0, 1)  # past the lower hole
    assert index.held_nbytes == held  # it held its blocks
    assert index.take_free(0, holes=False) is None  # only holes left
    assert index.free_rows(0) == 6
    assert index.take_free(0) == RowRef(0, 0, 0)  # the lowest, a hole: blocks again
    assert index.held_nbytes == held + 4096
    assert sorted(index._free[0]) == [RowRef(0, 0, r) for r in range(3, 8)]


def test_a_writer_without_a_row_reserves_after_growth_and_a_full_disk_evicts_its_own_key() -> None:
    index = RowIndex({0: 4096, 1: 4096}, 4 * 4096, {0: 8, 1: 8}, {0: 1, 1: 1})
    b0, b1, a0, a1 = (OffloadKey(bytes([i]), g) for i, g in ((1, 1), (2, 1), (3, 0), (4, 0)))
    for k in (b0, b1, a0, a1):  # LRU order: group 1's keys first
        _put(index, k, set())
    assert index.bytes_used == index.capacity_bytes
    assert not index.has_row(0)
    new, new2 = OffloadKey(b"n", 0), OffloadKey(b"m", 0)
    # room only by evicting b0, whose row group 0 cannot use: nothing is evicted yet
    assert index.reserve(0, {new}, evict_others=False) == (False, DEFERRED)
    assert index.lru_keys() == [b0, b1, a0, a1]
    # the filesystem is full: group 0's own LRU key gives its row, and only it
    ref = index.evict_own(0, {new}, reserved=False)
    assert ref is not None
    assert ref.group_id == 0
    assert index.lru_keys() == [b0, b1, a1]
    assert index.bytes_used == index.capacity_bytes  # the row is new's reservation
    assert (index.evictions, index.disk_full_evictions) == (1, 1)
    seq = index.begin_write(new)
    assert index.finish_write(new, ref, seq, 0, 1)
    # the growth works: room is made after it (the LRU key, of group 1), the new row taken
    index.commit_growth(index.plan_growth(0))
    assert index.has_row(0)
    ok, own = index.reserve(0, {new2})
    assert (ok, own) == (True, None)
    assert index.lru_keys() == [b1, a1, new]
    assert index.take_free(0, holes=False) is not None


def test_take_for_disk_gives_free_rows_then_the_oldest_keys_of_other_groups() -> None:
    index = RowIndex({0: 4096, 1: 8192, 2: 4096}, 64 * 4096, {0: 8, 1: 8, 2: 8}, {0: 2, 1: 2, 2: 1})
    a = [OffloadKey(bytes([i]), 0) for i in range(4)]
    c = [OffloadKey(bytes([10 + i]), 2) for i in range(2)]
    for k in (a[0], c[0], a[1], c[1], a[2], a[3]):  # LRU order
        _put(index, k, set())
    index.commit_growth(index.plan_growth(0))  # group 0: rows 4 and 5 free, holding blocks
    assert index.growth_nbytes(1) == 8192 + 4096  # group 1 has no segment: a header too
    held, used = index.held_nbytes, index.bytes_used
    # free rows of other groups first, those of the group with the most free rows
    rows = index.take_for_disk(1, 8192 + 4096, set(), keys=False)
    assert rows == [RowRef(0, 0, 4), RowRef(0, 0, 5)]
    assert index.held_nbytes == held - 2 * 4096  # counted as punched at once
    assert index.free_rows(0) == 0
    assert index.take_for_disk(1, 4096, set(), keys=False) == []  # no free row with blocks left
    assert index.lru_keys() == [a[0], c[0], a[1], c[1], a[2], a[3]]  # no key evicted for rows
    index.reclaimed(rows, punched=True)
    assert index.free_rows(0) == 2
    assert not index.has_row(0)  # they are holes now
    # then keys of other groups, least recently used first, never protected or pinned ones
    pinned = index.pin(c[0])
    assert pinned is not None
    keys = index.take_for_disk(1, 3 * 4096, {a[0]}, keys=True)
    assert len(keys) == 3
    assert index.lru_keys() == [a[0], c[0], a[3]]
    assert (index.evictions, index.disk_full_evictions) == (3, 3)
    assert index.bytes_used == used - 3 * 4096
    assert index.held_nbytes == held - 5 * 4096
    # not enough evictable bytes: nothing is evicted
    assert index.take_for_disk(1, 2 * 4096, {a[0]}, keys=True) == []
    assert index.lru_keys() == [a[0], c[0], a[3]]
    # never the writer's own group
    assert index.take_for_disk(0, 4096, {a[0]}, keys=True) == []
    index.reclaimed(keys, punched=True)
    assert index.held_nbytes == held - 5 * 4096


def _put(index: RowIndex, key: OffloadKey, protect: set[OffloadKey]) -> RowRef | None:
    """Reserve, take a row (growing), publish ``key``; the evicted row handed over, if any."""
    ok, own = index.reserve(key.group_id, protect)
    assert ok
    ref = own
    while ref is None and (ref := index.take_free(key.group_id)) is None:
        index.commit_growth(index.plan_growth(key.group_id))
    assert index.finish_write(key, ref, index.begin_write(key), 0, 1)
    return own


@settings(max_examples=150, deadline=None)
@given(
    groups=st.lists(st.integers(0, 2), min_size=1, max_size=120),
    touches=st.lists(st.integers(0, 10**6), max_size=40),
    window=st.integers(1, 6),
    share=st.integers(1, 4),
)
def test_reserve_evicts_own_group_within_the_window_else_strict_lru(
    groups: list[int], touches: list[int], window: int, share: int
) -> None:
    """Against a reference LRU list: which key each write evicts, and which row it gets."""
    rows = {0: 4096, 1: 4096, 2: 8192}
    index = RowIndex(rows, 8 * 4096, dict.fromkeys(rows, 64), dict.fromkeys(rows, 4), window, share)
    model: list[OffloadKey] = []  # least recently used first
    for i, g in enumerate(groups):
        if touches and i % 3 == 0 and model:  # a load moves a key to the MRU end
            k = model.pop(touches[i % len(touches)] % len(model))
            model.append(k)
            index.touch(k)
        key = OffloadKey(i.to_bytes(4, "big"), g)
        used = sum(rows[k.group_id] for k in model)
        need = used + rows[g] - index.capacity_bytes
        w = min(window, len(model) // share)
        own = [k for k in model[:w] if k.group_id == g] if 0 < need <= rows[g] and w > 1 else []
        refs = {k: index.lookup(k).ref for k in model}
        if own:
            expect = own[:1]
        else:
            expect, freed = [], 0
            while freed < need:
                expect.append(model[len(expect)])
                freed += rows[expect[-1].group_id]
        handed = _put(index, key, set())
        for k in expect:
            model.remove(k)
        model.append(key)
        assert index.lru_keys() == model
        own_victims = [k for k in expect if k.group_id == g]
        assert handed == (refs[own_victims[0]] if own_victims else None)
        # every other evicted row waits for blanking; the handed-over one needs none
        stale = index.take_stale()
        assert sorted(stale) == sorted(refs[k] for k in expect if refs[k] != handed)
        index.reclaimed(stale)  # blanked: free rows of their groups again
    assert index.evictions == len(groups) - len(model)
