"""LOAD call order and bytes over GPU memory shared by groups.

The CPU path with ``EngineConfig(copy_threads=2)``: a load job whose chunks may
write the same bytes must run as one unit in plan order (``kvtier._aliasing.pages_written_twice``
over ``analyse``/``block_shifts``/``footprint``), a single load call may not
write one GPU byte twice (``_validate`` / ``_check_aliased_pages``), and of
several load calls coalesced in one event-loop iteration the later call wins,
bit for bit.

Every layout here is made of views of ONE byte array (several ``torch.from_numpy``
storages over it, with different start addresses): dtype views, K/V-first
block dims, block dims in the middle, transposed (strided last dim) uint8
views, narrow slices, block strides that are not multiples of each other,
unpadded payloads, the same tensor in several groups. The reference model is
computed from byte addresses alone: a page of block ``b`` of a layer is the
list of addresses of ``tensor.select(block_dim, b)`` in row-major byte order,
its payload the first ``payload_nbytes`` of them; a store keeps those bytes,
a load writes them back, call after call, chunk after chunk.

To make a missed overlap visible on every run (not only when the two copy
threads happen to race), the "reversed" runs hand a split job's units to the
threads last unit first (``_units`` reversed): an overlap that the analysis
missed then leaves the EARLIER call's bytes. These runs fail with
``pages_written_twice`` forced to ``False``.

Full chunks in consecutive slots must not be scattered by ONE NumPy assignment
(``_load_run``) when two calls of a job load into the same block: call order
would then hold only because NumPy assigns repeated fancy indices in index
order, which its documentation does not promise (NumPy 2.4 does). A load job
that writes a page twice is copied chunk by chunk
(``test_consecutive_slots_loaded_into_one_block_by_several_calls``).

Registration refuses none of the cross-group sharing tried here; it refuses
(``LayoutError``) layers of ONE group that share a byte, which the random
builder then redraws.

Regressions guarded here:

* A load call that has to wait (its key's store is still in flight, or the
  key is only on NVMe and must be promoted) must not be submitted only after
  the wait, where a later call of the same iteration that writes the same GPU
  bytes is copied first and the EARLIER call's bytes are left
  (``TransferEngine.load``: the ``_must_wait`` branch goes through the
  ``_load`` task while later calls take the fast path to ``_submit_load``).
  Such a call takes a turn (``TransferEngine._take_turn``) and later loads of
  its GPU pages submit only after it.

Not a bug: a store and a load of the same blocks issued
together are not ordered at all (separate executors, separate threads), so
the store can capture a mix of the pages before and after the load. The
README says so: a caller awaits the load before it stores those blocks (as
vLLM frees a block for reuse only once its transfers ended).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
import kvtier._aliasing as aliasing
import kvtier._transfer as transfer
from kvtier import errors

C = kvtier.Chunk
M = 1 << 14  # bytes of the shared memory
DTYPES = [
    torch.uint8,
    torch.int16,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.float32,
    torch.int64,
    torch.float64,
]


def key(name: str, group_id: int) -> kvtier.OffloadKey:
    return kvtier.OffloadKey(hashlib.blake2b(name.encode(), digest_size=16).digest(), group_id)


# ---------------------------------------------------------------------- shared memory model


class Rec(NamedTuple):
    """A layer: ``from_numpy(mem[so:]).view(dtype).as_strided(shape, strides, offset)``."""

    so: int  # start of the layer's own storage inside the memory (bytes, multiple of 8)
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int  # elements
    block_dim: int

    @property
    def nb(self) -> int:
        return self.shape[self.block_dim]


def tensor(mem: np.ndarray, rec: Rec) -> torch.Tensor:
    base = torch.from_numpy(mem[rec.so :])
    if rec.dtype != torch.uint8:
        base = base.view(rec.dtype)
    return base.as_strided(rec.shape, rec.strides, rec.offset)


class Mem:
    """The shared byte array, layer records by group, and payloads by layer name."""

    def __init__(
        self,
        recs: dict[int, dict[str, Rec]],
        payload: dict[str, int] | None = None,
        seed: int = 0,
    ) -> None:
        self.mem = np.random.default_rng(seed).integers(0, 256, M, dtype=np.uint8)
        self.recs = recs
        self.payload = payload or {}
        self._addr: dict[tuple[int, int], list[np.ndarray]] = {}

    def layout(self) -> kvtier.KVLayout:
        groups = {g: {n: tensor(self.mem, r) for n, r in ls.items()} for g, ls in self.recs.items()}
        block_dim = {n: r.block_dim for ls in self.recs.values() for n, r in ls.items()}
        return kvtier.KVLayout.from_tensors(
            groups, block_dim=block_dim, payload_nbytes=self.payload
        )

    def addrs(self, g: int, b: int) -> list[np.ndarray]:
        """Per layer of group ``g``: the payload addresses of block ``b``, row-major."""
        if (g, b) not in self._addr:
            out = []
            everything = torch.arange(M, dtype=torch.int64)
            ptr = torch.from_numpy(self.mem).data_ptr()
            for name, rec in self.recs[g].items():
                t = tensor(self.mem, rec)
                u8 = t if t.dtype == torch.uint8 else t.unsqueeze(-1).view(torch.uint8)
                page = u8.select(rec.block_dim, b)
                a = everything.as_strided(page.shape, page.stride(), page.data_ptr() - ptr)
                a = a.reshape(-1).numpy().copy()
                out.append(a[: self.payload.get(name, len(a))])
            self._addr[(g, b)] = out
        return self._addr[(g, b)]

    def page_set(self, g: int, b: int) -> set[int]:
        return {int(x) for a in self.addrs(g, b) for x in a}

    def read(self, g: int, b: int) -> list[np.ndarray]:
        return [self.mem[a].copy() for a in self.addrs(g, b)]


class Reference:
    """Stored sub-blocks per key (bytes per layer) and the expected memory after loads."""

    def __init__(self, m: Mem) -> None:
        self.m = m
        self.stored: dict[kvtier.OffloadKey, dict[int, list[np.ndarray]]] = {}

    def store(self, chunk: kvtier.Chunk) -> None:
        g = chunk.key.group_id
        subs = {chunk.offset + j: self.m.read(g, b) for j, b in enumerate(chunk.block_ids)}
        self.stored.setdefault(chunk.key, subs)  # a stored key is skipped

    def load(self, expect: np.ndarray, chunk: kvtier.Chunk) -> None:
        g = chunk.key.group_id
        subs = self.stored[chunk.key]
        for j, b in enumerate(chunk.block_ids):
            for a, data in zip(self.m.addrs(g, b), subs[chunk.offset + j], strict=True):
                expect[a] = data

    def writes_twice(self, chunks: Sequence[kvtier.Chunk]) -> bool:
        """Whether one call's chunks write one byte twice (the engine must refuse it)."""
        seen: set[int] = set()
        for c in chunks:
            for b in c.block_ids:
                page = self.m.page_set(c.key.group_id, b)
                if seen & page:
                    return True
                seen |= page
        return False


