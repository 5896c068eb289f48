"""A hold pins the slot of a held NVMe-only key once promoted.

``TransferEngine.hold`` pins the row of a key only on NVMe; a load or
prefetch that promotes it into a CPU slot has the hold pin that slot
too (``NVMeWriter.promote`` -> ``TransferEngine._hold_promoted``), until the
hold ends. These tests end holds at every point of a promotion (released,
dropped and collected, closed) and make promotions fail, wait, be cancelled
and find no room, and check that every pin comes back exactly once.

Only real seams: the public API, ``NVMeConfig(row_io_wrapper=...)`` RowIO
wrappers over the real backend, real threads and the real garbage collector.
Ending a hold of an NVMe-only key must not cost O(holds of that key) (the
"Regression" test at the end checks the accounting, not the time).
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from tests.engine.helpers import (
    Gate,
    GatedRowIO,
    chunk_chain,
    keys_of,
    loop_errors,
    nvme_only,
    nvme_rows,
    one_group,
    settle,
    until,
)

M, P, C, N = (
    kvtier.Residency.MISS,
    kvtier.Residency.PENDING,
    kvtier.Residency.CPU,
    kvtier.Residency.NVME,
)


def _pins(engine: Any) -> tuple[int, int]:
    """(slots pinned, rows pinned)."""
    st = engine.stats()
    return st.slots_pinned, st.nvme["rows_pinned"]


def _slot_refs(engine: kvtier.TransferEngine) -> int:
    """Every pin of every slot (a slot pinned twice counts twice)."""
    return sum(e.refs for e in list(engine._pool.entries()))


class _FlipRowIO(GatedRowIO):
    """Gated reads; while ``flip`` is set every read lands with one payload byte flipped."""

    flip = False

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        n = super().preadv(handle, bufs, file_offset)
        if type(self).flip:
            for b in bufs:  # one buffer per row
                buf = memoryview(b).cast("B")
                buf[7] ^= 1
        return n


class _OneFlip(GatedRowIO):
    """Flips a payload byte of the first row of the next ``left`` reads."""

    left = 0

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        n = super().preadv(handle, bufs, file_offset)
        if type(self).left > 0:
            type(self).left -= 1
            buf = memoryview(bufs[0]).cast("B")
            buf[7] ^= 1
        return n


def _config(
    tmp_path: Path, slots: int, gate: Gate, row_io: type[GatedRowIO] = GatedRowIO, **kw: Any
) -> kvtier.EngineConfig:
    """``slots`` CPU slots of :func:`one_group`, NVMe rows through ``row_io(inner, gate)``."""
    layout_slot = one_group()[2]
    return kvtier.EngineConfig(
        slots * layout_slot,
        1,
        nvme=nvme_rows(tmp_path, layout_slot, None, row_io_wrapper=lambda i: row_io(i, gate)),
        **kw,
    )


# ===================================================================== holds ending mid-promotion


@pytest.mark.parametrize("bring_in", ["load", "prefetch"])
@pytest.mark.parametrize("end", ["release", "drop", "drop-after-commit"])
async def test_a_hold_ended_while_its_promotion_is_in_flight_pins_nothing_after(
    tmp_path: Path, bring_in: str, end: str
) -> None:
    layout, t, _ = one_group()
    gate = Gate()
    config = _config(tmp_path, 4, gate)
    a = chunk_chain("a", 2, 0)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            box = [engine.hold([*keys_of(a), a[0].key])]  # a0 twice
            assert box[0].residency == (N, N, N)
            gate.armed = True
            if bring_in == "load":
                fut: asyncio.Future[Any] = asyncio.ensure_future(
                    engine.load([kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(a)])
                )
            else:
                fut = asyncio.ensure_future(engine.prefetch(keys_of(a)))
            assert await until(gate.reading.is_set)
            assert engine.lookup(keys_of(a)) == [P, P]
            if end == "release":
                box[0].release()
            elif end == "drop":
                box.clear()
                gc.collect()
                await settle()
            assert engine.stats().holds_dropped == (end == "drop")
            assert engine.stats().nvme["rows_pinned"] == 2  # the reads in flight
            gate.opened.set()
            if end == "drop-after-commit":
                assert await until(lambda: engine.lookup(keys_of(a)) == [C, C])
                assert _slot_refs(engine) >= 3  # a0 twice and a1 by the hold
                box.clear()
                gc.collect()
                await settle()
                assert engine.stats().holds_dropped == 1
            out = await fut
            gate.armed = False
            if bring_in == "load":
                assert out.loaded == tuple(keys_of(a))
                assert torch.equal(t[40], t[0])
                assert torch.equal(t[41], t[1])
            else:
                assert set(out.promoted) == set(keys_of(a))
            assert _pins(engine) == (0, 0)
            assert _slot_refs(engine) == 0
            # the promoted keys are evictable: four new keys take every slot
            res = await engine.store(chunk_chain("x", 4, 10))
            assert len(res.stored) == 4
            assert engine.lookup(keys_of(a)) == [N, N]
    assert not errors


async def test_a_hold_dropped_on_the_read_thread_as_its_row_lands_is_released_once(
    tmp_path: Path,
) -> None:
    """The last reference goes on the executor thread that reads the row: its release is
    scheduled on the loop and races the promotion's commit there."""
    layout, t, _ = one_group()
    gate = Gate()
    config = _config(tmp_path, 4, gate)
    a = chunk_chain("a", 3, 0)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            for round_ in range(6):
                box = [engine.hold(keys_of(a)) for _ in range(3)]
                kept = engine.hold(keys_of(a[1:]))

                def drop(box: list[kvtier.Hold] = box) -> float:
                    box.clear()
                    gc.collect()
                    return 0.0

                gate.delay = drop
                chunks = [kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(a)]
                out = await engine.load(chunks)
                gate.delay = None
                assert out.loaded == tuple(keys_of(a))
                for i in range(3):
                    assert torch.equal(t[40 + i], t[i])
                await settle()
                assert not box
                # only `kept` pins a1, a2 now (in their slots and rows)
                assert _pins(engine) == (2, 2)
                assert _slot_refs(engine) == 2
                kept.release()
                assert _pins(engine) == (0, 0)
                assert engine.stats().holds_dropped == 3 * (round_ + 1)
                res = await engine.store(chunk_chain(f"x{round_}", 4, 10))  # push a back
                assert len(res.stored) == 4
                await engine.flush()
                assert engine.lookup(keys_of(a)) == [N, N, N]
    assert not errors


