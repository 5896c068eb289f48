"""Documented claims (README "Using it", command line, "Guarantees"; docs/DESIGN.md).

Each test names the claim it checks and where it is stated. A claim that does
not hold is a strict xfail whose reason says how the code differs. Async tests
run on asyncio and uvloop (tests/conftest.py); faults only through
``NVMeConfig.row_io_wrapper`` around the real backend.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import gc
import hashlib
import inspect
import json
import os
import pickle
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

import kvtier
from kvtier import errors
from kvtier.cli import main as cli_main
from kvtier.metrics import register_prometheus, unregister_prometheus

from ._faultio import KeyFault, Wrapper, until_set

BPC = 4


def _key(name: str | int, group_id: int) -> kvtier.OffloadKey:
    return kvtier.OffloadKey(hashlib.sha256(str(name).encode()).digest(), group_id)


def _fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    u8 = t.view(torch.uint8)
    u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8))


def _tensors(nb: int = 32) -> dict[str, torch.Tensor]:
    """g0: 1024-byte pages (float16); g1: 512-byte pages (uint8): unequal groups."""
    a = torch.empty((nb, 2, 256), dtype=torch.float16)
    b = torch.empty((nb, 512), dtype=torch.uint8)
    _fill(a, 1)
    _fill(b, 2)
    return {"a": a, "b": b}


def _layout(t: dict[str, torch.Tensor]) -> kvtier.KVLayout:
    return kvtier.KVLayout.from_tensors({0: {"a": t["a"]}, 1: {"b": t["b"]}})


def _nvme(root: Path, **kw: Any) -> kvtier.NVMeConfig:
    kw.setdefault("capacity_bytes", 16 << 20)
    kw.setdefault("namespace", "documented-claims")
    return kvtier.NVMeConfig(root=str(root), **kw)


async def _call(call: Any) -> Any:
    """Call ``call()`` and await its result if it is awaitable (async and sync methods)."""
    out = call()
    return await out if inspect.isawaitable(out) else out


def _bytes(t: torch.Tensor, ids: list[int]) -> bytes:
    return t[ids].contiguous().view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------
# README "Using it": storing a present key is skipped, even if the new chunk
# has more sub-blocks (a key stored partially stays partial); "a second run
# finds the key on NVMe: skipped".


async def test_present_key_is_skipped_even_with_more_sub_blocks(tmp_path: Path) -> None:
    t = _tensors()
    layout = _layout(t)
    k = _key("partial", 0)
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    async with kvtier.TransferEngine(layout, config) as engine:
        res = await engine.store([kvtier.Chunk(k, [3, 4], offset=1)])
        assert res.stored == (k,)
        assert engine.stored_range(k) == (1, 3)
        res = await engine.store([kvtier.Chunk(k, [5, 6, 7, 8])])  # more sub-blocks
        assert res.skipped == (k,)
        assert res.stored == ()
        assert res.rejected == ()
        assert engine.stored_range(k) == (1, 3)  # stays partial
        await engine.flush()
    async with kvtier.TransferEngine(layout, config) as engine:  # "a second run"
        assert engine.lookup([k]) == [kvtier.Residency.NVME]
        res = await engine.store([kvtier.Chunk(k, [5, 6, 7, 8])])
        assert res.skipped == (k,)
        assert res.stored == ()
        assert engine.stored_range(k) == (1, 3)
        assert engine.lookup([k]) == [kvtier.Residency.NVME]  # nothing copied to a slot


# README "Using it" / DESIGN "differs": a load that asks a key for sub-blocks
# outside stored_range fails that key alone (NotStoredError in
# LoadResult.failed, counted as a miss), also for a key on NVMe only.


@pytest.mark.parametrize("where", ["cpu", "nvme"])
async def test_load_outside_stored_range_fails_that_key_alone(tmp_path: Path, where: str) -> None:
    t = _tensors()
    layout = _layout(t)
    short, full = _key("short", 0), _key("full", 0)
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store([kvtier.Chunk(short, [0, 1]), kvtier.Chunk(full, [2, 3, 4, 5])])
        await engine.flush()
    want_full = _bytes(t["a"], [2, 3, 4, 5])
    if where == "cpu":
        engine = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, BPC))
        await engine.start()
        await engine.store([kvtier.Chunk(short, [0, 1]), kvtier.Chunk(full, [2, 3, 4, 5])])
    else:
        engine = kvtier.TransferEngine(layout, config)
        await engine.start()
        assert engine.lookup([short, full]) == [kvtier.Residency.NVME] * 2
    try:
        assert engine.stored_range(short) == (0, 2)
        before = engine.stats()
        t["a"][20:32] = 0
        res = await engine.load(
            [kvtier.Chunk(short, [20, 21, 22]), kvtier.Chunk(full, [24, 25, 26, 27])]
        )
        assert res.loaded == (full,)
        assert set(res.failed) == {short}
        assert isinstance(res.failed[short], errors.NotStoredError)
        after = engine.stats()
        assert after.misses == before.misses + 1
        assert after.load_failures == before.load_failures
        assert _bytes(t["a"], [24, 25, 26, 27]) == want_full
        assert not t["a"][20:23].view(torch.uint8).any()  # nothing written for the short key
        # the stored sub-blocks still load
        res = await engine.load([kvtier.Chunk(short, [20, 21])])
        assert res.loaded == (short,)
        assert _bytes(t["a"], [20, 21]) == _bytes(t["a"], [0, 1])
    finally:
        await engine.aclose()


# --------------------------------------------------------------------------
# README command-line table: `kvtier inspect ROOT` on a root without
# namespaces says so and exits 1; `--json` prints {"root": ..., "namespaces": []}
# and exits 0.


def test_inspect_root_without_namespaces(tmp_path: Path) -> None:
    runner = CliRunner()
    plain = runner.invoke(cli_main, ["inspect", str(tmp_path)])
    assert plain.exit_code == 1
    assert "no kvtier namespace" in plain.output
    as_json = runner.invoke(cli_main, ["inspect", str(tmp_path), "--json"])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.output)
    assert data["namespaces"] == []
    assert set(data) == {"root", "namespaces", "payloads_verified"}
    assert data["payloads_verified"] is False
    assert Path(data["root"]) == tmp_path


# --------------------------------------------------------------------------
# README "Prometheus": several engines of one process share a registry with
# distinct constant labels, each metric one family with every engine's samples;
# a closed engine exports nothing (it is held by weak reference);
# unregister_prometheus(export) stops an export.


async def test_prometheus_shared_families_closed_engine_exports_nothing() -> None:
    layout = _layout(_tensors())
    registry = CollectorRegistry()
    e0 = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, BPC))
    e1 = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, BPC))
    await e0.start()
    await e1.start()
    try:
        x0 = register_prometheus(e0, registry, labels={"rank": "0"})
        register_prometheus(e1, registry, labels={"rank": "1"})
        families = [m for m in registry.collect() if m.name == "kvtier_slots"]
        assert len(families) == 1
        ranks = {s.labels["rank"] for s in families[0].samples}
        assert ranks == {"0", "1"}
        await e1.aclose()
        assert registry.get_sample_value("kvtier_slots", {"rank": "1", "state": "free"}) is None
        free = registry.get_sample_value("kvtier_slots", {"rank": "0", "state": "free"})
        assert free == e0.num_slots
        unregister_prometheus(x0)
        assert registry.get_sample_value("kvtier_slots", {"rank": "0", "state": "free"}) is None
        assert not [m for m in registry.collect() if m.samples]
    finally:
        await e0.aclose()
        await e1.aclose()


async def test_prometheus_holds_the_engine_by_weak_reference() -> None:
    registry = CollectorRegistry()
    engine = kvtier.TransferEngine(_layout(_tensors()), kvtier.EngineConfig(1 << 20, BPC))
    await engine.start()
    register_prometheus(engine, registry)
    assert registry.get_sample_value("kvtier_slots", {"state": "free"}) == engine.num_slots
    await engine.aclose()
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None  # the export kept no strong reference
    assert registry.get_sample_value("kvtier_slots", {"state": "free"}) is None


# --------------------------------------------------------------------------
# README "Using it": without an NVMe tier, store(durable=True) raises
# ConfigError and flush() returns at once. DESIGN 6: bad input changes no state.


async def test_without_nvme_durable_store_raises_config_error_and_flush_returns_at_once() -> None:
    t = _tensors()
    async with kvtier.TransferEngine(_layout(t), kvtier.EngineConfig(1 << 20, BPC)) as engine:
        k = _key("nd", 0)
        before = engine.stats()
        with pytest.raises(errors.ConfigError) as info:
            await engine.store([kvtier.Chunk(k, [0, 1])], durable=True)
        assert isinstance(info.value, ValueError)
        assert engine.stats() == before
        assert engine.lookup([k]) == [kvtier.Residency.MISS]
        # a store in flight, then flush(): the coroutine finishes without suspending
        pending = asyncio.ensure_future(engine.store([kvtier.Chunk(k, [0, 1])]))
        await asyncio.sleep(0)
        coro = engine.flush()
        with pytest.raises(StopIteration):
            coro.send(None)
        assert (await pending).stored == (k,)


# --------------------------------------------------------------------------
# README "Using it" (prefetch): keys of one call never evict each other; a
# prefetched key is evictable like a stored one and its later load is a CPU
# hit. DESIGN "differs": prefetch counts promotions, not hits or misses.


async def test_prefetch_keys_of_one_call_never_evict_each_other(tmp_path: Path) -> None:
    t = _tensors()
    layout = _layout(t)
    keys = [_key(f"p{i}", 0) for i in range(8)]
    chunks = [kvtier.Chunk(k, [i]) for i, k in enumerate(keys)]
    async with kvtier.TransferEngine(
        layout, kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    ) as engine:
        assert (await engine.store(chunks)).stored == tuple(keys)
        await engine.flush()
    slot = layout.slot_nbytes(BPC)
    config = kvtier.EngineConfig(3 * slot, BPC, nvme=_nvme(tmp_path))
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.num_slots == 3
        before = engine.stats()
        res = await engine.prefetch(keys)
        assert len(res.promoted) == 3
        assert res.resident == ()
        assert set(res.failed) == set(keys) - set(res.promoted)
        # the promoted keys are all still in their slots: none evicted another
        assert engine.lookup(list(res.promoted)) == [kvtier.Residency.CPU] * 3
        assert all(isinstance(e, errors.KVTierError) for e in res.failed.values())
        # the failed keys are still on NVMe (a rejected promotion leaves the row)
        assert engine.lookup(list(res.failed)) == [kvtier.Residency.NVME] * 5
        after = engine.stats()
        assert (after.hits, after.misses, after.nvme_hits) == (
            before.hits,
            before.misses,
            before.nvme_hits,
        )
        assert after.nvme["promotions"] == before.nvme["promotions"] + 3
        # the later load is a CPU hit
        k = res.promoted[0]
        i = keys.index(k)
        t["a"][20] = 0
        out = await engine.load([kvtier.Chunk(k, [20])])
        assert out.loaded == (k,)
        assert _bytes(t["a"], [20]) == _bytes(t["a"], [i])
        assert engine.stats().hits == before.hits + 1
        assert engine.stats().nvme_hits == before.nvme_hits
        # prefetched keys are evictable like stored ones: a new store takes their slots
        new = [kvtier.Chunk(_key(f"n{j}", 1), [j]) for j in range(3)]
        assert len((await engine.store(new)).stored) == 3


# --------------------------------------------------------------------------
# README "Using it" / DESIGN 3 and 6 / Guarantees: a store never waits for
# room: keys that find no free or evictable slot come back in
# StoreResult.rejected; allocation never evicts a key of the same call.


async def test_store_never_waits_for_room_and_never_evicts_its_own_keys() -> None:
    t = _tensors()
    layout = _layout(t)
    slot = layout.slot_nbytes(BPC)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, BPC)) as engine:
        old = [kvtier.Chunk(_key(f"old{i}", 1), [i]) for i in range(4)]
        assert len((await engine.store(old)).stored) == 4
        big = [kvtier.Chunk(_key(f"big{i}", i % 2), [i]) for i in range(7)]
        res = await asyncio.wait_for(engine.store(big), 10)
        assert len(res.stored) == 4
        assert len(res.rejected) == 3
        assert set(res.stored) | set(res.rejected) == {c.key for c in big}
        assert engine.lookup(list(res.stored)) == [kvtier.Residency.CPU] * 4
        assert engine.lookup([c.key for c in old]) == [kvtier.Residency.MISS] * 4
        s = engine.stats()
        assert s.rejected == 3
        assert s.evictions == 4


# README "Using it": with NVMe write-through a slot stays pinned
# (stats().slots_pinned) until its row is written, so a burst of stores larger
# than the pool can be rejected while the first rows are still being written;
# await engine.flush() waits until they are, and their slots are evictable again.


async def test_write_through_pins_slots_until_written_and_flush_frees_them(tmp_path: Path) -> None:
    t = _tensors()
    layout = _layout(t)
    slot = layout.slot_nbytes(BPC)
    hold = KeyFault("write", "block")
    started = threading.Event()
    real_wait = hold.wait

    def wait() -> None:
        started.set()
        real_wait()

    hold.wait = wait  # type: ignore[method-assign]
    config = kvtier.EngineConfig(
        3 * slot, BPC, nvme=_nvme(tmp_path, row_io_wrapper=Wrapper(hold), grow_ahead=False)
    )
    engine = kvtier.TransferEngine(layout, config)
    await engine.start()
    try:
        first = [kvtier.Chunk(_key(f"w{i}", 0), [i]) for i in range(3)]
        assert len((await engine.store(first)).stored) == 3
        await until_set(started)
        assert engine.stats().slots_pinned == 3
        # README Guarantees: visible on NVMe only once the whole row is written
        tier = engine._nvme
        assert not any(tier.contains(c.key) for c in first)
        burst = [kvtier.Chunk(_key(f"x{i}", 1), [i]) for i in range(2)]
        res = await asyncio.wait_for(engine.store(burst), 10)
        assert res.rejected == tuple(c.key for c in burst)  # at once, not waiting
        flush = asyncio.ensure_future(engine.flush())
        await asyncio.sleep(0.05)
        assert not flush.done()  # flush waits for the held rows
        hold.gate.set()
        await asyncio.wait_for(flush, 30)
        s = engine.stats()
        assert s.slots_pinned == 0
        assert s.slots_resident == 3
        assert all(tier.contains(c.key) for c in first)
        assert len((await engine.store(burst)).stored) == 2  # evictable again
    finally:
        hold.gate.set()
        await engine.aclose()


# --------------------------------------------------------------------------
# OffloadKey: its repr is eval()-able (code comment, _types.py); DESIGN 6:
# hashable and immutable.


def test_offload_key_repr_eval_hashable_immutable() -> None:
    k = kvtier.OffloadKey(bytes(range(40)), 7)
    again = eval(repr(k), {"OffloadKey": kvtier.OffloadKey})
    assert again == k
    assert hash(again) == hash(k)
    assert {k: 1}[again] == 1
    with pytest.raises(AttributeError):
        k.group_id = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(k)) == k
    assert copy.deepcopy(k) == k


# README "Errors" and DESIGN 6: every error is a subclass of KVTierError;
# argument errors are also ValueError; flush() raises errors.NotDurableError
# (a StorageError).


def test_error_hierarchy() -> None:
    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, Exception) and c.__module__ == errors.__name__
    ]
    assert len(classes) >= 15
    for cls in classes:
        assert issubclass(cls, kvtier.KVTierError), cls
    argument = [
        errors.InvalidArgumentError,
        errors.LayoutError,
        errors.UnknownGroupError,
        errors.BlockIdError,
        errors.ChunkRangeError,
        errors.DuplicateKeyError,
        errors.NotStoredError,
        errors.ConfigError,
        errors.BudgetError,
        errors.AlignmentError,
    ]
    for cls in argument:
        assert issubclass(cls, ValueError), cls
    assert issubclass(errors.NotDurableError, errors.StorageError)
    assert kvtier.EngineClosedError is errors.EngineClosedError


# --------------------------------------------------------------------------
# DESIGN 6: a key of a group the layout does not have is a bad argument
# everywhere (UnknownGroupError from store, load, prefetch, lookup,
# prefix_hits and stored_range), never a MISS; bad input changes no state.


async def test_unknown_group_raises_from_every_method(tmp_path: Path) -> None:
    t = _tensors()
    bad = _key("bad", 5)
    good = _key("good", 0)
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    async with kvtier.TransferEngine(_layout(t), config) as engine:
        await engine.store([kvtier.Chunk(good, [0])])
        await engine.flush()
        before = engine.stats()
        calls = {
            "store": lambda: engine.store([kvtier.Chunk(bad, [1])]),
            "load": lambda: engine.load([kvtier.Chunk(bad, [1])]),
            "prefetch": lambda: engine.prefetch([good, bad]),
            "lookup": lambda: engine.lookup([good, bad]),
            "prefix_hits": lambda: engine.prefix_hits([good, bad]),
            "stored_range": lambda: engine.stored_range(bad),
        }
        for name, call in calls.items():
            with pytest.raises(errors.UnknownGroupError):
                await _call(call)
            assert engine.stats() == before, name
        assert engine.lookup([good]) == [kvtier.Residency.CPU]


def test_unknown_group_raises_from_background_engine() -> None:
    bad = _key("bad", 5)
    with kvtier.BackgroundEngine(_layout(_tensors()), kvtier.EngineConfig(1 << 20, BPC)) as engine:
        for fut in (
            engine.store([kvtier.Chunk(bad, [1])]),
            engine.load([kvtier.Chunk(bad, [1])]),
            engine.prefetch([bad]),
        ):
            assert isinstance(fut, concurrent.futures.Future)
            with pytest.raises(errors.UnknownGroupError):
                fut.result(30)
        for query in (engine.lookup, engine.prefix_hits):
            with pytest.raises(errors.UnknownGroupError):
                query([bad])
        with pytest.raises(errors.UnknownGroupError):
            engine.stored_range(bad)


# --------------------------------------------------------------------------
# DESIGN 2/3: slot_nbytes = round_up(max group_nbytes, 4096) + 4096, never the
# sum; num_slots == cpu_bytes // slot_nbytes; capacity is exact: num_slots keys
# of ANY group mix fit without eviction.


async def test_slot_is_sized_for_the_largest_group_and_capacity_is_exact() -> None:
    t = _tensors()
    layout = _layout(t)
    assert layout.group_nbytes(0, BPC) == BPC * 1024
    assert layout.group_nbytes(1, BPC) == BPC * 512
    assert layout.slot_nbytes(BPC) == 4096 + 4096
    cpu = 5 * layout.slot_nbytes(BPC) + 4095
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(cpu, BPC)) as engine:
        assert engine.num_slots == cpu // layout.slot_nbytes(BPC) == 5
        mix = [kvtier.Chunk(_key(f"m{i}", g), [i]) for i, g in enumerate([0, 1, 1, 0, 1])]
        res = await engine.store(mix)
        assert len(res.stored) == 5
        assert res.rejected == ()
        s = engine.stats()
        assert s.evictions == 0
        assert s.slots_free == 0
        assert s.keys_per_group == {0: 2, 1: 3}


# --------------------------------------------------------------------------
# README "Using it": hits counts keys a load found in a CPU slot, nvme_hits
# keys it promoted from NVMe, misses the rest.


async def test_stats_hits_nvme_hits_and_misses(tmp_path: Path) -> None:
    t = _tensors()
    layout = _layout(t)
    k = _key("h", 1)
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store([kvtier.Chunk(k, [0, 1])])
        await engine.flush()
    async with kvtier.TransferEngine(layout, config) as engine:
        res = await engine.load([kvtier.Chunk(k, [10, 11]), kvtier.Chunk(_key("nope", 1), [12])])
        assert res.loaded == (k,)
        s = engine.stats()
        assert (s.hits, s.nvme_hits, s.misses) == (0, 1, 1)
        assert (await engine.load([kvtier.Chunk(k, [13])])).loaded == (k,)
        s = engine.stats()
        assert (s.hits, s.nvme_hits, s.misses) == (1, 1, 1)


# DESIGN "differs": stats() after close keeps the NVMe tier's counters as they
# were at close (nvme is None only without an NVMe tier).


async def test_stats_after_close_keep_the_nvme_counters(tmp_path: Path) -> None:
    t = _tensors()
    layout = _layout(t)
    engine = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path)))
    await engine.start()
    await engine.store([kvtier.Chunk(_key(i, 0), [i]) for i in range(3)])
    await engine.flush()
    at_close = engine.stats().nvme
    assert at_close is not None
    assert at_close["rows_resident"] == 3
    await engine.aclose()
    after = engine.stats().nvme
    assert after is not None
    assert after["rows_resident"] == 3
    assert after["write_bytes"] == at_close["write_bytes"] > 0
    plain = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, BPC))
    await plain.start()
    assert plain.stats().nvme is None
    await plain.aclose()
    assert plain.stats().nvme is None


# --------------------------------------------------------------------------
# README "Using it": each group's first segment file (a growth step: up to 128
# MiB, at most capacity_bytes / (4 * groups)) is created right after start;
# NVMeConfig(grow_ahead=False): only when a write needs a row.


def _segments(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*.kvrows")}


async def test_first_segment_per_group_right_after_start(tmp_path: Path) -> None:
    layout = _layout(_tensors())
    cap = 2 << 20
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path / "ahead", capacity_bytes=cap))
    async with kvtier.TransferEngine(layout, config):
        for _ in range(500):
            segs = _segments(tmp_path / "ahead")
            if len(segs) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(Path(p).parent.name for p in segs) == ["g0", "g1"]
        for size in segs.values():
            assert 4096 < size <= 4096 + cap // (4 * 2)
    lazy = kvtier.EngineConfig(
        1 << 20, BPC, nvme=_nvme(tmp_path / "lazy", capacity_bytes=cap, grow_ahead=False)
    )
    async with kvtier.TransferEngine(layout, lazy) as engine:
        await asyncio.sleep(0.2)
        assert _segments(tmp_path / "lazy") == {}
        await engine.store([kvtier.Chunk(_key("g1", 1), [0])])
        await engine.flush()
        assert sorted(Path(p).parent.name for p in _segments(tmp_path / "lazy")) == ["g1"]


# README "Using it" example comment: "right after start(), each group's first
# segment file is allocated (here 2 x 128 MiB of disk)" for the example's
# config (capacity_bytes=8 GiB, two groups).


async def test_readme_example_allocates_two_128mib_segments(tmp_path: Path) -> None:
    ts = [torch.zeros(64, 2, 16, 1, 256, dtype=torch.bfloat16) for _ in range(4)]
    layout = kvtier.KVLayout.from_tensors(
        groups={0: {"layers.0.attn": ts[0], "layers.2.attn": ts[2]}, 1: {"l1": ts[1], "l3": ts[3]}},
        block_dim=0,
        tokens_per_block=16,
    )
    config = kvtier.EngineConfig(
        cpu_bytes=1 << 20,
        blocks_per_chunk=4,
        nvme=kvtier.NVMeConfig(
            root=str(tmp_path), capacity_bytes=8 << 30, namespace="gemma-3-270m/rank0"
        ),
    )
    async with kvtier.TransferEngine(layout, config):
        for _ in range(1000):
            segs = _segments(tmp_path)
            if len(segs) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(segs) == 2
        for p in tmp_path.rglob("*.kvrows"):
            st = p.stat()
            assert 127 << 20 <= st.st_size <= (128 << 20) + 4096
            assert st.st_blocks * 512 >= 127 << 20  # allocated, not sparse


# --------------------------------------------------------------------------
# DESIGN "differs": KVLayout.describe() leaves out num_blocks: resizing the GPU
# cache does not change the bytes of a row, so NVMe rows stay reusable.


async def test_resizing_the_gpu_cache_keeps_nvme_rows(tmp_path: Path) -> None:
    small = _tensors(16)
    k = _key("resize", 0)
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    async with kvtier.TransferEngine(_layout(small), config) as engine:
        await engine.store([kvtier.Chunk(k, [4, 5, 6, 7])])
        await engine.flush()
    big = {n: torch.zeros((64, *v.shape[1:]), dtype=v.dtype) for n, v in small.items()}
    async with kvtier.TransferEngine(_layout(big), config) as engine:
        assert engine.lookup([k]) == [kvtier.Residency.NVME]
        assert (await engine.load([kvtier.Chunk(k, [60, 61, 62, 63])])).loaded == (k,)
    assert _bytes(big["a"], [60, 61, 62, 63]) == _bytes(small["a"], [4, 5, 6, 7])
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1


# --------------------------------------------------------------------------
# README Guarantees / GUARANTEES.md 7: one engine per namespace and format; the
# second engine's NamespaceLockedError names the namespace, the root and the
# holder's pid; an engine with another layout gets another directory of the
# same root (and so runs next to the first).


async def test_one_engine_per_namespace_and_format(tmp_path: Path) -> None:
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path, namespace="ns/rank0"))
    async with kvtier.TransferEngine(_layout(_tensors()), config) as first:
        second = kvtier.TransferEngine(_layout(_tensors()), config)
        with pytest.raises(errors.NamespaceLockedError) as info:
            await second.start()
        msg = str(info.value)
        assert "ns/rank0" in msg
        assert str(tmp_path) in msg
        assert "in this process" in msg
        other = {"a": torch.zeros(32, 2, 128, dtype=torch.float16), "b": _tensors()["b"]}
        async with kvtier.TransferEngine(_layout(other), config):
            dirs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
            assert len(dirs) == 2
            assert all(d.startswith("ns_rank0-") for d in dirs)
        assert first.lookup([_key("x", 0)]) == [kvtier.Residency.MISS]  # unaffected


_HOLDER = """
import sys, torch, asyncio, kvtier
a = torch.zeros(32, 2, 256, dtype=torch.float16)
b = torch.zeros(32, 512, dtype=torch.uint8)
layout = kvtier.KVLayout.from_tensors({0: {"a": a}, 1: {"b": b}})
nvme = kvtier.NVMeConfig(root=sys.argv[1], capacity_bytes=16 << 20, namespace="ns/rank0")
async def main():
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4, nvme=nvme)):
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
asyncio.run(main())
"""


def test_namespace_held_by_another_process_names_its_pid(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            assert child.stdout.readline().strip() == "ready"
            config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path, namespace="ns/rank0"))
            engine = kvtier.BackgroundEngine(_layout(_tensors()), config)
            with pytest.raises(errors.NamespaceLockedError) as info:
                engine.start()
            msg = str(info.value)
            assert "ns/rank0" in msg
            assert str(tmp_path) in msg
            assert f"pid {child.pid}" in msg
        finally:
            child.stdin.write("\n")
            child.stdin.flush()
        assert child.wait(60) == 0


# --------------------------------------------------------------------------
# README "Using it" (BackgroundEngine): store, load, prefetch and flush return
# concurrent.futures.Future; a done callback runs on the engine thread, where
# lookup, prefix_hits, stored_range and stats work while cancel and close raise.


def test_background_engine_futures_and_done_callbacks(tmp_path: Path) -> None:
    t = _tensors()
    k = _key("bg", 0)
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    seen: dict[str, Any] = {}
    done = threading.Event()
    with kvtier.BackgroundEngine(_layout(t), config) as engine:

        def callback(fut: concurrent.futures.Future[Any]) -> None:
            try:
                seen["thread"] = threading.current_thread() is not threading.main_thread()
                seen["lookup"] = engine.lookup([k])
                seen["prefix"] = engine.prefix_hits([k])
                seen["range"] = engine.stored_range(k)
                seen["stats"] = engine.stats().slots_resident + engine.stats().slots_pinned
                for name, call in (("cancel", lambda: engine.cancel(fut)), ("close", engine.close)):
                    try:
                        call()
                    except errors.InvalidArgumentError:
                        seen[name] = "raised"
            finally:
                done.set()

        fut = engine.store([kvtier.Chunk(k, [0, 1, 2, 3])])
        assert isinstance(fut, concurrent.futures.Future)
        fut.add_done_callback(callback)
        assert done.wait(30)
        assert seen == {
            "thread": True,
            "lookup": [kvtier.Residency.CPU],
            "prefix": 1,
            "range": (0, 4),
            "stats": 1,
            "cancel": "raised",
            "close": "raised",
        }
        for f in (
            engine.flush(),
            engine.prefetch([k]),
            engine.load([kvtier.Chunk(k, [8, 9, 10, 11])]),
        ):
            assert isinstance(f, concurrent.futures.Future)
            f.result(30)
        assert engine.cancel(f) is False  # a finished Future: False at once
    assert _bytes(t["a"], [8, 9, 10, 11]) == _bytes(t["a"], [0, 1, 2, 3])


# --------------------------------------------------------------------------
# README "Using it" (NVMe tier): a write into a full tier evicts the least
# recently used key of its own group when that key is among the 32 least
# recently used evictable keys (at most 1/32 of the tier's keys, so a tier of
# fewer than 64 keys is strict LRU); stats().nvme["window_evictions"] counts
# the evictions that skipped an older key of another group.


def _equal_layout() -> kvtier.KVLayout:
    return kvtier.KVLayout.from_tensors(
        {
            0: {"x": torch.zeros(8, 1024, dtype=torch.uint8)},
            1: {"y": torch.zeros(8, 1024, dtype=torch.uint8)},
        }
    )


@pytest.mark.parametrize("rows", [63, 64])
async def test_eviction_window_is_strict_lru_below_64_keys(tmp_path: Path, rows: int) -> None:
    layout = _equal_layout()
    row = layout.slot_nbytes(BPC)  # equal groups: row == slot == 8 KiB
    config = kvtier.EngineConfig(
        2 * rows * row, BPC, nvme=_nvme(tmp_path, capacity_bytes=rows * row)
    )
    async with kvtier.TransferEngine(layout, config) as engine:
        oldest_other = _key("other", 1)
        await engine.store([kvtier.Chunk(oldest_other, [0])])
        await engine.flush()
        own = [_key(f"own{i}", 0) for i in range(rows - 1)]
        for k in own:  # one write batch each: published in this order
            await engine.store([kvtier.Chunk(k, [0])])
        await engine.flush()
        nv = engine.stats().nvme
        assert nv["rows_resident"] == rows
        assert nv["evictions"] == 0
        await engine.store([kvtier.Chunk(_key("new", 0), [1])], durable=True)
        nv = engine.stats().nvme
        assert nv["evictions"] == 1
        on_nvme = engine._nvme.contains
        if rows < 64:  # strict LRU: the oldest key, of the other group
            assert not on_nvme(oldest_other)
            assert on_nvme(own[0])
            assert nv["window_evictions"] == 0
        else:  # window of 2: the writer's own group's oldest key
            assert on_nvme(oldest_other)
            assert not on_nvme(own[0])
            assert nv["window_evictions"] == 1


# --------------------------------------------------------------------------
# README "Using it": aclose(hard=True) drops rows not yet written; flushes and
# durable stores waiting for them raise NotDurableError.


async def test_hard_close_drops_unwritten_rows_and_waiters_raise(tmp_path: Path) -> None:
    t = _tensors()
    layout = _layout(t)
    hold = KeyFault("write", "block")
    config = kvtier.EngineConfig(
        1 << 20, BPC, nvme=_nvme(tmp_path, row_io_wrapper=Wrapper(hold), io_threads=1)
    )
    engine = kvtier.TransferEngine(layout, config)
    await engine.start()
    keys = [_key(f"hc{i}", i % 2) for i in range(40)]
    try:
        # a held first batch, then rows queued behind it
        await engine.store([kvtier.Chunk(keys[0], [0])])
        await asyncio.sleep(0.05)
        for i, k in enumerate(keys[1:], 1):
            await engine.store([kvtier.Chunk(k, [i % 32])])
        flush = asyncio.ensure_future(engine.flush())
        durable = asyncio.ensure_future(
            engine.store([kvtier.Chunk(_key("d", 0), [5])], durable=True)
        )
        await asyncio.sleep(0.05)
        assert not flush.done()
        assert not durable.done()
        closing = asyncio.ensure_future(engine.aclose(hard=True))
        await asyncio.sleep(0.05)
        hold.gate.set()
        await asyncio.wait_for(closing, 30)
        for fut in (flush, durable):
            with pytest.raises(errors.NotDurableError) as info:
                await fut
            assert any(e.kind == "dropped" for e in info.value.failed.values())
    finally:
        hold.gate.set()
        await engine.aclose()
    async with kvtier.TransferEngine(
        layout, kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    ) as reopened:
        missing = [k for k, r in zip(keys, reopened.lookup(keys), strict=True) if r is not r.NVME]
        assert missing  # the dropped rows were never written


# --------------------------------------------------------------------------
# README "Using it": prefix_hits counts the leading keys of a request's chain
# that a load can serve.


async def test_prefix_hits_counts_only_the_leading_keys() -> None:
    async with kvtier.TransferEngine(
        _layout(_tensors()), kvtier.EngineConfig(1 << 20, BPC)
    ) as engine:
        chain = [_key(f"c{i}", 0) for i in range(5)]
        await engine.store([kvtier.Chunk(k, [i]) for i, k in enumerate(chain) if i != 2])
        assert engine.prefix_hits(chain) == 2
        assert engine.prefix_hits(chain[3:]) == 2
        assert engine.prefix_hits([]) == 0
        assert engine.prefix_hits(iter(chain[:2])) == 2


# --------------------------------------------------------------------------
# README "Using it" (prefetch): for the eviction policy a prefetch is a hint,
# not a use: under arc a prefetched key counts as used once its load comes, as
# a cold load does. DESIGN 3: a prefetch refreshes a resident key.


async def test_arc_prefetch_is_a_hint_and_its_load_the_first_use(tmp_path: Path) -> None:
    t = _tensors()
    layout = _layout(t)
    pre, cold = _key("pre", 0), _key("cold", 0)
    nvme = _nvme(tmp_path)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, BPC, nvme=nvme)) as e:
        await e.store([kvtier.Chunk(pre, [0]), kvtier.Chunk(cold, [1])], durable=True)
    config = kvtier.EngineConfig(1 << 20, BPC, eviction="arc", nvme=nvme)
    async with kvtier.TransferEngine(layout, config) as engine:
        arc = engine._pool.policy
        assert (await engine.prefetch([pre])).promoted == (pre,)
        assert pre in arc.t1
        assert pre not in arc.t2
        assert (await engine.prefetch([pre])).resident == (pre,)  # refreshed, not used
        assert pre in arc.t1
        assert pre not in arc.t2
        assert (await engine.load([kvtier.Chunk(pre, [10])])).loaded == (pre,)
        assert (await engine.load([kvtier.Chunk(cold, [11])])).loaded == (cold,)
        # the first load of each is its first use: both still in T1
        assert {pre, cold} <= set(arc.t1)
        assert not {pre, cold} & set(arc.t2)
        await engine.load([kvtier.Chunk(pre, [10]), kvtier.Chunk(cold, [11])])
        assert {pre, cold} <= set(arc.t2)  # the second use


# --------------------------------------------------------------------------
# DESIGN 6: store returns when the GPU->CPU copies are complete (the GPU
# blocks may be reused). DESIGN 4: all stores submitted in the same event-loop
# iteration are coalesced into one job (bounded by max_batch_chunks).


async def test_store_returns_after_its_copy_and_same_iteration_stores_coalesce() -> None:
    t = _tensors()
    layout = _layout(t)
    keys = [_key(f"co{i}", 0) for i in range(4)]
    want = [_bytes(t["a"], [i]) for i in range(4)]
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, BPC)) as engine:
        results = await asyncio.gather(
            *(engine.store([kvtier.Chunk(k, [i])]) for i, k in enumerate(keys[:3]))
        )
        assert [r.stored for r in results] == [(k,) for k in keys[:3]]
        t["a"][0:3] = 0  # reuse the GPU blocks at once
        assert engine.stats().store_jobs == 1
        res = await engine.load([kvtier.Chunk(k, [10 + i]) for i, k in enumerate(keys[:3])])
        assert len(res.loaded) == 3
        assert [_bytes(t["a"], [10 + i]) for i in range(3)] == want[:3]
    capped = kvtier.EngineConfig(1 << 20, BPC, max_batch_chunks=2)
    async with kvtier.TransferEngine(_layout(_tensors()), capped) as engine:
        await asyncio.gather(*(engine.store([kvtier.Chunk(k, [i])]) for i, k in enumerate(keys)))
        assert engine.stats().store_jobs == 2


# --------------------------------------------------------------------------
# README "Using it" (NVMe tier): eviction_window=1 is strict LRU everywhere; a
# row freed for another group is blanked, so an evicted key does not come back
# after a restart.


async def test_window_one_is_strict_and_evicted_keys_do_not_come_back(tmp_path: Path) -> None:
    layout = _equal_layout()
    row = layout.slot_nbytes(BPC)
    rows = 64
    nvme = _nvme(tmp_path, capacity_bytes=rows * row, eviction_window=1)
    config = kvtier.EngineConfig(2 * rows * row, BPC, nvme=nvme)
    oldest_other = _key("other", 1)
    own = [_key(f"own{i}", 0) for i in range(rows - 1)]
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store([kvtier.Chunk(oldest_other, [0])])
        await engine.flush()
        for k in own:
            await engine.store([kvtier.Chunk(k, [0])])
        await engine.store([kvtier.Chunk(_key("new", 0), [1])], durable=True)
        nv = engine.stats().nvme
        assert nv["evictions"] == 1
        assert nv["window_evictions"] == 0
    async with kvtier.TransferEngine(layout, config) as engine:
        assert engine.lookup([oldest_other]) == [kvtier.Residency.MISS]
        assert engine.lookup(own) == [kvtier.Residency.NVME] * len(own)
        assert engine.stats().nvme["rows_resident"] == rows


# --------------------------------------------------------------------------
# GUARANTEES.md 5: unusable configuration (an NVMe root that is a file, an
# NVMe capacity below one row) raises ConfigError or BudgetError and creates
# nothing.


async def test_unusable_nvme_config_raises_and_creates_nothing(tmp_path: Path) -> None:
    layout = _layout(_tensors())
    root = tmp_path / "fresh"
    tiny = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(root, capacity_bytes=4096))
    with pytest.raises(errors.ConfigError):
        async with kvtier.TransferEngine(layout, tiny):
            pass
    assert not root.exists()
    afile = tmp_path / "a-file"
    afile.write_bytes(b"x")
    bad = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(afile))
    with pytest.raises(errors.ConfigError):
        async with kvtier.TransferEngine(layout, bad):
            pass
    assert afile.read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


# --------------------------------------------------------------------------
# DESIGN 5: <root>/<namespace>-<digest16>/ holds format.json and one folder
# g<group_id>/ of <n>.kvrows per group; a 4096-byte header with magic
# KVTROWS\0; rows at 4096 + i * row_nbytes, row_nbytes = round_up(group_nbytes,
# 4096) + 4096 (a small group does not pay for the largest); the trailer is the
# last 4 KiB of a row and names the block hash.


async def test_on_disk_layout_matches_the_design(tmp_path: Path) -> None:
    big = torch.empty(16, 3072, dtype=torch.uint8)
    small = torch.empty(16, 512, dtype=torch.uint8)
    _fill(big, 3)
    _fill(small, 4)
    layout = kvtier.KVLayout.from_tensors({0: {"big": big}, 2: {"small": small}})
    k0, k2 = _key("disk0", 0), _key("disk2", 2)
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path, namespace="m/r0"))
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store([kvtier.Chunk(k0, [0, 1, 2, 3]), kvtier.Chunk(k2, [4])], durable=True)
    (ns,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert ns.name.startswith("m_r0-")
    assert len(ns.name) == len("m_r0-") + 16
    int(ns.name[-16:], 16)
    fmt = json.loads((ns / "format.json").read_text())
    rows = {int(g): n for g, n in fmt["row_nbytes"].items()}
    assert rows == {0: 3 * 4096 + 4096, 2: 4096 + 4096}
    assert sorted(p.name for p in ns.iterdir() if p.is_dir()) == ["g0", "g2"]
    for g, k in ((0, k0), (2, k2)):
        segs = sorted((ns / f"g{g}").iterdir())
        assert next(p.name for p in segs) == "0.kvrows"
        data = segs[0].read_bytes()
        assert data[:8] == b"KVTROWS\0"
        assert (len(data) - 4096) % rows[g] == 0
        trailers = [
            data[4096 + (i + 1) * rows[g] - 4096 : 4096 + (i + 1) * rows[g]]
            for i in range((len(data) - 4096) // rows[g])
        ]
        assert [i for i, tr in enumerate(trailers) if k.block_hash in tr] == [0]
    payload = (ns / "g0" / "0.kvrows").read_bytes()[4096 : 4096 + 3 * 4096]
    assert payload[: 4 * 3072] == big[0:4].numpy().tobytes()


# --------------------------------------------------------------------------
# README "Using it" (NVMe tier): row blocks stay within capacity_bytes plus one
# growth step per group where the filesystem punches holes, also when the
# workload moves from group to group.


async def test_row_blocks_stay_within_capacity_plus_one_step_per_group(tmp_path: Path) -> None:
    groups = {g: {f"l{g}": torch.zeros(64, 1024 * (g + 1), dtype=torch.uint8)} for g in range(3)}
    layout = kvtier.KVLayout.from_tensors(groups)
    cap = 1 << 20
    step = cap // (4 * 3)
    config = kvtier.EngineConfig(4 << 20, BPC, nvme=_nvme(tmp_path, capacity_bytes=cap))
    worst = 0
    async with kvtier.TransferEngine(layout, config) as engine:
        n = 0
        for phase in (0, 1, 2, 0, 2, 1):
            for i in range(60):
                await engine.store([kvtier.Chunk(_key(f"d{n}", phase), [i])])
                n += 1
                if i % 10 == 9:
                    await engine.flush()
            await engine.flush()
            assert engine.stats().nvme["bytes_used"] <= cap
            segs = list(tmp_path.rglob("*.kvrows"))
            blocks = sum(p.stat().st_blocks * 512 for p in segs) - 4096 * len(segs)  # headers
            worst = max(worst, blocks)
    # slack: ext4's extent-tree block per file that held more than four extents
    assert worst <= cap + 3 * step + 4096 * len(segs), (worst, cap + 3 * step)


# --------------------------------------------------------------------------
# README command-line table: `kvtier inspect ROOT` names the live engine
# holding a namespace; `kvtier remove ROOT NAME` refuses while a live engine
# holds it, and deletes it once closed.


async def test_inspect_and_remove_with_a_live_engine(tmp_path: Path) -> None:
    runner = CliRunner()
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    async with kvtier.TransferEngine(_layout(_tensors()), config) as engine:
        await engine.store([kvtier.Chunk(_key("live", 0), [0])], durable=True)
        out = runner.invoke(cli_main, ["inspect", str(tmp_path), "--json"])
        assert out.exit_code == 0, out.output
        (ns,) = json.loads(out.output)["namespaces"]
        assert ns["locked_by_pid"] == os.getpid()
        assert ns["groups"]["0"]["valid_rows"] == 1
        name = Path(ns["directory"]).name
        refused = runner.invoke(cli_main, ["remove", str(tmp_path), name, "--yes"])
        assert refused.exit_code == 1
        assert (tmp_path / name).is_dir()
        assert engine.lookup([_key("live", 0)]) == [kvtier.Residency.CPU]
    removed = runner.invoke(cli_main, ["remove", str(tmp_path), name, "--yes"])
    assert removed.exit_code == 0, removed.output
    assert not (tmp_path / name).exists()


# --------------------------------------------------------------------------
# README "Using it" (BackgroundEngine) and DESIGN "differs": close raises the
# StorageError of a failed final fdatasync, as aclose does (after every
# resource is freed: the namespace can be opened again).


@pytest.mark.parametrize("kind", ["aclose", "background"])
async def test_close_raises_the_storage_error_of_a_failed_final_fdatasync(
    tmp_path: Path, kind: str
) -> None:
    layout = _layout(_tensors())
    wrapper = Wrapper()
    # grow_ahead=False and a first durable store: the segment exists before the
    # fault is armed, so no segment creation (which also syncs) can take it
    nvme = _nvme(tmp_path, row_io_wrapper=wrapper, grow_ahead=False)
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=nvme)
    first, k = _key("first", 0), _key("sync", 0)
    if kind == "aclose":
        engine = kvtier.TransferEngine(layout, config)
        await engine.start()
        await engine.store([kvtier.Chunk(first, [1])], durable=True)
        await engine.store([kvtier.Chunk(k, [0])])
        wrapper.faults.append(KeyFault("fdatasync", "errno"))
        with pytest.raises(errors.StorageError):
            await engine.aclose()
    else:
        bg = kvtier.BackgroundEngine(layout, config).start()
        bg.store([kvtier.Chunk(first, [1])], durable=True).result(30)
        bg.store([kvtier.Chunk(k, [0])]).result(30)
        wrapper.faults.append(KeyFault("fdatasync", "errno"))
        with pytest.raises(errors.StorageError):
            await asyncio.get_running_loop().run_in_executor(None, bg.close)
    assert wrapper.faults[0].hits >= 1
    plain = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    async with kvtier.TransferEngine(layout, plain) as again:  # the lock was released
        assert again.lookup([k]) in ([kvtier.Residency.MISS], [kvtier.Residency.NVME])


# --------------------------------------------------------------------------
# DESIGN 2: two names in ONE group that view identical bytes are copied once
# and share one slot region; DESIGN 1: an excluded group keeps its index.


async def test_aliased_names_are_copied_once_and_excluded_groups_keep_their_index() -> None:
    x = torch.empty(16, 1024, dtype=torch.uint8)
    _fill(x, 9)
    y = torch.empty(16, 1024, dtype=torch.uint8)
    _fill(y, 10)
    layout = kvtier.KVLayout.from_tensors({0: {"x": x, "x_again": x}, 2: {"y": y}})
    assert layout.group_nbytes(0, BPC) == BPC * 1024
    assert list(layout.group_ids) == [0, 2]
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, BPC)) as engine:
        k = _key("alias", 0)
        res = await engine.store([kvtier.Chunk(k, [0, 1])])
        assert res.stored == (k,)
        assert engine.stats().store_bytes == 2 * 1024
        with pytest.raises(errors.UnknownGroupError):
            engine.lookup([_key("g1", 1)])
        x[8:10] = 0
        assert (await engine.load([kvtier.Chunk(k, [8, 9])])).loaded == (k,)
        assert torch.equal(x[8:10], x[0:2])


# --------------------------------------------------------------------------
# README command-line section: the built-in layouts.


def test_builtin_layouts_have_the_documented_groups() -> None:
    from kvtier._shapes import model_shape

    def kinds(name: str) -> list[tuple[str, int]]:
        shape = model_shape(name, 16)
        out = []
        for idx in shape.groups():
            (kind,) = {shape.layers[i].kind for i in idx}
            out.append((kind, len(idx)))
        return out

    assert sorted(kinds("gemma-3-270m")) == [("full", 3)] + [("sliding", 3)] * 5
    assert kinds("llama-3-8b") == [("full", 32)]
    v3 = model_shape("deepseek-v3", 16)
    assert kinds("deepseek-v3") == [("mla", 61)]
    assert v3.dtype == torch.bfloat16
    v32 = model_shape("deepseek-v3.2", 64)
    assert [n for _, n in kinds("deepseek-v3.2")] == [61, 61]
    per_token = sorted({lay.page_shape[1] for lay in v32.layers})
    assert per_token == [132, 656]
    assert v32.dtype.itemsize == 1
    assert sorted(kinds("qwen3-next")) == [("full", 12)] + [("linear", 12)] * 3


# README, after the command-line table: for `kvtier bench --layout FILE.json`,
# "layers of one kind share KV cache groups, split to equal layer counts as
# vLLM does". vLLM's rule (_get_kv_cache_groups_uniform_page_size): group size
# = the smallest layer count, or the largest when below 1.25x the smallest; a
# kind of n layers makes ceil(n / size) groups taking its layers in turn, not
# groups by the gcd of the counts (13 full + 12 sliding layers would make 25
# groups of one layer). The expected groups below are worked out by hand from
# vLLM's rule.


@pytest.mark.parametrize(
    ("full", "sliding", "expected"),
    [
        # size 13 (13 < 1.25 * 12): one group per kind.
        (13, 12, [list(range(13)), list(range(13, 25))]),
        # size 4: the six sliding layers (4..9) in two interleaved groups of 3.
        (4, 6, [[0, 1, 2, 3], [4, 6, 8], [5, 7, 9]]),
        # size 2: the six sliding layers (2..7) in three interleaved groups of 2.
        (2, 6, [[0, 1], [2, 5], [3, 6], [4, 7]]),
    ],
)
def test_json_layout_is_grouped_as_vllm_groups(
    tmp_path: Path, full: int, sliding: int, expected: list[list[int]]
) -> None:
    from kvtier._shapes import model_shape

    layers = [{"kind": "full", "page_shape": [2, 16, 1, 64]}] * full
    layers += [{"kind": "sliding", "page_shape": [2, 16, 1, 64]}] * sliding
    path = tmp_path / "layout.json"
    path.write_text(json.dumps({"name": "m", "dtype": "bfloat16", "layers": layers}))
    shape = model_shape(str(path), 16)
    assert shape.groups() == expected
    layout = shape.build(4)
    assert [len(layout.group(g).layers) for g in layout.group_ids] == [len(e) for e in expected]


# --------------------------------------------------------------------------
# README command-line table: `kvtier remove` asks first unless --yes.


def test_remove_asks_first_unless_yes(tmp_path: Path) -> None:
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))

    async def make() -> None:
        async with kvtier.TransferEngine(_layout(_tensors()), config) as engine:
            await engine.store([kvtier.Chunk(_key("r", 0), [0])], durable=True)

    asyncio.run(make())
    (ns,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    runner = CliRunner()
    no = runner.invoke(cli_main, ["remove", str(tmp_path), ns.name], input="n\n")
    assert no.exit_code == 1
    assert "Delete" in no.output
    assert ns.is_dir()
    yes = runner.invoke(cli_main, ["remove", str(tmp_path), ns.name], input="y\n")
    assert yes.exit_code == 0, yes.output
    assert not ns.exists()


# --------------------------------------------------------------------------
# DESIGN 6: a closed (or not started) engine raises EngineClosedError; DESIGN
# "differs": aclose(hard=True) once the engine is closed does nothing; stats()
# still answers.


async def test_closed_engine_refuses_every_call() -> None:
    engine = kvtier.TransferEngine(_layout(_tensors()), kvtier.EngineConfig(1 << 20, BPC))
    k = _key("closed", 0)
    for state in ("new", "closed"):
        if state == "closed":
            await engine.start()
            await engine.store([kvtier.Chunk(k, [0])])
            await engine.aclose()
        for call in (
            lambda: engine.store([kvtier.Chunk(k, [0])]),
            lambda: engine.load([kvtier.Chunk(k, [1])]),
            lambda: engine.prefetch([k]),
            engine.flush,
            lambda: engine.lookup([k]),
            lambda: engine.prefix_hits([k]),
            lambda: engine.stored_range(k),
        ):
            with pytest.raises(errors.EngineClosedError):
                await _call(call)
    assert await engine.aclose(hard=True) is None
    assert isinstance(engine.stats(), kvtier.EngineStats)


# GUARANTEES.md 4: stats().nvme counts failures_<kind> for eio, enospc, einval,
# short_read, short_write, checksum, trailer, capacity, missing and other.


async def test_nvme_stats_count_every_documented_failure_kind(tmp_path: Path) -> None:
    config = kvtier.EngineConfig(1 << 20, BPC, nvme=_nvme(tmp_path))
    async with kvtier.TransferEngine(_layout(_tensors()), config) as engine:
        nv = engine.stats().nvme
        kinds = "eio enospc einval short_read short_write checksum trailer capacity missing other"
        for kind in kinds.split():
            assert nv[f"failures_{kind}"] == 0, kind
