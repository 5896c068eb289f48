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
from typing import Literal, NamedTuple

import torch

from kvtier.errors import TransferError
from kvtier.layout import GroupLayout

Direction = Literal["store", "load"]

_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


class PieceSpec(NamedTuple):
    """Everything a copy needs about one piece of one layer of a group, precomputed.

    Attributes:
        gpu: the piece's wide view ``(num_blocks, *shape)`` (dtype of ``width``).
        width: element bytes of ``gpu``.
        shape: ``gpu.shape[1:]``.
        strides: row-major strides of ``shape`` (elements).
        gpu8: the same piece as ``uint8`` (used when a slot offset is not
            aligned to ``width``).
        shape8: ``gpu8.shape[1:]``.
        strides8: row-major strides of ``shape8``.
        payload: the layer's payload bytes per block.
        offset: byte offset of the piece inside sub-block 0 of the slot
            (layer offset + offset of the piece inside the page payload).
    """

    gpu: torch.Tensor
    width: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    gpu8: torch.Tensor
    shape8: tuple[int, ...]
    strides8: tuple[int, ...]
    payload: int
    offset: int


def piece_specs(group: GroupLayout, layer_offsets: Sequence[int]) -> tuple[PieceSpec, ...]:
    """Precompute the :class:`PieceSpec` list of ``group`` for one slot layout.

    Args:
        group: the group's layout.
        layer_offsets: byte offset of each distinct layer inside a slot
            (:meth:`KVLayout.layer_offsets`).
    """
    specs = []
    for layer, offset in zip(group.layers, layer_offsets, strict=True):
        for piece in layer.pieces:
            shape = tuple(piece.view.shape[1:])
            shape8 = tuple(piece.view8.shape[1:])
            specs.append(
                PieceSpec(
                    piece.view, piece.itemsize, shape, _contiguous_strides(shape),
                    piece.view8, shape8, _contiguous_strides(shape8),
                    layer.payload_nbytes, offset + piece.page_start,
                )
            )  # fmt: skip
    return tuple(specs)