# ===================================================================== failed promotions


@pytest.mark.parametrize("fault", ["eio", "checksum"])
@pytest.mark.parametrize("bring_in", ["load", "prefetch"])
async def test_a_held_key_whose_promotion_fails_leaves_no_slot_pin(
    tmp_path: Path, fault: str, bring_in: str
) -> None:
    layout, _, _ = one_group()
    gate = Gate()
    _FlipRowIO.flip = False
    config = _config(tmp_path, 4, gate, _FlipRowIO)
    a = chunk_chain("a", 2, 0)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            h1 = engine.hold([a[0].key, a[0].key, a[1].key])
            h2 = engine.hold(keys_of(a[1:]))
            assert _pins(engine) == (0, 2)
            if fault == "eio":
                gate.armed = gate.fail = True
                gate.opened.set()
            else:
                _FlipRowIO.flip = True
            try:
                if bring_in == "load":
                    out = await engine.load(
                        [kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(a)]
                    )
                    assert not out.loaded
                else:
                    out = await engine.prefetch(keys_of(a))
                    assert not out.promoted
            finally:
                gate.armed = gate.fail = False
                _FlipRowIO.flip = False
            assert set(out.failed) == set(keys_of(a))
            kinds = {e.kind for e in out.failed.values()}  # type: ignore[attr-defined]
            assert kinds == {fault}
            assert engine.lookup(keys_of(a)) == [M, M]
            assert _pins(engine) == (0, 2)  # the dropped rows stay held (zombies)
            assert _slot_refs(engine) == 0
            h1.release()
            assert _pins(engine) == (0, 1)
            # a1 is stored again: a new slot and row; the old hold of it pins neither
            res = await engine.store(a[1:])
            assert res.stored == (a[1].key,)
            await engine.flush()
            assert engine.lookup(keys_of(a)) == [M, C]
            assert _slot_refs(engine) == 0
            h2.release()
            assert _pins(engine) == (0, 0)
            res = await engine.store(chunk_chain("x", 4, 10))
            assert len(res.stored) == 4
    assert not errors


