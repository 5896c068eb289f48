"""The staged torch copy path: every torch copy goes through ONE device buffer.

``_staged_copy`` copies a batch of chunks (same group, same sub-block start and
length) through a buffer laid out like their slots: a store gathers each piece
with ``index_select`` into a strided view of it, then one contiguous copy per
chunk into its slot bytes ``[lo, hi)``; a load does the reverse. The torch path
(CUDA hosts' code) is forced on CPU tensors by replacing
``kvtier._engine.host_pieces``; the NumPy path (the default CPU path) is the
reference. Checked here:

* Random layouts (hypothesis drives a seeded builder): several pieces per page
  (K/V outside the block dim, the block dim in the middle), unpadded and odd
  payloads, uint8/float16/bfloat16/float32/float64/int64 layers mixed in one
  group (odd layer offsets force byte views), strided slices, a uint8 layer
  with a strided last dim, a strided block dim, the same bytes under two names
  of a group and one tensor in several groups; full, partial, scattered,
  consecutive and repeated-id chunks over several store and load calls of ONE
  job; the batch caps shrunk so that batches split. The payload bytes of every
  stored key's slot and the whole cache after the loads are bitwise equal
  between the two paths; a load writes every payload byte of its target
  blocks, with its source's bytes (the later load in call order when a block
  is loaded twice), and no other byte.
* A reused slot: the torch path stores zeros in the span bytes no piece
  covers, leaves the bytes past the span alone, and its payload bytes are the
  NumPy path's.
* NVMe write-through: rows stored by one path load bitwise through the other
  path in a new engine (reopened tier), both ways, reused slots included.
* ``after=`` on a CPU layout: InvalidArgumentError and nothing changed
  (TransferEngine and BackgroundEngine, on both paths).
* Regression: a load job whose calls write the same GPU bytes through two
  groups that alias memory with different block ids (one tensor registered
  with two block dims) or through two storages of the same memory is not
  batched so that an earlier load's bytes win on the torch path: the README
  promises "the later one wins, in call order" (the NumPy path keeps it).
* Regression: with ``copy_threads=2`` (the default on hosts with 2+ cores)
  the NumPy path must not run a job's units on both threads at once, where
  two loads of one job into one block keep call order only by chance; such a
  job runs as one unit.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
import kvtier._transfer as transfer
from kvtier.errors import InvalidArgumentError
from tests.engine.helpers import fill_random, key, same

NB = 40
DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64]
_seeds = iter(range(10_000, 1 << 30))


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A contiguous base tensor as flat bytes (same memory)."""
    return (t if t.dtype == torch.uint8 else t.view(torch.uint8)).reshape(-1)


def _random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    fill_random(t, seed)
    return t


