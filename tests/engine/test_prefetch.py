"""``prefetch``: NVMe-only keys promoted into CPU slots ahead of their load, no GPU touched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier.errors import (
    DuplicateKeyError,
    InvalidArgumentError,
    KeyNotResidentError,
    KVTierError,
    StorageError,
    UnknownGroupError,
)
from tests.engine.helpers import filled_layout, key, prefetch_chunks, prefetch_config, same

BPC = 2


async def _stored_on_nvme(root: Path, n: int = 4) -> tuple[kvtier.KVLayout, torch.Tensor]:
    """Store ``n`` chunks durably, close: a new engine finds them on NVMe only."""
    layout, t = filled_layout((16, 8192), seed=5, name="a")
    async with kvtier.TransferEngine(layout, prefetch_config(root)) as engine:
        await engine.store(prefetch_chunks(n), durable=True)
    return layout, t


async def test_prefetched_keys_load_as_cpu_hits_bitwise(tmp_path: Path) -> None:
    layout, t = await _stored_on_nvme(tmp_path)
    before = t.clone()
    chunks = prefetch_chunks()
    keys = [c.key for c in chunks]
    async with kvtier.TransferEngine(layout, prefetch_config(tmp_path)) as engine:
        assert engine.lookup(keys) == [kvtier.Residency.NVME] * 4
        res = await engine.prefetch(keys)
        assert set(res.promoted) == set(keys)
        assert res.resident == ()
        assert res.failed == {}
        assert engine.lookup(keys) == [kvtier.Residency.CPU] * 4
        stats = engine.stats()
        assert stats.slots_pinned == 0  # resident, evictable
        assert stats.nvme["promotions"] == 4
        assert stats.hits == stats.misses == 0  # prefetch counts no hit or miss
        t.zero_()  # the GPU blocks were not touched by the prefetch: scribble them now
        out = await engine.load(chunks)
        assert set(out.loaded) == set(keys)
        stats = engine.stats()
        assert stats.hits == 4
        assert stats.nvme_hits == 0  # the load found every key in a CPU slot
        assert stats.nvme["promotions"] == 4  # no second read
    assert same(t[:8], before[:8])


async def test_prefetch_touches_no_gpu_block(tmp_path: Path) -> None:
    layout, t = await _stored_on_nvme(tmp_path)
    t.fill_(0xAB)
    async with kvtier.TransferEngine(layout, prefetch_config(tmp_path)) as engine:
        res = await engine.prefetch([c.key for c in prefetch_chunks()])
        assert len(res.promoted) == 4
    assert int((t != 0xAB).count_nonzero()) == 0


async def test_resident_promoted_and_missing_keys_are_told_apart(tmp_path: Path) -> None:
    layout, _ = await _stored_on_nvme(tmp_path, n=2)
    async with kvtier.TransferEngine(layout, prefetch_config(tmp_path)) as engine:
        fresh = kvtier.Chunk(key("fresh", 0), [10, 11])
        await engine.store([fresh])
        on_nvme = [c.key for c in prefetch_chunks(2)]
        missing = key("never", 0)
        res = await engine.prefetch([fresh.key, *on_nvme, missing])
        assert res.resident == (fresh.key,)
        assert set(res.promoted) == set(on_nvme)
        assert set(res.failed) == {missing}
        assert isinstance(res.failed[missing], KeyNotResidentError)
        again = await engine.prefetch(on_nvme)  # now resident: nothing is read twice
        assert set(again.resident) == set(on_nvme)
        assert again.promoted == ()
        assert engine.stats().nvme["promotions"] == 2


async def test_corrupt_row_fails_alone_and_becomes_a_miss(tmp_path: Path) -> None:
    layout, _ = await _stored_on_nvme(tmp_path)
    seg = next(tmp_path.rglob("*.kvrows"))
    with open(seg, "r+b") as f:  # flip one payload byte of row 0
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    keys = [c.key for c in prefetch_chunks()]
    async with kvtier.TransferEngine(layout, prefetch_config(tmp_path)) as engine:
        res = await engine.prefetch(keys)
        assert len(res.failed) == 1
        assert len(res.promoted) == 3
        bad, err = next(iter(res.failed.items()))
        assert isinstance(err, StorageError)
        assert err.kind == "checksum"
        assert engine.lookup([bad]) == [kvtier.Residency.MISS]
        stats = engine.stats()
        assert stats.failures == {"checksum": 1}
        assert stats.nvme["promotion_failures"] == 1
        assert stats.slots_pinned == 0
        assert stats.keys_per_group == {0: 3}  # its slot was given back


async def test_keys_without_a_slot_fail_and_the_others_are_promoted(tmp_path: Path) -> None:
    layout, _ = await _stored_on_nvme(tmp_path)
    keys = [c.key for c in prefetch_chunks()]
    async with kvtier.TransferEngine(layout, prefetch_config(tmp_path, slots=2)) as engine:
        assert engine.num_slots == 2
        res = await engine.prefetch(keys)  # keys of the call never evict each other
        assert len(res.promoted) == 2
        assert len(res.failed) == 2
        assert all(type(e) is KVTierError for e in res.failed.values())
        assert engine.lookup(list(res.failed)) == [kvtier.Residency.NVME] * 2  # still on NVMe


async def test_a_store_in_flight_is_waited_for(tmp_path: Path) -> None:
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    async with kvtier.TransferEngine(layout, prefetch_config(tmp_path)) as engine:
        chunk = prefetch_chunks(1)[0]
        store = asyncio.ensure_future(engine.store([chunk]))
        await asyncio.sleep(0)  # the store's copy is in flight
        assert engine.lookup([chunk.key]) == [kvtier.Residency.PENDING]
        res = await engine.prefetch([chunk.key])
        assert res.resident == (chunk.key,)
        await store


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("not keys", InvalidArgumentError),
        (key("k", 0), InvalidArgumentError),
        ({key("k", 0)}, InvalidArgumentError),  # a set has no order: not a sequence
        ([b"hash"], InvalidArgumentError),
        ([key("k", 0), key("k", 0)], DuplicateKeyError),
        ([key("k", 7)], UnknownGroupError),
    ],
)
async def test_bad_input_raises_and_changes_nothing(
    tmp_path: Path, bad: object, error: type
) -> None:
    layout, _ = await _stored_on_nvme(tmp_path)
    keys = [c.key for c in prefetch_chunks()]
    async with kvtier.TransferEngine(layout, prefetch_config(tmp_path)) as engine:
        with pytest.raises(error):
            await engine.prefetch(bad)  # type: ignore[arg-type]
        with pytest.raises(DuplicateKeyError):  # a valid key before the duplicate: not read
            await engine.prefetch([keys[0], keys[1], keys[1]])
        assert engine.lookup(keys) == [kvtier.Residency.NVME] * 4
        assert engine.stats().nvme["promotions"] == 0


async def test_without_nvme_every_key_is_resident_or_failed() -> None:
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, BPC)) as engine:
        chunk = prefetch_chunks(1)[0]
        await engine.store([chunk])
        res = await engine.prefetch([chunk.key, key("absent", 0)])
        assert res.resident == (chunk.key,)
        assert set(res.failed) == {key("absent", 0)}


async def test_closed_engine_refuses(tmp_path: Path) -> None:
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    engine = kvtier.TransferEngine(layout, prefetch_config(tmp_path))
    with pytest.raises(kvtier.EngineClosedError):
        await engine.prefetch([key("k", 0)])


def test_background_engine_prefetch(tmp_path: Path) -> None:
    layout, t = asyncio.run(_stored_on_nvme(tmp_path))
    before = t.clone()
    chunks = prefetch_chunks()
    with kvtier.BackgroundEngine(layout, prefetch_config(tmp_path)) as engine:
        res = engine.prefetch([c.key for c in chunks]).result(timeout=60)
        assert len(res.promoted) == 4
        t.zero_()
        out = engine.load(chunks).result(timeout=60)
        assert len(out.loaded) == 4
        assert engine.stats().nvme_hits == 0
    assert same(t[:8], before[:8])


async def test_under_arc_a_prefetch_is_a_hint_not_a_use(tmp_path: Path) -> None:
    # ARC's T1 holds keys used once, T2 keys used twice or more. A prefetch
    # followed by one load is ONE use, as a cold load is: the key stays in T1;
    # a second load moves it to T2. A prefetch of a resident key refreshes it
    # in its own list without promoting it.
    import dataclasses

    layout, _ = await _stored_on_nvme(tmp_path)
    chunks = prefetch_chunks()
    config = dataclasses.replace(prefetch_config(tmp_path), eviction="arc")
    async with kvtier.TransferEngine(layout, config) as engine:
        arc = engine._pool.policy
        assert isinstance(arc, kvtier._policy.ARCPolicy)
        prefetched, cold = chunks[0], chunks[1]
        await engine.prefetch([prefetched.key])
        assert not (await engine.load([prefetched, cold])).failed  # one use each
        assert prefetched.key in arc.t1
        assert cold.key in arc.t1
        assert not arc.t2
        await engine.prefetch([prefetched.key, cold.key])  # resident: hints only
        # refreshed tail first (the call's first key ends the newest), still T1
        assert list(arc.t1)[-2:] == [cold.key, prefetched.key]
        assert not arc.t2
        assert not (await engine.load([prefetched])).failed  # a second use
        assert prefetched.key in arc.t2
        assert cold.key in arc.t1


async def test_under_lru_a_prefetch_of_a_resident_key_protects_it_from_eviction(
    tmp_path: Path,
) -> None:
    layout, _ = await _stored_on_nvme(tmp_path)
    chunks = prefetch_chunks()
    async with kvtier.TransferEngine(layout, prefetch_config(tmp_path, slots=3)) as engine:
        # fills the 3 slots, 0 oldest (a call's first chunk ends its newest)
        assert not (await engine.load(chunks[2::-1])).failed
        await engine.prefetch([chunks[0].key])  # needed soon
        assert not (await engine.load([chunks[3]])).failed  # evicts one
        assert engine.lookup([chunks[0].key, chunks[1].key]) == [
            kvtier.Residency.CPU,
            kvtier.Residency.NVME,
        ]
