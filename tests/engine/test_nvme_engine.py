"""The engine with its NVMe tier: restart in a new process, format isolation, corruption."""

from __future__ import annotations

import asyncio
import errno
import functools
import gc
import json
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier import _transfer
from kvtier.errors import StorageError
from tests.engine import nvme_child
from tests.engine.helpers import after_iterations, fill_random, key, same

REPO = Path(__file__).resolve().parents[2]


def _child(mode: str, root: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.engine.nvme_child", mode, str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_store_flush_then_new_process_loads_bitwise(tmp_path: Path) -> None:
    assert _child("store", tmp_path) == {"stored": 6}
    result = _child("load", tmp_path)
    assert result["residency"] == ["nvme"] * 6
    assert result["loaded"] == 6
    assert result["failed"] == 0
    assert result["equal"] == [True, True, True, True]


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock"
    }


async def test_layout_change_reuses_nothing_and_deletes_nothing(tmp_path: Path) -> None:
    layout, _ = nvme_child.build(True)
    async with kvtier.TransferEngine(layout, nvme_child.config(str(tmp_path))) as engine:
        await engine.store(nvme_child.chunks())
        await engine.flush()
    before = _tree(tmp_path)
    g0, g1, g2 = (
        torch.zeros(24, 2, 8, 1, 32, dtype=torch.float32),
        torch.zeros(2, 24, 8, 2, 32, dtype=torch.float16),
        torch.zeros(24, 4608, dtype=torch.uint8),
    )
    variants = {
        "dtype": (
            kvtier.KVLayout.from_tensors(
                {0: {"full.0": g0}, 1: {"swa.0": g1}, 2: {"lin.0": g2}},
                block_dim={"full.0": 0, "swa.0": 1, "lin.0": 0},
                payload_nbytes={"lin.0": 4096},
            ),
            4,
        ),
        "blocks_per_chunk": (nvme_child.build(False)[0], 2),
        "block size": (
            kvtier.KVLayout.from_tensors(
                {
                    0: {"full.0": torch.zeros(24, 2, 16, 1, 32, dtype=torch.bfloat16)},
                    1: {"swa.0": g1},
                    2: {"lin.0": g2},
                },
                block_dim={"full.0": 0, "swa.0": 1, "lin.0": 0},
                payload_nbytes={"lin.0": 4096},
                tokens_per_block={0: 32, 1: 16, 2: 16},
            ),
            4,
        ),
        "group added": (
            kvtier.KVLayout.from_tensors(
                {
                    0: {"full.0": torch.zeros(24, 2, 8, 1, 32, dtype=torch.bfloat16)},
                    1: {"swa.0": g1},
                    2: {"lin.0": g2},
                    3: {"extra": torch.zeros(24, 64)},
                },
                block_dim={"full.0": 0, "swa.0": 1, "lin.0": 0, "extra": 0},
                payload_nbytes={"lin.0": 4096},
            ),
            4,
        ),
    }
    dirs = {p.name for p in tmp_path.iterdir()}
    for name, (other, bpc) in variants.items():
        cfg = kvtier.EngineConfig(1 << 20, bpc, nvme=nvme_child.config(str(tmp_path)).nvme)
        async with kvtier.TransferEngine(other, cfg) as engine:
            assert (
                engine.lookup([c.key for c in nvme_child.chunks()]) == [kvtier.Residency.MISS] * 6
            ), name
        new_dirs = {p.name for p in tmp_path.iterdir()} - dirs
        assert len(new_dirs) == 1, name
        dirs |= new_dirs
    after = _tree(tmp_path)
    for path, data in before.items():
        assert after[path] == data, path


