"""``kvtier bench``: copy and NVMe throughput against baselines measured in the same run.

Phases (each reported in GB/s with p50/p99 per-batch latency):

* ``store``: device blocks -> CPU slots (``engine.store``, one call at a time)
  vs a plain torch copy of the same number of bytes between two contiguous
  buffers, and vs plain torch indexing of the same blocks. ``pipelined``: the
  same with ``inflight_batches`` calls in flight.
* ``load``: CPU slots -> device blocks (``engine.load``), the same way.
* ``nvme_write``: CPU slots -> NVMe. Every chunk is first stored into the CPU
  tier (not timed; that is the ``store`` phase), then its row is written and
  made durable (``store(chunks, durable=True)`` of the resident keys with
  ``write_through=False``: the same batches, checksums and writes as
  write-through) vs (a) a raw sequential write of one file with the same
  backend, request size, thread count and direct-I/O mode, ``fdatasync``
  included (the disk's ceiling), (a') the same raw write with every request
  first hashed with kvtier's row checksum (xxh3-64) on as many threads as the
  tier has checksum workers (``raw_checksummed``: the ceiling of any writer
  that checksums its data; hashing reads every byte once more, and on this
  2-vCPU VM that memory traffic slows the virtual disk) and (b) one file per
  chunk written to a temporary name and renamed (what most peers do).
* ``nvme_write_full``: the same leg on a full tier, where every row written
  evicts one (most often of another group): the tier, sized to the data set,
  is filled with every chunk, then the same blocks under new keys, in another
  order, are written and made durable; vs ``raw_rewrite``, the raw baseline's
  file written again in place (same requests, ``fdatasync``): blocks already
  written, as the evicted rows' are; and ``raw_rewrite_xxh3``, the same with
  every request hashed first (as ``raw_checksummed``).
* ``nvme_write_e2e``: store -> write-through -> ``flush`` of every chunk, timed
  end to end vs the same raw write. It includes the device -> CPU copies,
  which on a CPU-only host run on the same cores as the I/O threads (on a
  CUDA host they are DMA).
* ``nvme_read``: cold promotion NVMe -> CPU slots (a new engine: empty CPU
  tier; page cache dropped with ``posix_fadvise`` when I/O is buffered):
  ``engine.prefetch`` of every key, ``inflight_batches`` calls of
  ``batch_chunks`` keys at a time, vs (a) a raw sequential read of one file,
  (a') the same with every request hashed after it landed (``raw_checksummed``)
  and (b) reading each chunk file whole, all into memory as well.
  ``cold_load``: the same keys loaded cold with ``engine.load`` in another new
  engine, promotion plus the CPU -> device copy (on a CPU-only host a memory
  copy on the same cores as the I/O threads; on a CUDA host DMA).
* ``roundtrip``: after the prefetch (the keys then loaded, untimed) and after
  the cold load, every byte of every block is compared with the original
  (bitwise); a mismatch fails the run.

Baselines and kvtier alternate inside every repeat, on the same bytes, so a
noisy neighbour hurts both sides alike; the reported ratio is kvtier/baseline
of the median repeat.

Before the phases the bench collects and freezes its set-up heap
(``gc.collect(); gc.freeze()``, undone at the end), as vLLM's engine does after
start-up (``vllm/utils/gc_utils.py``, ``freeze_gc_heap``): ``import torch``
alone leaves ~165k objects that every full cyclic collection would walk,
pausing the process, kvtier's event loop and I/O threads included, for ~80 ms
(one such pause in a 0.27 s write phase cost it a third of its speed). The
raw baselines allocate almost no Python objects and so rarely trigger one;
file-per-chunk allocates a few per file, as kvtier does per row.
``gc_freeze=False`` (``--no-gc-freeze``) measures an unfrozen process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.markup import escape

import kvtier
from kvtier._shapes import LayerSpec, ModelShape, model_shape
from kvtier._slots import HostRegion
from kvtier._transfer import ChunkCopy, PieceSpec, piece_specs, slot_views
from kvtier.io import AioRowIO
from kvtier.io._format import payload_checksum
from kvtier.io._tier import GROW_NBYTES
from kvtier.layout import KVLayout, round_up


@dataclass
class BenchConfig:
    """Options of ``kvtier bench`` (see the CLI for their meaning)."""

    layout: str = "gemma-3-270m"
    size_bytes: int = 1 << 30
    blocks_per_chunk: int = 16
    tokens_per_block: int = 16
    batch_chunks: int = 32
    io_threads: int = 4
    direct_io: str = "auto"
    io_backend: str = "auto"
    request_nbytes: int = 4 << 20
    repeat: int = 3
    inflight_batches: int = 4
    root: str | None = None
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    nvme: bool = True
    seed: int = 0
    block_order: str = "random"
    gc_freeze: bool = True
    """Freeze the set-up heap before the phases, as a serving process does after start-up."""


_SEGMENT_NBYTES = 256 << 20
"""Segment file size of the bench's tiers (the first one per group is allocated whole)."""


