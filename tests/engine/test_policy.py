"""Eviction order of the LRU and ARC policies, through the engine and the pure pool."""

from __future__ import annotations

import torch

import kvtier
from kvtier._policy import ARCPolicy, LRUPolicy
from kvtier._slots import SlotPool
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
