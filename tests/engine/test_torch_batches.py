"""The torch copy path (CUDA hosts' code, here on CPU tensors) batches the chunks of a job.

Chunks of one group with the same sub-block range are copied together: one
``index_select`` (store) or ``index_copy_`` (load) per piece for the whole
batch, and one ``torch._foreach_copy_`` for its slot copies. On CUDA each call
is a launch from the event loop thread; these tests count the calls and check
every byte, against the NumPy path's slot images too.
"""

from __future__ import annotations

import asyncio
import collections
import random
from typing import Any

import pytest
import torch

import kvtier
from tests.engine.helpers import fill_random, key


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Select the torch path and count its index and foreach calls (from any thread)."""
    monkeypatch.setattr("kvtier._engine.host_pieces", lambda *a, **k: None)
    counts: collections.Counter[str] = collections.Counter()
    for name in ("index_select", "index_copy_"):
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _real: Any = real, _n: str = name) -> Any:
            counts[_n] += 1
            return _real(self, *a)

        monkeypatch.setattr(torch.Tensor, name, counted)
    real_foreach = torch._foreach_copy_

    def foreach(dst: Any, src: Any, **kw: Any) -> Any:
        counts["foreach_copy_"] += 1
        counts["foreach_items"] += len(dst)
        return real_foreach(dst, src, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", foreach)
    return counts


KV_PAYLOAD = 100


def _layout(num_blocks: int) -> tuple[kvtier.KVLayout, list[torch.Tensor]]:
    """Two groups: three packed layers each, plus one K/V-outside-block-dim layer (staged)."""
    tensors, groups = [], {}
    for g in (0, 1):
        layers = {}
        for i in range(3):
            t = torch.empty((num_blocks, 2, 4, 1, 8 * (g + 1)), dtype=torch.bfloat16)
            fill_random(t, 10 * g + i)
            layers[f"g{g}.l{i}"] = t
            tensors.append(t)
        kv = torch.empty((2, num_blocks, 4, 8), dtype=torch.float16)  # K/V outside block dim
        fill_random(kv, 100 + g)
        layers[f"g{g}.kv"] = kv
        tensors.append(kv)
        groups[g] = layers
    block_dim = {name: (1 if name.endswith(".kv") else 0) for g in groups.values() for name in g}
    # An unpadded payload of K (64 B) + 36 B of V: two pieces per page, the staged copy.
    payload = {name: KV_PAYLOAD for name in block_dim if name.endswith(".kv")}
    layout = kvtier.KVLayout.from_tensors(groups, block_dim=block_dim, payload_nbytes=payload)
    assert all(len(layout.group(g).layers[-1].pieces) == 2 for g in groups)
    return layout, tensors


def _chunks(num_blocks: int, n_per_group: int, bpc: int, seed: int) -> list[kvtier.Chunk]:
    rng = random.Random(seed)
    # distinct per group, below the last 8 blocks (_partials' blocks)
    blocks = {g: rng.sample(range(num_blocks - 8), n_per_group * bpc) for g in (0, 1)}
    out = []
    for i in range(n_per_group):
        for g in (0, 1):  # interleaved groups: batching must not depend on plan order
            out.append(kvtier.Chunk(key(f"c{i}", g), blocks[g][i * bpc : (i + 1) * bpc]))
    return out


def _config(bpc: int) -> kvtier.EngineConfig:
    # One copy thread: on CPU tensors a job is then ONE run_plan call, as on a CUDA
    # stream (several threads split it into units, each batched on its own).
    return kvtier.EngineConfig(16 << 20, bpc, copy_threads=1)


def _check_blocks(
    tensors: list[torch.Tensor], before: list[torch.Tensor], chunks: list[kvtier.Chunk]
) -> None:
    """Blocks of the chunks hold their original payload bytes; every other block is zero."""
    for pos, (t, b0) in enumerate(zip(tensors, before, strict=True)):
        g, dim = pos // 4, (1 if t.dim() == 4 else 0)
        n = KV_PAYLOAD if dim == 1 else None  # the kv layer's unpadded payload
        used = {b for c in chunks if c.key.group_id == g for b in c.block_ids}
        for b in range(t.shape[dim]):
            got = t.select(dim, b).contiguous().view(torch.uint8).flatten()[:n]
            want = b0.select(dim, b).contiguous().view(torch.uint8).flatten()[:n]
            assert torch.equal(got, want if b in used else torch.zeros_like(want)), (pos, b)


async def test_a_store_and_a_load_call_per_piece_not_per_chunk(
    torch_path: collections.Counter[str],
) -> None:
    nb, bpc, k = 64, 4, 8
    layout, tensors = _layout(nb)
    packed = 3  # packed layers per group, one piece each; the kv layer has two (staged)
    chunks = _chunks(nb, k, bpc, 1)
    before = [t.clone() for t in tensors]
    async with kvtier.TransferEngine(layout, _config(bpc)) as engine:
        res = await engine.store(chunks)
        assert len(res.stored) == 2 * k
        stored = collections.Counter(torch_path)
        for t in tensors:
            t.zero_()
        out = await engine.load(chunks)
        assert not out.failed
    loaded = torch_path - stored
    # ONE gather (scatter) per piece and group for all k chunks (the kv layer's two
    # pieces too), and one foreach of k slot copies per group (one per chunk).
    assert stored["index_select"] == 2 * (packed + 2)
    assert stored["foreach_copy_"] == 2
    assert stored["foreach_items"] == 2 * k
    assert loaded["index_copy_"] == 2 * (packed + 2)
    assert loaded["foreach_copy_"] == 2
    assert loaded["foreach_items"] == 2 * k
    _check_blocks(tensors, before, chunks)


def _partials(num_blocks: int) -> list[kvtier.Chunk]:
    """Per group, in the last 8 blocks: three chunks of sub-blocks [1, 3), one of [0, 1)."""
    base = num_blocks - 8
    out = []
    for g in (0, 1):
        out += [
            kvtier.Chunk(key(f"p{i}", g), [base + 2 * i, base + 2 * i + 1], 1) for i in range(3)
        ]
        out.append(kvtier.Chunk(key("q", g), [base + 7], 0))
    return out


async def _slot_images(
    monkeypatch: pytest.MonkeyPatch, torch_path: bool, chunks: list[kvtier.Chunk]
) -> list[torch.Tensor]:
    """Store ``chunks`` on one path; return each chunk's slot bytes; check a load restores them."""
    nb, bpc = 64, 4
    layout, tensors = _layout(nb)
    before = [t.clone() for t in tensors]
    with monkeypatch.context() as m:
        if torch_path:
            m.setattr("kvtier._engine.host_pieces", lambda *a, **k: None)
        async with kvtier.TransferEngine(layout, _config(bpc)) as engine:
            res = await engine.store(chunks)
            assert len(res.stored) == len(chunks)
            assert engine._region is not None
            images = [
                engine._region.slot(engine._pool.get(c.key).slot, engine.slot_nbytes).clone()
                for c in chunks
            ]
            for t in tensors:
                t.zero_()
            out = await engine.load(chunks)
            assert not out.failed
    _check_blocks(tensors, before, chunks)
    return images


