"""The torch copy path batches a job's chunks by (group, start, length).

The torch path (CUDA hosts' code) is forced on CPU tensors by replacing
``kvtier._engine.host_pieces``. With ``copy_threads=1`` a job is ONE
``run_plan`` call, as on a CUDA stream, so every batch spans the whole job.

* The tricky layouts of tests/engine/copy_layouts.py (multi-piece
  pages, odd payload prefixes shifting later layers to byte-aligned slot
  offsets, aliases in and across groups, strided slices, K/V-first pieces),
  each with several chunks per (group, sub-block range) in ONE store job and
  ONE load job: scattered, consecutive and reversed ids, a repeated id and two
  identical id lists (stores allow both), partial ranges, single sub-blocks
  at both ends. The torch path's slot bytes and loaded bytes must equal the
  NumPy path's, and every chunk must have gone through ``_torch_batch``.
* Order: two loads of one job into the same GPU block leave the later one's
  bytes, on the NumPy path and on the torch path. Run batch after batch in the
  order of their first chunk, ``_run_torch`` would copy a later chunk of an
  earlier batch before an earlier chunk of a later batch; a load that writes a
  page twice goes chunk by chunk in plan order (two regression tests).
* A failure in the middle of a batch: the job fails, no block receives bytes
  that are not its own, and the engine keeps working.
* Single-chunk batches and an empty plan.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import kvtier
import kvtier._transfer as transfer
from kvtier.errors import TransferError
from tests.engine.copy_layouts import CASES, NB, LayoutCase, check_loaded, layout_case
from tests.engine.helpers import fill_random, key, same

# ---------------------------------------------------------------------- helpers


@contextmanager
def _path(monkeypatch: pytest.MonkeyPatch, torch_path: bool) -> Iterator[dict[str, list[int]]]:
    """Select the copy path; record the sizes of ``_torch_batch`` and ``_torch_chunk`` calls."""
    calls: dict[str, list[int]] = {"batch": [], "chunk": []}
    real_batch, real_chunk = transfer._torch_batch, transfer._torch_chunk

    def batch(copies: Any, ids: Any, store: bool) -> None:
        calls["batch"].append(len(copies))
        real_batch(copies, ids, store)

    def chunk(copy: Any, store: bool) -> None:
        calls["chunk"].append(1)
        real_chunk(copy, store)

    with monkeypatch.context() as m:
        m.setattr(transfer, "_torch_batch", batch)
        m.setattr(transfer, "_torch_chunk", chunk)
        if torch_path:
            m.setattr("kvtier._engine.host_pieces", lambda *a, **k: None)
        yield calls


def _config(bpc: int) -> kvtier.EngineConfig:
    return kvtier.EngineConfig(4 << 20, bpc, copy_threads=1)


def _many_chunks(case: LayoutCase, seed: int) -> tuple[list[kvtier.Chunk], list[kvtier.Chunk]]:
    """Several chunks per group and sub-block range; returns (stored chunks, load targets).

    Plan order interleaves groups and ranges, so that a batch's chunks are not
    adjacent. Load targets are distinct over every group (groups may alias).
    """
    rng = random.Random(seed)
    bpc = case.bpc
    two = len(case.groups) > 1
    per_group: dict[int, list[tuple[list[int], int]]] = {}
    for g in case.groups:
        full = [
            rng.sample(range(NB), bpc),  # scattered
            list(range(5 + g, 5 + g + bpc)),  # consecutive: a plain slice on the old path
            list(range(30 + bpc - 1, 30 - 1, -1)),  # reversed run
        ]
        if not two:
            dup = rng.sample(range(NB), bpc - 1)
            full.append([*dup[:1], *dup])  # a repeated id inside one store chunk
            full.append(list(full[0]))  # the same ids as another chunk of the batch
        specs = [(ids, 0) for ids in full]
        specs += [(rng.sample(range(NB), 2), 1) for _ in range(2 if two else 3)]  # [1, 3)
        specs += [([rng.randrange(NB)], bpc - 1) for _ in range(2)]  # last sub-block
        specs += [([rng.randrange(NB)], 0) for _ in range(2)]  # first sub-block
        rng.shuffle(specs)
        per_group[g] = specs
    stored = []
    for i in range(max(len(s) for s in per_group.values())):
        for g, specs in per_group.items():
            if i < len(specs):
                ids, off = specs[i]
                stored.append(kvtier.Chunk(key(f"many.{g}.{i}", g), ids, off))
    total = sum(len(c.block_ids) for c in stored)
    assert total <= NB
    targets = iter(rng.sample(range(NB), total))
    moved = [kvtier.Chunk(c.key, [next(targets) for _ in c.block_ids], c.offset) for c in stored]
    return stored, moved


async def _store_and_load(
    case: LayoutCase, monkeypatch: pytest.MonkeyPatch, torch_path: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, list[int]]]:
    """ONE store job and ONE load job; returns slot images, tensors after the load, calls."""
    case.restore()
    stored, moved = _many_chunks(case, 12)
    before = case.pages()
    with _path(monkeypatch, torch_path) as calls:
        async with kvtier.TransferEngine(case.layout(), _config(case.bpc)) as engine:
            res = await engine.store(stored)
            assert len(res.stored) == len(stored)
            assert engine.stats().store_jobs == 1
            region = engine._region
            assert region is not None
            images = [
                region.slot(engine._pool.get(c.key).slot, engine.slot_nbytes).clone()
                for c in stored
            ]
            case.scribble()
            out = await engine.load(moved)
            assert not out.failed, out.failed
            assert engine.stats().load_jobs == 1
            check_loaded(case, before, list(zip(stored, moved, strict=True)))
            after = [t.clone() for _, t in case.flat()]
    return images, after, calls


# ---------------------------------------------------------------------- bytes


@pytest.mark.parametrize("name", CASES)
async def test_one_job_of_many_chunks_per_batch_matches_the_numpy_path(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    case = layout_case(name)
    np_images, np_after, np_calls = await _store_and_load(case, monkeypatch, torch_path=False)
    assert np_calls == {"batch": [], "chunk": []}  # the NumPy path never reaches torch
    t_images, t_after, t_calls = await _store_and_load(case, monkeypatch, torch_path=True)
    stored, _ = _many_chunks(case, 12)
    # Every chunk went through a batch (each (group, range) has >= 2 chunks), in both jobs.
    assert t_calls["chunk"] == []
    assert all(n >= 2 for n in t_calls["batch"])
    assert sum(t_calls["batch"]) == 2 * len(stored)
    for i, (a, b) in enumerate(zip(np_images, t_images, strict=True)):
        assert same(a, b), f"{name}: slot of chunk {i} differs between the NumPy and torch paths"
    for (n, _), a, b in zip(case.flat(), np_after, t_after, strict=True):
        assert same(a, b), f"{name}: layer {n} after the load differs between the two paths"


async def test_single_chunk_batches_and_an_empty_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunk per (group, range) keeps the per-chunk code; an empty plan copies nothing."""
    case = layout_case("bf16-prefix171-then-wide-layers")
    case.restore()
    before = case.pages()
    chunks = [
        kvtier.Chunk(key("s.full", 0), [9, 2, 7, 5], 0),
        kvtier.Chunk(key("s.part", 0), [3, 4], 1),
        kvtier.Chunk(key("s.last", 0), [6], 3),
    ]
    moved = [kvtier.Chunk(c.key, [NB - 1 - b for b in c.block_ids], c.offset) for c in chunks]
    with _path(monkeypatch, True) as calls:
        transfer.run_plan([], "store")
        transfer.run_plan([], "load")
        assert calls == {"batch": [], "chunk": []}
        async with kvtier.TransferEngine(case.layout(), _config(case.bpc)) as engine:
            assert len((await engine.store(chunks)).stored) == 3
            case.scribble()
            assert not (await engine.load(moved)).failed
    assert calls == {"batch": [], "chunk": [1] * 6}
    check_loaded(case, before, list(zip(chunks, moved, strict=True)))


