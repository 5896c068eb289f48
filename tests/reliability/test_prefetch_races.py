"""``TransferEngine.prefetch`` / ``BackgroundEngine.prefetch`` under races and faults.

Races with loads, stores, other prefetches and ``aclose``; cancellation; read
faults injected through a RowIO wrapper; a CPU tier too small; partial chunks;
keys leaving NVMe between the call and its read; many keys; bad input. Every
test checks that no wrong byte reaches a later load and that ``stats()`` stays
consistent (nothing left pinned or writing, promotions counted once).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier.errors import (
    DuplicateKeyError,
    EngineClosedError,
    KeyNotResidentError,
    KVTierError,
    NotDurableError,
    NotStoredError,
    StorageError,
)
from kvtier.io._aio import aio_supported
from kvtier.io._rowio import probe_direct_io

from ..engine.helpers import after_iterations, fill_random, key, same
from ._faultio import KeyFault, Wrapper

BPC = 2
BLOCK = 8192  # payload bytes of one GPU block (uint8 rows)
ROW = BPC * BLOCK + 4096  # one NVMe row: payload + trailer


# ---------------------------------------------------------------- fixtures


@dataclass
class Gpu:
    """A one-group (or two-group) "GPU" KV cache of CPU tensors with known bytes."""

    nblocks: int = 64
    block: int = BLOCK
    groups: int = 1
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    before: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for g in range(self.groups):
            # group 1 (when present) has half-size blocks: another row size
            t = torch.empty((self.nblocks, self.block >> g), dtype=torch.uint8)
            fill_random(t, 100 + g)
            self.tensors[g] = t
            self.before[g] = t.clone()
        self.layout = kvtier.KVLayout.from_tensors(
            {g: {f"l{g}": t} for g, t in self.tensors.items()}
        )

    def chunk(self, i: int, g: int = 0, tag: str = "k") -> kvtier.Chunk:
        return kvtier.Chunk(key(f"{tag}{i}", g), [2 * i, 2 * i + 1])

    def scribble(self, value: int = 0xAB) -> None:
        for t in self.tensors.values():
            t.fill_(value)

    def holds(self, c: kvtier.Chunk, src: kvtier.Chunk | None = None) -> bool:
        """The blocks of ``c`` hold the original bytes of ``src`` (default ``c``)."""
        g = c.key.group_id
        src = src or c
        return same(self.tensors[g][list(c.block_ids)], self.before[g][list(src.block_ids)])

    def untouched(self, c: kvtier.Chunk, value: int = 0xAB) -> bool:
        g = c.key.group_id
        return int((self.tensors[g][list(c.block_ids)] != value).count_nonzero()) == 0


def config(
    gpu: Gpu,
    root: Path,
    slots: int = 16,
    *,
    wrapper: object = None,
    capacity: int = 16 << 20,
    request_nbytes: int = 4 << 20,
    write_through: bool = True,
    eviction: str = "lru",
    segment_nbytes: int = 4 << 20,
    io_backend: str = "auto",
) -> kvtier.EngineConfig:
    nv = kvtier.NVMeConfig(
        root=root,
        io_backend=io_backend,
        capacity_bytes=capacity,
        namespace="prefetch-races",
        segment_nbytes=segment_nbytes,
        request_nbytes=request_nbytes,
        row_io_wrapper=wrapper,  # type: ignore[arg-type]
    )
    return kvtier.EngineConfig(
        slots * gpu.layout.slot_nbytes(BPC),
        BPC,
        nvme=nv,
        write_through=write_through,
        eviction=eviction,
    )


async def on_nvme(gpu: Gpu, root: Path, chunks: list[kvtier.Chunk], **kw: object) -> None:
    """Store ``chunks`` durably and close: a new engine finds them on NVMe only.

    Stored in one call, reversed: a call's rows are queued tail first, so the
    rows then lie in the order of ``chunks`` (row ``i`` holds ``chunks[i]``)
    and ``chunks[0]`` is the least recently used.
    """
    cfg = config(gpu, root, max(16, len(chunks)), **kw)  # type: ignore[arg-type]
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        res = await engine.store(chunks[::-1], durable=True)
        assert len(res.stored) == len(chunks)


def keys_of(chunks: list[kvtier.Chunk]) -> list[kvtier.OffloadKey]:
    return [c.key for c in chunks]


def settled(stats: kvtier.EngineStats) -> None:
    """Nothing pinned or half-written is left behind."""
    assert stats.slots_pinned == 0, stats
    assert stats.slots_writing == 0, stats
    assert stats.slots_free + stats.slots_resident == stats.num_slots, stats
    assert sum(stats.keys_per_group.values()) == stats.slots_resident, stats


def partition(res: kvtier.PrefetchResult, keys: list[kvtier.OffloadKey]) -> None:
    """Every key of the call is in exactly one of promoted / resident / failed."""
    buckets = [*res.promoted, *res.resident, *res.failed]
    assert sorted(buckets, key=repr) == sorted(keys, key=repr), res
    assert len(set(buckets)) == len(buckets), res


async def settle_loop(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def until(pred: object, limit_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not pred():  # type: ignore[operator]
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.002)


def gate_reads() -> tuple[Wrapper, KeyFault]:
    """A wrapper whose row reads all wait on the returned fault's gate."""
    block = KeyFault("read", "block")
    return Wrapper(block), block


# ---------------------------------------------------------------- races with loads and prefetches


@pytest.mark.parametrize("first", ["prefetch", "load"])
async def test_prefetch_and_load_of_the_same_keys_read_each_row_once(
    tmp_path: Path, first: str
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(6)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    wrapper, block = gate_reads()
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, wrapper=wrapper)) as eng:
        gpu.scribble()
        assert not any(gpu.holds(c) for c in chunks)  # the byte check can fail
        assert all(gpu.untouched(c) for c in chunks)
        try:
            if first == "prefetch":
                pf = asyncio.ensure_future(eng.prefetch(keys))
                await settle_loop()
                ld = asyncio.ensure_future(eng.load(chunks))
            else:
                ld = asyncio.ensure_future(eng.load(chunks))
                await settle_loop()
                pf = asyncio.ensure_future(eng.prefetch(keys))
            await settle_loop()
            assert eng.lookup(keys) == [kvtier.Residency.PENDING] * 6
        finally:
            block.gate.set()
        res, out = await pf, await ld
        partition(res, keys)
        assert set(out.loaded) == set(keys), out.failed
        assert all(gpu.holds(c) for c in chunks)
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == 6  # each row read once
        if first == "prefetch":
            assert set(res.promoted) == set(keys)
            assert (stats.hits, stats.nvme_hits) == (6, 0)
        else:
            assert set(res.resident) == set(keys)  # waited for the load's promotion
            assert (stats.hits, stats.nvme_hits) == (0, 6)
        assert stats.misses == stats.load_failures == 0
        settled(stats)
        assert stats.keys_per_group == {0: 6}


