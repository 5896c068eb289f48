"""CUDA ordering: a call's copies wait for the work its CALLER queued before the call.

The caller's stream is the current stream of the calling thread at the call
(or the ``after=`` event it passes), not the stream that happens to be current
when the job is submitted later: another ``torch.cuda.stream`` context of the
same thread, or the engine thread of a BackgroundEngine. The GPU tests are
skipped without CUDA; the argument checks run everywhere.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import kvtier
from kvtier.errors import InvalidArgumentError
from tests.engine.helpers import fill_random, key, same

gpu = pytest.mark.gpu


def _layout(device: str) -> tuple[kvtier.KVLayout, torch.Tensor]:
    full = torch.empty((64, 2, 16, 8, 128), dtype=torch.float32)
    fill_random(full, 7)
    full = full.to(device)
    layout = kvtier.KVLayout.from_tensors({0: {"full": full}}, block_dim={"full": 0})
    return layout, full


def _queue_slow_write(full: torch.Tensor, blocks: slice) -> None:
    """Queue about half a second of matmuls on the current stream, then write ``full[blocks]``."""
    a = torch.randn(8192, 8192, device=full.device)
    for _ in range(24):
        a = a @ a / 128.0
    part = full[blocks]
    part.copy_(a.flatten()[: part.numel()].view_as(part))


def _queue_slow_read(full: torch.Tensor, blocks: slice) -> torch.Tensor:
    """Queue about half a second of matmuls on the current stream, then a copy of ``full[blocks]``.

    The copy runs after the matmuls by stream order (a byte copy: arithmetic
    would turn -0.0 into 0.0 and quiet signalling NaNs of the random bytes).
    """
    a = torch.randn(8192, 8192, device=full.device)
    for _ in range(24):
        a = a @ a / 128.0
    return full[blocks].clone()


def _config() -> kvtier.EngineConfig:
    return kvtier.EngineConfig(64 << 20, 4)


@gpu
async def test_store_waits_for_the_stream_current_at_the_call() -> None:
    # The store is called under a side stream whose queued kernels write its
    # blocks; its job is submitted one loop iteration later, once the caller
    # has left the side stream's context (the default stream is current).
    layout, full = _layout("cuda")
    side = torch.cuda.Stream()
    async with kvtier.TransferEngine(layout, _config()) as engine:
        with torch.cuda.stream(side):
            _queue_slow_write(full, slice(0, 4))
            task = asyncio.ensure_future(engine.store([kvtier.Chunk(key("s", 0), [0, 1, 2, 3])]))
            await asyncio.sleep(0)  # the call ran (its mark is on `side`); no job yet
        assert len((await task).stored) == 1
        torch.cuda.synchronize()
        expected = full[0:4].clone()
        assert not (await engine.load([kvtier.Chunk(key("s", 0), [4, 5, 6, 7])])).failed
        torch.cuda.synchronize()
    assert same(full[4:8], expected)


@gpu
async def test_load_waits_for_reads_queued_before_the_call() -> None:
    # Kernels queued before the load read the blocks it overwrites: they must
    # see the old bytes, and the blocks end with the loaded ones.
    layout, full = _layout("cuda")
    side = torch.cuda.Stream()
    async with kvtier.TransferEngine(layout, _config()) as engine:
        assert len((await engine.store([kvtier.Chunk(key("l", 0), [0, 1, 2, 3])])).stored) == 1
        torch.cuda.synchronize()
        stored, old = full[0:4].clone(), full[4:8].clone()
        with torch.cuda.stream(side):
            seen = _queue_slow_read(full, slice(4, 8))
            task = asyncio.ensure_future(engine.load([kvtier.Chunk(key("l", 0), [4, 5, 6, 7])]))
            await asyncio.sleep(0)
        assert not (await task).failed
        torch.cuda.synchronize()
    assert same(seen, old)
    assert same(full[4:8], stored)


@gpu
async def test_after_event_is_waited_for() -> None:
    # An explicit event: recorded on a side stream after its writes, while the
    # calling thread's current stream (the default one) has nothing queued.
    layout, full = _layout("cuda")
    side = torch.cuda.Stream()
    async with kvtier.TransferEngine(layout, _config()) as engine:
        with torch.cuda.stream(side):
            _queue_slow_write(full, slice(8, 12))
            written = torch.cuda.Event()
            written.record(side)
        res = await engine.store([kvtier.Chunk(key("e", 0), [8, 9, 10, 11])], after=written)
        assert len(res.stored) == 1
        torch.cuda.synchronize()
        expected = full[8:12].clone()
        assert not (await engine.load([kvtier.Chunk(key("e", 0), [12, 13, 14, 15])])).failed
        torch.cuda.synchronize()
    assert same(full[12:16], expected)


@gpu
def test_background_store_and_load_wait_for_the_calling_threads_stream() -> None:
    layout, full = _layout("cuda")
    side = torch.cuda.Stream()
    with kvtier.BackgroundEngine(layout, _config()) as engine:
        with torch.cuda.stream(side):
            _queue_slow_write(full, slice(16, 20))
            fut = engine.store([kvtier.Chunk(key("b", 0), [16, 17, 18, 19])])
        assert len(fut.result(timeout=60).stored) == 1
        torch.cuda.synchronize()
        expected, old = full[16:20].clone(), full[20:24].clone()
        with torch.cuda.stream(side):
            seen = _queue_slow_read(full, slice(20, 24))
            out = engine.load([kvtier.Chunk(key("b", 0), [20, 21, 22, 23])]).result(timeout=60)
        assert not out.failed
        torch.cuda.synchronize()
    assert same(seen, old)
    assert same(full[20:24], expected)


@gpu
async def test_after_must_be_a_cuda_event() -> None:
    layout, _ = _layout("cuda")
    async with kvtier.TransferEngine(layout, _config()) as engine:
        with pytest.raises(InvalidArgumentError, match=r"torch\.cuda\.Event"):
            await engine.store([kvtier.Chunk(key("x", 0), [0])], after=torch.cuda.Stream())
        assert engine.lookup([key("x", 0)]) == [kvtier.Residency.MISS]


async def test_after_on_a_cpu_layout_is_refused_and_changes_nothing() -> None:
    layout, full = _layout("cpu")
    before = full.clone()
    async with kvtier.TransferEngine(layout, _config()) as engine:
        with pytest.raises(InvalidArgumentError, match="CUDA layout"):
            await engine.store([kvtier.Chunk(key("c", 0), [0])], after=object())
        assert engine.lookup([key("c", 0)]) == [kvtier.Residency.MISS]
        assert len((await engine.store([kvtier.Chunk(key("c", 0), [0])])).stored) == 1
        full.zero_()
        with pytest.raises(InvalidArgumentError, match="CUDA layout"):
            await engine.load([kvtier.Chunk(key("c", 0), [0])], after=object())
        assert engine.stats().hits == 0
        assert not full.any()
        assert not (await engine.load([kvtier.Chunk(key("c", 0), [0])])).failed
    assert same(full[0], before[0])


def test_background_after_on_a_cpu_layout_is_refused() -> None:
    layout, _ = _layout("cpu")
    with kvtier.BackgroundEngine(layout, _config()) as engine:
        fut = engine.store([kvtier.Chunk(key("c", 0), [0])], after=object())
        with pytest.raises(InvalidArgumentError, match="CUDA layout"):
            fut.result(timeout=30)
        fut = engine.load([kvtier.Chunk(key("c", 0), [0])], after=object())
        with pytest.raises(InvalidArgumentError, match="CUDA layout"):
            fut.result(timeout=30)
        assert engine.lookup([key("c", 0)]) == [kvtier.Residency.MISS]
