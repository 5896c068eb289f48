"""The row-moving half of NVMeTier: argument checks, allocation, coalesced batches.

Split out of ``_tier.py`` to keep modules small.

These functions run on the event loop thread and mutate the tier's
:class:`~kvtier.io._index.RowIndex` synchronously; every blocking step goes to
the tier's executor through ``tier._run``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable, Container
from typing import TYPE_CHECKING, Any

from kvtier.errors import InvalidArgumentError, StorageError, storage_error_kind
from kvtier.io import _files
from kvtier.io._align import buffer_address, check_direct
from kvtier.io._files import NO_ROW, ReadJob, WriteJob
from kvtier.io._format import SegmentHeader, encode_header
from kvtier.io._index import DEFERRED, Growth, RowRef
from kvtier.keys import OffloadKey

log = logging.getLogger("kvtier.io")

if TYPE_CHECKING:
    from kvtier.io._tier_state import TierState

FAILURE_KINDS = (
    "eio", "enospc", "einval", "short_read", "short_write",
    "checksum", "trailer", "capacity", "missing", "other",
)  # fmt: skip
"""Failure kinds counted by :meth:`NVMeTier.stats` as ``failures_<kind>``."""


def as_storage_error(exc: BaseException, what: str) -> StorageError:
    """Wrap a backend exception into a :class:`StorageError` with its kind (chained)."""
    if isinstance(exc, StorageError):
        return exc
    errno_ = exc.errno if isinstance(exc, OSError) else None
    err = StorageError(storage_error_kind(exc), f"{what}: {exc}", errno_)
    err.__cause__ = exc
    return err


def fail(tier: TierState, kind: str) -> None:
    """Count one failure of ``kind`` (unknown kinds count as ``other``)."""
    tier._counts[f"failures_{kind if kind in FAILURE_KINDS else 'other'}"] += 1


def slot_view(tier: TierState, key: Any, buf: Any) -> memoryview:
    """Check one ``(key, slot_buf)`` argument; return ``slot_buf[:row_nbytes]`` as bytes.

    Raises:
        InvalidArgumentError: not a key, unknown group, read-only,
            non-contiguous or too short buffer.
        AlignmentError: the buffer address is not 4 KiB aligned.

    """
    if not isinstance(key, OffloadKey):
        raise InvalidArgumentError(f"expected an OffloadKey, got {type(key).__name__}")
    row = tier.row_nbytes(key.group_id)
    view = memoryview(buf)
    if not view.c_contiguous or view.readonly:
        raise InvalidArgumentError(f"slot buffer of {key} must be writable and contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes < row:
        raise InvalidArgumentError(f"slot buffer of {key} has {view.nbytes} bytes < {row}")
    check_direct(buffer_address(view), row, 0)
    return view[:row]


def make_runs(tier: TierState, jobs: list[Any], ref: Callable[[Any], RowRef]) -> list[list[Any]]:
    """Sort jobs by row and cut them into runs of consecutive rows of one segment.

    A run holds at most ``request_nbytes // row_nbytes`` rows (at least one,
    at most IOV_MAX): one ``preadv``/``pwritev`` each.
    """
    out: list[list[Any]] = []
    for job in sorted(jobs, key=ref):
        r = ref(job)
        if out:
            p = ref(out[-1][-1])
            run = out[-1]
            if (p.group_id, p.segment, p.row + 1) == (r.group_id, r.segment, r.row) and len(
                run
            ) < tier._run_rows[r.group_id]:
                run.append(job)
                continue
        out.append([job])
    return out


async def write_batch(tier: TierState, jobs: list[WriteJob]) -> list[BaseException | None]:
    """Allocate rows, write them in coalesced runs, publish or free each row.

    Stale rows left by earlier calls are blanked first (so this batch can
    reuse them); rows of other groups evicted for this batch are blanked
    before its rows are written (see :func:`reclaim`: they keep their disk
    blocks within the budget), so that valid rows on disk never exceed
    ``capacity_bytes``, and it returns only once every row evicted so far is
    blank (:func:`settle_evictions`). The groups
    of the batch proceed independently: a group whose segment must grow
    first does not hold back the writes of the others. Runs as a tier task
    (shielded from the caller); never raises for I/O errors.
    """
    results: list[BaseException | None] = [None] * len(jobs)
    await reclaim(tier)
    protect = {j.key for j in jobs}  # never evicted for this batch
    groups = reserve_rows(tier, jobs, protect, results)
    t0 = time.perf_counter()
    # The rows of other groups evicted for this batch are blanked BEFORE its rows
    # are written into their room: valid rows on disk then never exceed
    # capacity_bytes, even in a crash. Otherwise a restart, finding the evicted
    # key's row and the new one, would keep the highest sequence numbers and drop
    # the oldest written key, maybe one that a flush covered and reads kept
    # recent. Another batch's reclaim may hold some of these rows: wait for it.
    await settle_evictions(tier)
    written = await asyncio.gather(
        *(_write_group(tier, group, protect, results) for group in groups)
    )
    tier._counts["write_seconds"] += time.perf_counter() - t0
    # Keys are published in the batch's order (the order they were stored in),
    # not group by group: the LRU then interleaves groups as the stores did, so
    # that a full tier finds a key of the writer's group among its oldest
    # (RowIndex.reserve's eviction window) instead of a run of one group.
    written_rows: list[tuple[WriteJob, tuple[int, int]]] = []
    holes: list[RowRef] = []  # rows of failed writes that ran out of space: punched
    for run, n, exc, failed_syncs in (outcome for group in written for outcome in group):
        tier._counts["write_requests"] += 1
        row = tier._row_nbytes[run[0].ref.group_id]
        segment = (run[0].ref.group_id, run[0].ref.segment)
        if n > 0:
            tier._dirty.add(segment)
            tier._write_epoch += 1
        # A row written while an fdatasync of its segment failed may have been
        # covered (and lost) by it: it is failed, never published.
        count, failure = tier._sync_failures.get(segment, (0, None))
        if exc is None and failure is not None and count != failed_syncs:
            exc = StorageError(
                failure.kind,
                f"an fdatasync of its segment failed during the write: {failure}",
                failure.errno,
            )
            exc.__cause__ = failure
        for k, job in enumerate(run):
            if exc is None and n >= (k + 1) * row:
                written_rows.append((job, segment))
                tier._counts["write_bytes"] += row
                continue
            err = (
                as_storage_error(exc, f"write of {job.key} failed")
                if exc is not None
                else StorageError("short_write", f"short write of {job.key}: {n} bytes")
            )
            # A row that ran out of space may be a hole the index did not know of (punched
            # in an earlier session, on a filesystem that does not answer FIEMAP): punch it,
            # so that its blocks are allocated before it is handed out again.
            hole = tier._can_punch and err.kind in ("enospc", "short_write")
            tier._index.fail_write(job.key, job.ref, job.seq, hole=hole)
            if hole:
                holes.append(job.ref)
            fail(tier, err.kind)
            results[job.pos] = err
    written_rows.sort(key=lambda item: item[0].pos)
    for job, segment in written_rows:
        if tier._index.finish_write(job.key, job.ref, job.seq, job.start, job.stop):
            tier._unsynced.setdefault(segment, {})[job.ref.row] = job.key
    if holes:
        await _blank(tier, holes, punch=True)
    if tier._index.over_budget and tier._can_punch:
        # A growth past the disk budget may have left the tier past it (the write took
        # a row the growth's reclaim had punched): punch free rows back within it.
        await reclaim(tier)
    # A failed write into a row evicted for it (its own group's, handed over
    # unblanked) left the evicted key's trailer in place: blank it before the
    # batch returns, as every other evicted row is, so that it cannot come back
    # after a crash (a discard during the batch leaves a stale row too).
    await settle_evictions(tier)
    return results


async def settle_evictions(tier: TierState) -> None:
    """Return once every row evicted so far is blank (or was reused in place).

    Blanks the index's stale rows, then waits for every reclaim whose I/O is in
    flight: another batch's reclaim may have taken rows this one evicted.
    Never raises.
    """
    if tier._index.stale_rows:
        await reclaim(tier)
    if tier._blanking:
        await asyncio.wait(set(tier._blanking))


def reserve_rows(
    tier: TierState,
    jobs: list[WriteJob],
    protect: Container[OffloadKey],
    results: list[BaseException | None],
) -> list[list[WriteJob]]:
    """Reserve capacity for every job, and a row where one is at hand (no I/O).

    Capacity first (:meth:`RowIndex.reserve`, evicting LRU keys of any group,
    never one of ``protect``, the keys of the batch), then the row: an
    evicted row of the group, else its lowest free row that holds its
    blocks, so the rows of one group follow each other in the batch's
    order. A job that finds no such row keeps ``job.ref`` unset:
    :func:`_take_row` fills a punched row or grows the segments first. When
    its group has no row at hand and room needs keys of other groups only,
    it reserves after that growth (``job.reserved`` False; on a full
    filesystem it then takes its own group's key alone). A job without room
    gets a :class:`StorageError` of kind ``capacity`` in ``results``
    (nothing was evicted for it).

    Returns:
        The jobs by group, each list in the batch's order.

    """
    index = tier._index
    groups: dict[int, list[WriteJob]] = {}
    short: set[int] = set()  # groups whose free rows ran out
    for job in jobs:
        group_id = job.key.group_id
        at_hand = group_id not in short and index.has_row(group_id)
        ok, ref = index.reserve(group_id, protect, evict_others=at_hand)
        if ref is DEFERRED:
            job.reserved = False  # room after growth (the rows of other groups do not help)
            short.add(group_id)
            groups.setdefault(group_id, []).append(job)
            continue
        if not ok:
            err = _no_room(tier, group_id)
            results[job.pos] = err
            fail(tier, err.kind)
            index.abandon_write(job.key, job.seq)
            continue
        if ref is None and at_hand:
            ref = index.take_free(group_id, holes=False)
        if ref is None:
            short.add(group_id)
        else:
            job.ref = ref
        groups.setdefault(group_id, []).append(job)
    return list(groups.values())


def _no_room(tier: TierState, group_id: int) -> StorageError:
    index = tier._index
    return StorageError(
        "capacity",
        f"no room for a {index.row_nbytes(group_id)}-byte row of group {group_id}: "
        f"{index.bytes_used} of capacity_bytes={index.capacity_bytes} are held by "
        "rows in flight, pinned or of the same write_rows call",
    )


async def _write_group(
    tier: TierState,
    jobs: list[WriteJob],
    protect: Container[OffloadKey],
    results: list[BaseException | None],
) -> list[tuple[list[WriteJob], int, BaseException | None, int]]:
    """Give rows to the jobs of one group that lack one, then write its runs.

    ``protect``: the keys of the whole batch (never evicted for it).

    A job whose growth failed, or that found no room after it, gets the
    error in ``results``.

    Returns:
        ``(run, bytes written, exception or None, failed syncs of its segment
        when the write was submitted)`` per run written.

    """
    placed: list[WriteJob] = []
    late = False  # a job reserved here (maybe evicting keys of other groups)
    for job in jobs:
        if job.ref is NO_ROW:
            late = late or not job.reserved
            ref = await _take_row(tier, job, protect)
            if isinstance(ref, StorageError):
                results[job.pos] = ref
                fail(tier, ref.kind)
                tier._index.abandon_write(job.key, job.seq)
                continue
            job.ref = ref
        placed.append(job)
    if late:  # as write_batch does for the others: evicted rows are blank before ours land
        await settle_evictions(tier)
    if jobs:
        grow_ahead(tier, jobs[0].key.group_id)
    runs = make_runs(tier, placed, lambda j: j.ref)
    outcomes = await asyncio.gather(*(_write_run(tier, run) for run in runs))
    return [(run, *outcome) for run, outcome in zip(runs, outcomes, strict=True)]


async def _write_run(tier: TierState, run: list[WriteJob]) -> tuple[int, BaseException | None, int]:
    """Seal a run on the checksum workers, then write it (I/O workers, or the AIO context).

    Returns:
        ``(bytes written, exception or None, failed syncs of the segment
        when the write was submitted)``.
    """
    ref = run[0].ref
    segment = (ref.group_id, ref.segment)
    spec = tier._specs[ref.group_id]
    exc = await tier._run_checksum(_files.seal_run, spec, run)
    failed_syncs = tier._sync_failures.get(segment, (0, None))[0]
    if exc is not None:
        return 0, exc, failed_syncs
    handle = tier._segments[segment]
    if tier._aio is not None:  # queued in the kernel: no worker thread, no GIL to wait for
        try:
            fut = tier._aio.submit_pwritev(handle, [j.buf for j in run], spec.row_offset(ref.row))
            return await _request_done(fut), None, failed_syncs
        except Exception as err:
            return 0, err, failed_syncs
    n, exc, _ = await tier._run(_files.write_run, tier._row_io, handle, spec, run)
    return n, exc, failed_syncs


async def _request_done(fut: concurrent.futures.Future[int]) -> int:
    """Await a queued request; if cancelled, return only once the kernel is done with it.

    The request's buffers are slots: a task that gave up while the kernel
    still reads or writes them would let the slot be reused under the I/O.
    """
    waiter = asyncio.wrap_future(fut)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        await asyncio.wait([waiter])
        raise


_FREE_STEPS = 4
"""A group grows by a whole step (ahead of need, or on demand) only while the
filesystem has this many of its steps free; on demand it grows by one row
otherwise, so that on a small filesystem one group's step cannot take the
room of every other group's rows (a group with no row and no key to take
could not store anything)."""


@contextlib.asynccontextmanager
async def _claim_growth(tier: TierState, group_id: int) -> AsyncIterator[int | None]:
    """Size a growth of a group against the filesystem's free space, and claim that space.

    A whole step while the free space (``shutil.disk_usage``), less what
    other growths sized and not yet done claimed, holds ``_FREE_STEPS``
    steps of the group; else one row. Growths are sized one at a time (a
    tier lock), so groups that grow together do not all see the same free
    space. The claim is given back when the ``async with`` block ends (the
    growth ended).

    Yields:
        ``max_rows`` for the growth: None for a whole step, or 1.
    """
    index = tier._index
    step = index.grow_step_nbytes(group_id)
    async with tier._growth_lock:
        try:
            free: int | None = (await tier._run_meta(shutil.disk_usage, tier.directory)).free
        except OSError:
            free = None  # not known: the growth itself will tell
        whole = free is None or free - tier._growth_claims >= _FREE_STEPS * step
        claim = step if whole else index.row_nbytes(group_id)
        tier._growth_claims += claim
    try:
        yield None if whole else 1
    finally:
        tier._growth_claims -= claim


def grow_ahead(tier: TierState, group_id: int) -> None:
    """Start growing a group's segments in the background if it runs low on free rows.

    Writes then rarely wait for a ``fallocate`` or a new segment file. A failed
    growth is only logged (no key fails): the group then grows on demand
    only, so the next write that needs a row reports the error for its key,
    until an on-demand growth succeeds.
    """
    if not tier._grow_ahead or group_id in tier._ahead_paused:
        return
    lock = tier._segment_locks.setdefault(group_id, asyncio.Lock())
    if not lock.locked() and tier._index.wants_growth(group_id):
        tier._spawn(_grow_ahead(tier, group_id, lock))


async def _grow_ahead(tier: TierState, group_id: int, lock: asyncio.Lock) -> None:
    async with lock:
        if not tier._index.wants_growth(group_id):
            return
        async with _claim_growth(tier, group_id) as one:
            if one is not None:
                # A step ahead of need would take the room another group's next row needs.
                exc: Exception | None = OSError(
                    errno.ENOSPC, f"under {_FREE_STEPS} growth steps free on the filesystem"
                )
            else:
                exc, _ = await _grow_step(tier, group_id)
        if exc is not None:
            tier._ahead_paused.add(group_id)
            first = group_id not in tier._ahead_failed
            tier._ahead_failed.add(group_id)
            log.log(
                logging.INFO if first else logging.DEBUG,
                "growing group %d ahead of need failed (it grows on demand only until an "
                "on-demand growth succeeds): %s",
                group_id,
                exc,
            )


async def _grow_step(
    tier: TierState, group_id: int, max_rows: int | None = None
) -> tuple[Exception | None, int]:
    """Grow a group by one planned step (caller holds its segment lock).

    Returns:
        ``(the error or None, the rows the step planned)``.
    """
    index = tier._index
    plan = index.plan_growth(group_id, max_rows)
    in_flight = asyncio.get_running_loop().create_future()
    tier._growing[group_id] = in_flight  # a group that finds the disk full waits for it
    try:
        if index.over_budget:  # first punch free rows the workload left (never raises)
            await reclaim(tier)
        await grow(tier, plan)
    except Exception as exc:
        index.abandon_growth(plan)
        return exc, plan.stop - plan.start
    finally:
        del tier._growing[group_id]
        in_flight.set_result(None)
    index.commit_growth(plan)
    tier._ahead_paused.discard(group_id)  # grew: growth ahead may run again
    tier._punch_frees, tier._punch_misses = True, 0  # room again: punching may help again
    return None, plan.stop - plan.start


async def _take_row(
    tier: TierState, job: WriteJob, protect: Container[OffloadKey]
) -> RowRef | StorageError:
    """Take a free row for a job, growing the group's segments when it has none.

    A free row that holds its disk blocks first; else a punched free row,
    whose blocks are allocated first (:func:`~kvtier.io._files.fill_row`);
    else a growth step (one row while the filesystem has fewer than
    ``_FREE_STEPS`` steps free). A job without a reservation (``job.reserved``
    False) reserves once a row is at hand (:meth:`RowIndex.reserve`, which
    may evict keys of any group or hand over its own group's key's row).
    When the allocation or growth step fails because the filesystem is full
    (ENOSPC, EDQUOT), one row is tried (a step); when that fails too,
    :func:`_on_full_disk` waits for other groups' growths in flight and tries
    again, or takes the row of the group's least recently used evictable key
    not in ``protect`` (the keys of its batch) (:meth:`RowIndex.evict_own`): a
    tier whose disk holds less than ``capacity_bytes`` keeps storing new
    keys, as an LRU cache within the space it got, and tries to grow again
    at its next need. A group with no such key punches rows of other groups
    (their free rows, then their least recently used keys) and grows again.
    On another failed growth, or with nothing to take, the reservation (if
    any) is given back and the error returned.
    """
    index = tier._index
    group_id = job.key.group_id
    lock = tier._segment_locks.setdefault(group_id, asyncio.Lock())
    tried: set[str] = set()  # what _on_full_disk did for this row (each once)
    while True:
        if not job.reserved and index.has_row(group_id):
            ok, own = index.reserve(group_id, protect)
            if not ok:
                return _no_room(tier, group_id)
            job.reserved = True
            if own is not None:
                return own
        if job.reserved and (ref := index.take_free(group_id, holes=False)) is not None:
            return ref
        async with lock:
            if index.has_row(group_id):
                continue
            # Once the filesystem was full, allocations wait for a row that punches rows
            # of other groups for room (_punch_for_row), which would lose them otherwise.
            serial = tier._punch_lock if tier._disk_was_full else contextlib.nullcontext()
            async with serial:
                got = await _allocate(tier, job)
            if isinstance(got, RowRef):
                return got
            if got is None:
                continue
            exc = got
            if storage_error_kind(exc) == "enospc":  # or EDQUOT
                if not tier._disk_was_full:
                    tier._disk_was_full = True
                    log.warning(
                        "kvtier: the filesystem of %s is full below capacity_bytes (%s): "
                        "new rows now reuse the rows of their group's least recently "
                        "used keys (counted as disk_full_evictions)",
                        tier.directory,
                        exc,
                    )
                errors: list[Exception] = []
                ref = await _on_full_disk(tier, job, protect, tried, errors)
                if ref is not None:
                    if ref is _RETRY:
                        continue
                    return ref
                if errors:  # a growth after a punch failed otherwise: that error, not ENOSPC
                    exc = errors[-1]
            if job.reserved:
                index.unreserve(group_id)
            return as_storage_error(exc, f"cannot grow the segments of group {group_id}")


async def _allocate(tier: TierState, job: WriteJob) -> RowRef | Exception | None:
    """Allocate disk blocks for a row of ``job``'s group (the caller holds its segment lock).

    A punched free row gets its blocks (:func:`_fill_hole`); else the group
    grows by a step (one row while the filesystem has fewer than
    ``_FREE_STEPS`` steps free), or by one row where the step did not fit.

    Returns:
        The filled row, for a job with a reservation; None: a row is at hand
        now (take it); or the error (the row given back, punched).
    """
    index = tier._index
    group_id = job.key.group_id
    if index.free_rows(group_id):  # punched rows only
        hole = index.take_free(group_id)
        assert hole is not None
        exc = await _fill_hole(tier, hole)
        if exc is not None:
            return exc
        if job.reserved:
            return hole
        index.reclaimed([hole])  # a free row with blocks: reserve, then take it
        return None
    async with _claim_growth(tier, group_id) as one:
        exc, rows = await _grow_step(tier, group_id, max_rows=one)
    if exc is not None and rows > 1 and storage_error_kind(exc) == "enospc":
        exc, _ = await _grow_step(tier, group_id, max_rows=1)  # a step did not fit: a row may
    return exc


_RETRY = RowRef(-3, -3, -3)
_PUNCH_MISSES = 2
"""Rows in a row whose growth failed after keys of other groups were punched for them,
after which the tier stops evicting keys for disk space until an allocation succeeds
(:func:`_punch_for_row`): the filesystem does not give punched blocks back (one with
snapshots), or another tenant takes them first."""
_SLACK = 4096
"""Bytes punched beyond a row's own (:func:`_punch_for_row`)."""
_ROW_ROUNDS = 4
"""Rounds of other groups' free rows a row may punch before keys are evicted for it
(:func:`_punch_for_row`): a free row may hold fewer blocks than the index counts."""
_KEY_ROUNDS = 2
"""Rounds of other groups' keys a row may punch (:func:`_punch_for_row`): a growth tried
before the lock was taken (growth ahead, say) may take what the first round freed."""


