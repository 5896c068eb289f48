"""Public API: exports, typed errors for bad input (state unchanged), lifecycle, cancellation."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

import kvtier
from kvtier import errors
from tests.engine.helpers import fill_random, key, same


def test_all_is_sorted_and_complete() -> None:
    assert kvtier.__all__ == sorted(kvtier.__all__)
    for name in kvtier.__all__:
        assert hasattr(kvtier, name)
    design = {
        "KVLayout",
        "OffloadKey",
        "Chunk",
        "Residency",
        "EngineConfig",
        "NVMeConfig",
        "TransferEngine",
        "BackgroundEngine",
        "StoreResult",
        "LoadResult",
        "PrefetchResult",
        "EngineStats",
        "KVTierError",
        "EngineClosedError",
    }
    assert design <= set(kvtier.__all__)


def _layout(nb: int = 16) -> tuple[kvtier.KVLayout, torch.Tensor, torch.Tensor]:
    a = torch.empty((nb, 2, 256), dtype=torch.float16)
    b = torch.empty((nb, 512), dtype=torch.uint8)
    fill_random(a, 1)
    fill_random(b, 2)
    return kvtier.KVLayout.from_tensors({0: {"a": a}, 1: {"b": b}}), a, b


BAD_STORE = {
    "unknown group": lambda: [kvtier.Chunk(key(1, 7), [0])],
    "block out of range": lambda: [kvtier.Chunk(key(1, 0), [16])],
    "negative block": lambda: [kvtier.Chunk(key(1, 0), [-1])],
    "offset+len > bpc": lambda: [kvtier.Chunk(key(1, 0), [0, 1, 2], offset=2)],
    "duplicate keys": lambda: [kvtier.Chunk(key(1, 0), [0]), kvtier.Chunk(key(1, 0), [1])],
    "not a chunk": lambda: [key(1, 0)],
    "a single chunk, not a list": lambda: kvtier.Chunk(key(1, 0), [0]),
    "one bad chunk after good ones": lambda: [
        kvtier.Chunk(key(2, 0), [0]),
        kvtier.Chunk(key(3, 1), [99]),
    ],
}


@pytest.mark.parametrize("case", sorted(BAD_STORE))
async def test_bad_store_raises_typed_error_and_changes_nothing(case: str) -> None:
    layout, a, _ = _layout()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4)) as engine:
        good = kvtier.Chunk(key("kept", 0), [4, 5])
        await engine.store([good])
        before = engine.stats()
        with pytest.raises(errors.InvalidArgumentError) as info:
            await engine.store(BAD_STORE[case]())
        assert isinstance(info.value, ValueError)
        assert isinstance(info.value, kvtier.KVTierError)
        after = engine.stats()
        assert after == before
        snapshot = a[4:6].clone()
        a[4:6] = 0
        assert (await engine.load([good])).loaded == (good.key,)
        assert same(a[4:6], snapshot)


BAD_LOAD = {
    "same GPU block twice": lambda: [kvtier.Chunk(key("kept", 0), [1, 1])],
    "same GPU block in two chunks": lambda: [
        kvtier.Chunk(key("kept", 0), [1, 2]),
        kvtier.Chunk(key("x", 0), [2]),
    ],
    "unknown group": lambda: [kvtier.Chunk(key("kept", 9), [1])],
    "block out of range": lambda: [kvtier.Chunk(key("kept", 0), [100, 101])],
}


@pytest.mark.parametrize("case", sorted(BAD_LOAD))
async def test_bad_load_raises_typed_error_and_changes_nothing(case: str) -> None:
    layout, a, _ = _layout()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4)) as engine:
        await engine.store([kvtier.Chunk(key("kept", 0), [4, 5])])
        before = engine.stats()
        a_before = a.clone()
        with pytest.raises(errors.InvalidArgumentError):
            await engine.load(BAD_LOAD[case]())
        assert engine.stats() == before
        assert same(a, a_before)


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: kvtier.OffloadKey(b"", 0), errors.InvalidArgumentError),
        (lambda: kvtier.OffloadKey("str", 0), errors.InvalidArgumentError),
        (lambda: kvtier.OffloadKey(b"x", -1), errors.InvalidArgumentError),
        (lambda: kvtier.Chunk(kvtier.OffloadKey(b"x", 0), []), errors.ChunkRangeError),
        (lambda: kvtier.Chunk(kvtier.OffloadKey(b"x", 0), [1], offset=-1), errors.ChunkRangeError),
        (lambda: kvtier.EngineConfig(cpu_bytes=0), errors.BudgetError),
        (lambda: kvtier.EngineConfig(cpu_bytes=-5), errors.BudgetError),
        (lambda: kvtier.EngineConfig(cpu_bytes=1 << 20, blocks_per_chunk=0), errors.ConfigError),
        (lambda: kvtier.EngineConfig(cpu_bytes=1 << 20, eviction="fifo"), errors.ConfigError),
        (lambda: kvtier.NVMeConfig(root="/tmp", capacity_bytes=0), errors.ConfigError),
        (
            lambda: kvtier.NVMeConfig(root="/tmp", capacity_bytes=1, direct_io="maybe"),
            errors.ConfigError,
        ),
        (
            lambda: kvtier.NVMeConfig(root="/tmp", capacity_bytes=1, io_backend="gds"),
            errors.ConfigError,
        ),
        (lambda: kvtier.KVLayout.from_tensors({}), errors.LayoutError),
        (lambda: kvtier.KVLayout.from_tensors({0: {}}), errors.LayoutError),
        (lambda: kvtier.KVLayout.from_tensors({0: {"a": [1, 2]}}), errors.LayoutError),
        (
            lambda: kvtier.KVLayout.from_tensors({0: {"a": torch.zeros(4, 8, device="meta")}}),
            errors.LayoutError,
        ),
        (
            lambda: kvtier.KVLayout.from_tensors({0: {"a": torch.zeros(4, 8)}}, block_dim=2),
            errors.LayoutError,
        ),
        (
            lambda: kvtier.KVLayout.from_tensors(
                {0: {"a": torch.zeros(4, 8), "b": torch.zeros(5, 8)}}
            ),
            errors.LayoutError,
        ),
        (
            lambda: kvtier.KVLayout.from_tensors(
                {0: {"a": torch.zeros(4, 8)}}, payload_nbytes={"a": 33}
            ),
            errors.LayoutError,
        ),
        (
            lambda: kvtier.KVLayout.from_tensors(
                {0: {"a": torch.zeros(4, 8)}}, payload_nbytes={"a": 0}
            ),
            errors.LayoutError,
        ),
        (
            lambda: kvtier.KVLayout.from_tensors(
                {0: {"a": torch.zeros(4, 8)}}, payload_nbytes={"zz": 4}
            ),
            errors.LayoutError,
        ),
        (
            lambda: kvtier.KVLayout.from_tensors({0: {"a": torch.zeros(4, 8)}}, tokens_per_block=0),
            errors.LayoutError,
        ),
        (lambda: kvtier.KVLayout.from_tensors({-1: {"a": torch.zeros(4, 8)}}), errors.LayoutError),
        (
            lambda: kvtier.KVLayout.from_tensors({0: {"a": torch.zeros(4, 8).t()}}, block_dim=1),
            errors.LayoutError,
        ),
        (lambda: _overlapping(), errors.LayoutError),
        (lambda: kvtier.OffloadKey(b"x", 1 << 32), errors.InvalidArgumentError),
        (
            lambda: kvtier.KVLayout.from_tensors({1 << 32: {"a": torch.zeros(4, 8)}}),
            errors.LayoutError,
        ),
        (
            lambda: kvtier.KVLayout.from_tensors(
                {0: {"a": torch.zeros(4, 8, dtype=torch.complex64).conj()}}
            ),
            errors.LayoutError,
        ),
        (
            lambda: kvtier.KVLayout.from_tensors(
                {0: {"kv": torch.zeros(2, 8, 16)}}, block_dim={"k v": 1}
            ),
            errors.LayoutError,
        ),
        (
            lambda: kvtier.NVMeConfig(root="/tmp", capacity_bytes=1 << 20, segment_nbytes=4096),
            errors.ConfigError,
        ),
        (lambda: kvtier.NVMeConfig(root="/tmp/a\0b", capacity_bytes=1 << 20), errors.ConfigError),
        (lambda: _overlapping_blocks(), errors.LayoutError),
        (
            lambda: kvtier.KVLayout.from_tensors({0: {"a": torch.zeros(1, 64).expand(8, 64)}}),
            errors.LayoutError,
        ),
        (lambda: kvtier.KVLayout.from_tensors({0: {"a": torch.zeros(0, 8)}}), errors.LayoutError),
    ],
)
def test_bad_construction_raises_typed_value_error(make, error) -> None:
    with pytest.raises(error) as info:
        make()
    assert isinstance(info.value, ValueError)


def _overlapping_blocks() -> kvtier.KVLayout:
    # Same shape and strides, shifted by two blocks: only blocks 2..9 overlap.
    base = torch.zeros(12, 256)
    return kvtier.KVLayout.from_tensors({0: {"a": base[:10], "b": base[2:12]}})


def _overlapping() -> kvtier.KVLayout:
    base = torch.zeros(8, 64)
    return kvtier.KVLayout.from_tensors({0: {"a": base[:, :40], "b": base[:, 32:]}})


def test_budget_smaller_than_one_slot() -> None:
    layout, _, _ = _layout()
    with pytest.raises(errors.BudgetError):
        kvtier.TransferEngine(layout, kvtier.EngineConfig(layout.slot_nbytes(4) - 1, 4))


async def test_calls_after_close_raise() -> None:
    layout, _, _ = _layout()
    engine = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4))
    with pytest.raises(kvtier.EngineClosedError):
        engine.lookup([key(1, 0)])
    await engine.start()
    await engine.aclose()
    await engine.aclose()  # idempotent
    with pytest.raises(kvtier.EngineClosedError):
        await engine.store([kvtier.Chunk(key(1, 0), [0])])
    with pytest.raises(kvtier.EngineClosedError):
        await engine.load([kvtier.Chunk(key(1, 0), [0])])
    with pytest.raises(kvtier.EngineClosedError):
        await engine.flush()
    with pytest.raises(kvtier.EngineClosedError):
        await engine.start()


async def test_full_pool_with_every_slot_pinned_rejects_without_blocking() -> None:
    layout, _, _ = _layout()
    config = kvtier.EngineConfig(2 * layout.slot_nbytes(1), 1)
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store([kvtier.Chunk(key(i, 0), [i]) for i in range(2)])
        for i in range(2):
            engine._pool.pin(key(i, 0))
        res = await asyncio.wait_for(engine.store([kvtier.Chunk(key(9, 1), [3])]), 5)
        assert res.rejected == (key(9, 1),)
        for i in range(2):
            engine._pool.unpin(key(i, 0))
        res = await engine.store([kvtier.Chunk(key(9, 1), [3])])
        assert res.stored == (key(9, 1),)


async def test_cancelled_store_and_load_leave_no_pins() -> None:
    t = torch.empty((64, 1 << 16), dtype=torch.uint8)
    fill_random(t, 3)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(64 << 20, 4)) as engine:
        for round_ in range(6):
            chunks = [
                kvtier.Chunk(key(f"{round_}-{i}", 0), list(range(4 * i, 4 * i + 4)))
                for i in range(8)
            ]
            task = asyncio.ensure_future(engine.store(chunks))
            for _ in range(round_):
                await asyncio.sleep(0)
            task.cancel()
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
            if round_ == 0:  # cancelled before it ran
                assert isinstance(outcome, asyncio.CancelledError)
            else:  # cancelled mid-way, or already done (a store takes a few loop turns)
                assert isinstance(outcome, asyncio.CancelledError | kvtier.StoreResult)
            load = asyncio.ensure_future(engine.load(chunks))
            for _ in range(round_):
                await asyncio.sleep(0)
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
        # let in-flight jobs finish
        for _ in range(50):
            stats = engine.stats()
            if stats.slots_pinned == 0 and stats.slots_writing == 0:
                break
            await asyncio.sleep(0.01)
        assert stats.slots_pinned == 0
        assert stats.slots_writing == 0
        # a cancelled store keeps its keys only if its copy had completed: they load bitwise
        resident = [
            c
            for c, r in zip(chunks, engine.lookup(c.key for c in chunks), strict=True)
            if r is kvtier.Residency.CPU
        ]
        before = t.clone()
        t.zero_()
        out = await engine.load(resident)
        assert not out.failed
        ids = [b for c in resident for b in c.block_ids]
        assert same(t[ids], before[ids])


def test_background_engine_from_sync_code() -> None:
    layout, a, _ = _layout()
    before = a.clone()
    with kvtier.BackgroundEngine(layout, kvtier.EngineConfig(1 << 20, 4)) as engine:
        fut = engine.store([kvtier.Chunk(key("bg", 0), [0, 1, 2, 3])])
        assert fut.result(timeout=10).stored == (key("bg", 0),)
        assert engine.lookup([key("bg", 0)]) == [kvtier.Residency.CPU]
        assert engine.prefix_hits([key("bg", 0), key("no", 0)]) == 1
        assert engine.stored_range(key("bg", 0)) == (0, 4)
        assert engine.stored_range(key("no", 0)) is None
        a.zero_()
        assert engine.load([kvtier.Chunk(key("bg", 0), [0, 1, 2, 3])]).result(timeout=10).loaded
        engine.flush().result(timeout=10)
        assert engine.stats().hits == 1
    assert same(a[:4], before[:4])
    with pytest.raises(kvtier.EngineClosedError):
        engine.store([kvtier.Chunk(key("bg", 0), [0])])


async def test_start_cancelled_while_prefaulting_does_not_unmap_under_the_worker() -> None:
    # A Ctrl-C during start() used to unmap the pool while the pre-fault thread
    # was still writing it: a segfault. Now the start waits for that thread.
    layout, _, _ = _layout()
    engine = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 30, 4))
    task = asyncio.ensure_future(engine.start())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(kvtier.EngineClosedError):
        engine.lookup([key(1, 0)])


def test_background_engine_start_twice_and_calls_racing_close() -> None:
    import concurrent.futures
    import threading

    layout, _, _ = _layout()
    for _ in range(10):
        engine = kvtier.BackgroundEngine(layout, kvtier.EngineConfig(1 << 20, 4)).start()
        with pytest.raises(kvtier.EngineClosedError):
            engine.start()
        with pytest.raises(errors.InvalidArgumentError):
            engine.lookup(key(1, 0))  # one key, not a list: typed error, not a TypeError
        futures, stop = [], threading.Event()

        def hammer(
            engine: kvtier.BackgroundEngine = engine,
            futures: list = futures,
            stop: threading.Event = stop,
        ) -> None:
            while not stop.is_set():
                try:
                    futures.append(engine.flush())
                except kvtier.EngineClosedError:
                    return

        thread = threading.Thread(target=hammer)
        thread.start()
        engine.close()
        stop.set()
        thread.join()
        # every call submitted before close() settles (done, failed or cancelled); none hangs
        _, pending = concurrent.futures.wait(futures, timeout=5)
        assert not pending


async def test_durable_store_without_nvme_is_a_config_error_and_changes_nothing() -> None:
    layout, _, _ = _layout()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4)) as engine:
        before = engine.stats()
        with pytest.raises(kvtier.errors.ConfigError, match="NVMe"):
            await engine.store([kvtier.Chunk(key("d", 0), [0, 1, 2, 3])], durable=True)
        assert engine.lookup([key("d", 0)]) == [kvtier.Residency.MISS]
        assert engine.stats() == before
        await engine.flush()  # nothing is durable without NVMe: returns at once


def test_error_messages_name_the_actual_mistake() -> None:
    with pytest.raises(errors.InvalidArgumentError, match=r"must be bytes.*got str"):
        kvtier.OffloadKey("abc", 0)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match=r"1\.\.64 bytes long, got 65"):
        kvtier.OffloadKey(bytes(65), 0)


async def test_a_call_before_start_says_how_to_start() -> None:
    layout, _, _ = _layout()
    engine = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2))
    with pytest.raises(kvtier.EngineClosedError, match=r"engine is new.*async with engine"):
        engine.lookup([kvtier.OffloadKey(b"k", 0)])
    async with engine:
        pass
    with pytest.raises(kvtier.EngineClosedError, match=r"engine is closed; no call is accepted$"):
        engine.lookup([kvtier.OffloadKey(b"k", 0)])


def test_one_layer_name_for_two_tensors_is_refused() -> None:
    """block_dim and payload_nbytes are keyed by name: a name must mean one tensor."""
    a, b = torch.zeros(4, 8), torch.zeros(4, 8)
    with pytest.raises(errors.LayoutError, match="'x' stands for different tensors in groups 0"):
        kvtier.KVLayout.from_tensors({0: {"x": a}, 1: {"x": b}}, block_dim={"x": 0})
    with pytest.raises(errors.LayoutError, match="different tensors"):
        kvtier.KVLayout.from_tensors({0: {"x": a}, 1: {"x": a[:, :4]}})  # another view
    # the same tensor (or an identical view of it) under one name in two groups: an alias
    layout = kvtier.KVLayout.from_tensors({0: {"x": a}, 1: {"x": a.view(4, 8)}})
    assert list(layout.group_ids) == [0, 1]


def test_a_vllm_kv_tensor_registered_with_block_dim_0_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """(2, num_blocks, ...) with the default block_dim=0 would be 2 blocks: logged."""
    t = torch.zeros((2, 8, 16, 1, 64), dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="kvtier.layout"):
        layout = kvtier.KVLayout.from_tensors({0: {"layers.0": t}})
    assert layout.group(0).num_blocks == 2
    assert "block_dim=1" in caplog.text
    assert "layers.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.layout"):
        layout = kvtier.KVLayout.from_tensors({0: {"layers.0": t}}, block_dim=1)
    assert layout.group(0).num_blocks == 8
    assert caplog.text == ""
