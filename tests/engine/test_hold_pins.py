"""Tail-first recency, WrongThreadError, engine.hold().

Only real seams: the public API, ``NVMeConfig(row_io_wrapper=...)`` RowIO
wrappers over the real backend, real threads, a real child process killed
with SIGKILL. A test headed "Regression" guards against a bug the engine once
had (four of them); every other test is a guarantee.

The child process of the SIGKILL test runs this module:
``python -m tests.engine.test_hold_pins child ROOT``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier.errors import NotDurableError, WrongThreadError
from tests.engine.helpers import (
    chunk_chain,
    fill_random,
    key,
    keys_of,
    nvme_rows,
    one_group,
    until,
)

M, P, C, N = (
    kvtier.Residency.MISS,
    kvtier.Residency.PENDING,
    kvtier.Residency.CPU,
    kvtier.Residency.NVME,
)
BLOCK = 4096  # payload of one block; a slot (and a row) is 8 KiB with its trailer


# ============================================================================ recency


async def test_a_chain_extended_from_a_resident_head_loses_its_tail_first() -> None:
    """Regression: a store whose head is already in a CPU slot leaves the head the call's
    newest key under lru, though it touches the head at the call and commits the new tail
    keys later (the head was once the call's OLDEST key).

    The common case: a request's prefix is cached, the store passes the whole chain."""
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(4 * slot, 1, eviction="lru")
    async with kvtier.TransferEngine(layout, config) as engine:
        chain = chunk_chain("a", 4, 0)
        await engine.store(chain[:1])  # the head was stored by an earlier request
        res = await engine.store(chain)  # head first, as a scheduler lists it
        assert res.skipped == (chain[0].key,)
        assert res.stored == tuple(keys_of(chain[1:]))
        # the pool is full: each new key evicts one; the tail must go first
        await engine.store(chunk_chain("x", 1, 10))
        assert engine.lookup(keys_of(chain)) == [C, C, C, M]
        assert engine.prefix_hits(keys_of(chain)) == 3


async def test_a_chain_extended_from_a_resident_head_under_arc_keeps_its_head() -> None:
    """The same call under arc: the touched head sits in T2 and outlives the tail."""
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(4 * slot, 1, eviction="arc")
    async with kvtier.TransferEngine(layout, config) as engine:
        chain = chunk_chain("a", 4, 0)
        await engine.store(chain[:1])
        await engine.store(chain)
        for i in range(3):
            await engine.store(chunk_chain(f"x{i}-", 1, 10 + i))
            assert engine.prefix_hits(keys_of(chain)) == 3 - i


async def test_nvme_rows_of_a_chain_extended_from_a_stored_head_lose_the_tail_first(
    tmp_path: Path,
) -> None:
    """Regression: a store that skips a key already on NVMe marks its row, so the new tail
    rows of the call are not newer than its head's row and NVMe evicts the tail first, not
    the head."""
    layout, _, slot = one_group()
    chain = chunk_chain("a", 4, 0)
    # arc keeps the CPU order right (see the test above): only the rows are under test
    config = kvtier.EngineConfig(4 * slot, 1, eviction="arc", nvme=nvme_rows(tmp_path, slot, 4))
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chain[:1], durable=True)
        res = await engine.store(chain, durable=True)
        assert res.stored == tuple(keys_of(chain[1:]))
        assert engine.stats().nvme["rows_resident"] == 4
        # One new key: the CPU pool evicts a3 (the tail), NVMe evicts one row.
        await engine.store(chunk_chain("x", 1, 10), durable=True)
        assert engine.lookup(keys_of(chain)) == [C, C, C, M]  # a3's row went too
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.lookup(keys_of(chain)) == [N, N, N, M]