async def _on_full_disk(
    tier: TierState,
    job: WriteJob,
    protect: Container[OffloadKey],
    tried: set[str],
    errors: list[Exception],
) -> RowRef | None:
    """A row of ``job``'s group cannot grow: the filesystem is full (ENOSPC, EDQUOT).

    In this order, each at most once per row (``tried`` records what was done):

    1. growths of other groups in flight are waited for, and the growth
       tried again: a failing ``fallocate`` holds blocks until it gives up;
    2. the row of the group's least recently used evictable key not in
       ``protect`` (the keys of its batch) is taken (:meth:`RowIndex.evict_own`)
       and overwritten in place;
    3. a group with no such key (it started writing after the others filled
       the filesystem, or every key of it is being read or written by the
       batch) takes disk blocks of other groups for one row and grows
       (:func:`_punch_for_row`). Without it such a group failed every write
       for good, as the others' keys, below ``capacity_bytes``, were never
       evicted. Skipped where holes cannot be punched, and once punching
       keys gave no room ``_PUNCH_MISSES`` times in a row, until an
       allocation succeeds again.

    Args:
        tier: the tier.
        job: the write (its group's segment lock is held).
        protect: keys never evicted (those of the job's batch).
        tried: what was done for this row already (updated).
        errors: gets the error of a growth after a punch that failed
            otherwise than with ENOSPC or EDQUOT (the job fails with it).

    Returns:
        A row for the job (its group's key's, now the job's reservation),
        ``_RETRY`` (a row is at hand or grow again), or None (nothing to
        take: the job fails with the growth's error).
    """
    index = tier._index
    group_id = job.key.group_id
    others = [f for g, f in tier._growing.items() if g != group_id]
    if others and "wait" not in tried:
        tried.add("wait")
        await asyncio.wait(others)
        return _RETRY
    if (ref := index.evict_own(group_id, protect, job.reserved)) is not None:
        job.reserved = True
        return ref
    if "punch" in tried or not (tier._can_punch and tier._punch_frees):
        return None
    tried.add("punch")
    async with tier._punch_lock:  # the blocks punched for a row are that row's
        return _RETRY if await _punch_for_row(tier, group_id, protect, errors) else None


