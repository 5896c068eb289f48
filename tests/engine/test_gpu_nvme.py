"""The NVMe tier under a CUDA layout, on every row I/O backend (skipped without a GPU).

Three unequal groups (a K/V-first tensor, an unpadded payload, partial
chunks), a CPU tier too small for them so loads promote rows from NVMe, and
a reopen of the same root by a new engine: every byte that reaches the GPU is
compared with ``torch.equal`` on its bytes.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier.io._rowio import kvikio_available
from tests.engine.helpers import fill_random, key, same

pytestmark = pytest.mark.gpu

BPC = 4
NB = 64
BACKENDS = [
    "posix",
    pytest.param(
        "kvikio",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or not kvikio_available(),
            reason="kvikio or a CUDA driver is not available",
        ),
    ),
]


def _build(seed: int | None) -> tuple[kvtier.KVLayout, list[torch.Tensor], list[int]]:
    """The 3-group layout on CUDA: random bytes (``seed``) or 0xEE everywhere (None)."""
    g0 = torch.empty((NB, 2, 8, 1, 32), dtype=torch.bfloat16)  # 1 KiB pages
    g1 = torch.empty((2, NB, 8, 2, 32), dtype=torch.float16)  # K/V-first, 2 KiB pages
    g2 = torch.empty((NB, 4096 + 512), dtype=torch.uint8)  # 4 KiB payload + padding
    tensors = []
    for i, t in enumerate((g0, g1, g2)):
        if seed is None:
            t.view(torch.uint8).fill_(0xEE)
        else:
            fill_random(t, seed + i)
        tensors.append(t.to("cuda"))
    layout = kvtier.KVLayout.from_tensors(
        {0: {"full.0": tensors[0]}, 1: {"swa.0": tensors[1]}, 2: {"lin.0": tensors[2]}},
        block_dim={"full.0": 0, "swa.0": 1, "lin.0": 0},
        payload_nbytes={"lin.0": 4096},
    )
    return layout, tensors, [0, 1, 0]


def _pages(tensors: list[torch.Tensor], dims: list[int], g: int, ids: list[int]) -> torch.Tensor:
    """The payload bytes of blocks ``ids`` of group ``g`` (a CPU copy)."""
    idx = torch.tensor(ids, device="cuda")
    t = tensors[g].index_select(dims[g], idx)
    if g == 2:
        t = t[:, :4096]
    return t.cpu()


def _config(root: Path, backend: str, cpu_bytes: int = 256 << 10) -> kvtier.EngineConfig:
    return kvtier.EngineConfig(
        cpu_bytes=cpu_bytes,
        blocks_per_chunk=BPC,
        nvme=kvtier.NVMeConfig(
            root=str(root),
            capacity_bytes=256 << 20,
            namespace="gpu",
            io_backend=backend,
            segment_nbytes=4 << 20,
        ),
    )


def _chunks() -> list[kvtier.Chunk]:
    rng = random.Random(5)
    out = []
    for g in range(3):
        for i in range(12):
            n = BPC if i % 3 else 2  # every third chunk partial, at offset 1
            ids = rng.sample(range(NB), n)
            out.append(kvtier.Chunk(key(f"r{g}.{i}", g), ids, offset=0 if n == BPC else 1))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
async def test_store_flush_reopen_promote_and_load_bitwise(tmp_path: Path, backend: str) -> None:
    chunks = _chunks()
    layout, tensors, dims = _build(seed=40)
    expected = {c.key: _pages(tensors, dims, c.key.group_id, c.block_ids) for c in chunks}
    async with kvtier.TransferEngine(layout, _config(tmp_path, backend)) as engine:
        assert engine.stats().nvme["backend"] == backend
        res = await engine.store(chunks)
        assert len(res.stored) + len(res.rejected) == len(chunks)
        assert res.stored  # the CPU tier holds only some of them at once
        rest = [c for c in chunks if c.key in set(res.rejected)]
        while rest:  # the rejected ones in later calls, as slots are written through
            await engine.flush()
            res = await engine.store(rest)
            rest = [c for c in rest if c.key in set(res.rejected)]
        await engine.flush()
    layout, tensors, dims = _build(seed=None)
    async with kvtier.TransferEngine(layout, _config(tmp_path, backend)) as engine:
        assert set(engine.lookup([c.key for c in chunks])) == {kvtier.Residency.NVME}
        for i in range(0, len(chunks), 6):  # more than the CPU tier holds: promotions evict
            # each chunk into blocks of its own (the stored ids overlap across chunks)
            call = [
                kvtier.Chunk(c.key, list(range(j * BPC, j * BPC + len(c.block_ids))), c.offset)
                for j, c in enumerate(chunks[i : i + 6])
            ]
            out = await engine.load(call)
            assert not out.failed, out.failed
            torch.cuda.synchronize()
            for c in call:
                assert same(_pages(tensors, dims, c.key.group_id, c.block_ids), expected[c.key])
        assert engine.stats().nvme_hits == len(chunks)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_random_calls_match_a_reference(tmp_path: Path, backend: str) -> None:
    # Concurrent stores and loads of random chunks, a CPU tier of a few slots:
    # every load brings back exactly the bytes its key was stored with.
    layout, tensors, dims = _build(seed=70)
    rng = random.Random(11)
    stored: dict[kvtier.OffloadKey, tuple[list[int], int, torch.Tensor]] = {}
    async with kvtier.TransferEngine(layout, _config(tmp_path, backend, 512 << 10)) as engine:
        for round_ in range(12):
            stores = []
            for i in range(8):
                g = rng.randrange(3)
                n = rng.randint(1, BPC)
                ids = rng.sample(range(NB), n)
                stores.append(kvtier.Chunk(key(f"k{round_}.{i}", g), ids, rng.randint(0, BPC - n)))
            pages = {c.key: _pages(tensors, dims, c.key.group_id, c.block_ids) for c in stores}
            loads = []
            taken: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
            for k in rng.sample(sorted(stored, key=repr), min(6, len(stored))):
                ids0, off, _ = stored[k]
                free = [b for b in range(NB) if b not in taken[k.group_id]]
                ids = rng.sample(free, len(ids0))
                taken[k.group_id].update(ids)
                loads.append(kvtier.Chunk(k, ids, off))
            if loads:  # the blocks a load writes are no store's source this round
                for c in stores:
                    c_ids = set(c.block_ids)
                    if c_ids & taken[c.key.group_id]:
                        pages.pop(c.key)
                stores = [c for c in stores if c.key in pages]
            st, ld = await asyncio.gather(engine.store(stores), engine.load(loads))
            assert not ld.failed, ld.failed
            await engine.flush()
            for c in stores:
                if c.key in st.stored:
                    stored[c.key] = (c.block_ids, c.offset, pages[c.key])
            torch.cuda.synchronize()
            for c in loads:
                got = _pages(tensors, dims, c.key.group_id, c.block_ids)
                assert same(got, stored[c.key][2]), (round_, c.key)
        assert engine.stats().nvme_hits > 0