@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_store_calls_coalesced_in_one_iteration_keep_call_order_then_head_first(
    tmp_path: Path, eviction: str
) -> None:
    """Two stores gathered into one job: b is newer than a, each call head first.

    On NVMe the two calls' rows go out in one write batch: after a restart
    their sequence numbers must say the same order.
    """
    layout, _, slot = one_group()
    a, b = chunk_chain("a", 3, 0), chunk_chain("b", 3, 3)
    big = kvtier.EngineConfig(16 * slot, 1, nvme=nvme_rows(tmp_path, slot, 6))
    async with kvtier.TransferEngine(layout, big) as engine:
        ra, rb = await asyncio.gather(engine.store(a), engine.store(b))
        assert engine.stats().store_jobs == 1  # really coalesced
        assert (len(ra.stored), len(rb.stored)) == (3, 3)
        await engine.flush()
    # after a restart the rows' order is a2 a1 a0 b2 b1 b0 (oldest first)
    config = kvtier.EngineConfig(16 * slot, 1, eviction=eviction, nvme=nvme_rows(tmp_path, slot, 6))
    async with kvtier.TransferEngine(layout, config) as engine:
        for i, expect_a, expect_b in (
            (0, [N, N, M], [N, N, N]),
            (1, [N, M, M], [N, N, N]),
            (2, [M, M, M], [N, N, N]),
            (3, [M, M, M], [N, N, M]),
        ):
            await engine.store(chunk_chain(f"x{i}-", 1, 20 + i), durable=True)
            assert engine.lookup(keys_of(a)) == expect_a, i
            assert engine.lookup(keys_of(b)) == expect_b, i
    # the CPU pool, in one session: the same order
    small = kvtier.EngineConfig(6 * slot, 1, eviction=eviction)
    async with kvtier.TransferEngine(layout, small) as engine:
        await asyncio.gather(engine.store(a), engine.store(b))
        await engine.store(chunk_chain("y", 2, 30))
        assert engine.lookup(keys_of(a)) == [C, M, M]
        assert engine.lookup(keys_of(b)) == [C, C, C]


