"""Fixtures of the NVMe tier tests: aligned slot buffers and a tier factory."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import pathlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from kvtier import OffloadKey
from kvtier.io import NVMeTier

LAYOUT: dict[str, Any] = {"groups": {"0": {"layers": ["a"]}, "1": {"layers": ["b"]}}}
GROUP_NBYTES = {0: 3 * 4096 + 100, 1: 4096, 2: 10_000}  # unequal, not 4 KiB multiples
BLOCKS_PER_CHUNK = 4


def key(i: int, group_id: int = 0) -> OffloadKey:
    return OffloadKey(f"hash-{i}".encode(), group_id)


def payload(k: OffloadKey, nbytes: int, salt: int = 0) -> bytes:
    """Deterministic bytes of a key (differs per key, group and salt)."""
    seed = hashlib.sha256(k.block_hash + bytes([k.group_id, salt & 0xFF])).digest()
    block = bytes((seed[0] + i * (seed[1] | 1)) & 0xFF for i in range(256))
    return (block * (nbytes // 256 + 1))[:nbytes]


def hashes(tier: NVMeTier) -> list[bytes]:
    """Sorted block hashes of a tier's visible keys."""
    return sorted(k.block_hash for k in list(tier.keys()))


def tier_kwargs(root: pathlib.Path | str, **over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "root": root,
        "namespace": "test/rank0",
        "capacity_bytes": 64 << 20,
        "layout_description": LAYOUT,
        "blocks_per_chunk": BLOCKS_PER_CHUNK,
        "group_nbytes": GROUP_NBYTES,
        "io_backend": "posix",
        "direct_io": "auto",
        "io_threads": 2,
        "segment_nbytes": 1 << 20,
        "request_nbytes": 1 << 20,
    }
    kw.update(over)
    return kw


class Slots:
    """Page-aligned slot buffers (an anonymous mmap, like the engine's pool)."""

    def __init__(self, count: int, slot_nbytes: int) -> None:
        self.slot_nbytes = slot_nbytes
        self._mm = mmap.mmap(-1, count * slot_nbytes)
        self._view = memoryview(self._mm)
        self.count = count

    def __getitem__(self, i: int) -> memoryview:
        return self._view[i * self.slot_nbytes : (i + 1) * self.slot_nbytes]

    def fill(self, i: int, data: bytes) -> memoryview:
        self[i][: len(data)] = data
        return self[i]

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # slices still alive: let GC do it
            self._view.release()
            self._mm.close()


@pytest.fixture
def slots() -> Iterator[Callable[[int, int], Slots]]:
    made: list[Slots] = []

    def make(count: int, slot_nbytes: int = 8 * 4096) -> Slots:
        s = Slots(count, slot_nbytes)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
async def open_tier(tmp_path: pathlib.Path) -> AsyncIterator[Callable[..., Any]]:
    """Factory: ``await open_tier(**overrides)`` -> an open NVMeTier, closed at teardown."""
    tiers: list[NVMeTier] = []

    async def make(**over: Any) -> NVMeTier:
        tier = NVMeTier(**tier_kwargs(over.pop("root", tmp_path / "nvme"), **over))
        await tier.open()
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        await tier.close()
