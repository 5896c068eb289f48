"""Reads of pinned rows in coalesced runs, retried row by row; the scan of an open.

A failed request of several rows is retried row by row, once; a key whose
own row fails is dropped and counted. The scan opens every segment and
rebuilds the tier's :class:`~kvtier.io._index.RowIndex` from the trailers.
No tier state is these functions' own: they use the index, the segments and
the counters; they take the tier as a
:class:`~kvtier.io._tier_state.ReadState`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from kvtier.errors import StorageError
from kvtier.io import _files
from kvtier.io._blanking import punch_unsure
from kvtier.io._files import ReadJob
from kvtier.io._index import RowRef
from kvtier.io._requests import fail, make_runs, request_done
from kvtier.keys import OffloadKey

log = logging.getLogger("kvtier.io")

if TYPE_CHECKING:
    from kvtier.io._tier_state import ReadState


async def read_batch(
    tier: ReadState, jobs: list[ReadJob], results: list[tuple[int, int] | BaseException]
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


async def _read_run(tier: ReadState, run: list[ReadJob]) -> list[StorageError | None]:
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


async def _read_request(tier: ReadState, run: list[ReadJob]) -> int | StorageError:
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
            return await request_done(fut)
        except Exception as err:
            return _files.read_failure(err)
    nbytes, _ = await tier._run(_files.read_run, tier._row_io, handle, spec, run)
    return nbytes


async def scan(tier: ReadState) -> None:
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
    await punch_unsure(tier, unsure)