@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_recency_with_two_groups_partial_chunks_and_repeated_block_ids(
    eviction: str,
) -> None:
    """One call mixing groups, partial chunks and a block named twice: head first still."""
    t0 = torch.empty((32, 2, BLOCK // 2), dtype=torch.uint8)
    t1 = torch.empty((32, BLOCK), dtype=torch.uint8)
    fill_random(t0, 1)
    fill_random(t1, 2)
    layout = kvtier.KVLayout.from_tensors({0: {"g0": t0}, 1: {"g1": t1}})
    slot = layout.slot_nbytes(2)
    config = kvtier.EngineConfig(5 * slot, 2, eviction=eviction)
    async with kvtier.TransferEngine(layout, config) as engine:
        chain = [
            kvtier.Chunk(key("h0", 0), [1, 1]),  # one block twice: stored twice
            kvtier.Chunk(key("h1", 1), [2], offset=1),  # partial
            kvtier.Chunk(key("h2", 0), [3, 4]),
            kvtier.Chunk(key("h3", 1), [5]),  # partial at offset 0
        ]
        res = await engine.store(chain)
        assert len(res.stored) == 4
        ks = keys_of(chain)
        for i in range(3):
            await engine.store([kvtier.Chunk(key(f"x{i}", i % 2), [10 + i])])
            assert engine.lookup(ks) == [C] * (4 - i) + [M] * i, i  # one free slot first
        # the stored bytes are right: block 1 twice in h0, h1 in sub-block 1 only
        out = await engine.load([kvtier.Chunk(key("h0", 0), [20, 21])])
        assert out.loaded == (key("h0", 0),)
        assert torch.equal(t0[20], t0[1])
        assert torch.equal(t0[21], t0[1])


def test_a_call_spanning_two_write_batches_keeps_its_head_newest_on_nvme(tmp_path: Path) -> None:
    """Regression: a call's rows that span two write batches leave the head the newest row,
    even when the head's batch finishes first (published batch by batch as each write ended,
    the head was once the OLDEST row).

    A write batch holds 64 MiB: 8 rows of 8 MiB. A call of 9 chunks needs two batches.

    Rows are queued tail first: the first batch takes a8..a1, the second a0
    (the head). Both are written at once (two write slots); the first one is
    held at its writes here (a slow disk, or simply 8x the bytes), so a0 is
    published first and becomes the least recently used row in the session.
    """
    payload = (8 << 20) - 4096  # a slot of exactly 8 MiB
    t = torch.empty((11, payload), dtype=torch.uint8)
    fill_random(t, 7)
    layout = kvtier.KVLayout.from_tensors({0: {"kv": t}})
    slot = layout.slot_nbytes(1)
    assert slot == 8 << 20
    chain = chunk_chain("a", 9, 0)
    from tests.reliability._faultio import KeyFault, Wrapper

    held = KeyFault("write", "block", hashes=frozenset(c.key.block_hash for c in chain[1:]))
    nvme = nvme_rows(tmp_path, slot, 9, row_io_wrapper=Wrapper(held))
    config = kvtier.EngineConfig(9 * slot, 1, nvme=nvme)

    async def run() -> tuple[list[kvtier.Residency], list[kvtier.Residency]]:
        async with kvtier.TransferEngine(layout, config) as engine:
            res = await engine.store(chain)
            assert len(res.stored) == 9
            await until(lambda: engine.stats().nvme["rows_resident"] >= 1, 5)
            held.gate.set()
            await engine.flush()
            assert engine.stats().nvme["rows_resident"] == 9
            # one more key: the CPU pool evicts a8 (its tail), NVMe one row: a8's too
            await engine.store([kvtier.Chunk(key("x", 0), [10])], durable=True)
            in_session = engine.lookup(keys_of(chain))
        async with kvtier.TransferEngine(layout, config) as engine:
            after = engine.lookup(keys_of(chain))
        return in_session, after

    in_session, after = asyncio.run(run())
    assert in_session == [C] * 8 + [M]
    assert after == [N] * 8 + [M]


async def test_a_load_of_held_keys_still_marks_them_head_first(tmp_path: Path) -> None:
    """Hits on held keys still count for recency: pins do not freeze the order."""
    layout, t, slot = one_group()
    chain = chunk_chain("a", 3, 0)
    config = kvtier.EngineConfig(4 * slot, 1)
    async with kvtier.TransferEngine(layout, config) as engine:
        for c in chain:  # one call each: a2 is the newest
            await engine.store([c])
        with engine.hold(keys_of(chain)):
            out = await engine.load([kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(chain)])
            assert out.loaded == tuple(keys_of(chain))
        for i in range(3):
            assert torch.equal(t[40 + i], t[i])
        await engine.store(chunk_chain("x", 2, 10))  # one free slot, one eviction: a2
        assert engine.lookup(keys_of(chain)) == [C, C, M]


# ====================================================================== WrongThreadError


def test_aclose_awaited_on_another_loop_of_the_engine_thread_raises(tmp_path: Path) -> None:
    """Regression: aclose() checks the event loop, not only the thread: awaited on a second
    loop of the engine's thread with write-through in flight it raises, instead of hanging,
    closing the engine and losing the row."""
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(8 * slot, 1, nvme=nvme_rows(tmp_path, slot, None))
    a = chunk_chain("a", 1, 0)
    engine = kvtier.TransferEngine(layout, config)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start())
        loop.run_until_complete(engine.store(a))  # its row is written in the background

        async def close_elsewhere() -> None:
            await asyncio.wait_for(engine.aclose(), 2)

        try:
            with pytest.raises(WrongThreadError):
                asyncio.run(close_elsewhere())
            # nothing changed: the engine works on its own loop and writes the row
            loop.run_until_complete(asyncio.wait_for(engine.flush(), 10))
            assert engine.lookup(keys_of(a)) == [C]
        finally:
            with contextlib.suppress(BaseException):
                loop.run_until_complete(asyncio.wait_for(engine.aclose(), 10))
        reopened = kvtier.TransferEngine(layout, config)

        async def reopen() -> list[kvtier.Residency]:
            async with reopened:
                return reopened.lookup(keys_of(a))

        assert asyncio.run(reopen()) == [N]
    finally:
        # What the bug leaves behind on the engine's loop (tasks of a tier closed
        # under them) is settled here, not garbage-collected in a later test.
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in left:
            task.cancel()
        if left:
            with contextlib.suppress(BaseException):
                loop.run_until_complete(
                    asyncio.wait_for(asyncio.gather(*left, return_exceptions=True), 10)
                )
        with contextlib.suppress(BaseException):
            loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
        gc.collect()


async def test_done_callbacks_on_the_loop_work_executor_threads_raise() -> None:
    """A done callback runs on the engine's thread: hold and release work there.

    The same calls from ``run_in_executor`` (a thread of the loop's pool)
    raise and change nothing, and a foreign release leaves the pins.
    """
    layout, _, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1)) as engine:
        a = chunk_chain("a", 2, 0)
        got: list[Any] = []

        def on_stored(fut: asyncio.Future[kvtier.StoreResult]) -> None:
            held = engine.hold(fut.result().stored)
            got.append(held)
            got.append(engine.stats().slots_pinned)

        task = asyncio.ensure_future(engine.store(a))
        task.add_done_callback(on_stored)
        await task
        await asyncio.sleep(0)
        held = got[0]
        assert held.residency == (C, C)
        assert got[1] == 2
        loop = asyncio.get_running_loop()
        for call in (
            lambda: engine.hold(keys_of(a)),
            held.release,
            lambda: engine.prefix_hits(keys_of(a)),
        ):
            with pytest.raises(WrongThreadError):
                await loop.run_in_executor(None, call)
        assert not held.released
        assert engine.stats().slots_pinned == 2
        # a coroutine created here but awaited in a thread's own loop raises too
        coro = engine.load([kvtier.Chunk(a[0].key, [30])])
        with pytest.raises(WrongThreadError):
            await loop.run_in_executor(None, asyncio.run, coro)
        assert engine.stats().slots_pinned == 2
        held.release()
        assert engine.stats().slots_pinned == 0


