"""A Hold garbage-collected before its release: the engine releases its pins.

A serving loop that aborts a request between its admission (``hold``) and its
load can drop the Hold without calling ``release()``. The engine keeps only a
weak reference to it, so the Hold is collected, and its pins (CPU slots and
NVMe rows) are released on the engine's loop, instead of pinning the keys
until ``aclose``: the first such hold is logged as a warning, every one is
counted in ``stats().holds_dropped``.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import threading
import weakref
from pathlib import Path

import pytest

import kvtier
from tests.engine.helpers import chunk_chain, keys_of, logged, nvme_rows, one_group, settle

C, N = kvtier.Residency.CPU, kvtier.Residency.NVME
WARNING = "garbage-collected without release()"


async def test_a_dropped_hold_releases_its_slots_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1)) as engine:
        chain = chunk_chain("a", 3, 0)
        await engine.store(chain)
        held = engine.hold(keys_of(chain))
        assert held.residency == (C, C, C)
        assert engine.stats().slots_pinned == 3
        ref = weakref.ref(held)
        del held
        gc.collect()  # the engine does not keep it alive
        assert ref() is None
        await settle()
        assert engine.stats().slots_pinned == 0
        assert engine.stats().holds_dropped == 1
        assert logged(caplog, WARNING) == 1
        for i in range(3):  # later ones are counted, not logged
            engine.hold(keys_of(chain[i : i + 1]))  # dropped at once
        await settle()
        assert engine.stats().holds_dropped == 4
        assert engine.stats().slots_pinned == 0
        assert logged(caplog, WARNING) == 1
        # the slots are evictable again: four new keys fit (three by eviction)
        res = await engine.store(chunk_chain("x", 4, 10))
        assert len(res.stored) == 4
        assert engine.lookup(keys_of(chain)) == [kvtier.Residency.MISS] * 3


async def test_a_kept_hold_stays_held_and_a_released_one_does_not_warn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1)) as engine:
        a, b = chunk_chain("a", 1, 0), chunk_chain("b", 1, 1)
        await engine.store([*a, *b])
        kept = engine.hold(keys_of(a))
        with engine.hold(keys_of(b)):
            pass
        gc.collect()
        await settle()
        assert logged(caplog, WARNING) == 0
        assert engine.stats().holds_dropped == 0
        assert engine.stats().slots_pinned == 1  # `kept` still pins a0
        res = await engine.store(chunk_chain("x", 4, 10))
        assert len(res.stored) == 3  # a0 stays; b0 and the free slots take three
        assert engine.lookup(keys_of(a)) == [C]
        kept.release()


async def test_a_dropped_hold_releases_its_nvme_rows(tmp_path: Path) -> None:
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(8 * slot, 1, nvme=nvme_rows(tmp_path, slot, 4))
    chain = chunk_chain("a", 3, 0)
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chain, durable=True)
    async with kvtier.TransferEngine(layout, config) as engine:
        held = engine.hold(keys_of(chain))
        assert held.residency == (N, N, N)
        assert engine.stats().nvme["rows_pinned"] == 3
        del held
        gc.collect()
        await settle()
        assert engine.stats().nvme["rows_pinned"] == 0
        # every row can be taken again: three writes evict the three keys
        res = await engine.store(chunk_chain("y", 4, 20), durable=True)
        assert len(res.stored) == 4
        assert engine.stats().nvme["evictions"] == 3


async def test_a_hold_dropped_after_aclose_does_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    engine = await kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1)).start()
    chain = chunk_chain("a", 2, 0)
    await engine.store(chain)
    held = engine.hold(keys_of(chain))
    await engine.aclose()
    assert held.released
    del held
    gc.collect()
    await settle()
    assert logged(caplog, WARNING) == 0


@pytest.mark.parametrize("drop", ["before_close_releases", "after_close_releases"])
async def test_a_hold_dropped_while_the_engine_closes(
    caplog: pytest.LogCaptureFixture, drop: str
) -> None:
    """Dropped while aclose() runs: released once, by whichever comes first; close ends."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    engine = await kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1)).start()
    chain = chunk_chain("a", 2, 0)
    await engine.store(chain)
    await engine.store(chunk_chain("w", 1, 5))
    held = engine.hold(keys_of(chain))
    unpins: list[object] = []
    unpin = engine._pool.unpin
    engine._pool.unpin = lambda key: (unpins.append(key), unpin(key))[1]  # type: ignore[method-assign]
    closing = asyncio.ensure_future(engine.aclose())
    if drop == "after_close_releases":
        for _ in range(100):
            if held.released:
                break
            await asyncio.sleep(0)
        assert held.released
    else:
        assert not held.released
    del held
    gc.collect()
    await asyncio.wait_for(closing, 30)
    assert collections.Counter(unpins) == collections.Counter(keys_of(chain))  # once each
    assert logged(caplog, WARNING) == (drop == "before_close_releases")


def test_a_background_engine_hold_dropped_on_another_thread_is_released(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    with kvtier.BackgroundEngine(layout, kvtier.EngineConfig(2 * slot, 1)) as engine:
        a = chunk_chain("a", 1, 0)
        engine.store(a).result(30)
        done = threading.Event()

        def worker() -> None:
            held = engine.hold(keys_of(a))
            assert held.residency == (C,)
            del held  # dropped on this thread, not the engine's
            gc.collect()
            done.set()

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(30)
        assert done.is_set()
        for _ in range(100):  # the release runs on the engine thread
            if engine.stats().slots_pinned == 0:
                break
            threading.Event().wait(0.01)
        assert engine.stats().slots_pinned == 0
        assert logged(caplog, WARNING) == 1
        res = engine.store(chunk_chain("x", 2, 10)).result(30)
        assert len(res.stored) == 2  # a0 evictable again
