"""Eviction order of the LRU and ARC policies, through the engine and the pure pool."""

from __future__ import annotations

import random

import pytest
import torch

import kvtier
from kvtier._policy import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy
from kvtier._slots import SlotPool
from kvtier.errors import ConfigError
from tests.engine.helpers import key


def _engine(nslots: int, eviction: str) -> tuple[kvtier.KVLayout, kvtier.EngineConfig]:
    t = torch.zeros((64, 1024), dtype=torch.uint8)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    return layout, kvtier.EngineConfig(nslots * layout.slot_nbytes(1), 1, eviction=eviction)


async def test_lru_victim_order_through_engine() -> None:
    layout, config = _engine(3, "lru")
    async with kvtier.TransferEngine(layout, config) as engine:
        for i in range(3):
            await engine.store([kvtier.Chunk(key(i, 0), [i])])
        await engine.load([kvtier.Chunk(key(0, 0), [10])])  # 0 becomes most recent
        await engine.store([kvtier.Chunk(key(3, 0), [3])])  # evicts 1 (LRU)
        res = engine.lookup([key(i, 0) for i in range(4)])
        assert res == [
            kvtier.Residency.CPU,
            kvtier.Residency.MISS,
            kvtier.Residency.CPU,
            kvtier.Residency.CPU,
        ]
        await engine.store([kvtier.Chunk(key(4, 0), [4])])  # evicts 2
        assert engine.lookup([key(2, 0)]) == [kvtier.Residency.MISS]


async def test_arc_keeps_frequent_keys_under_a_scan() -> None:
    layout, config = _engine(4, "arc")
    async with kvtier.TransferEngine(layout, config) as engine:
        hot = [key(f"hot{i}", 0) for i in range(2)]
        await engine.store([kvtier.Chunk(k, [i]) for i, k in enumerate(hot)])
        await engine.load([kvtier.Chunk(k, [10 + i]) for i, k in enumerate(hot)])  # hot -> T2
        for i in range(6):  # a one-time scan
            await engine.store([kvtier.Chunk(key(f"scan{i}", 0), [20 + i])])
        assert engine.lookup(hot) == [kvtier.Residency.CPU] * 2
    # LRU under the same sequence loses the hot keys
    layout, config = _engine(4, "lru")
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store([kvtier.Chunk(k, [i]) for i, k in enumerate(hot)])
        await engine.load([kvtier.Chunk(k, [10 + i]) for i, k in enumerate(hot)])
        for i in range(6):
            await engine.store([kvtier.Chunk(key(f"scan{i}", 0), [20 + i])])
        assert engine.lookup(hot) == [kvtier.Residency.MISS] * 2


def test_arc_ghost_hit_adapts_target() -> None:
    arc = ARCPolicy(2)
    for k in "ab":
        arc.insert(k)
    arc.remove("a", evicted=True)  # a -> B1
    assert "a" in arc.b1
    arc.insert("a")  # ghost hit in B1 grows p and goes to T2
    assert arc.p >= 1
    assert "a" in arc.t2


def test_pool_never_evicts_keys_of_the_same_call_and_is_atomic() -> None:
    pool = SlotPool(2, LRUPolicy())
    k = [key(i, 0) for i in range(4)]
    entries, rejected, evicted = pool.reserve([(k[0], 0, 1, 8), (k[1], 0, 1, 8)], protect=set())
    assert len(entries) == 2
    assert not rejected
    assert not evicted
    for e in entries:
        pool.commit(e.key)
    pool.pin(k[0])
    # k[1] is protected (same call), k[0] pinned: nothing evictable, both rejected, nothing changed
    entries, rejected, evicted = pool.reserve(
        [(k[2], 0, 1, 8), (k[3], 0, 1, 8)], protect={k[1], k[2], k[3]}
    )
    assert not entries
    assert rejected == [k[2], k[3]]
    assert not evicted
    assert pool.get(k[0]) is not None
    assert pool.get(k[1]) is not None
    pool.unpin(k[0])
    entries, rejected, evicted = pool.reserve(
        [(k[2], 0, 1, 8), (k[3], 0, 1, 8)], protect={k[2], k[3]}
    )
    assert evicted == [k[0], k[1]]
    assert len(entries) == 2


def test_refresh_moves_a_key_within_its_own_arc_list_and_falls_back_to_touch() -> None:
    arc = ARCPolicy(4)
    for i in range(3):
        arc.insert(key(i, 0))
    arc.touch(key(2, 0))  # 2 used twice: T2
    arc.refresh(key(0, 0))  # a hint: MRU of T1, not T2
    assert list(arc.t1) == [key(1, 0), key(0, 0)]
    assert list(arc.t2) == [key(2, 0)]
    arc.refresh(key(9, 0))  # not resident: nothing happens
    assert len(arc.t1) + len(arc.t2) == 3

    class TouchOnly:  # a plugged-in policy without refresh
        def __init__(self) -> None:
            self.inner = LRUPolicy()
            self.touched: list[object] = []

        def insert(self, k: object) -> None:
            self.inner.insert(k)

        def touch(self, k: object) -> None:
            self.touched.append(k)
            self.inner.touch(k)

        def remove(self, k: object, *, evicted: bool) -> None:
            self.inner.remove(k, evicted=evicted)

        def candidates(self):  # type: ignore[no-untyped-def]
            return self.inner.candidates()

    policy = TouchOnly()
    pool = SlotPool(2, policy)
    reserved, _, _ = pool.reserve([(key(0, 0), 0, 1, 16)], protect=set())
    assert len(reserved) == 1
    pool.commit(key(0, 0))
    pool.refresh(key(0, 0))
    assert policy.touched == [key(0, 0)]


