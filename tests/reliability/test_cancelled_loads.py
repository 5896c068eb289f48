"""Cancelled loads, bounded re-waits and CPU copy units.

Regressions guarded here: ``_withdraw`` must not compare calls holding tensors
with ``==``; ``BackgroundEngine.cancel`` waits for the cancelled call; a failed
copy's partial writes are documented in GUARANTEES 1. Every test can fail:
wrong bytes, blocks written after the call ended, leaked pins, hangs, spurious
misses, errors reported to the wrong call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import pathlib
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import kvtier
from kvtier import _transfer

from ._faultio import KeyFault, Wrapper
from ._model import (
    SCRIBBLE,
    Gpu,
    at_rest,
    chunks_for,
    engine_config,
    key,
    load_check,
    nvme_config,
    store_ok,
)


def _slow_loads(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """Every load unit sleeps ``delay_s`` in its copy thread before copying."""
    real = _transfer.run_plan

    def slow(plan: Sequence[_transfer.ChunkCopy], direction: str, **kw: Any) -> None:
        if direction == "load":
            time.sleep(delay_s)
        real(plan, direction, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_transfer, "run_plan", slow)


def _twin_groups(nb: int = 32) -> tuple[kvtier.KVLayout, torch.Tensor, torch.Tensor]:
    """Two groups whose single layers have the same shape (a common hybrid model layout)."""
    t0 = torch.empty((nb, 2, 8, 32), dtype=torch.float16)
    t1 = torch.empty((nb, 2, 8, 32), dtype=torch.float16)
    gen = torch.Generator().manual_seed(5)
    for t in (t0, t1):
        u8 = t.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, generator=gen, dtype=torch.uint8))
    layout = kvtier.KVLayout.from_tensors({0: {"full": t0}, 1: {"swa": t1}}, block_dim=0)
    return layout, t0, t1


# --------------------------------------------------------------------------- bugs


async def test_cancelled_load_then_a_load_of_another_group_raises_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout, t0, _t1 = _twin_groups()
    config = kvtier.EngineConfig(8 * layout.slot_nbytes(4), 4)
    async with kvtier.TransferEngine(layout, config) as engine:
        ka, kb = key("twin-a", 0), key("twin-b", 1)
        res = await engine.store([kvtier.Chunk(ka, [0, 1, 2, 3]), kvtier.Chunk(kb, [0, 1, 2, 3])])
        assert len(res.stored) == 2
        u0 = t0.view(torch.uint8)  # compare bytes: random fp16 holds NaNs
        want_a = u0[0:4].clone()
        _slow_loads(monkeypatch, 0.1)
        u0[16:20] = 0
        la = asyncio.ensure_future(engine.load([kvtier.Chunk(ka, [16, 17, 18, 19])]))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # la's copy is with a copy thread

        async def cancel_then_load() -> kvtier.LoadResult:
            # A serving loop drops one request and loads the next one (another
            # group) in the same step: the load's call is pending when la wakes.
            la.cancel()
            return await engine.load([kvtier.Chunk(kb, [16, 17, 18, 19])])

        lb = asyncio.ensure_future(cancel_then_load())
        (outcome,) = await asyncio.gather(la, return_exceptions=True)
        seen = u0[16:20].clone()
        assert (await lb).loaded == (kb,)
        await asyncio.sleep(0.2)
        assert isinstance(outcome, asyncio.CancelledError), repr(outcome)
        assert torch.equal(u0[16:20], seen), "blocks written after the cancelled load ended"
        assert torch.equal(seen, want_a) or int(seen.count_nonzero()) == 0
        await at_rest(engine)


def test_background_load_future_cancelled_from_another_thread_leaves_blocks_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout, t0, _ = _twin_groups()
    config = kvtier.EngineConfig(8 * layout.slot_nbytes(4), 4)
    with kvtier.BackgroundEngine(layout, config) as engine:
        k = key("bg-cancel", 0)
        assert engine.store([kvtier.Chunk(k, [0, 1, 2, 3])]).result(5).stored == (k,)
        u0 = t0.view(torch.uint8)  # compare bytes: random fp16 holds NaNs
        _slow_loads(monkeypatch, 0.2)
        u0[16:20] = 0
        fut = engine.load([kvtier.Chunk(k, [16, 17, 18, 19])])
        time.sleep(0.05)  # the copy runs
        # fut.cancel() alone returns while the copy still runs; engine.cancel waits.
        assert engine.cancel(fut, timeout=5)
        with contextlib.suppress(concurrent.futures.CancelledError):
            fut.result(5)
        seen = u0[16:20].clone()
        time.sleep(0.4)
        assert torch.equal(u0[16:20], seen), "blocks written after the future was cancelled"
        assert engine.stats().slots_pinned == 0


async def test_failed_unit_fails_the_call_and_writes_no_wrong_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = Gpu(num_blocks=64)
    cs = chunks_for([key(f"unit-{i}", 0) for i in range(8)])
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8, copy_threads=2)) as engine:
        await store_ok(engine, gpu, cs)
        real = _transfer.run_plan

        def failing(plan: Sequence[_transfer.ChunkCopy], direction: str, **kw: Any) -> None:
            if direction == "load" and any(0 in c.block_ids for c in plan):
                raise RuntimeError("injected copy failure")
            real(plan, direction, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(_transfer, "run_plan", failing)
        for c in cs:
            gpu.scribble(c)
        res = await engine.load(cs)
        assert res.loaded == ()  # the call's one error fails all eight keys
        assert all(isinstance(e, kvtier.errors.TransferError) for e in res.failed.values())
        # A failed copy may have written some blocks (GUARANTEES 1), only ever
        # with the key's own bytes; the failing unit's blocks stay untouched.
        for c in cs:
            assert gpu.holds_or_untouched(c), f"{c.key}: blocks hold other bytes"
        assert gpu.untouched(cs[0])


async def test_cancelled_load_then_a_load_of_another_group_in_the_model_layout() -> None:
    gpu = Gpu(num_blocks=64)
    ka, kb = key("model-a", 0), key("model-b", 1)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8)) as engine:
        await store_ok(engine, gpu, chunks_for([ka, kb]))
        a, b = chunks_for([ka, kb], first_block=32)
        gpu.scribble(a)
        la = asyncio.ensure_future(engine.load([a]))
        await asyncio.sleep(0)
        await asyncio.sleep(0)

        async def cancel_then_load() -> kvtier.LoadResult:
            la.cancel()
            return await engine.load([b])

        lb = asyncio.ensure_future(cancel_then_load())
        (outcome,) = await asyncio.gather(la, return_exceptions=True)
        assert (await lb).loaded == (kb,)
        assert isinstance(outcome, asyncio.CancelledError), repr(outcome)


# --------------------------------------------------------------------------- held up


async def test_failed_unit_is_reported_to_its_own_call_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = Gpu(num_blocks=64)
    mine = chunks_for([key(f"own-a{i}", 0) for i in range(6)])  # blocks 0..23
    other = chunks_for([key(f"own-b{i}", 0) for i in range(6)], first_block=32)
    cfg = engine_config(gpu, 16, copy_threads=2)
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, mine + other)
        real = _transfer.run_plan
        hits = {"n": 0}

        def failing(plan: Sequence[_transfer.ChunkCopy], direction: str, **kw: Any) -> None:
            if direction == "load" and any(44 in c.block_ids for c in plan):
                hits["n"] += 1
                raise RuntimeError("injected copy failure")
            real(plan, direction, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(_transfer, "run_plan", failing)
        for c in mine + other:
            gpu.scribble(c)
        a, b = await asyncio.gather(engine.load(mine), engine.load(other))  # one job
        assert hits["n"] == 2  # the job, then the call copied again on its own
        assert a.loaded == tuple(c.key for c in mine)
        assert not a.failed
        assert all(gpu.holds(c) for c in mine)
        assert set(b.failed) == {c.key for c in other}
        assert all(isinstance(e, kvtier.errors.TransferError) for e in b.failed.values())
        assert engine.stats().failures.get("transfer") == 1  # one failed job
        await at_rest(engine)
        monkeypatch.setattr(_transfer, "run_plan", real)
        assert not (await load_check(engine, gpu, other)).failed


async def test_cancelled_twice_while_waiting_for_a_store_then_its_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = Gpu(num_blocks=64)
    real = _transfer.run_plan

    def slow(plan: Sequence[_transfer.ChunkCopy], direction: str, **kw: Any) -> None:
        time.sleep(0.04)
        real(plan, direction, **kw)  # type: ignore[arg-type]

    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8)) as engine:
        (c,) = chunks_for([key("twice", 0)])
        gpu.write(c)
        monkeypatch.setattr(_transfer, "run_plan", slow)
        store = asyncio.ensure_future(engine.store([c]))
        await asyncio.sleep(0)
        dst = kvtier.Chunk(c.key, [40, 41, 42, 43])
        gpu.scribble(dst)
        for wait_s in (0.0, 0.02, 0.045, 0.06):  # in the wait, at its end, during the copy
            gpu.scribble(dst)
            task = asyncio.ensure_future(engine.load([dst]))
            await asyncio.sleep(wait_s)
            task.cancel()
            await asyncio.sleep(0.005)
            task.cancel()
            (out,) = await asyncio.gather(task, return_exceptions=True)
            seen = [gpu.page(0, b).clone() for b in dst.block_ids]
            await asyncio.sleep(0.1)
            assert all(
                torch.equal(gpu.page(0, b), s) for b, s in zip(dst.block_ids, seen, strict=True)
            )
            if isinstance(out, asyncio.CancelledError):
                assert gpu.holds_or_untouched(dst)
            else:
                assert out.loaded == (c.key,)
                assert gpu.holds(dst)
        assert (await store).stored == (c.key,)
        await at_rest(engine)


@pytest.mark.parametrize("how", ["timeout", "wait_for"])
async def test_timed_out_load_during_a_slow_promotion(tmp_path: pathlib.Path, how: str) -> None:
    gpu = Gpu()
    cs = chunks_for([key(f"to-{i}", i % 2) for i in range(3)])
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))) as e:
        await store_ok(e, gpu, cs)
    slow = KeyFault("read", "delay", delay_s=0.08)
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(slow)))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        for c in cs:
            gpu.scribble(c)
        t0 = time.monotonic()

        async def timed() -> kvtier.LoadResult:
            if how == "timeout":
                async with asyncio.timeout(0.01):
                    return await engine.load(cs)
            return await asyncio.wait_for(engine.load(cs), 0.01)

        with pytest.raises(TimeoutError):
            await timed()
        assert time.monotonic() - t0 >= 0.07  # waited for the promotion it started
        snap = [gpu.page(c.key.group_id, b).clone() for c in cs for b in c.block_ids]
        await asyncio.sleep(0.15)
        now = [gpu.page(c.key.group_id, b) for c in cs for b in c.block_ids]
        assert all(torch.equal(a, b) for a, b in zip(snap, now, strict=True))
        assert all(gpu.untouched(c) for c in cs)  # cancelled before its copy: nothing
        await at_rest(engine)
        assert engine.lookup([c.key for c in cs]) == [kvtier.Residency.CPU] * 3
        assert not (await load_check(engine, gpu, cs)).failed


async def test_many_cancelled_loads_during_a_stalled_promotion_then_aclose(
    tmp_path: pathlib.Path,
) -> None:
    gpu = Gpu()
    ks = [key(f"many-{i}", i % 2) for i in range(6)]
    cs = chunks_for(ks)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))) as e:
        await store_ok(e, gpu, cs)
    stall = KeyFault("read", "block")
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(stall)))
    engine = kvtier.TransferEngine(gpu.layout, cfg)
    await engine.start()
    try:
        for c in cs:
            gpu.scribble(c)
        # three callers per key set, same blocks: all cancelled while the reads stall
        tasks = [asyncio.ensure_future(engine.load(cs[i : i + 2])) for i in (0, 2, 4)]
        await asyncio.sleep(0.02)
        tasks += [asyncio.ensure_future(engine.load([c])) for c in cs[::2]]
        await asyncio.sleep(0.02)
        for t in tasks:
            t.cancel()
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks)  # each waits for the promotion it depends on
        closing = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0.02)
        assert not closing.done()
        threading.Timer(0.05, stall.gate.set).start()
        outs = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert all(isinstance(o, asyncio.CancelledError) for o in outs), outs
        await asyncio.wait_for(closing, 10)
        assert all(gpu.untouched(c) for c in cs)
    finally:
        stall.gate.set()
        await engine.aclose()


async def test_load_waits_for_a_store_started_while_it_waited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = Gpu(num_blocks=64)
    real = _transfer.run_plan

    def slow(plan: Sequence[_transfer.ChunkCopy], direction: str, **kw: Any) -> None:
        if direction == "store":
            time.sleep(0.03)
        real(plan, direction, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_transfer, "run_plan", slow)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8)) as engine:
        first, later = chunks_for([key("first", 0), key("later", 0)])
        gpu.write(first)
        gpu.write(later)
        s1 = asyncio.ensure_future(engine.store([first]))
        await asyncio.sleep(0)
        dst = chunks_for([first.key, later.key], first_block=32)
        for c in dst:
            gpu.scribble(c)
        assert engine.lookup([later.key]) == [kvtier.Residency.MISS]
        load = asyncio.ensure_future(engine.load(dst))
        await asyncio.sleep(0.005)  # the load waits for `first`; now `later` starts
        s2 = asyncio.ensure_future(engine.store([later]))
        res = await load
        assert res.loaded == (first.key, later.key), res
        assert all(gpu.holds(c) for c in dst)
        await asyncio.gather(s1, s2)
        await at_rest(engine)


async def test_load_arriving_during_another_loads_promotion_gets_the_key(
    tmp_path: pathlib.Path,
) -> None:
    gpu = Gpu(num_blocks=64)
    ks = [key(f"prom-{i}", 0) for i in range(2)]
    cs = chunks_for(ks)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))) as e:
        await store_ok(e, gpu, cs)
    slow = KeyFault("read", "delay", delay_s=0.03)
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(slow)))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        a = [kvtier.Chunk(ks[0], [20, 21, 22, 23])]
        b = chunks_for(ks, first_block=40)  # one key promoted by `a`, one by itself
        for c in a + b:
            gpu.scribble(c)
        la = asyncio.ensure_future(engine.load(a))
        await asyncio.sleep(0.005)
        assert engine.lookup(ks) == [kvtier.Residency.PENDING, kvtier.Residency.NVME]
        lb = asyncio.ensure_future(engine.load(b))
        lc = asyncio.ensure_future(engine.load([kvtier.Chunk(ks[1], [60, 61, 62, 63])]))
        ra, rb, rc = await asyncio.gather(la, lb, lc)
        assert ra.loaded == (ks[0],)
        assert set(rb.loaded) == set(ks), rb
        assert rc.loaded == (ks[1],), rc
        assert all(gpu.holds(c) for c in a + b)
        assert gpu.holds(kvtier.Chunk(ks[1], [60, 61, 62, 63]))
        assert engine.stats().nvme["promotions"] == 2  # type: ignore[index]
        await at_rest(engine)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_random_store_load_cancel_evict_with_nvme(tmp_path: pathlib.Path, seed: int) -> None:
    rng = random.Random(seed)
    gpu = Gpu(num_blocks=64)
    nvme = nvme_config(tmp_path, capacity_bytes=10 * gpu.slot_nbytes, segment_nbytes=64 << 10)
    cfg = engine_config(
        gpu, 5, nvme, copy_threads=2, max_batch_chunks=rng.randint(1, 4), eviction="lru"
    )
    universe = [key(f"soak{seed}-{i}", i % 2) for i in range(18)]
    counts = {"loaded": 0, "cancelled": 0, "failed": 0}
    engine = kvtier.TransferEngine(gpu.layout, cfg)
    await engine.start()
    try:

        async def worker(w: int) -> None:
            base = 16 * w  # blocks [base, base + 16) of both groups are this worker's
            for _ in range(25):
                cs = chunks_for(rng.sample(universe, rng.randint(1, 3)), first_block=base)
                op = rng.random()
                if op < 0.35:
                    for c in cs:
                        gpu.write(c)
                    task = asyncio.ensure_future(engine.store(cs))
                elif op < 0.4:
                    task = asyncio.ensure_future(engine.flush())
                else:
                    for c in cs:
                        gpu.scribble(c)
                    task = asyncio.ensure_future(engine.load(cs))
                if rng.random() < 0.4:
                    for _ in range(rng.randrange(0, 6)):
                        await asyncio.sleep(0)
                    task.cancel()
                (out,) = await asyncio.gather(task, return_exceptions=True)
                if op < 0.4:
                    if isinstance(out, BaseException) and not isinstance(
                        out, asyncio.CancelledError | kvtier.errors.NotDurableError
                    ):
                        raise out
                    continue
                if isinstance(out, asyncio.CancelledError):
                    counts["cancelled"] += 1
                    assert all(gpu.holds_or_untouched(c) for c in cs)
                    for c in cs:  # reuse the blocks at once: nothing may write them now
                        for b in c.block_ids:
                            gpu.page(c.key.group_id, b).fill_(0x11)
                    await asyncio.sleep(0.003)
                    for c in cs:
                        for b in c.block_ids:
                            assert bool((gpu.page(c.key.group_id, b) == 0x11).all())
                    continue
                assert isinstance(out, kvtier.LoadResult), repr(out)
                for c in cs:
                    if c.key in out.loaded:
                        counts["loaded"] += 1
                        assert gpu.holds(c), f"{c.key} loaded WRONG bytes"
                    else:
                        counts["failed"] += 1
                        assert c.key in out.failed
                        assert gpu.untouched(c)

        await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(4))), 30)
        assert counts["loaded"] > 0, counts
        assert counts["cancelled"] > 0, counts
        stats = await at_rest(engine)
        assert stats.slots_pinned == 0
        present = [
            k for k, r in zip(universe, engine.lookup(universe), strict=True) if r.value != "miss"
        ]
        for k in present:
            (c,) = chunks_for([k], first_block=48)
            res = await load_check(engine, gpu, [c])
            assert not res.failed or all(
                isinstance(e, kvtier.errors.KVTierError) for e in res.failed.values()
            )
    finally:
        await asyncio.wait_for(engine.aclose(), 10)
    assert SCRIBBLE != 0x11