async def test_two_holds_of_two_keys_one_promotion_fails_one_lands(tmp_path: Path) -> None:
    layout, t, _ = one_group()
    gate = Gate()
    _FlipRowIO.flip = False
    config = _config(tmp_path, 4, gate, _OneFlip)
    a = chunk_chain("a", 2, 0)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            h1 = engine.hold([a[0].key, a[0].key, a[1].key, a[1].key])
            h2 = engine.hold(keys_of(a))
            _OneFlip.left = 1  # the first row read lands corrupted
            out = await engine.load([kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(a)])
            assert len(out.loaded) == 1
            assert len(out.failed) == 1
            good = out.loaded[0]
            i = keys_of(a).index(good)
            assert torch.equal(t[40 + i], t[i])
            assert _pins(engine) == (1, 2)  # the good slot; the good row and the dropped one
            assert _slot_refs(engine) == 3  # twice by h1, once by h2
            h1.release()
            assert _pins(engine) == (1, 2)
            assert _slot_refs(engine) == 1
            h2.release()
            assert _pins(engine) == (0, 0)
            res = await engine.store(chunk_chain("x", 4, 10))
            assert len(res.stored) == 4
    assert not errors


async def test_a_held_key_whose_row_failed_then_restored_and_promoted_again_is_released_once(
    tmp_path: Path,
) -> None:
    """The hold of a row that failed its read still names its key: the key stored again,
    evicted to NVMe and promoted is pinned by that hold, and unpinned once by its release."""
    layout, t, _ = one_group()
    gate = Gate()
    config = _config(tmp_path, 2, gate)
    a = chunk_chain("a", 1, 0)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            held = engine.hold(keys_of(a))
            gate.armed = gate.fail = True
            gate.opened.set()
            out = await engine.prefetch(keys_of(a))
            gate.armed = gate.fail = False
            assert set(out.failed) == {a[0].key}
            await engine.store(a)
            await engine.flush()
            res = await engine.store(chunk_chain("x", 2, 10))  # not pinned: evicted
            assert len(res.stored) == 2
            await engine.flush()
            assert engine.lookup(keys_of(a)) == [N]
            out = await engine.load([kvtier.Chunk(a[0].key, [40])])
            assert out.loaded == (a[0].key,)
            assert torch.equal(t[40], t[0])
            slots_pinned, _ = _pins(engine)
            assert slots_pinned == _slot_refs(engine) <= 1
            held.release()
            assert _pins(engine) == (0, 0)
            res = await engine.store(chunk_chain("y", 2, 20))
            assert len(res.stored) == 2
    assert not errors


# ===================================================================== cancelled, waiting, closing


async def test_a_load_cancelled_mid_promotion_leaves_the_hold_pin_alone(tmp_path: Path) -> None:
    layout, t, _ = one_group()
    gate = Gate()
    config = _config(tmp_path, 4, gate)
    a = chunk_chain("a", 2, 0)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            held = engine.hold(keys_of(a))
            gate.armed = True
            loading = asyncio.ensure_future(
                engine.load([kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(a)])
            )
            assert await until(gate.reading.is_set)
            loading.cancel()
            await settle()
            assert not loading.done()  # it waits for the read in flight
            gate.opened.set()
            with pytest.raises(asyncio.CancelledError):
                await loading
            gate.armed = False
            assert engine.lookup(keys_of(a)) == [C, C]
            assert _pins(engine) == (2, 2)  # the hold's, not the cancelled load's
            assert _slot_refs(engine) == 2
            res = await engine.store(chunk_chain("x", 4, 10))
            assert len(res.stored) == 2  # the held keys stay
            out = await engine.load([kvtier.Chunk(c.key, [50 + i]) for i, c in enumerate(a)])
            assert out.loaded == tuple(keys_of(a))
            assert torch.equal(t[50], t[0])
            assert torch.equal(t[51], t[1])
            held.release()
            await engine.flush()  # the new keys' slots are pinned until written
            assert _pins(engine) == (0, 0)
            assert _slot_refs(engine) == 0
    assert not errors


