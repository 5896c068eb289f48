"""Growing a group's segment files, on demand or ahead of need, sized by the free space.

Owns the growths' claims on the filesystem's free space
(``tier._growth_lock``, ``tier._growth_claims``) and the state of growth
ahead of need (``tier._ahead_paused``, ``tier._ahead_failed``); records each
growth in flight (``tier._growing``, which a full filesystem waits for). A
growth past the disk budget reclaims first
(:func:`~kvtier.io._blanking.reclaim`); one that succeeds lets punching for
disk space resume (:mod:`~kvtier.io._disk_space`). These functions take the
tier as a :class:`~kvtier.io._tier_state.GrowthState`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvtier.errors import storage_error_kind
from kvtier.io import _files
from kvtier.io._blanking import reclaim
from kvtier.io._format import SegmentHeader, encode_header
from kvtier.io._index import Growth

log = logging.getLogger("kvtier.io")

if TYPE_CHECKING:
    from kvtier.io._tier_state import GrowthState


_FREE_STEPS = 4
"""A group grows by a whole step (ahead of need, or on demand) only while the
filesystem has this many of its steps free; on demand it grows by one row
otherwise, so that on a small filesystem one group's step cannot take the
room of every other group's rows (a group with no row and no key to take
could not store anything)."""


@contextlib.asynccontextmanager
async def claim_growth(tier: GrowthState, group_id: int) -> AsyncIterator[int | None]:
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


def grow_ahead(tier: GrowthState, group_id: int) -> None:
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


async def _grow_ahead(tier: GrowthState, group_id: int, lock: asyncio.Lock) -> None:
    async with lock:
        if not tier._index.wants_growth(group_id):
            return
        async with claim_growth(tier, group_id) as one:
            if one is not None:
                # A step ahead of need would take the room another group's next row needs.
                exc: Exception | None = OSError(
                    errno.ENOSPC, f"under {_FREE_STEPS} growth steps free on the filesystem"
                )
            else:
                exc, _ = await grow_step(tier, group_id)
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


async def grow_step(
    tier: GrowthState, group_id: int, max_rows: int | None = None
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


async def grow_row(tier: GrowthState, group_id: int, errors: list[Exception]) -> bool | None:
    """Grow a group by one row after a punch (the caller holds its segment lock).

    Returns:
        True: it grew. None: the filesystem is still full (punching more may
        help). False: punching more would not help: holes cannot be punched
        here, or the growth failed otherwise than with ENOSPC or EDQUOT (its
        error is appended to ``errors``).
    """
    async with claim_growth(tier, group_id):
        exc, _ = await grow_step(tier, group_id, max_rows=1)
    if exc is None:
        return True
    if storage_error_kind(exc) != "enospc":
        errors.append(exc)
        return False
    return None if tier._can_punch else False


async def grow(tier: GrowthState, plan: Growth) -> None:
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
