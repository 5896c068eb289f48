"""The lifecycle state machine, the prefetch key sort and the tail-first refresh, on their own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvtier._in_flight import CallContext, wait_in_flight
from kvtier._lifecycle import Lifecycle
from kvtier._policy import make_policy
from kvtier._prefetch import sort_keys
from kvtier._slots import SlotPool
from kvtier._types import OffloadKey
from kvtier.errors import EngineClosedError, KeyNotResidentError, WrongThreadError


def _key(name: str) -> OffloadKey:
    return OffloadKey(name.encode().ljust(16, b"\0"), 0)


async def _nothing() -> None:
    return None


async def test_a_new_lifecycle_refuses_calls_and_closes_without_a_start() -> None:
    life = Lifecycle("TransferEngine")
    with pytest.raises(EngineClosedError, match="start it first"):
        life.check_open()
    await life.close(False, _nothing, _nothing, lambda: None)
    assert life.closed
    with pytest.raises(EngineClosedError, match="cannot start in state 'closed'"):
        await life.start(_nothing, _nothing)


async def test_start_opens_and_close_drains_then_releases_once() -> None:
    life = Lifecycle("TransferEngine")
    steps: list[str] = []

    async def drain() -> None:
        steps.append(f"drain:{life.state}")

    async def release() -> None:
        steps.append(f"release:{life.state}")

    await life.start(_nothing, release)
    life.check_open(loop=True)
    await asyncio.gather(
        life.close(False, drain, release, lambda: None),
        life.close(False, drain, release, lambda: None),
    )
    assert steps == ["drain:closing", "release:closed"]
    assert not life.request_hard_close()  # closed: nothing left to drop


async def test_a_failed_start_releases_and_ends_closed() -> None:
    life = Lifecycle("TransferEngine")
    released: list[str] = []

    async def set_up() -> None:
        raise OSError("no room")

    async def release() -> None:
        released.append(life.state)

    with pytest.raises(OSError, match="no room"):
        await life.start(set_up, release)
    assert released == ["closed"]
    assert life.closed


async def test_close_during_start_stops_it_at_its_next_step() -> None:
    life = Lifecycle("TransferEngine")
    gate = asyncio.Event()

    async def set_up() -> None:
        await gate.wait()
        life.stop_if_closing()

    start = asyncio.ensure_future(life.start(set_up, _nothing))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(life.close(False, _nothing, _nothing, lambda: None))
    await asyncio.sleep(0)
    assert not closing.done()
    gate.set()
    await closing
    with pytest.raises(EngineClosedError, match="while it was starting"):
        await start
    assert life.closed


async def test_a_hard_request_during_the_close_cancels_the_writes_now() -> None:
    life = Lifecycle("TransferEngine")
    cancelled: list[bool] = []
    gate, draining = asyncio.Event(), asyncio.Event()

    async def drain() -> None:
        draining.set()
        await gate.wait()

    await life.start(_nothing, _nothing)
    soft = asyncio.ensure_future(life.close(False, drain, _nothing, lambda: None))
    await draining.wait()
    assert life.state == "closing"
    assert not life.hard
    hard = asyncio.ensure_future(life.close(True, drain, _nothing, lambda: cancelled.append(True)))
    await asyncio.sleep(0)
    assert life.hard
    assert cancelled == [True]
    gate.set()
    await asyncio.gather(soft, hard)


async def test_calls_from_another_thread_raise_wrong_thread() -> None:
    life = Lifecycle("TransferEngine")
    await life.start(_nothing, _nothing)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            life.check_open()
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=call)
    th.start()
    th.join()
    assert len(errors) == 1
    assert isinstance(errors[0], WrongThreadError)
    assert "TransferEngine: a call from another thread" in str(errors[0])


def _pool(n: int) -> SlotPool:
    return SlotPool(n, make_policy("lru", n))


def _resident(pool: SlotPool, *keys: OffloadKey) -> None:
    entries, rejected, _ = pool.reserve([(k, 0, 1, 1) for k in keys], protect=frozenset())
    assert not rejected
    for entry in entries:
        pool.commit(entry.key)


def test_sort_keys_pins_residents_and_fails_keys_on_no_medium() -> None:
    pool = _pool(4)
    a, b, c = _key("a"), _key("b"), _key("c")
    _resident(pool, a, b)
    resident, promote, failed = sort_keys([b, c, a], pool, None)
    assert resident == [b, a]
    assert promote == []
    assert set(failed) == {c}
    assert isinstance(failed[c], KeyNotResidentError)
    assert all(pool.get(k).refs == 1 for k in (a, b))  # type: ignore[union-attr]


def test_refresh_tail_first_leaves_the_first_key_most_recent() -> None:
    pool = _pool(3)
    a, b, c, d = _key("a"), _key("b"), _key("c"), _key("d")
    _resident(pool, a, b, c)
    pool.refresh_tail_first([a, b, c], {a, b, c})
    _resident(pool, d)  # needs room: the least recently used (the tail, c) goes
    assert pool.get(c) is None
    assert pool.get(a) is not None
    assert pool.get(b) is not None


async def test_wait_in_flight_returns_at_once_for_a_cancelled_caller() -> None:
    k = _key("k")
    fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    ctx = CallContext(cancelled=True)
    await asyncio.wait_for(wait_in_flight({k: fut}, [k], ctx), 1)
    fut.set_result(True)
