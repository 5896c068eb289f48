"""Cancellation: tasks cancelled at random points leave no pinned or writing slot, no leaked work.

"At rest" means: ``stats().slots_pinned == 0``, ``stats().slots_writing == 0``
and no task beyond the ones that existed before the engine was used; and
``aclose()`` completes. NVMe I/O is slowed down through the RowIO wrapper so
that cancellations land while copies, row writes, syncs and promotions are in
flight.
"""

from __future__ import annotations

import asyncio
import pathlib
import random
import time
from typing import Any

import pytest
import torch

import kvtier
from kvtier import _transfer, errors

from ._faultio import KeyFault, Wrapper
from ._model import (
    Gpu,
    at_rest,
    chunks,
    chunks_for,
    engine_config,
    key,
    load_check,
    nvme_config,
    store_ok,
)


async def _cancel_after(rng: random.Random, task: asyncio.Future[object]) -> None:
    """Cancel ``task`` after a random number of loop iterations or a random short time."""
    if rng.random() < 0.5:
        for _ in range(rng.randrange(0, 12)):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(rng.uniform(0, 0.004))
    task.cancel()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_cancellation_during_store_load_flush(tmp_path: pathlib.Path, seed) -> None:
    rng = random.Random(seed)
    gpu = Gpu(num_blocks=64)
    slow = Wrapper(
        KeyFault("write", "delay", delay_s=0.002), KeyFault("read", "delay", delay_s=0.002)
    )
    cfg = engine_config(gpu, 12, nvme_config(tmp_path, wrapper=slow))
    baseline = len(asyncio.all_tasks())
    universe = [key(f"c{seed}-{i}", i % 2) for i in range(40)]
    cancelled = {"store": 0, "load": 0, "flush": 0, "durable": 0}
    engine = kvtier.TransferEngine(gpu.layout, cfg)
    await engine.start()
    for _ in range(30):
        ops = []
        cancellers: list[asyncio.Future[None]] = []
        for slot in range(4):  # four concurrent ops on disjoint GPU blocks
            kind = rng.choice(sorted(cancelled))
            cs = chunks_for(rng.sample(universe, 2), first_block=16 * slot)
            if kind in ("store", "durable"):
                for c in cs:
                    gpu.write(c)
                coro = engine.store(cs, durable=kind == "durable")
            elif kind == "load":
                for c in cs:
                    gpu.scribble(c)
                coro = engine.load(cs)
            else:
                coro = engine.flush()
            task = asyncio.ensure_future(coro)
            ops.append((kind, cs, task))
            if rng.random() < 0.7:
                cancellers.append(asyncio.ensure_future(_cancel_after(rng, task)))
        outcomes = await asyncio.gather(*(t for _, _, t in ops), return_exceptions=True)
        await asyncio.gather(*cancellers)
        for (kind, cs, _), out in zip(ops, outcomes, strict=True):
            if isinstance(out, asyncio.CancelledError):
                cancelled[kind] += 1
                if kind == "load":  # copies already submitted may still have landed
                    assert all(gpu.holds_or_untouched(c) for c in cs)
            elif isinstance(out, errors.NotDurableError) and kind == "durable":
                # a skipped key whose store (by a cancelled op) never completed: on no medium
                assert {e.kind for e in out.failed.values()} == {"missing"}, out  # type: ignore[attr-defined]
                assert engine.lookup(list(out.failed)) == [kvtier.Residency.MISS] * len(out.failed)
            elif isinstance(out, BaseException):
                raise out
            elif kind == "load":
                for c in cs:
                    assert gpu.holds(c) if c.key in out.loaded else gpu.untouched(c)
    assert sum(cancelled.values()) >= 20, cancelled
    await engine.flush()
    await at_rest(engine, baseline)
    present = [
        k for k, r in zip(universe, engine.lookup(universe), strict=True) if r.value != "miss"
    ]
    assert present
    for i in range(0, len(present), 4):  # every surviving key loads bitwise
        assert not (await load_check(engine, gpu, chunks_for(present[i : i + 4]))).failed
    await asyncio.wait_for(engine.aclose(), 10)
    async with kvtier.TransferEngine(
        gpu.layout, engine_config(gpu, 12, nvme_config(tmp_path))
    ) as e:
        assert e.lookup(present) == [kvtier.Residency.NVME] * len(present)
        for i in range(0, len(present), 4):
            assert not (await load_check(e, gpu, chunks_for(present[i : i + 4]))).failed