async def _punch_for_row(
    tier: TierState, group_id: int, protect: Container[OffloadKey], errors: list[Exception]
) -> bool:
    """Punch rows of other groups until one row of ``group_id`` fits, and grow it by that row.

    The caller holds the group's segment lock and ``tier._punch_lock`` (so
    that rows of two such groups do not take each other's punched blocks).
    First free rows of other groups, enough bytes for one row (and a segment
    header where the group starts a file, :meth:`RowIndex.growth_nbytes`),
    for up to ``_ROW_ROUNDS`` rounds while the growth still fails (a free
    row may lack blocks the index counts, punched by a failed earlier
    punch or outside the tier); then the least
    recently used evictable keys of other groups not in ``protect``, a page
    more (:meth:`RowIndex.take_for_disk`), for up to ``_KEY_ROUNDS`` rounds.
    After ``_PUNCH_MISSES`` rows in a row whose growth failed after every
    key round (a filesystem that keeps punched blocks, or another tenant
    took them), the tier stops punching for disk space
    (``tier._punch_frees``) until a growth or a punched row's allocation
    succeeds (:func:`_grow_step`, :func:`_fill_hole`).

    Args:
        tier: the tier.
        group_id: the writer's group.
        protect: keys never evicted (those of the writer's batch).
        errors: gets the error of a growth that failed otherwise than with
            ENOSPC or EDQUOT (the rounds stop there).

    Returns:
        Whether the group grew by a row.
    """
    index = tier._index
    need = index.growth_nbytes(group_id)
    skip: set[RowRef] = set()
    for _ in range(_ROW_ROUNDS):
        refs = index.take_for_disk(group_id, need, protect, keys=False, skip=skip)
        if not refs:
            break
        skip.update(refs)
        await _blank(tier, refs, punch=True)
        if (grew := await _grow_row(tier, group_id, errors)) is not None:
            return grew
    for _ in range(_KEY_ROUNDS):
        # a page more than the row: a growth may need a block for the file's extent tree
        refs = index.take_for_disk(group_id, need + _SLACK, protect, keys=True)
        if not refs:
            return False
        await _blank(tier, refs, punch=True)
        if (grew := await _grow_row(tier, group_id, errors)) is not None:
            return grew
    _punch_missed(tier)
    return False


