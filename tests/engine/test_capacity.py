"""The reason kvtier exists: slots sized for the largest group, never the sum."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.layout import round_up
from tests.engine.helpers import clear_blocks, equal_groups, fill_random, key, snapshot


@pytest.mark.parametrize("blocks_per_chunk", [1, 3, 4])
async def test_eight_equal_groups_hold_sixteen_keys(blocks_per_chunk: int) -> None:
    nb = 2 * blocks_per_chunk + 1
    groups = equal_groups(nb, 8, 2, (2, 4, 64))  # 2 layers x 1 KiB pages per group
    layout = kvtier.KVLayout.from_tensors(groups)
    slot = layout.slot_nbytes(blocks_per_chunk)
    group_bytes = layout.group_nbytes(0, blocks_per_chunk)
    assert slot == round_up(group_bytes) + 4096
    sum_slot = round_up(8 * group_bytes) + 4096
    assert slot < sum_slot
    config = kvtier.EngineConfig(cpu_bytes=16 * slot, blocks_per_chunk=blocks_per_chunk)
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.num_slots == 16
        # The sum-sized design would hold only this many keys:
        assert config.cpu_bytes // sum_slot < 16
        chunks = []
        for g in range(8):
            for c in range(2):
                ids = list(range(c * blocks_per_chunk, (c + 1) * blocks_per_chunk))
                chunks.append(kvtier.Chunk(key(f"{g}-{c}", g), ids))
        expected = {ch.key: snapshot(layout, ch.key.group_id, list(ch.block_ids)) for ch in chunks}
        result = await engine.store(chunks)
        assert len(result.stored) == 16
        assert not result.rejected
        assert not result.skipped
        stats = engine.stats()
        assert stats.evictions == 0
        assert stats.keys_per_group == dict.fromkeys(range(8), 2)
        assert all(r is kvtier.Residency.CPU for r in engine.lookup([c.key for c in chunks]))
        for g in range(8):
            clear_blocks(layout, g, list(range(nb)))
        loaded = await engine.load(chunks)
        assert not loaded.failed
        assert len(loaded.loaded) == 16
        for ch in chunks:
            got = snapshot(layout, ch.key.group_id, list(ch.block_ids))
            assert all(torch.equal(a, b) for a, b in zip(got, expected[ch.key], strict=True))


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
async def test_unequal_groups_slot_sized_for_largest(blocks_per_chunk: int) -> None:
    nb = 4 * blocks_per_chunk
    groups = {}
    for g, ratio in enumerate((1, 2, 4)):
        t = torch.empty((nb, ratio * 1024), dtype=torch.uint8)
        fill_random(t, g)
        groups[g] = {f"l{g}": t}
    layout = kvtier.KVLayout.from_tensors(groups)
    sizes = [layout.group_nbytes(g, blocks_per_chunk) for g in range(3)]
    assert sizes == [blocks_per_chunk * 1024 * r for r in (1, 2, 4)]
    slot = layout.slot_nbytes(blocks_per_chunk)
    assert slot == round_up(max(sizes)) + 4096
    cpu_bytes = 7 * slot + slot // 2
    async with kvtier.TransferEngine(
        layout, kvtier.EngineConfig(cpu_bytes, blocks_per_chunk)
    ) as engine:
        assert engine.num_slots == cpu_bytes // slot == 7
        chunks = [
            kvtier.Chunk(
                key(i, i % 3),
                list(range((i // 3) * blocks_per_chunk, (i // 3 + 1) * blocks_per_chunk)),
            )
            for i in range(7)
        ]
        res = await engine.store(chunks)
        assert len(res.stored) == 7
        assert engine.stats().evictions == 0
        stats = engine.stats()
        assert stats.reserved_nbytes == 7 * slot
        assert stats.slot_waste_nbytes == 7 * slot - sum(sizes[i % 3] for i in range(7))
        # One more key of any group must evict exactly one.
        res = await engine.store([kvtier.Chunk(key("extra", 0), [0])])
        assert len(res.stored) == 1
        assert engine.stats().evictions == 1
