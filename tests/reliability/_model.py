"""Shared pieces of the reliability suites: a two-group layout and a model of key contents.

Keys are content-addressed: the bytes of sub-block ``j`` of a key are a pure
function of ``(block_hash, group_id, j)``. A test writes them into the "GPU"
blocks before a store, scribbles the blocks before a load and then checks the
blocks byte for byte; a block that a failed load must not touch keeps the
scribble pattern.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import torch

import kvtier
from kvtier.io import RowIO

BPC = 4
"""blocks_per_chunk of every reliability layout."""

SCRIBBLE = 0xEE
"""Byte that fills "GPU" blocks before a load."""

PAGE_NBYTES = {0: 2048, 1: 1024}
"""Bytes of one block's page per group (group 1 is K/V-first: two 512-byte planes)."""


def key(name: object, group_id: int) -> kvtier.OffloadKey:
    """A content-addressed key: the hash of ``name`` in group ``group_id``."""
    digest = hashlib.blake2b(f"rel:{name}".encode(), digest_size=16).digest()
    return kvtier.OffloadKey(digest, group_id)


class Gpu:
    """The "GPU" KV cache: group 0 ``(nb, 2, 16, 32)`` fp16, group 1 ``(2, nb, 8, 32)`` bf16.

    Group 1 is K/V-first. Group 0 pages are 2 KiB (one piece); group 1 pages
    are two 512-byte planes (two pieces per page), so ``slot_nbytes(4) = 8 KiB
    + 4 KiB trailer``, rows are 12 KiB (group 0) and 8 KiB (group 1).
    """

    def __init__(self, num_blocks: int = 64) -> None:
        self.num_blocks = num_blocks
        self.t0 = torch.zeros((num_blocks, 2, 16, 32), dtype=torch.float16)
        self.t1 = torch.zeros((2, num_blocks, 8, 32), dtype=torch.bfloat16)
        self.layout = kvtier.KVLayout.from_tensors(
            {0: {"full.0": self.t0}, 1: {"swa.0": self.t1}},
            block_dim={"full.0": 0, "swa.0": 1},
        )
        self._u0 = self.t0.view(torch.uint8).view(num_blocks, PAGE_NBYTES[0])
        self._u1 = self.t1.view(torch.uint8).view(2, num_blocks, PAGE_NBYTES[1] // 2)
        self._cache: dict[tuple[kvtier.OffloadKey, int], torch.Tensor] = {}

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one CPU slot (also the size of a group-0 row)."""
        return self.layout.slot_nbytes(BPC)

    def page(self, group_id: int, block_id: int) -> torch.Tensor:
        """The uint8 bytes of one block's page (a view; group 1: shape ``(2, 512)``)."""
        if group_id == 0:
            return self._u0[block_id]
        return self._u1[:, block_id]

    def content(self, k: kvtier.OffloadKey, sub_block: int) -> torch.Tensor:
        """The bytes sub-block ``sub_block`` of key ``k`` always holds (shaped like its page)."""
        cached = self._cache.get((k, sub_block))
        if cached is None:
            seed = int.from_bytes(hashlib.blake2b(k.block_hash, digest_size=7).digest(), "little")
            gen = torch.Generator().manual_seed(seed * 131 + k.group_id * 17 + sub_block)
            shape = self.page(k.group_id, 0).shape
            cached = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            self._cache[(k, sub_block)] = cached
        return cached

    def write(self, chunk: kvtier.Chunk) -> None:
        """Put the chunk's true bytes into its GPU blocks (before a store)."""
        for j, b in enumerate(chunk.block_ids):
            self.page(chunk.key.group_id, b).copy_(self.content(chunk.key, chunk.offset + j))

    def scribble(self, chunk: kvtier.Chunk) -> None:
        """Fill the chunk's GPU blocks with :data:`SCRIBBLE` (before a load)."""
        for b in chunk.block_ids:
            self.page(chunk.key.group_id, b).fill_(SCRIBBLE)

    def holds(self, chunk: kvtier.Chunk) -> bool:
        """Whether the chunk's GPU blocks hold exactly the key's bytes."""
        return all(
            torch.equal(self.page(chunk.key.group_id, b), self.content(chunk.key, chunk.offset + j))
            for j, b in enumerate(chunk.block_ids)
        )

    def untouched(self, chunk: kvtier.Chunk) -> bool:
        """Whether every byte of the chunk's GPU blocks is still :data:`SCRIBBLE`."""
        return all(
            bool((self.page(chunk.key.group_id, b) == SCRIBBLE).all()) for b in chunk.block_ids
        )

    def holds_or_untouched(self, chunk: kvtier.Chunk) -> bool:
        """Per block: the true bytes or the scribble, nothing else (cancelled loads)."""
        for j, b in enumerate(chunk.block_ids):
            page = self.page(chunk.key.group_id, b)
            ok = torch.equal(page, self.content(chunk.key, chunk.offset + j))
            if not ok and not bool((page == SCRIBBLE).all()):
                return False
        return True


def chunks(
    names: Iterable[object], group_id: int | None = None, first_block: int = 0
) -> list[kvtier.Chunk]:
    """Full chunks for ``names`` on consecutive GPU blocks; groups alternate when not given."""
    keys = [key(n, i % 2 if group_id is None else group_id) for i, n in enumerate(names)]
    return chunks_for(keys, first_block)


def chunks_for(keys: Iterable[kvtier.OffloadKey], first_block: int = 0) -> list[kvtier.Chunk]:
    """Full chunks for ``keys``; each group's chunks on consecutive blocks from ``first_block``."""
    out = []
    per_group: dict[int, int] = {}
    for k in keys:
        start = first_block + per_group.get(k.group_id, 0)
        per_group[k.group_id] = per_group.get(k.group_id, 0) + BPC
        out.append(kvtier.Chunk(k, list(range(start, start + BPC))))
    return out


def nvme_config(
    root: str | os.PathLike[str],
    *,
    capacity_bytes: int = 32 << 20,
    namespace: str = "reliability",
    wrapper: Callable[[RowIO], RowIO] | None = None,
    request_nbytes: int = 4 << 20,
    segment_nbytes: int = 256 << 10,
    **kw: Any,
) -> kvtier.NVMeConfig:
    """An NVMe tier config for tests (posix backend, small segments)."""
    return kvtier.NVMeConfig(
        root=root,
        capacity_bytes=capacity_bytes,
        namespace=namespace,
        io_backend="posix",
        io_threads=2,
        segment_nbytes=segment_nbytes,
        request_nbytes=request_nbytes,
        row_io_wrapper=wrapper,
        **kw,
    )


def engine_config(
    gpu: Gpu, slots: int, nvme: kvtier.NVMeConfig | None = None, **kw: Any
) -> kvtier.EngineConfig:
    """An engine config whose pool holds exactly ``slots`` slots."""
    return kvtier.EngineConfig(
        cpu_bytes=slots * gpu.slot_nbytes, blocks_per_chunk=BPC, nvme=nvme, **kw
    )


async def store_ok(engine: kvtier.TransferEngine, gpu: Gpu, cs: Sequence[kvtier.Chunk]) -> None:
    """Write the chunks' bytes into the GPU and store them; every key must be stored or skipped."""
    for c in cs:
        gpu.write(c)
    res = await engine.store(cs)
    assert not res.rejected, res


async def load_check(
    engine: kvtier.TransferEngine, gpu: Gpu, cs: Sequence[kvtier.Chunk]
) -> kvtier.LoadResult:
    """Scribble, load and check: loaded keys hold their bytes, failed keys' blocks are untouched."""
    for c in cs:
        gpu.scribble(c)
    res = await engine.load(cs)
    for c in cs:
        if c.key in res.loaded:
            assert gpu.holds(c), f"{c.key} loaded WRONG bytes"
        else:
            assert c.key in res.failed, c.key
            assert gpu.untouched(c), f"failed load of {c.key} wrote bytes to its GPU blocks"
    return res


def tree(root: pathlib.Path) -> dict[str, bytes]:
    """Every file under ``root`` (but the lock file) and its bytes."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock"
    }


REST_TIMEOUT_S = 10.0


async def at_rest(engine: kvtier.TransferEngine, baseline: int | None = None) -> kvtier.EngineStats:
    """Wait until no slot is pinned or writing (and, given ``baseline``, no more
    than that many asyncio tasks run); fail after ``REST_TIMEOUT_S``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + REST_TIMEOUT_S
    while True:
        stats = engine.stats()
        rest = stats.slots_pinned == 0 and stats.slots_writing == 0
        if rest and (baseline is None or len(asyncio.all_tasks()) <= baseline):
            return stats
        if loop.time() > deadline:
            pytest.fail(f"not at rest: {stats}, {len(asyncio.all_tasks())} tasks > {baseline}")
        await asyncio.sleep(0.002)