async def test_loads_of_one_block_wait_their_turn_while_the_hold_is_released(
    tmp_path: Path,
) -> None:
    layout, t, _ = one_group()
    gate = Gate()
    config = _config(tmp_path, 4, gate)
    a = chunk_chain("a", 1, 0)
    b = chunk_chain("b", 1, 5)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            await engine.store(b)
            held = engine.hold([*keys_of(a), *keys_of(b)])
            assert held.residency == (N, C)
            gate.armed = True
            first = asyncio.ensure_future(engine.load([kvtier.Chunk(a[0].key, [40])]))
            assert await until(gate.reading.is_set)
            second = asyncio.ensure_future(engine.load([kvtier.Chunk(b[0].key, [40])]))
            third = asyncio.ensure_future(engine.load([kvtier.Chunk(a[0].key, [41])]))
            await settle()
            assert not second.done()  # behind the first, which writes block 40 too
            held.release()
            gate.opened.set()
            outs = await asyncio.gather(first, second, third)
            gate.armed = False
            assert [o.loaded for o in outs] == [(a[0].key,), (b[0].key,), (a[0].key,)]
            assert torch.equal(t[40], t[5])  # the later call's bytes
            assert torch.equal(t[41], t[0])
            await engine.flush()  # b's write-through pins its slot until written
            assert _pins(engine) == (0, 0)
            assert _slot_refs(engine) == 0
    assert not errors


@pytest.mark.parametrize("hard", [False, True])
async def test_aclose_with_a_held_keys_promotion_in_flight(tmp_path: Path, hard: bool) -> None:
    layout, t, _ = one_group()
    gate = Gate()
    config = _config(tmp_path, 4, gate)
    a = chunk_chain("a", 2, 0)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        engine = await kvtier.TransferEngine(layout, config).start()
        held = engine.hold(keys_of(a))
        box = [engine.hold(keys_of(a))]
        gate.armed = True
        loading = asyncio.ensure_future(
            engine.load([kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(a)])
        )
        prefetching = asyncio.ensure_future(engine.prefetch(keys_of(a)))
        assert await until(gate.reading.is_set)
        closing = asyncio.ensure_future(engine.aclose(hard=hard))
        await settle()
        assert held.released
        assert not closing.done()  # waits for the load
        box.clear()
        gc.collect()
        await settle()
        gate.opened.set()
        out = await loading
        pre = await prefetching
        await closing
        gate.armed = False
        assert out.loaded == tuple(keys_of(a))
        assert torch.equal(t[40], t[0])
        assert torch.equal(t[41], t[1])
        assert set(pre.resident) == set(keys_of(a))
        assert _pins(engine) == (0, 0)
        assert _slot_refs(engine) == 0
    assert not errors


# ===================================================================== no room


@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_prefetch_of_held_keys_into_a_pool_the_hold_fills_fails_cleanly(
    tmp_path: Path, eviction: str
) -> None:
    layout, t, _ = one_group()
    gate = Gate()
    config = _config(tmp_path, 2, gate, eviction=eviction)
    a = chunk_chain("a", 4, 0)
    await nvme_only(layout, config, a[2:])
    await nvme_only(layout, config, a[:2])
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            held = engine.hold(keys_of(a))
            assert held.residency == (N, N, N, N)
            pre = await asyncio.wait_for(engine.prefetch(keys_of(a)), 10)
            assert len(pre.promoted) == 2
            assert len(pre.failed) == 2
            assert all(isinstance(e, kvtier.errors.KVTierError) for e in pre.failed.values())
            assert _pins(engine) == (2, 4)
            # every slot pinned by the hold: stores are rejected, promotions find no room
            res = await engine.store(chunk_chain("x", 2, 10))
            assert len(res.rejected) == 2
            rest = [k for k in keys_of(a) if k not in pre.promoted]
            out = await asyncio.wait_for(
                engine.load([kvtier.Chunk(k, [40 + i]) for i, k in enumerate(rest)]), 10
            )
            assert not out.loaded
            assert engine.lookup(rest) == [N, N]  # a rejected promotion keeps the row
            again = await asyncio.wait_for(engine.prefetch(rest), 10)
            assert not again.promoted
            # the promoted ones load from their slots
            index = {c.key: i for i, c in enumerate(a)}
            out = await engine.load([kvtier.Chunk(k, [50 + index[k]]) for k in pre.promoted])
            assert set(out.loaded) == set(pre.promoted)
            for k in pre.promoted:
                assert torch.equal(t[50 + index[k]], t[index[k]])
            assert _pins(engine) == (2, 4)
            held.release()
            assert _pins(engine) == (0, 0)
            out = await engine.load([kvtier.Chunk(k, [40 + i]) for i, k in enumerate(rest)])
            assert set(out.loaded) == set(rest)
            for i, k in enumerate(rest):
                assert torch.equal(t[40 + i], t[index[k]])
            assert _pins(engine) == (0, 0)
    assert not errors


