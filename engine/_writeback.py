"""Glue between the CPU slot pool and the NVMe tier: write-through and promotion.

Write-through: keys whose store completed are pinned and handed to
:meth:`kvtier.io.NVMeTier.write_rows` in batches. A batch stays open until one
of the ``_MAX_BATCHES_IN_FLIGHT`` write slots is free for it (or it holds
``_MAX_BATCH_NBYTES``), so everything stored while earlier batches were being
written goes out together and the rows of one group land in consecutive file
offsets: long runs, full-size requests. A slot stays pinned until its row write has
finished. A row that fails is remembered until a ``flush()`` covering it
reports it (:class:`~kvtier.errors.NotDurableError`). Promotion: an NVMe-only
key is read into a freshly reserved slot, verified by the tier, and becomes a
resident CPU key.
"""

from __future__ import annotations

import asyncio
import collections
import os
import pathlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier._types import OffloadKey
from kvtier.errors import (
    KeyNotResidentError,
    KVTierError,
    NamespaceLockedError,
    NotDurableError,
    StorageError,
    storage_error_kind,
)

if TYPE_CHECKING:
    from kvtier._config import NVMeConfig
    from kvtier._slots import HostRegion, SlotPool
    from kvtier._stats import Counters
    from kvtier.io import NVMeTier
    from kvtier.layout import KVLayout

_MAX_BATCHES_IN_FLIGHT = 2
_MAX_BATCH_NBYTES = 64 << 20
"""An open write batch holding this many slot bytes is closed; the next key opens another."""

Failures = dict[OffloadKey, BaseException]
"""The rows of a write batch that failed, by key."""


@dataclass(eq=False)
class _Batch:
    """Rows queued for one ``write_rows`` call, written once a write slot is free."""

    done: asyncio.Future[Failures]
    """Set to the failed rows once every row was written or failed (shared; never cancel)."""
    t0: float
    rows: list[tuple[OffloadKey, int, int, int]] = field(default_factory=list)
    """``(key, start, stop, seq)`` in enqueue order."""


@dataclass(frozen=True, eq=False)
class WriterParts:
    """What an NVMe writer is handed by the engine it serves, and updates in place.

    The engine builds one at start, once its CPU region exists, so the writer
    never reaches into the engine and ``_writeback`` does not import ``_engine``.
    """

    layout: KVLayout
    blocks_per_chunk: int
    slot_nbytes: int
    """Bytes per CPU slot: the largest group's chunk, 4 KiB-aligned."""
    pool: SlotPool
    """The engine's slot pool: the writer pins, commits and drops its entries."""
    region: HostRegion
    """The CPU slots' memory: rows are written from and read into its buffers."""
    ready: dict[OffloadKey, asyncio.Future[bool]]
    """Keys whose bytes are still arriving in their slot -> set once they are there."""
    counters: Counters
    """The engine's counters; the writer adds to ``rejected`` and ``failures``."""


async def open_tier(cfg: NVMeConfig, layout: KVLayout, blocks_per_chunk: int) -> NVMeTier:
    """Open the NVMe tier described by ``cfg`` for ``layout``'s groups.

    Args:
        cfg: the engine's ``config.nvme``.
        layout: the engine's KV layout; its description and per-group chunk
            sizes (bytes) make the tier's format.
        blocks_per_chunk: GPU blocks per chunk (one row holds one group's chunk).

    Raises:
        The errors of :func:`open_tier_for`.
    """
    bpc = blocks_per_chunk
    return await open_tier_for(
        cfg,
        layout.describe(),
        bpc,
        {g: layout.group_nbytes(g, bpc) for g in layout.group_ids},
    )


async def open_tier_for(
    cfg: NVMeConfig,
    layout_description: dict[str, Any],
    blocks_per_chunk: int,
    group_nbytes: dict[int, int],
) -> NVMeTier:
    """Open the NVMe tier of ``cfg`` for a layout known by its description.

    The vLLM backend's scheduler process has no KV cache tensors, only the
    worker's ``KVLayout.describe()`` and group sizes; both it and
    :class:`~kvtier.TransferEngine` open their tier here.

    Raises:
        NamespaceLockedError: another open engine holds the namespace (the
            message names its pid).
    """
    from kvtier.io import NVMeTier

    tier = NVMeTier(
        root=cfg.root,
        namespace=cfg.namespace,
        capacity_bytes=cfg.capacity_bytes,
        layout_description=layout_description,
        blocks_per_chunk=blocks_per_chunk,
        group_nbytes=group_nbytes,
        io_backend=cfg.io_backend,
        direct_io=cfg.direct_io,
        io_threads=cfg.io_threads,
        segment_nbytes=cfg.segment_nbytes,
        request_nbytes=cfg.request_nbytes,
        row_io_wrapper=cfg.row_io_wrapper,
        grow_ahead=cfg.grow_ahead,
        eviction_window=cfg.eviction_window,
    )
    try:
        await tier.open()
    except NamespaceLockedError as exc:
        loop = asyncio.get_running_loop()
        holder = await loop.run_in_executor(None, _lock_holder, tier.directory / "lock")
        raise NamespaceLockedError(
            f"NVMe namespace {cfg.namespace!r} under {str(cfg.root)!r} is held by another "
            f"open engine{holder}; close that engine or choose another namespace "
            f"(lock: {tier.directory / 'lock'})"
        ) from exc
    return tier