async def test_overlapping_prefetches_read_each_row_once(tmp_path: Path) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(5)]
    k = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    wrapper, block = gate_reads()
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, wrapper=wrapper)) as eng:
        try:
            p1 = asyncio.ensure_future(eng.prefetch(k[0:3]))
            p2 = asyncio.ensure_future(eng.prefetch(k[1:5]))
            p3 = asyncio.ensure_future(eng.prefetch([k[4], k[0]]))
            await settle_loop()
        finally:
            block.gate.set()
        r1, r2, r3 = await asyncio.gather(p1, p2, p3)
        partition(r1, k[0:3])
        partition(r2, k[1:5])
        partition(r3, [k[4], k[0]])
        assert set(r1.promoted) == set(k[0:3])
        assert set(r2.promoted) == {k[3], k[4]}
        assert set(r2.resident) == {k[1], k[2]}
        assert set(r3.resident) == {k[0], k[4]}
        assert not r1.failed
        assert not r2.failed
        assert not r3.failed
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == 5
        assert stats.nvme["read_bytes"] == 5 * ROW
        settled(stats)
        gpu.scribble()
        out = await eng.load(chunks)
        assert set(out.loaded) == set(k)
        assert all(gpu.holds(c) for c in chunks)
        assert eng.stats().nvme_hits == 0


async def test_store_of_the_same_keys_during_prefetch_is_skipped_and_loads_nvme_bytes(
    tmp_path: Path,
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(4)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    wrapper, block = gate_reads()
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, wrapper=wrapper)) as eng:
        try:
            pf = asyncio.ensure_future(eng.prefetch(keys))
            await settle_loop()
            gpu.scribble(0x11)  # another content under the same keys: must never be cached
            st = await eng.store(chunks)  # promotion in flight: skipped, not re-copied
            assert set(st.skipped) == set(keys)
            assert st.stored == st.rejected == ()
        finally:
            block.gate.set()
        res = await pf
        assert set(res.promoted) == set(keys)
        await eng.flush()
        gpu.scribble()
        out = await eng.load(chunks)
        assert set(out.loaded) == set(keys)
        assert all(gpu.holds(c) for c in chunks)  # the NVMe bytes, not 0x11
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["rows_written"] == 0  # nothing was written back
        settled(stats)


async def test_prefetch_of_a_fresh_store_in_flight_then_store_again(tmp_path: Path) -> None:
    gpu = Gpu()
    fresh = [gpu.chunk(i, tag="fresh") for i in range(3)]
    keys = keys_of(fresh)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as eng:
        st = asyncio.ensure_future(eng.store(fresh))
        await asyncio.sleep(0)
        assert eng.lookup(keys) == [kvtier.Residency.PENDING] * 3
        res = await eng.prefetch(keys)
        assert set(res.resident) == set(keys)
        assert res.promoted == ()
        assert res.failed == {}
        assert set((await st).stored) == set(keys)
        again = await eng.store(fresh)
        assert set(again.skipped) == set(keys)
        gpu.scribble()
        out = await eng.load(fresh)
        assert set(out.loaded) == set(keys)
        assert all(gpu.holds(c) for c in fresh)
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == 0
        await eng.flush()
        settled(eng.stats())


async def test_prefetch_of_a_store_cancelled_in_flight_is_a_miss(tmp_path: Path) -> None:
    gpu = Gpu()
    fresh = [gpu.chunk(i, tag="gone") for i in range(2)]
    keys = keys_of(fresh)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as eng:
        st = asyncio.ensure_future(eng.store(fresh))
        await asyncio.sleep(0)
        assert eng.lookup(keys) == [kvtier.Residency.PENDING] * 2
        pf = asyncio.ensure_future(eng.prefetch(keys))
        await asyncio.sleep(0)
        st.cancel()
        res = await pf
        with pytest.raises(asyncio.CancelledError):
            await st
        partition(res, keys)
        assert set(res.failed) == set(keys)
        assert all(isinstance(e, KeyNotResidentError) for e in res.failed.values())
        assert eng.lookup(keys) == [kvtier.Residency.MISS] * 2
        settled(eng.stats())
        assert eng.stats().keys_per_group == {}


async def test_failed_promotion_of_a_load_is_a_miss_for_a_waiting_prefetch(
    tmp_path: Path,
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(3)]
    bad = chunks[1]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    eio = KeyFault("read", "errno", hashes=frozenset({bad.key.block_hash}))
    block = KeyFault("read", "block")
    wrapper = Wrapper(eio, block)  # eio first: it is the fault taken for the bad row
    cfg = config(gpu, tmp_path, wrapper=wrapper, request_nbytes=4096)  # one row a request
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        gpu.scribble()
        try:
            ld = asyncio.ensure_future(eng.load(chunks))
            await settle_loop()
            pf = asyncio.ensure_future(eng.prefetch(keys))
            await settle_loop()
        finally:
            block.gate.set()
        out, res = await ld, await pf
        assert set(out.loaded) == set(keys) - {bad.key}
        assert isinstance(out.failed[bad.key], StorageError)
        assert gpu.untouched(bad)
        assert all(gpu.holds(c) for c in chunks if c is not bad)
        assert set(res.resident) == set(keys) - {bad.key}
        assert isinstance(res.failed[bad.key], KeyNotResidentError)
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotion_failures"] == 1  # counted once, by the load
        assert stats.failures == {"eio": 1}
        assert eng.lookup([bad.key]) == [kvtier.Residency.MISS]
        settled(stats)


# ---------------------------------------------------------------- cancellation


async def test_cancelled_prefetch_leaks_no_slot_and_its_keys_load_bitwise(tmp_path: Path) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(4)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    wrapper, block = gate_reads()
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, wrapper=wrapper)) as eng:
        try:
            pf = asyncio.ensure_future(eng.prefetch(keys))
            await settle_loop()
            assert eng.lookup(keys) == [kvtier.Residency.PENDING] * 4
            pf.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pf
            # the reads were started: the slots stay reserved (never reused under the I/O)
            assert eng.lookup(keys) == [kvtier.Residency.PENDING] * 4
            assert eng.stats().slots_writing == 4
        finally:
            block.gate.set()
        again = await eng.prefetch(keys)  # waits for the cancelled call's reads
        assert set(again.resident) == set(keys)
        assert again.promoted == ()
        assert again.failed == {}
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == 4
        settled(stats)
        assert stats.keys_per_group == {0: 4}
        gpu.scribble()
        out = await eng.load(chunks)
        assert set(out.loaded) == set(keys)
        assert all(gpu.holds(c) for c in chunks)


