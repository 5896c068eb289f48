"""Calls from another thread or event loop than the engine's raise WrongThreadError.

The engine is not thread-safe: a call from a foreign thread would race the
loop's own bookkeeping, and a load awaited on another thread's loop could wait
forever (one load in a few hundred hung). Such calls raise at once and change
nothing; ``stats()`` stays readable from any thread (metrics scrapes read it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvtier
from kvtier.errors import WrongThreadError
from tests.engine.helpers import fill_random, key


def _layout() -> tuple[kvtier.KVLayout, kvtier.EngineConfig, torch.Tensor]:
    t = torch.empty((16, 256), dtype=torch.uint8)
    fill_random(t, 5)
    layout = kvtier.KVLayout.from_tensors({0: {"kv": t}})
    return layout, kvtier.EngineConfig(8 * layout.slot_nbytes(1), 1), t


def _in_thread(fn: Callable[[], Any]) -> BaseException | Any:
    """Run ``fn`` on a new thread; return its result or the exception it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed back to the test
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the call from another thread hung"
    return out[0]


async def test_calls_from_another_thread_raise_and_change_nothing() -> None:
    layout, config, t = _layout()
    a, b = key("a", 0), key("b", 0)
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store([kvtier.Chunk(a, [1])])
        before = engine.stats()
        foreign: list[Callable[[], Any]] = [
            lambda: engine.lookup([a]),
            lambda: engine.prefix_hits([a]),
            lambda: engine.stored_range(a),
            lambda: asyncio.run(engine.store([kvtier.Chunk(b, [2])])),
            lambda: asyncio.run(engine.load([kvtier.Chunk(a, [3])])),
            lambda: asyncio.run(engine.prefetch([a])),
            lambda: asyncio.run(engine.flush()),
            lambda: asyncio.run(engine.aclose()),
        ]
        t3 = t[3].clone()
        for call in foreign:
            err = _in_thread(call)
            assert isinstance(err, WrongThreadError), err
            assert "thread" in str(err)
        assert engine.stats() == before
        assert engine.lookup([a, b]) == [kvtier.Residency.CPU, kvtier.Residency.MISS]
        assert torch.equal(t[3], t3)  # the foreign load copied nothing
        # stats() is readable from any thread (a metrics scrape)
        stats = _in_thread(engine.stats)
        assert isinstance(stats, kvtier.EngineStats)
        assert stats.keys_per_group == before.keys_per_group
        # ... and the engine still works on its own loop
        out = await engine.load([kvtier.Chunk(a, [3])])
        assert out.loaded == (a,)
        assert torch.equal(t[3], t[1])


def test_a_coroutine_awaited_on_another_loop_of_the_same_thread_raises() -> None:
    layout, config, t = _layout()
    a = key("a", 0)
    engine = kvtier.TransferEngine(layout, config)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start())
        loop.run_until_complete(engine.store([kvtier.Chunk(a, [1])]))
        for coro in (
            engine.load([kvtier.Chunk(a, [4])]),
            engine.store([kvtier.Chunk(key("b", 0), [2])]),
            engine.prefetch([a]),
            engine.flush(),
        ):
            with pytest.raises(WrongThreadError, match="event loop"):
                asyncio.run(coro)
        assert engine.lookup([a, key("b", 0)]) == [
            kvtier.Residency.CPU,
            kvtier.Residency.MISS,
        ]
        out = loop.run_until_complete(engine.load([kvtier.Chunk(a, [4])]))
        assert out.loaded == (a,)
        assert torch.equal(t[4], t[1])
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()


async def test_a_closed_or_new_engine_still_says_so_from_any_thread() -> None:
    layout, config, _ = _layout()
    engine = kvtier.TransferEngine(layout, config)
    err = _in_thread(lambda: engine.lookup([key("a", 0)]))
    assert isinstance(err, kvtier.EngineClosedError)
    async with engine:
        pass
    err = _in_thread(lambda: engine.lookup([key("a", 0)]))
    assert isinstance(err, kvtier.EngineClosedError)
    assert _in_thread(lambda: asyncio.run(engine.aclose())) is None  # idempotent anywhere