async def test_corrupt_payload_byte_is_a_counted_miss_and_others_load(tmp_path: Path) -> None:
    t = torch.empty((16, 8192), dtype=torch.uint8)
    fill_random(t, 7)
    before = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    nv = kvtier.NVMeConfig(
        root=tmp_path, capacity_bytes=16 << 20, namespace="corrupt", segment_nbytes=1 << 20
    )
    cfg = kvtier.EngineConfig(1 << 20, 2, nvme=nv)
    chunks = [kvtier.Chunk(key(i, 0), [2 * i, 2 * i + 1]) for i in range(4)]
    async with kvtier.TransferEngine(layout, cfg) as engine:
        await engine.store(chunks, durable=True)
    seg = next(tmp_path.rglob("*.kvrows"))
    row = layout.slot_nbytes(2)  # one group: row size == slot size
    with open(seg, "r+b") as f:  # flip one payload byte of row 0
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    t.zero_()
    async with kvtier.TransferEngine(layout, cfg) as engine:
        out = await engine.load(chunks)
        assert len(out.failed) == 1
        assert len(out.loaded) == 3
        bad = next(iter(out.failed))
        stats = engine.stats()
        assert stats.load_failures == 1
        assert stats.nvme["checksum_failures"] == 1
        assert stats.failures == {"checksum": 1}
        assert engine.lookup([bad]) == [kvtier.Residency.MISS]
    bad_blocks = next(c.block_ids for c in chunks if c.key == bad)
    good = [b for c in chunks if c.key != bad for b in c.block_ids]
    assert same(t[good], before[good])
    assert int(t[list(bad_blocks)].count_nonzero()) == 0  # no wrong bytes reached the "GPU"
    assert row > 0


async def test_durable_store_writes_rows_even_without_write_through(tmp_path: Path) -> None:
    t = torch.empty((4, 4096), dtype=torch.uint8)
    fill_random(t, 9)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    nv = kvtier.NVMeConfig(root=tmp_path, capacity_bytes=1 << 24, segment_nbytes=1 << 20)
    cfg = kvtier.EngineConfig(1 << 20, 1, nvme=nv, write_through=False)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        await engine.store([kvtier.Chunk(key("lazy", 0), [0])])  # CPU only
        await engine.store([kvtier.Chunk(key("durable", 0), [1])], durable=True)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        assert engine.lookup([key("lazy", 0), key("durable", 0)]) == [
            kvtier.Residency.MISS,
            kvtier.Residency.NVME,
        ]


class _Forwarding:
    """A RowIO wrapper forwarding every call to ``inner``; subclasses change one call.

    ``on`` switches the change on (set it from the test once set-up is done).
    """

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.on = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class _SlowReads(_Forwarding):
    """Reads take 0.15 s once ``on`` is set (promotions stay in flight)."""

    def preadv(self, *args: object, **kwargs: object) -> int:
        if self.on.is_set():
            time.sleep(0.15)
        return self.inner.preadv(*args, **kwargs)  # type: ignore[attr-defined,no-any-return]


def _wrapped_engine_config(
    tmp_path: Path, seed: int, namespace: str, wrapper: type[_Forwarding], bpc: int = 2
) -> tuple[torch.Tensor, kvtier.KVLayout, kvtier.EngineConfig, list[_Forwarding]]:
    """A one-group layout of seeded bytes and an NVMe config whose RowIO is wrapped.

    Returns ``(tensor, layout, config, holder)``; ``holder[-1]`` is the wrapper of
    the engine opened last.
    """
    t = torch.empty((16, 8192), dtype=torch.uint8)
    fill_random(t, seed)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    holder: list[_Forwarding] = []
    nv = kvtier.NVMeConfig(
        root=tmp_path,
        capacity_bytes=16 << 20,
        namespace=namespace,
        segment_nbytes=1 << 20,
        row_io_wrapper=lambda inner: holder.append(wrapper(inner)) or holder[-1],
    )
    return t, layout, kvtier.EngineConfig(1 << 20, bpc, nvme=nv), holder


