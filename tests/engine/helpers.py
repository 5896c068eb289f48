"""Test helpers: layouts with recognisable bytes, and a reference model of slot contents."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import kvtier
from tests.io.faults import DelegatingRowIO


def key(name: str | int, group_id: int) -> kvtier.OffloadKey:
    return kvtier.OffloadKey(hashlib.blake2b(str(name).encode(), digest_size=16).digest(), group_id)


def after_iterations(n: int, fn: Callable[[], object]) -> None:
    """Call ``fn`` on the running event loop ``n`` iterations from now."""
    loop = asyncio.get_running_loop()
    if n == 0:
        loop.call_soon(fn)
    else:
        loop.call_soon(after_iterations, n - 1, fn)


def fill_random(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    u8 = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8))


def equal_groups(
    nb: int, n_groups: int, layers_per_group: int, page: tuple[int, ...]
) -> dict[int, dict[str, torch.Tensor]]:
    groups = {}
    for g in range(n_groups):
        groups[g] = {}
        for i in range(layers_per_group):
            t = torch.empty((nb, *page), dtype=torch.float16)
            fill_random(t, 1000 * g + i)
            groups[g][f"layers.{g}.{i}"] = t
    return groups


def snapshot(layout: kvtier.KVLayout, group_id: int, block_ids: list[int]) -> list[torch.Tensor]:
    """The payload bytes of the given blocks of a group (one uint8 tensor per layer)."""
    out = []
    for layer in layout.group(group_id).layers:
        for piece in layer.pieces:
            out.append(piece.view[block_ids].clone().view(torch.uint8))
    return out


def clear_blocks(layout: kvtier.KVLayout, group_id: int, block_ids: list[int]) -> None:
    for layer in layout.group(group_id).layers:
        for piece in layer.pieces:
            piece.view[block_ids] = 0


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (bytes, not values: random bytes make NaNs and NaN != NaN)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def one_group(num_blocks: int = 64, seed: int = 11) -> tuple[kvtier.KVLayout, torch.Tensor, int]:
    """One group of one ``(num_blocks, 4096)`` uint8 tensor filled at random.

    Returns the layout, the tensor and ``slot_nbytes(1)`` (8 KiB: one block
    and its trailer; one row too).
    """
    t = torch.empty((num_blocks, 4096), dtype=torch.uint8)
    fill_random(t, seed)
    layout = kvtier.KVLayout.from_tensors({0: {"kv": t}})
    return layout, t, layout.slot_nbytes(1)


def filled_layout(
    shape: tuple[int, ...], *, dtype: torch.dtype = torch.uint8, seed: int = 11, name: str = "kv"
) -> tuple[kvtier.KVLayout, torch.Tensor]:
    """One group of one tensor of ``shape`` (block dim 0) filled at random.

    Args:
        shape: The tensor's shape; ``shape[0]`` is the number of GPU blocks.
        dtype: Its dtype.
        seed: The fill's seed (:func:`fill_random`).
        name: The layer's name (it enters the NVMe format digest).

    Returns:
        The layout (group 0) and the tensor.
    """
    t = torch.empty(shape, dtype=dtype)
    fill_random(t, seed)
    return kvtier.KVLayout.from_tensors({0: {name: t}}), t


def chunk_chain(name: str, n: int, first_block: int, group_id: int = 0) -> list[kvtier.Chunk]:
    """``n`` one-block chunks ``{name}0 .. {name}{n-1}`` on consecutive blocks, head first."""
    return [kvtier.Chunk(key(f"{name}{i}", group_id), [first_block + i]) for i in range(n)]


def prefetch_config(root: Any, slots: int = 8) -> kvtier.EngineConfig:
    """``slots`` two-block slots of the prefetch tests' layout, 16 MiB of NVMe under ``root``."""
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    nv = kvtier.NVMeConfig(
        root=root, capacity_bytes=16 << 20, namespace="prefetch", segment_nbytes=1 << 20
    )
    return kvtier.EngineConfig(slots * layout.slot_nbytes(2), 2, nvme=nv)


def prefetch_chunks(n: int = 4) -> list[kvtier.Chunk]:
    """``n`` two-block chunks of group 0: ``key(i, 0)`` on blocks ``2i`` and ``2i + 1``."""
    return [kvtier.Chunk(key(i, 0), [2 * i, 2 * i + 1]) for i in range(n)]


def keys_of(chunks: list[kvtier.Chunk]) -> list[kvtier.OffloadKey]:
    """The chunks' keys, in order."""
    return [c.key for c in chunks]


def nvme_rows(
    root: Any, slot: int, rows: int | None = None, namespace: str = "t", **kw: Any
) -> kvtier.NVMeConfig:
    """An NVMe tier under ``root``: 16 MiB, or with ``rows`` exactly that many rows.

    ``rows``: one segment of a 4 KiB header and ``rows`` rows of ``slot``
    bytes, and a capacity of just that (a full tier after ``rows`` keys).
    ``kw`` goes to :class:`kvtier.NVMeConfig` (``row_io_wrapper=...``).
    """
    if rows is None:
        return kvtier.NVMeConfig(root=root, capacity_bytes=1 << 24, namespace=namespace, **kw)
    size = 4096 + rows * slot
    return kvtier.NVMeConfig(
        root=root, capacity_bytes=size, namespace=namespace, segment_nbytes=size, **kw
    )


async def until(cond: Callable[[], object], seconds: float = 10.0) -> bool:
    """Poll ``cond`` on the running loop until it is true or ``seconds`` passed; its last value."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.002)
    return bool(cond())


async def settle(n: int = 5) -> None:
    """Let the loop run ``n`` rounds of ready callbacks (releases scheduled from elsewhere)."""
    for _ in range(n):
        await asyncio.sleep(0)


@contextlib.contextmanager
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """Collect what the running loop's exception handler gets (an exception in a callback)."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        yield errors
    finally:
        loop.set_exception_handler(old)


async def nvme_only(
    layout: kvtier.KVLayout, config: kvtier.EngineConfig, chunks: list[kvtier.Chunk]
) -> None:
    """Store ``chunks`` durably and close: the next engine of ``config`` finds them on NVMe only."""
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chunks, durable=True)


def logged(caplog: Any, text: str, logger: str = "kvtier") -> int:
    """How many records of ``logger`` that ``caplog`` captured contain ``text``."""
    return sum(text in r.getMessage() for r in caplog.records if r.name == logger)


class Gate:
    """Shared state of the gated RowIO wrappers of one test (one per tier open)."""

    def __init__(self) -> None:
        self.armed = False  # reads wait for ``opened``
        self.fail = False  # reads that passed the gate raise EIO
        self.opened = threading.Event()
        self.reading = threading.Event()  # a read waits at the gate
        self.delay: Callable[[], float] | None = None  # seconds each read sleeps

    def wrap(self, inner: Any) -> GatedRowIO:
        return GatedRowIO(inner, self)


class GatedRowIO(DelegatingRowIO):
    """Reads wait at ``gate`` while it is armed (``NVMeConfig.row_io_wrapper``)."""

    def __init__(self, inner: Any, gate: Gate) -> None:
        super().__init__(inner)
        self.gate = gate

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        g = self.gate
        if g.armed:
            g.reading.set()
            if not g.opened.wait(30):
                raise OSError(errno.EIO, "the test never opened the gate")
            if g.fail:
                raise OSError(errno.EIO, "injected EIO")
        if g.delay is not None:
            time.sleep(g.delay())
        return self.inner.preadv(handle, bufs, file_offset)
