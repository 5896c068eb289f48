"""Copy jobs between GPU blocks and CPU slots.

A *job* is every chunk copy of one direction submitted in one event-loop
iteration. Its plan is a list of :class:`ChunkCopy`; each expands, per distinct
layer and per rectangular piece of the page, into one vectorised torch call
(``index_select`` into the slot for stores, ``index_copy_`` into the GPU blocks
for loads; a plain strided ``copy_`` when the block ids are consecutive).

* CPU-only hosts: the "GPU" tensors are CPU tensors and the plan runs in a
  dedicated single-thread executor per direction (jobs of one direction
  complete in submission order; torch releases the GIL while copying).
* CUDA hosts: the plan is enqueued on a dedicated stream per direction that
  first waits on the compute stream; completion is a CUDA event polled from the
  event loop (never ``synchronize()`` on the loop thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.errors import TransferError
from kvtier.layout import GroupLayout

Direction = Literal["store", "load"]

_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


@dataclass(frozen=True, slots=True)
class ChunkCopy:
    """One chunk of one group between its GPU blocks and its CPU slot.

    Attributes:
        group: the group's layout.
        layer_offsets: byte offset of each distinct layer inside the slot.
        slot: uint8 view of the whole slot (CPU memory, 4 KiB aligned).
        block_ids: GPU block ids of sub-blocks ``start .. start+len(block_ids)``.
        start: first sub-block index inside the chunk.

    """

    group: GroupLayout
    layer_offsets: tuple[int, ...]
    slot: torch.Tensor
    block_ids: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        """Payload bytes this copy moves."""
        return len(self.block_ids) * self.group.block_payload_nbytes


def piece_contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """Row-major strides (in elements) of a contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def _consecutive(ids: tuple[int, ...]) -> bool:
    first = ids[0]
    return ids[-1] - first == len(ids) - 1 and all(b == first + i for i, b in enumerate(ids))


def _slot_piece(copy: ChunkCopy, li: int, pi: int) -> torch.Tensor:
    """The slot-side view matching piece ``pi`` of layer ``li``: ``(n, *piece_shape)``."""
    layer = copy.group.layers[li]
    piece = layer.pieces[pi]
    n = len(copy.block_ids)
    p = layer.payload_nbytes
    base = copy.layer_offsets[li] + copy.start * p
    region = copy.slot[base : base + n * p]
    shape = piece.view.shape[1:]
    if piece.page_start == 0 and piece.nbytes == p:
        out = region if piece.itemsize == 1 else region.view(piece.view.dtype)
        return out.view(n, *shape)
    cols = region.view(n, p)[:, piece.page_start : piece.page_start + piece.nbytes]
    if piece.itemsize != 1:
        cols = cols.view(piece.view.dtype)
    return (
        cols.view(n, *shape)
        if cols.is_contiguous()
        else cols.as_strided(
            (n, *shape), (cols.stride(0), *piece_contiguous_strides(shape)), cols.storage_offset()
        )
    )


def run_plan(plan: Sequence[ChunkCopy], direction: Direction) -> None:
    """Execute a job's copies synchronously (worker thread or CUDA stream context).

    Args:
        plan: the chunk copies.
        direction: ``"store"`` (GPU blocks -> slots) or ``"load"`` (slots -> GPU blocks).

    """
    for copy in plan:
        ids = copy.block_ids
        device = copy.group.layers[0].pieces[0].view.device
        run = _consecutive(ids)
        idx = None if run else torch.tensor(ids, dtype=torch.long, device=device)
        on_cpu = device.type == "cpu"
        for li, layer in enumerate(copy.group.layers):
            for pi, piece in enumerate(layer.pieces):
                slot_view = _slot_piece(copy, li, pi)
                if run:
                    gpu = piece.view[ids[0] : ids[0] + len(ids)]
                    if direction == "store":
                        slot_view.copy_(gpu, non_blocking=not on_cpu)
                    else:
                        gpu.copy_(slot_view, non_blocking=not on_cpu)
                    continue
                assert idx is not None
                if direction == "store":
                    if on_cpu and slot_view.is_contiguous():
                        torch.index_select(piece.view, 0, idx, out=slot_view)
                    else:
                        slot_view.copy_(piece.view.index_select(0, idx), non_blocking=not on_cpu)
                elif on_cpu:
                    piece.view.index_copy_(0, idx, slot_view)
                else:
                    piece.view.index_copy_(0, idx, slot_view.to(device, non_blocking=True))


class CopyExecutor:
    """Runs jobs of ONE direction in submission order.

    Args:
        device: the device of the registered KV cache tensors.
        direction: ``"store"`` or ``"load"``.

    """

    def __init__(self, device: torch.device, direction: Direction) -> None:
        self.device = device
        self.direction: Direction = direction
        self._cuda = device.type == "cuda"
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None
        if self._cuda:  # pragma: no cover - CUDA hosts only
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"kvtier-{direction}"
            )

    async def run(self, plan: Sequence[ChunkCopy]) -> None:
        """Copy a job and return when every byte has landed.

        Never blocks the event loop. Cancelling the awaiting task does NOT stop
        the copy; callers shield it so that slots stay reserved until it ends.

        Raises:
            TransferError: a copy failed (from the torch error).

        """
        loop = asyncio.get_running_loop()
        if self._pool is not None:
            try:
                await loop.run_in_executor(self._pool, run_plan, plan, self.direction)
            except Exception as exc:
                raise TransferError(
                    f"{self.direction} copy of {len(plan)} chunks failed: {exc}"
                ) from exc
            return
        await self._run_cuda(plan)  # pragma: no cover - CUDA hosts only

    async def _run_cuda(self, plan: Sequence[ChunkCopy]) -> None:  # pragma: no cover - CUDA only
        assert self._stream is not None
        try:
            compute = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(compute)
            with torch.cuda.stream(self._stream):
                run_plan(plan, self.direction)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
        except Exception as exc:
            raise TransferError(
                f"{self.direction} copy of {len(plan)} chunks failed: {exc}"
            ) from exc
        delay = _POLL_MIN_S
        while not event.query():  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def close(self) -> None:
        """Stop the worker thread (waits for the job in progress)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