async def test_prometheus_scrapes_from_another_thread_while_the_loop_works() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    import kvtier.metrics

    layout, _, slot = one_group()
    registry = prometheus_client.CollectorRegistry()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(6 * slot, 1)) as engine:
        export = kvtier.metrics.register_prometheus(engine, registry, labels={"rank": "9"})
        stop = threading.Event()
        scrapes: list[dict[str, float]] = []
        errors: list[BaseException] = []
        pattern = re.compile(r'^kvtier_slots\{rank="9",state="(\w+)"\} (\S+)$', re.M)

        def scrape() -> None:
            while not stop.is_set():
                try:
                    text = prometheus_client.generate_latest(registry).decode()
                    scrapes.append({s: float(v) for s, v in pattern.findall(text)})
                    engine.stats()  # the call itself, too
                    time.sleep(0.0005)
                except BaseException as exc:
                    errors.append(exc)
                    return

        thread = threading.Thread(target=scrape)
        thread.start()
        try:
            for round_ in range(30):
                chain = chunk_chain(f"r{round_}-", 3, 3 * (round_ % 10))
                await engine.store(chain)
                with engine.hold(keys_of(chain)):
                    await engine.load([kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(chain)])
                    await asyncio.sleep(0.001)
        finally:
            stop.set()
            thread.join(30)
        assert not errors, errors
        assert len(scrapes) > 3
        for s in scrapes:
            assert set(s) == {"free", "writing", "resident", "pinned"}, s
            assert sum(s.values()) == 6
        final = prometheus_client.generate_latest(registry).decode()
        held = engine.hold(keys_of(chunk_chain("r29-", 3, 27)))
        text = prometheus_client.generate_latest(registry).decode()
        assert 'kvtier_slots{rank="9",state="pinned"} 3.0' in text
        assert 'kvtier_slots{rank="9",state="pinned"} 0.0' in final
        held.release()
        kvtier.metrics.unregister_prometheus(export)