@pytest.mark.parametrize("n", range(0, 12, 2))
async def test_prefetch_cancelled_at_any_iteration_then_load(tmp_path: Path, n: int) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(4)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as eng:
        pf = asyncio.ensure_future(eng.prefetch(keys))
        after_iterations(n, pf.cancel)
        try:
            res = await pf
        except asyncio.CancelledError:
            res = None
        if res is not None:
            partition(res, keys)
            assert set(res.promoted) == set(keys)
        gpu.scribble()
        out = await eng.load(chunks)  # waits for whatever the cancelled call started
        assert set(out.loaded) == set(keys), out.failed
        assert all(gpu.holds(c) for c in chunks)
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == 4  # never read twice
        assert stats.hits + stats.nvme_hits == 4
        settled(stats)


async def test_prefetch_cancelled_while_waiting_for_a_store_still_leaves_consistent_state(
    tmp_path: Path,
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(3)]
    fresh = gpu.chunk(10, tag="fresh")
    await on_nvme(gpu, tmp_path, chunks)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as eng:
        st = asyncio.ensure_future(eng.store([fresh]))
        await asyncio.sleep(0)
        keys = [fresh.key, *keys_of(chunks)]
        pf = asyncio.ensure_future(eng.prefetch(keys))
        await asyncio.sleep(0)
        pf.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pf
        await st
        again = await eng.prefetch(keys)
        partition(again, keys)
        assert not again.failed
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == 3  # whoever read them, once each
        await eng.flush()  # the fresh key's row write pins its slot until written
        settled(eng.stats())
        gpu.scribble()
        out = await eng.load([fresh, *chunks])
        assert len(out.loaded) == 4
        assert all(gpu.holds(c) for c in [fresh, *chunks])


# ---------------------------------------------------------------- close


@pytest.mark.parametrize("hard", [False, True])
async def test_aclose_waits_for_a_prefetch_in_flight(tmp_path: Path, hard: bool) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(4)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    wrapper, block = gate_reads()
    eng = kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, wrapper=wrapper))
    await eng.start()
    try:
        fresh = gpu.chunk(20, tag="fresh")
        await eng.store([fresh])  # a row write queued too
        pf = asyncio.ensure_future(eng.prefetch(keys))
        await settle_loop()
        closing = asyncio.ensure_future(eng.aclose(hard=hard))
        await settle_loop()
        assert not closing.done()  # the reads still use slots of the region
        with pytest.raises(EngineClosedError):
            await eng.prefetch(keys)
    finally:
        block.gate.set()
    res = await pf
    await closing
    assert set(res.promoted) == set(keys)
    stats = eng.stats()
    assert stats.slots_pinned == 0
    assert stats.slots_writing == 0
    # the keys are still on NVMe for the next engine, with their bytes
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as again:
        assert again.lookup(keys) == [kvtier.Residency.NVME] * 4
        gpu.scribble()
        out = await again.load(chunks)
        assert set(out.loaded) == set(keys)
        assert all(gpu.holds(c) for c in chunks)


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8])
async def test_prefetch_racing_aclose(tmp_path: Path, hard: bool, n: int) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(4)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    eng = kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path))
    await eng.start()
    pf = asyncio.ensure_future(eng.prefetch(keys))
    closing: list[asyncio.Future[None]] = []
    after_iterations(n, lambda: closing.append(asyncio.ensure_future(eng.aclose(hard=hard))))
    try:
        res: kvtier.PrefetchResult | BaseException = await pf
    except EngineClosedError as exc:
        res = exc
    await until(lambda: bool(closing))
    await closing[0]
    await eng.aclose()
    if isinstance(res, kvtier.PrefetchResult):
        partition(res, keys)
        assert set(res.promoted) == set(keys)
    stats = eng.stats()
    assert stats.slots_pinned == 0
    assert stats.slots_writing == 0
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as again:
        assert again.lookup(keys) == [kvtier.Residency.NVME] * 4


async def test_prefetch_cancelled_before_its_reads_started_reads_nothing(tmp_path: Path) -> None:
    """The call waits for another call's promotion (reads gated); cancelled meanwhile,
    it reads none of its other keys and evicts nothing for them."""
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(3)]
    others = [gpu.chunk(i, tag="cpu-only") for i in range(4, 6)]
    await on_nvme(gpu, tmp_path, chunks)
    wrapper, block = gate_reads()
    cfg = config(gpu, tmp_path, slots=4, write_through=False, wrapper=wrapper)
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        await eng.store(others)  # CPU only (no write-through): evicting them loses them
        try:
            ld = asyncio.ensure_future(eng.load(chunks[:1]))  # its read waits at the gate
            await settle_loop()
            assert eng.lookup(keys_of(chunks)) == [
                kvtier.Residency.PENDING,
                kvtier.Residency.NVME,
                kvtier.Residency.NVME,
            ]
            pf = asyncio.ensure_future(eng.prefetch(keys_of(chunks)))
            await settle_loop()  # the call waits for the promotion in flight
            pf.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pf
        finally:
            block.gate.set()
        out = await ld
        assert out.loaded == (chunks[0].key,)
        await settle_loop(50)
        stats = eng.stats()
        assert stats.nvme is not None
        # the caller gave up before its own reads: only the load's row was read
        assert stats.nvme["promotions"] == 1
        assert eng.lookup(keys_of(others)) == [kvtier.Residency.CPU] * 2
        assert eng.lookup(keys_of(chunks[1:])) == [kvtier.Residency.NVME] * 2
        settled(stats)


# ---------------------------------------------------------------- read faults


@pytest.mark.parametrize("err", [errno.EIO, errno.EINVAL])
async def test_read_error_fails_only_its_key_and_no_wrong_bytes_later(
    tmp_path: Path, err: int
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(5)]
    bad = chunks[2]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    fault = KeyFault("read", "errno", hashes=frozenset({bad.key.block_hash}), err=err)
    cfg = config(gpu, tmp_path, wrapper=Wrapper(fault), request_nbytes=4096)  # a row a request
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        res = await eng.prefetch(keys)
        partition(res, keys)
        assert set(res.promoted) == set(keys) - {bad.key}
        exc = res.failed[bad.key]
        assert isinstance(exc, StorageError)
        kind = {errno.EIO: "eio", errno.EINVAL: "einval"}[err]
        assert exc.kind == kind
        assert eng.lookup([bad.key]) == [kvtier.Residency.MISS]  # dropped, never re-read
        stats = eng.stats()
        assert stats.nvme is not None
        assert (stats.nvme["promotions"], stats.nvme["promotion_failures"]) == (4, 1)
        assert stats.failures == {kind: 1}
        assert stats.hits == stats.misses == stats.load_failures == 0
        settled(stats)
        assert stats.keys_per_group == {0: 4}
        gpu.scribble()
        out = await eng.load(chunks)
        assert set(out.loaded) == set(keys) - {bad.key}
        assert isinstance(out.failed[bad.key], KeyNotResidentError)
        assert gpu.untouched(bad)  # the garbage the failed read left in its slot never lands
        assert all(gpu.holds(c) for c in chunks if c is not bad)
        assert fault.hits == 1
        # the key can be stored again from the GPU and then loads its own bytes
        gpu.tensors[0].copy_(gpu.before[0])
        assert (await eng.store([bad])).stored == (bad.key,)
        gpu.scribble()
        assert (await eng.load([bad])).loaded == (bad.key,)
        assert gpu.holds(bad)