@contextmanager
def reversed_units(on: bool = True) -> Iterator[None]:
    """Split load jobs hand their units to the copy threads last unit first."""
    if not on:
        yield
        return
    real = transfer._units

    def units(plan: Sequence[transfer.ChunkCopy], threads: int) -> list[Any]:
        return list(reversed(real(plan, threads)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer, "_units", units)
        yield


def config(bpc: int, **kw: Any) -> kvtier.EngineConfig:
    return kvtier.EngineConfig(4 << 20, bpc, copy_threads=2, **kw)


async def load_calls(
    engine: kvtier.TransferEngine,
    ref: Reference,
    calls: list[list[kvtier.Chunk]],
    jobs_per_call: int = 1,
) -> np.ndarray:
    """Issue ``calls`` in one iteration; check refusals; return the expected memory.

    ``jobs_per_call``: the calls make one job (1), or one job each (0: max_batch_chunks=1).
    """
    expect = ref.m.mem.copy()
    refused = [ref.writes_twice(call) for call in calls]
    for call, bad in zip(calls, refused, strict=True):
        if not bad:
            for chunk in call:
                ref.load(expect, chunk)
    jobs = engine.stats().load_jobs
    out = await asyncio.gather(*(engine.load(c) for c in calls), return_exceptions=True)
    for res, bad, call in zip(out, refused, calls, strict=True):
        if bad:
            assert isinstance(res, errors.BlockIdError), (call, res)
        else:
            assert isinstance(res, kvtier.LoadResult), (call, res)
            assert not res.failed, res.failed
            assert set(res.loaded) == {c.key for c in call}
    accepted = len(calls) - sum(refused)
    if accepted:
        want = jobs + (1 if jobs_per_call else accepted)
        assert engine.stats().load_jobs == want  # coalesced into ONE job, or one each
    return expect


def diff(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.flatnonzero(got != want)
    return f"{len(bad)} bytes differ, first at {bad[:8].tolist()}"


# ---------------------------------------------------------------------- random layouts


def _random_rec(rng: random.Random, nb: int) -> Rec:
    dtype = rng.choice(DTYPES)
    kind = rng.choice(["outer", "outer", "kv_first", "mid", "narrow", "transposed_u8", "scalar"])
    if kind == "transposed_u8":
        dtype = torch.uint8
    a, b = rng.randint(1, 3), rng.randint(1, 6)
    if kind == "outer":  # (nb, a, b), rows c apart, blocks s apart (any block stride)
        c = b + rng.choice([0, 0, 1, 3])
        s = a * c + rng.choice([0, 0, rng.randint(1, 9)])
        shape, strides, bd = (nb, a, b), (s, c, 1), 0
    elif kind == "narrow":  # a narrow slice of a wider page
        full = a * b + rng.randint(1, 5)
        start = rng.randint(0, full - a * b)
        shape, strides, bd = (nb, a * b), (full, 1), 0
        return _placed(rng, dtype, shape, strides, bd, extra=start)
    elif kind == "kv_first":  # (a, nb, b): a segments per page, nb * row apart
        row = b + rng.choice([0, 0, 2])
        shape, strides, bd = (a, nb, b), (nb * row, row, 1), 1
    elif kind == "mid":  # (a, nb, 2, b)
        shape, strides, bd = (a, nb, 2, b), (nb * 2 * b, 2 * b, b, 1), 1
    elif kind == "scalar":  # one element per block
        shape, strides, bd = (nb,), (rng.choice([1, 1, 3]),), 0
    else:  # (nb, b, a) byte view of (nb, a, b) rows: strided last dim
        s = a * b + rng.choice([0, rng.randint(1, 5)])
        shape, strides, bd = (nb, b, a), (s, 1, b), 0
    return _placed(rng, dtype, shape, strides, bd)


def _placed(
    rng: random.Random,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    bd: int,
    extra: int = 0,
) -> Rec:
    w = dtype.itemsize
    so = rng.choice([0, 0, 0, 8, 40, 1000])
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + extra
    room = (M - so) // w - extent
    offset = rng.randint(0, min(room, rng.choice([48, 256, 2048]) // w)) + extra
    return Rec(so, dtype, shape, strides, offset, bd)


def random_mem(seed: int) -> tuple[Mem, kvtier.KVLayout]:
    """Two to four groups over one memory; redrawn until the layout registers."""
    rng = random.Random(seed)
    for _ in range(500):
        recs: dict[int, dict[str, Rec]] = {}
        pool: list[tuple[str, Rec]] = []
        payload: dict[str, int] = {}
        for g in range(rng.randint(2, 4)):
            nb = rng.choice([4, 6, 8])
            layers: dict[str, Rec] = {}
            for i in range(rng.randint(1, 3)):
                same = [(n, r) for n, r in pool if r.nb == nb and n not in layers]
                if same and rng.random() < 0.3:  # one tensor in several groups
                    name, rec = rng.choice(same)
                elif same and rng.random() < 0.15:  # the same view under another name
                    name, rec = f"g{g}.l{i}", rng.choice(same)[1]
                    page = rec.dtype.itemsize * int(np.prod(rec.shape)) // nb
                    if page > 1 and rng.random() < 0.5:
                        payload[name] = rng.randint(1, page)
                else:
                    name, rec = f"g{g}.l{i}", _random_rec(rng, nb)
                    page = rec.dtype.itemsize * int(np.prod(rec.shape)) // nb
                    if page > 1 and rng.random() < 0.25:
                        payload[name] = rng.randint(1, page)
                    pool.append((name, rec))
                layers[name] = rec
            recs[g] = layers
        m = Mem(recs, payload, seed)
        try:
            return m, m.layout()
        except errors.LayoutError:
            continue  # two layers of one group share a byte: refused, redraw
    raise AssertionError("no layout registered")


def random_chunk(
    rng: random.Random, layout: kvtier.KVLayout, name: str, g: int, bpc: int
) -> kvtier.Chunk:
    off = rng.randrange(bpc) if rng.random() < 0.4 else 0
    n = rng.randint(1, bpc - off)
    nb = layout.group(g).num_blocks
    return C(key(name, g), [rng.randrange(nb) for _ in range(n)], off)  # ids may repeat


def random_load_calls(
    rng: random.Random, layout: kvtier.KVLayout, ref: Reference
) -> list[list[kvtier.Chunk]]:
    calls = []
    keys = list(ref.stored)
    for _ in range(rng.randint(2, 5) if rng.random() < 0.7 else rng.randint(8, 14)):
        call = []
        for k in rng.sample(keys, rng.randint(1, min(3, len(keys)))):
            subs = sorted(ref.stored[k])
            lo = rng.choice(subs)
            hi = lo
            while hi + 1 in ref.stored[k] and rng.random() < 0.6:
                hi += 1
            nb = layout.group(k.group_id).num_blocks
            call.append(C(k, rng.sample(range(nb), hi - lo + 1), lo))
        calls.append(call)
    return calls


async def random_run(seed: int, reverse: bool) -> tuple[int, int]:
    """Random stores, then three rounds of coalesced load calls.

    Returns:
        (calls refused, pairs of accepted calls of one round that write a common byte).
    """
    rng = random.Random(seed ^ 0x5EED)
    m, layout = random_mem(seed)
    bpc = rng.randint(1, 4)
    ref = Reference(m)
    stores = [
        random_chunk(rng, layout, f"{seed}.{g}.{i}", g, bpc)
        for g in layout.group_ids
        for i in range(3)
    ]
    for chunk in stores:
        ref.store(chunk)
    refused = overlapping = 0
    with reversed_units(reverse):
        async with kvtier.TransferEngine(layout, config(bpc)) as engine:
            assert len((await engine.store(stores)).stored) == len(stores)
            for _ in range(3):
                calls = random_load_calls(rng, layout, ref)
                expect = await load_calls(engine, ref, calls)
                assert np.array_equal(m.mem, expect), f"seed {seed}: {diff(m.mem, expect)}"
                refused += sum(ref.writes_twice(c) for c in calls)
                ok = [
                    {a for c in call for b in c.block_ids for a in m.page_set(c.key.group_id, b)}
                    for call in calls
                    if not ref.writes_twice(call)
                ]
                overlapping += sum(bool(p & q) for i, p in enumerate(ok) for q in ok[:i])
    return refused, overlapping


# ---------------------------------------------------------------------- the analysis, byte by byte


@settings(max_examples=60, deadline=None, database=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_pages_written_twice_never_misses_a_shared_byte(seed: int) -> None:
    """Any two chunks of a load plan that write one common byte make the plan ordered."""
    m, layout = random_mem(seed)
    rng = random.Random(seed)
    bpc = 4
    specs = {
        g: transfer.piece_specs(layout.group(g), layout.layer_offsets(g, bpc))
        for g in layout.group_ids
    }
    cache: dict[frozenset[int], aliasing.Aliasing] = {}
    overlapping = 0
    for _ in range(40):
        chunks = []
        for _ in range(rng.randint(2, 4)):
            g = rng.choice(layout.group_ids)
            ids = rng.sample(range(layout.group(g).num_blocks), rng.randint(1, 2))
            chunks.append((g, ids))
        plan = [transfer.ChunkCopy(specs[g], {}, 0, tuple(ids), 0, 1) for g, ids in chunks]
        pages = [set().union(*(m.page_set(g, b) for b in ids)) for g, ids in chunks]
        shared = any(pages[i] & pages[j] for i in range(len(pages)) for j in range(i))
        overlapping += shared
        if shared:
            assert aliasing.pages_written_twice(plan), (seed, m.recs, chunks)
            assert aliasing.pages_written_twice(plan, cache), (seed, m.recs, chunks)
        # the same verdict from the engine's cache as without it
        assert aliasing.pages_written_twice(plan, cache) == aliasing.pages_written_twice(plan)


def test_packed_groups_interleaved_in_one_storage_are_not_ordered() -> None:
    """Groups packed side by side in each block never share a byte: no ordering, no refusal."""
    base = np.zeros((8, 3, 40), dtype=np.uint8)
    t = torch.from_numpy(base)
    layout = kvtier.KVLayout.from_tensors({g: {f"p{g}": t[:, g]} for g in range(3)})
    specs = {g: transfer.piece_specs(layout.group(g), (0,)) for g in range(3)}
    label, mixed = aliasing.analyse({id(s): s for s in specs.values()})
    assert len(set(label.values())) == 3
    assert not mixed
    plan = [transfer.ChunkCopy(specs[g], {}, 0, (5,), 0, 40) for g in range(3)]
    assert not aliasing.pages_written_twice(plan)


# ---------------------------------------------------------------------- engine, random layouts


@pytest.mark.parametrize("reverse", [False, True], ids=["natural", "reversed-units"])
@settings(max_examples=40, deadline=None, database=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_shared_layouts_later_call_wins_bitwise(seed: int, reverse: bool) -> None:
    """Coalesced load calls over groups that share memory: bytes as the reference, refusals exact.

    A call whose chunks write one byte twice raises ``BlockIdError`` and writes
    nothing; every other call loads, and the later call's bytes are left
    wherever two calls write the same bytes.
    """
    asyncio.run(random_run(seed, reverse))


def test_the_random_runs_exercise_refusals_and_overlaps() -> None:
    """The generator is not vacuous: calls get refused, and accepted calls overlap across calls."""
    runs = [asyncio.run(random_run(seed, True)) for seed in range(12)]
    assert sum(r for r, _ in runs) > 5
    assert sum(o for _, o in runs) > 20
    assert sum(o > 0 for _, o in runs) > 6


# ---------------------------------------------------------------------- engine, fixed layouts


def _case_dtype_views() -> Mem:
    # one float32 tensor in group 0, its bytes as int16 (other shape) in group 1
    r0 = Rec(0, torch.float32, (8, 2, 16), (32, 16, 1), 4, 0)
    r1 = Rec(0, torch.int16, (8, 64), (64, 1), 8, 0)
    return Mem({0: {"f32": r0}, 1: {"i16": r1}})


def _case_two_block_dims() -> Mem:
    r = Rec(0, torch.uint8, (8, 8, 16), (128, 16, 1), 0, 0)
    return Mem({0: {"a": r}, 1: {"b": r._replace(block_dim=1)}})


def _case_kv_first_and_k_half() -> Mem:
    # group 0: a K/V-first (2, nb, 4, 8) bf16 cache; group 1: its K half as (nb, 4, 8)
    kv = Rec(0, torch.bfloat16, (2, 8, 4, 8), (256, 32, 8, 1), 0, 1)
    k = Rec(0, torch.bfloat16, (8, 4, 8), (32, 8, 1), 0, 0)
    return Mem({0: {"kv": kv}, 1: {"k": k}})


def _case_block_strides_48_and_40() -> Mem:
    # two storages, block strides 48 and 40 bytes (no multiple of each other), overlapping
    a = Rec(0, torch.uint8, (8, 40), (48, 1), 0, 0)
    b = Rec(40, torch.int64, (8, 4), (5, 1), 1, 0)
    return Mem({0: {"a": a}, 1: {"b": b}})


def _case_transposed_and_rows() -> Mem:
    # group 0: rows (8, 4, 6) uint8; group 1: a transposed byte view of the same
    # memory shifted by 3 bytes, with 2 more blocks
    rows = Rec(0, torch.uint8, (8, 4, 6), (24, 6, 1), 0, 0)
    tr = Rec(0, torch.uint8, (10, 6, 4), (24, 1, 6), 3, 0)
    return Mem({0: {"rows": rows}, 1: {"tr": tr}})


def _case_packed_and_unpadded() -> Mem:
    # three groups packed in each block (three 24-byte layers of 32-byte strides)
    # and a fourth group over the whole block, unpadded to 70 bytes
    parts = {g: {f"p{g}": Rec(0, torch.int16, (8, 12), (48, 1), 16 * g, 0)} for g in range(3)}
    whole = {3: {"whole": Rec(0, torch.uint8, (8, 96), (96, 1), 0, 0)}}
    return Mem({**parts, **whole}, {"whole": 70})


def _case_many_runs() -> Mem:
    # 128 one-byte runs per page (> _MAX_RUNS: not listed) over the rows of another group
    tr = Rec(0, torch.uint8, (8, 16, 8), (128, 1, 16), 0, 0)
    rows = Rec(8, torch.int32, (8, 32), (32, 1), 2, 0)
    return Mem({0: {"tr": tr}, 1: {"rows": rows}})


def _case_wide_shift_range() -> Mem:
    # K/V-first (2, 100, 8) and the same bytes as 200 plain blocks: block b of group 0
    # meets blocks b and b + 100 of group 1 (a shift range > _MAX_RUNS)
    kv = Rec(0, torch.uint8, (2, 100, 8), (800, 8, 1), 0, 1)
    flat = Rec(0, torch.int16, (200, 4), (4, 1), 0, 0)
    return Mem({0: {"kv": kv}, 1: {"flat": flat}})


FIXED: dict[str, Callable[[], Mem]] = {
    "many-runs": _case_many_runs,
    "wide-shift-range": _case_wide_shift_range,
    "dtype-views": _case_dtype_views,
    "two-block-dims": _case_two_block_dims,
    "kv-first-and-k-half": _case_kv_first_and_k_half,
    "block-strides-48-and-40": _case_block_strides_48_and_40,
    "transposed-and-rows": _case_transposed_and_rows,
    "packed-and-unpadded": _case_packed_and_unpadded,
}


def _targets(m: Mem, layout: kvtier.KVLayout) -> tuple[int, int, int, int]:
    """(g, b, h, c): a page of group g and one of group h != g that share a byte."""
    for g in layout.group_ids:
        for h in layout.group_ids:
            if g == h:
                continue
            for b in range(layout.group(g).num_blocks):
                for c in range(layout.group(h).num_blocks):
                    if m.page_set(g, b) & m.page_set(h, c) and b != c:
                        return g, b, h, c
    for g in layout.group_ids:  # same block ids only
        for h in layout.group_ids:
            if g != h and m.page_set(g, 3) & m.page_set(h, 3):
                return g, 3, h, 3
    raise AssertionError("no shared page")


@pytest.mark.parametrize("reverse", [False, True], ids=["natural", "reversed-units"])
@pytest.mark.parametrize("case", sorted(FIXED))
async def test_fixed_shared_layouts_later_call_wins_every_time(case: str, reverse: bool) -> None:
    """Five calls in one iteration, ten rounds, call order rotated: the later call wins each time.

    Calls: group g into page b, group h into page c (sharing bytes with b), and
    partial chunks (offset 1) of both into the same pages, in changing order.
    """
    m = FIXED[case]()
    layout = m.layout()
    g, b, h, c = _targets(m, layout)
    ref = Reference(m)
    nb_g, nb_h = layout.group(g).num_blocks, layout.group(h).num_blocks
    stores = [
        *(C(key(f"{case}g{i}", g), [(b + 1 + i) % nb_g, (b + 2 + i) % nb_g]) for i in range(3)),
        *(C(key(f"{case}h{i}", h), [(c + 1 + i) % nb_h, (c + 2 + i) % nb_h]) for i in range(3)),
    ]
    for chunk in stores:
        ref.store(chunk)
    with reversed_units(reverse):
        async with kvtier.TransferEngine(layout, config(2)) as engine:
            assert len((await engine.store(stores)).stored) == 6
            for rnd in range(10):
                kg = [key(f"{case}g{i}", g) for i in range(3)]
                kh = [key(f"{case}h{i}", h) for i in range(3)]
                calls = [
                    [C(kg[rnd % 3], [b])],
                    [C(kh[rnd % 3], [c])],
                    [C(kg[(rnd + 1) % 3], [b], 1)],
                    [C(kh[(rnd + 1) % 3], [c], 1), C(kg[(rnd + 2) % 3], [(b + 4) % nb_g])],
                    [C(kg[(rnd + 2) % 3], [b])],
                ]
                rng = random.Random(rnd)
                rng.shuffle(calls)
                expect = await load_calls(engine, ref, calls)
                assert np.array_equal(m.mem, expect), f"round {rnd}: {diff(m.mem, expect)}"


@pytest.mark.parametrize("case", sorted(FIXED))
async def test_one_call_writing_a_shared_byte_twice_is_refused_and_changes_nothing(
    case: str,
) -> None:
    """One load whose chunks (two groups) write a byte twice: BlockIdError, nothing written."""
    m = FIXED[case]()
    layout = m.layout()
    g, b, h, c = _targets(m, layout)
    ref = Reference(m)
    x, y = C(key("x", g), [0]), C(key("y", h), [1])
    async with kvtier.TransferEngine(layout, config(1)) as engine:
        assert len((await engine.store([x, y])).stored) == 2
        for chunk in (x, y):
            ref.store(chunk)
        before = m.mem.copy()
        stats = engine.stats()
        with pytest.raises(errors.BlockIdError):
            await engine.load([C(x.key, [b]), C(y.key, [c])])
        assert np.array_equal(m.mem, before)
        assert engine.stats() == stats
        # pages of the two groups that share no byte load together
        for b2 in range(layout.group(g).num_blocks):
            if not m.page_set(g, b2) & m.page_set(h, c):
                expect = await load_calls(engine, ref, [[C(x.key, [b2]), C(y.key, [c])]])
                assert np.array_equal(m.mem, expect), diff(m.mem, expect)
                break


async def test_packed_groups_load_the_same_block_ids_in_one_call() -> None:
    m = _case_packed_and_unpadded()
    layout = m.layout()
    ref = Reference(m)
    stores = [C(key(f"p{g}", g), [g + 1, 7 - g]) for g in range(3)]
    for chunk in stores:
        ref.store(chunk)
    async with kvtier.TransferEngine(layout, config(2)) as engine:
        assert len((await engine.store(stores)).stored) == 3
        call = [C(s.key, [4, 5]) for s in stores]
        assert not ref.writes_twice(call)
        expect = await load_calls(engine, ref, [call])
        assert np.array_equal(m.mem, expect), diff(m.mem, expect)


async def test_consecutive_slots_loaded_into_one_block_by_several_calls() -> None:
    """Full chunks in consecutive slots that write one block: chunk by chunk, later wins.

    A descriptor table (``kvtier._copytable.execute``) scatters with ONE NumPy
    assignment per row size, where call order would hold only because NumPy
    assigns repeated indices in order (not documented); such a job is copied
    chunk by chunk instead (``run_plan(in_order=True)``).
    """
    m = _case_kv_first_and_k_half()
    layout = m.layout()
    ref = Reference(m)
    stores = [C(key(f"run{i}", 0), [i, (i + 3) % 8]) for i in range(5)]
    for chunk in stores:
        ref.store(chunk)
    runs: list[int] = []
    real = transfer.execute

    def spy(table: Any) -> None:
        runs.append(len(table.nbytes))
        real(table)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer, "execute", spy)
        async with kvtier.TransferEngine(layout, config(2)) as engine:
            assert len((await engine.store(stores)).stored) == 5
            assert runs  # the store went through a table
            runs.clear()
            slots = [engine._pool.get(s.key).slot for s in stores]
            assert slots == sorted(slots)
            assert slots == list(range(slots[0], slots[0] + 5))
            calls = [[C(s.key, [6, 2])] for s in stores]  # all five into blocks 6 and 2
            expect = m.mem.copy()
            for call in calls:
                ref.load(expect, call[0])
            out = await asyncio.gather(*(engine.load(c) for c in calls))
            assert all(not r.failed for r in out)
            assert engine.stats().load_jobs == 1
    assert runs == []  # no one-call scatter over repeated block ids
    assert np.array_equal(m.mem, expect), diff(m.mem, expect)


@pytest.mark.parametrize("case", ["two-block-dims", "kv-first-and-k-half"])
async def test_calls_split_into_several_jobs_keep_call_order(case: str) -> None:
    """``max_batch_chunks=1``: each call of one iteration is a job of its own; and a job of
    the next iteration, split over both threads last unit first, still follows."""
    m = FIXED[case]()
    layout = m.layout()
    g, b, h, c = _targets(m, layout)
    ref = Reference(m)
    stores = [C(key(f"sj{i}", (g, h)[i % 2]), [i]) for i in range(6)]
    for chunk in stores:
        ref.store(chunk)
    with reversed_units():
        cfg = config(1, max_batch_chunks=1)
        async with kvtier.TransferEngine(layout, cfg) as engine:
            assert len((await engine.store(stores)).stored) == 6
            calls = [[C(s.key, [(b, c)[i % 2]])] for i, s in enumerate(stores)]
            expect = await load_calls(engine, ref, calls, jobs_per_call=0)
            assert np.array_equal(m.mem, expect), diff(m.mem, expect)
        stores = [C(key(f"sj2.{i}", (g, h)[i % 2]), [i]) for i in range(6)]
        for chunk in stores:
            ref.store(chunk)  # from the memory as the first engine left it
        async with kvtier.TransferEngine(layout, config(1)) as engine:
            assert len((await engine.store(stores)).stored) == 6
            # iteration 1: one job of six calls into other blocks, then group g into b;
            # iteration 2: group h into c (shares bytes with b)
            nb_g = layout.group(g).num_blocks
            first = [[C(s.key, [(b + 1 + i) % nb_g])] for i, s in enumerate(stores[:6:2])]
            first.append([C(stores[2].key, [b])])
            expect = ref.m.mem.copy()
            for call in first:
                ref.load(expect, call[0])
            ref.load(expect, C(stores[1].key, [c]))
            jobs = engine.stats().load_jobs
            tasks = [asyncio.ensure_future(engine.load(call)) for call in first]
            for _ in range(3):
                await asyncio.sleep(0)
            last = asyncio.ensure_future(engine.load([C(stores[1].key, [c])]))
            out = await asyncio.gather(*tasks, last)
            assert all(not r.failed for r in out)
            assert engine.stats().load_jobs == jobs + 2  # two jobs, the second one queued
            assert np.array_equal(m.mem, expect), diff(m.mem, expect)


def test_background_engine_back_to_back_loads_later_call_wins() -> None:
    m = _case_two_block_dims()
    layout = m.layout()
    ref = Reference(m)
    a, b = C(key("bg-a", 0), [1]), C(key("bg-b", 1), [2])
    with kvtier.BackgroundEngine(layout, config(1)) as bg:
        assert len(bg.store([a, b]).result(30).stored) == 2
        for chunk in (a, b):
            ref.store(chunk)
        for rnd in range(10):
            # group 0's block 5 and group 1's block 3 share t[5, 3]
            calls = [[C(a.key, [5])], [C(b.key, [3])]]
            if rnd % 2:
                calls.reverse()
            expect = m.mem.copy()
            for call in calls:
                ref.load(expect, call[0])
            futures = [bg.load(call) for call in calls]
            assert all(not f.result(30).failed for f in futures)
            assert np.array_equal(m.mem, expect), f"round {rnd}: {diff(m.mem, expect)}"


# ---------------------------------------------------------------- regressions


# Regression: a load call that waits for its key's store in flight is not submitted
# after the later calls of its iteration (TransferEngine.load: _must_wait -> _load
# task; the others take the fast path to _submit_load), which left the EARLIER call's
# bytes.
@pytest.mark.parametrize("shared", [False, True], ids=["one-group", "aliased-groups"])
async def test_earlier_load_waiting_for_its_store_still_loses_to_the_later_call(
    shared: bool,
) -> None:
    m = (
        _case_dtype_views()
        if shared
        else Mem({0: {"t": Rec(0, torch.uint8, (8, 64), (64, 1), 0, 0)}})
    )
    layout = m.layout()
    ref = Reference(m)
    gy = 1 if shared else 0
    x, y = C(key("x", 0), [1]), C(key("y", gy), [2])
    async with kvtier.TransferEngine(layout, config(1)) as engine:
        assert len((await engine.store([y])).stored) == 1
        ref.store(y)
        ref.store(x)
        expect = m.mem.copy()
        ref.load(expect, C(x.key, [5]))
        ref.load(expect, C(y.key, [5]))  # the later call: its bytes are left
        out = await asyncio.gather(
            engine.store([x]),  # x's store is in flight when its load is called
            engine.load([C(x.key, [5])]),
            engine.load([C(y.key, [5])]),
        )
        assert out[0].stored == (x.key,)
        assert not out[1].failed
        assert not out[2].failed
    assert np.array_equal(m.mem, expect), diff(m.mem, expect)


# Regression: a load call whose key must be promoted from NVMe is not submitted after
# the promotion, behind a later call of the same iteration into the same GPU bytes
# (TransferEngine.load: _must_wait -> _load task), which left the EARLIER call's bytes.
async def test_earlier_load_promoted_from_nvme_still_loses_to_the_later_call(
    tmp_path: Path,
) -> None:
    m = _case_two_block_dims()
    layout = m.layout()
    ref = Reference(m)
    x, y = C(key("nv-x", 0), [1]), C(key("nv-y", 1), [2])
    nvme = kvtier.NVMeConfig(root=str(tmp_path), capacity_bytes=64 << 20, namespace="promoted")
    async with kvtier.TransferEngine(layout, config(1, nvme=nvme)) as engine:
        assert len((await engine.store([x], durable=True)).stored) == 1
    ref.store(x)
    async with kvtier.TransferEngine(layout, config(1, nvme=nvme)) as engine:  # x: NVMe only
        assert len((await engine.store([y])).stored) == 1
        ref.store(y)
        assert engine.lookup([x.key, y.key]) == [kvtier.Residency.NVME, kvtier.Residency.CPU]
        expect = m.mem.copy()
        # group 0's block 5 and group 1's block 3 share t[5, 3]
        ref.load(expect, C(x.key, [5]))
        ref.load(expect, C(y.key, [3]))
        out = await asyncio.gather(engine.load([C(x.key, [5])]), engine.load([C(y.key, [3])]))
        assert not out[0].failed
        assert not out[1].failed
    assert np.array_equal(m.mem, expect), diff(m.mem, expect)
