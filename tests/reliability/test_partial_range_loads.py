"""Partial-range loads, stored_range, durable stores without NVMe, inspect, NVMeConfig.

A load asking a key for sub-blocks outside its stored range must fail that key
alone (``NotStoredError`` in ``failed``, one miss) on the fast and the slow
path; its GPU blocks get no bytes; no slot stays pinned; every key of a load
is counted once among ``hits``, ``nvme_hits``, ``misses`` (and failed
promotions in ``load_failures``).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
from typing import Any

import pytest
from click.testing import CliRunner

import kvtier
from kvtier import errors

from ._faultio import KeyFault, Wrapper
from ._model import Gpu, at_rest, chunks, engine_config, key, load_check, nvme_config, store_ok


def _counts(s: kvtier.EngineStats) -> tuple[int, int, int, int]:
    return s.hits, s.nvme_hits, s.misses, s.load_failures


def _delta(before: kvtier.EngineStats, after: kvtier.EngineStats) -> tuple[int, ...]:
    return tuple(a - b for a, b in zip(_counts(after), _counts(before), strict=True))


def _short(name: str, first_block: int, n: int = 2, offset: int = 0) -> kvtier.Chunk:
    """A group-0 chunk of ``n`` sub-blocks from ``offset`` on GPU blocks ``first_block..``."""
    return kvtier.Chunk(key(name, 0), list(range(first_block, first_block + n)), offset)


# ---------------------------------------------------------------- load: fast path


async def test_fast_path_short_key_fails_alone_and_is_one_miss() -> None:
    gpu = Gpu()
    a = chunks(["fp-a"], group_id=0)[0]
    b_short = _short("fp-b", 8, n=2, offset=1)  # stores sub-blocks [1, 3)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4)) as engine:
        await store_ok(engine, gpu, [a, b_short])
        assert engine.stored_range(b_short.key) == (1, 3)
        before = engine.stats()
        too_low = kvtier.Chunk(b_short.key, [16, 17], 0)  # [0, 2): sub-block 0 missing
        too_high = kvtier.Chunk(b_short.key, [16, 17], 2)  # [2, 4): sub-block 3 missing
        for bad in (too_low, too_high):
            moved = kvtier.Chunk(a.key, [20, 21, 22, 23])
            res = await load_check(engine, gpu, [bad, moved])
            assert res.loaded == (a.key,)
            assert isinstance(res.failed[bad.key], errors.NotStoredError)
        inside = kvtier.Chunk(b_short.key, [30], 2)  # [2, 3) of [1, 3)
        assert (await load_check(engine, gpu, [inside])).loaded == (b_short.key,)
        after = await at_rest(engine)
        assert after.slots_pinned == 0
        assert _delta(before, after) == (3, 0, 2, 0)
        # only the bad key: no job, nothing pinned, one miss
        res = await load_check(engine, gpu, [too_low])
        assert not res.loaded
        assert isinstance(res.failed[too_low.key], errors.NotStoredError)
        assert _delta(after, engine.stats()) == (0, 0, 1, 0)
        assert engine.stats().load_jobs == after.load_jobs


async def test_duplicate_key_with_a_bad_range_is_rejected_before_counting() -> None:
    gpu = Gpu()
    b_short = _short("dup-b", 0)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4)) as engine:
        await store_ok(engine, gpu, [b_short])
        before = engine.stats()
        with pytest.raises(errors.DuplicateKeyError):
            await engine.load(
                [kvtier.Chunk(b_short.key, [8, 9, 10, 11]), kvtier.Chunk(b_short.key, [12])]
            )
        assert _counts(engine.stats()) == _counts(before)


# ---------------------------------------------------------------- load: slow path


async def test_pending_short_key_fails_at_once_while_the_other_key_waits() -> None:
    gpu = Gpu()
    a = chunks(["pd-a"], group_id=0)[0]
    b_short = _short("pd-b", 8)
    for c in (a, b_short):
        gpu.write(c)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4)) as engine:
        before = engine.stats()
        store = asyncio.ensure_future(engine.store([a, b_short]))
        await asyncio.sleep(0)  # the store reserved its slots: both keys PENDING
        assert engine.lookup([a.key, b_short.key]) == [kvtier.Residency.PENDING] * 2
        assert engine.stored_range(b_short.key) == (0, 2)
        bad = kvtier.Chunk(b_short.key, [20, 21, 22, 23])
        moved = kvtier.Chunk(a.key, [24, 25, 26, 27])
        res = await load_check(engine, gpu, [bad, moved])
        assert res.loaded == (a.key,)
        assert isinstance(res.failed[bad.key], errors.NotStoredError)
        assert (await store).stored == (a.key, b_short.key)
        after = await at_rest(engine)
        assert _delta(before, after) == (1, 0, 1, 0)


async def test_key_stored_short_while_the_load_waits_is_counted_once() -> None:
    # The load waits for a's store; b is a MISS at the call's range check, then
    # another call stores b with sub-blocks [0, 2) before the wait ends. b fails
    # with NotStoredError and counts once, as a miss (it used to count as a hit
    # too).
    gpu = Gpu()
    a = chunks(["cc-a"], group_id=0)[0]
    b_short = _short("cc-b", 8)
    for c in (a, b_short):
        gpu.write(c)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4)) as engine:
        before = engine.stats()
        bad = kvtier.Chunk(b_short.key, [20, 21, 22, 23])
        moved = kvtier.Chunk(a.key, [24, 25, 26, 27])
        for c in (bad, moved):
            gpu.scribble(c)
        store_a = asyncio.ensure_future(engine.store([a]))
        load = asyncio.ensure_future(engine.load([moved, bad]))
        store_b = asyncio.ensure_future(engine.store([b_short]))
        res = await load
        await asyncio.gather(store_a, store_b)
        assert res.loaded == (a.key,)
        assert isinstance(res.failed[bad.key], errors.NotStoredError)
        assert gpu.holds(moved)
        assert gpu.untouched(bad)
        after = await at_rest(engine)
        assert after.slots_pinned == 0
        # two keys looked up: one hit, one miss
        assert _delta(before, after) == (1, 0, 1, 0)


async def _nvme_with(tmp_path: pathlib.Path, gpu: Gpu, cs: list[kvtier.Chunk]) -> None:
    async with kvtier.TransferEngine(
        gpu.layout, engine_config(gpu, 8, nvme_config(tmp_path))
    ) as engine:
        for c in cs:
            gpu.write(c)
        assert not (await engine.store(cs, durable=True)).rejected


async def test_cancelled_slow_load_with_a_not_stored_key_leaves_nothing_pinned(
    tmp_path: pathlib.Path,
) -> None:
    gpu = Gpu()
    a = chunks(["cn-a"], group_id=0)[0]
    b_short = _short("cn-b", 8)
    await _nvme_with(tmp_path, gpu, [a, b_short])
    stall = KeyFault("read", "block")
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(stall)))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        assert engine.stored_range(b_short.key) == (0, 2)
        before = engine.stats()
        bad = kvtier.Chunk(b_short.key, [20, 21, 22, 23])
        moved = kvtier.Chunk(a.key, [24, 25, 26, 27])
        for c in (bad, moved):
            gpu.scribble(c)
        task = asyncio.ensure_future(engine.load([bad, moved]))
        await asyncio.sleep(0.05)  # a's promotion read is stalled
        assert engine.lookup([a.key, b_short.key]) == [
            kvtier.Residency.PENDING,
            kvtier.Residency.NVME,  # nothing promoted for the bad key
        ]
        task.cancel()
        stall.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = await at_rest(engine)
        assert after.slots_pinned == 0
        assert gpu.untouched(bad)
        assert gpu.holds_or_untouched(moved)
        assert after.misses == before.misses + 1
        assert after.nvme is not None
        assert after.nvme["promotions"] == 1
        # the promoted key now loads from its CPU slot; the bad key still fails alone
        res = await load_check(engine, gpu, [bad, moved])
        assert res.loaded == (a.key,)
        assert isinstance(res.failed[bad.key], errors.NotStoredError)
        assert (await at_rest(engine)).slots_pinned == 0


async def test_slow_path_short_key_and_two_callers_of_one_promotion(tmp_path: pathlib.Path) -> None:
    # Two loads wait for one promotion of a; the second also asks b (on NVMe,
    # [0, 2)) for a whole chunk. Counters: a: one nvme_hit + one hit; b: one miss.
    gpu = Gpu()
    a = chunks(["tw-a"], group_id=0)[0]
    b_short = _short("tw-b", 8)
    await _nvme_with(tmp_path, gpu, [a, b_short])
    stall = KeyFault("read", "block")
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(stall)))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        before = engine.stats()
        first = kvtier.Chunk(a.key, [16, 17, 18, 19])
        second = kvtier.Chunk(a.key, [24, 25, 26, 27])
        bad = kvtier.Chunk(b_short.key, [32, 33, 34, 35])
        for c in (first, second, bad):
            gpu.scribble(c)
        t1 = asyncio.ensure_future(engine.load([first]))
        await asyncio.sleep(0.02)
        t2 = asyncio.ensure_future(engine.load([second, bad]))
        await asyncio.sleep(0.02)
        stall.gate.set()
        r1, r2 = await asyncio.gather(t1, t2)
        assert r1.loaded == (a.key,)
        assert r2.loaded == (a.key,)
        assert isinstance(r2.failed[b_short.key], errors.NotStoredError)
        assert gpu.holds(first)
        assert gpu.holds(second)
        assert gpu.untouched(bad)
        after = await at_rest(engine)
        assert _delta(before, after) == (1, 1, 1, 0)
        assert engine.lookup([b_short.key]) == [kvtier.Residency.NVME]


# ---------------------------------------------------------------- stored_range


async def test_stored_range_through_the_lifecycle(tmp_path: pathlib.Path) -> None:
    gpu = Gpu()
    k = _short("sr", 0, n=3, offset=1)
    async with kvtier.TransferEngine(
        gpu.layout, engine_config(gpu, 4, nvme_config(tmp_path))
    ) as engine:
        assert engine.stored_range(k.key) is None
        gpu.write(k)
        task = asyncio.ensure_future(engine.store([k], durable=True))
        await asyncio.sleep(0)
        assert engine.stored_range(k.key) == (1, 4)  # PENDING
        await task
        assert engine.stored_range(k.key) == (1, 4)
        # a later store of the whole chunk is skipped: the range never grows
        full = kvtier.Chunk(k.key, [10, 11, 12, 13])
        assert (await engine.store([full])).skipped == (k.key,)
        assert engine.stored_range(k.key) == (1, 4)
        with pytest.raises(errors.InvalidArgumentError):
            engine.stored_range(k.key.block_hash)  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidArgumentError):
            engine.stored_range(k)  # type: ignore[arg-type]
    with pytest.raises(errors.EngineClosedError):
        engine.stored_range(k.key)
    async with kvtier.TransferEngine(
        gpu.layout, engine_config(gpu, 4, nvme_config(tmp_path))
    ) as engine:
        assert engine.lookup([k.key]) == [kvtier.Residency.NVME]
        assert engine.stored_range(k.key) == (1, 4)
        assert engine.stored_range(key("sr-other", 0)) is None
        assert engine.stored_range(kvtier.OffloadKey(k.key.block_hash, 1)) is None


def test_background_stored_range_errors() -> None:
    gpu = Gpu()
    k = _short("bg-sr", 0)
    gpu.write(k)
    with kvtier.BackgroundEngine(gpu.layout, engine_config(gpu, 4)) as engine:
        assert engine.store([k]).result(timeout=10).stored == (k.key,)
        assert engine.stored_range(k.key) == (0, 2)
        with pytest.raises(errors.InvalidArgumentError):
            engine.stored_range("nope")  # type: ignore[arg-type]
        assert engine.stored_range(k.key) == (0, 2)  # the engine thread survived
    with pytest.raises(errors.EngineClosedError):
        engine.stored_range(k.key)


# ---------------------------------------------------------------- durable without NVMe


async def test_durable_store_without_nvme_is_a_config_error_and_changes_nothing() -> None:
    gpu = Gpu()
    c = chunks(["dn"], group_id=0)[0]
    gpu.write(c)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4)) as engine:
        before = engine.stats()
        with pytest.raises(errors.ConfigError):
            await engine.store([c], durable=True)
        assert engine.lookup([c.key]) == [kvtier.Residency.MISS]
        after = engine.stats()
        assert after == before
        # and the plain store still works; flush returns at once
        assert (await engine.store([c])).stored == (c.key,)
        await engine.flush()
        with pytest.raises(errors.ConfigError):  # a key already stored: still refused
            await engine.store([c], durable=True)
    with kvtier.BackgroundEngine(gpu.layout, engine_config(gpu, 4)) as bg:
        with pytest.raises(errors.ConfigError):
            bg.store([c], durable=True).result(timeout=10)
        assert bg.lookup([c.key]) == [kvtier.Residency.MISS]
        assert bg.stats().slots_free == bg.num_slots


# ---------------------------------------------------------------- inspect


def _inspect(root: pathlib.Path, *args: str) -> Any:
    from kvtier.cli import main

    return CliRunner().invoke(main, ["inspect", str(root), *args])


def test_inspect_counts_only_namespace_folders(tmp_path: pathlib.Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "x-0123456789ABCDEF").mkdir()  # upper case: not a tier digest
    (tmp_path / "x-0123456789abcde").mkdir()  # 15 digits
    (tmp_path / "-0123456789abcdef").mkdir()  # no namespace part
    (tmp_path / "y-0123456789abcdef0").mkdir()  # 17 digits
    (tmp_path / "f-0123456789abcdef").write_text("a file")
    res = _inspect(tmp_path)
    assert res.exit_code == 1, res.output
    assert "no kvtier namespace folder" in res.output
    res = _inspect(tmp_path, "--json")  # an empty list, for scripts
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["namespaces"] == []
    (tmp_path / "ns-0123456789abcdef").mkdir()
    (tmp_path / "renamed").mkdir()
    (tmp_path / "renamed" / "format.json").write_text("{}")
    res = _inspect(tmp_path, "--json")
    assert res.exit_code == 0, res.output
    names = [ns["directory"] for ns in json.loads(res.output)["namespaces"]]
    assert names == ["ns-0123456789abcdef", "renamed"]


async def test_inspect_finds_the_namespace_a_tier_made(tmp_path: pathlib.Path) -> None:
    gpu = Gpu()
    c = chunks(["ins"], group_id=0)[0]
    # a namespace that the tier must sanitize (spaces, slashes)
    await _nvme_with_ns(tmp_path, gpu, c, "rank 0/model:a")
    (tmp_path / "unrelated").mkdir()
    res = _inspect(tmp_path)
    assert res.exit_code == 0, res.output
    assert "namespace=rank 0/model:a" in res.output
    assert "unrelated" not in res.output


async def _nvme_with_ns(tmp_path: pathlib.Path, gpu: Gpu, c: kvtier.Chunk, ns: str) -> None:
    cfg = engine_config(gpu, 4, nvme_config(tmp_path, namespace=ns))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        gpu.write(c)
        await engine.store([c], durable=True)


# ---------------------------------------------------------------- NVMeConfig


class _Path:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __fspath__(self) -> Any:
        return self.value


@pytest.mark.parametrize("root", ["", _Path(""), _Path(b""), b"/tmp", 0, None], ids=repr)
def test_nvme_config_rejects_empty_or_non_path_root(root: Any) -> None:
    with pytest.raises(errors.ConfigError):
        kvtier.NVMeConfig(root=root, capacity_bytes=1 << 20)


@pytest.mark.parametrize("value", [0, 1, "yes", None, 1.0])
def test_nvme_config_grow_ahead_must_be_a_bool(value: Any) -> None:
    with pytest.raises(errors.ConfigError):
        kvtier.NVMeConfig(root="/tmp", capacity_bytes=1 << 20, grow_ahead=value)


async def test_nvme_config_root_pathlike_returning_bytes(tmp_path: pathlib.Path) -> None:
    gpu = Gpu()
    try:
        cfg = engine_config(gpu, 4, nvme_config(_Path(os.fsencode(tmp_path))))
    except errors.ConfigError:
        return  # refused up front: fine
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:  # or it works
        assert engine.stored_range(key("pb", 0)) is None


def test_nvme_config_root_pathlike_returning_an_int() -> None:
    with pytest.raises(errors.ConfigError):
        kvtier.NVMeConfig(root=_Path(5), capacity_bytes=1 << 20)
