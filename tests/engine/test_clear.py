"""engine.clear(): a serving engine's cache reset while kvtier runs.

``clear()`` drops every CPU-resident key nothing pins, ``clear(nvme=True)``
also the namespace's NVMe rows (blanked: a restart does not find them). It
waits for the transfers in flight at the call, leaves held keys alone and
reports them; stats count the freed slots at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

import kvtier
from tests.engine.helpers import (
    Gate,
    chunk_chain,
    clear_blocks,
    keys_of,
    nvme_only,
    nvme_rows,
    one_group,
    settle,
    until,
)

M, C, N = kvtier.Residency.MISS, kvtier.Residency.CPU, kvtier.Residency.NVME


async def test_clear_drops_unpinned_cpu_keys_and_reports_held_ones() -> None:
    layout, t, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(8 * slot, 1)) as engine:
        a, b = chunk_chain("a", 4, 0), chunk_chain("b", 2, 4)
        await engine.store(a + b)
        with engine.hold(keys_of(b)):
            res = await engine.clear()
            assert res.cpu_dropped == 4
            assert res.nvme_dropped == 0
            assert set(res.kept) == set(keys_of(b))
            assert engine.lookup(keys_of(a)) == [M] * 4
            assert engine.lookup(keys_of(b)) == [C, C]
            stats = engine.stats()
            assert stats.slots_free == 6
            assert stats.slots_pinned == 2
            assert stats.keys_per_group.get(0, 0) == 2
            want = t[4:6].clone()
            t[20:22] = 0
            out = await engine.load([kvtier.Chunk(c.key, [20 + i]) for i, c in enumerate(b)])
            assert out.loaded == tuple(keys_of(b))
            assert torch.equal(t[20:22], want)
        res = await engine.clear()
        assert res.cpu_dropped == 2
        assert res.kept == ()
        assert engine.stats().slots_free == 8
        # the freed slots take new keys
        assert len((await engine.store(chunk_chain("c", 8, 30))).stored) == 8


async def test_clear_keeps_nvme_rows_and_clear_nvme_drops_them_for_good(tmp_path: Path) -> None:
    layout, t, slot = one_group()
    config = kvtier.EngineConfig(8 * slot, 1, nvme=nvme_rows(tmp_path, slot))
    chain = chunk_chain("a", 4, 0)
    want = t[0:4].clone()
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chain, durable=True)
        res = await engine.clear()
        assert res.cpu_dropped == 4
        assert engine.lookup(keys_of(chain)) == [N] * 4
        clear_blocks(layout, 0, [0, 1, 2, 3])
        out = await engine.load(chain)  # promoted back from the rows
        assert out.loaded == tuple(keys_of(chain))
        assert torch.equal(t[0:4], want)
        res = await engine.clear(nvme=True)
        assert res.cpu_dropped == 4
        assert res.nvme_dropped == 4
        assert engine.lookup(keys_of(chain)) == [M] * 4
        assert engine.stats().slots_free == 8
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.lookup(keys_of(chain)) == [M] * 4  # blanked, not found again


async def test_clear_nvme_leaves_a_held_row(tmp_path: Path) -> None:
    layout, _t, slot = one_group()
    config = kvtier.EngineConfig(8 * slot, 1, nvme=nvme_rows(tmp_path, slot))
    chain = chunk_chain("a", 3, 0)
    await nvme_only(layout, config, chain)
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.lookup(keys_of(chain)) == [N] * 3
        with engine.hold(keys_of(chain[:1])):
            res = await engine.clear(nvme=True)
            assert res.nvme_dropped == 2
            assert res.kept == (chain[0].key,)
            assert engine.lookup(keys_of(chain)) == [N, M, M]
            clear_blocks(layout, 0, [0])
            out = await engine.load(chain[:1])
            assert out.loaded == (chain[0].key,)


async def test_clear_during_a_store_lets_it_finish_and_frees_its_slots() -> None:
    layout, _t, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(8 * slot, 1)) as engine:
        chain = chunk_chain("a", 6, 0)
        store = asyncio.create_task(engine.store(chain))
        await asyncio.sleep(0)  # the store has reserved its slots
        assert engine.stats().slots_free < 8
        res = await engine.clear()
        stored = await store
        assert stored.stored == tuple(keys_of(chain))  # nothing in flight changed
        assert res.cpu_dropped == 6
        assert engine.stats().slots_free == 8
        assert engine.lookup(keys_of(chain)) == [M] * 6


async def test_clear_during_a_load_from_nvme_waits_for_it(tmp_path: Path) -> None:
    layout, t, slot = one_group()
    gate = Gate()
    config = kvtier.EngineConfig(
        8 * slot, 1, nvme=nvme_rows(tmp_path, slot, row_io_wrapper=gate.wrap)
    )
    chain = chunk_chain("a", 4, 0)
    want = t[0:4].clone()
    await nvme_only(layout, config, chain)
    clear_blocks(layout, 0, [0, 1, 2, 3])
    async with kvtier.TransferEngine(layout, config) as engine:
        gate.armed = True
        load = asyncio.create_task(engine.load(chain))
        assert await until(gate.reading.is_set)
        clear = asyncio.create_task(engine.clear(nvme=True))
        await settle(20)
        assert not clear.done()  # it waits for the read in flight
        gate.armed = False
        gate.opened.set()
        out, res = await load, await clear
        assert out.loaded == tuple(keys_of(chain))
        assert torch.equal(t[0:4], want)  # the load got its bytes
        assert res.cpu_dropped == 4
        assert res.nvme_dropped == 4
        assert engine.lookup(keys_of(chain)) == [M] * 4


def test_background_engine_clear_runs_on_the_engine_thread() -> None:
    layout, _t, slot = one_group()
    with kvtier.BackgroundEngine(layout, kvtier.EngineConfig(4 * slot, 1)) as engine:
        chain = chunk_chain("a", 3, 0)
        engine.store(chain).result(30)
        res = engine.clear().result(30)
        assert res.cpu_dropped == 3
        assert engine.lookup(keys_of(chain)) == [M] * 3
