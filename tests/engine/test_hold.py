"""engine.hold(keys): keys a scheduler counted on stay loadable until it loads them.

A serving loop asks ``prefix_hits`` when it admits a request and loads the
hits a step later; a store in between may evict them, and the load then fails
(the request must recompute). ``hold`` pins the keys in their CPU slots, and
the NVMe rows of keys that are only on NVMe, until ``release()`` (as vLLM's
``OffloadingManager.prepare_load`` protects blocks until ``complete_load``,
and LMCache's ``lookup(pin=True)`` until ``lookup_unpin``).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import kvtier
from kvtier.errors import WrongThreadError
from kvtier.metrics import register_prometheus
from tests.engine.helpers import chunk_chain, key, keys_of, nvme_rows, one_group

M, P, C, N = (
    kvtier.Residency.MISS,
    kvtier.Residency.PENDING,
    kvtier.Residency.CPU,
    kvtier.Residency.NVME,
)


@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_held_cpu_keys_are_never_evicted_until_released(eviction: str) -> None:
    layout, t, slot = one_group()
    config = kvtier.EngineConfig(4 * slot, 1, eviction=eviction)
    async with kvtier.TransferEngine(layout, config) as engine:
        chain = chunk_chain("a", 3, 0)
        await engine.store(chain)
        with engine.hold([*keys_of(chain), key("never", 0)]) as held:
            assert held.residency == (C, C, C, M)
            assert held.prefix_hits == 3
            assert engine.stats().slots_pinned == 3
            # a burst of stores: one free slot, the held keys cannot make room
            res = await engine.store(chunk_chain("x", 3, 10))
            assert len(res.stored) == 1
            assert len(res.rejected) == 2
            assert engine.lookup(keys_of(chain)) == [C, C, C]
            out = await engine.load([kvtier.Chunk(c.key, [30 + i]) for i, c in enumerate(chain)])
            assert out.loaded == tuple(keys_of(chain))
            for i in range(3):
                assert torch.equal(t[30 + i], t[i])
        assert held.released
        assert engine.stats().slots_pinned == 0
        res = await engine.store(chunk_chain("y", 3, 20))  # room again: the chain is evictable
        assert len(res.stored) == 3
        assert M in engine.lookup(keys_of(chain))


async def test_held_nvme_rows_are_never_evicted_until_released(tmp_path: Path) -> None:
    layout, t, slot = one_group()
    config = kvtier.EngineConfig(8 * slot, 1, nvme=nvme_rows(tmp_path, slot, 4))
    chain = chunk_chain("a", 3, 0)
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chain, durable=True)
    async with kvtier.TransferEngine(layout, config) as engine:
        held = engine.hold(keys_of(chain))
        assert held.residency == (N, N, N)
        assert engine.stats().slots_pinned == 0  # rows are held, not slots
        assert engine.stats().nvme["rows_pinned"] == 3
        registry = CollectorRegistry()
        register_prometheus(engine, registry)
        assert registry.get_sample_value("kvtier_nvme_rows_pinned") == 3
        # four rows: one is free, the next two writes find no row to take
        with pytest.raises(kvtier.errors.NotDurableError) as info:
            await engine.store(chunk_chain("x", 3, 10), durable=True)
        assert len(info.value.failed) == 2
        assert all(e.kind == "capacity" for e in info.value.failed.values())  # type: ignore[attr-defined]
        assert engine.lookup(keys_of(chain)) == [N, N, N]
        # a held row is promoted and loaded as usual
        out = await engine.load([kvtier.Chunk(chain[0].key, [40])])
        assert out.loaded == (chain[0].key,)
        assert torch.equal(t[40], t[0])
        held.release()
        held.release()  # idempotent
        assert engine.stats().nvme["rows_pinned"] == 0
        assert registry.get_sample_value("kvtier_nvme_rows_pinned") == 0
        res = await engine.store(chunk_chain("y", 2, 20), durable=True)  # rows can be taken again
        assert len(res.stored) == 2
        assert engine.stats().nvme["evictions"] == 2


async def test_a_key_in_flight_is_reported_pending_and_not_held() -> None:
    layout, _, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1)) as engine:
        a = chunk_chain("a", 1, 0)
        store = asyncio.ensure_future(engine.store(a))
        await asyncio.sleep(0)  # reserved, the copy not yet done
        held = engine.hold(keys_of(a))
        assert held.residency == (P,)
        assert engine.prefix_hits(keys_of(a)) == 1  # a load would wait for it ...
        assert held.prefix_hits == 0  # ... but the hold does not hold it
        await store
        assert engine.stats().slots_pinned == 0
        held.release()


async def test_aclose_releases_holds_and_release_after_close_does_nothing(
    tmp_path: Path,
) -> None:
    layout, _, slot = one_group()
    nvme = kvtier.NVMeConfig(root=tmp_path, capacity_bytes=1 << 24, namespace="close")
    config = kvtier.EngineConfig(4 * slot, 1, nvme=nvme)
    chain = chunk_chain("a", 2, 0)
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chain[:1], durable=True)
    engine = await kvtier.TransferEngine(layout, config).start()
    await engine.store(chain[1:])
    held = engine.hold(keys_of(chain))
    assert held.residency == (N, C)
    await asyncio.wait_for(engine.aclose(), 30)  # a forgotten hold does not block close
    assert held.released
    held.release()
    with pytest.raises(kvtier.EngineClosedError):
        engine.hold(keys_of(chain))
    # the namespace was released: another engine opens it and finds both keys
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.lookup(keys_of(chain)) == [N, N]


async def test_hold_checks_its_keys_and_its_thread() -> None:
    layout, _, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1)) as engine:
        await engine.store(chunk_chain("a", 1, 0))
        with pytest.raises(kvtier.errors.InvalidArgumentError):
            engine.hold(key("a0", 0))  # type: ignore[arg-type]
        with pytest.raises(kvtier.errors.UnknownGroupError):
            engine.hold([key("a0", 0), key("b", 7)])
        assert engine.stats().slots_pinned == 0  # nothing held by a refused call
        held = engine.hold([key("a0", 0)])
        errs: list[BaseException] = []

        def other() -> None:
            for call in (lambda: engine.hold([key("a0", 0)]), held.release):
                try:
                    call()
                except BaseException as exc:
                    errs.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(30)
        assert [type(e) for e in errs] == [WrongThreadError, WrongThreadError]
        assert not held.released
        assert engine.stats().slots_pinned == 1
        held.release()
        assert engine.stats().slots_pinned == 0


def test_background_engine_hold_releases_on_the_engine_thread() -> None:
    layout, _, slot = one_group()
    with kvtier.BackgroundEngine(layout, kvtier.EngineConfig(2 * slot, 1)) as engine:
        a = chunk_chain("a", 1, 0)
        engine.store(a).result(30)
        with engine.hold(keys_of(a)) as held:
            assert held.residency == (C,)
            assert engine.stats().slots_pinned == 1
            res = engine.store(chunk_chain("x", 2, 10)).result(30)
            assert len(res.rejected) == 1  # one free slot; the held key stays
        assert held.released
        assert engine.stats().slots_pinned == 0
        assert engine.lookup(keys_of(a)) == [C]


async def test_a_held_row_that_fails_its_read_is_freed_at_release(tmp_path: Path) -> None:
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(4 * slot, 1, nvme=nvme_rows(tmp_path, slot, 1))
    a = chunk_chain("a", 1, 0)
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(a, durable=True)
    for seg in tmp_path.rglob("*.kvrows"):  # a's row is row 0 of one of them
        with open(seg, "r+b") as f:  # flip one payload byte of row 0 (after the 4 KiB header)
            f.seek(4096 + 7)
            byte = f.read(1)
            f.seek(4096 + 7)
            f.write(bytes([byte[0] ^ 1]))
    async with kvtier.TransferEngine(layout, config) as engine:
        held = engine.hold(keys_of(a))
        assert held.residency == (N,)
        out = await engine.load([kvtier.Chunk(a[0].key, [40])])
        assert out.failed[a[0].key].kind == "checksum"  # type: ignore[attr-defined]
        assert engine.lookup(keys_of(a)) == [M]
        # the dropped row is still held: the one row of the tier cannot be taken
        with pytest.raises(kvtier.errors.NotDurableError):
            await engine.store(chunk_chain("b", 1, 10), durable=True)
        held.release()
        res = await engine.store(chunk_chain("c", 1, 11), durable=True)  # the row is free now
        assert len(res.stored) == 1


async def test_stores_that_copy_nothing_yield_so_nvme_writes_can_free_the_slots(
    tmp_path: Path,
) -> None:
    """A scheduler retrying rejected stores in a loop must not starve the writes.

    A store whose keys are all rejected (every slot pinned by write-through)
    still yields, so that a retry loop lets the NVMe writes that free the slots
    run (without the yield: 76,000 stores in 2 s, no row written).
    """
    layout, _, slot = one_group()
    nvme = kvtier.NVMeConfig(root=tmp_path, capacity_bytes=1 << 24, namespace="yield")
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(2 * slot, 1, nvme=nvme)) as e:
        first = await e.store(chunk_chain("a", 2, 0))  # both slots pinned until written
        assert len(first.stored) == 2
        late = chunk_chain("b", 1, 10)
        for _ in range(100_000):  # no sleep: only the store itself may yield
            if (await e.store(late)).stored:
                break
            assert not (await e.load([kvtier.Chunk(key("never", 0), [20])])).loaded
        else:
            raise AssertionError("the rows were never written: the retries starved them")
        assert (await e.store(late)).skipped == (late[0].key,)
        await e.flush()


@pytest.mark.parametrize("bring_in", ["prefetch", "load"])
async def test_a_held_nvme_key_promoted_stays_pinned_in_its_slot_until_release(
    tmp_path: Path, bring_in: str
) -> None:
    """A scheduler holds a request's keys, prefetches the ones on NVMe ahead, and loads a
    step later: stores in between must not push them back to NVMe. The hold pins the
    promoted slots, not only the rows, so the promoted copies are not evicted again."""
    layout, t, slot = one_group()
    chain = chunk_chain("a", 3, 0)
    config = kvtier.EngineConfig(4 * slot, 1, nvme=nvme_rows(tmp_path, slot))
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chain, durable=True)
    async with kvtier.TransferEngine(layout, config) as engine:
        held = engine.hold([*keys_of(chain), chain[0].key])  # a0 twice: held twice
        assert held.residency == (N, N, N, N)
        if bring_in == "prefetch":
            pre = await engine.prefetch(keys_of(chain[:2]))
            assert set(pre.promoted) == set(keys_of(chain[:2]))
        else:
            out = await engine.load(
                [kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(chain[:2])]
            )
            assert out.loaded == tuple(keys_of(chain[:2]))
        assert engine.stats().slots_pinned == 2
        # a burst of stores: two free slots are left, the promoted keys stay in theirs
        res = await engine.store(chunk_chain("x", 4, 10))
        assert len(res.stored) == 2
        assert engine.lookup(keys_of(chain)) == [C, C, N]
        await engine.flush()  # the new keys' slots are evictable once their rows are written
        out = await engine.load([kvtier.Chunk(c.key, [50 + i]) for i, c in enumerate(chain)])
        assert out.loaded == tuple(keys_of(chain))
        for i in range(3):
            assert torch.equal(t[50 + i], t[i])
        assert engine.stats().slots_pinned == 3  # a2 was promoted by that load: pinned too
        assert engine.stats().nvme["rows_pinned"] == 3
        held.release()
        assert engine.stats().slots_pinned == 0
        assert engine.stats().nvme["rows_pinned"] == 0
        res = await engine.store(chunk_chain("y", 4, 20))  # evictable again
        assert len(res.stored) == 4
        assert C not in engine.lookup(keys_of(chain))


async def test_a_promotion_after_the_release_pins_nothing(tmp_path: Path) -> None:
    layout, _, slot = one_group()
    chain = chunk_chain("a", 2, 0)
    config = kvtier.EngineConfig(4 * slot, 1, nvme=nvme_rows(tmp_path, slot))
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chain, durable=True)
    async with kvtier.TransferEngine(layout, config) as engine:
        with engine.hold(keys_of(chain)) as held:
            assert held.residency == (N, N)
        other = engine.hold(keys_of(chain[1:]))  # a second hold of a1 only
        pre = await engine.prefetch(keys_of(chain))
        assert set(pre.promoted) == set(keys_of(chain))
        assert engine.stats().slots_pinned == 1  # a1, by the open hold
        other.release()
        assert engine.stats().slots_pinned == 0
