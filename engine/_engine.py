"""The asyncio transfer engine: ``store`` / ``load`` chunks of one KV cache group."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import torch

if TYPE_CHECKING:
    from kvtier.io import NVMeTier

from kvtier._aliasing import aliasing_labels
from kvtier._config import EngineConfig
from kvtier._holds import Hold, HoldRegistry, Pins, leading
from kvtier._in_flight import CallContext, on_no_medium, wait_in_flight
from kvtier._jobs import Call, JobQueue, track
from kvtier._lifecycle import Lifecycle, drain, open_nvme, open_pool, release
from kvtier._load_order import LoadOrder, LoadTurn
from kvtier._policy import make_policy
from kvtier._prefetch import run_prefetch
from kvtier._slots import HostRegion, SlotEntry, SlotPool
from kvtier._stats import Counters, engine_stats
from kvtier._transfer import (
    ChunkCopy,
    CopyExecutor,
    Direction,
    HostGroup,
    check_backend,
    host_pieces,
    piece_specs,
    record_event,
)
from kvtier._types import (
    Chunk,
    ClearResult,
    EngineStats,
    LoadResult,
    OffloadKey,
    PrefetchResult,
    Residency,
    StoreResult,
)
from kvtier._validation import CallValidator
from kvtier.errors import (
    BudgetError,
    ConfigError,
    InvalidArgumentError,
    KeyNotResidentError,
    KVTierError,
    NotStoredError,
)
from kvtier.layout import KVLayout

log = logging.getLogger("kvtier")


@dataclass
class _PreparedStore:
    """A store call after its synchronous half (slots reserved, copies submitted).

    ``result`` is what the caller awaits; a caller cancelled before the copy
    ended cancels it, and the copy's completion then frees the slots.
    """

    by_key: dict[OffloadKey, Chunk]
    entries: list[SlotEntry]
    skipped: list[OffloadKey]
    rejected: list[OffloadKey]
    ready: asyncio.Future[bool]
    result: asyncio.Future[StoreResult]
    durable: bool
    keys: list[OffloadKey]  # the call's keys, in call order
    hit: bool  # some present key was touched at the call


@dataclass
class _Load:
    """A submitted load copy.

    ``result`` is for the caller (a cancelled caller cancels it); ``finished``
    is set once the copy has ended, whatever happened.
    """

    call: Call
    result: asyncio.Future[LoadResult]
    finished: asyncio.Future[None]


async def _uninterrupted(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` is done, even if the waiting task is cancelled again."""
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(fut)


def _not_stored(chunk: Chunk, stored: tuple[int, int]) -> NotStoredError | None:
    """The error for a chunk asking sub-blocks outside the ``stored`` range, else None."""
    if stored[0] <= chunk.offset and chunk.stop <= stored[1]:
        return None
    return NotStoredError(
        f"{chunk.key}: sub-blocks [{chunk.offset}, {chunk.stop}) requested, "
        f"[{stored[0]}, {stored[1]}) stored"
    )