async def test_load_waits_for_a_promotion_another_load_starts_meanwhile(
    tmp_path: Path, monkeypatch
) -> None:
    # Load A waits for a store in flight; meanwhile load B starts promoting
    # another key of A from NVMe. A must wait for that promotion too and load
    # the key, not report it as a miss.
    t, layout, cfg, holder = _wrapped_engine_config(tmp_path, 21, "wait", _SlowReads)
    before = t.clone()
    k_nvme, k_new = key("on-nvme", 0), key("in-flight", 0)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        await engine.store([kvtier.Chunk(k_nvme, [0, 1])], durable=True)
    real = _transfer.run_plan

    def slow_store(plan: list, direction: str, **kw: Any) -> None:
        if direction == "store":
            time.sleep(0.05)
        real(plan, direction, **kw)

    monkeypatch.setattr(_transfer, "run_plan", slow_store)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        assert engine.lookup([k_nvme]) == [kvtier.Residency.NVME]
        holder[-1].on.set()
        store = asyncio.ensure_future(engine.store([kvtier.Chunk(k_new, [2, 3])]))
        await asyncio.sleep(0)
        t[8:12] = 0
        load_a = asyncio.ensure_future(
            engine.load([kvtier.Chunk(k_new, [8, 9]), kvtier.Chunk(k_nvme, [10, 11])])
        )
        await asyncio.sleep(0.01)  # A now waits for the store
        load_b = asyncio.ensure_future(engine.load([kvtier.Chunk(k_nvme, [12, 13])]))
        res_a, res_b = await asyncio.gather(load_a, load_b)
        assert (await store).stored == (k_new,)
    assert not res_b.failed
    assert not res_a.failed, res_a.failed
    assert same(t[[8, 9]], before[[2, 3]])
    assert same(t[[10, 11, 12, 13]], before[[0, 1, 0, 1]])


async def test_key_leaving_nvme_during_its_promotion_is_a_miss_not_a_failure(
    tmp_path: Path,
) -> None:
    # The row of a key chosen for promotion is evicted (a write batch needing
    # room) at every point of the load in turn: the key either loads bitwise
    # or is a MISS (KeyNotResidentError), no storage failure is counted, and
    # the other key always loads.
    t = torch.empty((8, 4096), dtype=torch.uint8)
    fill_random(t, 5)
    before = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    nv = kvtier.NVMeConfig(root=tmp_path, capacity_bytes=1 << 24, segment_nbytes=1 << 20)
    cfg = kvtier.EngineConfig(1 << 20, 2, nvme=nv)
    gone, kept = key("gone", 0), key("kept", 0)
    outcomes = set()
    for n in range(12):
        t.copy_(before)
        async with kvtier.TransferEngine(layout, cfg) as engine:
            await engine.store(
                [kvtier.Chunk(gone, [0, 1]), kvtier.Chunk(kept, [2, 3])], durable=True
            )
        t[4:] = 0
        async with kvtier.TransferEngine(layout, cfg) as engine:
            assert engine.lookup([gone, kept]) == [kvtier.Residency.NVME] * 2
            nvme = engine._nvme
            assert nvme is not None
            load = asyncio.ensure_future(
                engine.load([kvtier.Chunk(gone, [4, 5]), kvtier.Chunk(kept, [6, 7])])
            )
            after_iterations(n, functools.partial(nvme.discard, gone))
            res = await load
            stats = engine.stats()
        assert kept in res.loaded
        assert same(t[[6, 7]], before[[2, 3]])
        if gone in res.loaded:
            assert same(t[[4, 5]], before[[0, 1]])
            outcomes.add("loaded")
        else:
            err = res.failed[gone]
            assert isinstance(err, kvtier.errors.KeyNotResidentError), (n, err)
            assert int(t[[4, 5]].count_nonzero()) == 0
            outcomes.add("miss")
        assert stats.failures == {}, (n, stats.failures)
        assert stats.nvme is not None
        assert stats.nvme["promotion_failures"] == 0
    assert outcomes == {"loaded", "miss"}