# ===================================================================== a store, two holds


async def test_a_store_of_a_held_nvme_key_is_skipped_and_its_promotion_pinned(
    tmp_path: Path,
) -> None:
    layout, t, _ = one_group()
    gate = Gate()
    config = _config(tmp_path, 4, gate)
    a = chunk_chain("a", 2, 0)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            h1 = engine.hold(keys_of(a))
            h2 = engine.hold([a[0].key, a[0].key])
            res = await engine.store(a, durable=True)
            assert res.skipped == tuple(keys_of(a))
            assert engine.lookup(keys_of(a)) == [N, N]
            await engine.prefetch(keys_of(a))
            assert engine.lookup(keys_of(a)) == [C, C]
            assert _slot_refs(engine) == 4  # a0: h1, h2 twice; a1: h1
            res = await engine.store(a, durable=True)  # present on both media: skipped
            assert res.skipped == tuple(keys_of(a))
            h3 = engine.hold(keys_of(a))  # CPU now: pins the slots
            assert h3.residency == (C, C)
            assert _slot_refs(engine) == 6
            h1.release()
            assert _slot_refs(engine) == 4
            assert _pins(engine) == (2, 1)  # a0's row, by h2
            h2.release()
            assert _pins(engine) == (2, 0)
            res = await engine.store(chunk_chain("x", 4, 10))
            assert len(res.stored) == 2
            h3.release()
            await engine.flush()
            assert _pins(engine) == (0, 0)
            out = await engine.load([kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(a)])
            assert out.loaded == tuple(keys_of(a))
            assert torch.equal(t[40], t[0])
            assert torch.equal(t[41], t[1])
    assert not errors


# ===================================================================== BackgroundEngine


def test_background_engine_hold_prefetch_and_release_from_another_thread(tmp_path: Path) -> None:
    layout, t, _ = one_group()
    gate = Gate()
    config = _config(tmp_path, 4, gate)
    a = chunk_chain("a", 3, 0)
    with kvtier.BackgroundEngine(layout, config) as bg:
        bg.store(a, durable=True).result(30)
    with kvtier.BackgroundEngine(layout, config) as bg:
        held = bg.hold(keys_of(a))
        assert held.residency == (N, N, N)
        gate.armed = True
        pre = bg.prefetch(keys_of(a[:2]))
        assert gate.reading.wait(10)
        other = bg.hold(keys_of(a[:2]))
        assert other.residency == (P, P)  # in flight: not held
        gate.opened.set()
        assert set(pre.result(30).promoted) == set(keys_of(a[:2]))
        gate.armed = False
        assert bg.stats().slots_pinned == 2
        res = bg.store(chunk_chain("x", 4, 10)).result(30)
        assert len(res.stored) == 2
        assert bg.lookup(keys_of(a)) == [C, C, N]
        th = threading.Thread(target=held.release)
        th.start()
        th.join(10)
        assert held.released
        other.release()
        bg.flush().result(30)
        st = bg.stats()
        assert st.slots_pinned == 0
        assert st.nvme["rows_pinned"] == 0
        out = bg.load([kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(a)]).result(30)
        assert out.loaded == tuple(keys_of(a))
        for i in range(3):
            assert torch.equal(t[40 + i], t[i])


# ===================================================================== a storm