class PolicyConformance:
    """The contract of :class:`kvtier._policy.EvictionPolicy`, run against every policy.

    A subclass sets ``make(capacity)``. Each test holds for any policy the
    slot pool may be given: the candidates are exactly the resident keys, each
    once; hints and touches of absent keys make nothing resident; listing the
    candidates changes nothing; with no eviction history, keys never touched
    go before touched ones, oldest first.
    """

    def make(self, capacity: int) -> EvictionPolicy:
        raise NotImplementedError

    def test_is_an_eviction_policy(self) -> None:
        assert isinstance(self.make(4), EvictionPolicy)

    @pytest.mark.parametrize("seed", range(20))
    def test_candidates_are_exactly_the_resident_keys(self, seed: int) -> None:
        rng = random.Random(seed)
        capacity = 6
        policy = self.make(capacity)
        resident: set[object] = set()
        hints = ("refresh", "insert_hint", "first_use")
        for _ in range(300):
            k = key(rng.randrange(12), 0)
            op = rng.choice(["insert", "touch", "remove", "evict", *hints])
            if op == "insert" or (op == "insert_hint" and not hasattr(policy, op)):
                if k not in resident and len(resident) >= capacity:
                    victim = next(iter(policy.candidates()))
                    policy.remove(victim, evicted=True)
                    resident.discard(victim)
                policy.insert(k)
                resident.add(k)
            elif op == "insert_hint":
                if k not in resident and len(resident) >= capacity:
                    continue
                policy.insert_hint(k)  # type: ignore[attr-defined]
                resident.add(k)
            elif op in ("remove", "evict"):
                policy.remove(k, evicted=op == "evict")
                resident.discard(k)
            elif hasattr(policy, op):
                getattr(policy, op)(k)  # a hit or a hint: residency unchanged
            else:
                policy.touch(k)
            listed = list(policy.candidates())
            assert len(listed) == len(set(listed)), (seed, op)
            assert set(listed) == resident, (seed, op)

    def test_touch_and_hints_of_an_absent_key_make_nothing_resident(self) -> None:
        policy = self.make(4)
        policy.insert(key(0, 0))
        for op in ("touch", "refresh", "first_use"):
            if hasattr(policy, op):
                getattr(policy, op)(key(9, 0))
        policy.remove(key(8, 0), evicted=True)  # absent: no error, no change
        assert list(policy.candidates()) == [key(0, 0)]

    def test_listing_candidates_changes_nothing(self) -> None:
        policy = self.make(8)
        for i in range(5):
            policy.insert(key(i, 0))
        policy.touch(key(2, 0))
        first = list(policy.candidates())
        assert list(policy.candidates()) == first
        next(iter(policy.candidates()))  # a partly consumed iterator
        assert list(policy.candidates()) == first

    def test_untouched_keys_go_first_oldest_first(self) -> None:
        policy = self.make(8)
        for i in range(5):
            policy.insert(key(i, 0))
        policy.touch(key(1, 0))
        policy.touch(key(3, 0))
        listed = list(policy.candidates())
        assert listed[:3] == [key(0, 0), key(2, 0), key(4, 0)]
        assert set(listed[3:]) == {key(1, 0), key(3, 0)}

    def test_an_inserted_key_that_is_resident_again_is_listed_once(self) -> None:
        policy = self.make(4)
        policy.insert(key(0, 0))
        policy.insert(key(0, 0))
        policy.remove(key(0, 0), evicted=True)
        policy.insert(key(0, 0))
        assert list(policy.candidates()) == [key(0, 0)]

    def test_the_pool_evicts_its_first_candidate_that_is_not_pinned(self) -> None:
        policy = self.make(3)
        pool = SlotPool(3, policy)
        keys = [key(i, 0) for i in range(4)]
        for k in keys[:3]:
            entries, _, _ = pool.reserve([(k, 0, 1, 8)], protect=set())
            pool.commit(entries[0].key)
        pool.pin(keys[0])
        expected = next(k for k in policy.candidates() if k != keys[0])
        _, rejected, evicted = pool.reserve([(keys[3], 0, 1, 8)], protect=set())
        assert not rejected
        assert evicted == [expected]
        assert pool.get(keys[0]) is not None


class TestLRUPolicy(PolicyConformance):
    def make(self, capacity: int) -> EvictionPolicy:
        return make_policy("lru", capacity)


class TestARCPolicy(PolicyConformance):
    def make(self, capacity: int) -> EvictionPolicy:
        return make_policy("arc", capacity)


def test_an_unknown_policy_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        make_policy("fifo", 4)