def test_background_engine_holds_from_callbacks_and_releases_from_many_threads(
    tmp_path: Path,
) -> None:
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(4 * slot, 1, nvme=nvme_rows(tmp_path, slot, None))
    chain = chunk_chain("a", 2, 0)
    with kvtier.BackgroundEngine(layout, config) as bg:
        bg.store(chain, durable=True).result(30)
    with kvtier.BackgroundEngine(layout, config) as bg:
        bg.store(chunk_chain("c", 2, 4)).result(30)
        holds: list[kvtier.Hold] = []
        done = threading.Event()

        def on_done(_: concurrent.futures.Future[Any]) -> None:  # the engine thread
            holds.append(bg.hold([*keys_of(chain), *keys_of(chunk_chain("c", 2, 4))]))
            done.set()

        bg.flush().add_done_callback(on_done)
        assert done.wait(30)
        held = holds[0]
        assert held.residency == (N, N, C, C)
        assert bg.stats().slots_pinned == 2
        # the engine proper refuses this thread
        with pytest.raises(WrongThreadError):
            bg.engine.hold(keys_of(chain))
        # eight threads release at once: one release happens, the rest do nothing
        barrier = threading.Barrier(8)
        errs: list[BaseException] = []

        def release() -> None:
            try:
                barrier.wait(10)
                held.release()
            except BaseException as exc:
                errs.append(exc)

        threads = [threading.Thread(target=release) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not errs, errs
        assert held.released
        assert bg.stats().slots_pinned == 0
        # the released rows and slots are evictable again: new keys take them
        out = bg.load([kvtier.Chunk(chain[0].key, [30])]).result(30)
        assert out.loaded == (chain[0].key,)
        assert bg.stats().slots_pinned == 0
        forgotten = bg.hold(keys_of(chain))
    assert forgotten.released  # close released it
    forgotten.release()  # from another thread after close: nothing to do
    with pytest.raises(kvtier.EngineClosedError):
        bg.hold(keys_of(chain))


# ================================================================================ hold


async def test_holds_that_fill_every_slot_reject_stores_and_promotions_never_hang(
    tmp_path: Path,
) -> None:
    layout, t, slot = one_group()
    n0 = chunk_chain("n", 1, 20)
    async with kvtier.TransferEngine(
        layout, kvtier.EngineConfig(4 * slot, 1, nvme=nvme_rows(tmp_path, slot, 4))
    ) as engine:
        await engine.store(n0, durable=True)
    config = kvtier.EngineConfig(3 * slot, 1, nvme=nvme_rows(tmp_path, slot, 4))
    async with kvtier.TransferEngine(layout, config) as engine:
        a = chunk_chain("a", 3, 0)
        await engine.store(a, durable=True)  # three slots, four rows: all taken
        held = engine.hold([*keys_of(a), n0[0].key])
        assert held.residency == (C, C, C, N)
        assert engine.stats().slots_pinned == 3
        x = chunk_chain("x", 1, 10)
        res = await asyncio.wait_for(engine.store(x), 10)
        assert res.rejected == (x[0].key,)
        res = await asyncio.wait_for(engine.store(x, durable=True), 10)
        assert res.rejected == (x[0].key,)
        pre = await asyncio.wait_for(engine.prefetch(keys_of(n0)), 10)
        assert set(pre.failed) == {n0[0].key}
        out = await asyncio.wait_for(engine.load([kvtier.Chunk(n0[0].key, [40])]), 10)
        assert set(out.failed) == {n0[0].key}
        # a promotion refused for room is no read failure: the row stays on NVMe
        assert engine.lookup(keys_of(n0)) == [N]
        assert engine.stats().nvme["rows_resident"] == 4
        assert engine.stats().slots_pinned == 3
        held.release()
        assert engine.stats().slots_pinned == 0
        out = await engine.load([kvtier.Chunk(n0[0].key, [40])])
        assert out.loaded == (n0[0].key,)
        assert torch.equal(t[40], t[20])
        assert len((await engine.store(x, durable=True)).stored) == 1
        assert engine.stats().slots_pinned == 0


async def test_a_hold_of_every_row_fails_writes_with_capacity_until_released(
    tmp_path: Path,
) -> None:
    layout, t, slot = one_group()
    a = chunk_chain("a", 3, 0)
    nvme = nvme_rows(tmp_path, slot, 3)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1, nvme=nvme)) as e:
        await e.store(a, durable=True)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1, nvme=nvme)) as e:
        held = e.hold(keys_of(a))
        assert held.residency == (N, N, N)
        x = chunk_chain("x", 2, 10)
        res = await asyncio.wait_for(e.store(x), 10)  # CPU room; rows find none
        assert len(res.stored) == 2
        with pytest.raises(NotDurableError) as info:
            await asyncio.wait_for(e.flush(), 10)
        assert set(info.value.failed) == set(keys_of(x))
        assert e.lookup(keys_of(a)) == [N, N, N]
        assert e.lookup(keys_of(x)) == [C, C]
        held.release()
        # durable=True writes the CPU keys' rows again, into the released rows
        res = await e.store(x, durable=True)
        assert res.skipped == tuple(keys_of(x))
        assert e.stats().nvme["rows_resident"] == 3
        assert e.stats().nvme["evictions"] == 2
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1, nvme=nvme)) as e:
        assert e.lookup(keys_of(x)) == [N, N]
        out = await e.load([kvtier.Chunk(x[1].key, [50])])
        assert out.loaded == (x[1].key,)
        assert torch.equal(t[50], t[11])