class _SlowWrites(_Forwarding):
    """Records the size of every write and delays row writes."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)
        self.sizes: list[int] = []

    def pwritev(self, handle: object, bufs: list[memoryview], offset: int) -> int:
        n = sum(b.nbytes for b in bufs)
        self.sizes.append(n)
        if n > 4096:  # a row write, not a segment header
            time.sleep(0.2)
        return self.inner.pwritev(handle, bufs, offset)  # type: ignore[attr-defined,no-any-return]


async def _six_stores_while_writes_are_slow(tmp_path: Path, ns: str) -> int:
    """Store six one-chunk calls while two slow batches are in flight.

    Returns:
        The row write requests counted by the RowIO.
    """
    t = torch.empty((12, 4096), dtype=torch.uint8)
    fill_random(t, 13)
    before = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    holder: list[_SlowWrites] = []
    nv = kvtier.NVMeConfig(
        root=tmp_path,
        capacity_bytes=1 << 24,
        namespace=ns,
        segment_nbytes=1 << 20,
        row_io_wrapper=lambda inner: holder.append(_SlowWrites(inner)) or holder[-1],
    )
    cfg = kvtier.EngineConfig(1 << 20, 2, nvme=nv)
    chunks = [kvtier.Chunk(key(f"c{i}", 0), [2 * i, 2 * i + 1]) for i in range(6)]
    async with kvtier.TransferEngine(layout, cfg) as engine:
        await engine.store(chunks[:1])
        await asyncio.sleep(0.05)  # batch 1 is being written
        await engine.store(chunks[1:2])
        await asyncio.sleep(0.05)  # batch 2 too: both write slots are busy
        for c in chunks[2:]:
            await engine.store([c])
        await engine.flush()
    t.zero_()
    async with kvtier.TransferEngine(layout, cfg) as engine:
        out = await engine.load(chunks)
        assert not out.failed
    assert same(t, before)
    rows = [n for n in holder[0].sizes if n > 4096]
    assert sum(rows) == 6 * layout.slot_nbytes(2)
    return len(rows)


async def test_stores_made_while_both_write_slots_are_busy_go_out_as_one_batch(
    tmp_path: Path,
) -> None:
    # Stores 3-6 arrive while batches 1 and 2 are written: they join one open
    # batch, whose four consecutive rows leave in a single request.
    requests = await _six_stores_while_writes_are_slow(tmp_path, "merge")
    assert requests == 3


async def test_a_full_open_batch_is_closed_and_the_next_key_opens_another(
    tmp_path: Path, monkeypatch
) -> None:
    from kvtier import _writeback

    monkeypatch.setattr(_writeback, "_MAX_BATCH_NBYTES", 1)  # one row per batch
    requests = await _six_stores_while_writes_are_slow(tmp_path, "cap")
    assert requests == 6


async def test_partial_key_on_nvme_fails_alone_when_a_load_asks_for_more(tmp_path: Path) -> None:
    # After a restart the caller cannot know that a key holds only sub-blocks
    # [0, 2): stored_range says so, and a load of the whole chunk fails that
    # key alone (NotStoredError) while the other key of the call is promoted.
    t = torch.empty((16, 4096), dtype=torch.uint8)
    fill_random(t, 31)
    before = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    nv = kvtier.NVMeConfig(root=tmp_path, capacity_bytes=1 << 24, segment_nbytes=1 << 20)
    cfg = kvtier.EngineConfig(1 << 20, 4, nvme=nv)
    part, full = key("part", 0), key("full", 0)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        await engine.store(
            [kvtier.Chunk(part, [0, 1]), kvtier.Chunk(full, [4, 5, 6, 7])], durable=True
        )
    t[8:] = 0
    async with kvtier.TransferEngine(layout, cfg) as engine:
        assert engine.lookup([part, full]) == [kvtier.Residency.NVME] * 2
        assert engine.stored_range(part) == (0, 2)
        out = await engine.load(
            [kvtier.Chunk(part, [8, 9, 10, 11]), kvtier.Chunk(full, [12, 13, 14, 15])]
        )
        assert out.loaded == (full,)
        assert isinstance(out.failed[part], kvtier.errors.NotStoredError)
        out = await engine.load([kvtier.Chunk(part, [8, 9])])
        assert out.loaded == (part,)
        stats = engine.stats()
        assert (stats.hits, stats.nvme_hits, stats.misses) == (0, 2, 1)  # both came from NVMe
    assert same(t[12:16], before[4:8])
    assert same(t[8:10], before[0:2])
    assert int(t[10:12].count_nonzero()) == 0


async def test_closed_engine_is_freed_without_a_cyclic_garbage_collection(tmp_path: Path) -> None:
    """The engine and its NVMe writer refer to each other until close: then the pair,
    with every slot and row index entry behind it, goes by reference counting (a full
    cyclic collection of a process that imported torch pauses it for ~80 ms)."""
    layout, _ = nvme_child.build(True)
    gc.collect()
    gc.disable()
    try:
        engine = kvtier.TransferEngine(layout, nvme_child.config(str(tmp_path)))
        async with engine:
            await engine.store(nvme_child.chunks())
            await engine.load(nvme_child.chunks())
            await engine.flush()
            assert engine._writer is not None
            writer = weakref.ref(engine._writer)
        gone = weakref.ref(engine)
        del engine
        await asyncio.sleep(0)  # the loop drops its handles of finished tasks
        assert gone() is None
        assert writer() is None
    finally:
        gc.enable()


async def test_a_load_cancelled_during_its_promotion_counts_no_failure(tmp_path: Path) -> None:
    """Cancelled while a key is promoted: nothing is copied, and the pinned keys are
    released without being counted as load failures (a cancellation is not one)."""
    t, layout, cfg, holder = _wrapped_engine_config(tmp_path, 31, "cancel", _SlowReads)
    k_nvme, k_cpu = key("on-nvme", 0), key("in-cpu", 0)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        await engine.store([kvtier.Chunk(k_nvme, [0, 1])], durable=True)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        await engine.store([kvtier.Chunk(k_cpu, [2, 3])])
        holder[-1].on.set()
        t[8:12] = 7
        load = asyncio.ensure_future(
            engine.load([kvtier.Chunk(k_cpu, [8, 9]), kvtier.Chunk(k_nvme, [10, 11])])
        )
        for _ in range(5000):  # until k_cpu is pinned and k_nvme's (slow) read in flight
            if engine.lookup([k_nvme]) == [kvtier.Residency.PENDING]:
                break
            await asyncio.sleep(0.001)
        assert engine.lookup([k_nvme]) == [kvtier.Residency.PENDING]
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        stats = engine.stats()
        assert stats.hits == 1  # k_cpu was found
        assert stats.load_failures == 0
        assert stats.failures == {}
        assert stats.slots_pinned == 0
        assert engine.lookup([k_cpu, k_nvme]) == [kvtier.Residency.CPU] * 2
    assert int((t[8:12] != 7).count_nonzero()) == 0  # no block received bytes


class _FailingSync(_Forwarding):
    """``fdatasync`` fails with EIO once ``on`` is set."""

    def fdatasync(self, handle: object) -> None:
        if self.on.is_set():
            raise OSError(errno.EIO, "injected EIO")
        self.inner.fdatasync(handle)  # type: ignore[attr-defined]


async def test_stats_keep_the_nvme_counters_after_close(tmp_path: Path) -> None:
    t = torch.empty((8, 4096), dtype=torch.uint8)
    fill_random(t, 41)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    nv = kvtier.NVMeConfig(root=tmp_path, capacity_bytes=16 << 20, segment_nbytes=1 << 20)
    engine = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1, nvme=nv))
    async with engine:
        await engine.store([kvtier.Chunk(key(i, 0), [i]) for i in range(3)], durable=True)
        live = engine.stats().nvme
    after = engine.stats().nvme
    assert live is not None
    assert after is not None
    assert after["rows_written"] == live["rows_written"] == 3
    assert after["rows_resident"] == 3
    after["rows_written"] = -1  # a copy: the engine's snapshot is not changed
    assert engine.stats().nvme["rows_written"] == 3  # type: ignore[index]


async def test_close_releases_everything_when_the_final_fdatasync_fails(tmp_path: Path) -> None:
    _, layout, cfg, holder = _wrapped_engine_config(tmp_path, 43, "sync", _FailingSync, bpc=1)
    engine = kvtier.TransferEngine(layout, cfg)
    await engine.start()
    await engine.store([kvtier.Chunk(key("dirty", 0), [0])])  # written through, not synced
    for _ in range(5000):  # the row (and the segment created for it) written: 5 s at most
        if engine.stats().nvme["rows_written"] == 1:  # type: ignore[index]
            break
        await asyncio.sleep(0.001)
    assert engine.stats().nvme["rows_written"] == 1  # type: ignore[index]
    holder[-1].on.set()
    with pytest.raises(StorageError):
        await engine.aclose()  # the final fdatasync of the written segment fails
    assert engine._region is None  # the slot pool was unmapped all the same
    assert engine._executors == {}
    with pytest.raises(kvtier.EngineClosedError):
        engine.lookup([key("dirty", 0)])
    assert engine.stats().nvme is not None
    async with kvtier.TransferEngine(layout, cfg) as again:  # the namespace lock was released
        assert again.lookup([key("dirty", 0)]) != [kvtier.Residency.PENDING]


@pytest.mark.parametrize("call", ["load", "prefetch"])
@pytest.mark.parametrize("times", [1, 2, 1 << 30], ids=["one-shot", "through-retry", "persistent"])
async def test_an_eio_on_one_row_of_a_coalesced_read_costs_at_most_that_row(
    tmp_path: Path, call: str, times: int
) -> None:
    from tests.reliability._faultio import KeyFault, Wrapper

    t = torch.empty((16, 8192), dtype=torch.uint8)
    fill_random(t, 3)
    before = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    chunks = [kvtier.Chunk(key(i, 0), [2 * i, 2 * i + 1]) for i in range(6)]
    bad = chunks[3].key
    # times=1: only the coalesced request fails; 2: also the row's own retry; then it is gone
    wrapper = Wrapper()

    def config(wrap: Any = None) -> kvtier.EngineConfig:
        nv = kvtier.NVMeConfig(
            root=tmp_path,
            capacity_bytes=16 << 20,
            namespace="isolate",
            segment_nbytes=1 << 20,
            row_io_wrapper=wrap,
        )
        return kvtier.EngineConfig(1 << 20, 2, nvme=nv)

    async with kvtier.TransferEngine(layout, config()) as engine:
        await engine.store(chunks, durable=True)
    t.zero_()
    lost = {bad} if times > 1 else set()
    async with kvtier.TransferEngine(layout, config(wrapper)) as engine:
        wrapper.faults.append(KeyFault("read", "errno", frozenset({bad.block_hash}), times=times))
        if call == "load":
            out = await engine.load(chunks)
            assert set(out.loaded) == {c.key for c in chunks} - lost
            failed = dict(out.failed)
        else:
            res = await engine.prefetch([c.key for c in chunks])
            assert set(res.promoted) == {c.key for c in chunks} - lost
            failed = dict(res.failed)
            out = await engine.load(chunks)  # CPU hits, no read
            assert set(out.loaded) == set(res.promoted)
        assert set(failed) == lost
        for err in failed.values():
            assert isinstance(err, StorageError)
            assert err.kind == "eio"
        stats = engine.stats()
        assert stats.nvme["read_requests"] == 1 + 6  # one coalesced request, then row by row
        assert stats.failures == ({"eio": 1} if lost else {})
        want = [kvtier.Residency.MISS if c.key in lost else kvtier.Residency.CPU for c in chunks]
        assert engine.lookup([c.key for c in chunks]) == want
    good = [b for c in chunks if c.key not in lost for b in c.block_ids]
    assert same(t[good], before[good])
    async with kvtier.TransferEngine(layout, config()) as engine:  # restarted, fault gone
        want = [kvtier.Residency.MISS if c.key in lost else kvtier.Residency.NVME for c in chunks]
        assert engine.lookup([c.key for c in chunks]) == want
        out = await engine.load(chunks)
        assert set(out.loaded) == {c.key for c in chunks} - lost