# ---------------------------------------------------------------------- order


def _plain_layout() -> tuple[kvtier.KVLayout, torch.Tensor]:
    t = torch.empty((NB, 2, 16), dtype=torch.float16)
    fill_random(t, 1212)
    return kvtier.KVLayout.from_tensors({0: {"t": t}}), t


async def _later_load_wins_same_group(monkeypatch: pytest.MonkeyPatch, torch_path: bool) -> None:
    """Plan [q (full), a (sub-blocks [1, 3) into blocks 5, 6), b (full into 4..7)].

    Batches: full = [q, b], partial = [a]. The later load, b, must leave its
    bytes in blocks 5 and 6, as the NumPy path and the per-chunk code do.
    """
    layout, t = _plain_layout()
    src = t.clone()
    q, a, b = (key(n, 0) for n in ("q", "a", "b"))
    with _path(monkeypatch, torch_path):
        async with kvtier.TransferEngine(layout, _config(4)) as engine:
            res = await engine.store(
                [
                    kvtier.Chunk(q, [20, 21, 22, 23]),
                    kvtier.Chunk(a, [0, 1, 2, 3]),
                    kvtier.Chunk(b, [8, 9, 10, 11]),
                ]
            )
            assert len(res.stored) == 3
            t.zero_()
            jobs = engine.stats().load_jobs
            results = await asyncio.gather(
                engine.load([kvtier.Chunk(q, [30, 31, 32, 33])]),
                engine.load([kvtier.Chunk(a, [5, 6], 1)]),
                engine.load([kvtier.Chunk(b, [4, 5, 6, 7])]),
            )
            assert all(not r.failed for r in results)
            assert engine.stats().load_jobs == jobs + 1  # one job: the three calls coalesced
    assert same(t[30:34], src[20:24])
    assert same(t[4], src[8])
    assert same(t[7], src[11])
    assert same(t[5:7], src[9:11]), "blocks 5, 6 hold the earlier load's bytes (a's)"