class TransferEngine:
    """Moves chunks of ONE KV cache group at a time between GPU blocks, CPU slots and NVMe.

    The CPU pool holds ``num_slots = cpu_bytes // layout.slot_nbytes(blocks_per_chunk)``
    slots, each sized for the LARGEST group, so ``num_slots`` keys of any group
    mix fit without eviction. Use it as an async context manager, or call
    :meth:`start` and :meth:`aclose`. All methods must be called from the event
    loop thread that started the engine, and its coroutines awaited on that
    loop (use :class:`BackgroundEngine` from synchronous code); other calls
    raise :class:`~kvtier.errors.WrongThreadError` and change nothing.
    :meth:`stats` alone may be read from any thread (a metrics scrape).

    Args:
        layout: the registered GPU KV cache.
        config: sizing and policies.

    Raises:
        BudgetError: ``cpu_bytes`` cannot hold one slot.
        ConfigError: the NVMe ``capacity_bytes`` cannot hold one row of the
            largest group; or ``copy_backend`` cannot run here (``"dma"`` or
            ``"kernel"`` on a CUDA host; ``"kernel"`` without Triton or
            ``TRITON_INTERPRET=1``).
        InvalidArgumentError: ``layout`` / ``config`` have the wrong type.

    """

    def __init__(self, layout: KVLayout, config: EngineConfig) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if not isinstance(config, EngineConfig):
            raise InvalidArgumentError(
                f"config must be an EngineConfig, got {type(config).__name__}"
            )
        self.layout = layout
        self.config = config
        check_backend(config.copy_backend, layout.device)
        bpc = config.blocks_per_chunk
        self.blocks_per_chunk = bpc
        self.slot_nbytes = layout.slot_nbytes(bpc)
        self.num_slots = config.cpu_bytes // self.slot_nbytes
        if self.num_slots < 1:
            raise BudgetError(
                f"cpu_bytes={config.cpu_bytes} cannot hold one slot of {self.slot_nbytes} bytes "
                f"(largest group chunk + 4 KiB trailer, blocks_per_chunk={bpc})"
            )
        self._offsets = {g: layout.layer_offsets(g, bpc) for g in layout.group_ids}
        self._specs = {g: piece_specs(layout.group(g), self._offsets[g]) for g in layout.group_ids}
        self._group_nbytes = {g: layout.group_nbytes(g, bpc) for g in layout.group_ids}
        if config.nvme is not None and config.nvme.capacity_bytes < self.slot_nbytes:
            # A row of the largest group is slot_nbytes long (payload + trailer).
            raise ConfigError(
                f"NVMeConfig.capacity_bytes={config.nvme.capacity_bytes} cannot hold one "
                f"{self.slot_nbytes}-byte row of the largest group (blocks_per_chunk={bpc})"
            )
        self._validate = CallValidator(layout, bpc)
        # Load turns: groups whose blocks share bytes only at the same block id
        # (one tensor in several groups, as vLLM's hybrid allocator shares them) get
        # one label, and their pages compare by block id.
        self._load_order = LoadOrder(aliasing_labels(self._specs), self._validate.alias_class)
        self._lifecycle = Lifecycle(type(self).__name__)
        self._region: HostRegion | None = None
        self._host: dict[int, HostGroup | None] = {}
        self._pool = SlotPool(self.num_slots, make_policy(config.eviction, self.num_slots))
        self._executors: dict[Direction, CopyExecutor] = {}
        self._ready: dict[OffloadKey, asyncio.Future[bool]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        # Holds not yet released (aclose releases them).
        self._holds = HoldRegistry(self._pool)
        self._c = Counters()
        self._jobs = JobQueue(self._c, config.max_batch_chunks, self._executors, self._tasks)
        self._nvme: Any = None
        self._nvme_final: dict[str, Any] | None = None  # the tier's last counters once closed
        self._writer: Any = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> Self:
        """Allocate and pre-fault the CPU pool, open the NVMe tier.

        Blocks nothing on the event loop (pre-faulting runs in a worker thread).

        Raises:
            EngineClosedError: the engine was already started or closed, or
                :meth:`aclose` was called while it started (everything it
                had set up is released then).
            BudgetError: the CPU pool of ``cpu_bytes`` cannot be allocated.
            ConfigError: the NVMe root is unusable.
            NamespaceLockedError: another engine holds the NVMe namespace.

        """
        await self._lifecycle.start(self._set_up, self._release)
        return self

    async def _set_up(self) -> None:
        """The start's steps: the CPU pool, the copy threads, the NVMe tier and its writer."""
        life = self._lifecycle
        region = self._region = await open_pool(
            self.num_slots, self.slot_nbytes, self.config.cpu_bytes, self.config.pin_memory
        )
        torch_only = self.config.copy_backend == "torch"
        self._host = {
            g: None if torch_only else host_pieces(
                self._specs[g], region.host_views, self.slot_nbytes, self.num_slots,
                self.blocks_per_chunk,
            )
            for g in self.layout.group_ids
        }  # fmt: skip
        life.stop_if_closing()
        threads = self.config.copy_threads
        self._executors.update(
            {
                d: CopyExecutor(self.layout.device, d, threads, self.config.copy_backend)
                for d in ("store", "load")
            }
        )
        self._executors["load"].know_groups(list(self._specs.values()))
        if self.config.nvme is not None:
            from kvtier._writeback import WriterParts

            parts = WriterParts(
                self.layout, self.blocks_per_chunk, self.slot_nbytes, self._pool, region,
                self._ready, self._c,
            )  # fmt: skip
            promoted = self._holds.promoted
            self._nvme, self._writer = await open_nvme(self.config.nvme, parts, promoted)
            life.stop_if_closing()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self, *, hard: bool = False) -> None:
        """Close the engine; later calls raise :class:`EngineClosedError`.

        Args:
            hard: cancel background NVMe writes instead of draining them (keys
                whose row was not fully written stay invisible on NVMe).

        Idempotent: every call returns only once the engine is closed (its
        NVMe namespace lock released). Waits for calls in flight (their copies
        touch slots and GPU blocks), then for the NVMe writes of their keys.

        Called while :meth:`start` runs, it waits for the step in progress
        (pre-faulting the CPU pool, opening the NVMe tier), after which
        ``start`` raises :class:`EngineClosedError` and releases what it set up.

        Cancellation: closing continues in the background; a later ``aclose``
        waits for it.

        Raises:
            WrongThreadError: called from another thread or event loop than
                the engine's while it is not closed (nothing changed).

        """
        await self._lifecycle.close(hard, self._drain, self._release, self._request_hard_close)

    def _request_hard_close(self) -> None:
        """Make the close in progress, or about to start, hard: drop rows not yet written."""
        if self._lifecycle.request_hard_close() and self._writer is not None:
            self._writer.cancel()  # the close may be draining: now, not at its next step

    async def _drain(self) -> None:
        """The close's first step: end every hold, then wait for the work in flight."""
        for held in self._holds.live():  # a hold never keeps the engine open
            self._release_hold(held)
        await drain(self._tasks, self._writer, self._lifecycle)

    async def _release(self) -> None:
        """Free what the start set up; ``stats()`` keeps the tier's last counters."""
        try:
            await release(self._nvme, self._writer, self._executors, self._host, self._region)
        finally:
            if self._nvme is not None:
                self._nvme_final = self._nvme_stats()
            self._nvme = self._region = None

    def _nvme_stats(self) -> dict[str, Any]:
        nvme = dict(self._nvme.stats())
        if self._writer is not None:
            nvme.update(self._writer.stats())
        return nvme

    def _mark(self, after: Any) -> Any:
        """The CUDA event a call's copies wait for: ``after``, or one recorded now.

        On a CUDA layout without ``after``, an event is recorded on the calling
        thread's current stream at the call: the copies then wait for the work
        queued before the call, whichever stream is current when the job is
        submitted later (another task's ``torch.cuda.stream`` context, or the
        engine thread of a :class:`~kvtier.BackgroundEngine`).

        Returns:
            A ``torch.cuda.Event``, or None on a CPU layout.

        Raises:
            InvalidArgumentError: ``after`` is not a ``torch.cuda.Event``, or
                is given for a CPU layout.
        """
        cuda = self.layout.device.type == "cuda"
        if after is not None:
            if not cuda:
                raise InvalidArgumentError(
                    f"after= needs a CUDA layout; this layout is on {self.layout.device}"
                )
            if not isinstance(after, torch.cuda.Event):
                raise InvalidArgumentError(
                    f"after must be a torch.cuda.Event, got {type(after).__name__}"
                )
            return after
        if not cuda:
            return None
        return record_event(self.layout.device)  # pragma: no cover - CUDA hosts only

    # ------------------------------------------------------------------ queries
    def lookup(self, keys: Iterable[OffloadKey]) -> list[Residency]:
        """Where each key can be loaded from now (no I/O, never blocks).

        Args:
            keys: offload keys.

        Returns:
            One :class:`Residency` per key: ``PENDING`` while a store or a
            promotion is in flight, ``CPU`` for a resident slot, ``NVME`` when
            only a fully written row exists, else ``MISS``.

        Raises:
            InvalidArgumentError: ``keys`` is not an iterable of :class:`OffloadKey`;
                ``UnknownGroupError`` for a group the layout does not have (as
                ``store``, ``load`` and ``prefetch`` raise: such a key is a
                caller's bug, not a miss).
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread or event loop than
                the engine's (nothing changed).

        """
        self._lifecycle.check_open()
        keys = self._validate.key_list(keys)
        out = []
        for key in keys:
            entry = self._pool.get(key)
            if entry is not None:
                out.append(Residency.PENDING if entry.writing else Residency.CPU)
            elif self._nvme is not None and self._nvme.contains(key):
                out.append(Residency.NVME)
            else:
                out.append(Residency.MISS)
        return out

    def hold(self, keys: Iterable[OffloadKey]) -> Hold:
        """Keep keys from eviction until the returned :class:`Hold` is released (no I/O).

        A scheduler that admits a request on :meth:`prefix_hits` loads the
        hits a step later; a store in between could evict them, and the load
        would then fail them. Held keys are not evicted: a key in a CPU slot
        is pinned there, a key only on NVMe has its row pinned (a load then
        promotes it as usual, into a free or evictable slot, which the hold
        then pins too; with every slot pinned that key fails). Stores that
        need room evict other keys, or are rejected when only held ones are
        left (as vLLM's
        ``OffloadingManager.prepare_load`` protects blocks until
        ``complete_load``, and LMCache's ``lookup(pin=True)`` until
        ``lookup_unpin``). Release it after the load returned (a ``with``
        block around the load does); a hold garbage-collected unreleased is
        released then (counted in ``EngineStats.holds_dropped``, the first
        one logged as a warning), and :meth:`aclose` releases the rest.

        Args:
            keys: offload keys, e.g. a request's prefix chain, head first.

        Returns:
            A :class:`Hold`: ``residency`` per key as :meth:`lookup` says,
            ``prefix_hits``, ``release()``; a context manager.

        Raises:
            InvalidArgumentError: ``keys`` is not an iterable of :class:`OffloadKey`
                (``UnknownGroupError``: a key of a group the layout does not
                have); nothing is held.
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread or event loop than
                the engine's (nothing changed).

        """
        self._lifecycle.check_open()
        keys = self._validate.key_list(keys)
        cpu: list[OffloadKey] = []
        rows: list[tuple[OffloadKey, Any]] = []
        residency: list[Residency] = []
        for key in keys:
            entry = self._pool.get(key)
            if entry is not None:
                if entry.writing:
                    residency.append(Residency.PENDING)
                else:
                    self._pool.pin(key)
                    cpu.append(key)
                    residency.append(Residency.CPU)
            elif self._nvme is not None and (ref := self._nvme.hold_row(key)) is not None:
                rows.append((key, ref))
                residency.append(Residency.NVME)
            else:
                residency.append(Residency.MISS)
        held = Hold(
            self._release_hold, self._hold_dropped, tuple(keys), tuple(residency), cpu, rows
        )
        self._holds.add(held)
        return held

    def _release_hold(self, held: Hold) -> None:
        """Unpin what ``held`` pinned (its engine's loop thread; idempotent)."""
        if held.released:
            return
        if self._lifecycle.state in ("open", "starting"):
            self._lifecycle.check_thread("Hold.release()")
        held.detach()
        self._holds.discard(held)
        self._release_pins(held.pins)

    def _release_pins(self, pins: Pins) -> bool:
        """Unpin a hold's slots and rows once (loop thread); False if done already.

        Both ways a hold ends (:meth:`_release_hold`, and a garbage-collected
        hold's scheduled :meth:`_release_dropped`) come here
        (:meth:`HoldRegistry.release`). Nothing is unpinned once the engine closed.
        """
        refs = self._holds.release(pins, closed=self._lifecycle.closed)
        if refs is None:
            return False
        if self._nvme is not None:
            for ref in refs:
                self._nvme.release_row(ref)
        return True

    def _hold_dropped(self, pins: Pins) -> None:
        """A :class:`Hold` was garbage-collected unreleased: release its pins on the loop.

        Runs in ``Hold.__del__``, on whatever thread dropped the last
        reference, possibly in the middle of the engine's own code: the
        release is scheduled on the loop (thread-safe), never run here, and
        nothing is logged here (a handler could block or raise).
        """
        loop = self._lifecycle.loop
        if loop is not None and not self._lifecycle.closed:
            loop.call_soon_threadsafe(self._release_dropped, pins)

    def _release_dropped(self, pins: Pins) -> None:
        """Release a garbage-collected hold's pins (loop thread); count it, warn the first time."""
        if self._release_pins(pins):  # else aclose released it meanwhile
            self._holds.count_dropped()

    def prefix_hits(self, keys: Iterable[OffloadKey]) -> int:
        """Number of leading keys that a load can serve (``CPU``, ``NVME`` or ``PENDING``).

        A key stored as a partial chunk counts; :meth:`stored_range` says
        which sub-blocks a load of it can ask for.

        Raises:
            InvalidArgumentError: ``keys`` is not an iterable of :class:`OffloadKey`
                (``UnknownGroupError``: a key of a group the layout does not have).
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread or event loop than
                the engine's (nothing changed).

        """
        return leading(self.lookup(keys), (Residency.CPU, Residency.NVME, Residency.PENDING))

    # ------------------------------------------------------------------ validation
    # ------------------------------------------------------------------ store
    async def store(
        self, chunks: Sequence[Chunk], *, durable: bool = False, after: Any = None
    ) -> StoreResult:
        """Copy chunks from their GPU blocks into CPU slots (and write them through to NVMe).

        Returns when every GPU->CPU copy of the call has completed, so the GPU
        blocks may be reused. NVMe write-through continues in the background
        unless ``durable`` is True, in which case it also waits until the
        rows of all the call's keys, stored or skipped, are durable
        (``fdatasync``); the row of a skipped key that is only in a CPU slot
        (its earlier write failed) is written again.

        Stores issued in the same event-loop iteration are coalesced into one
        job. Keys already present (CPU, in flight or on NVMe) are skipped.
        Keys that find no free or evictable slot are rejected (never waits for
        room). Eviction never picks a key of the same call. Recency follows
        the call's order, head first: the first chunk becomes the most
        recently used key (in the CPU slots and, through the order its row is
        queued in, on NVMe), so a prefix chain passed head first loses its
        tail first.

        Cancellation: the copy already submitted still completes; if the caller
        was cancelled before that, the call's slots are then freed (the keys are
        not kept), never while the copy uses them.

        Args:
            chunks: one :class:`Chunk` per key, ``block_ids`` in
                ``[0, num_blocks)`` of its group, ``offset + len(block_ids) <=
                blocks_per_chunk``, no key twice. A block id may repeat in a
                store (its page is copied into each sub-block that names it);
                :meth:`load` refuses that, since it would write one page twice.
            durable: wait for the call's NVMe rows to be durable (needs an
                NVMe tier).
            after: CUDA layouts only: a ``torch.cuda.Event`` the copies wait
                for before they read the GPU blocks (e.g. recorded after the
                forward pass that wrote them). Default: an event recorded at
                this call on the calling thread's current stream, so work
                queued on it before the call is waited for, not later work.

        Returns:
            :class:`StoreResult` with ``stored``, ``skipped`` and ``rejected`` keys.

        Raises:
            InvalidArgumentError: bad chunks (subclasses name the rule),
                ``durable`` not a bool, or ``after`` not a ``torch.cuda.Event``
                (or given on a CPU layout); nothing changed.
            ConfigError: ``durable`` on an engine without an NVMe tier; nothing changed.
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread or event loop than
                the engine's (nothing changed).
            NotDurableError: ``durable`` and rows of the call's keys could not
                be written (its ``result`` is the StoreResult; the keys stay in CPU slots).
            StorageError: ``durable`` and the ``fdatasync`` failed (see :meth:`flush`).

        """
        self._lifecycle.check_open(loop=True)
        if not isinstance(durable, bool):
            raise InvalidArgumentError(f"store(durable=...) must be a bool, got {durable!r}")
        if durable and self.config.nvme is None:
            raise ConfigError("store(durable=True) needs an NVMe tier (EngineConfig.nvme)")
        chunks = self._validate.chunks(chunks, load=False)
        after = self._mark(after)
        prepared = self._prepare_store(chunks, durable, after)
        if prepared.result.done():
            # Nothing to copy (every key skipped or rejected): yield once all the
            # same, so that a caller retrying rejected stores in a loop cannot
            # starve the NVMe writes whose end frees the slots.
            await asyncio.sleep(0)
        # Cancelled here, ``prepared.result`` is cancelled too: _store_copied
        # then frees the slots once the copy has ended.
        result = await prepared.result
        if not durable or self._writer is None:
            return result
        task = asyncio.ensure_future(self._make_durable(prepared, result))
        self._track(task)
        return await asyncio.shield(task)

    def _prepare_store(self, chunks: list[Chunk], durable: bool, after: Any) -> _PreparedStore:
        """Synchronous half of a store: skip present keys, reserve slots, submit the copies."""
        skipped, requests, by_key, hit = [], [], {}, []
        for chunk in chunks:
            key = chunk.key
            entry = self._pool.get(key)
            if entry is not None or (self._nvme is not None and self._nvme.contains(key)):
                skipped.append(key)
                if entry is not None and not entry.writing:
                    hit.append(key)
                continue
            nbytes = len(chunk.block_ids) * self.layout.group(key.group_id).block_payload_nbytes
            requests.append((key, chunk.offset, chunk.stop, nbytes))
            by_key[key] = chunk
        for key in reversed(hit):  # recency: the call's first chunk ends most recently used
            self._pool.touch(key)
        # Every key of the call is protected, the skipped (present) ones too
        # (a set is built only when the call must evict).
        evicts = len(requests) > self._pool.free_count
        protect = {c.key for c in chunks} if evicts else frozenset[OffloadKey]()
        entries, rejected, _evicted = self._pool.reserve(requests, protect=protect)
        self._c.rejected += len(rejected)
        loop = asyncio.get_running_loop()
        prepared = _PreparedStore(
            by_key,
            entries,
            skipped,
            rejected,
            loop.create_future(),
            loop.create_future(),
            durable,
            [c.key for c in chunks],
            bool(hit),
        )
        for entry in entries:
            self._ready[entry.key] = prepared.ready
        if entries:
            copies = [self._copy(by_key[e.key], e.slot) for e in entries]
            done = functools.partial(self._store_copied, prepared)
            self._jobs.submit("store", Call(copies, done, after))
        else:
            self._store_copied(prepared, None)
        return prepared

    def _store_copied(self, p: _PreparedStore, error: BaseException | None) -> None:
        """The store's copy ended: commit (or free) its slots, queue the rows, resolve it."""
        cancelled = p.result.cancelled()
        stored: list[OffloadKey] = []
        rejected = list(p.rejected)
        for entry in p.entries:
            key = entry.key
            self._ready.pop(key, None)
            if error is not None or cancelled:
                self._pool.abort(key)
                rejected.append(key)
            else:
                stored.append(key)
        # Recency (CPU and, through the order rows are queued in, NVMe): the call's
        # first chunk ends most recently used, so a prefix chain loses its tail first.
        for key in reversed(stored):
            self._pool.commit(key)
        if stored and p.hit:  # present keys were touched at the call, before these commits
            self._pool.refresh_tail_first(p.keys, {k for k in p.keys if self._resident(k)})
        if not p.ready.done():  # never cancelled by kvtier; guard against outside hands
            p.ready.set_result(error is None and not cancelled)
        if self._writer is not None and (self.config.write_through or p.durable):
            # write_through=False: only durable stores write rows. The call's keys on
            # NVMe are marked tail first once its rows are written (skipped ones too).
            self._writer.enqueue(
                [(k, p.by_key[k].offset, p.by_key[k].stop) for k in reversed(stored)], p.keys
            )
        if not p.result.done():
            p.result.set_result(StoreResult(tuple(stored), tuple(p.skipped), tuple(rejected)))

    async def _make_durable(self, p: _PreparedStore, result: StoreResult) -> StoreResult:
        assert self._writer is not None
        # Skipped keys count too: wait for stores of them in flight, then for their rows.
        others = {self._ready[k] for k in p.skipped if k in self._ready}
        if others:
            await asyncio.wait(others)
        await self._writer.make_durable([*result.stored, *p.skipped], result)
        return result

    def _track(self, fut: asyncio.Future[Any]) -> None:
        """Make :meth:`aclose` wait for ``fut`` (a task or a job in flight)."""
        track(self._tasks, fut)

    def _copy(self, chunk: Chunk, slot: int) -> ChunkCopy:
        assert self._region is not None
        g = chunk.key.group_id
        return ChunkCopy(
            self._specs[g],
            self._region.views,
            slot * self.slot_nbytes,
            chunk.block_ids,
            chunk.offset,
            len(chunk.block_ids) * self.layout.group(g).block_payload_nbytes,
            self._host[g],
            slot,
        )

    # ------------------------------------------------------------------ load
    async def load(self, chunks: Sequence[Chunk], *, after: Any = None) -> LoadResult:
        """Copy chunks from CPU slots (promoting NVMe rows first) into their GPU blocks.

        Returns when the bytes are in the GPU blocks. A key whose store is in
        flight is waited for. A key on NVMe only is read into a CPU slot,
        verified (trailer and checksum) and then copied; a key on no medium or
        a failed read lands in ``LoadResult.failed`` and its GPU blocks receive
        no bytes from kvtier. A failed device copy (:class:`TransferError`)
        fails every key of the call; some of their blocks may already hold
        their own bytes, never other bytes. Loads issued in the same
        event-loop iteration are coalesced into one job. Hits (and promoted
        keys) are marked used tail first, so the call's first chunk ends the
        most recently used key in the CPU slots (and, of the rows it read,
        on NVMe; a CPU hit does not touch the key's row).

        Calls that write the same GPU bytes land in call order (the later
        call's bytes are left): a call into a block that an earlier call,
        still waiting for its store in flight or its promotion, also writes
        waits for that call before it copies. Loads and stores are not
        ordered against each other (await one before the other touches the
        same blocks).

        Cancellation: when ``load`` raises ``CancelledError``, nothing writes
        its GPU blocks any more, so they may be reused at once. A copy not yet
        handed to a copy thread is withdrawn; one already running is waited
        for (the cancellation is delayed by at most that copy, and by an NVMe
        promotion in flight for the call); the blocks then hold either the
        key's bytes or what they held before, per block.

        Args:
            chunks: one :class:`Chunk` per key; a GPU block may appear only once
                per call. A key whose stored sub-blocks (:meth:`stored_range`)
                do not cover ``offset .. offset+len(block_ids)`` fails alone
                with :class:`NotStoredError` in ``LoadResult.failed`` (counted
                as a miss); the other keys load.
            after: CUDA layouts only: a ``torch.cuda.Event`` the copies wait
                for before they write the GPU blocks (e.g. recorded after the
                last kernel that reads what the blocks held). Default: an
                event recorded at this call on the calling thread's current
                stream.

        Returns:
            :class:`LoadResult`.

        Raises:
            InvalidArgumentError: bad chunks (wrong types, block ids out of
                range, a block twice, unknown group), or ``after`` not a
                ``torch.cuda.Event`` (or given on a CPU layout); nothing changed.
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread or event loop than
                the engine's (nothing changed).

        """
        self._lifecycle.check_open(loop=True)
        chunks = self._validate.chunks(chunks, load=True)
        after = self._mark(after)
        not_stored: dict[OffloadKey, BaseException] = {}
        for chunk in chunks:
            try:
                self._check_range(chunk)
            except NotStoredError as exc:
                not_stored[chunk.key] = exc
                self._c.misses += 1
        chunks = [c for c in chunks if c.key not in not_stored] if not_stored else chunks
        turn = self._take_turn(chunks)
        if turn is None:
            # Fast path: every key is resident or a miss; no task, and a
            # cancelled caller leaves the unpinning to the copy's completion.
            pinned, failed = self._pin_resident(chunks)
            failed.update(not_stored)
            if not pinned:
                await asyncio.sleep(0)  # every key failed: yield, as a store that copies nothing
                return LoadResult((), failed)
            pending = self._submit_load(pinned, failed, after)
            try:
                return await pending.result
            except asyncio.CancelledError:
                if not self._jobs.withdraw("load", pending.call):
                    await _uninterrupted(pending.finished)
                raise
        ctx = CallContext(woken=asyncio.get_running_loop().create_future())
        task = asyncio.ensure_future(self._load(chunks, ctx, after, turn))
        # However the task ends (even cancelled before its first step), its turn ends.
        task.add_done_callback(lambda _: self._load_order.end(turn[0]))
        self._track(task)
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            ctx.cancel()
            await _uninterrupted(task)  # it copies nothing more once it sees ``cancelled``
            raise
        if not_stored:
            result.failed.update(not_stored)
        return result

    async def prefetch(self, keys: Sequence[OffloadKey]) -> PrefetchResult:
        """Promote keys that are only on NVMe into CPU slots, ahead of their load.

        A serving loop calls it when it schedules a request whose prefix is
        on NVMe, so that the later :meth:`load` is a CPU hit and copies only
        CPU -> GPU. No GPU memory is touched. Each row is read, verified
        (trailer and checksum) and left in an unpinned slot, evictable like
        any stored key; a failed read drops the row (the key is a MISS
        afterwards, as after a failed load). Keys whose store or promotion is
        in flight are waited for. Promotions of one call go out as coalesced
        runs of consecutive rows, like a load's. The call's keys stay pinned
        until it returns: a store that needs room meanwhile evicts others.
        Recency follows the call's order, head first, as for a load (for
        the policy a prefetch is a hint, not a use).

        Hits and misses are not counted (they count loads); promotions and
        their failures are (``EngineStats.nvme``: ``promotions``,
        ``promotion_failures``; ``failures`` by kind).

        Cancellation: reads already started complete and their keys stay
        resident; reads not started yet (the call was still waiting for a
        store or promotion in flight) are skipped; the result is lost.

        Args:
            keys: offload keys, no key twice. Without an NVMe tier every key
                is resident or failed.

        Returns:
            :class:`PrefetchResult` (``promoted``, ``resident``, ``failed``).

        Raises:
            InvalidArgumentError: ``keys`` is not a sequence of
                :class:`OffloadKey`; ``DuplicateKeyError`` for a key twice,
                ``UnknownGroupError`` for a group the layout does not have.
                Nothing changed.
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread or event loop than
                the engine's (nothing changed).

        """
        self._lifecycle.check_open(loop=True)
        keys = self._validate.distinct_keys(keys)
        nvme, writer = self._nvme, self._writer
        return await run_prefetch(keys, self._ready, self._pool, nvme, writer, self._tasks)

    def _resident(self, key: OffloadKey) -> bool:
        entry = self._pool.get(key)
        return entry is not None and not entry.writing

    def _take_turn(self, chunks: list[Chunk]) -> tuple[LoadTurn, list[LoadTurn]] | None:
        """Queue a load call behind earlier waiting loads of its GPU pages, if it must wait.

        See :meth:`LoadOrder.take`; ``None`` when the call can submit at once.
        """
        return self._load_order.take(chunks, self._must_wait(chunks))

    def _must_wait(self, chunks: list[Chunk]) -> bool:
        """A key of ``chunks`` has a store or promotion in flight, or must be promoted."""
        ready, pool, nvme = self._ready, self._pool, self._nvme
        for chunk in chunks:
            key = chunk.key
            if key in ready:
                return True
            if nvme is not None and pool.get(key) is None and nvme.contains(key):
                return True
        return False

    def _pin_resident(
        self, chunks: list[Chunk], promote: list[Chunk] | None = None
    ) -> tuple[list[Chunk], dict[OffloadKey, BaseException]]:
        """Pin the resident keys of ``chunks``.

        Keys only on NVMe go to ``promote`` when it is given; every other key,
        and a resident key without the requested sub-blocks, is a miss (in
        the returned ``failed``).
        """
        pinned: list[Chunk] = []
        failed: dict[OffloadKey, BaseException] = {}
        for chunk in chunks:
            key = chunk.key
            entry = self._pool.get(key)
            if entry is not None and not entry.writing:
                short = _not_stored(chunk, (entry.start, entry.stop))
                if short is not None:
                    # stored (by another call) with fewer sub-blocks while we waited
                    self._c.misses += 1
                    failed[key] = short
                    continue
                self._pool.pin(key)
                pinned.append(chunk)
                self._c.hits += 1
            elif (
                promote is not None
                and entry is None
                and self._nvme is not None
                and self._nvme.contains(key)
            ):
                promote.append(chunk)
            else:
                self._c.misses += 1
                failed[key] = on_no_medium(key)
        for chunk in reversed(pinned):  # the call's first chunk ends most recently used
            self._pool.touch(chunk.key)
        return pinned, failed

    def _submit_load(
        self, pinned: list[Chunk], failed: dict[OffloadKey, BaseException], after: Any
    ) -> _Load:
        """Copy pinned keys to their GPU blocks; unpin them when the copy has ended."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[LoadResult] = loop.create_future()
        finished: asyncio.Future[None] = loop.create_future()
        copies = []
        for chunk in pinned:
            entry = self._pool.get(chunk.key)
            assert entry is not None
            copies.append(self._copy(chunk, entry.slot))

        def copied(error: BaseException | None) -> None:
            loaded: list[OffloadKey] = []
            for chunk in pinned:
                self._pool.unpin(chunk.key)
                if error is None:
                    loaded.append(chunk.key)
                else:
                    failed[chunk.key] = error
                    if not isinstance(error, asyncio.CancelledError):  # withdrawn: not a failure
                        self._c.load_failures += 1
            if not result.done():
                result.set_result(LoadResult(tuple(loaded), failed))
            finished.set_result(None)

        call = Call(copies, copied, after)
        self._jobs.submit("load", call)
        return _Load(call, result, finished)

    def stored_range(self, key: OffloadKey) -> tuple[int, int] | None:
        """Sub-blocks ``[start, stop)`` of ``key`` that a load can serve now (never blocks).

        A chunk stored with ``Chunk(key, block_ids, offset)`` holds sub-blocks
        ``offset .. offset + len(block_ids)`` (in ``0 .. blocks_per_chunk``);
        a later store of the same key is skipped, so the range never grows.
        Load any sub-range of it.

        Returns:
            ``(start, stop)`` for a key in a CPU slot, on NVMe, or whose store
            or promotion is in flight (``PENDING``); None for a ``MISS``.

        Raises:
            InvalidArgumentError: ``key`` is not an :class:`OffloadKey`
                (``UnknownGroupError``: its group is not in the layout, as
                :meth:`lookup` says).
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread or event loop than
                the engine's (nothing changed).

        """
        self._lifecycle.check_open()
        self._validate.check_key(key)
        return self._stored_range(key)

    def _stored_range(self, key: OffloadKey) -> tuple[int, int] | None:
        entry = self._pool.get(key)
        if entry is not None:
            return entry.start, entry.stop
        if self._nvme is not None:
            rng: tuple[int, int] | None = self._nvme.stored_range(key)
            return rng
        return None

    def _check_range(self, chunk: Chunk) -> None:
        rng = self._stored_range(chunk.key)
        short = None if rng is None else _not_stored(chunk, rng)
        if short is not None:
            raise short

    async def _load(
        self,
        chunks: list[Chunk],
        ctx: CallContext,
        after: Any,
        turn: tuple[LoadTurn, list[LoadTurn]],
    ) -> LoadResult:
        # Wait for stores / promotions in flight on these keys, again when
        # another call started one while we waited (else the key would read
        # as a miss); a cancelled caller waits for this task, so stop then.
        await wait_in_flight(self._ready, [c.key for c in chunks], ctx)
        promote: list[Chunk] = []
        pinned, failed = self._pin_resident(chunks, promote)
        if promote:
            by_key = {c.key: c for c in promote}
            ok, errors = await self._writer.promote(list(by_key), protect={c.key for c in chunks})
            failed.update(errors)
            for exc in errors.values():  # evicted from NVMe meanwhile: a plain miss
                if isinstance(exc, KeyNotResidentError):
                    self._c.misses += 1
                else:
                    self._c.load_failures += 1
            for chunk in (by_key[k] for k in ok):
                try:
                    self._check_range(chunk)  # a promoted row may hold another range
                except NotStoredError as exc:
                    self._pool.unpin(chunk.key)
                    failed[chunk.key] = exc
                    self._c.misses += 1
                else:
                    pinned.append(chunk)
                    self._c.nvme_hits += 1
            if ok and len(pinned) > len(ok):
                # Promoted keys became resident after the hits were touched: mark the
                # call's keys again, tail first (a refresh: no second use is counted).
                self._pool.refresh_tail_first([c.key for c in chunks], {c.key for c in pinned})
        if not pinned:
            return LoadResult((), failed)
        # Earlier loads into the blocks this call copies to submit first, so the later
        # call wins. Its keys stay pinned meanwhile: a key resident at the call is
        # loaded (the earlier call's promotion cannot evict it). A cancelled caller
        # stops waiting (it will copy nothing).
        pages, classes = self._load_order.pages_of(pinned)
        ahead = [t.submitted for t in turn[1] if t.overlaps(pages, classes)]
        while not ctx.cancelled and (ahead := [f for f in ahead if not f.done()]):
            assert ctx.woken is not None
            await asyncio.wait([*ahead, ctx.woken], return_when=asyncio.FIRST_COMPLETED)
        if ctx.cancelled:  # the caller is gone: copy nothing (not a load failure)
            for chunk in pinned:
                self._pool.unpin(chunk.key)
                failed[chunk.key] = asyncio.CancelledError()
            return LoadResult((), failed)
        pending = self._submit_load(pinned, failed, after)
        self._load_order.end(turn[0])
        await pending.finished
        return pending.result.result()

    # ------------------------------------------------------------------ flush / stats
    async def flush(self) -> None:
        r"""Return when every key stored before the call is durable on NVMe.

        Waits for the write-through of those keys, then ``fdatasync``\\ s the
        segment files they went to (batched). Without an NVMe tier nothing is
        ever durable and it returns at once (``store(durable=True)`` raises).

        Raises:
            NotDurableError: rows of keys stored before the call could not be
                written since the last flush reported them (``failed`` names the
                keys; they stay in CPU slots, a restart will not find them).
            StorageError: an ``fdatasync`` failed. The keys written to that
                segment file since its last good sync leave NVMe (a retried
                sync would not prove them durable) and stay in their CPU slots;
                ``store(keys, durable=True)`` writes them again. The next
                flush syncs again and raises ``NotDurableError`` naming them.
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread or event loop than
                the engine's (nothing changed).

        Cancellation: the writes continue; other flushes and durable stores
        waiting for the same rows are not affected.

        """
        self._lifecycle.check_open(loop=True)
        if self._writer is not None:
            await self._writer.flush()

    async def clear(self, *, nvme: bool = False) -> ClearResult:
        """Empty the CPU tier (and with ``nvme=True`` the NVMe tier) while running.

        For a serving engine's cache reset (vLLM's ``reset_prefix_cache``).
        First waits for the calls in flight at the call (their copies touch
        slots and GPU blocks) and for the NVMe writes of the keys they
        stored; then drops every key in a CPU slot that nothing pins. Keys a
        :class:`Hold` pins are left alone and reported, as are keys that a
        call started while ``clear`` waited still uses. With ``nvme=True``
        every NVMe row of the namespace that no hold pins is dropped too and
        its trailer blanked (as eviction does), so a restart does not find
        it; a row a read still uses is blanked once that read ends. Without
        it, rows stay: a later :meth:`lookup` says ``NVME`` for such keys,
        ``MISS`` for the rest. :meth:`stats` (and its Prometheus gauges)
        count the freed slots at once.

        Args:
            nvme: also drop the NVMe rows (no effect without an NVMe tier).

        Returns:
            A :class:`ClearResult`: keys dropped per tier, keys kept.

        Raises:
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread or event loop than
                the engine's (nothing changed).

        Cancellation: the wait ends, nothing is dropped by this call.
        """
        self._lifecycle.check_open(loop=True)
        # The calls in flight now (and the jobs they start), then the row
        # writes of what they stored: write-through pins their slots.
        for _ in range(3):
            pending = list(self._tasks)
            if not pending:
                break
            await asyncio.wait(pending)
        if self._writer is not None:
            with contextlib.suppress(KVTierError):
                # A row that did not become durable is dropped below anyway.
                await self._writer.flush()
        self._lifecycle.check_open()
        pool = self._pool
        kept: list[OffloadKey] = []
        cpu_dropped = 0
        for entry in list(pool.entries()):
            if entry.writing or entry.refs:
                kept.append(entry.key)
                continue
            pool.drop(entry.key)
            cpu_dropped += 1
        nvme_dropped = 0
        if nvme and self._nvme is not None:
            held = {key for h in self._holds.live() for key, _ in h.pins.rows}
            kept.extend(sorted(held - set(kept), key=lambda k: (k.group_id, k.block_hash)))
            nvme_dropped = await self._nvme.clear(keep=held | set(kept))
        return ClearResult(cpu_dropped, nvme_dropped, tuple(kept))

    @property
    def closed(self) -> bool:
        """Whether the engine has closed (``aclose()`` ended, or ``start()`` failed)."""
        return self._lifecycle.closed

    @property
    def nvme(self) -> NVMeTier | None:
        """The engine's NVMe tier while it is open, else ``None`` (no tier configured, or closed).

        Read it for its queries (``directory``, ``contains``, ``stats``); the
        engine owns its rows, so write through the engine only.
        """
        tier: NVMeTier | None = self._nvme
        return tier

    @property
    def write_batch_seconds(self) -> Sequence[float]:
        """Seconds from queueing to writing of each NVMe write batch, oldest first.

        The last 65,536 batches; empty without an NVMe tier. ``kvtier bench``
        reports their median and p99.
        """
        return self._writer.batch_seconds if self._writer is not None else ()

    def work_in_flight(self) -> list[asyncio.Future[Any]]:
        """The engine's own tasks now running: copy jobs, NVMe writes, promotions.

        Awaiting them waits for this moment's work, not for work they start.
        Loop thread only.
        """
        return list(self._tasks)

    def stats(self) -> EngineStats:
        """A snapshot of the counters (never blocks).

        ``reserved_nbytes`` is ``slot_nbytes`` times occupied slots;
        ``slot_waste_nbytes`` is reserved minus the payload the keys use.
        ``keys_per_group`` counts resident keys (pinned included, stores in
        flight not). After close, ``nvme`` keeps the tier's counters as they
        were at close. The slot figures come from one pass over the pool, so
        they add up to ``num_slots`` also when another thread (a metrics
        scrape) reads them while the engine's loop runs.
        """
        nvme: dict[str, Any] | None
        if self._nvme is not None:
            nvme = self._nvme_stats()
        else:  # closed: the tier's last counters (None without an NVMe tier)
            nvme = dict(self._nvme_final) if self._nvme_final is not None else None
        return engine_stats(
            self._pool,
            self._c,
            slot_nbytes=self.slot_nbytes,
            pinned_memory=bool(self._region and self._region.pinned),
            nvme=nvme,
            holds_dropped=self._holds.dropped,
        )