def _punch_missed(tier: TierState) -> None:
    """Count a row whose growth failed after its key punch; stop after ``_PUNCH_MISSES``."""
    tier._punch_misses += 1
    if tier._punch_misses >= _PUNCH_MISSES and tier._punch_frees:
        tier._punch_frees = False
        log.info(
            "kvtier: punching rows of other groups gave %s no room, %d times in a row: keys "
            "are no longer evicted for disk space until an allocation succeeds",
            tier.directory,
            _PUNCH_MISSES,
        )


async def _grow_row(tier: TierState, group_id: int, errors: list[Exception]) -> bool | None:
    """Grow a group by one row after a punch (the caller holds its segment lock).

    Returns:
        True: it grew. None: the filesystem is still full (punching more may
        help). False: punching more would not help: holes cannot be punched
        here, or the growth failed otherwise than with ENOSPC or EDQUOT (its
        error is appended to ``errors``).
    """
    async with _claim_growth(tier, group_id):
        exc, _ = await _grow_step(tier, group_id, max_rows=1)
    if exc is None:
        return True
    if storage_error_kind(exc) != "enospc":
        errors.append(exc)
        return False
    return None if tier._can_punch else False


async def _fill_hole(tier: TierState, ref: RowRef) -> Exception | None:
    """Allocate a punched free row's blocks; on failure give it back, punched.

    Returns:
        The error, or None (the row is the caller's and holds its blocks).
    """
    try:
        await tier._run_meta(
            _files.fill_row,
            tier._segments[(ref.group_id, ref.segment)],
            tier._specs[ref.group_id],
            ref.row,
        )
    except Exception as exc:
        tier._index.reclaimed([ref], punched=True)
        return exc
    tier._punch_frees, tier._punch_misses = True, 0  # room again: punching may help again
    return None


