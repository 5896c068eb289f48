"""Write batches: capacity and rows for each job, coalesced writes, each row published or freed.

Owns whether the filesystem was seen full below ``capacity_bytes``
(``tier._disk_was_full``: from then on allocations wait for the punch
lock). Rows come from the index, from a growth (:mod:`~kvtier.io._growth`)
or, on a full filesystem, from :mod:`~kvtier.io._disk_space`; evicted rows
are blanked by :mod:`~kvtier.io._blanking` before the batch's rows land.
A written segment is recorded for the tier's syncs (``tier._dirty``,
``tier._unsynced``). These functions run on the event loop thread and
mutate the tier's :class:`~kvtier.io._index.RowIndex` synchronously; every
blocking step goes to the tier's workers. They take the tier as a
:class:`~kvtier.io._tier_state.WriteState`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Container
from typing import TYPE_CHECKING

from kvtier.errors import StorageError, storage_error_kind
from kvtier.io import _files
from kvtier.io._blanking import blank, reclaim, settle_evictions
from kvtier.io._disk_space import RETRY, fill_hole, on_full_disk
from kvtier.io._files import NO_ROW, WriteJob
from kvtier.io._growth import claim_growth, grow_ahead, grow_step
from kvtier.io._index import DEFERRED, RowRef
from kvtier.io._requests import as_storage_error, fail, make_runs, request_done
from kvtier.keys import OffloadKey

log = logging.getLogger("kvtier.io")

if TYPE_CHECKING:
    from kvtier.io._tier_state import WriteState


async def write_batch(tier: WriteState, jobs: list[WriteJob]) -> list[BaseException | None]:
    """Allocate rows, write them in coalesced runs, publish or free each row.

    Stale rows left by earlier calls are blanked first (so this batch can
    reuse them); rows of other groups evicted for this batch are blanked
    before its rows are written (see :func:`~kvtier.io._blanking.reclaim`:
    they keep their disk blocks within the budget), so that valid rows on
    disk never exceed ``capacity_bytes``, and it returns only once every row
    evicted so far is blank (:func:`~kvtier.io._blanking.settle_evictions`).
    The groups of the batch proceed independently: a group whose segment must grow
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
        await blank(tier, holes, punch=True)
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


def reserve_rows(
    tier: WriteState,
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


def _no_room(tier: WriteState, group_id: int) -> StorageError:
    index = tier._index
    return StorageError(
        "capacity",
        f"no room for a {index.row_nbytes(group_id)}-byte row of group {group_id}: "
        f"{index.bytes_used} of capacity_bytes={index.capacity_bytes} are held by "
        "rows in flight, pinned or of the same write_rows call",
    )


async def _write_group(
    tier: WriteState,
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


async def _write_run(
    tier: WriteState, run: list[WriteJob]
) -> tuple[int, BaseException | None, int]:
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
            return await request_done(fut), None, failed_syncs
        except Exception as err:
            return 0, err, failed_syncs
    n, exc, _ = await tier._run(_files.write_run, tier._row_io, handle, spec, run)
    return n, exc, failed_syncs


async def _take_row(
    tier: WriteState, job: WriteJob, protect: Container[OffloadKey]
) -> RowRef | StorageError:
    """Take a free row for a job, growing the group's segments when it has none.

    A free row that holds its disk blocks first; else a punched free row,
    whose blocks are allocated first (:func:`~kvtier.io._files.fill_row`);
    else a growth step (one row while the filesystem has fewer than
    ``_growth._FREE_STEPS`` steps free). A job without a reservation
    (``job.reserved`` False) reserves once a row is at hand
    (:meth:`RowIndex.reserve`, which may evict keys of any group or hand over
    its own group's key's row). When the allocation or growth step fails
    because the filesystem is full (ENOSPC, EDQUOT), one row is tried (a
    step); when that fails too, :func:`~kvtier.io._disk_space.on_full_disk`
    waits for other groups' growths in flight and tries again, or takes the
    row of the group's least recently used evictable key not in ``protect``
    (the keys of its batch) (:meth:`RowIndex.evict_own`): a tier whose disk
    holds less than ``capacity_bytes`` keeps storing new keys, as an LRU cache
    within the space it got, and tries to grow again at its next need. A group
    with no such key punches rows of other groups (their free rows, then their
    least recently used keys) and grows again. On another failed growth, or
    with nothing to take, the reservation (if any) is given back and the error
    returned.
    """
    index = tier._index
    group_id = job.key.group_id
    lock = tier._segment_locks.setdefault(group_id, asyncio.Lock())
    tried: set[str] = set()  # what on_full_disk did for this row (each once)
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
            # of other groups for room (_disk_space.on_full_disk), which would lose them otherwise.
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
                ref = await on_full_disk(tier, job, protect, tried, errors)
                if ref is not None:
                    if ref is RETRY:
                        continue
                    return ref
                if errors:  # a growth after a punch failed otherwise: that error, not ENOSPC
                    exc = errors[-1]
            if job.reserved:
                index.unreserve(group_id)
            return as_storage_error(exc, f"cannot grow the segments of group {group_id}")


async def _allocate(tier: WriteState, job: WriteJob) -> RowRef | Exception | None:
    """Allocate disk blocks for a row of ``job``'s group (the caller holds its segment lock).

    A punched free row gets its blocks (:func:`~kvtier.io._disk_space.fill_hole`);
    else the group grows by a step (one row while the filesystem has fewer
    than ``_growth._FREE_STEPS`` steps free), or by one row where the step
    did not fit.

    Returns:
        The filled row, for a job with a reservation; None: a row is at hand
        now (take it); or the error (the row given back, punched).
    """
    index = tier._index
    group_id = job.key.group_id
    if index.free_rows(group_id):  # punched rows only
        hole = index.take_free(group_id)
        assert hole is not None
        exc = await fill_hole(tier, hole)
        if exc is not None:
            return exc
        if job.reserved:
            return hole
        index.reclaimed([hole])  # a free row with blocks: reserve, then take it
        return None
    async with claim_growth(tier, group_id) as one:
        exc, rows = await grow_step(tier, group_id, max_rows=one)
    if exc is not None and rows > 1 and storage_error_kind(exc) == "enospc":
        exc, _ = await grow_step(tier, group_id, max_rows=1)  # a step did not fit: a row may
    return exc