async def test_numpy_path_later_load_into_a_block_wins_within_one_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await _later_load_wins_same_group(monkeypatch, torch_path=False)


async def test_torch_path_later_load_into_a_block_wins_across_sub_block_ranges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await _later_load_wins_same_group(monkeypatch, torch_path=True)


async def _later_load_wins_across_aliased_groups(
    monkeypatch: pytest.MonkeyPatch, torch_path: bool
) -> None:
    """One tensor in groups 0 and 1. Plan [x (g0), y (g1 into 4..7), z (g0 into 4..7)].

    Batches: g0 = [x, z], g1 = [y]; z is the later load of blocks 4..7.
    """
    t = torch.empty((NB, 64), dtype=torch.uint8)
    fill_random(t, 1213)
    layout = kvtier.KVLayout.from_tensors({0: {"t": t}, 1: {"t": t}})
    src = t.clone()
    x, y, z = key("x", 0), key("y", 1), key("z", 0)
    with _path(monkeypatch, torch_path):
        async with kvtier.TransferEngine(layout, _config(4)) as engine:
            res = await engine.store(
                [
                    kvtier.Chunk(x, [20, 21, 22, 23]),
                    kvtier.Chunk(y, [0, 1, 2, 3]),
                    kvtier.Chunk(z, [8, 9, 10, 11]),
                ]
            )
            assert len(res.stored) == 3
            t.zero_()
            results = await asyncio.gather(
                engine.load([kvtier.Chunk(x, [30, 31, 32, 33])]),
                engine.load([kvtier.Chunk(y, [4, 5, 6, 7])]),
                engine.load([kvtier.Chunk(z, [4, 5, 6, 7])]),
            )
            assert all(not r.failed for r in results)
            assert engine.stats().load_jobs == 1
    assert same(t[30:34], src[20:24])
    assert same(t[4:8], src[8:12]), "blocks 4..7 hold the earlier load's bytes (y's)"