async def grow(tier: TierState, plan: Growth) -> None:
    """Create or extend the segment file of a :class:`Growth` plan.

    Raises:
        OSError, StorageError: the file could not be created or extended.

    """
    spec = tier._specs[plan.group_id]
    if not plan.new:
        handle = tier._segments[(plan.group_id, plan.segment)]
        await tier._run_meta(
            _files.grow_segment,
            tier._row_io,
            handle,
            spec.row_offset(plan.stop),
            spec.row_offset(plan.start),
        )
        return
    header = encode_header(
        SegmentHeader(
            tier.digest,
            plan.group_id,
            spec.row_nbytes,
            plan.num_rows,
            _files.group_layout_json(tier._layout, plan.group_id),
        )
    )
    tier._segments[(plan.group_id, plan.segment)] = await tier._run_meta(
        _files.create_segment,
        tier._row_io,
        tier.directory / f"g{plan.group_id}",
        plan.segment,
        header,
        spec.row_offset(plan.stop),
    )


async def reclaim(tier: TierState) -> None:
    """Blank the index's stale rows, then free them.

    Within the disk budget a row's 4 KiB trailer is zeroed and the row keeps
    its disk blocks (its next write is an overwrite of written blocks). Past
    it, the stale rows and then free rows of the groups with the most free
    bytes are deallocated with a punched hole until the blocks are back
    within the budget; where that is not supported (the first try falls back
    to zeroed trailers), free rows are left alone from then on.

    A failed blanking is logged and counted (``reclaim_failures``); the row
    is freed anyway (its next write overwrites the trailer; until then a
    restart may find its old key again, with intact bytes). A failed punch
    counts too, but its rows' trailers were zeroed instead (they are blank
    and count as holding blocks). Never raises.
    """
    index = tier._index
    refs = index.take_stale()
    # Where holes cannot be punched, free rows stay as they are: blanking them
    # again would not bring the blocks back within the budget.
    punch = index.over_budget and tier._can_punch
    if punch:
        index.mark_punched(refs)
        refs += index.take_to_punch(index.held_nbytes - index.disk_budget_nbytes)
    if refs:
        await _blank(tier, refs, punch)


