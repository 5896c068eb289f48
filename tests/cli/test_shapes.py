"""The bench's synthetic model shapes (kvtier._shapes), DeepSeek-V3.2's MLA + indexer above all."""

from __future__ import annotations

import asyncio
import hashlib
import math
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier._shapes import SHAPES, model_shape

T = 16


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_builtin_shape_builds_its_groups(name: str) -> None:
    shape = model_shape(name, T)
    layout = shape.build(2)
    groups = shape.groups()
    assert list(layout.group_ids) == list(range(len(groups)))
    assert sorted(i for g in groups for i in g) == list(range(len(shape.layers)))
    names = [n for g in layout.group_ids for lay in layout.group(g).layers for n in lay.names]
    assert len(names) == len(set(names)) == len(shape.layers)
    # The slot holds ONE group's chunk, sized for the largest group (never the sum).
    per_group = [layout.group_nbytes(g, 4) for g in layout.group_ids]
    assert layout.slot_nbytes(4) >= max(per_group)
    if len(per_group) > 1:
        assert layout.slot_nbytes(4) < sum(per_group)
    assert shape.block_nbytes() == sum(
        math.prod(lay.page_shape) * shape.dtype.itemsize for lay in shape.layers
    )


def test_deepseek_v32_is_mla_plus_indexer_in_vllm_fp8_formats() -> None:
    shape = model_shape("deepseek-v3.2", T)
    assert shape.dtype == torch.uint8
    assert [len(g) for g in shape.groups()] == [61, 61]
    mla, indexer = shape.groups()
    assert {shape.layers[i].kind for i in mla} == {"mla"}
    assert {shape.layers[i].kind for i in indexer} == {"indexer"}
    # fp8_ds_mla: 512 FP8 + 4 float32 scales + 64 bf16 rope values per token.
    assert {shape.layers[i].page_shape for i in mla} == {(T, 512 + 4 * 4 + 64 * 2)}
    # Indexer keys: 128 FP8 values + one float32 scale per quant block of 128.
    assert {shape.layers[i].page_shape for i in indexer} == {(T, 128 + 128 // 128 * 4)}
    layout = shape.build(1)
    assert layout.group(0).layers[0].names == ("model.layers.0.self_attn.mla_attn",)
    assert layout.group(1).layers[-1].names == ("model.layers.60.self_attn.indexer.k_cache",)
    assert layout.group_nbytes(0, 4) == 61 * 4 * T * 656
    assert layout.group_nbytes(1, 4) == 61 * 4 * T * 132
    assert layout.slot_nbytes(4) >= layout.group_nbytes(0, 4)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_deepseek_v32_round_trips_both_groups_through_nvme(tmp_path: Path, loop: str) -> None:
    """A full and a partial chunk of each group: stored, engine reopened, loaded from NVMe."""
    shape = model_shape("deepseek-v3.2", 4)
    gen = torch.Generator().manual_seed(3)
    tensors = {  # as ModelShape.build makes them, kept here to check the bytes
        shape.layers[i].name or "": torch.randint(
            0, 256, (12, *shape.layers[i].page_shape), dtype=torch.uint8, generator=gen
        )
        for g in shape.groups()
        for i in g
    }
    groups = {
        g: {shape.layers[i].name or "": tensors[shape.layers[i].name or ""] for i in idx}
        for g, idx in enumerate(shape.groups())
    }
    layout = kvtier.KVLayout.from_tensors(groups, tokens_per_block=4)
    original = {n: t.clone() for n, t in tensors.items()}
    cfg = kvtier.EngineConfig(
        cpu_bytes=8 * layout.slot_nbytes(3),
        blocks_per_chunk=3,
        nvme=kvtier.NVMeConfig(root=str(tmp_path), capacity_bytes=64 << 20, namespace="ds32"),
    )

    def key(g: int, n: int) -> kvtier.OffloadKey:
        return kvtier.OffloadKey(hashlib.sha256(f"{g}/{n}".encode()).digest(), g)

    stored = [kvtier.Chunk(key(g, 0), [5, 1, 9]) for g in (0, 1)]
    stored += [kvtier.Chunk(key(g, 1), [2, 7], offset=1) for g in (0, 1)]  # partial

    async def main() -> None:
        async with kvtier.TransferEngine(layout, cfg) as engine:
            res = await engine.store(stored, durable=True)
            assert len(res.stored) == 4
        for t in tensors.values():
            t.zero_()
        async with kvtier.TransferEngine(layout, cfg) as engine:
            assert engine.lookup([c.key for c in stored]) == [kvtier.Residency.NVME] * 4
            assert engine.stored_range(key(0, 1)) == (1, 3)
            out = await engine.load(stored)
            assert not out.failed
        used = {5, 1, 9, 2, 7}
        for n, t in tensors.items():
            for b in range(12):
                if b in used:
                    assert torch.equal(t[b], original[n][b]), (n, b)
                else:
                    assert not t[b].any(), (n, b)  # no other block was written

    if loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