def _t(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return _random_bytes(shape, dtype, next(_seeds))


@dataclasses.dataclass
class _Cache:
    """Layer tensors by group, the contiguous tensors that own their memory, and bpc."""

    groups: dict[int, dict[str, torch.Tensor]]
    block_dim: dict[str, int]
    payload: dict[str, int]
    bases: list[torch.Tensor]
    bpc: int

    def __post_init__(self) -> None:
        self.pristine = [b.clone() for b in self.bases]

    def restore(self) -> None:
        for b, p in zip(self.bases, self.pristine, strict=True):
            b.copy_(p)

    def fill(self, value: int) -> None:
        for b in self.bases:
            _u8(b).fill_(value)

    def state(self) -> list[torch.Tensor]:
        return [_u8(b).clone() for b in self.bases]

    def layout(self) -> kvtier.KVLayout:
        return kvtier.KVLayout.from_tensors(
            self.groups, block_dim=self.block_dim, payload_nbytes=self.payload
        )


def _random_cache(rng: random.Random) -> _Cache:
    bpc = rng.randint(1, 5)

    def _t(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return _random_bytes(shape, dtype, rng.randrange(1 << 30))

    groups: dict[int, dict[str, torch.Tensor]] = {}
    block_dim: dict[str, int] = {}
    payload: dict[str, int] = {}
    bases: list[torch.Tensor] = []
    shared: list[tuple[str, torch.Tensor]] = []  # layers other groups may alias
    for g in range(rng.randint(1, 3)):
        layers: dict[str, torch.Tensor] = {}
        for i in range(rng.randint(1, 4)):
            if shared and rng.random() < 0.25:  # one tensor in several groups (same name)
                name, t = rng.choice(shared)
                if name not in layers:
                    layers[name] = t
                continue
            name = f"g{g}.l{i}"
            dtype = rng.choice(DTYPES)
            a, b = rng.randint(1, 4), rng.randint(1, 9)
            kind = rng.choice(["packed", "kv", "mid", "slice", "strided_blocks", "scalar", "u8"])
            if kind == "packed":
                t = base = _t((NB, a, b), dtype)
                dim = 0
            elif kind == "kv":  # K/V outside the block dim: 2 pieces per page
                t = base = _t((2, NB, a, b), dtype)
                dim = 1
            elif kind == "mid":  # block dim in the middle: 3a strided rows per page
                t = base = _t((a, 3, NB, b), dtype)
                dim = 2
            elif kind == "slice":  # rows of b elements, further apart
                base = _t((NB, a, b + rng.randint(1, 3)), dtype)
                t, dim = base[:, :, :b], 0
            elif kind == "strided_blocks":  # every other block of a bigger tensor
                base = _t((a, 2 * NB, b), dtype)
                t, dim = base[:, ::2], 1
            elif kind == "scalar":  # one element per block
                t = base = _t((NB,), dtype)
                dim = 0
            else:  # a one-byte dtype may have a strided last dim
                base = _t((NB, a, 2 * b), torch.uint8)
                t, dim = base[:, :, ::2], 0
            page = t.numel() // NB * t.element_size()
            if page > 1 and rng.random() < 0.5:
                payload[name] = rng.randint(1, page)  # unpadded: a prefix of the page
            layers[name] = t
            block_dim[name] = dim
            bases.append(base)
            if rng.random() < 0.15:  # the same bytes under a second name: copied once
                alias = f"{name}.alias"
                layers[alias] = t[:]
                block_dim[alias] = dim
                if name in payload:
                    payload[alias] = payload[name]
            if rng.random() < 0.4:
                shared.append((name, t))
        if not layers:
            t = base = _t((NB, 3, 5), torch.float32)
            layers[f"g{g}.fallback"] = t
            block_dim[f"g{g}.fallback"] = 0
            bases.append(base)
        groups[g] = layers
    return _Cache(groups, block_dim, payload, bases, bpc)


# ---------------------------------------------------------------------- plans


@dataclasses.dataclass
class _Plan:
    """Store calls and load calls (each call a list of chunks), one job per direction."""

    stores: list[list[kvtier.Chunk]]
    loads: list[list[kvtier.Chunk]]
    twice: bool  # some load writes a block that an earlier load of the job writes


def _random_plan(cache: _Cache, rng: random.Random, tag: str) -> _Plan:
    bpc = cache.bpc
    stored: list[kvtier.Chunk] = []
    for g in cache.groups:
        ranges = [(0, bpc)]
        for _ in range(2):
            o = rng.randrange(bpc)
            ranges.append((o, rng.randint(1, bpc - o)))
        for i in range(rng.randint(2, 7)):
            o, n = rng.choice(ranges)
            how = rng.random()
            if how < 0.4:
                ids = rng.sample(range(NB), n)  # scattered
            elif how < 0.7:
                s = rng.randrange(NB - n + 1)
                ids = list(range(s, s + n))  # consecutive
            else:
                ids = rng.choices(range(NB), k=n)  # ids may repeat in a store
            stored.append(kvtier.Chunk(key(f"{tag}.{g}.{i}", g), ids, o))
    rng.shuffle(stored)  # interleave groups and ranges
    stores: list[list[kvtier.Chunk]] = [[] for _ in range(rng.randint(1, 3))]
    for c in stored:
        rng.choice(stores).append(c)
    stores = [s for s in stores if s]
    # Loads: targets distinct over every group (groups may share tensors), sub-ranges too.
    pool = rng.sample(range(NB), NB)
    loaded: list[kvtier.Chunk] = []
    for c in stored:
        o, n = c.offset, len(c.block_ids)
        o2 = rng.randint(o, o + n - 1) if rng.random() < 0.3 else o
        n2 = rng.randint(1, o + n - o2) if o2 != o else n
        if rng.random() < 0.15 or len(pool) < n2:
            continue
        loaded.append(kvtier.Chunk(c.key, [pool.pop() for _ in range(n2)], o2))
    if not loaded:  # every chunk was skipped: load one
        c = stored[0]
        loaded.append(kvtier.Chunk(c.key, [pool.pop() for _ in c.block_ids], c.offset))
    calls: list[list[kvtier.Chunk]] = [[] for _ in range(rng.randint(1, 3))]
    for c in loaded:
        rng.choice(calls).append(c)
    calls = [c for c in calls if c]
    twice = False
    if loaded and rng.random() < 0.4:
        # A later call loads a key of the same group into blocks that `first` loads,
        # preferably with another sub-block range; a first call loads the same range
        # elsewhere, so that a batch of that range would come before `first`'s.
        first = rng.choice(loaded)
        g = first.key.group_id
        others = [c for c in stored if c.key.group_id == g]
        moved = [
            c
            for c in others
            if (c.offset, len(c.block_ids)) != (first.offset, len(first.block_ids))
        ]
        again = rng.choice(moved or others)
        n = min(len(again.block_ids), len(first.block_ids))
        if len(pool) >= n:
            calls.insert(0, [kvtier.Chunk(again.key, [pool.pop() for _ in range(n)], again.offset)])
        calls.append([kvtier.Chunk(again.key, list(first.block_ids[:n]), again.offset)])
        twice = True
    return _Plan(stores, calls, twice)


# ---------------------------------------------------------------------- runs


@contextmanager
def _path(torch_path: bool) -> Iterator[list[tuple[int, int]]]:
    """Select the copy path; record (chunks, block ids) of every ``_staged_copy`` batch."""
    batches: list[tuple[int, int]] = []
    real = transfer._staged_copy

    def staged(copies: Any, ids: Any, store: bool) -> None:
        batches.append((len(copies), len(ids)))
        real(copies, ids, store)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(transfer, "_staged_copy", staged)
        if torch_path:
            m.setattr("kvtier._engine.host_pieces", lambda *a, **k: None)
        yield batches


def _payload_bytes(engine: kvtier.TransferEngine, chunk: kvtier.Chunk) -> torch.Tensor:
    """The slot bytes of a stored chunk's sub-blocks, layer after layer."""
    region = engine._region
    assert region is not None
    slot = region.slot(engine._pool.get(chunk.key).slot, engine.slot_nbytes)
    g = chunk.key.group_id
    lo, hi = chunk.offset, chunk.offset + len(chunk.block_ids)
    parts = []
    for layer, off in zip(engine.layout.group(g).layers, engine._offsets[g], strict=True):
        p = layer.payload_nbytes
        parts.append(slot[off + lo * p : off + hi * p])
    return torch.cat(parts).clone()


@dataclasses.dataclass
class _Run:
    images: list[torch.Tensor]  # payload bytes of each stored chunk's slot
    after: list[torch.Tensor]  # cache bytes after the loads (0xEE elsewhere)
    sizes: list[int]  # chunks of each _staged_copy batch
    ids: list[int]  # block ids of each _staged_copy batch


def _pieces(layout: kvtier.KVLayout, g: int) -> list[torch.Tensor]:
    return [p.view8 for layer in layout.group(g).layers for p in layer.pieces]


async def _run(cache: _Cache, plan: _Plan, torch_path: bool, threads: int) -> _Run:
    """One store job and a load job twice (over 0xEE, then over 0x11), checked against a model."""
    cache.restore()
    layout = cache.layout()
    stored = [c for call in plan.stores for c in call]
    bpc = cache.bpc
    cpu = layout.slot_nbytes(bpc) * (len(stored) + 1)
    cfg = kvtier.EngineConfig(cpu, bpc, copy_threads=threads)
    with _path(torch_path) as batches:
        async with kvtier.TransferEngine(layout, cfg) as engine:
            results = await asyncio.gather(*(engine.store(call) for call in plan.stores))
            assert sum(len(r.stored) for r in results) == len(stored)
            assert engine.stats().store_jobs == 1
            images = [_payload_bytes(engine, c) for c in stored]
            # What each loaded block must hold: the last load of it, in call order.
            by_key = {c.key: c for c in stored}
            want: dict[tuple[int, int], list[torch.Tensor]] = {}
            for call in plan.loads:
                for c in call:
                    src = by_key[c.key]
                    g = c.key.group_id
                    for j, b in enumerate(c.block_ids):
                        sb = src.block_ids[c.offset - src.offset + j]
                        want[g, b] = [v[sb].clone() for v in _pieces(layout, g)]
            outs = []
            for value in (0xEE, 0x11):
                cache.fill(value)
                jobs = engine.stats().load_jobs
                res = await asyncio.gather(*(engine.load(call) for call in plan.loads))
                assert all(not r.failed for r in res), [r.failed for r in res]
                assert engine.stats().load_jobs == jobs + 1  # the calls made ONE job
                outs.append(cache.state())
                for (g, b), pieces in want.items():
                    for v, w in zip(_pieces(layout, g), pieces, strict=True):
                        assert same(v[b], w), f"group {g} block {b}: not its source's bytes"
    # The bytes a load may write: the payload bytes of its target blocks.
    cache.fill(0)
    for g, b in want:
        for v in _pieces(layout, g):
            v[b] = 1
    allowed = [s == 1 for s in cache.state()]
    for a, z, ok in zip(outs[0], outs[1], allowed, strict=True):
        assert bool((a[~ok] == 0xEE).all()), "a byte outside the targets' payload was written"
        assert bool((z[~ok] == 0x11).all()), "a byte outside the targets' payload was written"
        assert torch.equal(a[ok], z[ok]), "a payload byte of a target block was not written"
    return _Run(images, outs[0], [k for k, _ in batches], [n for _, n in batches])


def _compare(numpy_run: _Run, torch_run: _Run) -> None:
    assert numpy_run.sizes == []  # the NumPy path never stages
    assert torch_run.sizes  # every torch copy is staged
    for i, (a, b) in enumerate(zip(numpy_run.images, torch_run.images, strict=True)):
        assert torch.equal(a, b), f"slot payload of chunk {i} differs between the paths"
    for i, (a, b) in enumerate(zip(numpy_run.after, torch_run.after, strict=True)):
        assert torch.equal(a, b), f"tensor {i} after the loads differs between the paths"


CAPS = {
    "default": {},
    "two-ids-per-chunk": {"_BATCH_IDS": 2},  # with bpc ids: 2 chunks of bpc per batch
    "8KiB": {"_BATCH_NBYTES": 8192},
    "single": {"_BATCH_NBYTES": 1},
}


@settings(max_examples=30, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    cap=st.sampled_from(sorted(CAPS)),
    threads=st.sampled_from([1, 2]),
)
def test_random_layouts_and_jobs_match_the_numpy_path_bitwise(
    seed: int, cap: str, threads: int
) -> None:
    rng = random.Random(seed)
    cache = _random_cache(rng)
    plan = _random_plan(cache, rng, f"h{seed}")
    if plan.twice:
        threads = 1  # two copy threads may split a job whose loads overlap: no order then
    caps = {k: (v * cache.bpc if k == "_BATCH_IDS" else v) for k, v in CAPS[cap].items()}
    numpy_run = asyncio.run(_run(cache, plan, torch_path=False, threads=1))
    with pytest.MonkeyPatch.context() as m:
        for name, value in caps.items():
            m.setattr(transfer, name, value)
        torch_run = asyncio.run(_run(cache, plan, torch_path=True, threads=threads))
    _compare(numpy_run, torch_run)
    if cap == "single":
        assert set(torch_run.sizes) == {1}
    if cap == "two-ids-per-chunk":  # a batch holds at most 2 * bpc block ids
        pairs = zip(torch_run.sizes, torch_run.ids, strict=True)
        assert all(k == 1 or n <= 2 * cache.bpc for k, n in pairs)


# ---------------------------------------------------------------------- fixed layouts


def _mixed_cache(groups: tuple[int, ...] = (0, 1, 2)) -> _Cache:
    """Every dtype in one group, odd payloads first (later layers at odd offsets), aliases.

    Group 1 aliases two of group 0's tensors and adds a K/V-first layer; group 2
    is one float64 layer with a 1-byte payload.
    """
    t8 = _t((NB, 3, 7), torch.uint8)
    t16 = _t((2, NB, 3, 5), torch.float16)  # K/V first
    tbf = _t((NB, 2, 9), torch.bfloat16)
    t32 = _t((3, 2, NB, 3), torch.float32)  # block dim in the middle: strided rows
    base64 = _t((NB, 2, 7), torch.float64)
    t64 = base64[:, :, :5]  # strided rows
    ti = _t((2, NB, 5), torch.int64)
    kv = _t((2, NB, 4, 3), torch.bfloat16)
    tail = _t((NB, 3), torch.float64)
    every = {
        0: {"u8": t8, "f16": t16, "bf16": tbf, "f32": t32, "f64": t64, "i64": ti},
        1: {"f32": t32, "i64": ti, "kv": kv},
        2: {"tail": tail},
    }
    chosen = {g: every[g] for g in groups}
    names = {n for layers in chosen.values() for n in layers}
    block_dim = {"u8": 0, "f16": 1, "bf16": 0, "f32": 2, "f64": 0, "i64": 1, "kv": 1, "tail": 0}
    payload = {"u8": 19, "f16": 42, "f32": 62, "i64": 77, "kv": 31, "tail": 1}
    owners = {"u8": t8, "f16": t16, "bf16": tbf, "f32": t32, "f64": base64, "i64": ti}
    owners |= {"kv": kv, "tail": tail}
    return _Cache(
        chosen,
        {n: d for n, d in block_dim.items() if n in names},
        {n: p for n, p in payload.items() if n in names},
        [owners[n] for n in sorted(names)],
        3,  # odd layer offsets: wide pieces fall back to bytes
    )


def _mixed_plan(tag: str) -> _Plan:
    """5 chunks per (group, range) over three store calls, partial ranges, repeated ids."""
    rng = random.Random(1515)
    stored = []
    for g in (0, 1, 2):
        for i in range(15):
            o, n = [(0, 3), (1, 2), (2, 1)][i % 3]
            ids = rng.sample(range(NB), n) if i % 2 else rng.choices(range(4), k=n)
            stored.append(kvtier.Chunk(key(f"{tag}.{g}.{i}", g), ids, o))
    rng.shuffle(stored)
    pool = rng.sample(range(NB), NB)
    loads = []
    for c in stored:
        n = len(c.block_ids)
        if len(pool) >= n:
            loads.append(kvtier.Chunk(c.key, [pool.pop() for _ in range(n)], c.offset))
    return _Plan([stored[0::3], stored[1::3], stored[2::3]], [loads[0::2], loads[1::2]], False)


@pytest.mark.parametrize("cap", ["default", "2-full-chunks-by-bytes", "2-full-chunks-by-ids"])
async def test_every_dtype_in_one_group_in_batches_matches_the_numpy_path(cap: str) -> None:
    cache = _mixed_cache()
    plan = _mixed_plan("mixed")
    numpy_run = await _run(cache, plan, torch_path=False, threads=1)
    layout = cache.layout()
    with pytest.MonkeyPatch.context() as m:
        if cap == "2-full-chunks-by-bytes":  # a full chunk of group 0 spans its whole group
            row = -(-layout.group_nbytes(0, 3) // 4096) * 4096  # its share of the buffer
            m.setattr(transfer, "_BATCH_NBYTES", 2 * row + 1)
        elif cap == "2-full-chunks-by-ids":
            m.setattr(transfer, "_BATCH_IDS", 7)  # 2 chunks of 3 ids
        torch_run = await _run(cache, plan, torch_path=True, threads=1)
    _compare(numpy_run, torch_run)
    n_loaded = sum(len(call) for call in plan.loads)
    assert sum(torch_run.sizes) == 45 + 2 * n_loaded  # every chunk staged once per job
    if cap == "default":  # one store batch per (group, range): 9 batches of 5
        assert torch_run.sizes[:9] == [5] * 9
    else:  # group 0's full chunks: 2 + 2 + 1
        assert 2 in torch_run.sizes
        assert len(torch_run.sizes) > 9 + 2 * 9


# ---------------------------------------------------------------------- reused slots


def _big_pages_cache() -> _Cache:
    """Pages of 1.5 KiB and more: a partial chunk's span starts past the slot's first 4 KiB."""
    a = _t((NB, 2, 96), torch.float64)
    b = _t((2, NB, 50), torch.int64)
    return _Cache({0: {"a": a, "b": b}}, {"a": 0, "b": 1}, {"a": 1530, "b": 777}, [a, b], 4)


@pytest.mark.parametrize("which", ["mixed", "big-pages"])
async def test_a_reused_slot_gets_zeros_in_the_uncovered_span_and_the_numpy_payload(
    which: str,
) -> None:
    """One slot: X (full) is evicted by Y (one sub-block, 2 or 3), which reuses X's slot."""
    cache = _mixed_cache((0,)) if which == "mixed" else _big_pages_cache()
    sub = 2 if which == "mixed" else 3
    layout = cache.layout()
    bpc = cache.bpc
    slot_nbytes = layout.slot_nbytes(bpc)
    offsets = layout.layer_offsets(0, bpc)
    payloads = [layer.payload_nbytes for layer in layout.group(0).layers]
    x = kvtier.Chunk(key("x", 0), list(range(5, 5 + bpc)))
    y = kvtier.Chunk(key("y", 0), [11], sub)
    in_payload = torch.zeros(slot_nbytes, dtype=torch.bool)
    for off, p in zip(offsets, payloads, strict=True):
        in_payload[off + sub * p : off + (sub + 1) * p] = True
    first = min(off + sub * p for off, p in zip(offsets, payloads, strict=True))
    lo = first - first % 4096
    hi = max(off + (sub + 1) * p for off, p in zip(offsets, payloads, strict=True))
    assert lo < first  # the span starts before the first layer's sub-block
    assert (lo > 0) == (which == "big-pages")
    slots = {}
    for torch_path in (False, True):
        cache.restore()
        layout = cache.layout()
        want = [v[11].clone() for v in _pieces(layout, 0)]
        cfg = kvtier.EngineConfig(slot_nbytes, bpc, copy_threads=1)
        with _path(torch_path):
            async with kvtier.TransferEngine(layout, cfg) as engine:
                assert len((await engine.store([x])).stored) == 1
                region = engine._region
                assert region is not None
                old = region.slot(0, slot_nbytes).clone()
                assert len((await engine.store([y])).stored) == 1  # X evicted
                assert engine.lookup([x.key]) == [kvtier.Residency.MISS]
                assert engine._pool.get(y.key).slot == 0
                slots[torch_path] = (old, region.slot(0, slot_nbytes).clone())
                cache.fill(0xEE)
                assert not (await engine.load([kvtier.Chunk(y.key, [30], sub)])).failed
                for v, w in zip(_pieces(layout, 0), want, strict=True):
                    assert same(v[30], w)
    (np_old, np_slot), (t_old, t_slot) = slots[False], slots[True]
    assert torch.equal(np_old, t_old)
    assert torch.equal(np_slot[in_payload], t_slot[in_payload])  # Y's payload: the same bytes
    assert not torch.equal(np_slot[in_payload], np_old[in_payload])  # and not X's
    span = torch.zeros(slot_nbytes, dtype=torch.bool)
    span[lo:hi] = True
    assert t_old[span & ~in_payload].any()  # X left bytes there
    assert not bool(t_slot[span & ~in_payload].any()), "uncovered span bytes are not zero"
    assert torch.equal(t_slot[~span], t_old[~span]), "the torch path wrote past its span"
    assert torch.equal(np_slot[~in_payload], np_old[~in_payload])  # NumPy: payload only


# ---------------------------------------------------------------------- NVMe


def _nvme_config(root: Path, ns: str, bpc: int, cpu: int) -> kvtier.EngineConfig:
    nv = kvtier.NVMeConfig(
        root=root, capacity_bytes=16 << 20, namespace=ns, io_backend="posix",
        io_threads=2, segment_nbytes=1 << 20, request_nbytes=1 << 20,
    )  # fmt: skip
    return kvtier.EngineConfig(cpu, bpc, nvme=nv, copy_threads=1)


@pytest.mark.parametrize("writer", ["torch", "numpy"])
async def test_rows_stored_by_one_path_load_bitwise_through_the_other_after_reopen(
    tmp_path: Path, writer: str
) -> None:
    """Write-through rows of a batched job (and of reused slots) reopen on the other path."""
    cache = _mixed_cache()
    plan = _mixed_plan(f"nv-{writer}")
    stored = [c for call in plan.stores for c in call]
    layout = cache.layout()
    # 8 slots for 45 keys: later stores evict earlier keys and reuse their slots
    cpu = layout.slot_nbytes(cache.bpc) * 8
    store_torch = writer == "torch"
    jobs = -(-len(stored) // 6)
    cache.restore()
    want = {}
    for c in stored:
        g = c.key.group_id
        want[c.key] = [v[list(c.block_ids)].clone() for v in _pieces(layout, g)]
    with _path(store_torch) as sizes:
        async with kvtier.TransferEngine(
            layout, _nvme_config(tmp_path, "x", cache.bpc, cpu)
        ) as engine:
            for i in range(0, len(stored), 6):  # jobs of 6 calls of one chunk, 8 slots
                part = stored[i : i + 6]
                results = await asyncio.gather(*(engine.store([c]) for c in part))
                assert all(len(r.stored) == 1 for r in results)
                await engine.flush()
            assert engine.stats().store_jobs == jobs
    assert bool(sizes) == store_torch
    if store_torch:
        assert max(k for k, _ in sizes) >= 2  # batches of several chunks wrote rows
    # Every key, in rounds of at most NB target blocks (distinct inside a round).
    rounds: list[list[kvtier.Chunk]] = [[]]
    free = list(range(NB))
    for c in stored:
        n = len(c.block_ids)
        if len(free) < n:
            rounds.append([])
            free = list(range(NB))
        rounds[-1].append(kvtier.Chunk(c.key, [free.pop() for _ in range(n)], c.offset))
    layout = cache.layout()
    loaded = 0
    with _path(not store_torch) as sizes:
        async with kvtier.TransferEngine(
            layout, _nvme_config(tmp_path, "x", cache.bpc, cpu)
        ) as engine:
            keys = [c.key for c in stored]
            assert engine.lookup(keys) == [kvtier.Residency.NVME] * len(keys)
            for chunks in rounds:
                cache.fill(0xEE)
                for i in range(0, len(chunks), 6):  # 6 calls of one chunk at a time
                    res = await asyncio.gather(*(engine.load([c]) for c in chunks[i : i + 6]))
                    assert all(not r.failed for r in res)
                for c in chunks:
                    for v, w in zip(_pieces(layout, c.key.group_id), want[c.key], strict=True):
                        assert same(v[list(c.block_ids)], w), f"{c.key}: not the stored bytes"
                    loaded += 1
    assert bool(sizes) == (not store_torch)
    if not store_torch:
        assert max(k for k, _ in sizes) >= 2  # batches of several promoted chunks
    assert loaded == len(stored) == 45


# ---------------------------------------------------------------------- after=


def _fake_event() -> Any:
    if torch.cuda.is_available():  # a CUDA build refuses object.__new__ (seen on an H200)
        return torch.cuda.Event()
    return object.__new__(torch.cuda.Event)  # an Event instance on a CPU-only torch too


@pytest.mark.parametrize("torch_path", [False, True])
@pytest.mark.parametrize("after", ["event", "object"])
async def test_after_on_a_cpu_layout_raises_and_changes_nothing(
    torch_path: bool, after: str
) -> None:
    ev = _fake_event() if after == "event" else object()
    t = _t((NB, 2, 8), torch.bfloat16)
    layout = kvtier.KVLayout.from_tensors({0: {"t": t}})
    chunks = [kvtier.Chunk(key("a", 0), [1, 2, 3, 4]), kvtier.Chunk(key("b", 0), [5], 2)]
    with _path(torch_path) as batches:
        async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4)) as engine:
            free = engine._pool.free_count
            with pytest.raises(InvalidArgumentError):
                await engine.store(chunks, after=ev)
            assert engine.lookup([c.key for c in chunks]) == [kvtier.Residency.MISS] * 2
            assert engine.stats().store_jobs == 0
            assert engine._pool.free_count == free  # no slot reserved
            assert len((await engine.store(chunks)).stored) == 2
            src = t.clone()
            t.view(torch.uint8).fill_(0xEE)
            moved = [kvtier.Chunk(c.key, [b + 20 for b in c.block_ids], c.offset) for c in chunks]
            with pytest.raises(InvalidArgumentError):
                await engine.load(moved, after=ev)
            await asyncio.sleep(0.05)
            assert bool((t.view(torch.uint8) == 0xEE).all())
            assert engine.stats().load_jobs == 0
            assert engine.lookup([c.key for c in chunks]) == [kvtier.Residency.CPU] * 2
            assert not (await engine.load(moved)).failed  # nothing pinned, nothing broken
    assert same(t[21:25], src[1:5])
    assert same(t[25], src[5])
    assert len(batches) == (4 if torch_path else 0)  # 2 stores + 2 loads, none for the refused


@pytest.mark.parametrize("torch_path", [False, True])
def test_background_engine_after_on_a_cpu_layout_raises_and_changes_nothing(
    torch_path: bool,
) -> None:
    t = _t((NB, 4, 4), torch.float32)
    layout = kvtier.KVLayout.from_tensors({0: {"t": t}})
    chunks = [kvtier.Chunk(key("bg", 0), [7, 3])]
    cfg = kvtier.EngineConfig(1 << 20, 2)
    with _path(torch_path) as batches, kvtier.BackgroundEngine(layout, cfg) as bg:
        with pytest.raises(InvalidArgumentError):
            bg.store(chunks, after=_fake_event()).result(30)
        assert bg.lookup([chunks[0].key]) == [kvtier.Residency.MISS]
        assert len(bg.store(chunks).result(30).stored) == 1
        src = t.clone()
        t.zero_()
        with pytest.raises(InvalidArgumentError):
            bg.load([kvtier.Chunk(chunks[0].key, [1, 2])], after=_fake_event()).result(30)
        assert not t.any()
        assert bg.stats().load_jobs == 0
        assert not bg.load([kvtier.Chunk(chunks[0].key, [1, 2])]).result(30).failed
    assert same(t[[1, 2]], src[[7, 3]])
    assert len(batches) == (2 if torch_path else 0)  # one store, one load


# ---------------------------------------------------------------------- memory shared by groups


def _shared_memory_layout(variant: str) -> tuple[kvtier.KVLayout, torch.Tensor, list[int]]:
    """Two groups over the same bytes; returns (layout, the whole memory, [A, B, C] targets).

    ``block-dims``: one tensor ``(8, 8, 16)`` as group 0 (block dim 0) and group 1
    (block dim 1): block ``i`` of group 0 and block ``j`` of group 1 share
    ``t[i, j]``. ``two-storages``: groups 0 and 1 are ``torch.from_numpy`` of columns
    ``[0, 48)`` and ``[32, 64)`` of one NumPy array: two storages (other data
    pointers) that share columns ``[32, 48)`` of every block.
    Targets: A (g0) and C (g0) in two calls around B (g1); C shares bytes with B.
    """
    if variant == "block-dims":
        t = _t((8, 8, 16), torch.uint8)
        return (
            kvtier.KVLayout.from_tensors({0: {"a": t}, 1: {"b": t}}, block_dim={"a": 0, "b": 1}),
            t,
            [0, 3, 2],
        )
    arr = np.zeros((8, 64), dtype=np.uint8)
    memory = torch.from_numpy(arr)
    fill_random(memory, 77)
    left, right = torch.from_numpy(arr[:, :48]), torch.from_numpy(arr[:, 32:])
    assert left.untyped_storage().data_ptr() != right.untyped_storage().data_ptr()
    return kvtier.KVLayout.from_tensors({0: {"a": left}, 1: {"b": right}}), memory, [0, 2, 2]


async def _later_load_over_shared_memory(variant: str, torch_path: bool) -> None:
    layout, t, (ta, tb, tc) = _shared_memory_layout(variant)
    a, b, c = key("A", 0), key("B", 1), key("C", 0)
    g0, g1 = (layout.group(g).layers[0].pieces[0].view8 for g in (0, 1))
    cfg = kvtier.EngineConfig(1 << 20, 1, copy_threads=1)
    with _path(torch_path):
        async with kvtier.TransferEngine(layout, cfg) as engine:
            chunks = [kvtier.Chunk(a, [4]), kvtier.Chunk(b, [5]), kvtier.Chunk(c, [6])]
            assert len((await engine.store(chunks)).stored) == 3
            want_b, want_c = g1[5].clone(), g0[6].clone()
            t.zero_()
            res = await asyncio.gather(
                engine.load([kvtier.Chunk(a, [ta])]),
                engine.load([kvtier.Chunk(b, [tb])]),
                engine.load([kvtier.Chunk(c, [tc])]),
            )
            assert all(not r.failed for r in res)
            assert engine.stats().load_jobs == 1  # one job: the three calls coalesced
    final = t.clone()
    # B's bytes that C's block does not share hold B's bytes
    t.zero_()
    g0[tc] = 1
    under_c = g1[tb].clone().bool()
    t.copy_(final)
    assert under_c.any()  # B and C share bytes
    assert not under_c.all()
    assert same(g1[tb][~under_c], want_b[~under_c])
    # C's load is the later one: its block holds C's bytes, all of them
    assert same(g0[tc], want_c), "bytes shared with B hold the earlier load's (B's) bytes"


@pytest.mark.parametrize("variant", ["block-dims", "two-storages"])
async def test_numpy_path_later_load_wins_over_memory_shared_by_groups(variant: str) -> None:
    await _later_load_over_shared_memory(variant, torch_path=False)


@pytest.mark.parametrize("variant", ["block-dims", "two-storages"])
async def test_torch_path_later_load_wins_over_memory_shared_by_groups(variant: str) -> None:
    """Pieces are compared by the bytes their blocks reach (``kvtier._aliasing.analyse``),
    not by block ids per storage, which let the batches reorder these loads."""
    await _later_load_over_shared_memory(variant, torch_path=True)


def test_the_staged_copy_is_the_only_torch_copy() -> None:
    """Every torch chunk goes through ``_staged_copy`` (``_torch_chunk`` and ``_torch_batch``)."""
    calls: collections.Counter[str] = collections.Counter()
    real = transfer._staged_copy

    def staged(copies: Any, ids: Any, store: bool) -> None:
        calls[f"{'store' if store else 'load'}:{len(copies)}"] += 1
        real(copies, ids, store)

    t = _t((NB, 4, 6), torch.float16)
    layout = kvtier.KVLayout.from_tensors({0: {"t": t}})
    chunks = [kvtier.Chunk(key(i, 0), [i, i + 10], 1) for i in range(5)]

    async def main() -> None:
        cfg = kvtier.EngineConfig(1 << 20, 3, copy_threads=1)
        async with kvtier.TransferEngine(layout, cfg) as engine:
            assert len((await engine.store(chunks)).stored) == 5
            t.zero_()
            assert not (await engine.load(chunks[:1])).failed

    src = t.clone()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(transfer, "_staged_copy", staged)
        m.setattr("kvtier._engine.host_pieces", lambda *a, **k: None)
        asyncio.run(main())
    assert calls == {"store:5": 1, "load:1": 1}
    assert same(t[[0, 10]], src[[0, 10]])
    assert not t[1:10].any()


def test_numpy_path_with_two_copy_threads_keeps_the_later_load_into_a_block() -> None:
    """Two load calls of one job write block 5 (a's bytes, then b's), ``copy_threads=2``.

    The job's units must not run on both threads at once, where call order is
    kept only by chance (the unit of ``a`` held until ``b``'s has run, as a
    scheduler may do, leaves a's bytes). A load job that writes a block twice
    runs as one unit, in plan order: the held unit is the whole job.
    """
    t = _t((8, 256), torch.uint8)
    layout = kvtier.KVLayout.from_tensors({0: {"t": t}})
    src = t.clone()
    real = transfer.run_plan
    b_done = threading.Event()

    def run_plan(plan: Any, direction: str, **kw: Any) -> None:
        if direction == "load" and plan[0].block_ids == (5,) and plan[0].slot == slot_a:
            units.append(len(plan))
            b_done.wait(0.5)  # no other unit sets it: both loads are in this one
        real(plan, direction, **kw)
        if direction == "load" and plan[0].slot != slot_a:
            b_done.set()

    async def main() -> None:
        nonlocal slot_a
        cfg = kvtier.EngineConfig(1 << 20, 1, copy_threads=2)
        async with kvtier.TransferEngine(layout, cfg) as engine:
            a, b = key("a", 0), key("b", 0)
            assert len((await engine.store([kvtier.Chunk(a, [1]), kvtier.Chunk(b, [2])])).stored)
            slot_a = engine._pool.get(a).slot
            t[5].zero_()
            res = await asyncio.gather(
                engine.load([kvtier.Chunk(a, [5])]), engine.load([kvtier.Chunk(b, [5])])
            )
            assert not any(r.failed for r in res)
            assert engine.stats().load_jobs == 1

    slot_a = -1
    units: list[int] = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(transfer, "run_plan", run_plan)
        asyncio.run(main())
    assert units == [2]  # one unit of both chunks
    assert not b_done.is_set()
    assert same(t[5], src[2]), "block 5 holds the earlier load's (a's) bytes"