async def test_short_read_in_a_coalesced_request_retries_the_rows_after_the_cut(
    tmp_path: Path,
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(5)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)  # one batch: rows 0..4 in store order
    target = chunks[2]
    # every request holding the target row is cut 100 bytes into it
    fault = KeyFault("read", "short", hashes=frozenset({target.key.block_hash}), keep=100)
    async with kvtier.TransferEngine(
        gpu.layout, config(gpu, tmp_path, wrapper=Wrapper(fault))
    ) as eng:
        res = await eng.prefetch(keys)
        partition(res, keys)
        stats = eng.stats()
        assert stats.nvme is not None
        # one coalesced preadv, then rows 2, 3 and 4 (not read in full) alone
        assert stats.nvme["read_requests"] == 1 + 3
        assert set(res.promoted) == set(keys) - {target.key}
        assert set(res.failed) == {target.key}
        err = res.failed[target.key]
        assert isinstance(err, StorageError)
        assert err.kind == "short_read"
        assert eng.lookup([target.key]) == [kvtier.Residency.MISS]
        assert stats.nvme["promotion_failures"] == 1
        assert stats.failures == {"short_read": 1}
        settled(stats)
        gpu.scribble()
        out = await eng.load(chunks)
        assert set(out.loaded) == set(keys) - {target.key}
        assert all(gpu.holds(c) for c in chunks if c is not target)
        assert gpu.untouched(target)


async def test_corrupt_trailer_and_eio_in_one_call_with_concurrent_load(tmp_path: Path) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(6)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    seg = sorted(tmp_path.rglob("*.kvrows"))[0]
    with open(seg, "r+b") as f:  # flip a payload byte of row 4 (data starts after a 4 KiB header)
        f.seek(4096 + 4 * ROW + 7)
        b = f.read(1)
        f.seek(4096 + 4 * ROW + 7)
        f.write(bytes([b[0] ^ 0x01]))
    eio = KeyFault("read", "errno", hashes=frozenset({chunks[1].key.block_hash}))
    cfg = config(gpu, tmp_path, wrapper=Wrapper(eio), request_nbytes=4096)
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        gpu.scribble()
        pf = asyncio.ensure_future(eng.prefetch(keys[:4]))
        ld = asyncio.ensure_future(eng.load(chunks[3:]))
        res, out = await pf, await ld
        partition(res, keys[:4])
        assert set(res.failed) == {keys[1]}
        assert set(out.loaded) == {keys[3], keys[5]}
        assert set(out.failed) == {keys[4]}
        assert isinstance(out.failed[keys[4]], StorageError)
        assert out.failed[keys[4]].kind == "checksum"
        assert gpu.untouched(chunks[4])
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotion_failures"] == 2
        assert stats.failures == {"eio": 1, "checksum": 1}
        assert eng.lookup([keys[1], keys[4]]) == [kvtier.Residency.MISS] * 2
        settled(stats)
        out = await eng.load([chunks[0], chunks[2]])
        assert len(out.loaded) == 2
        assert all(gpu.holds(c) for c in (chunks[0], chunks[2], chunks[3], chunks[5]))


# ---------------------------------------------------------------- CPU tier too small


