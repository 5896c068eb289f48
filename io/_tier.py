"""NVMeTier: the engine's only entry point to the NVMe tier (DESIGN.md section 5)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import re
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from kvtier.errors import (
    ChunkRangeError,
    ConfigError,
    DuplicateKeyError,
    EngineClosedError,
    StorageError,
    UnknownGroupError,
)
from kvtier.io import _blanking, _files, _growth, _reads, _requests, _writes
from kvtier.io._align import ALIGN, round_up
from kvtier.io._files import GroupSpec, ReadJob, WriteJob
from kvtier.io._format import (
    HEADER_NBYTES,
    digest16,
    format_digest,
    format_fields,
)
from kvtier.io._index import RowIndex, RowRef
from kvtier.io._inspect import other_formats
from kvtier.io._requests import FAILURE_KINDS
from kvtier.io._rowio import (
    IO_BACKENDS,
    IOV_MAX,
    AioRowIO,
    RowIO,
    SubmittingRowIO,
    select_backend,
    submits,
)
from kvtier.keys import OffloadKey

__all__ = ["FAILURE_KINDS", "NVMeTier"]

log = logging.getLogger("kvtier.io")

T = TypeVar("T")

GROW_NBYTES = 128 << 20
"""Largest growth step of a segment file (bytes)."""


class NVMeTier:
    """Rows of offload keys in per-group segment files under one namespace directory.

    Construction is pure (no I/O); :meth:`open` does the file work. All
    blocking I/O runs on the tier's own ``ThreadPoolExecutor`` of
    ``io_threads`` workers, never on the loop thread or the default executor;
    row checksums (sealing before a write, verification after a read) run on
    a second pool of ``min(io_threads, CPUs)`` workers, and file growth and
    hole punching (``fallocate``, segment creation) on a third of
    ``min(2, io_threads)`` workers, so that the I/O workers only wait for row
    reads and writes.
    Every method must be called from the one event loop thread that opened it.

    Slot buffers: a buffer passed to :meth:`write_rows` or :meth:`read_rows`
    is used until that call returns. If the awaiting task is cancelled, the
    I/O still completes in a tier task (the index stays consistent) and the
    buffer stays in use until :meth:`drain`, :meth:`close` (or, for writes,
    :meth:`flush`) returns; keep the slot pinned until then.

    Args:
        root: parent folder of all namespaces (created if missing).
        namespace: the user's label (model id, rank); sanitized into the
            directory name ``<namespace>-<digest16>``.
        capacity_bytes: bound on the bytes of rows in use (visible keys and
            writes in flight), all groups together. When a write needs room,
            the least recently used keys of any group are evicted, or the
            writer's own group's oldest key within ``eviction_window``
            (its row is handed to the writer and overwritten in place). Rows
            of other groups become free rows of their own group once their
            trailers are zeroed (one 4 KiB write each), and keep their disk
            blocks, so that the group's next writes overwrite them in place
            (on ext4 an overwrite of written blocks is much faster than a
            write into new ones). Row blocks exceed ``capacity_bytes`` by at
            most one growth step per group (plus headers, and ext4's
            extent-tree blocks): past that, freed rows are
            deallocated with a punched hole where the filesystem supports
            it, the groups with the most free rows first; the files'
            apparent sizes keep the holes. Where holes cannot be punched,
            freed rows keep their blocks for their own group, and a workload
            that moves to other groups can take the disk past that bound (a
            write never waits for room that only another group's free rows
            hold).
        layout_description: ``KVLayout.describe()`` (JSON-able).
        blocks_per_chunk: GPU blocks per chunk (bounds stored ranges).
        group_nbytes: group id -> unpadded payload bytes of one chunk.
        io_backend: ``"auto"``, ``"posix"``, ``"kvikio"`` or ``"aio"`` (see
            :func:`~kvtier.io.select_backend`; ``"aio"`` queues up to
            ``4 * io_threads`` row requests in the kernel).
        direct_io: ``"auto"``, ``"on"`` or ``"off"``.
        io_threads: I/O worker threads (bounds the I/O requests in flight).
        segment_nbytes: largest size of a segment file (header included).
            Files are not preallocated: they grow in steps of
            ``min(segment_nbytes - 4096, 128 MiB, capacity_bytes / (4 * groups))``
            bytes (at least one row), with ``posix_fallocate`` (``ftruncate``
            where unsupported).
        request_nbytes: cap of one coalesced read or write request (bytes);
            a single row is never split.
        row_io_wrapper: wraps the selected backend (fault injection, counting).
        grow_ahead: grow a group by one step in the background when it is
            down to half a step of free rows (and create each group's first
            segment right after :meth:`open`), so writes rarely wait for
            ``fallocate`` or a new file; only while a whole step fits in the
            disk budget above. A failed growth ahead fails no key: it is
            logged, and that group grows only on demand again until an
            on-demand growth succeeds. False: rows are added only when a
            write needs one.
        eviction_window: a full tier evicts the least recently used key of
            the writer's group instead of the least recently used key when it
            is among this many least recently used evictable keys (pinned
            keys and keys of the writing call are skipped; the window is at
            most 1/32 of the keys); its row is then overwritten in place,
            with no blanking write. ``1``: strict LRU. See
            :meth:`~kvtier.io._index.RowIndex.reserve`.

    Raises:
        ConfigError: an argument is out of range (no state is created).

    """

    directory: pathlib.Path
    digest: bytes

    def __init__(
        self,
        *,
        root: str | os.PathLike[str],
        namespace: str,
        capacity_bytes: int,
        layout_description: dict[str, Any],
        blocks_per_chunk: int,
        group_nbytes: Mapping[int, int],
        io_backend: str = "auto",
        direct_io: str = "auto",
        io_threads: int = 4,
        segment_nbytes: int = 256 << 20,
        request_nbytes: int = 4 << 20,
        row_io_wrapper: Callable[[RowIO], RowIO] | None = None,
        grow_ahead: bool = True,
        eviction_window: int = 32,
    ) -> None:
        if not group_nbytes or any(int(n) <= 0 or int(g) < 0 for g, n in group_nbytes.items()):
            raise ConfigError(f"group_nbytes must map group ids to sizes > 0: {group_nbytes!r}")
        for name, value, low in (
            ("capacity_bytes", capacity_bytes, 1),
            ("blocks_per_chunk", blocks_per_chunk, 1),
            ("io_threads", io_threads, 1),
            ("segment_nbytes", segment_nbytes, 2 * ALIGN),
            ("request_nbytes", request_nbytes, ALIGN),
            ("eviction_window", eviction_window, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"NVMeTier {name} must be an int >= {low}, got {value!r}")
        if io_backend not in IO_BACKENDS:
            raise ConfigError(f"io_backend must be auto, posix, kvikio or aio, got {io_backend!r}")
        if direct_io not in ("auto", "on", "off"):
            raise ConfigError(f"direct_io must be auto, on or off, got {direct_io!r}")
        self._group_nbytes = {int(g): int(n) for g, n in sorted(group_nbytes.items())}
        self._row_nbytes = {g: round_up(n) + ALIGN for g, n in self._group_nbytes.items()}
        fields = format_fields(
            layout_description=layout_description,
            blocks_per_chunk=blocks_per_chunk,
            row_nbytes=self._row_nbytes,
            namespace=namespace,
        )
        self.digest = format_digest(
            layout_description=layout_description,
            blocks_per_chunk=blocks_per_chunk,
            row_nbytes=self._row_nbytes,
            namespace=namespace,
        )
        fields["digest"] = self.digest.hex()
        self._format_json = json.dumps(fields, indent=2, sort_keys=True) + "\n"
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", namespace)[:80] or "_"
        self._root = pathlib.Path(root)
        self._namespace = namespace
        self.directory = self._root / f"{safe}-{digest16(self.digest)}"
        self._layout = layout_description
        self._blocks_per_chunk = blocks_per_chunk
        self._specs = {
            g: GroupSpec(g, self.digest, n, round_up(n), self._row_nbytes[g], blocks_per_chunk)
            for g, n in self._group_nbytes.items()
        }
        rows_per_segment = {
            g: max(1, (segment_nbytes - HEADER_NBYTES) // r) for g, r in self._row_nbytes.items()
        }
        self._run_rows = {
            g: max(1, min(IOV_MAX, request_nbytes // r)) for g, r in self._row_nbytes.items()
        }
        step_nbytes = min(
            segment_nbytes - HEADER_NBYTES, GROW_NBYTES, capacity_bytes // (4 * len(self._specs))
        )
        grow_rows = {g: max(1, step_nbytes // r) for g, r in self._row_nbytes.items()}
        self._index = RowIndex(
            self._row_nbytes, capacity_bytes, rows_per_segment, grow_rows, eviction_window
        )
        self._options = (io_backend, direct_io, io_threads, row_io_wrapper)
        self._grow_ahead = bool(grow_ahead)
        self._ahead_paused: set[int] = set()  # groups whose last growth ahead failed
        self._ahead_failed: set[int] = set()  # groups whose growth ahead failed once (logged)
        self._can_punch = True  # False once fallocate(PUNCH_HOLE) was not supported here
        # False once punching other groups' keys gave no room, _PUNCH_MISSES times in a
        # row (see _disk_space.on_full_disk)
        self._punch_frees = True
        self._punch_misses = 0  # key punches in a row that gave no room (_disk_space)
        self._punch_lock = asyncio.Lock()  # one row at a time punches for room
        # One future per reclaim whose blanking I/O is in flight (see _blanking.reclaim).
        self._blanking: set[asyncio.Future[None]] = set()
        # The future of each group's growth in flight (see _growth.grow_step).
        self._growing: dict[int, asyncio.Future[None]] = {}
        # Growths are sized one at a time against the free space, less what the
        # growths sized and not yet done claimed (see _growth.claim_growth).
        self._growth_lock = asyncio.Lock()
        self._growth_claims = 0
        self._state = "new"
        self._row_io: RowIO | None = None
        self._aio: SubmittingRowIO | None = None  # row requests are queued through it
        self._backend: RowIO | None = None  # the unwrapped backend
        self._executor: ThreadPoolExecutor | None = None
        self._checksum_executor: ThreadPoolExecutor | None = None
        self._meta_executor: ThreadPoolExecutor | None = None
        self._lock_fd: int | None = None
        self._segments: dict[tuple[int, int], Any] = {}
        self._segment_locks: dict[int, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._write_tasks: set[asyncio.Task[Any]] = set()
        self._dirty: set[tuple[int, int]] = set()
        # Per segment, the keys published in it since its last successful
        # fdatasync, by row (a reused row replaces its entry: bounded by the rows).
        self._unsynced: dict[tuple[int, int], dict[int, OffloadKey]] = {}
        # Per segment, how many of its fdatasync calls failed: a row written while
        # one failed is not published (write_batch compares before and after).
        self._sync_failures: dict[tuple[int, int], tuple[int, StorageError]] = {}
        self.on_sync_drop: Callable[[OffloadKey, StorageError], None] | None = None
        """Called for each key a failed ``fdatasync`` drops (the engine reports it)."""
        self._write_epoch = self._synced_epoch = 0
        self._sync_task: asyncio.Task[None] | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._opening: asyncio.Future[None] | None = None  # done once open() has ended
        self._counts: dict[str, float] = dict.fromkeys(
            ["read_bytes", "read_seconds", "write_bytes", "write_seconds"], 0
        )
        self._counts.update({f"failures_{k}": 0 for k in FAILURE_KINDS})
        self._counts.update(invalid_rows_at_open=0, invalid_segments_at_open=0)
        self._counts.update(read_requests=0, write_requests=0, direct_io_fallback=0)
        self._counts.update(reclaim_failures=0)
        # The filesystem filled up below capacity_bytes once (warned once): from then
        # on, on-demand allocations wait for the punch lock (_writes._take_row).
        self._disk_was_full = False

    # -- sizes ------------------------------------------------------------------

    def row_nbytes(self, group_id: int) -> int:
        """Bytes of one row of a group: ``round_up(group_nbytes, 4096) + 4096``.

        Raises:
            UnknownGroupError: the group is not in ``group_nbytes``.

        """
        return self._row_nbytes[self._group(group_id)]

    def payload_region_nbytes(self, group_id: int) -> int:
        """``round_up(group_nbytes, 4096)``: the trailer's offset inside a slot.

        Raises:
            UnknownGroupError: the group is not in ``group_nbytes``.

        """
        return self._specs[self._group(group_id)].payload_region

    def _group(self, group_id: int) -> int:
        if group_id not in self._specs:
            raise UnknownGroupError(f"NVMe tier has no group {group_id!r}")
        return group_id

    # -- lifecycle --------------------------------------------------------------

    def _submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        assert self._executor is not None
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._submit(fn, *args)

    async def _run_checksum(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (checksums, trailers) on the checksum workers, not the I/O workers.

        The I/O workers then only wait for the disk: ``io_threads`` requests
        stay in flight while rows are sealed or verified next to them.
        """
        assert self._checksum_executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._checksum_executor, fn, *args)

    async def _run_meta(self, fn: Callable[..., T], *args: Any) -> T:
        """Run file-space work (``fallocate``, segment creation, hole punching) on its own workers.

        A ``fallocate`` can take milliseconds; on an I/O worker it would leave
        one of the ``io_threads`` request slots empty for that long.
        """
        assert self._meta_executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._meta_executor, fn, *args)

    async def _run_kept(
        self,
        fn: Callable[..., T],
        calls: Sequence[tuple[Any, ...]],
        keep: Callable[[int, T], None],
    ) -> list[T]:
        """Run ``fn(*args)`` for each ``args`` of ``calls`` on the workers; return the results.

        For steps whose results own resources (the namespace lock fd, segment
        handles): the await never abandons a worker thread. ``keep(i,
        result)`` is called for every call that returned, also when the
        awaiting task is cancelled or another call raised, so that
        :meth:`_release` can free what was acquired. Once all calls have
        ended, a cancellation is re-raised, else the first call's exception.
        """
        futures = [self._submit(fn, *args) for args in calls]
        try:
            await _settle(futures)
        finally:
            for i, fut in enumerate(futures):
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    keep(i, fut.result())
        return [fut.result() for fut in futures]

    async def open(self) -> None:
        """Prepare the directory, take the lock, choose the backend and rebuild the index.

        Raises:
            ConfigError: ``root`` is a file or not writable; ``direct_io="on"``
                without O_DIRECT; kvikio requested but unusable.
            NamespaceLockedError: another live engine holds the namespace.
            EngineClosedError: the tier was closed or is already open.

        """
        if self._state != "new":
            raise EngineClosedError(f"NVMe tier {self.directory} is {self._state}")
        self._state = "opening"
        self._opening = asyncio.get_running_loop().create_future()
        try:
            await self._open()
        finally:
            self._opening.set_result(None)

    async def _open(self) -> None:
        io_backend, direct_io, io_threads, wrapper = self._options
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-io")
        self._checksum_executor = ThreadPoolExecutor(
            max(1, min(io_threads, os.cpu_count() or 1)), thread_name_prefix="kvtier-checksum"
        )
        self._meta_executor = ThreadPoolExecutor(
            min(2, io_threads), thread_name_prefix="kvtier-meta"
        )
        try:
            # Every step runs to its end even if this task is cancelled meanwhile:
            # a worker thread that took the lock after an abandoned await would
            # leave the namespace locked for the rest of the process.
            await self._run_kept(
                _files.prepare_directory,
                [(self._root, self.directory, self._format_json)],
                self._keep_lock_fd,
            )
            (inner,) = await self._run_kept(
                select_backend,
                [(io_backend, direct_io, self.directory, 4 * io_threads, io_threads)],
                self._keep_backend,
            )
            self._counts["direct_io_fallback"] = int(direct_io == "auto" and not inner.direct)
            self._row_io = wrapper(inner) if wrapper is not None else inner
            if not all(callable(getattr(self._row_io, m, None)) for m in ("preadv", "pwritev")):
                raise ConfigError(
                    f"row_io_wrapper returned {self._row_io!r:.80}, not a RowIO "
                    "(preadv, pwritev, open, ...)"
                )
            if submits(self._row_io):  # a wrapper without submit_* gets blocking calls
                self._aio = cast("SubmittingRowIO", self._row_io)
            await _reads.scan(self)
            others = await self._run(other_formats, self._root, self.directory, self._namespace)
        except BaseException:
            await self._release()
            self._state = "closed"
            raise
        self._state = "open"
        if others:
            log.warning(
                "NVMe namespace %r: this engine uses %s; the root also holds folders of "
                "other formats of this namespace (layout, blocks_per_chunk or row size), "
                "which this engine never reads: %s. `kvtier inspect %s` shows which an "
                "engine holds; `kvtier remove %s NAME` frees one that none holds",
                self._namespace, self.directory.name, ", ".join(others), str(self._root),
                str(self._root),
            )  # fmt: skip
        for group_id in self._specs:  # first segments (or more rows) before the first write
            _growth.grow_ahead(self, group_id)

    async def _release(self) -> None:
        row_io, segments, lock_fd = self._row_io, list(self._segments.values()), self._lock_fd
        backend, self._backend, self._aio = self._backend, None, None
        self._segments.clear()
        self._lock_fd = None

        def release() -> None:
            if isinstance(backend, AioRowIO):
                backend.shutdown()  # waits for its requests (the tier's tasks have ended)
            for seg in segments:
                with contextlib.suppress(OSError):
                    assert row_io is not None
                    row_io.close(seg)
            if lock_fd is not None:
                _files.release_lock(lock_fd)

        if self._executor is not None:
            await _settle([self._submit(release)])  # a cancelled wait still releases
            self._executor.shutdown(wait=False)
        for pool in (self._checksum_executor, self._meta_executor):
            if pool is not None:
                pool.shutdown(wait=False)

    def _keep_lock_fd(self, _: int, fd: int) -> None:
        self._lock_fd = fd

    def _keep_backend(self, _: int, backend: RowIO) -> None:
        self._backend = backend  # its AIO context (if any) is freed by _release

    async def close(self) -> None:
        """Wait for in-flight I/O, fdatasync written segments, close files, release the lock.

        Idempotent: a later call returns at once (or waits for a close in
        progress). A cancelled ``close`` keeps closing in the background. A
        ``close`` during :meth:`open` first waits for the open to end.

        Raises:
            StorageError: the final fdatasync failed (files are closed and the
                lock released anyway; raised by the first call only).

        """
        if self._state == "new":
            self._state = "closed"
        if self._state == "opening":
            assert self._opening is not None
            await asyncio.shield(self._opening)  # open() releases what it took if it fails
        if self._state == "closed":
            return
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close())
            self._close_task.add_done_callback(lambda t: t.cancelled() or t.exception())
            await asyncio.shield(self._close_task)
        else:
            await asyncio.wait([self._close_task])

    async def _close(self) -> None:
        self._state = "closing"
        try:
            while self._tasks:
                await asyncio.wait(list(self._tasks))
            await _blanking.reclaim(self)
            if self._dirty:
                await self._sync_once()
        finally:
            await self._release()
            self._state = "closed"

    def _check_open(self) -> None:
        if self._state != "open":
            raise EngineClosedError(f"NVMe tier {self.directory} is {self._state}")

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    # -- index queries ----------------------------------------------------------

    def contains(self, key: OffloadKey) -> bool:
        """Whether ``key`` has a fully written row (does not touch the LRU)."""
        return self._index.lookup(key) is not None

    def stored_range(self, key: OffloadKey) -> tuple[int, int] | None:
        """Return the stored sub-block range ``(start, stop)`` of a visible key, or None."""
        entry = self._index.lookup(key)
        return None if entry is None else (entry.start, entry.stop)

    def keys(self) -> list[OffloadKey]:
        """Visible keys, groups in id order, least recently used first."""
        return self._index.keys()

    def touch(self, key: OffloadKey, rank: int | None = None) -> None:
        """Mark a visible key's row used (no I/O; nothing for another key).

        Args:
            key: the key.
            rank: None: most recently used now. A number from
                :meth:`reserve_ranks`: used at the time it was reserved, so
                a call's keys touched once its writes ended rank by the call,
                before the keys of later calls. A key never moves back.

        In memory only: after a restart rows rank by their sequence numbers,
        that is by when they were written.
        """
        self._index.touch(key, rank)

    def reserve_ranks(self, n: int) -> int:
        """Take ``n`` recency numbers now, for :meth:`touch` calls that come later.

        Returns:
            The first number; the call's keys use ``first .. first + n - 1``.
        """
        return self._index.reserve_ranks(n)

    def hold_row(self, key: OffloadKey) -> RowRef | None:
        """Pin the row of a visible key against eviction and reuse; None when not visible.

        Undo it with :meth:`release_row` (``TransferEngine.hold``). A row
        dropped meanwhile (its read failed, the key was discarded) is freed
        at that release.
        """
        entry = self._index.pin(key)
        return None if entry is None else entry.ref

    def release_row(self, ref: RowRef) -> None:
        """Undo one :meth:`hold_row`."""
        self._index.unpin(ref)

    def discard(self, key: OffloadKey) -> None:
        """Forget a key; its row becomes free (later, if a read still uses it).

        Writes of the key in flight will not make it visible. The row's
        trailer is blanked by the next write or :meth:`close`; a restart
        before that may find the key again.
        """
        self._index.discard(key)

    async def clear(self, keep: Collection[OffloadKey] = ()) -> int:
        """Drop every visible key except ``keep`` and blank the rows it frees.

        Writes in flight of the dropped keys will not publish them. A row a
        read still pins is blanked once that read ends (at the next
        reclaim). Blanking failures are logged and counted
        (``reclaim_failures``), as for eviction.

        Args:
            keep: keys whose rows stay (held by the engine).

        Returns:
            The number of keys dropped.

        Raises:
            EngineClosedError: the tier is not open.
        """
        self._check_open()
        dropped = 0
        for key in list(self._index.keys()):
            if key not in keep:
                self._index.discard(key)
                dropped += 1
        await _blanking.reclaim(self)
        return dropped

    def stats(self) -> dict[str, int | float | bool | str]:
        """Counters: bytes in bytes, times in seconds (summed over calls).

        Keys: ``rows_resident``, ``rows_pinned`` (rows that may not be
        evicted or reused now: read by a load or prefetch in flight, or held
        by ``TransferEngine.hold``), ``bytes_used`` (rows of visible keys and
        writes in flight; ``<= capacity_bytes``), ``capacity_bytes``,
        ``bytes_allocated`` (rows allocated in segment files, free ones
        and growths in flight included), ``read_bytes``, ``read_seconds``,
        ``write_bytes``, ``write_seconds``,
        ``read_requests``, ``write_requests``, ``failures_<kind>`` for every
        kind in :data:`FAILURE_KINDS`, ``checksum_failures`` (the same count as
        ``failures_checksum``, under the name of its Prometheus counter), ``evictions``,
        ``window_evictions`` (evictions of the writer's own group's key out
        of strict LRU order, see ``eviction_window``), ``disk_full_evictions``
        (evictions because the writer's segments could not grow, the
        filesystem being full below ``capacity_bytes``: its own group's
        least recently used key, or, for a group with no key to take, keys
        of other groups whose rows were punched), ``direct_io``,
        ``direct_io_fallback``, ``backend``,
        ``invalid_rows_at_open``, ``invalid_segments_at_open``, ``segments``,
        ``reclaim_failures`` (stale rows whose trailer could not be blanked).
        """
        out: dict[str, int | float | bool | str] = {
            k: (v if k.endswith("seconds") else int(v)) for k, v in self._counts.items()
        }
        out.update(
            rows_resident=len(self._index),
            rows_pinned=self._index.rows_pinned,
            bytes_used=self._index.bytes_used,
            capacity_bytes=self._index.capacity_bytes,
            bytes_allocated=self._index.allocated_nbytes,
            checksum_failures=int(self._counts["failures_checksum"]),
            evictions=self._index.evictions,
            window_evictions=self._index.window_evictions,
            disk_full_evictions=self._index.disk_full_evictions,
            direct_io=bool(self._row_io is not None and self._row_io.direct),
            backend=self._row_io.name if self._row_io is not None else "",
            segments=len(self._segments),
        )
        return out

    # -- writes -----------------------------------------------------------------

    async def write_rows(
        self, rows: Sequence[tuple[OffloadKey, int, int, memoryview]]
    ) -> list[BaseException | None]:
        """Write rows; each key becomes visible once its whole row is written.

        Each item is ``(key, start, stop, slot_buf)``: ``slot_buf`` is the
        whole CPU slot (4 KiB-aligned address, writable, ``>= row_nbytes``
        bytes) whose first ``group_nbytes`` bytes are the payload. The tier
        writes the trailer into ``slot_buf[payload_region:row_nbytes]``.
        Consecutive rows go out as one ``pwritev`` of at most ``request_nbytes``.

        Returns:
            Per row ``None`` or a :class:`StorageError` (kinds ``eio``,
            ``enospc``, ``einval``, ``short_write``, ``capacity``, ...). A
            failed row is freed; other rows are unaffected. ``capacity``: the
            row is larger than ``capacity_bytes``, or no room is left even
            after evicting every key that is not pinned by a read, in flight
            or part of this call (then nothing is evicted for it).

        Raises:
            InvalidArgumentError: bad key, range, buffer or a duplicate key
                (subclasses; raised before any state changes).
            AlignmentError: a slot buffer address is not 4 KiB aligned.
            EngineClosedError: the tier is not open.

        Cancellation: the I/O continues and the tier stays consistent; the slot
        buffers stay in use until :meth:`flush`, :meth:`drain` or
        :meth:`close` returns.

        """
        self._check_open()
        jobs: list[WriteJob] = []
        seen: set[OffloadKey] = set()
        for pos, (key, start, stop, buf) in enumerate(rows):
            view = _requests.slot_view(self, key, buf)
            if not 0 <= start < stop <= self._blocks_per_chunk:
                raise ChunkRangeError(f"{key}: sub-blocks {start}..{stop} outside a chunk")
            if key in seen:
                raise DuplicateKeyError(f"{key} appears twice in one write_rows call")
            seen.add(key)
            jobs.append(WriteJob(key, start, stop, view, pos))
        for job in jobs:  # registered now: a discard() from here on keeps the key unpublished
            job.seq = self._index.begin_write(job.key)
        task = self._spawn(_writes.write_batch(self, jobs))
        self._write_tasks.add(task)
        task.add_done_callback(self._write_tasks.discard)
        return await asyncio.shield(task)

    # -- reads ------------------------------------------------------------------

    async def read_rows(
        self, rows: Sequence[tuple[OffloadKey, memoryview]]
    ) -> list[tuple[int, int] | BaseException]:
        """Read rows into slots and verify them (trailer, key, group, checksum).

        Each item is ``(key, slot_buf)``; the row lands in
        ``slot_buf[:row_nbytes]`` (4 KiB-aligned address, writable).
        Consecutive rows are read with one ``preadv`` of at most ``request_nbytes``.
        When such a request of several rows fails (EIO, a short read), each
        row it did not read in full is read again alone, once: only a row
        whose own read fails, or that does not verify, fails.

        Returns:
            Per row the stored range ``(start, stop)``, or a
            :class:`StorageError` (kinds ``missing``, ``short_read``,
            ``trailer``, ``checksum``, ``eio``, ...). A failed key is dropped
            (MISS from then on) and counted; on failure the slot holds garbage.

        Raises:
            InvalidArgumentError: bad key or buffer (before any state change).
            AlignmentError: a slot buffer address is not 4 KiB aligned.
            EngineClosedError: the tier is not open.

        Cancellation: the reads continue; the rows stay pinned and the slot
        buffers in use until :meth:`drain` or :meth:`close` returns.

        """
        self._check_open()
        views = [_requests.slot_view(self, key, buf) for key, buf in rows]
        results: list[tuple[int, int] | BaseException] = [(0, 0)] * len(views)
        jobs: list[ReadJob] = []
        for pos, ((key, _), view) in enumerate(zip(rows, views, strict=True)):
            entry = self._index.pin(key)
            if entry is None:
                results[pos] = StorageError("missing", f"{key} is not on NVMe")
                _requests.fail(self, "missing")
            else:
                jobs.append(ReadJob(key, view, entry, pos))
        if jobs:
            await asyncio.shield(self._spawn(_reads.read_batch(self, jobs, results)))
        return results

    # -- durability -------------------------------------------------------------

    async def flush(self) -> None:
        """Return when every write accepted before the call is durable.

        Waits for those writes, then ``fdatasync``s each segment written since
        the last sync, in parallel; concurrent callers share one sync.

        Raises:
            StorageError: an ``fdatasync`` failed. The keys published in that
                segment since its last good sync are dropped (MISS), each
                counted as a failure of the error's kind; the segments stay
                dirty, so the next flush syncs them again.
            EngineClosedError: the tier is not open.

        """
        self._check_open()
        pending = [t for t in self._write_tasks if not t.done()]
        if pending:
            await asyncio.wait(pending)
        target = self._write_epoch
        while self._synced_epoch < target:
            if self._sync_task is None:
                self._sync_task = self._spawn(self._sync_once())
            await asyncio.shield(self._sync_task)

    async def _sync_once(self) -> None:
        try:
            epoch, dirty = self._write_epoch, list(self._dirty)
            self._dirty = set()
            unsynced = [self._unsynced.pop(s, {}) for s in dirty]
            row_io = self._row_io
            assert row_io is not None
            outcomes = await asyncio.gather(
                *(self._run(row_io.fdatasync, self._segments[s]) for s in dirty),
                return_exceptions=True,
            )
            errors = [e for e in outcomes if isinstance(e, BaseException)]
            if errors:
                err = _requests.as_storage_error(errors[0], "fdatasync of a segment failed")
                for segment, rows, outcome in zip(dirty, unsynced, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        # rows published while the failed sync ran are not known durable either
                        rows.update(self._unsynced.pop(segment, {}))
                        failure = _requests.as_storage_error(
                            outcome, f"fdatasync of segment g{segment[0]}/{segment[1]} failed"
                        )
                        count = self._sync_failures.get(segment, (0, failure))[0]
                        self._sync_failures[segment] = (count + 1, failure)
                        self._drop_unsynced(segment, rows, failure)
                self._dirty.update(dirty)
                raise err
            self._synced_epoch = max(self._synced_epoch, epoch)
        finally:
            self._sync_task = None

    def _drop_unsynced(
        self, segment: tuple[int, int], rows: dict[int, OffloadKey], failure: StorageError
    ) -> None:
        """Drop the keys published in ``segment`` since its last good sync (its sync failed).

        A retried ``fdatasync`` that succeeds does not prove them durable:
        after a failed writeback Linux may mark the pages clean and report the
        error only once, and a device cache flush that failed may have lost
        them. Each such key that is still at that row is dropped (MISS on
        NVMe; a resident CPU copy stays, and ``store(durable=True)`` writes it
        again), counted as a failure of ``failure.kind`` and passed to
        :attr:`on_sync_drop` at once, so that the engine's next flush names
        it even if the sync that dropped it was another (maybe cancelled)
        caller's, and a later rewrite of the key clears it.
        """
        group_id, number = segment
        for row, key in rows.items():
            if self._index.drop(key, RowRef(group_id, number, row)):
                _requests.fail(self, failure.kind)
                if self.on_sync_drop is not None:
                    self.on_sync_drop(key, failure)

    async def drain(self) -> None:
        """Wait until no read, write or sync of this tier is in flight.

        After it returns, no slot buffer passed to a (possibly cancelled)
        :meth:`write_rows` or :meth:`read_rows` call is used by the tier.
        """
        while self._tasks:
            await asyncio.wait(list(self._tasks))


async def _settle(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every future is done, even if the awaiting task is cancelled meanwhile.

    The futures are not cancelled (a worker thread cannot be stopped: its
    result would be lost). A cancellation of the waiter is re-raised once all
    futures are done; their own outcomes are left to the caller.
    """
    cancelled: asyncio.CancelledError | None = None
    pending = [f for f in futures if not f.done()]
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError as exc:
            cancelled = exc
        pending = [f for f in pending if not f.done()]
    if cancelled is not None:
        raise cancelled