@dataclass(frozen=True, slots=True)
class ChunkCopy:
    """One chunk of one group between its GPU blocks and its CPU slot.

    Attributes:
        specs: the group's pieces (:func:`piece_specs`).
        region: ``{itemsize: view of the whole CPU pool as int8/16/32/64}``
            (4 KiB aligned, 1-D).
        slot_offset: byte offset of the slot inside the pool.
        block_ids: GPU block ids of sub-blocks ``start .. start+len(block_ids)``.
        start: first sub-block index inside the chunk.
        nbytes: payload bytes this copy moves.
    """

    specs: tuple[PieceSpec, ...]
    region: dict[int, torch.Tensor]
    slot_offset: int
    block_ids: tuple[int, ...]
    start: int
    nbytes: int


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def slot_views(copy: ChunkCopy, spec: PieceSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(gpu_view, slot_view)`` of one piece, in the same dtype.

    ``gpu_view`` is ``(num_blocks, *shape)``; ``slot_view`` is ``(n, *shape)``
    made by one ``as_strided`` on the pool: sub-block ``j`` of the layer starts
    at ``slot_offset + layer_offset + (start + j) * payload``. The piece's wide
    element type is used when that start is aligned to it, bytes otherwise.
    """
    base = copy.slot_offset + spec.offset + copy.start * spec.payload
    if base % spec.width:
        gpu, w, shape, strides = spec.gpu8, 1, spec.shape8, spec.strides8
    else:
        gpu, w, shape, strides = spec.gpu, spec.width, spec.shape, spec.strides
    slot = copy.region[w].as_strided(
        (len(copy.block_ids), *shape), (spec.payload // w, *strides), base // w
    )
    return gpu, slot


def run_plan(plan: Sequence[ChunkCopy], direction: Direction) -> None:
    """Execute a job's copies synchronously (worker thread or CUDA stream context).

    Per chunk and per piece of each distinct layer: a strided ``copy_`` when
    the block ids are consecutive, else ``index_select`` into the slot (store)
    or ``index_copy_`` into the GPU blocks (load).

    Args:
        plan: the chunk copies.
        direction: ``"store"`` (GPU blocks -> slots) or ``"load"`` (slots -> GPU blocks).
    """
    store = direction == "store"
    for copy in plan:
        ids = copy.block_ids
        first, n = ids[0], len(ids)
        device = copy.specs[0].gpu.device
        on_cpu = device.type == "cpu"
        run = ids == tuple(range(first, first + n))
        idx = None if run else torch.tensor(ids, dtype=torch.long, device=device)
        for spec in copy.specs:
            gpu, slot = slot_views(copy, spec)
            if idx is None:
                if store:
                    slot.copy_(gpu[first : first + n], non_blocking=not on_cpu)
                else:
                    gpu[first : first + n].copy_(slot, non_blocking=not on_cpu)
            elif store:
                if on_cpu and slot.is_contiguous():
                    torch.index_select(gpu, 0, idx, out=slot)
                else:
                    slot.copy_(gpu.index_select(0, idx), non_blocking=not on_cpu)
            elif on_cpu:
                gpu.index_copy_(0, idx, slot)
            else:
                gpu.index_copy_(0, idx, slot.to(device, non_blocking=True))


def _split(plan: Sequence[ChunkCopy], parts: int) -> list[Sequence[ChunkCopy]]:
    """Cut ``plan`` into at most ``parts`` consecutive pieces of about equal bytes."""
    if parts <= 1 or len(plan) <= 1:
        return [plan]
    target = sum(c.nbytes for c in plan) / parts
    out: list[Sequence[ChunkCopy]] = []
    start, acc = 0, 0
    for i, c in enumerate(plan):
        acc += c.nbytes
        if acc >= target * (len(out) + 1) and len(out) < parts - 1:
            out.append(plan[start : i + 1])
            start = i + 1
    if start < len(plan):
        out.append(plan[start:])
    return out


class CopyExecutor:
    """Runs jobs of ONE direction in submission order.

    On CPU-only hosts a job's chunks are split across ``threads`` worker
    threads (torch releases the GIL while copying); the next job of the same
    direction starts only when every part of the previous one has finished.

    Args:
        device: the device of the registered KV cache tensors.
        direction: ``"store"`` or ``"load"``.
        threads: copy threads for the CPU path (``>= 1``).
    """

    def __init__(self, device: torch.device, direction: Direction, threads: int = 1) -> None:
        self.device = device
        self.direction: Direction = direction
        self._cuda = device.type == "cuda"
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._threads = max(1, threads)
        self._tail: asyncio.Future[None] | None = None
        if self._cuda:  # pragma: no cover - CUDA hosts only
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._threads, thread_name_prefix=f"kvtier-{direction}"
            )

    async def run(self, plan: Sequence[ChunkCopy]) -> None:
        """Copy a job and return when every byte has landed.

        Never blocks the event loop. Cancelling the awaiting task does NOT stop
        the copy; callers shield it so that slots stay reserved until it ends.

        Raises:
            TransferError: a copy failed (from the torch error).

        """
        loop = asyncio.get_running_loop()
        if self._pool is None:
            await self._run_cuda(plan)  # pragma: no cover - CUDA hosts only
            return
        previous, done = self._tail, loop.create_future()
        self._tail = done
        try:
            if previous is not None:
                await asyncio.shield(previous)
            parts = _split(plan, self._threads)
            results = await asyncio.gather(
                *(
                    loop.run_in_executor(self._pool, run_plan, part, self.direction)
                    for part in parts
                ),
                return_exceptions=True,
            )
        finally:
            done.set_result(None)
            if self._tail is done:
                self._tail = None
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise TransferError(
                f"{self.direction} copy of {len(plan)} chunks failed: {errors[0]}"
            ) from errors[0]

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