async def test_cancelling_one_flush_spares_the_other_waiters(tmp_path: pathlib.Path) -> None:
    gpu = Gpu()
    stall = KeyFault("write", "block")
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(stall)))
    baseline = len(asyncio.all_tasks())
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, chunks(["f0", "f1"]))
        durable_chunks = chunks(["f2"], first_block=16)
        gpu.write(durable_chunks[0])
        first = asyncio.ensure_future(engine.flush())
        second = asyncio.ensure_future(engine.flush())
        durable = asyncio.ensure_future(engine.store(durable_chunks, durable=True))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.sleep(0.01)
        stall.gate.set()
        await asyncio.wait_for(second, 10)  # neither cancelled nor failed
        res = await asyncio.wait_for(durable, 10)
        assert res.stored == (durable_chunks[0].key,)
        assert first.cancelled()
        await at_rest(engine, baseline)


async def test_cancelled_durable_store_keeps_its_key(tmp_path: pathlib.Path) -> None:
    gpu = Gpu()
    stall = KeyFault("write", "block")
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(stall)))
    baseline = len(asyncio.all_tasks())
    cs = chunks(["dur0", "dur1"])
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        for c in cs:
            gpu.write(c)
        task = asyncio.ensure_future(engine.store(cs, durable=True))
        await asyncio.sleep(0.05)  # the copy is done; the row writes are stalled
        assert engine.lookup([c.key for c in cs]) == [kvtier.Residency.CPU] * 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stall.gate.set()
        await engine.flush()
        await at_rest(engine, baseline)
        assert not (await load_check(engine, gpu, cs)).failed
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))) as e:
        assert not (await load_check(e, gpu, cs)).failed


async def test_cancelled_load_during_promotion(tmp_path: pathlib.Path) -> None:
    gpu = Gpu()
    cs = chunks(["pr0", "pr1", "pr2"])
    plain = engine_config(gpu, 8, nvme_config(tmp_path))
    async with kvtier.TransferEngine(gpu.layout, plain) as engine:
        await store_ok(engine, gpu, cs)
    stall = KeyFault("read", "block")
    baseline = len(asyncio.all_tasks())
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(stall)))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        for c in cs:
            gpu.scribble(c)
        task = asyncio.ensure_future(engine.load(cs))
        await asyncio.sleep(0.05)  # the promotion reads are stalled
        assert engine.lookup([c.key for c in cs]) == [kvtier.Residency.PENDING] * 3
        task.cancel()
        # The cancellation waits for the promotion in flight (load's docstring):
        # the task is not done while the reads are held.
        await asyncio.sleep(0.05)
        assert not task.done()
        stall.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await at_rest(engine, baseline)
        assert all(gpu.holds_or_untouched(c) for c in cs)
        # the promoted keys stay in CPU slots and load bitwise
        assert engine.lookup([c.key for c in cs]) == [kvtier.Residency.CPU] * 3
        assert not (await load_check(engine, gpu, cs)).failed


async def test_aclose_writes_the_rows_of_stores_still_in_flight(tmp_path: pathlib.Path) -> None:
    gpu = Gpu()
    slow = KeyFault("write", "delay", delay_s=0.03)
    nv = nvme_config(tmp_path, wrapper=Wrapper(slow))
    cfg = engine_config(gpu, 16, nv, max_batch_chunks=1)  # one copy job (and write batch) each
    cs = chunks([f"ac{i}" for i in range(6)])
    engine = kvtier.TransferEngine(gpu.layout, cfg)
    await engine.start()
    for c in cs:
        gpu.write(c)
    tasks = [asyncio.ensure_future(engine.store([c])) for c in cs]
    await asyncio.sleep(0)
    await asyncio.wait_for(engine.aclose(), 10)  # drains: stores, then their row writes
    assert all(len(t.result().stored) == 1 for t in tasks)
    async with kvtier.TransferEngine(
        gpu.layout, engine_config(gpu, 16, nvme_config(tmp_path))
    ) as e:
        assert e.lookup([c.key for c in cs]) == [kvtier.Residency.NVME] * 6
        assert not (await load_check(e, gpu, cs[:4])).failed