@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_too_few_slots_evicts_other_keys_never_the_calls_own(
    tmp_path: Path, eviction: str
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(4)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    mine, other = gpu.chunk(10, tag="mine"), gpu.chunk(11, tag="other")
    cfg = config(gpu, tmp_path, slots=4, write_through=False, eviction=eviction)
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        await eng.store([mine])
        await eng.store([other])
        await eng.load([mine])  # ``mine`` is the most recently used, ``other`` the victim
        call = [mine.key, *keys]  # 1 resident + 4 on NVMe, 4 slots: 2 free, 1 evictable
        res = await eng.prefetch(call)
        partition(res, call)
        assert res.resident == (mine.key,)
        assert res.promoted == tuple(keys[:3])  # request order
        assert set(res.failed) == {keys[3]}
        assert type(res.failed[keys[3]]) is KVTierError
        assert eng.lookup([mine.key, other.key, keys[3]]) == [
            kvtier.Residency.CPU,
            kvtier.Residency.MISS,  # CPU only: evicted and gone
            kvtier.Residency.NVME,  # not read, not dropped
        ]
        stats = eng.stats()
        assert stats.evictions == 1
        assert stats.nvme is not None
        assert (stats.nvme["promotions"], stats.nvme["promotion_failures"]) == (3, 0)
        assert stats.failures == {}
        assert stats.rejected == 1  # keys[3]: no slot; not a failed read (still on NVMe)
        settled(stats)
        assert stats.slots_free == 0
        gpu.scribble()
        out = await eng.load([mine, *chunks[:3]])
        assert len(out.loaded) == 4
        assert all(gpu.holds(c) for c in [mine, *chunks[:3]])


async def test_every_slot_pinned_by_row_writes_rejects_without_evicting(tmp_path: Path) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(2)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    hold = KeyFault("write", "block")
    cfg = config(gpu, tmp_path, slots=3, wrapper=Wrapper(hold))
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        fresh = [gpu.chunk(i, tag="fresh") for i in range(3)]
        try:
            assert len((await eng.store(fresh)).stored) == 3
            await settle_loop()
            assert eng.stats().slots_pinned == 3  # their row writes hold them
            res = await eng.prefetch(keys)
            assert set(res.failed) == set(keys)
            assert all(type(e) is KVTierError for e in res.failed.values())
            assert eng.lookup(keys) == [kvtier.Residency.NVME] * 2
            assert eng.lookup(keys_of(fresh)) == [kvtier.Residency.CPU] * 3
            assert eng.stats().evictions == 0
        finally:
            hold.gate.set()
        await eng.flush()
        res = await eng.prefetch(keys)  # the written rows are evictable now
        assert set(res.promoted) == set(keys)
        stats = eng.stats()
        assert stats.evictions == 2
        settled(stats)
        gpu.scribble()
        out = await eng.load(chunks)
        assert set(out.loaded) == set(keys)
        assert all(gpu.holds(c) for c in chunks)


# ---------------------------------------------------------------- partial chunks


async def test_partial_chunk_prefetched_then_a_wider_load_is_not_stored(tmp_path: Path) -> None:
    gpu = Gpu()
    part = kvtier.Chunk(key("part", 0), [5], offset=1)  # sub-block 1 only
    head = kvtier.Chunk(key("head", 0), [6], offset=0)  # sub-block 0 only
    await on_nvme(gpu, tmp_path, [part, head])
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as eng:
        assert eng.stored_range(part.key) == (1, 2)
        res = await eng.prefetch([part.key, head.key])
        assert set(res.promoted) == {part.key, head.key}
        assert eng.stored_range(part.key) == (1, 2)
        assert eng.stored_range(head.key) == (0, 1)
        stats = eng.stats()
        assert stats.payload_nbytes == 2 * BLOCK  # one sub-block each, not a whole chunk
        assert stats.slot_waste_nbytes == 2 * stats.slot_nbytes - 2 * BLOCK
        gpu.scribble()
        wide = [
            kvtier.Chunk(part.key, [20, 21]),  # sub-blocks 0..2: 0 was never stored
            kvtier.Chunk(head.key, [22, 23]),  # 0..2: 1 was never stored
        ]
        out = await eng.load(wide)
        assert out.loaded == ()
        assert all(isinstance(out.failed[c.key], NotStoredError) for c in wide)
        assert all(gpu.untouched(c) for c in wide)
        shifted = kvtier.Chunk(head.key, [24], offset=1)
        out = await eng.load([shifted])
        assert isinstance(out.failed[head.key], NotStoredError)
        assert gpu.untouched(shifted)
        stats = eng.stats()
        assert stats.misses == 3
        assert stats.load_failures == 0
        # the prefetched slots still serve what was stored, into other blocks
        ok = [kvtier.Chunk(part.key, [30], offset=1), kvtier.Chunk(head.key, [31])]
        out = await eng.load(ok)
        assert set(out.loaded) == {part.key, head.key}
        assert same(gpu.tensors[0][30], gpu.before[0][5])
        assert same(gpu.tensors[0][31], gpu.before[0][6])
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == 2
        assert stats.nvme_hits == 0
        settled(stats)


async def test_load_of_a_partial_key_while_its_prefetch_reads_is_not_stored(
    tmp_path: Path,
) -> None:
    gpu = Gpu()
    part = kvtier.Chunk(key("part", 0), [5], offset=1)
    await on_nvme(gpu, tmp_path, [part])
    wrapper, block = gate_reads()
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, wrapper=wrapper)) as eng:
        gpu.scribble()
        try:
            pf = asyncio.ensure_future(eng.prefetch([part.key]))
            await settle_loop()
            assert eng.lookup([part.key]) == [kvtier.Residency.PENDING]
            assert eng.stored_range(part.key) == (1, 2)
            wide = kvtier.Chunk(part.key, [20, 21])
            out = await eng.load([wide])
            assert isinstance(out.failed[part.key], NotStoredError)
            assert gpu.untouched(wide)
            ld = asyncio.ensure_future(eng.load([kvtier.Chunk(part.key, [22], offset=1)]))
            await settle_loop()
        finally:
            block.gate.set()
        res, out = await pf, await ld
        assert res.promoted == (part.key,)
        assert out.loaded == (part.key,)
        assert same(gpu.tensors[0][22], gpu.before[0][5])
        settled(eng.stats())


# ---------------------------------------------------------------- keys leaving NVMe


@pytest.mark.parametrize("n", range(6))
async def test_key_discarded_from_nvme_around_the_read_is_a_plain_miss(
    tmp_path: Path, n: int
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(3)]
    gone = chunks[1]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as eng:
        nvme = eng._nvme  # NVMe eviction, as a write needing room does it
        pf = asyncio.ensure_future(eng.prefetch(keys))
        after_iterations(n, functools.partial(nvme.discard, gone.key))
        res = await pf
        partition(res, keys)
        assert set(res.promoted) >= set(keys) - {gone.key}
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotion_failures"] == 0  # a key leaving NVMe is no failure
        assert stats.failures == {}
        settled(stats)
        if gone.key in res.failed:
            assert isinstance(res.failed[gone.key], KeyNotResidentError)
            assert eng.lookup([gone.key]) == [kvtier.Residency.MISS]
            assert stats.keys_per_group == {0: 2}
        gpu.scribble()
        out = await eng.load(chunks)
        assert set(out.loaded) == set(res.promoted)
        for c in chunks:
            assert gpu.holds(c) if c.key in out.loaded else gpu.untouched(c)


@pytest.mark.parametrize("n", range(8))
async def test_row_writes_evicting_nvme_rows_during_a_prefetch_never_give_wrong_bytes(
    tmp_path: Path, n: int
) -> None:
    # The prefetch waits for a fresh key whose store is in flight; that store's row
    # writes need room and evict the old rows, before, during or after the
    # prefetch reserved its slots (thread timing decides): every outcome is clean.
    gpu = Gpu()
    old = [gpu.chunk(i) for i in range(4)]
    fresh = [gpu.chunk(i, tag="fresh") for i in range(4, 8)]
    cap = 4 * ROW  # NVMe holds 4 rows: the fresh rows evict the old ones
    await on_nvme(gpu, tmp_path, old, capacity=cap)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, capacity=cap)) as eng:
        st = asyncio.ensure_future(eng.store(fresh))
        await settle_loop(n)
        call = [fresh[0].key, *keys_of(old)]
        res = await eng.prefetch(call)
        assert len((await st).stored) == 4
        flushed: BaseException | None = None
        try:
            await eng.flush()
        except NotDurableError as exc:  # no room: the old rows were pinned by the reads
            flushed = exc
        if isinstance(flushed, NotDurableError):
            assert all(e.kind == "capacity" for e in flushed.failed.values()), flushed
        partition(res, call)
        assert res.resident == (fresh[0].key,)
        for k, exc in res.failed.items():  # evicted before its read pinned the row
            assert isinstance(exc, KeyNotResidentError), (k, exc)
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotion_failures"] == 0
        assert stats.nvme["promotions"] == len(res.promoted)
        assert stats.failures == {}
        assert stats.nvme["bytes_used"] <= cap
        assert stats.nvme["rows_written"] + stats.nvme["write_failures"] == 4
        settled(stats)
        gpu.scribble()
        out = await eng.load([*old, *fresh])
        assert set(res.promoted) <= set(out.loaded)
        assert set(keys_of(fresh)) <= set(out.loaded)
        for c in [*old, *fresh]:
            assert gpu.holds(c) if c.key in out.loaded else gpu.untouched(c)


# ---------------------------------------------------------------- many keys


