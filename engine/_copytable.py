"""Descriptor tables: a copy job as rows of (source address, destination address, nbytes).

A job's plan (its chunk copies) becomes ONE table, built with vectorised
NumPy arithmetic from what was computed once per engine:

* per group, every contiguous *run* of a block's pages (:class:`GroupRuns`):
  its address in GPU block 0, the distance from one block to the next, its
  offset in sub-block 0 of a slot and the distance from one sub-block to the
  next there;
* per job, the block ids, sub-block indices and slot offsets of its chunks.

Row ``(r, b)`` of the table is run ``r`` of the ``b``-th block of the job:
``gpu = gpu0[r] + block_id[b] * stride[r]`` and
``slot = pool + slot_offset[b] + slot0[r] + sub_block[b] * payload[r]``.
Rows that continue each other on both sides (consecutive block ids of a
block-contiguous cache into consecutive sub-blocks) are merged, so a
sequential chunk of a layer is one row. The host-side cost of a job is this
array arithmetic: it does not grow with the layers beyond the length of the
arrays.

On CPU-only hosts (the "GPU" tensors are CPU tensors) :func:`execute` runs a
table: rows under :data:`MEMMOVE_NBYTES` bytes go out as ONE fancy-indexed
NumPy copy per row size, on a flat view of the address range as the widest
element (up to 16 bytes, ``complex128``; copies of it move bits, never
values) that the addresses and size are aligned to; larger rows go out one
``memmove`` each (ctypes releases the GIL). CUDA hosts hand the same table
to a batched copy.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
import numpy.typing as npt
import torch

I64 = npt.NDArray[np.int64]

MEMMOVE_NBYTES = 2048
"""Rows of at least this many bytes are copied one ``memmove`` each on CPU hosts.