async def test_holds_promotions_drops_and_cancellations_at_random_return_every_pin(
    tmp_path: Path,
) -> None:
    """Many holds over NVMe keys, begun and ended while loads and prefetches promote them
    (reads delayed at random), some loads cancelled: no pin is lost or dropped twice."""
    layout, t, _ = one_group(num_blocks=128)
    gate = Gate()
    rng = random.Random(19)
    gate.delay = lambda: rng.random() * 0.002
    slot = layout.slot_nbytes(1)
    config = kvtier.EngineConfig(
        6 * slot, 1, nvme=nvme_rows(tmp_path, slot, None, row_io_wrapper=gate.wrap)
    )
    a = chunk_chain("a", 12, 0)
    await nvme_only(layout, config, a)
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            holds: list[kvtier.Hold] = []
            tasks: list[asyncio.Future[Any]] = []
            free = list(range(40, 100))
            wrong: list[tuple[int, int]] = []
            loaded = [0]

            def check(fut: asyncio.Future[Any], pairs: list[tuple[int, int]]) -> None:
                # at the load's end, before another load may reuse its blocks
                if not fut.cancelled():
                    out = fut.result()
                    for blk, i in pairs:
                        if a[i].key in out.loaded:
                            loaded[0] += 1
                            if not torch.equal(t[blk], t[i]):
                                wrong.append((blk, i))
                free.extend(blk for blk, _ in pairs)

            for step in range(300):
                op = rng.random()
                if op < 0.25:
                    holds.append(engine.hold(rng.sample(keys_of(a), rng.randint(1, 4))))
                elif op < 0.4 and holds:
                    holds.pop(rng.randrange(len(holds))).release()
                elif op < 0.5 and holds:
                    holds.pop(rng.randrange(len(holds)))  # dropped
                    if rng.random() < 0.3:
                        gc.collect()
                elif op < 0.75 and len(free) >= 3:
                    idx = rng.sample(range(12), rng.randint(1, 3))
                    pairs = [(free.pop(), i) for i in idx]  # blocks no other load writes
                    fut = asyncio.ensure_future(
                        engine.load([kvtier.Chunk(a[i].key, [blk]) for blk, i in pairs])
                    )
                    fut.add_done_callback(lambda f, p=pairs: check(f, p))
                    tasks.append(fut)
                    if rng.random() < 0.2:
                        asyncio.get_running_loop().call_later(0.0005, fut.cancel)
                elif op < 0.9:
                    idx = rng.sample(range(12), rng.randint(1, 4))
                    tasks.append(asyncio.ensure_future(engine.prefetch([a[i].key for i in idx])))
                else:
                    tasks.append(
                        asyncio.ensure_future(engine.store(chunk_chain(f"s{step}", 2, 110)))
                    )
                if rng.random() < 0.5:
                    await asyncio.sleep(0)
                if rng.random() < 0.1:
                    await asyncio.sleep(0.001)
            await asyncio.gather(*tasks, return_exceptions=True)
            assert not wrong
            assert loaded[0] > 5  # the storm loaded keys (how many depends on timing)
            assert engine.stats().nvme["promotions"] > 5
            for h in holds:
                h.release()
            holds.clear()
            gc.collect()
            await settle()
            await engine.flush()
            assert _pins(engine) == (0, 0)
            assert _slot_refs(engine) == 0
            res = await engine.store(chunk_chain("z", 6, 120))
            assert len(res.stored) == 6
    assert not errors


# ===================================================================== many holds of one key


async def test_many_holds_of_one_nvme_key_end_in_any_order_and_a_promotion_pins_the_rest(
    tmp_path: Path,
) -> None:
    """Regression (cost, not correctness): the holders of a key are a dict, so ending N
    holds of one shared prefix key does not cost O(N^2) on the loop, as ``list.remove``
    on a list of holders did (30,000 in random order: about 1.8 s, against 0.035 s for
    holds of a CPU key; measured once, not timed here).
    Checked here: holds ended in any order, some listing the key twice, leave exactly the
    open ones' pins for a promotion."""
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(4 * slot, 1, nvme=nvme_rows(tmp_path, slot))
    a = chunk_chain("a", 1, 0)
    await nvme_only(layout, config, a)
    async with kvtier.TransferEngine(layout, config) as engine:
        k = a[0].key
        holds = [engine.hold([k] * (1 + i % 2)) for i in range(3000)]
        order = list(range(3000))
        random.Random(7).shuffle(order)
        kept = order[:5]  # holds 5 open: their entries of k pin the promoted slot
        for i in order[5:]:
            holds[i].release()
        assert engine.stats().nvme["rows_pinned"] == 1
        pre = await engine.prefetch([k])
        assert pre.promoted == (k,)
        entries = sum(1 + i % 2 for i in kept)
        assert engine._pool.get(k) is not None
        for i in kept:
            assert _slot_refs(engine) == entries  # one pin per entry of an open hold
            holds[i].release()
            entries -= 1 + i % 2
        assert entries == 0
        assert _slot_refs(engine) == 0
        assert _pins(engine) == (0, 0)