@pytest.mark.parametrize("slots", [1500, 1000])
async def test_many_keys_in_one_call(tmp_path: Path, slots: int) -> None:
    n = 1500  # one coalesced run would exceed IOV_MAX (1024 buffers)
    gpu = Gpu(nblocks=2 * n, block=256)
    chunks = [gpu.chunk(i) for i in range(n)]
    keys = keys_of(chunks)
    kw = {"capacity": 32 << 20, "request_nbytes": 64 << 20, "segment_nbytes": 32 << 20}
    await on_nvme(gpu, tmp_path, chunks, **kw)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, slots, **kw)) as eng:
        res = await eng.prefetch(keys)
        partition(res, keys)
        assert res.promoted == tuple(keys[:slots])  # request order
        assert set(res.failed) == set(keys[slots:])
        assert all(type(e) is KVTierError for e in res.failed.values())
        assert eng.lookup(keys[slots:]) == [kvtier.Residency.NVME] * (n - slots)
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == slots
        if slots > 1024:
            assert stats.nvme["read_requests"] >= 2  # cut at IOV_MAX rows
        assert stats.evictions == 0
        settled(stats)
        assert stats.keys_per_group == {0: slots}
        gpu.scribble()
        out = await eng.load(chunks[:slots])
        assert len(out.loaded) == slots
        assert same(gpu.tensors[0][: 2 * slots], gpu.before[0][: 2 * slots])
        assert eng.stats().nvme_hits == 0


# ---------------------------------------------------------------- bad input


async def test_duplicate_key_raises_and_touches_nothing_not_even_the_lru(tmp_path: Path) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(2)]
    await on_nvme(gpu, tmp_path, chunks)
    lru, mru, newcomer = (gpu.chunk(i, tag="cpu") for i in range(10, 13))
    cfg = config(gpu, tmp_path, slots=2, write_through=False)
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        await eng.store([lru])
        await eng.store([mru])
        twin = kvtier.OffloadKey(bytes(lru.key.block_hash), lru.key.group_id)  # equal, not same
        assert twin is not lru.key
        for bad in (
            [lru.key, chunks[0].key, twin],
            (chunks[0].key, chunks[1].key, chunks[0].key),
            [chunks[1].key, chunks[1].key],
        ):
            with pytest.raises(DuplicateKeyError):
                await eng.prefetch(bad)
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == 0
        assert stats.evictions == 0
        assert eng.lookup(keys_of(chunks)) == [kvtier.Residency.NVME] * 2
        # ``lru`` was not touched by the refused call: it is still the victim
        assert (await eng.store([newcomer])).stored == (newcomer.key,)
        assert eng.lookup([lru.key, mru.key]) == [kvtier.Residency.MISS, kvtier.Residency.CPU]


async def test_empty_and_tuple_calls(tmp_path: Path) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(2)]
    await on_nvme(gpu, tmp_path, chunks)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as eng:
        assert await eng.prefetch([]) == kvtier.PrefetchResult((), (), {})
        assert await eng.prefetch(()) == kvtier.PrefetchResult((), (), {})
        res = await eng.prefetch(tuple(keys_of(chunks)))
        assert set(res.promoted) == set(keys_of(chunks))
        with pytest.raises(kvtier.errors.InvalidArgumentError):
            await eng.prefetch(k for k in keys_of(chunks))  # type: ignore[arg-type]
        settled(eng.stats())


# ---------------------------------------------------------------- two groups


async def test_two_groups_of_different_row_sizes(tmp_path: Path) -> None:
    gpu = Gpu(groups=2)
    chunks = [gpu.chunk(i, g, tag=f"g{g}-") for g in (0, 1) for i in range(3)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    corrupt = KeyFault("read", "errno", hashes=frozenset({chunks[4].key.block_hash}))
    cfg = config(gpu, tmp_path, wrapper=Wrapper(corrupt), request_nbytes=4096)
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        res = await eng.prefetch(keys[::-1])
        partition(res, keys)
        assert set(res.failed) == {chunks[4].key}
        stats = eng.stats()
        assert stats.keys_per_group == {0: 3, 1: 2}
        assert stats.nvme is not None
        assert (stats.nvme["promotions"], stats.nvme["promotion_failures"]) == (5, 1)
        settled(stats)
        gpu.scribble()
        out = await eng.load(chunks)
        assert set(out.loaded) == set(keys) - {chunks[4].key}
        for c in chunks:
            assert gpu.holds(c) if c.key in out.loaded else gpu.untouched(c)


# ---------------------------------------------------------------- BackgroundEngine


def test_background_engine_cancel_of_a_prefetch_in_flight(tmp_path: Path) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(4)]
    keys = keys_of(chunks)
    asyncio.run(on_nvme(gpu, tmp_path, chunks))
    wrapper, block = gate_reads()
    with kvtier.BackgroundEngine(gpu.layout, config(gpu, tmp_path, wrapper=wrapper)) as eng:
        try:
            fut = eng.prefetch(keys)
            for _ in range(500):
                if eng.lookup(keys) == [kvtier.Residency.PENDING] * 4:
                    break
                threading.Event().wait(0.002)
            assert eng.lookup(keys) == [kvtier.Residency.PENDING] * 4
            with pytest.raises(TimeoutError):  # waits for the reads in flight
                eng.cancel(fut, timeout=0.2)
            threading.Timer(0.1, block.gate.set).start()
            assert eng.cancel(fut, timeout=30) is True  # cancelled (by the first call)
        finally:
            block.gate.set()
        assert fut.cancelled()
        assert eng.lookup(keys) == [kvtier.Residency.CPU] * 4
        stats = eng.stats()
        settled(stats)
        assert stats.nvme is not None
        assert stats.nvme["promotions"] == 4
        gpu.scribble()
        out = eng.load(chunks).result(timeout=30)
        assert set(out.loaded) == set(keys)
        assert all(gpu.holds(c) for c in chunks)
        assert eng.stats().nvme_hits == 0


@pytest.mark.parametrize("hard", [False, True])
def test_background_engine_close_with_a_prefetch_in_flight(tmp_path: Path, hard: bool) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(4)]
    keys = keys_of(chunks)
    asyncio.run(on_nvme(gpu, tmp_path, chunks))
    wrapper, block = gate_reads()
    eng = kvtier.BackgroundEngine(gpu.layout, config(gpu, tmp_path, wrapper=wrapper)).start()
    try:
        fut = eng.prefetch(keys)
        threading.Timer(0.2, block.gate.set).start()
        eng.close(hard=hard)  # waits for the reads, which use slots of the region
    finally:
        block.gate.set()
    res = fut.result(timeout=0)
    assert set(res.promoted) == set(keys)
    with pytest.raises(EngineClosedError):
        eng.prefetch(keys)
    with kvtier.BackgroundEngine(gpu.layout, config(gpu, tmp_path)) as again:
        assert again.lookup(keys) == [kvtier.Residency.NVME] * 4
        res = again.prefetch(keys).result(timeout=30)
        assert set(res.promoted) == set(keys)