def _lock_holder(path: pathlib.Path) -> str:
    """`` (pid N)`` from the namespace lock file (or ``(in this process)``), or '' (blocks)."""
    try:
        pid = path.read_text().strip()
    except OSError:
        return ""
    if not pid.isdigit():
        return ""
    return " (in this process)" if int(pid) == os.getpid() else f" (pid {pid})"


class NVMeWriter:
    """Background write-through and promotion for one engine."""

    def __init__(
        self,
        parts: WriterParts,
        tier: NVMeTier,
        *,
        on_promoted: Callable[[OffloadKey], None],
    ) -> None:
        self._parts: WriterParts | None = parts
        # Called for each key a promotion committed (a hold of its row pins the slot too).
        self._on_promoted = on_promoted
        self._tier = tier
        self._open: _Batch | None = None  # the batch new keys join
        self._waiting: list[_Batch] = []  # batches not yet handed to the tier (open included)
        self._inflight: set[asyncio.Future[Failures]] = set()
        self._batch_of: dict[OffloadKey, asyncio.Future[Failures]] = {}  # queued or in flight
        self._enqueued = 0  # keys handed to write-through so far (their sequence)
        self._failed: dict[OffloadKey, tuple[int, BaseException]] = {}  # not yet reported
        self._flush_marks: dict[object, int] = {}  # flush calls in progress -> their mark
        self._tasks: set[asyncio.Task[None]] = set()
        self._sem = asyncio.Semaphore(_MAX_BATCHES_IN_FLIGHT)
        self.rows_written = 0
        self.write_failures = 0
        self.promotions = 0
        self.promotion_failures = 0
        self.batch_seconds: collections.deque[float] = collections.deque(maxlen=65536)
        """Seconds from a write batch's first enqueue to its last row written."""
        tier.on_sync_drop = self._sync_dropped

    def _held(self) -> WriterParts:
        """The engine's parts; :class:`AssertionError` once :meth:`detach` dropped them."""
        parts = self._parts
        assert parts is not None, "NVMe writer used after its engine closed"
        return parts

    # ------------------------------------------------------------------ write-through
    def enqueue(
        self, items: list[tuple[OffloadKey, int, int]], call: list[OffloadKey] | None = None
    ) -> None:
        """Pin the slots of resident keys and queue their rows.

        Args:
            items: ``(key, start, stop)``: the stored sub-block range of each key.
                ``self._batch_of[key]`` is then the future of the key's batch.
            call: the store call's keys in call order (its skipped ones too):
                once every row of ``items`` was written (or failed), those of
                them on NVMe are marked used tail first, so the call's first
                key ends the most recently used row whichever batch ended
                last (its rows may span batches, written concurrently).

        """
        parts = self._held()
        pool = parts.pool
        full = -(-_MAX_BATCH_NBYTES // parts.slot_nbytes)  # rows of a full batch
        batches: list[asyncio.Future[Failures]] = []
        for key, start, stop in items:
            batch = self._open
            if batch is None or len(batch.rows) >= full:
                batch = self._open_batch()
            pool.pin(key)
            self._enqueued += 1
            batch.rows.append((key, start, stop, self._enqueued))
            self._batch_of[key] = batch.done
            if not batches or batches[-1] is not batch.done:
                batches.append(batch.done)
        if call:
            self._touch_when_written(call, batches)

    def _touch_when_written(
        self, call: list[OffloadKey], batches: list[asyncio.Future[Failures]]
    ) -> None:
        """Mark the call's keys on NVMe used, tail first, once ``batches`` are done."""
        tier = self._tier
        left = [len(batches)]
        # Ranked at the call, not when its batches end: a call whose batch
        # waited (segment growth, a write slot) stays before later calls.
        first = tier.reserve_ranks(len(call))

        def touch_all() -> None:
            for i, key in enumerate(reversed(call)):
                tier.touch(key, first + i)  # no-op for a key not (or no longer) on NVMe

        def one_done(_: object) -> None:
            left[0] -= 1
            if left[0] == 0:
                touch_all()

        if not batches:  # every key was skipped: nothing to wait for
            touch_all()
        for fut in batches:
            fut.add_done_callback(one_done)

    def _open_batch(self) -> _Batch:
        """Open a batch for new keys; its task writes it once a write slot is free."""
        batch = _Batch(asyncio.get_running_loop().create_future(), time.perf_counter())
        self._open = batch
        self._waiting.append(batch)
        self._inflight.add(batch.done)
        task = asyncio.ensure_future(self._write_when_free(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return batch

    async def _write_when_free(self, batch: _Batch) -> None:
        async with self._sem:
            if self._open is batch:
                self._open = None  # later keys go to the next batch
            if batch not in self._waiting:  # dropped by cancel()
                return
            self._waiting.remove(batch)
            await self._write(batch)

    async def _write(self, batch: _Batch) -> None:
        parts = self._held()
        pool, region = parts.pool, parts.region
        views = []
        failed: Failures = {}
        try:
            rows = []
            for key, start, stop, _ in batch.rows:
                entry = pool.get(key)
                assert entry is not None
                view = region.buffer(entry.slot, parts.slot_nbytes)
                views.append(view)
                rows.append((key, start, stop, view))
            try:
                results: list[BaseException | None] = await asyncio.shield(
                    self._tier.write_rows(rows)
                )
            except Exception as exc:  # the tier refused the whole call: every row failed
                results = [exc] * len(rows)
            for (key, _, _, seq), res in zip(batch.rows, results, strict=True):
                if res is None:
                    self.rows_written += 1
                    if self._tier.contains(key):  # not dropped by a failed sync meanwhile
                        self._failed.pop(key, None)
                else:
                    self.write_failures += 1
                    failed[key] = res
                    self._failed[key] = (seq, res)
        finally:
            for view in views:
                view.release()
            for key, _, _, _ in batch.rows:
                pool.unpin(key)
                if self._batch_of.get(key) is batch.done:
                    del self._batch_of[key]
            self._inflight.discard(batch.done)
            self.batch_seconds.append(time.perf_counter() - batch.t0)
            if not batch.done.done():
                batch.done.set_result(failed)

    async def flush(self) -> None:
        """Wait for every row queued before the call, then make them durable.

        Raises:
            NotDurableError: rows queued before the call failed since the last
                flush that reported them (every flush in progress when they
                are reported gets them too).
            StorageError: an ``fdatasync`` failed (the tier dropped the keys
                written to that segment since its last good sync).

        Cancellation: the writes continue; other callers waiting for the same
        rows are not affected; unreported failures stay for the next flush.

        """
        token = object()
        mark = self._flush_marks[token] = self._enqueued
        try:
            waits = list(self._inflight)
            if waits:
                await asyncio.wait(waits)  # never cancels the batch futures others share
            await self._tier.flush()
        finally:
            del self._flush_marks[token]
        failed = {k: exc for k, (seq, exc) in self._failed.items() if seq <= mark}
        if failed:
            covered = max(self._flush_marks.values(), default=0)  # flushes still running
            for k in failed:
                if self._failed[k][0] > covered:
                    del self._failed[k]
            raise NotDurableError(failed)

    async def make_durable(self, keys: list[OffloadKey], result: Any) -> None:
        """Return once the rows of ``keys`` are written and synced (``store(durable=True)``).

        Waits for the queued or in-flight rows of the keys; queues the row of
        a resident CPU key that is neither on NVMe nor queued (its earlier
        write failed); then syncs the segment files.

        Raises:
            NotDurableError: some of the keys' rows failed, or a key is on no
                medium; ``result`` rides along.
            StorageError: the ``fdatasync`` failed.

        """
        pool = self._held().pool
        missing: Failures = {}
        rewrite = []
        for key in keys:
            if key in self._batch_of or self._tier.contains(key):
                continue
            entry = pool.get(key)
            if entry is not None and not entry.writing:
                rewrite.append((key, entry.start, entry.stop))
            else:
                missing[key] = StorageError("missing", f"{key} is on no medium")
        if rewrite:
            self.enqueue(rewrite)
        waits = {self._batch_of[k] for k in keys if k in self._batch_of}
        if waits:
            await asyncio.wait(waits)  # never cancels the batch futures others share
        await self._tier.flush()
        wanted = set(keys)
        failed = dict(missing)
        for fut in waits:
            failed.update((k, exc) for k, exc in fut.result().items() if k in wanted)
        # a key whose row another caller's failed fdatasync dropped meanwhile
        failed.update(
            (k, self._failed[k][1]) for k in wanted if k in self._failed and k not in failed
        )
        if failed:
            raise NotDurableError(failed, result)

    def _sync_dropped(self, key: OffloadKey, err: StorageError) -> None:
        """A failed ``fdatasync`` dropped ``key`` from NVMe: a failed row to report.

        Its sequence is 1: every flush from now on covers it (it was stored
        before), until one reports it or a new write of the key succeeds.
        """
        self._failed[key] = (1, err)

    def detach(self) -> None:
        """Drop the engine's parts once the engine is closed.

        The tier and the writer refer to each other; without this, a closed
        writer (with every slot entry and row index entry behind it) could only
        be freed by a full cyclic garbage collection, which pauses the whole
        process (about 80 ms with torch imported). Counters stay readable.
        """
        self._parts = None
        self._tier.on_sync_drop = None  # the tier and the writer refer to each other too

    @property
    def busy(self) -> bool:
        """Whether rows are queued or being written."""
        return bool(self._tasks)

    async def drain(self) -> None:
        """Wait for every queued and in-flight row write (used by ``aclose``)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def cancel(self) -> None:
        """Drop rows not yet handed to the tier (hard stop); in-flight I/O still completes.

        A dropped row is a failed row (kind ``"dropped"``): flushes and durable
        stores waiting for it raise :class:`NotDurableError`.
        """
        pool = self._held().pool
        for batch in self._waiting:
            failed: Failures = {}
            for key, _, _, seq in batch.rows:
                pool.unpin(key)
                if self._batch_of.get(key) is batch.done:
                    del self._batch_of[key]
                failed[key] = StorageError(
                    "dropped", f"{key}: row dropped by aclose(hard=True) before it was written"
                )
                self._failed[key] = (seq, failed[key])
            self._inflight.discard(batch.done)
            batch.done.set_result(failed)
        self._waiting, self._open = [], None

    # ------------------------------------------------------------------ promotion
    async def promote(
        self, keys: list[OffloadKey], protect: Collection[OffloadKey], *, hint: bool = False
    ) -> tuple[list[OffloadKey], dict[OffloadKey, BaseException]]:
        """Read NVMe-only keys into CPU slots; returns (keys promoted and pinned, failures).

        ``hint``: a prefetch, not a use; the keys are committed as hinted
        (:meth:`SlotPool.commit`) and their first load is their first use.
        """
        parts = self._held()
        pool, region = parts.pool, parts.region
        errors: dict[OffloadKey, BaseException] = {}
        requests = []
        for key in keys:
            rng = self._tier.stored_range(key)
            if rng is None:
                errors[key] = KeyNotResidentError(f"{key} left NVMe before promotion")
                continue
            nbytes = (rng[1] - rng[0]) * parts.layout.group(key.group_id).block_payload_nbytes
            requests.append((key, rng[0], rng[1], nbytes))
        entries, rejected, _ = pool.reserve(requests, protect=protect)
        for key in rejected:
            errors[key] = KVTierError(f"{key}: no free or evictable CPU slot for promotion")
        parts.counters.rejected += len(rejected)  # not a failed read: the row stays on NVMe
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bool] = loop.create_future()
        for entry in entries:
            parts.ready[entry.key] = ready
        views = [region.buffer(e.slot, parts.slot_nbytes) for e in entries]
        try:
            results: list[tuple[int, int] | BaseException] = await asyncio.shield(
                self._tier.read_rows([(e.key, v) for e, v in zip(entries, views, strict=True)])
            )
        except Exception as exc:  # the tier refused the whole call: no slot may stay writing
            results = [exc] * len(entries)
        finally:
            for view in views:
                view.release()
        ok: list[OffloadKey] = []
        for entry, res in zip(entries, results, strict=True):
            key = entry.key
            parts.ready.pop(key, None)
            if isinstance(res, StorageError) and res.kind == "missing":
                # NVMe eviction (a write batch needing room) won the race: a MISS
                pool.abort(key)
                errors[key] = KeyNotResidentError(f"{key} left NVMe before promotion")
            elif isinstance(res, BaseException):
                pool.abort(key)
                errors[key] = res
                self.promotion_failures += 1
                kind = storage_error_kind(res)
                parts.counters.failures[kind] = parts.counters.failures.get(kind, 0) + 1
            else:
                entry.start, entry.stop = res
                ok.append(key)
                self.promotions += 1
        for key in reversed(ok):  # recency: the call's first key ends most recently used
            pool.commit(key, hint=hint)
            pool.pin(key)
            self._on_promoted(key)  # a hold of its row pins the slot too
        ready.set_result(True)
        return ok, errors

    def stats(self) -> dict[str, int]:
        """Write-through and promotion counters."""
        return {
            "rows_written": self.rows_written,
            "write_failures": self.write_failures,
            "promotions": self.promotions,
            "promotion_failures": self.promotion_failures,
            "writes_queued": sum(len(b.rows) for b in self._waiting),
        }