Below it one fancy-indexed copy per row size wins: it costs about 8 ns per
16-byte row against about 0.4 µs of Python per ``memmove`` call (both
measured on a 2-vCPU VM), but passes the bytes twice (a gather into a
temporary, then a scatter). Groups whose runs are 1 KiB or more do not use
the table on CPU hosts (``kvtier._transfer.TABLE_ROW_NBYTES``), so only
merged rows of consecutive blocks reach this size.
"""

_WIDTH_DTYPES: dict[int, Any] = {
    16: np.complex128,
    8: np.uint64,
    4: np.uint32,
    2: np.uint16,
    1: np.uint8,
}


class GroupRuns(NamedTuple):
    """The contiguous runs of one block of a group, and where they go in a slot.

    All arrays are ``int64`` of shape ``(R,)``, one entry per run, in bytes.

    Attributes:
        gpu: address of the run in GPU block 0.
        stride: bytes from one GPU block to the next in the run's tensor.
        slot: byte offset of the run in sub-block 0 of a slot.
        payload: bytes from one sub-block to the next in the slot (the
            layer's payload per block).
        nbytes: bytes of the run.
        pool: address of the CPU pool (slot 0).
        lo: lowest address of the group's tensors and the pool, 16-byte aligned down.
        hi: one past the highest such address, 16-byte aligned up.
        width: the largest power of two, at most 16, that divides every
            address and size of every row of the group (whatever the block
            ids and slots: slots are 4 KiB multiples).
        size: the bytes of every run when they are all equal, else 0.
        per_piece: the most runs one piece has per block.
    """

    gpu: I64
    stride: I64
    slot: I64
    payload: I64
    nbytes: I64
    pool: int
    lo: int
    hi: int
    width: int
    size: int
    per_piece: int


class _Spec(Protocol):
    @property
    def gpu8(self) -> torch.Tensor: ...
    @property
    def payload(self) -> int: ...
    @property
    def offset(self) -> int: ...


def _runs_of(view8: torch.Tensor) -> tuple[list[int], list[int], int]:
    """Split one block's piece ``view8[b]`` (``uint8``) into contiguous runs.

    Returns:
        ``(gpu_offsets, packed_offsets, nbytes)``: the byte offset of each
        run inside block 0 of the view, its offset in the packed
        (row-major) piece, and the bytes per run.
    """
    shape, strides = list(view8.shape[1:]), list(view8.stride()[1:])
    run, k = 1, len(shape)
    while k and (shape[k - 1] == 1 or strides[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    gpu, packed = [0], [0]
    inner = run
    for size, stride in zip(reversed(shape[:k]), reversed(strides[:k]), strict=True):
        gpu = [g + i * stride for i in range(size) for g in gpu]
        packed = [p + i * inner for i in range(size) for p in packed]
        inner *= size
    return gpu, packed, run


def group_runs(specs: Sequence[_Spec], pool: int, pool_nbytes: int) -> GroupRuns:
    """Precompute the :class:`GroupRuns` of a group (once per engine).

    Args:
        specs: the group's pieces (``kvtier._transfer.piece_specs``): each
            has ``gpu8``, the piece as ``uint8`` ``(num_blocks, *shape8)``,
            ``payload`` (layer payload bytes per block) and ``offset`` (byte
            offset of the piece in sub-block 0 of a slot).
        pool: address of the CPU pool.
        pool_nbytes: bytes of the pool.
    """
    gpu: list[int] = []
    stride: list[int] = []
    slot: list[int] = []
    payload: list[int] = []
    nbytes: list[int] = []
    lo, hi = pool, pool + pool_nbytes
    per_piece = 0
    for spec in specs:
        v = spec.gpu8
        base = v.data_ptr()
        g_off, p_off, run = _runs_of(v)
        gpu += [base + o for o in g_off]
        slot += [spec.offset + o for o in p_off]
        n = len(g_off)
        per_piece = max(per_piece, n)
        stride += [v.stride(0)] * n
        payload += [spec.payload] * n
        nbytes += [run] * n
        storage = v.untyped_storage()
        lo = min(lo, storage.data_ptr())
        hi = max(hi, storage.data_ptr() + storage.nbytes())

    def arr(x: list[int]) -> I64:
        return np.array(x, dtype=np.int64)

    bits = 16 | pool
    for values in (gpu, stride, slot, payload, nbytes):
        for value in values:
            bits |= value
    size = nbytes[0] if nbytes and len(set(nbytes)) == 1 else 0
    return GroupRuns(
        arr(gpu), arr(stride), arr(slot), arr(payload), arr(nbytes), pool,
        lo // 16 * 16, -(-hi // 16) * 16, bits & -bits, size, per_piece,
    )  # fmt: skip


class TableChunk(Protocol):
    """What :func:`job_table` reads of a chunk copy (``kvtier._transfer.ChunkCopy``)."""

    @property
    def block_ids(self) -> tuple[int, ...]: ...
    @property
    def start(self) -> int: ...
    @property
    def slot_offset(self) -> int: ...


class CopyTable(NamedTuple):
    """Row ``i`` moves ``nbytes[i]`` bytes from ``lo + src[i]`` to ``lo + dst[i]``.

    Addresses are offsets from ``lo``, so that one flat view of the memory
    from ``lo`` (:func:`execute`) reaches every row.

    Attributes:
        src: source offsets from ``lo``, ``int64`` ``(n,)``.
        dst: destination offsets from ``lo``, ``int64`` ``(n,)``.
        nbytes: bytes per row, ``int64`` ``(n,)``.
        lo: the address offsets count from (16-byte aligned).
        hi: one past the highest address a row may touch (16-byte aligned).
        width: a power of two, at most 16, dividing every offset and size.
        size: the bytes of every row when they are all equal, else 0.
    """

    src: I64
    dst: I64
    nbytes: I64
    lo: int
    hi: int
    width: int = 1
    size: int = 0


class _Scratch(threading.local):
    """Per-thread buffers that tables are built and executed in, grown as needed.

    A fresh array per table costs page faults on every job: glibc's arenas
    of threads other than the main one return freed memory to the system at
    once (measured: building and running a 31,000-row table in a copy
    thread took 2.4-4 ms with fresh arrays, 0.4-0.5 ms in reused ones).
    """

    def __init__(self) -> None:
        self.buffers: dict[str, npt.NDArray[Any]] = {}

    def get(self, name: str, n: int, dtype: Any = np.int64) -> npt.NDArray[Any]:
        buf = self.buffers.get(name)
        if buf is None or len(buf) < n or buf.dtype != dtype:
            buf = np.empty(max(n, 1024, 2 * (0 if buf is None else len(buf))), dtype=dtype)
            self.buffers[name] = buf
        return buf[:n]


_scratch = _Scratch()


def _alike(chunks: Sequence[TableChunk]) -> bool:
    n, start = len(chunks[0].block_ids), chunks[0].start
    return all(len(x.block_ids) == n and x.start == start for x in chunks)


def _group_rows(
    runs: GroupRuns,
    chunks: Sequence[TableChunk],
    lo: int,
    templates: dict[tuple[int, int], I64],
    out: tuple[I64, I64, I64],
) -> bool:
    """Write one group's rows, as in :func:`job_table`, into ``out``.

    Args:
        runs: the group's runs.
        chunks: the group's chunk copies in the job.
        lo: the address the offsets count from.
        templates: the group's cache of slot templates.
        out: ``(gpu, host, nbytes)``: the rows' offsets from ``lo`` and sizes,
            each of exactly this group's row count (:func:`_row_count`).

    Returns:
        Whether a chunk has consecutive block ids (rows that may merge).
    """
    gpu_out, host_out, nb_out = out
    c = len(chunks)
    first = chunks[0]
    n, start = len(first.block_ids), first.start
    slots = np.fromiter((x.slot_offset for x in chunks), np.int64, c)
    slots += runs.pool - lo
    nrun = len(runs.gpu)
    if _alike(chunks):
        # Every chunk alike (the common case): rows broadcast as (chunk, run, block).
        blocks = np.fromiter(
            itertools.chain.from_iterable(x.block_ids for x in chunks), np.int64, c * n
        ).reshape(c, 1, n)
        template = templates.get((start, n))
        if template is None:  # (run, block): offset in the slot
            sub = np.arange(start, start + n, dtype=np.int64)
            template = runs.slot[:, None] + runs.payload[:, None] * sub
            templates[(start, n)] = template
        gpu = gpu_out.reshape(c, nrun, n)
        np.multiply(blocks, runs.stride[None, :, None], out=gpu)
        gpu += (runs.gpu - lo)[None, :, None]
        np.add(template[None], slots[:, None, None], out=host_out.reshape(c, nrun, n))
        nb_out.reshape(c, nrun, n)[...] = runs.nbytes[None, :, None]
        return n > 1 and bool((blocks[:, 0, 1:] - blocks[:, 0, :-1] == 1).any())
    lens = np.fromiter((len(x.block_ids) for x in chunks), np.int64, c)
    firsts = np.fromiter((x.start for x in chunks), np.int64, c)
    flat = np.fromiter(
        itertools.chain.from_iterable(x.block_ids for x in chunks), np.int64, int(lens.sum())
    )
    per_chunk = nrun * lens
    owner = np.repeat(np.arange(c), per_chunk)  # chunk of each row
    i = np.arange(int(per_chunk.sum()), dtype=np.int64) - (np.cumsum(per_chunk) - per_chunk)[owner]
    m = lens[owner]
    j = i % m  # block of the chunk
    r = i // m  # run
    b = flat[(np.cumsum(lens) - lens)[owner] + j]
    gpu_out[...] = (runs.gpu[r] - lo) + runs.stride[r] * b
    host_out[...] = slots[owner] + runs.slot[r] + runs.payload[r] * (firsts[owner] + j)
    nb_out[...] = runs.nbytes[r]
    return bool((flat[1:] - flat[:-1] == 1).any())


def _row_count(runs: GroupRuns, chunks: Sequence[TableChunk]) -> int:
    return len(runs.gpu) * sum(len(x.block_ids) for x in chunks)


def job_table(
    groups: Sequence[tuple[GroupRuns, Sequence[TableChunk], dict[tuple[int, int], I64]]],
    store: bool,
    merge: bool = True,
) -> CopyTable:
    """Build the descriptor table of a job.

    Rows are in the order (group, chunk, run, block of the chunk), so that
    the blocks of one run of one chunk follow each other and merge when they
    continue each other on both sides. Where every chunk of a group has the
    same block count and first sub-block (full chunks), the rows are one
    broadcast of ``(chunks, runs, blocks)``; otherwise they are indexed row
    by row (still vectorised). The table's arrays are views of the calling
    thread's scratch buffers: valid until the thread builds its next table.

    Args:
        groups: per group of the job (all of one engine: one pool), its
            :class:`GroupRuns`, its chunk copies (block ids of sub-blocks
            ``start .. start + len(block_ids)`` of the slot at byte
            ``slot_offset`` of the pool) and a cache of its slot templates
            that the caller keeps with the group.
        store: ``True`` for GPU blocks -> slots, ``False`` for slots -> GPU blocks.
        merge: merge rows that continue each other on both sides (:func:`merged`).

    Raises:
        ValueError: the groups do not share one pool.
    """
    present = [g for g in groups if g[1]]
    if not present:
        empty = np.zeros(0, np.int64)
        return CopyTable(empty, empty, empty, 0, 0)
    if len({g[0].pool for g in present}) != 1:
        raise ValueError("kvtier: the groups of one job share one pool")
    lo = min(g[0].lo for g in present)
    hi = max(g[0].hi for g in present)
    counts = [_row_count(runs, chunks) for runs, chunks, _ in present]
    total = sum(counts)
    gpu = _scratch.get("gpu", total)
    host = _scratch.get("host", total)
    nb = _scratch.get("nbytes", total)
    consecutive, at = False, 0
    for (runs, chunks, templates), k in zip(present, counts, strict=True):
        out = (gpu[at : at + k], host[at : at + k], nb[at : at + k])
        consecutive |= _group_rows(runs, chunks, lo, templates, out)
        at += k
    width = min(g[0].width for g in present)
    sizes = {g[0].size for g in present}
    size = sizes.pop() if len(sizes) == 1 else 0
    table = CopyTable(gpu if store else host, host if store else gpu, nb, lo, hi, width, size)
    if merge and consecutive:
        return merged(table)
    return table


def merged(table: CopyTable) -> CopyTable:
    """Merge rows that continue the previous row on both sides into it.

    Row ``i + 1`` joins row ``i`` when ``src[i] + nbytes[i] == src[i + 1]``
    and the same holds for ``dst``. Only when at least a quarter of the rows
    join: a few joins among scattered block ids save little and split the
    rows into more sizes (one copy call each, :func:`execute`).
    """
    src, dst, nb = table.src, table.dst, table.nbytes
    if len(src) < 2:
        return table
    ends = src[:-1] + nb[:-1]
    joins = (ends == src[1:]) & (dst[:-1] + nb[:-1] == dst[1:])
    if 4 * int(joins.sum()) < len(src):  # few joins (scattered block ids): sizes stay uniform
        return table
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return CopyTable(
        src[starts], dst[starts], np.add.reduceat(nb, starts), table.lo, table.hi, table.width
    )


def overlaps(table: CopyTable) -> bool:
    """Whether two rows of the table write a common byte (a load that writes a page twice)."""
    if len(table.dst) < 2:
        return False
    order = np.argsort(table.dst, kind="stable")
    d = table.dst[order]
    return bool((d[:-1] + table.nbytes[order][:-1] > d[1:]).any())


_views: dict[tuple[int, int, int], npt.NDArray[Any]] = {}


def _flat(lo: int, hi: int, width: int) -> npt.NDArray[Any]:
    """A 1-D array of ``width``-byte elements over the addresses ``[lo, hi)``.

    The array does not own that memory: only the rows of a table, which lie
    in the engine's tensors and pool, are ever read or written through it.
    """
    key = (lo, hi, width)
    view = _views.get(key)
    if view is None:
        if len(_views) >= 16:
            _views.clear()
        raw = (ctypes.c_uint8 * (hi - lo)).from_address(lo)
        view = np.frombuffer(cast(Any, raw), dtype=_WIDTH_DTYPES[width])
        _views[key] = view
    return view


_shift: Any = np.right_shift  # into a scratch buffer (numpy's stubs reject out= with an int)


def execute(table: CopyTable) -> None:
    """Copy every row of ``table`` (CPU hosts; worker threads).

    Rows must not overlap on the destination side (:func:`overlaps`): the
    fancy-indexed copies write in no defined order.

    Raises:
        IndexError: a destination lies outside ``[lo, hi)`` (never for a
            table of :func:`job_table`, whose block ids and slots were
            range-checked; sources are clipped to the range, not checked).
    """
    nb = table.nbytes
    if not len(nb):
        return
    if table.size:
        classes: list[tuple[int, Any]] = [(table.size, None)]
    else:
        lo_size, hi_size = int(nb.min()), int(nb.max())
        if lo_size == hi_size:
            classes = [(lo_size, None)]
        else:
            classes = [(int(s), nb == s) for s in np.unique(nb)]
    for size, sel in classes:
        src = table.src if sel is None else table.src[sel]
        dst = table.dst if sel is None else table.dst[sel]
        if size >= MEMMOVE_NBYTES:
            move, lo = ctypes.memmove, table.lo
            for d, s in zip(dst.tolist(), src.tolist(), strict=True):
                move(lo + d, lo + s, size)
            continue
        w = table.width
        flat = _flat(table.lo, table.hi, w)
        shift = w.bit_length() - 1
        si = _scratch.get("si", len(src))
        di = _scratch.get("di", len(dst))
        _shift(src, shift, out=si)
        _shift(dst, shift, out=di)
        k = size >> shift
        if k == 1:
            # flat is 1-D and contiguous: take() gathers into the scratch row buffer
            rows = _scratch.get(f"rows{w}", len(si), flat.dtype)
            np.take(flat, si, out=rows, mode="clip")
            flat[di] = rows
        else:
            rows = np.lib.stride_tricks.as_strided(
                flat, shape=(len(flat) - k + 1, k), strides=(w, w), writeable=True
            )
            rows[di] = rows[si]