class _Shifty(Sequence[kvtier.OffloadKey]):
    """A sequence whose first iteration differs from the later ones."""

    def __init__(self, first: list[kvtier.OffloadKey], later: list[kvtier.OffloadKey]) -> None:
        self.first, self.later, self.iterations = first, later, 0

    def __len__(self) -> int:
        return len(self.first)

    def __getitem__(self, i: int) -> kvtier.OffloadKey:  # type: ignore[override]
        return self.first[i]

    def __iter__(self) -> Iterator[kvtier.OffloadKey]:
        self.iterations += 1
        return iter(self.first if self.iterations == 1 else self.later)


async def test_keys_are_validated_and_used_from_one_snapshot(tmp_path: Path) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(2)]
    k = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path)) as eng:
        with contextlib.suppress(DuplicateKeyError):  # refusing it is fine too
            await eng.prefetch(_Shifty(k, [k[0], k[0]]))
        settled(eng.stats())  # no slot leaked, none left pinned


@pytest.mark.parametrize("n", [0, 2, 4, 8])
async def test_aio_backend_prefetch_cancelled_and_raced_with_a_load(tmp_path: Path, n: int) -> None:
    if not aio_supported() or not probe_direct_io(tmp_path):
        pytest.skip("no Linux AIO context or no O_DIRECT here")
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(8)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    cfg = config(gpu, tmp_path, io_backend="aio")
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        gpu.scribble()
        pf = asyncio.ensure_future(eng.prefetch(keys[:5]))
        after_iterations(n, pf.cancel)
        ld = asyncio.ensure_future(eng.load(chunks[3:]))
        try:
            res = await pf
            partition(res, keys[:5])
            assert not res.failed
        except asyncio.CancelledError:
            pass
        out = await ld
        assert set(out.loaded) == set(keys[3:])
        out = await eng.load(chunks[:3])
        assert set(out.loaded) == set(keys[:3])
        assert all(gpu.holds(c) for c in chunks)
        stats = eng.stats()
        assert stats.nvme is not None
        assert stats.nvme["backend"] == "aio"
        assert stats.nvme["promotions"] == 8
        assert stats.nvme["promotion_failures"] == 0
        settled(stats)


# ---------------------------------------------------------------- more races


async def test_durable_store_skipping_a_key_whose_prefetch_read_fails_reports_it(
    tmp_path: Path,
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(2)]
    bad = chunks[0]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    eio = KeyFault("read", "errno", hashes=frozenset({bad.key.block_hash}))
    block = KeyFault("read", "block")
    cfg = config(gpu, tmp_path, wrapper=Wrapper(eio, block), request_nbytes=4096)
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        try:
            pf = asyncio.ensure_future(eng.prefetch(keys))
            await settle_loop()
            st = asyncio.ensure_future(eng.store(chunks, durable=True))
            await settle_loop()
            assert not st.done()  # waits for the promotions it skipped
        finally:
            block.gate.set()
        res = await pf
        assert set(res.failed) == {bad.key}
        with pytest.raises(NotDurableError) as info:
            await st  # never claims a key durable that is on no medium
        assert set(info.value.failed) == {bad.key}
        assert set(info.value.result.skipped) == set(keys)
        settled(eng.stats())


async def test_load_cancelled_while_waiting_for_a_prefetch_read_writes_nothing(
    tmp_path: Path,
) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(3)]
    keys = keys_of(chunks)
    await on_nvme(gpu, tmp_path, chunks)
    wrapper, block = gate_reads()
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, wrapper=wrapper)) as eng:
        gpu.scribble()
        try:
            pf = asyncio.ensure_future(eng.prefetch(keys))
            await settle_loop()
            ld = asyncio.ensure_future(eng.load(chunks))
            await settle_loop()
            ld.cancel()
            await settle_loop()
            assert not ld.done()  # delayed by the promotion in flight for its keys
        finally:
            block.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await ld
        assert all(gpu.untouched(c) for c in chunks)  # the cancelled load copied nothing
        res = await pf
        assert set(res.promoted) == set(keys)
        settled(eng.stats())
        out = await eng.load(chunks)
        assert set(out.loaded) == set(keys)
        assert all(gpu.holds(c) for c in chunks)


def test_background_engine_prefetch_bad_input_raises_through_the_future(tmp_path: Path) -> None:
    gpu = Gpu()
    chunks = [gpu.chunk(i) for i in range(2)]
    keys = keys_of(chunks)
    asyncio.run(on_nvme(gpu, tmp_path, chunks))
    with kvtier.BackgroundEngine(gpu.layout, config(gpu, tmp_path)) as eng:
        with pytest.raises(DuplicateKeyError):
            eng.prefetch([keys[0], keys[1], keys[0]]).result(timeout=30)
        assert eng.lookup(keys) == [kvtier.Residency.NVME] * 2
        assert eng.stats().nvme["promotions"] == 0  # type: ignore[index]
        res = eng.prefetch(keys).result(timeout=30)
        assert set(res.promoted) == set(keys)


# ---------------------------------------------------------------- randomized soak


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_mix_of_prefetch_load_store_cancel_never_gives_wrong_bytes(
    tmp_path: Path, seed: int
) -> None:
    await _soak(tmp_path, seed, close=None)


@pytest.mark.parametrize("hard", [False, True])
async def test_random_mix_closed_while_calls_are_in_flight(tmp_path: Path, hard: bool) -> None:
    await _soak(tmp_path, 3, close=hard)