async def test_a_hold_of_duplicate_keys_pins_twice_and_releases_fully(tmp_path: Path) -> None:
    layout, _, slot = one_group()
    a, n = chunk_chain("a", 1, 0), chunk_chain("n", 1, 1)
    nvme = nvme_rows(tmp_path, slot, 2)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1, nvme=nvme)) as e:
        await e.store(n, durable=True)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(2 * slot, 1, nvme=nvme)) as e:
        await e.store(a, durable=True)
        k, nk = a[0].key, n[0].key
        held = e.hold([k, k, nk, nk, k])
        assert held.residency == (C, C, N, N, C)
        assert held.prefix_hits == 5
        assert e.stats().slots_pinned == 1  # one slot, pinned three times
        held.release()
        assert held.released
        assert e.stats().slots_pinned == 0
        # both are evictable again: two new durable keys take the slot... and both rows
        x = chunk_chain("x", 2, 10)
        res = await e.store(x, durable=True)
        assert len(res.stored) == 2
        assert e.lookup([k, nk]) == [M, M]


async def test_hold_with_concurrent_loads_prefetches_and_cancellations_returns_to_zero(
    tmp_path: Path,
) -> None:
    """Held keys loaded, prefetched and cancelled mid-promotion: every pin comes back."""
    from tests.engine.helpers import Gate

    layout, t, slot = one_group()
    a = chunk_chain("a", 4, 0)
    gate = Gate()
    nvme = nvme_rows(tmp_path, slot, 4, row_io_wrapper=gate.wrap)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(8 * slot, 1, nvme=nvme)) as e:
        await e.store(a, durable=True)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(8 * slot, 1, nvme=nvme)) as e:
        held = e.hold(keys_of(a))
        assert held.residency == (N,) * 4
        gate.armed = True
        load = asyncio.ensure_future(e.load([kvtier.Chunk(a[0].key, [40])]))
        pre = asyncio.ensure_future(e.prefetch(keys_of(a[1:3])))
        assert await until(lambda: e.lookup(keys_of(a)) == [P, P, P, N])
        assert await until(gate.reading.is_set)  # PENDING comes first, the read a moment later
        # while promotions are in flight: a hold reports them PENDING and holds nothing new
        during = e.hold(keys_of(a))
        assert during.residency == (P, P, P, N)
        load.cancel()
        gate.armed = False
        gate.opened.set()
        with contextlib.suppress(asyncio.CancelledError):
            await load
        got = await pre
        assert set(got.promoted) == set(keys_of(a[1:3]))
        during.release()
        # loads of held keys, several at once, into distinct blocks
        outs = await asyncio.gather(
            *(e.load([kvtier.Chunk(c.key, [40 + i])]) for i, c in enumerate(a))
        )
        for i, out in enumerate(outs):
            assert out.loaded == (a[i].key,), out.failed
            assert torch.equal(t[40 + i], t[i])
        # held keys promoted from NVMe stay pinned in their slots until the release
        # (an NVMe hold pins the slots too, not only the rows)
        assert e.stats().slots_pinned == 4
        held.release()
        assert e.stats().slots_pinned == 0
        # the rows are free to be taken again: four new durable keys evict all four
        res = await e.store(chunk_chain("y", 4, 10), durable=True)
        assert len(res.stored) == 4
        assert e.stats().nvme["evictions"] == 4


