"""A full filesystem: a row for a group whose segments cannot grow, and punched rows.

When the filesystem is full below ``capacity_bytes`` (ENOSPC, EDQUOT), a
row waits for other groups' growths, takes its own group's least recently
used key, or punches rows of other groups for room and grows by that row
(one row at a time: ``tier._punch_lock``). Keeps the punch bookkeeping
(``tier._punch_frees``, ``tier._punch_misses``: punching for disk space
stops after rows it gave no room, until an allocation, here or a growth's,
succeeds), and fills the blocks of a punched free row before it is
written. These functions take the tier as a
:class:`~kvtier.io._tier_state.DiskSpaceState`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Container
from typing import TYPE_CHECKING

from kvtier.io import _files
from kvtier.io._blanking import blank
from kvtier.io._files import WriteJob
from kvtier.io._growth import grow_row
from kvtier.io._index import RowRef
from kvtier.keys import OffloadKey

log = logging.getLogger("kvtier.io")

if TYPE_CHECKING:
    from kvtier.io._tier_state import DiskSpaceState


RETRY = RowRef(-3, -3, -3)
"""What :func:`on_full_disk` returns when a row is at hand or the growth is to be tried again."""
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


async def on_full_disk(
    tier: DiskSpaceState,
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
        ``RETRY`` (a row is at hand or grow again), or None (nothing to
        take: the job fails with the growth's error).
    """
    index = tier._index
    group_id = job.key.group_id
    others = [f for g, f in tier._growing.items() if g != group_id]
    if others and "wait" not in tried:
        tried.add("wait")
        await asyncio.wait(others)
        return RETRY
    if (ref := index.evict_own(group_id, protect, job.reserved)) is not None:
        job.reserved = True
        return ref
    if "punch" in tried or not (tier._can_punch and tier._punch_frees):
        return None
    tried.add("punch")
    async with tier._punch_lock:  # the blocks punched for a row are that row's
        return RETRY if await _punch_for_row(tier, group_id, protect, errors) else None


async def _punch_for_row(
    tier: DiskSpaceState, group_id: int, protect: Container[OffloadKey], errors: list[Exception]
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
    succeeds (:func:`~kvtier.io._growth.grow_step`, :func:`fill_hole`).

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
        await blank(tier, refs, punch=True)
        if (grew := await grow_row(tier, group_id, errors)) is not None:
            return grew
    for _ in range(_KEY_ROUNDS):
        # a page more than the row: a growth may need a block for the file's extent tree
        refs = index.take_for_disk(group_id, need + _SLACK, protect, keys=True)
        if not refs:
            return False
        await blank(tier, refs, punch=True)
        if (grew := await grow_row(tier, group_id, errors)) is not None:
            return grew
    _punch_missed(tier)
    return False


def _punch_missed(tier: DiskSpaceState) -> None:
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


async def fill_hole(tier: DiskSpaceState, ref: RowRef) -> Exception | None:
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