async def _soak(tmp_path: Path, seed: int, close: bool | None) -> None:
    """300 random stores, loads, prefetches, flushes, some cancelled; every load checked.

    ``close``: None, or ``aclose(hard=close)`` while the last calls are in flight.
    """
    rng = random.Random(seed)
    nkeys, sentinel = 24, 0xAB
    gpu = Gpu(nblocks=2 * nkeys + 80)
    t, before = gpu.tensors[0], gpu.before[0]

    def src(i: int) -> kvtier.Chunk:  # every 5th key is a partial chunk (sub-block 0 only)
        ids = [2 * i] if i % 5 == 0 else [2 * i, 2 * i + 1]
        return kvtier.Chunk(key(f"soak{i}", 0), ids)

    sources = [src(i) for i in range(nkeys)]
    by_key = {c.key: c for c in sources}
    bad = frozenset({sources[3].key.block_hash, sources[7].key.block_hash})
    eio = KeyFault("read", "errno", hashes=bad, times=4)
    cfg = config(
        gpu, tmp_path, slots=6, wrapper=Wrapper(eio), capacity=10 * ROW, request_nbytes=2 * ROW
    )
    await on_nvme(gpu, tmp_path, sources[:10], capacity=10 * ROW)
    free_dst = list(range(2 * nkeys, 2 * nkeys + 80, 2))
    t[2 * nkeys :].fill_(sentinel)
    loads_checked = 0

    def check_load(chunks: list[kvtier.Chunk], out: object, cancelled: bool) -> None:
        nonlocal loads_checked
        for c in chunks:
            s = list(by_key[c.key].block_ids)
            got = t[list(c.block_ids)]
            want = before[s[: len(c.block_ids)]] if len(c.block_ids) <= len(s) else None
            if not cancelled and isinstance(out, kvtier.LoadResult) and c.key in out.loaded:
                assert want is not None
                assert same(got, want), c.key
                loads_checked += 1
            elif not cancelled:
                assert int((got != sentinel).count_nonzero()) == 0, c.key
            else:  # per block: the key's bytes or what was there before
                for j, b in enumerate(c.block_ids):
                    row = t[b]
                    ok = int((row != sentinel).count_nonzero()) == 0
                    assert ok or (want is not None and same(row, want[j])), c.key
            t[list(c.block_ids)] = sentinel
            free_dst.append(c.block_ids[0] - (c.block_ids[0] % 2))

    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        inflight: dict[asyncio.Future[object], tuple[str, list[kvtier.Chunk]]] = {}
        for step in range(300):
            op = rng.choice(["store", "load", "load", "prefetch", "prefetch", "flush"])
            picks = rng.sample(range(nkeys), rng.randint(1, 5))
            if op == "store":
                fut = asyncio.ensure_future(eng.store([sources[i] for i in picks]))
                inflight[fut] = ("store", [])
            elif op == "load" and len(free_dst) >= len(picks):
                chunks = []
                for i in picks:
                    d = free_dst.pop()
                    ids = [d] if rng.random() < 0.5 else [d, d + 1]
                    chunks.append(kvtier.Chunk(sources[i].key, ids))
                fut = asyncio.ensure_future(eng.load(chunks))
                inflight[fut] = ("load", chunks)
            elif op == "prefetch":
                keys = [sources[i].key for i in picks]
                fut = asyncio.ensure_future(eng.prefetch(keys))
                inflight[fut] = ("prefetch", [sources[i] for i in picks])
            elif op == "flush":
                fut = asyncio.ensure_future(eng.flush())
                inflight[fut] = ("flush", [])
            else:
                continue
            if rng.random() < 0.2:
                after_iterations(rng.randint(0, 6), fut.cancel)
            if len(inflight) >= 8 or step % 7 == 0:
                done, _ = await asyncio.wait(list(inflight), return_when=asyncio.FIRST_COMPLETED)
                for f in done:
                    kind, chunks = inflight.pop(f)
                    cancelled = f.cancelled()
                    exc = None if cancelled else f.exception()
                    if kind == "load":
                        assert exc is None, exc
                        check_load(chunks, None if cancelled else f.result(), cancelled)
                    elif kind == "prefetch" and not cancelled:
                        assert exc is None, exc
                        res = f.result()
                        partition(res, keys_of(chunks))  # type: ignore[arg-type]
                        for e in res.failed.values():
                            assert isinstance(e, KeyNotResidentError | StorageError | KVTierError)
                    elif kind == "flush" and exc is not None:
                        assert isinstance(exc, NotDurableError), exc
                    elif kind == "store":
                        assert exc is None, exc
        closing = None
        if close is not None:
            closing = asyncio.ensure_future(eng.aclose(hard=close))
        for f in list(inflight):
            kind, chunks = inflight.pop(f)
            try:
                out = await f
            except (asyncio.CancelledError, NotDurableError, EngineClosedError):
                out = None
            if kind == "load":
                check_load(chunks, out, f.cancelled())
        if closing is None:
            with contextlib.suppress(NotDurableError):
                await eng.flush()
            resident = [k for k in by_key if eng.lookup([k]) == [kvtier.Residency.NVME]]
        else:
            await closing
            resident = []
        stats = eng.stats()
        settled(stats)
        assert loads_checked > 20
        # a failed key's own read failed; a failed request of 2 rows is retried row by row,
        # so each failure but maybe the last follows at most one other hit
        assert (eio.hits - 1) // 2 <= stats.failures.get("eio", 0) <= eio.hits
        if closing is None:  # a closed engine reports no NVMe counters
            assert stats.nvme is not None
            assert sum(stats.failures.values()) == stats.nvme["promotion_failures"]
            assert stats.failures.get("eio", 0) == stats.nvme["failures_eio"]
    async with kvtier.TransferEngine(gpu.layout, config(gpu, tmp_path, capacity=10 * ROW)) as e2:
        for k, s in by_key.items():  # whatever the next engine finds loads its own bytes
            d = free_dst[0]
            c = kvtier.Chunk(k, [d, d + 1][: len(s.block_ids)])
            out = await e2.load([c])
            if k in resident:
                assert out.loaded == (k,), out.failed
            if out.loaded:
                assert same(t[list(c.block_ids)], before[list(s.block_ids)])
            else:
                assert int((t[list(c.block_ids)] != sentinel).count_nonzero()) == 0
            t[list(c.block_ids)] = sentinel


async def test_a_key_reported_resident_is_in_a_cpu_slot_after_the_call(tmp_path: Path) -> None:
    gpu = Gpu()
    warm, cold = gpu.chunk(0), gpu.chunk(1)
    await on_nvme(gpu, tmp_path, [warm, cold])
    wrapper, block = gate_reads()
    cfg = config(gpu, tmp_path, slots=2, wrapper=wrapper)
    async with kvtier.TransferEngine(gpu.layout, cfg) as eng:
        newcomer = gpu.chunk(5, tag="new")
        try:
            # ``warm`` is already in a CPU slot; ``cold`` is read into the other one
            warm_pf = asyncio.ensure_future(eng.prefetch([warm.key]))
            await settle_loop()
            block.gate.set()
            assert (await warm_pf).promoted == (warm.key,)
            block.gate.clear()
            pf = asyncio.ensure_future(eng.prefetch([warm.key, cold.key]))
            await settle_loop()
            assert eng.lookup([cold.key]) == [kvtier.Residency.PENDING]
            # another caller needs a slot while the read is in flight
            st = await eng.store([newcomer])
            # ``warm`` is held by the prefetch in flight and ``cold`` is being read
            # into the other slot: no slot can be evicted for the newcomer
            assert st.rejected == (newcomer.key,)
        finally:
            block.gate.set()
        res = await pf
        partition(res, [warm.key, cold.key])
        after = dict(zip([warm.key, cold.key], eng.lookup([warm.key, cold.key]), strict=True))
        assert res.resident == (warm.key,)
        assert res.promoted == (cold.key,)
        for k in (*res.resident, *res.promoted):
            assert after[k] is kvtier.Residency.CPU, (k, after[k], res)
