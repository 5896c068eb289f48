"""Copy jobs between GPU blocks and CPU slots.

A *job* is every chunk copy of one direction submitted in one event-loop
iteration. Its plan is a list of :class:`ChunkCopy`; each expands, per distinct
layer and per rectangular piece of the page, into one vectorised call.

* CUDA hosts: torch calls (``index_select`` into the slot for stores,
  ``index_copy_`` into the GPU blocks for loads; a plain strided ``copy_`` when
  the block ids are consecutive) enqueued on a dedicated stream per direction
  that first waits on the compute stream; completion is a CUDA event polled
  from the event loop (never ``synchronize()`` on the loop thread).
* CPU-only hosts: the "GPU" tensors are CPU tensors, and the same plan runs as
  NumPy calls on views of the same memory (``np.take(..., mode="clip")`` to
  gather, fancy-index assignment to scatter) in worker threads; NumPy releases
  the GIL while copying. Measured on a 2-vCPU VM with 16 KiB pages
  (``kvtier bench``): NumPy's per-call cost is about half of torch's, its
  scatter runs at memcpy speed where ``index_copy_`` reaches about 0.4x, and
  its gather matches ``index_select``. Jobs of one direction complete in
  submission order.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvtier._aliasing import ALL_GROUPS, Aliasing, analyse, pages_written_twice
from kvtier._copytable import CopyTable, GroupRuns, execute, group_runs, job_table
from kvtier.errors import ConfigError, TransferError
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
        layer_offset: byte offset of the piece's layer inside the slot (the
            pieces of one layer share it and follow each other in a spec list).
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
    layer_offset: int


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
                    layer.payload_nbytes, offset + piece.page_start, offset,
                )
            )  # fmt: skip
    return tuple(specs)


class HostPiece(NamedTuple):
    """NumPy views of one piece for the CPU path, made once per engine.

    Attributes:
        gpu: the cache piece ``(num_blocks, *shape)`` with the cache's strides.
        slots: the same piece in every slot, ``(num_slots, blocks_per_chunk,
            *shape)``, a strided view of the pool: ``slots[s, j]`` is sub-block
            ``j`` of the layer in slot ``s``.
        take: ``gpu`` and one slot's rows are C-contiguous, so ``np.take``
            gathers straight into the slot.
    """

    gpu: npt.NDArray[Any]
    slots: npt.NDArray[Any]
    take: bool


TABLE_ROW_NBYTES = 1024
"""On the NumPy backend, groups whose contiguous runs are all smaller go through the table.

A table row costs about 10 ns plus its bytes twice (a gather into a
temporary, then a scatter); one NumPy call per chunk and piece costs about
2 µs for 16 blocks plus the bytes once. They meet near 1 KiB per run at the
10 GB/s a 2-vCPU VM copies. Measured with ``benchmarks/copy_ab.py``: with
every group through the table, 16 KiB pages stored at 0.5x of the per-piece
calls.
"""


TABLE_RUNS_PER_PIECE = 64
"""... and whose pieces have at most this many runs per block.