async def _blank(tier: TierState, refs: list[RowRef], punch: bool) -> None:
    """Blank rows the index handed out (stale, or taken to punch) and give them back to it.

    See :func:`reclaim`; with ``punch``, the rows' blocks are deallocated
    (``refs`` are counted as punched already: :meth:`RowIndex.mark_punched`).
    Never raises.
    """
    index = tier._index
    by_segment: dict[tuple[int, int], list[int]] = {}
    for ref in refs:
        by_segment.setdefault((ref.group_id, ref.segment), []).append(ref.row)
    in_flight = asyncio.get_running_loop().create_future()
    tier._blanking.add(in_flight)  # settle_evictions waits for it
    try:
        outcomes = await asyncio.gather(
            *(
                tier._run_meta(
                    _files.blank_rows,
                    tier._row_io,
                    tier._segments[seg],
                    tier._specs[seg[0]],
                    rows,
                    punch,
                )
                for seg, rows in by_segment.items()
            ),
            return_exceptions=True,
        )
    finally:
        tier._blanking.discard(in_flight)
        in_flight.set_result(None)
    for (g, seg), outcome in zip(by_segment, outcomes, strict=True):
        tier._dirty.add((g, seg))
        tier._write_epoch += 1
        if isinstance(outcome, BaseException):
            log.warning("blanking rows of segment g%d/%d failed: %s", g, seg, outcome)
            tier._counts["reclaim_failures"] += 1
        rows = [RowRef(g, seg, row) for row in by_segment[(g, seg)]]
        index.reclaimed(rows, punched=outcome is True)  # a failed punch: blocks counted
        if punch and outcome is False:  # unsupported: the trailers were zeroed instead
            tier._can_punch = False