def _mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def preflight(cfg: BenchConfig) -> tuple[ModelShape, int]:
    """Check that a run of ``cfg`` can work before anything is allocated; its shape and blocks.

    The data set is ``--size`` rounded down to whole chunks, at least one
    chunk per group. Checked: the memory it needs (on a CPU device about
    3x the data set plus a slot per chunk: the KV cache, the plain-copy
    buffers and the CPU tier) against ``MemAvailable``; with NVMe phases,
    that the folder takes a temporary directory, its free space (about 4x
    the rows, plus a growth step per group for each of two tiers) and that
    the I/O backend and direct-I/O mode work there
    (:func:`kvtier.io.select_backend`; for ``aio``, two contexts).

    Returns:
        ``(shape, num_blocks)``: the layout's shape and blocks per tensor.

    Raises:
        InvalidArgumentError: unknown layout or a bad layout file.
        ConfigError: not enough memory or disk; the folder is not writable;
            the backend or direct-I/O mode does not work there.
    """
    from kvtier.errors import ConfigError
    from kvtier.io import select_backend

    shape = model_shape(cfg.layout, cfg.tokens_per_block)
    bpc = cfg.blocks_per_chunk
    num_blocks = max(bpc, cfg.size_bytes // shape.block_nbytes())
    num_blocks -= num_blocks % bpc
    groups = shape.groups()
    item = shape.dtype.itemsize
    group_nbytes = [sum(math.prod(shape.layers[i].page_shape) for i in g) * item for g in groups]
    data = num_blocks * shape.block_nbytes()
    chunks = num_blocks // bpc
    slot = round_up(max(group_nbytes) * bpc) + 4096
    rows = chunks * sum(round_up(n * bpc) + 4096 for n in group_nbytes)
    host = chunks * len(groups) * slot + (3 * data if cfg.device == "cpu" else data)
    host += 512 << 20  # the process itself: Python, torch, the engines' threads
    available = _mem_available()
    if available is not None and host > available:
        floor = num_blocks == bpc  # one chunk per group: --size is not what sets it
        advice = (
            f"one chunk per group is the least a run moves: pass a smaller --blocks-per-chunk "
            f"(now {bpc})"
            if floor
            else "pass a smaller --size"
        )
        raise ConfigError(
            f"kvtier bench: {shape.name} at {data / 2**30:.2f} GiB per phase needs about "
            f"{host / 2**30:.1f} GiB of memory, {available / 2**30:.1f} GiB is available: " + advice
        )
    if not cfg.nvme:
        return shape, num_blocks
    folder = cfg.root or os.getcwd()
    try:
        probe = tempfile.mkdtemp(prefix="kvtier-bench-probe-", dir=folder)
    except OSError as exc:
        raise ConfigError(f"kvtier bench: cannot write in {folder}: {exc} (see --dir)") from exc
    try:
        # raw.bin, the file-per-chunk files and two tiers at once (tier{r}, tier{r}-e2e),
        # each tier with up to one growth step per group beyond its rows (NVMeTier).
        capacity = 2 * rows + len(groups) * _SEGMENT_NBYTES
        step = min(_SEGMENT_NBYTES - 4096, GROW_NBYTES, capacity // (4 * len(groups)))
        least = 2 * len(groups) * step  # each group's first segment file, in two tiers
        need = 4 * rows + least
        free = shutil.disk_usage(probe).free
        if need > free:
            advice = (
                "pass a smaller --size or another --dir"
                if least <= free
                else f"no --size fits: any run needs about {least / 2**30:.1f} GiB (a segment "
                "file per group in two tiers); pass another --dir, or --no-nvme"
            )
            raise ConfigError(
                f"kvtier bench: the NVMe phases need about {need / 2**30:.1f} GiB of free "
                f"space in {folder}, which has {free / 2**30:.1f} GiB: {advice}"
            )
        # The run holds two backends at once (the baselines' and the tier's): for
        # "aio", two kernel contexts must fit under fs.aio-max-nr.
        ios = [select_backend(cfg.io_backend, cfg.direct_io, probe, 4 * cfg.io_threads)]
        if isinstance(ios[0], AioRowIO):
            try:
                ios.append(AioRowIO(4 * cfg.io_threads))
            except OSError as exc:
                raise ConfigError(
                    f"kvtier bench --io-backend aio: the run needs two AIO contexts of "
                    f"{4 * cfg.io_threads} requests: {exc} (fewer --io-threads?)"
                ) from exc
        for io in ios:
            if isinstance(io, AioRowIO):
                io.shutdown()
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return shape, num_blocks


_NVME_STEPS_PER_REPEAT = 12
"""``progress`` calls of one repeat of :func:`_nvme_phases`."""


def bench_steps(cfg: BenchConfig) -> int:
    """How many times :func:`run_bench` calls its ``progress`` callback for ``cfg``.

    Set-up, the copy phases and the scheduling overhead, plus
    ``_NVME_STEPS_PER_REPEAT`` per repeat with ``cfg.nvme``: the total of a
    progress bar whose ``n``-th call starts step ``n``.
    """
    return 3 + (_NVME_STEPS_PER_REPEAT * cfg.repeat if cfg.nvme else 0)


@dataclass
class Phase:
    """Figures of one phase: kvtier and its baselines (GB/s = 1e9 bytes/s)."""

    name: str
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    batch_seconds: list[float] = field(default_factory=list)
    baselines: dict[str, list[float]] = field(default_factory=dict)
    variants: dict[str, list[float]] = field(default_factory=dict)
    """kvtier run another way (``pipelined``): seconds per repeat."""
    counts: dict[str, list[int]] = field(default_factory=dict)
    """Events per repeat (``new_keys_evicted``), reported as they are."""

    def gbps(self, seconds: list[float]) -> float:
        """Throughput of the median repeat."""
        return self.nbytes / statistics.median(seconds) / 1e9 if seconds else 0.0

    def summary(self) -> dict[str, Any]:
        """JSON-able figures: GB/s, p50/p99 batch latency (ms), ratios to baselines."""
        out: dict[str, Any] = {"bytes": self.nbytes, "gbps": round(self.gbps(self.seconds), 3)}
        if self.batch_seconds:
            lat = sorted(self.batch_seconds)
            out["p50_ms"] = round(1e3 * lat[len(lat) // 2], 3)
            out["p99_ms"] = round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3)
        bases = {name: self.gbps(secs) for name, secs in self.baselines.items()}

        def ratios(gbps: float) -> dict[str, float | None]:
            return {f"ratio_vs_{b}": round(gbps / v, 3) if v else None for b, v in bases.items()}

        for name, base in bases.items():
            out[f"{name}_gbps"] = round(base, 3)
        out |= ratios(self.gbps(self.seconds))
        for name, secs in self.variants.items():
            out[name] = {"gbps": round(self.gbps(secs), 3)} | ratios(self.gbps(secs))
        out |= {name: list(values) for name, values in self.counts.items()}
        return out


class LagMonitor:
    """Measures event-loop lag: how late a 1 ms sleep wakes up (seconds)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            self.samples.append(max(0.0, time.perf_counter() - t0 - 0.001))

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[None]:
        """Sample lag while the block runs."""
        self._task = asyncio.ensure_future(self._run())
        try:
            yield
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def p99_ms(self) -> float:
        """99th percentile lag in milliseconds."""
        if not self.samples:
            return 0.0
        s = sorted(self.samples)
        return 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))]


def _chunks(
    layout: KVLayout, shape: ModelShape, bpc: int, seed: int, block_order: str = "random"
) -> list[kvtier.Chunk]:
    """Every block of every group in chunks of ``bpc`` blocks.

    ``block_order="random"`` scatters a chunk's blocks over the whole cache (a
    long-running server's fragmented block pool, the worst case);
    ``"sequential"`` gives each chunk consecutive block ids (a fresh pool).
    """
    rng = random.Random(seed)
    out = []
    for g in layout.group_ids:
        ids = list(range(layout.group(g).num_blocks))
        if block_order == "random":
            rng.shuffle(ids)
        for c in range(0, len(ids) - bpc + 1, bpc):
            digest = hashlib.blake2b(f"{shape.name}/{g}/{c}".encode(), digest_size=16).digest()
            out.append(kvtier.Chunk(kvtier.OffloadKey(digest, g), ids[c : c + bpc]))
    rng.shuffle(out)
    return out


def _batches(chunks: list[kvtier.Chunk], n: int) -> list[list[kvtier.Chunk]]:
    return [chunks[i : i + n] for i in range(0, len(chunks), n)]


def _piece_views(layout: KVLayout) -> Iterator[torch.Tensor]:
    """Every piece view of every layer of every group, in layout order."""
    for g in layout.group_ids:
        for lay in layout.group(g).layers:
            for p in lay.pieces:
                yield p.view


def _scribble(layout: KVLayout) -> None:
    for view in _piece_views(layout):
        view.fill_(0x5A)


def _check(ok: bool, what: str) -> None:
    """Raise ``AssertionError(what)`` unless ``ok`` (an ``assert`` would vanish under -O)."""
    if not ok:
        raise AssertionError(what)


def _first(failed: dict[Any, BaseException]) -> str:
    """One failure of many, and how many there were (a one-line message)."""
    if not failed:
        return ""
    key, err = next(iter(failed.items()))
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return f"{key}: {err}{more}"


def _digests(layout: KVLayout) -> list[int]:
    """The row checksum (xxh3-64) of every tensor's bytes: what the copy phases must keep."""
    out = []
    for piece in _piece_views(layout):
        view = piece.detach().contiguous().view(torch.uint8).cpu()
        out.append(payload_checksum(view.numpy().data.cast("B")))
    return out


def _whole(done: int, want: int, what: str) -> None:
    """Check that a baseline request moved all its bytes (an ``assert`` would vanish under -O)."""
    if done != want:
        raise RuntimeError(f"bench {what}: {done} of {want} bytes")


class _Baselines:
    """Raw sequential file I/O and file-per-chunk I/O with the engine's backend options."""

    def __init__(
        self, cfg: BenchConfig, root: str, total: int, row_nbytes: int, nrows: int
    ) -> None:
        from kvtier.io import select_backend

        self.io = select_backend(
            cfg.io_backend, cfg.direct_io, root, 4 * cfg.io_threads, cfg.io_threads
        )
        self.root = root
        self.total = round_up(total)
        self.row_nbytes = row_nbytes
        self.nrows = nrows
        self.req = cfg.request_nbytes
        self.pool = concurrent.futures.ThreadPoolExecutor(
            cfg.io_threads, thread_name_prefix="bench-io"
        )
        # As large as the data set: every request reads or writes memory of its
        # own, as kvtier's slots do (a few reused buffers would stay cache-hot).
        self.buf = HostRegion(round_up(max(self.total, row_nbytes * nrows)), pin=False)
        self.buf.prefault()
        self.threads = cfg.io_threads
        # As many hashing threads as the tier has checksum workers.
        self.hash_pool = concurrent.futures.ThreadPoolExecutor(
            max(1, min(cfg.io_threads, os.cpu_count() or 1)), thread_name_prefix="bench-hash"
        )

    def _mv(self, offset: int, n: int) -> memoryview:
        return self.buf.buffer(0, self.buf.nbytes)[offset : offset + n]

    def _parallel(self, fn: Callable[[int, int], None], count: int) -> float:
        t0 = time.perf_counter()
        futs = [self.pool.submit(fn, i % self.threads, i) for i in range(count)]
        for f in futs:
            f.result()
        return time.perf_counter() - t0

    def _sequential(self, h: Any, write: bool, checksum: bool = False) -> float:
        """One pass of ``req``-byte requests over the file (I/O threads, or the AIO context).

        ``checksum``: every request's bytes are also hashed with kvtier's row
        checksum (xxh3-64) on ``hash_pool``, before the request is issued
        (write: hashing runs ahead, each request goes out once its hash is
        done) or after it completed (read), the least a writer or reader that
        checks its data must add to the disk's ceiling.
        """
        offsets = range(0, self.total, self.req)
        sizes = [min(self.req, self.total - off) for off in offsets]

        def hash_of(i: int) -> concurrent.futures.Future[int]:
            return self.hash_pool.submit(payload_checksum, self._mv(offsets[i], sizes[i]))

        t0 = time.perf_counter()
        hashes = [hash_of(i) for i in range(len(offsets))] if checksum and write else []
        if isinstance(self.io, AioRowIO):  # the same requests, queued in the kernel
            submit = self.io.submit_pwritev if write else self.io.submit_preadv
            futs = []
            for i, (off, n) in enumerate(zip(offsets, sizes, strict=True)):
                if hashes:
                    hashes[i].result()
                futs.append(submit(h, [self._mv(off, n)], off))
            for i, fut in enumerate(futs):
                _whole(fut.result(), sizes[i], "raw request")
                if checksum and not write:
                    hashes.append(hash_of(i))
        else:
            op = self.io.pwritev if write else self.io.preadv

            def one(worker: int, i: int) -> None:
                if checksum and write:
                    hashes[i].result()
                _whole(op(h, [self._mv(offsets[i], sizes[i])], offsets[i]), sizes[i], "raw request")
                if checksum and not write:  # verified on the hashing threads, as kvtier does
                    hashes.append(hash_of(i))

            self._parallel(one, len(offsets))
        for fut in hashes:
            fut.result()
        return time.perf_counter() - t0

    def raw_write(self, checksum: bool = False) -> float:
        """Seconds to write ``raw.bin`` afresh (``checksum``: see :meth:`_sequential`)."""
        path = os.path.join(self.root, "raw.bin")
        # A fresh file every repeat, like kvtier's fresh tier: overwriting blocks
        # that an earlier repeat already wrote would skip the allocation work.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        t0 = time.perf_counter()  # file creation counts, as it does for kvtier's segments
        h = self.io.open(path, True)
        self.io.allocate(h, self.total)
        self._sequential(h, write=True, checksum=checksum)
        self.io.fdatasync(h)
        dt = time.perf_counter() - t0
        self.io.close(h)
        return dt

    def raw_rewrite(self, checksum: bool = False) -> float:
        """Seconds to write ``raw.bin`` again in place (its blocks are written already).

        ``checksum``: see :meth:`_sequential`.
        """
        h = self.io.open(os.path.join(self.root, "raw.bin"), True)
        t0 = time.perf_counter()
        self._sequential(h, write=True, checksum=checksum)
        self.io.fdatasync(h)
        dt = time.perf_counter() - t0
        self.io.close(h)
        return dt

    def raw_read(self, checksum: bool = False) -> float:
        """Seconds to read ``raw.bin`` from the disk (``checksum``: see :meth:`_sequential`)."""
        path = os.path.join(self.root, "raw.bin")
        _drop_cache(path, self.io.direct)
        h = self.io.open(path, False)
        dt = self._sequential(h, write=False, checksum=checksum)
        self.io.close(h)
        return dt

    def files_write(self) -> float:
        d = os.path.join(self.root, "files")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)

        def one(worker: int, i: int) -> None:
            tmp = os.path.join(d, f"{i}.tmp")
            h = self.io.open(tmp, True)
            n = self.io.pwritev(h, [self._mv(i * self.row_nbytes, self.row_nbytes)], 0)
            _whole(n, self.row_nbytes, "chunk file write")
            self.io.fdatasync(h)
            self.io.close(h)
            os.rename(tmp, os.path.join(d, f"{i}.kv"))

        return self._parallel(one, self.nrows)

    def files_read(self) -> float:
        d = os.path.join(self.root, "files")
        for i in range(self.nrows):
            _drop_cache(os.path.join(d, f"{i}.kv"), self.io.direct)

        def one(worker: int, i: int) -> None:
            h = self.io.open(os.path.join(d, f"{i}.kv"), False)
            n = self.io.preadv(h, [self._mv(i * self.row_nbytes, self.row_nbytes)], 0)
            _whole(n, self.row_nbytes, "chunk file read")
            self.io.close(h)

        return self._parallel(one, self.nrows)

    def close(self) -> None:
        self.pool.shutdown()
        self.hash_pool.shutdown()
        if isinstance(self.io, AioRowIO):
            self.io.shutdown()
        self.buf.close()


def _drop_tree_cache(root: str) -> None:
    """Evict every file under ``root`` from the page cache (buffered I/O only)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            _drop_cache(os.path.join(dirpath, f), False)


def _drop_cache(path: str, direct: bool) -> None:
    """Evict a file from the page cache (no-op for O_DIRECT, which bypasses it)."""
    if direct or not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def _copy_phases(
    cfg: BenchConfig, layout: KVLayout, chunks: list[kvtier.Chunk], report: dict[str, Phase]
) -> None:
    bpc = cfg.blocks_per_chunk
    engine_cfg = kvtier.EngineConfig(
        len(chunks) * layout.slot_nbytes(bpc),
        bpc,
        max_batch_chunks=cfg.batch_chunks,
    )
    batches = _batches(chunks, cfg.batch_chunks)
    payload = sum(
        len(c.block_ids) * layout.group(c.key.group_id).block_payload_nbytes for c in chunks
    )
    # The plain-copy baseline moves the same bytes between two buffers as large
    # as the whole data set, a fresh window per batch, so neither side is warm
    # in the CPU caches (a repeated small copy would run from L2/L3).
    src = torch.empty(payload, dtype=torch.uint8, device=cfg.device).fill_(1)
    dst = HostRegion(round_up(payload), pin=True)
    dst.prefault()
    per_batch = min(cfg.batch_chunks, len(chunks))  # never more slots than chunks
    gather_region = HostRegion(per_batch * layout.slot_nbytes(bpc), pin=True)
    specs = {
        g: piece_specs(layout.group(g), layout.layer_offsets(g, bpc)) for g in layout.group_ids
    }
    gather_region.prefault()
    store, load = report["store"], report["load"]
    store.nbytes = load.nbytes = payload
    for phase in (store, load):
        phase.baselines["plain_copy"] = []
        phase.baselines["torch_gather"] = []
        phase.variants["pipelined"] = []
    sizes = [
        sum(len(c.block_ids) * layout.group(c.key.group_id).block_payload_nbytes for c in batch)
        for batch in batches
    ]

    def plain(direction: str) -> float:
        t0 = time.perf_counter()
        window = 0
        for n in sizes:
            if direction == "store":
                dst.tensor[window : window + n].copy_(src[window : window + n])
            else:
                src[window : window + n].copy_(dst.tensor[window : window + n])
            window += n
            if src.is_cuda:
                torch.cuda.synchronize()
        return time.perf_counter() - t0

    def gather(direction: str) -> float:
        t0 = time.perf_counter()
        for batch in batches:
            _torch_gather(layout, specs, batch, gather_region, bpc, direction)
        return time.perf_counter() - t0

    # Whole passes alternate inside every repeat: kvtier one call at a time,
    # the plain copy, the torch gather, then kvtier with ``inflight_batches``
    # calls in flight (how a serving loop overlaps the steps of its requests).
    # Alternating per batch instead slowed every kvtier call that followed a
    # torch-gather batch (measured on the 2-vCPU VM: stores 15-35% slower, the
    # same with OMP_NUM_THREADS=1), so passes alternate as in the NVMe phases.
    # kvtier's loads put back every byte its stores took (checked after each
    # pass, not timed); the torch-gather load scatters ONE batch of slots into
    # every batch's blocks, so an untimed kvtier load restores the cache after it.
    original = _digests(layout)

    def check(what: str) -> None:
        _check(_digests(layout) == original, f"bench {what}: the KV cache changed bytes")

    for _ in range(cfg.repeat):
        async with kvtier.TransferEngine(layout, engine_cfg) as engine:
            for direction, phase in (("store", store), ("load", load)):
                if direction == "load":
                    _scribble(layout)  # not timed: the load must write every byte back
                phase.seconds.append(await _copy_pass(engine, batches, direction, 1, phase))
                if direction == "load":
                    check("store -> load")
                phase.baselines["plain_copy"].append(plain(direction))
                phase.baselines["torch_gather"].append(gather(direction))
            await _copy_pass(engine, batches, "load", cfg.inflight_batches, None)
            check("restore after the torch-gather load")
        async with kvtier.TransferEngine(layout, engine_cfg) as engine:
            for direction, phase in (("store", store), ("load", load)):
                if direction == "load":
                    _scribble(layout)
                phase.variants["pipelined"].append(
                    await _copy_pass(engine, batches, direction, cfg.inflight_batches, None)
                )
            check("pipelined store -> load")
    dst.close()
    gather_region.close()


async def _copy_pass(
    engine: kvtier.TransferEngine,
    batches: list[list[kvtier.Chunk]],
    direction: str,
    inflight: int,
    phase: Phase | None,
) -> float:
    """Store, load or prefetch every batch, ``inflight`` calls at a time; returns the seconds.

    Per-call latency goes to ``phase.batch_seconds`` when ``phase`` is given.
    """
    sem = asyncio.Semaphore(inflight)

    async def one(batch: list[kvtier.Chunk]) -> None:
        async with sem:
            t0 = time.perf_counter()
            if direction == "store":
                res = await engine.store(batch)
                _check(len(res.stored) == len(batch), "bench store rejected keys")
            elif direction == "prefetch":
                pre = await engine.prefetch([c.key for c in batch])
                _check(not pre.failed, f"bench prefetch failed: {_first(pre.failed)}")
                _check(len(pre.promoted) == len(batch), "bench prefetch promoted too few keys")
            else:
                out = await engine.load(batch)
                _check(not out.failed, f"bench load failed: {_first(out.failed)}")
            if phase is not None:
                phase.batch_seconds.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in batches))
    return time.perf_counter() - t0


def _torch_gather(
    layout: KVLayout,
    specs: dict[int, tuple[PieceSpec, ...]],
    batch: list[kvtier.Chunk],
    region: HostRegion,
    bpc: int,
    direction: str,
) -> None:
    """Baseline: the same blocks moved with plain torch indexing, one call per chunk and layer.

    What a serving engine writes without kvtier: ``slot.copy_(kv[block_ids])``
    to store and ``kv[block_ids] = slot`` to load, into the same slot layout.
    """
    slot_nbytes = layout.slot_nbytes(bpc)
    for i, c in enumerate(batch):
        g = c.key.group_id
        copy = ChunkCopy(
            specs[g],
            region.views,
            i * slot_nbytes,
            c.block_ids,
            c.offset,
            0,
        )
        idx = torch.tensor(c.block_ids, device=layout.device)
        for spec in copy.specs:
            gpu, slot = slot_views(copy, spec)
            if direction == "store":
                slot.copy_(gpu[idx])
            else:  # index_put_ takes its values on the destination's device
                gpu[idx] = slot.to(gpu.device)
    if layout.device.type == "cuda":
        torch.cuda.synchronize()


async def _in_thread(fn: Callable[..., float], *args: Any) -> float:
    """``fn(*args)`` on a worker thread; if the caller is cancelled, only once it ended.

    A baseline's thread keeps writing under the bench's temporary folder after
    its awaiting task is cancelled (SIGTERM, Ctrl-C): the folder may be
    removed only once the thread is done with it.
    """
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(fut)
        raise


async def _nvme_phases(
    cfg: BenchConfig,
    layout: KVLayout,
    chunks: list[kvtier.Chunk],
    report: dict[str, Phase],
    lag: LagMonitor,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    bpc = cfg.blocks_per_chunk
    base_root = cfg.root or os.getcwd()
    tmp = tempfile.mkdtemp(prefix="kvtier-bench-", dir=base_root)
    info: dict[str, Any] = {"tmpdir": tmp}
    loop = asyncio.get_running_loop()
    baselines: _Baselines | None = None
    try:
        rows = {g: round_up(layout.group_nbytes(g, bpc)) + 4096 for g in layout.group_ids}
        row_bytes = sum(rows[c.key.group_id] for c in chunks)
        write, e2e, read = report["nvme_write"], report["nvme_write_e2e"], report["nvme_read"]
        full = report["nvme_write_full"]
        write.nbytes = e2e.nbytes = read.nbytes = full.nbytes = row_bytes
        full.baselines = {"raw_rewrite": [], "raw_rewrite_xxh3": []}
        e2e.baselines = {"raw_sequential": [], "raw_checksummed": []}
        baselines = _Baselines(cfg, tmp, row_bytes, max(rows.values()), len(chunks))
        info["direct_io"] = baselines.io.direct
        info["backend"] = type(baselines.io).__name__
        for phase in (write, read):
            phase.baselines = {"raw_sequential": [], "raw_checksummed": [], "file_per_chunk": []}
        read.variants["cold_load"] = []
        original = _digests(layout)  # the bytes the copy phases checked and left
        for r in range(cfg.repeat):
            root = os.path.join(tmp, f"tier{r}")
            nvme = kvtier.NVMeConfig(
                root=root,
                capacity_bytes=2 * row_bytes + len(rows) * _SEGMENT_NBYTES,
                namespace=f"bench{r}",
                io_backend=cfg.io_backend,
                direct_io=cfg.direct_io,
                io_threads=cfg.io_threads,
                request_nbytes=cfg.request_nbytes,
                segment_nbytes=_SEGMENT_NBYTES,
            )
            ecfg = kvtier.EngineConfig(
                len(chunks) * layout.slot_nbytes(bpc),
                bpc,
                nvme=nvme,
                max_batch_chunks=cfg.batch_chunks,
            )
            progress(f"repeat {r + 1}/{cfg.repeat}: raw sequential write")
            write.baselines["raw_sequential"].append(await _in_thread(baselines.raw_write))
            progress(f"repeat {r + 1}/{cfg.repeat}: raw sequential write, checksummed")
            write.baselines["raw_checksummed"].append(await _in_thread(baselines.raw_write, True))
            progress(f"repeat {r + 1}/{cfg.repeat}: kvtier CPU -> NVMe")
            staged = dataclasses.replace(ecfg, write_through=False)
            async with kvtier.TransferEngine(layout, staged) as engine:
                await _write_leg(engine, chunks, cfg, (write, lag))
            progress(f"repeat {r + 1}/{cfg.repeat}: raw rewrite")
            full.baselines["raw_rewrite"].append(await _in_thread(baselines.raw_rewrite))
            progress(f"repeat {r + 1}/{cfg.repeat}: raw rewrite, hashed")
            full.baselines["raw_rewrite_xxh3"].append(await _in_thread(baselines.raw_rewrite, True))
            progress(f"repeat {r + 1}/{cfg.repeat}: kvtier CPU -> NVMe, full tier")
            await _full_tier_write(layout, ecfg, chunks, full, lag, cfg, original, root + "-full")
            progress(f"repeat {r + 1}/{cfg.repeat}: kvtier store + write-through")
            e2e_root = root + "-e2e"
            e2e_cfg = dataclasses.replace(ecfg, nvme=dataclasses.replace(nvme, root=e2e_root))
            async with kvtier.TransferEngine(layout, e2e_cfg) as engine, lag.watch():
                t0 = time.perf_counter()
                for batch in _batches(chunks, cfg.batch_chunks):
                    res = await engine.store(batch)
                    _check(len(res.stored) == len(batch), "bench store rejected keys")
                await engine.flush()
                e2e.seconds.append(time.perf_counter() - t0)
                assert engine._writer is not None
                e2e.batch_seconds.extend(engine._writer.batch_seconds)
                failures = engine.stats().nvme or {}
                _check(failures.get("write_failures", 0) == 0, f"NVMe write failures: {failures}")
            # Not timed: the write-through rows load back, from NVMe, as the bytes stored.
            _scribble(layout)
            async with kvtier.TransferEngine(layout, e2e_cfg) as engine:
                _check(
                    engine.prefix_hits([c.key for c in chunks]) == len(chunks),
                    "bench write-through rows missing on NVMe",
                )
                await _copy_pass(
                    engine, _batches(chunks, cfg.batch_chunks), "load", cfg.inflight_batches, None
                )
            _check(
                _digests(layout) == original,
                "round trip store + write-through -> NVMe -> load changed bytes",
            )
            shutil.rmtree(e2e_root, ignore_errors=True)
            for name in e2e.baselines:
                e2e.baselines[name].append(write.baselines[name][-1])
            progress(f"repeat {r + 1}/{cfg.repeat}: file-per-chunk write")
            write.baselines["file_per_chunk"].append(await _in_thread(baselines.files_write))

            progress(f"repeat {r + 1}/{cfg.repeat}: raw sequential read")
            read.baselines["raw_sequential"].append(await _in_thread(baselines.raw_read))
            progress(f"repeat {r + 1}/{cfg.repeat}: raw sequential read, checksummed")
            read.baselines["raw_checksummed"].append(await _in_thread(baselines.raw_read, True))
            progress(f"repeat {r + 1}/{cfg.repeat}: kvtier cold promotion")
            batches = _batches(chunks, cfg.batch_chunks)
            for direction in ("prefetch", "load"):
                if not baselines.io.direct:
                    _drop_tree_cache(root)
                _scribble(layout)
                async with kvtier.TransferEngine(layout, ecfg) as engine, lag.watch():
                    _check(
                        engine.prefix_hits([c.key for c in chunks]) == len(chunks),
                        "bench keys missing on NVMe",
                    )
                    timed = read if direction == "prefetch" else None
                    seconds = await _copy_pass(
                        engine, batches, direction, cfg.inflight_batches, timed
                    )
                    if direction == "prefetch":
                        read.seconds.append(seconds)
                        # untimed: the GPU blocks get the promoted bytes for the check
                        await _copy_pass(engine, batches, "load", cfg.inflight_batches, None)
                    else:
                        read.variants["cold_load"].append(seconds)
                _check(
                    _digests(layout) == original,
                    f"round trip store -> NVMe -> {direction} changed bytes",
                )
            info["verified_repeats"] = r + 1
            progress(f"repeat {r + 1}/{cfg.repeat}: file-per-chunk read")
            read.baselines["file_per_chunk"].append(await _in_thread(baselines.files_read))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        if baselines is not None:
            baselines.close()  # its threads are done with the folder (_in_thread)
        shutil.rmtree(tmp, ignore_errors=True)
    info["tmpdir_removed"] = not await loop.run_in_executor(None, os.path.exists, tmp)
    return info


async def _write_leg(
    engine: kvtier.TransferEngine,
    chunks: list[kvtier.Chunk],
    cfg: BenchConfig,
    timed: tuple[Phase, LagMonitor] | None = None,
) -> None:
    """The CPU -> NVMe leg on an engine with ``write_through=False``.

    Every chunk is stored into the CPU tier (not timed), then
    ``store(chunks, durable=True)`` writes the rows of these resident keys and
    syncs them: the same batches, checksums and writes as write-through.
    ``timed``: the phase that gets the seconds and the per-batch latencies of
    the write, and the monitor of the event loop's lag during it.
    """
    for batch in _batches(chunks, cfg.batch_chunks):  # device -> CPU, not timed
        res = await engine.store(batch)
        _check(len(res.stored) == len(batch), "bench store rejected keys")
    writer = engine._writer
    assert writer is not None
    first = len(writer.batch_seconds)
    async with timed[1].watch() if timed else contextlib.nullcontext():
        t0 = time.perf_counter()
        # Every key is resident and not yet on NVMe: this writes their rows.
        res = await engine.store(chunks, durable=True)
        seconds = time.perf_counter() - t0
    _check(len(res.skipped) == len(chunks), "bench keys left the CPU tier")
    if timed:
        timed[0].seconds.append(seconds)
        timed[0].batch_seconds.extend(list(writer.batch_seconds)[first:])


async def _full_tier_write(
    layout: KVLayout,
    ecfg: kvtier.EngineConfig,
    chunks: list[kvtier.Chunk],
    phase: Phase,
    lag: LagMonitor,
    cfg: BenchConfig,
    original: list[int],
    root: str,
) -> None:
    """The CPU -> NVMe leg on a full tier: every row written evicts one (timed), then checked.

    A tier with room for exactly the data set is filled with every chunk (not
    timed), then the same blocks are stored under new keys, in another order,
    and written (``store(durable=True)``, timed as in ``nvme_write``): each row
    evicts one, mostly the oldest key of its own group (``eviction_window``;
    under strict LRU most often one of another group), as in a serving engine
    that has run long enough to fill its disk budget. Not timed: a new engine
    must find exactly the new keys the tier held at close, and no invalid row;
    it loads them from NVMe (the few that later new keys evicted come from
    ``ecfg``'s tier, written by the fresh-tier leg) and every tensor is
    compared with the bytes the bench generated.
    """
    assert ecfg.nvme is not None
    row_bytes = phase.nbytes
    nvme = dataclasses.replace(ecfg.nvme, root=root, capacity_bytes=row_bytes)
    staged = dataclasses.replace(ecfg, nvme=nvme, write_through=False)
    rng = random.Random(cfg.seed + 1)
    fresh = [
        kvtier.Chunk(kvtier.OffloadKey(b"full/" + c.key.block_hash, c.key.group_id), c.block_ids)
        for c in rng.sample(chunks, len(chunks))
    ]
    async with kvtier.TransferEngine(layout, staged) as engine:
        await _write_leg(engine, chunks, cfg)  # fill the tier, not timed
        await _write_leg(engine, fresh, cfg, (phase, lag))
        st = engine.stats().nvme or {}
        _check(st.get("write_failures", 0) == 0, f"NVMe write failures: {st}")
        evictions = st.get("evictions", 0)
        _check(
            isinstance(evictions, int) and evictions >= len(fresh),
            "the full tier evicted too few rows",
        )
        # of the leg's evictions (the fill evicts nothing), those that took the
        # writer's own group's key out of strict LRU order (eviction_window)
        window = st.get("window_evictions", 0)
        phase.counts.setdefault("window_evictions", []).append(
            window if isinstance(window, int) else 0
        )
        # A few of the first new keys may have been evicted by later ones (the
        # tier holds exactly the data set, and with NVMeConfig.eviction_window a
        # write evicts its own group's oldest key when it is among the oldest,
        # which late in the leg can be one of the first new keys while a key of
        # the fill is left). The live tier says which.
        assert engine._nvme is not None
        kept = [c for c in fresh if engine._nvme.contains(c.key)]
    # Not timed: exactly those new keys load back from NVMe as the bytes stored
    # (a row written wrong is invalid at open, or fails its checksum); the
    # blocks of the evicted ones come back from the fresh-tier leg's tier
    # (``ecfg``: every chunk under its first key), so every tensor can be compared.
    _scribble(layout)
    async with kvtier.TransferEngine(layout, staged) as engine:
        on_nvme = engine.lookup([c.key for c in fresh])
        found = [
            c for c, where in zip(fresh, on_nvme, strict=True) if where is not kvtier.Residency.MISS
        ]
        invalid = (engine.stats().nvme or {}).get("invalid_rows_at_open", 0)
        _check(
            found == kept and invalid == 0,
            f"the full tier's rows at reopen: {len(found)} of the {len(kept)} new keys it held, "
            f"{invalid} invalid rows",
        )
        await _copy_pass(engine, _batches(kept, cfg.batch_chunks), "load", 1, None)
    evicted = {c.key.block_hash[len(b"full/") :] for c in fresh} - {
        c.key.block_hash[len(b"full/") :] for c in kept
    }
    _check(len(evicted) <= len(fresh) // 10, f"the full tier evicted {len(evicted)} new keys")
    phase.counts.setdefault("new_keys_evicted", []).append(len(evicted))
    if evicted:
        async with kvtier.TransferEngine(layout, ecfg) as engine:
            back = [c for c in chunks if c.key.block_hash in evicted]
            await _copy_pass(engine, _batches(back, cfg.batch_chunks), "load", 1, None)
    _check(_digests(layout) == original, "store -> NVMe (full tier) -> load changed bytes")
    await asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, root, True)


async def _scheduling_overhead(
    cfg: BenchConfig, shape: ModelShape, nchunks: int
) -> dict[str, float]:
    """Engine time per chunk when the copy itself costs ~nothing (16-byte pages).

    Same groups, layers, chunk count and batching as the data set, so this is
    what kvtier adds per chunk (validation, slot bookkeeping, job coalescing,
    thread hand-off, one vectorised call per layer) on top of the copy.
    """
    tiny = ModelShape(
        shape.name,
        tuple(LayerSpec(lay.kind, (16,)) for lay in shape.layers),
        torch.uint8,
        shape.tokens_per_block,
    )
    bpc = cfg.blocks_per_chunk
    groups = len(tiny.groups())
    layout = tiny.build(bpc * (nchunks // groups + 1), cfg.device)
    chunks = _chunks(layout, tiny, bpc, cfg.seed, cfg.block_order)
    batches = _batches(chunks, cfg.batch_chunks)
    ecfg = kvtier.EngineConfig(
        len(chunks) * layout.slot_nbytes(bpc), bpc, max_batch_chunks=cfg.batch_chunks
    )
    runs: dict[str, list[float]] = {"store": [], "load": []}
    for _ in range(max(3, cfg.repeat)):  # the median: a lone pass may catch a pause
        async with kvtier.TransferEngine(layout, ecfg) as engine:
            for direction, secs in runs.items():
                secs.append(await _copy_pass(engine, batches, direction, 1, None))
    return {d: round(1e6 * statistics.median(secs) / len(chunks), 2) for d, secs in runs.items()}


async def run_bench(
    cfg: BenchConfig, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Run every phase and return the figures (JSON-able).

    With ``cfg.gc_freeze`` the heap left by the set-up is frozen for the
    phases and unfrozen afterwards (see the module docstring), unless the
    caller's heap was frozen already (``gc.get_freeze_count() > 0``).

    Args:
        cfg: options; ``size_bytes`` is the KV cache size (bytes) moved per phase.
        progress: called with a short description as each step starts, never
            inside a timed region: :func:`bench_steps` times in all.

    Returns:
        ``{"config", "machine", "layout", "phases": {name: summary},
        "loop_lag_p99_ms", "gc_frozen_objects", ...}``.

    Raises:
        InvalidArgumentError: a bad layout file (:func:`preflight`).
        ConfigError: the run would not fit, or cannot write (:func:`preflight`).
        AssertionError: a round trip changed bytes or a phase failed keys.
    """
    shape, num_blocks = preflight(cfg)
    progress(f"allocating {escape(shape.name)}: {num_blocks} blocks")
    layout = shape.build(num_blocks, cfg.device)
    chunks = _chunks(layout, shape, cfg.blocks_per_chunk, cfg.seed, cfg.block_order)
    # A caller that froze its heap already manages the collector: leave it alone.
    freeze = cfg.gc_freeze and gc.get_freeze_count() == 0
    if freeze:
        gc.collect()  # garbage frozen now would never be freed
        gc.freeze()
    try:
        return await _run_phases(
            cfg, shape, layout, chunks, num_blocks, gc.get_freeze_count(), progress
        )
    finally:
        if freeze:
            gc.unfreeze()


async def _run_phases(
    cfg: BenchConfig,
    shape: ModelShape,
    layout: KVLayout,
    chunks: list[kvtier.Chunk],
    num_blocks: int,
    frozen: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    report = {
        name: Phase(name, 0)
        for name in (
            "store",
            "load",
            "nvme_write",
            "nvme_write_full",
            "nvme_write_e2e",
            "nvme_read",
        )
    }
    progress("copy phases")
    await _copy_phases(cfg, layout, chunks, report)
    lag = LagMonitor()
    io_info: dict[str, Any] = {}
    if cfg.nvme:
        io_info = await _nvme_phases(cfg, layout, chunks, report, lag, progress)
    else:
        for name in ("nvme_write", "nvme_write_full", "nvme_write_e2e", "nvme_read"):
            del report[name]
    progress("scheduling overhead")
    overhead = await _scheduling_overhead(cfg, shape, len(chunks))
    bpc = cfg.blocks_per_chunk
    return {
        # the block size in effect (a layout file's own tokens_per_block wins)
        "config": {**asdict(cfg), "tokens_per_block": shape.tokens_per_block},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "device": cfg.device,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "layout": {
            "name": shape.name,
            "groups": len(layout.group_ids),
            "num_blocks": num_blocks,
            "tokens_per_block": shape.tokens_per_block,  # a layout file's own, if it sets one
            "chunks": len(chunks),
            "slot_nbytes": layout.slot_nbytes(bpc),
            "sum_sized_slot_nbytes": round_up(
                sum(layout.group_nbytes(g, bpc) for g in layout.group_ids)
            )
            + 4096,
        },
        "io": io_info,
        "gc_frozen_objects": frozen,
        "phases": {name: p.summary() for name, p in report.items()},
        "scheduling_overhead_us_per_chunk": overhead,
        "loop_lag_p99_ms": round(lag.p99_ms(), 3),
    }


def _ms(value: float | None) -> str:
    """A latency cell: milliseconds with three decimals, empty when not measured."""
    return "" if value is None else f"{value:.3f}"


def _size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it at 1 or more (``"256 MiB"``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.4g} {unit}"
    return f"{nbytes} bytes"


def format_table(result: dict[str, Any]) -> Any:
    """A rich Table of the phases."""
    from rich.table import Table

    lay, cfg = result["layout"], result["config"]
    moved = result["phases"]["store"]["bytes"]
    groups = f"{lay['groups']} group{'s' if lay['groups'] != 1 else ''}"
    caption = (
        f"{moved / 2**20:.0f} MiB per phase, {lay['chunks']} chunks x "
        f"{cfg['blocks_per_chunk']} blocks, {groups}, "
        f"{cfg['repeat']} repeat{'s' if cfg['repeat'] != 1 else ' (single samples: noisy)'}"
    )
    if moved > cfg["size_bytes"]:  # the data set holds at least one chunk per group
        caption += f"; above --size {_size(cfg['size_bytes'])}: one chunk per group"
    table = Table(
        title=f"kvtier bench - {escape(result['layout']['name'])} ({result['machine']['device']})",
        caption=caption,
    )
    for col in ("phase", "GB/s", "p50 ms", "p99 ms", "baseline GB/s", "ratio"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for name, p in result["phases"].items():
        bases = [k.removesuffix("_gbps") for k in p if k.endswith("_gbps") and k != "gbps"]
        first = True
        for b in bases or [None]:
            table.add_row(
                name if first else "",
                f"{p['gbps']:.2f}" if first else "",
                _ms(p.get("p50_ms")) if first else "",
                _ms(p.get("p99_ms")) if first else "",
                f"{b}: {p[f'{b}_gbps']:.2f}" if b else "",
                f"{p[f'ratio_vs_{b}']:.2f}x" if b and p.get(f"ratio_vs_{b}") else "",
            )
            first = False
        for variant, v in p.items():  # kvtier run another way: ratio to the first baseline
            if isinstance(v, dict) and "gbps" in v:
                b = bases[0] if bases else None
                ratio = v.get(f"ratio_vs_{b}") if b else None
                table.add_row(
                    f"  {variant}",
                    f"{v['gbps']:.2f}",
                    "",
                    "",
                    f"{b}: {p[f'{b}_gbps']:.2f}" if b else "",
                    f"{ratio:.2f}x" if ratio else "",
                )
    return table


def plot(result: dict[str, Any], path: str) -> None:
    """Write a PNG bar chart of GB/s per phase against the baselines (needs matplotlib).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = result["phases"]
    names = list(phases)
    series: dict[str, list[float]] = {"kvtier": [phases[n]["gbps"] for n in names]}
    for n in names:
        for k, v in phases[n].items():
            if k.endswith("_gbps") and k != "gbps":
                series.setdefault(k.removesuffix("_gbps"), [0.0] * len(names))[names.index(n)] = v
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (label, vals) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(names))], vals, width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=20, ha="right")
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvtier bench: {result['layout']['name']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def to_json(result: dict[str, Any], path: str) -> None:
    """Write the figures as JSON."""
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