async def test_batched_slots_hold_the_numpy_paths_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot bytes are the NVMe row format: a CUDA host's rows must equal a CPU host's."""
    chunks = _chunks(64, 5, 4, 2)[:7] + _partials(64)  # full chunks, then partial ones
    numpy_images = await _slot_images(monkeypatch, False, chunks)
    torch_images = await _slot_images(monkeypatch, True, chunks)
    for i, (a, b) in enumerate(zip(numpy_images, torch_images, strict=True)):
        assert torch.equal(a, b), f"slot of chunk {i}: the NumPy and torch paths differ"


async def test_two_loads_into_one_block_in_one_job_go_chunk_by_chunk_in_order(
    torch_path: collections.Counter[str],
) -> None:
    nb, bpc = 64, 4
    layout, tensors = _layout(nb)
    first, second = (kvtier.Chunk(key(n, 0), [1, 2, 3, 4]) for n in ("first", "second"))
    async with kvtier.TransferEngine(layout, _config(bpc)) as engine:
        assert len((await engine.store([first])).stored) == 1
        for t in tensors[:4]:  # group 0's blocks 1..4 change: `second` stores other bytes
            t.view(torch.uint8).bitwise_not_()
        assert len((await engine.store([second])).stored) == 1
        second_bytes = [t.clone() for t in tensors]
        before = collections.Counter(torch_path)
        jobs = engine.stats().load_jobs
        target = [kvtier.Chunk(c.key, [9, 10, 11, 12]) for c in (first, second)]
        a, b = await asyncio.gather(engine.load([target[0]]), engine.load([target[1]]))
        assert not a.failed
        assert not b.failed
        assert engine.stats().load_jobs == jobs + 1  # one job: both calls coalesced
        # copied chunk by chunk: one slot copy per call of the foreach loop
        assert torch_path["foreach_copy_"] == before["foreach_copy_"] + 2
        assert torch_path["foreach_items"] == before["foreach_items"] + 2
    for t, t2 in zip(tensors[:4], second_bytes[:4], strict=True):
        dim = 1 if t.dim() == 4 else 0
        n = KV_PAYLOAD if dim == 1 else None
        for dst, src in zip((9, 10, 11, 12), (1, 2, 3, 4), strict=True):
            got = t.select(dim, dst).contiguous().view(torch.uint8).flatten()[:n]
            last = t2.select(dim, src).contiguous().view(torch.uint8).flatten()[:n]
            assert torch.equal(got, last)  # the later load's bytes, whole


async def test_batches_are_capped_in_block_ids_and_bytes(
    torch_path: collections.Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch holds at most _BATCH_IDS block ids and _BATCH_NBYTES of slot bytes (its
    device buffer): more chunks make more batches, and the bytes stay right."""
    import kvtier._transfer as transfer

    nb, bpc, k = 64, 4, 8
    layout, tensors = _layout(nb)
    chunks = _chunks(nb, k, bpc, 3)
    before = [t.clone() for t in tensors]
    monkeypatch.setattr(transfer, "_BATCH_IDS", 3 * bpc)  # 3 chunks per batch: 3 + 3 + 2
    async with kvtier.TransferEngine(layout, _config(bpc)) as engine:
        assert len((await engine.store(chunks)).stored) == 2 * k
        stored = collections.Counter(torch_path)
        for t in tensors:
            t.zero_()
        assert not (await engine.load(chunks)).failed
    assert stored["foreach_copy_"] == 2 * 3  # groups x batches
    assert stored["foreach_items"] == 2 * k
    _check_blocks(tensors, before, chunks)
    # A chunk's slot bytes (1936 in group 0, 3472 in group 1) take 4 KiB of the device
    # buffer each: 3 chunks per 12 KiB batch, 3 + 3 + 2 in each group.
    monkeypatch.setattr(transfer, "_BATCH_IDS", 4096)
    monkeypatch.setattr(transfer, "_BATCH_NBYTES", 3 * 4096)
    torch_path.clear()
    for t, b0 in zip(tensors, before, strict=True):
        t.copy_(b0)
    async with kvtier.TransferEngine(layout, _config(bpc)) as engine:
        assert len((await engine.store(chunks)).stored) == 2 * k
        assert torch_path["foreach_copy_"] == 2 * 3
        for t in tensors:
            t.zero_()
        assert not (await engine.load(chunks)).failed
    _check_blocks(tensors, before, chunks)