async def test_a_held_row_that_fails_with_eio_stays_pinned_until_release(tmp_path: Path) -> None:
    from tests.reliability._faultio import KeyFault, Wrapper

    layout, _, slot = one_group()
    a = chunk_chain("a", 2, 0)
    fault = KeyFault("read", "errno", hashes=frozenset({a[0].key.block_hash}), times=1)
    wrap = Wrapper()
    nvme = nvme_rows(tmp_path, slot, 2, row_io_wrapper=wrap)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1, nvme=nvme)) as e:
        await e.store(a, durable=True)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1, nvme=nvme)) as e:
        held = e.hold(keys_of(a))
        wrap.faults.append(fault)
        out = await e.load([kvtier.Chunk(a[0].key, [40])])  # alone: one read request
        assert out.failed[a[0].key].kind == "eio"  # type: ignore[attr-defined]
        out = await e.load([kvtier.Chunk(a[1].key, [41])])
        assert out.loaded == (a[1].key,)
        assert e.lookup(keys_of(a)) == [M, C]
        # a0's dropped row and a1's held row: no row for a new key
        x = chunk_chain("x", 1, 10)
        with pytest.raises(NotDurableError):
            await e.store(x, durable=True)
        held.release()
        held.release()
        res = await e.store(chunk_chain("y", 1, 11), durable=True)
        assert len(res.stored) == 1
        assert e.stats().slots_pinned == 0


async def test_aclose_hard_with_holds_and_writes_in_flight(tmp_path: Path) -> None:
    from tests.reliability._faultio import KeyFault, Wrapper

    layout, t, slot = one_group()
    a = chunk_chain("a", 2, 0)
    blocked = KeyFault("write", "block")
    wrap = Wrapper()
    nvme = nvme_rows(tmp_path, slot, None, row_io_wrapper=wrap)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(8 * slot, 1, nvme=nvme)) as e:
        await e.store(a, durable=True)
    e = await kvtier.TransferEngine(layout, kvtier.EngineConfig(8 * slot, 1, nvme=nvme)).start()
    try:
        wrap.faults.append(blocked)
        b = chunk_chain("b", 2, 4)
        await e.store(b)  # write-through waits at the blocked write
        await until(lambda: blocked.hits > 0, 10)
        held = e.hold([*keys_of(a), *keys_of(b)])
        assert held.residency == (N, N, C, C)
        closing = asyncio.ensure_future(e.aclose(hard=True))
        await asyncio.sleep(0.05)
        assert held.released  # the close released it at once
        blocked.gate.set()
        await asyncio.wait_for(closing, 30)
    finally:
        blocked.gate.set()
        await e.aclose()
    held.release()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(8 * slot, 1, nvme=nvme)) as e:
        assert e.lookup(keys_of(a)) == [N, N]
        out = await e.load([kvtier.Chunk(a[1].key, [50])])
        assert out.loaded == (a[1].key,)
        assert torch.equal(t[50], t[1])
        # b's rows were in flight: each is there with its bytes, or not at all
        for i, c in enumerate(b):
            if e.lookup([c.key]) == [N]:
                out = await e.load([kvtier.Chunk(c.key, [52 + i])])
                assert out.loaded == (c.key,)
                assert torch.equal(t[52 + i], t[4 + i])