async def test_numpy_path_later_load_wins_across_aliased_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await _later_load_wins_across_aliased_groups(monkeypatch, torch_path=False)


async def test_torch_path_later_load_wins_across_aliased_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await _later_load_wins_across_aliased_groups(monkeypatch, torch_path=True)


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize("direction", ["store", "load"])
async def test_a_failure_in_the_middle_of_a_batch_fails_the_job_and_writes_no_foreign_bytes(
    monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """The job's ``_foreach_copy_`` raises after one slot copy: TransferError, nothing wrong."""
    layout_t = [torch.empty((NB, 2, 8), dtype=torch.bfloat16) for _ in range(3)]
    for i, t in enumerate(layout_t):
        fill_random(t, 1300 + i)
    layout = kvtier.KVLayout.from_tensors({0: {f"l{i}": t for i, t in enumerate(layout_t)}})
    src = [t.clone() for t in layout_t]
    chunks = [
        kvtier.Chunk(key(f"e{i}", 0), [4 * i + 3, 4 * i + 1, 4 * i, 4 * i + 2]) for i in range(4)
    ]
    moved = [kvtier.Chunk(c.key, [b + 20 for b in c.block_ids]) for c in chunks]
    real = torch._foreach_copy_
    seen = collections.Counter[str]()

    def flaky(dst: Any, srcs: Any, **kw: Any) -> Any:
        seen["calls"] += 1
        if seen["calls"] == 1 and not seen["failed"]:
            seen["failed"] += 1
            real(dst[:1], srcs[:1], **kw)  # a partial batch, then the error
            raise RuntimeError("injected foreach failure")
        return real(dst, srcs, **kw)

    with _path(monkeypatch, True) as calls:
        async with kvtier.TransferEngine(layout, _config(4)) as engine:
            if direction == "store":
                with monkeypatch.context() as m:
                    m.setattr(torch, "_foreach_copy_", flaky)
                    res = await engine.store(chunks)
                assert seen["failed"] == 1
                assert res.stored == ()
                assert set(res.rejected) == {c.key for c in chunks}
                assert engine.lookup([c.key for c in chunks]) == [kvtier.Residency.MISS] * 4
                assert len((await engine.store(chunks)).stored) == 4  # slots were freed
                for t in layout_t:
                    t.zero_()
            else:
                assert len((await engine.store(chunks)).stored) == 4
                for t in layout_t:
                    t.zero_()
                with monkeypatch.context() as m:
                    m.setattr(torch, "_foreach_copy_", flaky)
                    out = await engine.load(moved)
                assert seen["failed"] == 1
                assert set(out.failed) == {c.key for c in chunks}
                assert all(isinstance(e, TransferError) for e in out.failed.values())
                # Every block holds zeros or its own bytes; nothing outside the targets.
                for t, s in zip(layout_t, src, strict=True):
                    for c, m2 in zip(chunks, moved, strict=True):
                        for sb, db in zip(c.block_ids, m2.block_ids, strict=True):
                            assert same(t[db], s[sb]) or not t[db].view(torch.uint8).any()
                    assert not t[:20].view(torch.uint8).any()
                    assert not t[36:].view(torch.uint8).any()
                for t in layout_t:
                    t.zero_()
            out = await engine.load(moved)  # the engine still works: keys unpinned
            assert not out.failed
    assert calls["batch"]  # the batched code ran
    for t, s in zip(layout_t, src, strict=True):
        for c, m2 in zip(chunks, moved, strict=True):
            assert same(t[list(m2.block_ids)], s[list(c.block_ids)])
