"""The NumPy copy path and the callback-driven job flow.

Some tests guard against regressions; the others are checks of what holds
(each can fail: wrong bytes, leaked slots/pins, hangs, copies still running
after ``aclose``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvtier
import kvtier._transfer as transfer
from tests.engine.helpers import fill_random, key

from ._model import at_rest


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t.contiguous()


# --------------------------------------------------------------------------- bugs


async def test_multi_piece_layer_with_a_late_piece_starts_and_round_trips() -> None:
    # K/V-first page (2 segments of 64 KiB) with an unpadded payload covering K and
    # 100 bytes of V: two pieces, the second at page_start=65536 > slack of the slot.
    t = torch.empty((2, 6, 65536), dtype=torch.uint8)
    fill_random(t, 3)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"kv": t}}, block_dim=1, payload_nbytes={"kv": 65536 + 100}
    )
    assert [p.page_start for p in layout.group(0).layers[0].pieces] == [0, 65536]
    before = t.clone()
    config = kvtier.EngineConfig(cpu_bytes=layout.slot_nbytes(1) * 4, blocks_per_chunk=1)
    async with kvtier.TransferEngine(layout, config) as engine:
        k = key("late-piece", 0)
        assert (await engine.store([kvtier.Chunk(k, [2])])).stored == (k,)
        t.zero_()
        out = await engine.load([kvtier.Chunk(k, [4])])
        assert out.loaded == (k,)
    assert torch.equal(t[0, 4], before[0, 2])
    assert torch.equal(t[1, 4, :100], before[1, 2, :100])


# pickle.dumps(OffloadKey(b"abc", 1)) as written by a kvtier whose OffloadKey had no cached hash.
_OLD_KEY_PICKLE = (
    b"\x80\x04\x950\x00\x00\x00\x00\x00\x00\x00\x8c\rkvtier._types\x94\x8c\nOffloadKey"
    b"\x94\x93\x94)\x81\x94]\x94(C\x03abc\x94K\x01eb."
)


def test_key_pickled_by_the_previous_version_is_hashable() -> None:
    k = pickle.loads(_OLD_KEY_PICKLE)
    assert k == kvtier.OffloadKey(b"abc", 1)
    assert {kvtier.OffloadKey(b"abc", 1): 1}[k] == 1


def test_offload_key_asdict_round_trips() -> None:
    k = key("asdict", 2)
    assert kvtier.OffloadKey(**dataclasses.asdict(k)) == k


# --------------------------------------------------------------------------- OffloadKey


def test_offload_key_copies_and_pickles_keep_hash_and_equality() -> None:
    k = key("copies", 7)
    clones = [copy.copy(k), copy.deepcopy(k), dataclasses.replace(k)]
    clones += [
        pickle.loads(pickle.dumps(k, protocol=p)) for p in range(pickle.HIGHEST_PROTOCOL + 1)
    ]
    for c in clones:
        assert c == k
        assert hash(c) == hash(k)
        assert {k: 1}[c] == 1
    moved = dataclasses.replace(k, group_id=8)
    assert moved != k
    assert hash(moved) == hash(kvtier.OffloadKey(k.block_hash, 8))


def test_offload_key_unpickled_in_another_process_matches_fresh_keys() -> None:
    keys = [key(i, i % 3) for i in range(4)]
    code = (
        "import pickle, sys, kvtier\n"
        "keys = pickle.loads(sys.stdin.buffer.read())\n"
        "fresh = {kvtier.OffloadKey(k.block_hash, k.group_id): i for i, k in enumerate(keys)}\n"
        "print(all(fresh[k] == i and hash(k) == hash(kvtier.OffloadKey(k.block_hash, k.group_id))"
        " for i, k in enumerate(keys)))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="4242")
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(keys),
        capture_output=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == b"True", out.stderr[-500:]


# --------------------------------------------------------------------------- bytes


_DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64]


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[int, dict, dict, dict, list[torch.Tensor]]:
    """Random groups: any dtype, block dim anywhere, padded rows, unpadded payloads, aliases."""
    nb = draw(st.integers(8, 14))
    groups: dict[int, dict[str, torch.Tensor]] = {}
    bdims: dict[str, int] = {}
    payloads: dict[str, int] = {}
    bases: list[torch.Tensor] = []
    for g in range(draw(st.integers(1, 2))):
        groups[g] = {}
        for i in range(draw(st.integers(1, 2))):
            dtype = draw(st.sampled_from(_DTYPES))
            page = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
            page[-1] *= draw(st.sampled_from([1, 2, 8, 16]))
            bd = draw(st.integers(0, len(page)))
            shape = list(page)
            shape.insert(bd, nb)
            pad = draw(st.sampled_from([0, 0, 1, 3]))
            if pad and bd != len(shape) - 1:
                base = torch.empty((*shape[:-1], shape[-1] + pad), dtype=dtype)
                t = base[..., : shape[-1]]
            else:
                base = t = torch.empty(shape, dtype=dtype)
            fill_random(base, len(bases) + 7)
            bases.append(base)
            name = f"g{g}.l{i}"
            groups[g][name] = t
            bdims[name] = bd
            if draw(st.booleans()):
                payloads[name] = draw(st.integers(1, math.prod(page) * dtype.itemsize))
        if g == 1 and draw(st.booleans()):  # a hybrid allocator: one tensor in two groups
            first = next(iter(groups[0]))
            groups[1]["alias"] = groups[0][first]
            bdims["alias"] = bdims[first]
    return nb, groups, bdims, payloads, bases


async def _differential_roundtrip(
    layout: kvtier.KVLayout,
    bases: list[torch.Tensor],
    nb: int,
    bpc: int,
    threads: int,
    data: st.DataObject,
) -> None:
    config = kvtier.EngineConfig(
        cpu_bytes=layout.slot_nbytes(bpc) * 12, blocks_per_chunk=bpc, copy_threads=threads
    )
    engine = kvtier.TransferEngine(layout, config)
    try:
        await engine.start()
    except AssertionError:  # test_multi_piece_layer_with_a_late_piece_starts_and_round_trips
        assume(False)
    try:
        g = data.draw(st.sampled_from(layout.group_ids))
        pieces = [p for lay in layout.group(g).layers for p in lay.pieces]
        perm = data.draw(st.permutations(range(nb)))
        chunks, pos = [], 0
        for i in range(data.draw(st.integers(1, min(5, nb // bpc)))):
            full = data.draw(st.booleans())
            off = 0 if full else data.draw(st.integers(0, bpc - 1))
            n = bpc if full else data.draw(st.integers(1, bpc - off))
            chunks.append(kvtier.Chunk(key(i, g), perm[pos : pos + n], off))
            pos += n
        expected = {c.key: [p.view8[list(c.block_ids)].clone() for p in pieces] for c in chunks}
        assert len((await engine.store(chunks)).stored) == len(chunks)
        for base in bases:
            _u8(base).fill_(0xAB) if base.is_contiguous() else base.view(torch.uint8).fill_(0xAB)
        dst = data.draw(st.permutations(range(nb)))
        loads, pos = [], 0
        for i in data.draw(st.permutations(range(len(chunks)))):  # same or another slot order
            c = chunks[i]
            loads.append(kvtier.Chunk(c.key, dst[pos : pos + len(c.block_ids)], c.offset))
            pos += len(c.block_ids)
        cut = data.draw(st.integers(0, len(loads)))  # two callers coalesced into one job
        outs = await asyncio.gather(engine.load(loads[:cut]), engine.load(loads[cut:]))
        assert not any(o.failed for o in outs)
        for c in loads:
            for p, want in zip(pieces, expected[c.key], strict=True):
                assert torch.equal(p.view8[list(c.block_ids)], want), (c, p.page_start)
                p.view8[list(c.block_ids)] = 0xAB
        for base in bases:  # nothing outside the loaded payloads was written
            assert bool((base.view(torch.uint8) == 0xAB).all())
        await at_rest(engine)
    finally:
        await engine.aclose()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(_layouts(), st.integers(1, 4), st.integers(1, 2), st.data())
def test_numpy_path_round_trips_random_layouts_bitwise(
    lay: tuple[int, dict, dict, dict, list[torch.Tensor]],
    bpc: int,
    threads: int,
    data: st.DataObject,
) -> None:
    nb, groups, bdims, payloads, bases = lay
    try:
        layout = kvtier.KVLayout.from_tensors(groups, block_dim=bdims, payload_nbytes=payloads)
    except kvtier.errors.LayoutError:
        assume(False)
    asyncio.run(_differential_roundtrip(layout, bases, nb, bpc, threads, data))


async def test_full_chunks_in_consecutive_slots_next_to_partial_chunks() -> None:
    """One _load_run per layer over consecutive slots, partial chunks around it, byte fallback."""
    nb, bpc = 40, 3
    a = torch.empty((nb, 3, 7), dtype=torch.uint8)  # odd payload: later layers are unaligned
    b = torch.empty((2, nb, 5, 8), dtype=torch.float16)  # K/V-first, strided
    fill_random(a, 1)
    fill_random(b, 2)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"a": a, "b": b}}, block_dim={"a": 0, "b": 1}, payload_nbytes={"b": 2 * 5 * 8 * 2 - 6}
    )
    before_a, before_b = a.clone(), b.clone()
    config = kvtier.EngineConfig(cpu_bytes=layout.slot_nbytes(bpc) * 8, blocks_per_chunk=bpc)
    async with kvtier.TransferEngine(layout, config) as engine:
        specs = [(0, 3), (0, 3), (1, 2), (0, 3), (0, 3), (0, 3), (0, 1), (0, 3)]
        chunks, nxt = [], 0
        for i, (off, n) in enumerate(specs):
            chunks.append(kvtier.Chunk(key(i, 0), list(range(nxt, nxt + n)), off))
            nxt += n
        res = await engine.store(chunks)
        assert res.stored == tuple(c.key for c in chunks)
        slots = [engine._pool.get(c.key).slot for c in chunks]
        assert slots == sorted(slots)
        a.zero_()
        b.zero_()
        rng = random.Random(5)
        dst = list(range(nb))
        rng.shuffle(dst)
        loads, pos = [], 0
        for c in chunks:
            loads.append(kvtier.Chunk(c.key, dst[pos : pos + len(c.block_ids)], c.offset))
            pos += len(c.block_ids)
        out = await engine.load(loads)
        assert not out.failed
        for c, ld in zip(chunks, loads, strict=True):
            assert torch.equal(a[list(ld.block_ids)], before_a[list(c.block_ids)])
        # b: compare the transferred prefix of each page (first 154 bytes of K then V)
        kb = _u8(b.movedim(1, 0))
        ko = _u8(before_b.movedim(1, 0))
        for c, ld in zip(chunks, loads, strict=True):
            got = kb[list(ld.block_ids)].reshape(len(c.block_ids), -1)
            want = ko[list(c.block_ids)].reshape(len(c.block_ids), -1)
            assert torch.equal(got[:, : 2 * 5 * 8 * 2 - 6], want[:, : 2 * 5 * 8 * 2 - 6])
            assert bool((got[:, 2 * 5 * 8 * 2 - 6 :] == 0).all())
        await at_rest(engine)


# --------------------------------------------------------------------------- flow


def _small_engine(
    nb: int = 64, slots: int = 16, bpc: int = 4, **kw: object
) -> tuple[kvtier.KVLayout, torch.Tensor, kvtier.EngineConfig]:
    t = torch.empty((nb, 2, 4, 64), dtype=torch.float16)
    fill_random(t, 11)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    config = kvtier.EngineConfig(
        cpu_bytes=layout.slot_nbytes(bpc) * slots, blocks_per_chunk=bpc, **kw
    )
    return layout, t, config


@pytest.mark.parametrize("kind", ["sleep0", "time"])
async def test_store_and_load_cancelled_at_every_iteration(kind: str) -> None:
    layout, t, config = _small_engine(copy_threads=2, max_batch_chunks=1)
    src = t.clone()
    async with kvtier.TransferEngine(layout, config) as engine:
        for n in range(16):
            k = key(f"{kind}{n}", 0)
            ids = [(4 * n + j) % 32 for j in range(4)]
            task = asyncio.ensure_future(engine.store([kvtier.Chunk(k, ids)]))
            for _ in range(n):
                await (asyncio.sleep(0) if kind == "sleep0" else asyncio.sleep(0.0002))
            task.cancel()
            try:
                res = await task
                assert res.stored == (k,)
            except asyncio.CancelledError:
                pass
            await at_rest(engine)
            if engine.lookup([k])[0] is not kvtier.Residency.CPU:
                continue
            dst = [32 + (7 * n + j) % 32 for j in range(4)]
            t[dst] = 0
            load = asyncio.ensure_future(engine.load([kvtier.Chunk(k, dst)]))
            for _ in range(n % 5):
                await asyncio.sleep(0)
            load.cancel()
            (outcome,) = await asyncio.gather(load, return_exceptions=True)
            assert isinstance(outcome, asyncio.CancelledError) or outcome.loaded == (k,)
            await at_rest(engine)
            # a cancelled load may or may not have written: all of the key's bytes or none
            got = t[dst]
            assert torch.equal(_u8(got), _u8(src[ids])) or bool((got == 0).all())
            out = await engine.load([kvtier.Chunk(k, dst)])
            assert out.loaded == (k,)
            assert torch.equal(_u8(t[dst]), _u8(src[ids]))
            t.copy_(src)


async def test_cancel_right_after_the_copy_finished_keeps_no_slot_busy() -> None:
    layout, t, config = _small_engine()
    src = t.clone()
    async with kvtier.TransferEngine(layout, config) as engine:
        for n in range(8):
            k = key(f"late{n}", 0)
            ids = [4 * n + j for j in range(4)]
            task = asyncio.ensure_future(engine.store([kvtier.Chunk(k, ids)]))
            await asyncio.sleep(0)
            while engine.lookup([k])[0] is kvtier.Residency.PENDING:  # noqa: ASYNC110
                await asyncio.sleep(0)
            task.cancel()  # the copy has ended; the caller has not resumed yet (or just did)
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
            assert isinstance(outcome, asyncio.CancelledError) or outcome.stored == (k,)
            stats = await at_rest(engine)
            assert stats.slots_resident == n + 1  # committed before the cancel: kept
            dst = [40 + j for j in range(4)]
            load = asyncio.ensure_future(engine.load([kvtier.Chunk(k, dst)]))
            await asyncio.sleep(0)
            assert engine.stats().slots_pinned == 1
            while engine.stats().slots_pinned:  # noqa: ASYNC110 - polling the copy's end
                await asyncio.sleep(0)
            load.cancel()
            (outcome,) = await asyncio.gather(load, return_exceptions=True)
            assert isinstance(outcome, asyncio.CancelledError) or outcome.loaded == (k,)
            await at_rest(engine)
            assert torch.equal(_u8(t[dst]), _u8(src[ids]))


@pytest.mark.parametrize("seed", [1, 2])
async def test_many_callers_small_batches_cancellations_and_eviction(seed: int) -> None:
    """Several jobs queued per direction (worker-thread starts), cancels, evictions: bytes exact."""
    rng = random.Random(seed)
    nb, bpc = 256, 4
    t0 = torch.empty((nb, 2, 4, 32), dtype=torch.float16)
    t1 = torch.empty((2, nb, 3, 16), dtype=torch.bfloat16)
    fill_random(t0, 1)
    fill_random(t1, 2)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t0}, 1: {"b": t1}}, block_dim={"a": 0, "b": 1})
    config = kvtier.EngineConfig(
        cpu_bytes=layout.slot_nbytes(bpc) * 10,
        blocks_per_chunk=bpc,
        copy_threads=2,
        max_batch_chunks=rng.choice([1, 2, 3]),
        eviction="arc" if seed % 2 else "lru",
    )

    def blocks(g: int, ids: list[int]) -> torch.Tensor:
        return _u8(t0[ids] if g == 0 else t1[:, ids])

    shape: dict[kvtier.OffloadKey, tuple[list[int], int]] = {}
    for i in range(24):
        for g in range(2):
            kr = random.Random(1000 * seed + 2 * i + g)
            full = kr.random() < 0.6
            off = 0 if full else kr.randrange(bpc)
            n = bpc if full else kr.randrange(1, bpc - off + 1)
            base = (i % 12) * bpc  # sources live in blocks 0..47 and never change
            shape[key(i, g)] = (list(range(base + off, base + off + n)), off)
    want = {k: blocks(k.group_id, ids) for k, (ids, _) in shape.items()}
    free = list(range(48, nb))  # destinations; a cancelled load's blocks are never reused

    async with kvtier.TransferEngine(layout, config) as engine:

        async def store(k: kvtier.OffloadKey) -> None:
            ids, off = shape[k]
            res = await engine.store([kvtier.Chunk(k, ids, off)])
            assert set(res.stored) | set(res.skipped) | set(res.rejected) == {k}

        async def load(k: kvtier.OffloadKey) -> None:
            ids, off = shape[k]
            if len(free) < len(ids):
                return
            rng.shuffle(free)
            dst = [free.pop() for _ in ids]
            try:
                res = await engine.load([kvtier.Chunk(k, dst, off)])
            except kvtier.errors.NotStoredError:
                free.extend(dst)
                return
            if k in res.loaded:
                assert torch.equal(blocks(k.group_id, dst), want[k]), f"wrong bytes for {k}"
            free.extend(dst)

        tasks = []
        for _ in range(220):
            k = key(rng.randrange(24), rng.randrange(2))
            tasks.append(asyncio.ensure_future(store(k) if rng.random() < 0.5 else load(k)))
            if rng.random() < 0.15:
                tasks[-1].cancel()
            r = rng.random()
            if r < 0.3:
                await asyncio.sleep(0)
            elif r < 0.35:
                await asyncio.sleep(0.001)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        bad = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(r, asyncio.CancelledError) for r in bad), bad[:3]
        stats = await at_rest(engine)
        assert stats.store_jobs > 1
        assert stats.load_jobs > 1
        for k in shape:  # every resident key still loads its own bytes
            if engine.lookup([k])[0] is kvtier.Residency.CPU:
                ids, off = shape[k]
                dst = free[: len(ids)]
                assert (await engine.load([kvtier.Chunk(k, dst, off)])).loaded == (k,)
                assert torch.equal(blocks(k.group_id, dst), want[k])


async def test_failed_copy_in_a_multi_call_job_fails_only_its_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = transfer.run_plan

    def failing(plan: list[transfer.ChunkCopy], direction: str, **kw: Any) -> None:
        if any(13 in c.block_ids for c in plan):
            raise RuntimeError("injected copy failure")
        real(plan, direction, **kw)

    monkeypatch.setattr(transfer, "run_plan", failing)
    layout, t, config = _small_engine(copy_threads=2)
    src = t.clone()
    async with kvtier.TransferEngine(layout, config) as engine:
        ks = [key(f"iso{i}", 0) for i in range(4)]
        ids = [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23], [24, 25, 26, 27]]
        res = await asyncio.gather(
            *(engine.store([kvtier.Chunk(k, b)]) for k, b in zip(ks, ids, strict=True))
        )
        assert [r.stored for r in res] == [(ks[0],), (), (ks[2],), (ks[3],)]
        assert res[1].rejected == (ks[1],)
        assert engine.lookup([ks[1]]) == [kvtier.Residency.MISS]
        stats = await at_rest(engine)
        assert stats.slots_resident == 3
        assert stats.failures.get("transfer") == 1
        t[32:] = 0
        # ks[2], ks[3] sit in consecutive slots: one _load_run; ks[0] goes to block 13
        outs = await asyncio.gather(
            engine.load([kvtier.Chunk(ks[0], [13, 33, 34, 35])]),
            engine.load(
                [kvtier.Chunk(ks[2], [40, 41, 42, 43]), kvtier.Chunk(ks[3], [50, 51, 52, 53])]
            ),
        )
        assert isinstance(outs[0].failed[ks[0]], kvtier.errors.TransferError)
        assert outs[1].loaded == (ks[2], ks[3])
        assert torch.equal(_u8(t[40:44]), _u8(src[20:24]))
        assert torch.equal(_u8(t[50:54]), _u8(src[24:28]))
        assert bool((t[33:36] == 0).all())
        await at_rest(engine)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_aclose_waits_for_every_queued_job(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    real = transfer.run_plan
    lock = threading.Lock()
    inflight = [0]

    def slow(plan: list[transfer.ChunkCopy], direction: str, **kw: Any) -> None:
        with lock:
            inflight[0] += 1
        try:
            time.sleep(0.01)
            real(plan, direction, **kw)
        finally:
            with lock:
                inflight[0] -= 1

    monkeypatch.setattr(transfer, "run_plan", slow)
    rng = random.Random(seed)
    layout, _, config = _small_engine(slots=12, copy_threads=2, max_batch_chunks=1)
    engine = await kvtier.TransferEngine(layout, config).start()
    k_old = key("old", 0)
    assert (await engine.store([kvtier.Chunk(k_old, [60, 61, 62, 63])])).stored == (k_old,)
    stores = [
        asyncio.ensure_future(
            engine.store([kvtier.Chunk(key(i, 0), [4 * i + j for j in range(4)])])
        )
        for i in range(6)
    ]
    loads = [
        asyncio.ensure_future(
            engine.load([kvtier.Chunk(k_old, [40 + 4 * i + j for j in range(4)])])
        )
        for i in range(3)
    ]
    await asyncio.sleep(rng.uniform(0, 0.03))
    for task in stores + loads:
        if rng.random() < 0.3:
            task.cancel()
    await engine.aclose()
    assert inflight[0] == 0
    assert all(task.done() for task in stores + loads)
    stats = engine.stats()
    assert stats.slots_writing == 0
    assert stats.slots_pinned == 0
    for task in stores:
        if not task.cancelled():
            assert len(task.result().stored) == 1
    with pytest.raises(kvtier.EngineClosedError):
        await engine.store([kvtier.Chunk(key("late", 0), [0])])


def test_background_engine_from_threads_exact_bytes() -> None:
    t = torch.empty((128, 1024), dtype=torch.uint8)
    fill_random(t, 1)
    src = t[:64].clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    config = kvtier.EngineConfig(layout.slot_nbytes(2) * 64, 2, max_batch_chunks=2)
    errors: list[BaseException] = []
    with kvtier.BackgroundEngine(layout, config) as bg:

        def worker(w: int) -> None:
            rng = random.Random(w)
            try:
                for it in range(25):
                    i = rng.randrange(8) + 8 * w
                    k = key(i, 0)
                    bg.store([kvtier.Chunk(k, [2 * i, 2 * i + 1])]).result(timeout=30)
                    d = 64 + 2 * (w * 8 + it % 8)
                    res = bg.load([kvtier.Chunk(k, [d, d + 1])]).result(timeout=30)
                    assert res.loaded == (k,)
                    assert torch.equal(t[[d, d + 1]], src[[2 * i, 2 * i + 1]])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        stats = bg.stats()
    assert not errors, errors[:2]
    assert stats.slots_pinned == 0
    assert stats.slots_writing == 0