async def read_batch(
    tier: TierState, jobs: list[ReadJob], results: list[tuple[int, int] | BaseException]
) -> None:
    """Read pinned rows in coalesced runs, verify and unpin them; fill ``results``.

    A failed request of several rows is retried row by row (:func:`_read_run`);
    a key whose own row failed is dropped from the index and counted by kind.
    """
    runs = make_runs(tier, jobs, lambda j: j.entry.ref)
    t0 = time.perf_counter()
    try:
        outcomes = await asyncio.gather(*(_read_run(tier, run) for run in runs))
    finally:
        for job in jobs:
            tier._index.unpin(job.entry.ref)
    tier._counts["read_seconds"] += time.perf_counter() - t0
    tier._counts["read_requests"] += len(runs)
    read: list[ReadJob] = []
    for run, errors in zip(runs, outcomes, strict=True):
        for job, err in zip(run, errors, strict=True):
            if err is None:
                read.append(job)
                tier._counts["read_bytes"] += job.buf.nbytes
                results[job.pos] = (job.entry.start, job.entry.stop)
            else:
                tier._index.drop(job.key, job.entry.ref)
                fail(tier, err.kind)
                results[job.pos] = err
    # Recency: the call's first key ends most recently used (runs are in row order).
    for job in sorted(read, key=lambda j: j.pos, reverse=True):
        tier._index.touch(job.key)


