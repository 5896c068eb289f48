"""Within one call, the first chunk counts as the most recently used.

A serving engine stores and loads a request's prefix chain in one call, head
first. If the head were the oldest key of the call, the first eviction would
take it, and every key after it would hold a slot (or a row) that
``prefix_hits`` can no longer reach. So recency is assigned tail first: the
chain loses its tail first, as vLLM's offloading LRU does (its ``touch()``
walks the block hashes reversed). This holds for both policies in the CPU
pool, for stores, hits, prefetches and promotions, and for the NVMe rows,
also after a restart (their order comes from the rows' sequence numbers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvtier
from tests.engine.helpers import chunk_chain, equal_groups, filled_layout, keys_of

M, C, N = kvtier.Residency.MISS, kvtier.Residency.CPU, kvtier.Residency.NVME
BLOCK = 4096  # payload bytes of one block: a slot (and a row) is 8 KiB with its trailer


@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_a_chain_stored_in_one_call_loses_its_tail_first(eviction: str) -> None:
    layout, _ = filled_layout((64, BLOCK), seed=3)
    probe = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1))
    config = kvtier.EngineConfig(4 * probe.slot_nbytes, 1, eviction=eviction)
    async with kvtier.TransferEngine(layout, config) as engine:
        chain = chunk_chain("a", 4, 0)
        assert len((await engine.store(chain)).stored) == 4
        for i in range(3):
            await engine.store(chunk_chain(f"x{i}-", 1, 10 + i))  # one eviction each
            expect = [C] * (3 - i) + [M] * (i + 1)
            assert engine.lookup(keys_of(chain)) == expect, i
            assert engine.prefix_hits(keys_of(chain)) == 3 - i


async def test_a_chain_loaded_in_one_call_loses_its_tail_first() -> None:
    layout, t = filled_layout((64, BLOCK), seed=3)
    probe = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1))
    config = kvtier.EngineConfig(6 * probe.slot_nbytes, 1)
    async with kvtier.TransferEngine(layout, config) as engine:
        a, b = chunk_chain("a", 3, 0), chunk_chain("b", 3, 3)
        await engine.store(a)
        await engine.store(b)  # b is newer than a
        # Keys stored in one call each: loading b's tail alone makes it b's newest key.
        await engine.load([kvtier.Chunk(b[2].key, [40])])
        out = await engine.load([kvtier.Chunk(c.key, [20 + i]) for i, c in enumerate(a)])
        assert out.loaded == tuple(keys_of(a))  # call order is kept in the result
        for i in range(3):
            assert torch.equal(t[20 + i], t[i])
        # oldest first: b1 b0 b2 a2 a1 a0 (a loaded last, its head the newest)
        await engine.store(chunk_chain("x", 2, 10))  # two evictions
        assert engine.lookup(keys_of(b)) == [M, M, C]  # b2 was touched on its own
        assert engine.lookup(keys_of(a)) == [C, C, C]
        await engine.store(chunk_chain("y", 2, 13))
        assert engine.lookup(keys_of(b)) == [M, M, M]
        assert engine.lookup(keys_of(a)) == [C, C, M]


async def test_present_keys_of_a_store_are_touched_tail_first() -> None:
    layout, _ = filled_layout((64, BLOCK), seed=3)
    probe = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1))
    config = kvtier.EngineConfig(4 * probe.slot_nbytes, 1)
    async with kvtier.TransferEngine(layout, config) as engine:
        chain = chunk_chain("a", 3, 0)
        for c in reversed(chain):  # three calls: a0 is the newest, a2 the oldest
            await engine.store([c])
        # ... stored again in natural order, one call per key: a2 is now the newest
        for c in chain:
            await engine.store([c])
        # ... and once more in one call: skipped, and touched tail first
        res = await engine.store(chain)
        assert res.skipped == tuple(keys_of(chain))
        await engine.store(chunk_chain("x", 3, 10))  # one free slot, two evictions: a2, then a1
        assert engine.lookup(keys_of(chain)) == [C, M, M]


async def test_a_prefetched_chain_loses_its_tail_first(tmp_path: Path) -> None:
    layout, _ = filled_layout((64, BLOCK), seed=3)
    probe = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1))
    nvme = kvtier.NVMeConfig(root=tmp_path, capacity_bytes=1 << 24, namespace="chain")
    chain = chunk_chain("a", 4, 0)
    async with kvtier.TransferEngine(
        layout, kvtier.EngineConfig(8 * probe.slot_nbytes, 1, nvme=nvme)
    ) as engine:
        await engine.store(chain, durable=True)
    config = kvtier.EngineConfig(4 * probe.slot_nbytes, 1, nvme=nvme, write_through=False)
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.lookup(keys_of(chain)) == [N] * 4
        pre = await engine.prefetch(keys_of(chain))  # promoted through CPU slots
        assert pre.promoted == tuple(keys_of(chain))
        await engine.store(chunk_chain("x", 1, 10))  # one eviction from the CPU pool
        assert engine.lookup(keys_of(chain)) == [C, C, C, N]
        # A prefetch of resident keys refreshes them tail first too: oldest first,
        # x0 a2 a1 a0 after it.
        pre = await engine.prefetch(keys_of(chain[:3]))
        assert pre.resident == tuple(keys_of(chain[:3]))
        await engine.store(chunk_chain("y", 1, 11))  # evicts x0
        assert engine.lookup(keys_of(chain)) == [C, C, C, N]
        await engine.store(chunk_chain("z", 1, 12))  # evicts a2
        assert engine.lookup(keys_of(chain)) == [C, C, N, N]


async def test_nvme_rows_of_a_chain_are_evicted_tail_first_also_after_a_restart(
    tmp_path: Path,
) -> None:
    layout, t = filled_layout((64, BLOCK), seed=3)
    probe = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1))
    row = probe.slot_nbytes  # one group: a row is a slot (payload + 4 KiB trailer)
    nvme = kvtier.NVMeConfig(
        root=tmp_path,
        capacity_bytes=4096 + 4 * row,  # one segment header and four rows
        namespace="chain",
        segment_nbytes=4096 + 4 * row,
    )
    config = kvtier.EngineConfig(8 * probe.slot_nbytes, 1, nvme=nvme)
    chain = chunk_chain("a", 4, 0)
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chain, durable=True)
        assert engine.stats().nvme["rows_resident"] == 4
    for i in range(2):  # each round in a new engine: the order comes from the rows
        async with kvtier.TransferEngine(layout, config) as engine:
            assert engine.lookup(keys_of(chain)) == [N] * (4 - i) + [M] * i
            await engine.store(chunk_chain(f"x{i}-", 1, 10 + i), durable=True)  # evicts one row
            assert engine.lookup(keys_of(chain)) == [N] * (3 - i) + [M] * (i + 1)
            assert engine.prefix_hits(keys_of(chain)) == 3 - i
    # Promotions touch the rows tail first as well. Rows, oldest first: a1 a0 x0 x1.
    a0, a1 = chain[0].key, chain[1].key
    async with kvtier.TransferEngine(layout, config) as engine:
        out = await engine.load([kvtier.Chunk(a1, [30]), kvtier.Chunk(a0, [31])])
        assert out.loaded == (a1, a0)
        assert torch.equal(t[30], t[1])
        assert torch.equal(t[31], t[0])
        # Now x0 x1 a0 a1 (a1 was first in the call): three rows evicted, x0 x1 a0.
        for j in range(3):
            await engine.store(chunk_chain(f"z{j}-", 1, 20 + j), durable=True)
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.lookup([a0, a1]) == [M, N]


@pytest.mark.parametrize("call", ["load", "prefetch"])
@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_a_chain_of_hits_and_promotions_loses_its_tail_first(
    tmp_path: Path, eviction: str, call: str
) -> None:
    """A load (or prefetch) whose middle key is promoted: its hits were marked first."""
    layout, t = filled_layout((64, BLOCK), seed=3)
    probe = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1))
    chain = chunk_chain("a", 3, 0)
    nvme = kvtier.NVMeConfig(root=tmp_path, capacity_bytes=1 << 24, namespace="mixed")
    async with kvtier.TransferEngine(
        layout, kvtier.EngineConfig(8 * probe.slot_nbytes, 1, nvme=nvme)
    ) as engine:
        await engine.store(chain[1:2], durable=True)  # a1 on NVMe only after a restart
    config = kvtier.EngineConfig(4 * probe.slot_nbytes, 1, nvme=nvme, eviction=eviction)
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store([chain[0], chain[2]], durable=True)  # a0, a2 in CPU slots
        assert engine.lookup(keys_of(chain)) == [C, N, C]
        if call == "load":
            out = await engine.load([kvtier.Chunk(c.key, [20 + i]) for i, c in enumerate(chain)])
            assert sorted(out.loaded, key=keys_of(chain).index) == keys_of(chain)
            assert torch.equal(t[21], t[1])
        else:
            pre = await engine.prefetch(keys_of(chain))
            assert pre.promoted == (chain[1].key,)
        assert engine.lookup(keys_of(chain)) == [C, C, C]
        # one free slot, then two evictions: a2, then a1 (a0 is the newest)
        await engine.store(chunk_chain(f"x-{call}", 3, 10), durable=True)
        assert engine.lookup(keys_of(chain)) == [C, N, N], call


@pytest.mark.parametrize("grow_ahead", [True, False])
@pytest.mark.parametrize("run", range(3))
async def test_nvme_rows_rank_by_store_call_across_groups_right_after_start(
    tmp_path: Path, grow_ahead: bool, run: int
) -> None:
    """Three calls of three groups right after start() (their segment files still
    growing): a filler that needs the first call's room evicts the first call."""
    groups = equal_groups(64, 3, 1, (BLOCK // 2,))
    layout = kvtier.KVLayout.from_tensors(groups)
    probe = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1))
    row = probe.slot_nbytes  # equal groups: equal rows
    nvme = kvtier.NVMeConfig(
        root=tmp_path,
        capacity_bytes=6 * row,
        namespace="order",
        eviction_window=1,
        grow_ahead=grow_ahead,
    )
    config = kvtier.EngineConfig(16 * row, 1, nvme=nvme)
    first, second, third = (chunk_chain(f"g{g}-", 2, 2 * g, g) for g in (1, 0, 2))
    async with kvtier.TransferEngine(layout, config) as engine:
        for chain in (first, second, third):
            assert len((await engine.store(chain)).stored) == 2
        await engine.flush()
        await engine.store(chunk_chain("filler-", 2, 20, 1), durable=True)
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.lookup(keys_of(first)) == [M, M]
        assert engine.lookup(keys_of(second + third)) == [N] * 4