async def test_held_rows_with_an_eviction_window_pass_to_other_keys(tmp_path: Path) -> None:
    """A full two-group tier with a window: held own-group keys are passed over."""
    t0 = torch.empty((64, BLOCK), dtype=torch.uint8)
    t1 = torch.empty((64, BLOCK), dtype=torch.uint8)
    fill_random(t0, 3)
    fill_random(t1, 4)
    layout = kvtier.KVLayout.from_tensors({0: {"g0": t0}, 1: {"g1": t1}})
    slot = layout.slot_nbytes(1)
    rows = 64  # >= 2 * 32 keys: the window is in use
    nvme = kvtier.NVMeConfig(
        root=tmp_path, capacity_bytes=rows * slot, namespace="win", eviction_window=8
    )
    config = kvtier.EngineConfig(8 * slot, 1, nvme=nvme, write_through=False)
    g0 = [kvtier.Chunk(key(f"p{i}", 0), [i % 32]) for i in range(32)]
    g1 = [kvtier.Chunk(key(f"q{i}", 1), [i % 32]) for i in range(32)]
    async with kvtier.TransferEngine(layout, config) as e:
        for i in range(0, 32, 4):  # interleaved: q0..3 p0..3 q4..7 ...
            await e.store(g1[i : i + 4], durable=True)
            await e.store(g0[i : i + 4], durable=True)
    async with kvtier.TransferEngine(layout, config) as e:
        assert e.stats().nvme["rows_resident"] == 64
        # hold the oldest eight of group 0 (p0..p7): the window would take one of them
        held = e.hold(keys_of(g0[:8]))
        assert held.residency == (N,) * 8
        for j in range(6):
            await e.store([kvtier.Chunk(key(f"z{j}", 0), [40 + j])], durable=True)
        assert e.lookup(keys_of(g0[:8])) == [N] * 8
        held.release()
        await e.store([kvtier.Chunk(key("z-last", 0), [50])], durable=True)
        assert e.stats().nvme["evictions"] == 7
        # every key still found reads back its own bytes
        for c in [*g0, *g1]:
            if e.lookup([c.key]) == [N]:
                out = await e.load([kvtier.Chunk(c.key, [60])])
                assert out.loaded == (c.key,)
                src = t0 if c.key.group_id == 0 else t1
                dst = t0 if c.key.group_id == 0 else t1
                assert torch.equal(dst[60], src[c.block_ids[0]])


# ============================================================================= SIGKILL


def _child_config(root: str, slot: int) -> kvtier.EngineConfig:
    return kvtier.EngineConfig(6 * slot, 1, nvme=nvme_rows(Path(root), slot, 8))


async def _child(root: str) -> None:
    layout, _, slot = one_group(seed=99)
    config = _child_config(root, slot)
    held_chain = chunk_chain("h", 4, 0)
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(held_chain, durable=True)
    async with kvtier.TransferEngine(layout, config) as engine:
        held = engine.hold(keys_of(held_chain))
        assert held.residency == (N,) * 4, held.residency
        print("ready", flush=True)
        i = 0
        while True:  # a full tier: every write evicts one of the unheld rows
            w = i % 20000
            await engine.store([kvtier.Chunk(key(f"w{w}", 0), [8 + w % 40])], durable=True)
            if i % 7 == 0:
                await engine.load([kvtier.Chunk(held_chain[i % 4].key, [60])])
            i += 1


def test_sigkill_while_rows_are_held_reopens_with_every_row_right(tmp_path: Path) -> None:
    from tests.reliability._faultio import kill_child

    root = tmp_path / "root"
    err = tmp_path / "child.err"
    alive = kill_child(["tests.engine.test_hold_pins", "child", str(root)], err, delay=0.6)
    assert alive, err.read_text()[-3000:]
    layout2, t, slot = one_group(seed=99)  # the child's bytes (it loads into block 60 only)
    config = _child_config(str(root), slot)
    ref = t.clone()

    async def reopen() -> tuple[int, int]:
        async with kvtier.TransferEngine(layout2, config) as engine:
            held = keys_of(chunk_chain("h", 4, 0))
            assert engine.lookup(held) == [N] * 4
            checked = 0
            names = [("h", i, i) for i in range(4)] + [("w", i, 8 + i % 40) for i in range(20000)]
            for name, i, block in names:
                k = key(f"{name}{i}", 0)
                if engine.lookup([k]) != [N]:
                    continue
                out = await engine.load([kvtier.Chunk(k, [60])])
                assert out.loaded == (k,), out.failed
                assert torch.equal(t[60], ref[block]), (name, i)
                checked += 1
            return checked, engine.stats().nvme["rows_resident"]

    checked, resident = asyncio.run(reopen())
    assert checked == resident
    assert 4 <= resident <= 8


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    asyncio.run(_child(sys.argv[2]))