async def _read_run(tier: TierState, run: list[ReadJob]) -> list[StorageError | None]:
    """Read a run with one request, then verify it on the checksum workers.

    When a request of several rows fails (an error such as EIO, or a short
    read), each row it did not read in full is read again alone, once, before
    anything fails: only a row whose own read fails, or whose trailer or
    checksum does not verify, gets an error. Each retry counts as a read request.
    """
    ref = run[0].entry.ref
    spec = tier._specs[ref.group_id]
    nbytes = await _read_request(tier, run)
    errors = await tier._run_checksum(_files.verify_run, spec, run, nbytes)
    if len(run) == 1:
        return errors
    unread = [
        i
        for i in range(len(run))
        if isinstance(nbytes, StorageError) or nbytes < (i + 1) * spec.row_nbytes
    ]
    if not unread:
        return errors
    tier._counts["read_requests"] += len(unread)
    alone = await asyncio.gather(*(_read_request(tier, [run[i]]) for i in unread))
    for i, n in zip(unread, alone, strict=True):
        (errors[i],) = await tier._run_checksum(_files.verify_run, spec, [run[i]], n)
    return errors


async def _read_request(tier: TierState, run: list[ReadJob]) -> int | StorageError:
    """Read consecutive rows with one request (I/O workers, or the AIO context).

    Returns:
        The bytes read, or the :class:`StorageError` of the failed request;
        never raises.
    """
    ref = run[0].entry.ref
    spec = tier._specs[ref.group_id]
    handle = tier._segments[(ref.group_id, ref.segment)]
    if tier._aio is not None:
        try:
            fut = tier._aio.submit_preadv(handle, [j.buf for j in run], spec.row_offset(ref.row))
            return await _request_done(fut)
        except Exception as err:
            return _files.read_failure(err)
    nbytes, _ = await tier._run(_files.read_run, tier._row_io, handle, spec, run)
    return nbytes


async def scan(tier: TierState) -> None:
    """Open every segment of the tier's groups and rebuild the index from the trailers.

    Unusable segments (bad header) are skipped, logged and counted; their
    numbers are never reused. Rows whose trailer could not be read are free.
    When anything could not be read or was invalid the sequence numbers jump
    (:meth:`RowIndex.rebuild`'s ``blind``), so that a row a later open reads
    again never outranks a write of this session.
    """
    assert tier._row_io is not None
    found: dict[tuple[int, int], tuple[int, int]] = {}
    rows: list[tuple[RowRef, OffloadKey, int, int, int]] = []
    holes: list[RowRef] = []
    unsure: dict[tuple[int, int], list[int]] = {}  # holes found by lseek: rows by segment
    blind = False  # some trailer (or a whole segment) could not be read, or was invalid
    for g, spec in tier._specs.items():
        group_dir = tier.directory / f"g{g}"
        numbers = await tier._run(_files.list_segments, group_dir)

        def keep(i: int, scan: _files.ScanResult, g: int = g, numbers: list[int] = numbers) -> None:
            if scan.handle is not None:  # recorded at once: a failed open closes it
                tier._segments[(g, numbers[i])] = scan.handle

        scans = await tier._run_kept(
            _files.scan_segment,
            [(tier._row_io, group_dir / f"{n}{_files.SEGMENT_SUFFIX}", spec, n) for n in numbers],
            keep,
        )
        for n, scan in zip(numbers, scans, strict=True):
            if scan.handle is None:
                log.warning("ignoring unusable segment %s/%d: %s", group_dir, n, scan.error)
                tier._counts["invalid_segments_at_open"] += 1
                tier._index.skip_segment(g, n)
                blind = True
                continue
            found[(g, n)] = (scan.num_rows, scan.allocated_rows)
            rows.extend(scan.rows)
            holes.extend(RowRef(g, n, i) for i in scan.holes)
            if scan.holes_unsure and scan.holes:
                unsure[(g, n)] = scan.holes
            # any invalid row may be a misread one whose trailer is intact on disk
            blind = blind or scan.invalid_rows > 0
            tier._counts["invalid_rows_at_open"] += scan.invalid_rows
    tier._index.rebuild(found, rows, blind=blind, holes=holes)
    await _punch_unsure(tier, unsure)


async def _punch_unsure(tier: TierState, unsure: dict[tuple[int, int], list[int]]) -> None:
    """Punch the free rows an open found without data by ``lseek`` (no ``FIEMAP``: tmpfs).

    ``lseek(SEEK_DATA)`` reports ranges allocated but never written as holes
    too, so some of these rows may still hold their blocks while the index
    counts them as punched (``held_nbytes`` would leave them out, and the
    disk budget would not hold). Punching them makes that count exact; they
    are free, so nothing is lost (a row of a key is never among them). A
    failed punch is logged and counted (``reclaim_failures``). Never raises.
    """
    index = tier._index
    for (g, n), rows in unsure.items():
        free = [i for i in rows if index.punched(RowRef(g, n, i))]
        if not free or not tier._can_punch:
            continue
        try:
            punched = await tier._run_meta(
                _files.blank_rows, tier._row_io, tier._segments[(g, n)], tier._specs[g], free
            )
        except Exception as exc:
            log.warning("punching free rows of segment g%d/%d at open failed: %s", g, n, exc)
            tier._counts["reclaim_failures"] += 1
            continue
        if not punched:
            tier._can_punch = False  # their trailers were zeroed: blank, blocks unknown