A piece whose block dimension is its innermost (stride 1) is one run per
element: with 128 x 2048 runs a block, the table of 64 chunks had 4 million
rows and its first job took 815 ms, against 50 ms for one NumPy call per
chunk and piece.
"""


class HostGroup(NamedTuple):
    """What the CPU path precomputes of one group, once per engine.

    Attributes:
        pieces: one :class:`HostPiece` per piece spec (copies chunk by chunk).
        runs: the group's contiguous runs (:class:`kvtier._copytable.GroupRuns`),
            from which a job's descriptor table is built.
        blocks_per_chunk: sub-blocks per chunk.
        templates: the slot side of the group's rows per ``(first sub-block,
            blocks)``, filled by :func:`kvtier._copytable.job_table`.
        table: the NumPy backend copies the group through the table (its
            runs are all under :data:`TABLE_ROW_NBYTES`, at most
            :data:`TABLE_RUNS_PER_PIECE` per piece and block).
    """

    pieces: tuple[HostPiece, ...]
    runs: GroupRuns
    blocks_per_chunk: int
    templates: dict[tuple[int, int], Any]
    table: bool = True


def host_pieces(
    specs: Sequence[PieceSpec],
    pool: dict[int, npt.NDArray[Any]],
    slot_nbytes: int,
    num_slots: int,
    blocks_per_chunk: int,
) -> HostGroup | None:
    """Precompute the CPU path's views and runs of a group's pieces in every slot.

    Args:
        specs: the group's pieces (:func:`piece_specs`).
        pool: ``{itemsize: 1-D view of the whole pool}`` (``HostRegion.host_views``).
        slot_nbytes: bytes per slot (a multiple of 4096).
        num_slots: slots in the pool.
        blocks_per_chunk: sub-blocks per chunk.

    Returns:
        The group's :class:`HostGroup`, or ``None`` when the cache is not on the CPU.
    """
    out = []
    for spec in specs:
        if spec.gpu.device.type != "cpu":
            return None
        wide = spec.offset % spec.width == 0 and spec.payload % spec.width == 0
        w = spec.width if wide else 1
        gpu = (spec.gpu if wide else spec.gpu8).detach().numpy()  # same memory
        shape = spec.shape if wide else spec.shape8
        strides = spec.strides if wide else spec.strides8
        # The piece is packed (row-major) in the slot: prod(shape) elements per sub-block.
        last = spec.offset + (num_slots - 1) * slot_nbytes + (blocks_per_chunk - 1) * spec.payload
        last += math.prod(shape) * w
        assert slot_nbytes % w == 0, "slots are 4 KiB multiples"
        assert last <= num_slots * slot_nbytes, "a layer lies inside its slot"
        slots = np.lib.stride_tricks.as_strided(
            pool[w][spec.offset // w :],
            shape=(num_slots, blocks_per_chunk, *shape),
            strides=(slot_nbytes, spec.payload, *(st * w for st in strides)),
            writeable=True,
        )
        take = gpu.flags.c_contiguous and slots[0].flags.c_contiguous
        out.append(HostPiece(gpu, slots, bool(take)))
    flat = pool[1]
    runs = group_runs(specs, flat.ctypes.data, flat.nbytes)
    table = (
        bool(len(runs.nbytes))
        and int(runs.nbytes.max()) < TABLE_ROW_NBYTES
        and runs.per_piece <= TABLE_RUNS_PER_PIECE
    )
    return HostGroup(tuple(out), runs, blocks_per_chunk, {}, table)


class ChunkCopy(NamedTuple):
    """One chunk of one group between its GPU blocks and its CPU slot.

    A NamedTuple, because one is built per chunk on the event loop thread.

    Attributes:
        specs: the group's pieces (:func:`piece_specs`).
        region: ``{itemsize: view of the whole CPU pool as int8/16/32/64}``
            (4 KiB aligned, 1-D).
        slot_offset: byte offset of the slot inside the pool.
        block_ids: GPU block ids of sub-blocks ``start .. start+len(block_ids)``.
        start: first sub-block index inside the chunk.
        nbytes: payload bytes this copy moves.
        host: the group's :class:`HostGroup` (CPU path), or ``None`` to
            copy with torch.
        slot: index of the slot (``slot_offset // slot_nbytes``).
    """

    specs: tuple[PieceSpec, ...]
    region: dict[int, torch.Tensor]
    slot_offset: int
    block_ids: tuple[int, ...]
    start: int
    nbytes: int
    host: HostGroup | None = None
    slot: int = 0


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


def _run_host(copy: ChunkCopy, store: bool) -> None:
    assert copy.host is not None
    ids = copy.block_ids
    first, n = ids[0], len(ids)
    run = ids == tuple(range(first, first + n))
    idx = None if run else np.array(ids, dtype=np.intp)
    partial = copy.start or n != copy.host.blocks_per_chunk
    for piece in copy.host.pieces:
        gpu = piece.gpu
        slot = (
            piece.slots[copy.slot, copy.start : copy.start + n]
            if partial
            else piece.slots[copy.slot]
        )
        if idx is None:
            if store:
                np.copyto(slot, gpu[first : first + n])
            else:
                np.copyto(gpu[first : first + n], slot)
        elif not store:
            gpu[idx] = slot
        elif piece.take:
            # mode="clip" copies straight into ``out`` ("raise" buffers it);
            # block ids were range-checked when the chunk was accepted.
            np.take(gpu, idx, axis=0, out=slot, mode="clip")
        else:  # take() would copy a strided cache whole: gather via a small temporary
            slot[...] = gpu[idx]


def _slot_runs(plan: Sequence[ChunkCopy]) -> list[tuple[int, int]]:
    """Split ``plan`` into ``[start, stop)`` runs that one NumPy call per piece can copy.

    A run of two or more holds full chunks of one group in consecutive slots;
    everything else is a run of one.
    """
    runs, i = [], 0
    while i < len(plan):
        c, j = plan[i], i + 1
        if c.host is not None and c.start == 0 and len(c.block_ids) == c.host.blocks_per_chunk:
            bpc = len(c.block_ids)
            while (
                j < len(plan)
                and plan[j].host is c.host
                and plan[j].slot == c.slot + (j - i)
                and plan[j].start == 0
                and len(plan[j].block_ids) == bpc
            ):
                j += 1
        runs.append((i, j))
        i = j
    return runs


def _load_run(run: Sequence[ChunkCopy]) -> None:
    """Load full chunks of one group in consecutive slots: ONE NumPy call per piece.

    The slots' strided view ``(k, blocks_per_chunk, *shape)`` is scattered
    straight into the cache blocks. Few large calls mean few GIL hand-offs:
    with one call per chunk, a copy thread that re-takes the GIL after each
    call can starve the other one for a whole job (measured: the two halves
    of a job then run one after the other). Stores keep one ``np.take`` per
    chunk: NumPy has no one-pass gather into a strided destination, and two
    passes cost more than the hand-offs.
    """
    host = run[0].host
    assert host is not None
    s0, k = run[0].slot, len(run)
    idx = np.array([c.block_ids for c in run], dtype=np.intp)  # (k, blocks_per_chunk)
    for piece in host.pieces:
        piece.gpu[idx] = piece.slots[s0 : s0 + k]


def run_plan(
    plan: Sequence[ChunkCopy],
    direction: Direction,
    aliasing: dict[frozenset[int], Aliasing] | None = None,
    in_order: bool = False,
    backend: str = "auto",
) -> None:
    """Execute a job's copies synchronously (worker thread or CUDA stream context).

    Chunks with ``host`` pieces (CPU-only hosts) of groups whose runs are
    smaller than :data:`TABLE_ROW_NBYTES` run as the job's descriptor table
    (:func:`plan_table`, executed by :func:`kvtier._copytable.execute`); the
    chunks of other groups run one NumPy call per chunk and piece, which
    moves large runs in one pass (:func:`_run_pieces`).
    The others run as torch calls, per chunk and per piece of each distinct
    layer: a strided copy when the block ids are consecutive, else a gather
    into the slot (store) or a scatter into the GPU blocks (load).

    Args:
        plan: the chunk copies.
        direction: ``"store"`` (GPU blocks -> slots) or ``"load"`` (slots -> GPU blocks).
        aliasing: the caller's cache for
            :func:`kvtier._aliasing.pages_written_twice` (one per engine).
        in_order: CPU path: a load whose chunks write a GPU page twice
            (:func:`kvtier._aliasing.pages_written_twice`), copied chunk by chunk in plan
            order so that the later chunk wins. Not through the table: NumPy
            does not say in which order an assignment through repeated
            indices writes ("there is in general no guarantee for the
            iteration order", its indexing docs).
        backend: ``EngineConfig.copy_backend``: ``"kernel"`` runs a CPU
            path table with the Triton kernel
            (:func:`kvtier._copykernel.execute_kernel`), the others with NumPy.
    """
    store = direction == "store"
    if plan and plan[0].host is not None:
        if in_order:
            for copy in plan:
                _run_host(copy, store)
            return
        if backend == "kernel":
            from kvtier._copykernel import execute_kernel

            execute_kernel(plan_table(plan, store=store))
            return
        small = [c for c in plan if c.host is not None and c.host.table]
        if len(small) != len(plan):
            _run_pieces([c for c in plan if c.host is not None and not c.host.table], store)
        if small:
            execute(plan_table(small, store=store))
        return
    _run_torch(plan, store, aliasing)


def _run_pieces(plan: Sequence[ChunkCopy], store: bool) -> None:
    """Copy chunks of groups with large runs: one NumPy call per chunk and piece.

    Loads of full chunks in consecutive slots are one call per piece for all
    of them (:func:`_load_run`).
    """
    if store:
        for copy in plan:
            _run_host(copy, True)
        return
    for i, j in _slot_runs(plan):
        if j - i > 1:
            _load_run(plan[i:j])
        else:
            _run_host(plan[i], False)


def plan_table(plan: Sequence[ChunkCopy], *, store: bool) -> CopyTable:
    """The descriptor table of a CPU-path job (:func:`kvtier._copytable.job_table`).

    Args:
        plan: chunk copies whose ``host`` is set.
        store: ``True`` for GPU blocks -> slots, ``False`` for the reverse.
    """
    groups: dict[int, tuple[GroupRuns, list[ChunkCopy], dict[tuple[int, int], Any]]] = {}
    for copy in plan:
        host = copy.host
        assert host is not None
        entry = groups.get(id(host))
        if entry is None:
            entry = groups[id(host)] = (host.runs, [], host.templates)
        entry[1].append(copy)
    return job_table(list(groups.values()), store)


_BATCH_NBYTES = 64 << 20
"""At most this many slot bytes per batch: the size of its device buffer."""
_BATCH_IDS = 4096
"""At most this many block ids per batch (their index tensor leaves pageable host memory)."""


def _run_torch(
    plan: Sequence[ChunkCopy],
    store: bool,
    aliasing: dict[frozenset[int], Aliasing] | None = None,
) -> None:
    """The torch path (CUDA hosts): chunks of one group and sub-block range copied together.

    Chunks with the same pieces, ``start`` and length form batches, whatever
    their order in ``plan``, copied through a device buffer of their slot
    bytes (:func:`_torch_batch`): ONE ``index_select`` (store) or
    ``index_copy_`` (load) per piece for the whole batch, and one contiguous
    copy per chunk between the buffer and its slot, issued as one
    ``torch._foreach_copy_`` (a C++ loop of non-blocking copies). On CUDA
    every call is a launch issued from the event loop thread. A batch holds
    at most :data:`_BATCH_NBYTES` of slot bytes (its device buffer) and
    :data:`_BATCH_IDS` block ids.

    The order of the chunks does not matter: a job's chunks have distinct
    slots, and a load whose chunks write one GPU page twice (two loads of one
    job into the same block, of one group or of groups that share a tensor)
    is copied chunk by chunk, in plan order, so that the later load wins.
    """
    if not store and pages_written_twice(plan, aliasing):
        for copy in plan:
            _torch_chunk(copy, store)
        return
    batches: dict[tuple[int, int, int], list[ChunkCopy]] = {}
    for copy in plan:
        batches.setdefault((id(copy.specs), copy.start, len(copy.block_ids)), []).append(copy)
    for copies in batches.values():
        n = len(copies[0].block_ids)
        lo, hi = _stage_span(copies[0])
        row = -(-(hi - lo) // 4096) * 4096  # a chunk's share of the buffer (_staged_copy)
        size = max(1, min(_BATCH_NBYTES // row, _BATCH_IDS // n))
        for i in range(0, len(copies), size):
            part = copies[i : i + size]
            if len(part) == 1:
                _torch_chunk(part[0], store)
            else:
                _torch_batch(part, [b for c in part for b in c.block_ids], store)


def _device_ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``ids`` as a ``long`` tensor on ``device``, built on the host and copied without blocking.

    ``torch.tensor(..., device=cuda)`` would synchronize the current (copy)
    stream, which has just been told to wait for the compute stream, on the
    loop thread.
    """
    return torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)


def _torch_chunk(copy: ChunkCopy, store: bool) -> None:
    """Copy one chunk with torch (a batch of one, see :func:`_torch_batch`)."""
    _staged_copy([copy], list(copy.block_ids), store)


def _stage_span(copy: ChunkCopy) -> tuple[int, int]:
    """Slot bytes ``[lo, hi)`` (from the slot's start) that hold the chunk's sub-blocks.

    ``lo`` is rounded down to 4 KiB, so an offset in the span has the same
    alignment as in the slot. Layer ``L`` holds sub-blocks ``start .. start+n``
    at ``layer_offset + (start .. start+n) * payload``.
    """
    n = len(copy.block_ids)
    lo = min(s.layer_offset + copy.start * s.payload for s in copy.specs)
    hi = max(s.layer_offset + (copy.start + n) * s.payload for s in copy.specs)
    return lo - lo % 4096, hi


def _torch_batch(copies: Sequence[ChunkCopy], ids: list[int], store: bool) -> None:
    """Copy two or more chunks of one group and sub-block range (see :func:`_staged_copy`)."""
    _staged_copy(copies, ids, store)


def _staged_copy(copies: Sequence[ChunkCopy], ids: list[int], store: bool) -> None:
    """Copy chunks of one group and sub-block range through a device buffer of their slot bytes.

    The buffer holds, per chunk, the slot bytes ``[lo, hi)`` of
    :func:`_stage_span`, laid out as in the slot. A store gathers each piece
    of the whole batch into it with ONE ``index_select`` and one strided copy,
    then sends each chunk's bytes to its slot as ONE contiguous copy; a load
    does the reverse (one copy per chunk in, then one ``index_copy_`` per
    piece). On CUDA every call is a launch issued from the event loop thread:
    a batch of ``k`` chunks of a group of ``p`` pieces costs about ``2p + k``
    launches, where copying piece by piece straight into the slots cost
    ``p (k + 1)`` (the measured bottleneck on an H200: 88 us per chunk for
    Gemma's 6 pieces per group). Slot bytes inside the span that no piece
    covers (padding, the other sub-blocks of a partial chunk) are stored as
    zeros.

    Args:
        copies: chunks with the same ``specs``, ``start`` and length.
        ids: their block ids, chunk after chunk (no page written twice for a load).
        store: GPU blocks -> slots, else slots -> GPU blocks.
    """
    c0 = copies[0]
    k, n = len(copies), len(c0.block_ids)
    device = c0.specs[0].gpu.device
    non_blocking = device.type != "cpu"
    lo, hi = _stage_span(c0)
    span = hi - lo
    row = -(-span // 4096) * 4096  # every chunk's bytes start 4 KiB aligned in the buffer
    region = c0.region[1]
    slots = [region[c.slot_offset + lo : c.slot_offset + hi] for c in copies]
    idx = _device_ids(ids, device)
    if store:
        stage = torch.zeros(k * row, dtype=torch.uint8, device=device)
    else:
        stage = torch.empty(k * row, dtype=torch.uint8, device=device)
        rows = [stage[i * row : i * row + span] for i in range(k)]
        torch._foreach_copy_(rows, slots, non_blocking=non_blocking)
    for spec in c0.specs:
        base = spec.offset + c0.start * spec.payload - lo
        if base % spec.width == 0 and spec.payload % spec.width == 0:
            gpu, w, shape, strides = spec.gpu, spec.width, spec.shape, spec.strides
        else:
            gpu, w, shape, strides = spec.gpu8, 1, spec.shape8, spec.strides8
        part = stage.view(gpu.dtype).as_strided(
            (k, n, *shape), (row // w, spec.payload // w, *strides), base // w
        )
        if store:
            part.copy_(gpu.index_select(0, idx).view(k, n, *shape))
        else:
            gpu.index_copy_(0, idx, part.reshape(k * n, *shape))
    if store:
        rows = [stage[i * row : i * row + span] for i in range(k)]
        torch._foreach_copy_(slots, rows, non_blocking=non_blocking)


_SPLIT_NBYTES = 4 << 20
"""A CPU-path job of fewer bytes is one unit of work: one table, one thread.

Building and running one table costs tens of microseconds of NumPy calls
whatever its length, and waking a second copy thread costs as much, so a
small job is not split. Measured on a 2-vCPU VM with 16-byte pages (``kvtier
bench``'s scheduling overhead): one unit per job against two or eight.
"""
_UNITS_PER_THREAD = 4


def _units(plan: Sequence[ChunkCopy], threads: int) -> list[Sequence[ChunkCopy]]:
    """Cut ``plan`` into consecutive slices, about ``_UNITS_PER_THREAD`` per copy thread.

    One slice when the plan moves fewer than :data:`_SPLIT_NBYTES` bytes.
    Each slice is one descriptor table (:func:`plan_table`).
    """
    if threads <= 1 or len(plan) <= 1 or sum(c.nbytes for c in plan) < _SPLIT_NBYTES:
        return [plan]
    size = max(1, -(-len(plan) // (threads * _UNITS_PER_THREAD)))
    return [plan[i : i + size] for i in range(0, len(plan), size)]


JobDone = Callable[[BaseException | None], None]


class _HostJob:
    """A CPU-path job in flight: its units of work, and who reports its end.

    The copy threads pull units from ``next_unit`` (``next()`` on an
    ``itertools.count`` is atomic under the GIL) until none is left, so a
    thread that wakes late, or loses the GIL for a while, only does less of
    the job, and the threads end within one unit of each other.
    """

    __slots__ = (
        "direct",
        "done",
        "error",
        "hold",
        "in_order",
        "loop",
        "next_unit",
        "remaining",
        "units",
    )

    def __init__(
        self,
        units: list[Sequence[ChunkCopy]],
        workers: int,
        loop: asyncio.AbstractEventLoop,
        done: JobDone,
        in_order: bool = False,
        hold: bool = False,
        direct: bool = False,
    ) -> None:
        self.units = units
        self.in_order = in_order  # one unit, chunk by chunk (run_plan)
        self.hold = hold  # failed: later jobs wait for CopyExecutor.release()
        self.direct = direct  # run past the queue (while it is held)
        self.next_unit = itertools.count()
        self.remaining = workers
        self.error: BaseException | None = None
        self.loop = loop
        self.done = done


class CopyExecutor:
    """Runs jobs of ONE direction in submission order.

    On CPU-only hosts a job's chunks are split across ``threads`` worker
    threads (NumPy releases the GIL while copying); the next job of the same
    direction starts, from the worker thread that finished the previous one,
    only when every part of it has finished. Completion reaches the event loop
    as ONE ``call_soon_threadsafe`` per job (no task, no future chain: each
    hop through the loop costs a wake-up).

    On CUDA hosts a job is enqueued at once on the direction's stream (stream
    order keeps jobs in order) and its event is polled with ``call_later``.

    Args:
        device: the device of the registered KV cache tensors.
        direction: ``"store"`` or ``"load"``.
        threads: copy threads for the CPU path (``>= 1``).
        backend: ``EngineConfig.copy_backend`` (:func:`run_plan`).
    """

    def __init__(
        self, device: torch.device, direction: Direction, threads: int = 1, backend: str = "auto"
    ) -> None:
        self.device = device
        self.backend = backend
        self.direction: Direction = direction
        self._cuda = device.type == "cuda"
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._threads = max(1, threads)
        self._lock = threading.Lock()
        self._queue: collections.deque[_HostJob] = collections.deque()
        self._running = False
        # the cache of kvtier._aliasing.pages_written_twice
        self._aliasing: dict[frozenset[int], Aliasing] = {}
        if self._cuda:  # pragma: no cover - CUDA hosts only
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._threads, thread_name_prefix=f"kvtier-{direction}"
            )
            # Start the threads now, not in the first job: a thread's start
            # costs about 0.3 ms on a 2-vCPU VM, which the first job would pay.
            ready = threading.Barrier(self._threads + 1)
            for _ in range(self._threads):
                self._pool.submit(ready.wait)
            ready.wait()

    def submit(
        self,
        plan: Sequence[ChunkCopy],
        done: JobDone,
        after: Sequence[Any] = (),
        *,
        hold_on_error: bool = False,
        direct: bool = False,
    ) -> None:
        """Start copying a job; ``done(error)`` runs on the event loop when every byte landed.

        Must be called from the event loop thread. ``error`` is ``None`` or a
        :class:`TransferError` (from the torch/NumPy error). The copy is never
        stopped once submitted (callers keep its slots reserved until ``done``).

        Args:
            plan: the job's chunk copies.
            done: called once on the event loop with ``None`` or the error.
            after: CUDA only: ``torch.cuda.Event`` s the job's stream waits for
                before its first copy (the callers' streams at their calls);
                when empty, it waits for the loop thread's current stream.
                Ignored on the CPU path.
            hold_on_error: CPU path: if the job fails, the jobs after it wait
                until :meth:`release` (the caller copies parts of it again
                first, with ``direct``, so that call order holds).
            direct: CPU path: start at once, past the jobs waiting (only while
                a failed job holds them).
        """
        loop = asyncio.get_running_loop()
        if self._pool is None:
            self._submit_cuda(plan, loop, done, after)  # pragma: no cover - CUDA hosts only
            return
        in_order = self.direction == "load" and pages_written_twice(plan, self._aliasing)
        if in_order:
            units: list[Sequence[ChunkCopy]] = [plan]  # one thread, in plan order: later wins
        else:
            units = _units(plan, self._threads)
        job = _HostJob(
            units, min(self._threads, len(units)), loop, done, in_order, hold_on_error, direct
        )
        if direct:
            self._start(job)
            return
        with self._lock:
            if self._running:
                self._queue.append(job)
                return
            self._running = True
        self._start(job)

    def know_groups(self, specs: Sequence[tuple[PieceSpec, ...]]) -> None:
        """Analyse how all the groups' pieces share memory, once (before the first job).

        Without it the first load job of each set of groups does it, which
        costs about 1 ms for a layout of 122 layers (``deepseek-v3.2``).

        Args:
            specs: every group's pieces (:func:`piece_specs`).
        """
        self._aliasing[ALL_GROUPS] = analyse({id(p): p for p in specs})

    def _start(self, job: _HostJob) -> None:
        assert self._pool is not None
        for _ in range(job.remaining):
            self._pool.submit(self._work, job)

    def _work(self, job: _HostJob) -> None:
        error: BaseException | None = None
        units = job.units
        while (i := next(job.next_unit)) < len(units):
            try:
                run_plan(
                    units[i],
                    self.direction,
                    aliasing=self._aliasing,
                    in_order=job.in_order,
                    backend=self.backend,
                )
            except Exception as exc:
                if error is None:
                    error = TransferError(
                        f"{self.direction} copy of {len(units[i])} chunks failed: {exc}"
                    )
                    error.__cause__ = exc
        with self._lock:
            if error is not None and job.error is None:
                job.error = error
            job.remaining -= 1
            if job.remaining:
                return
            if job.direct or (job.hold and job.error is not None):
                following = None  # the queue waits for release()
            else:
                following = self._queue.popleft() if self._queue else None
                self._running = following is not None
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            job.loop.call_soon_threadsafe(job.done, job.error)
        if following is not None:
            self._start(following)

    def release(self) -> None:
        """Start the jobs that a failed ``hold_on_error`` job held back (event loop thread)."""
        if self._pool is None:
            return
        with self._lock:
            following = self._queue.popleft() if self._queue else None
            self._running = following is not None
        if following is not None:
            self._start(following)

    async def run(
        self, plan: Sequence[ChunkCopy], after: Sequence[Any] = (), *, direct: bool = False
    ) -> None:
        """Copy a job and return when every byte has landed (:meth:`submit` as a coroutine).

        Cancelling the awaiting task does NOT stop the copy.

        Raises:
            TransferError: a copy failed (from the torch/NumPy error).
        """
        fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        def done(err: BaseException | None) -> None:
            if not fut.done():
                fut.set_result(err)

        self.submit(plan, done, after, direct=direct)
        error = await fut
        if error is not None:
            raise error

    def _submit_cuda(
        self,
        plan: Sequence[ChunkCopy],
        loop: asyncio.AbstractEventLoop,
        done: JobDone,
        after: Sequence[Any],
    ) -> None:  # pragma: no cover - CUDA hosts only
        assert self._stream is not None
        error: TransferError | None = None
        try:
            if after:
                for event in after:
                    self._stream.wait_event(event)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                try:
                    run_plan(plan, self.direction, self._aliasing)
                except Exception as exc:
                    # Copies enqueued before the failure may still be running:
                    # report the error only once the stream has passed them,
                    # so the job's slots are not reused under a DMA.
                    error = TransferError(
                        f"{self.direction} copy of {len(plan)} chunks failed: {exc}"
                    )
                    error.__cause__ = exc
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
        except Exception as exc:  # the stream itself failed (a sticky CUDA error)
            failed = TransferError(f"{self.direction} copy of {len(plan)} chunks failed: {exc}")
            failed.__cause__ = exc
            loop.call_soon(done, failed)
            return

        def poll(delay: float) -> None:
            try:
                finished = event.query()  # type: ignore[no-untyped-call]
            except Exception as exc:  # a device fault while copying: never leave `done` unsaid
                failed = TransferError(f"{self.direction} copy failed on the device: {exc}")
                failed.__cause__ = exc
                done(failed)
                return
            if finished:
                done(error)
            else:
                loop.call_later(delay, poll, min(delay * 2, _POLL_MAX_S))

        loop.call_soon(poll, _POLL_MIN_S)

    def close(self) -> None:
        """Stop the worker threads (waits for the job in progress)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def check_backend(backend: str, device: torch.device) -> None:
    """Raise unless ``backend`` (``EngineConfig.copy_backend``) can copy for a cache on ``device``.

    Raises:
        ConfigError: ``"dma"`` or ``"kernel"`` on a CUDA device (not measured
            there yet: ``benchmarks/gpu_check.sh``), or ``"kernel"`` where
            Triton cannot run CPU tensors (:func:`kvtier._copykernel.available`).
    """
    if device.type != "cpu" and backend in ("dma", "kernel"):
        raise ConfigError(
            f"kvtier: copy_backend={backend!r} is not available on {device.type} devices in this "
            "release; use 'auto' or 'torch'"
        )
    if backend == "kernel":
        from kvtier._copykernel import require

        require()


def record_event(device: torch.device) -> Any:  # pragma: no cover - CUDA hosts only
    """A ``torch.cuda.Event`` recorded now on the calling thread's current stream of ``device``.

    Args:
        device: a CUDA device; the event marks the point the caller's work on
            its current stream has reached (the copy threads wait for it).
    """
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event