async def test_concurrent_aclose_returns_after_the_namespace_is_released(tmp_path) -> None:
    gpu = Gpu()
    slow = KeyFault("write", "delay", delay_s=0.05)
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(slow)))
    engine = kvtier.TransferEngine(gpu.layout, cfg)
    await engine.start()
    await store_ok(engine, gpu, chunks(["cc0", "cc1"]))
    first = asyncio.ensure_future(engine.aclose())
    await asyncio.sleep(0)
    await asyncio.wait_for(engine.aclose(), 10)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))):
        pass  # the namespace lock is free: the second aclose waited for the first
    await first


async def test_a_hard_aclose_after_the_engine_closed_does_nothing(tmp_path) -> None:
    """It raised AttributeError: it cancelled the writes of a writer already detached."""
    gpu = Gpu()
    engine = kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path)))
    await engine.start()
    await store_ok(engine, gpu, chunks(["hc0"]))
    await engine.aclose()
    await engine.aclose(hard=True)
    await engine.aclose(hard=True)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))) as e:
        assert e.lookup([chunks(["hc0"])[0].key]) == [kvtier.Residency.NVME]


async def test_cancelled_aclose_keeps_closing(tmp_path: pathlib.Path) -> None:
    gpu = Gpu()
    slow = KeyFault("write", "delay", delay_s=0.03)
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(slow)))
    engine = kvtier.TransferEngine(gpu.layout, cfg)
    await engine.start()
    cs = chunks([f"ca{i}" for i in range(6)])
    for i in range(0, 6, 2):  # three write batches: one in flight, two queued
        await store_ok(engine, gpu, cs[i : i + 2])
    task = asyncio.ensure_future(engine.aclose())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(engine.aclose(), 10)
    with pytest.raises(kvtier.EngineClosedError):
        await engine.store(cs)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))) as e:
        assert e.lookup([c.key for c in cs]) == [kvtier.Residency.NVME] * 6
        assert not (await load_check(e, gpu, cs[:4])).failed


@pytest.mark.parametrize("turns", [1, 2, 3, 6])
async def test_cancelled_load_leaves_its_blocks_alone_afterwards(
    monkeypatch: pytest.MonkeyPatch, turns: int
) -> None:
    # Slow copies (30 ms each, on the real copy code) so that cancellation
    # lands while the load's copy is pending or running; once load() raised
    # CancelledError nothing may write its blocks any more.
    real = _transfer.run_plan

    def slow(plan: list[_transfer.ChunkCopy], direction: str, **kw: Any) -> None:
        time.sleep(0.03)
        real(plan, direction, **kw)

    t = torch.empty((32, 4096), dtype=torch.uint8)
    t.copy_(
        torch.randint(
            0, 255, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
        )
    )
    truth = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    config = kvtier.EngineConfig(4 * layout.slot_nbytes(4), 4)
    async with kvtier.TransferEngine(layout, config) as engine:
        chunks = [kvtier.Chunk(key(f"c{i}", 0), list(range(4 * i, 4 * i + 4))) for i in range(2)]
        assert len((await engine.store(chunks)).stored) == 2
        monkeypatch.setattr(_transfer, "run_plan", slow)
        target = [kvtier.Chunk(c.key, [b + 16 for b in c.block_ids]) for c in chunks]
        t[16:24] = 0
        task = asyncio.ensure_future(engine.load(target))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        seen = t[16:24].clone()
        await asyncio.sleep(0.1)  # longer than any copy still in flight would take
        assert torch.equal(t[16:24], seen)  # nothing wrote the blocks after the call ended
        if isinstance(outcome, asyncio.CancelledError):  # per block: the truth or untouched
            for b in range(8):
                assert torch.equal(seen[b], truth[b]) or int(seen[b].count_nonzero()) == 0
        else:
            assert not outcome.failed
            assert torch.equal(seen, truth[0:8])
        stats = engine.stats()
        assert stats.slots_pinned == 0
        assert stats.slots_writing == 0
