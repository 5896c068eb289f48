"""CUDA path: dedicated streams, compute-stream ordering, pinned slots (skipped without a GPU)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import kvtier
from tests.engine.helpers import key, same

pytestmark = pytest.mark.gpu


def _layout(
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[kvtier.KVLayout, torch.Tensor, torch.Tensor]:
    full = torch.randn((64, 2, 16, 8, 128), device="cuda").to(dtype)
    kv_first = torch.randn((2, 64, 16, 2, 64), device="cuda").to(dtype)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"full": full}, 1: {"swa": kv_first}}, block_dim={"full": 0, "swa": 1}
    )
    return layout, full, kv_first


async def test_cuda_roundtrip_bitwise_and_pinned() -> None:
    layout, full, swa = _layout()
    chunks = [kvtier.Chunk(key(i, i % 2), [(7 * i + j) % 64 for j in range(4)]) for i in range(12)]
    before = (full.clone(), swa.clone())
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(64 << 20, 4)) as engine:
        assert engine.stats().pinned_memory
        res = await engine.store(chunks)
        assert len(res.stored) == 12
        full.zero_()
        swa.zero_()
        out = await engine.load(chunks)
        assert not out.failed
        torch.cuda.synchronize()
    # Only the stored blocks come back (the others stay zero).
    for g, t, b, dim in ((0, full, before[0], 0), (1, swa, before[1], 1)):
        ids = torch.tensor(sorted({i for c in chunks if c.key.group_id == g for i in c.block_ids}))
        assert not same(t, b)
        assert same(t.index_select(dim, ids.cuda()), b.index_select(dim, ids.cuda()))


async def test_store_waits_for_the_compute_stream() -> None:
    layout, full, _ = _layout(torch.float32)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(64 << 20, 4)) as engine:
        # A long kernel on the compute stream writes the blocks the store reads.
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            a = a @ a / 64.0
        full[0:4].copy_(a.flatten()[: full[0:4].numel()].view_as(full[0:4]))
        expected = full[0:4].clone()
        await engine.store([kvtier.Chunk(key("cs", 0), [0, 1, 2, 3])])
        full[0:4].zero_()
        await engine.load([kvtier.Chunk(key("cs", 0), [4, 5, 6, 7])])
        torch.cuda.synchronize()
        assert same(full[4:8], expected)


async def test_loop_stays_responsive_during_cuda_jobs() -> None:
    layout, _, _ = _layout()
    chunks = [kvtier.Chunk(key(i, 0), [(i * 4 + j) % 64 for j in range(4)]) for i in range(16)]
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(64 << 20, 4)) as engine:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        await engine.store(chunks)
        task.cancel()
        assert ticks > 0


async def test_partial_chunks_round_trip_bitwise() -> None:
    layout, full, swa = _layout()
    chunks = [
        kvtier.Chunk(key(f"p{i}", i % 2), [(11 * i + 5 * j) % 64 for j in range(2)], offset=1)
        for i in range(6)
    ]
    before = (full.clone(), swa.clone())
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(64 << 20, 4)) as engine:
        assert len((await engine.store(chunks)).stored) == 6
        full.zero_()
        swa.zero_()
        assert not (await engine.load(chunks)).failed
        torch.cuda.synchronize()
    for c in chunks:
        t, b = (full, before[0]) if c.key.group_id == 0 else (swa, before[1])
        ids = torch.tensor(c.block_ids, device="cuda")
        dim = 0 if c.key.group_id == 0 else 1
        assert same(t.index_select(dim, ids), b.index_select(dim, ids))


async def test_store_of_scattered_blocks_does_not_wait_for_compute_on_the_loop() -> None:
    # Building a job's block-index tensor with torch.tensor(..., device=cuda)
    # synchronizes the copy stream, which waits for the compute stream: the
    # loop thread would block until the queued kernels end.
    layout, _, _ = _layout(torch.float32)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(64 << 20, 4)) as engine:
        a = torch.randn(8192, 8192, device="cuda")
        for _ in range(24):  # a few hundred milliseconds of queued compute
            a = a @ a / 128.0
        task = asyncio.ensure_future(engine.store([kvtier.Chunk(key("sc", 0), [9, 3, 7, 1])]))
        await asyncio.sleep(0.002)  # the store's job has been submitted by now
        still_computing = not torch.cuda.current_stream().query()
        await task
        assert still_computing
