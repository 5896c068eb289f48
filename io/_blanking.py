"""Blanking the rows the index gave back: reclaim, punching within the disk budget.

Owns the blankings in flight (``tier._blanking``, what
:func:`settle_evictions` waits for). A stale or evicted row's 4 KiB trailer
is zeroed and the row keeps its blocks, or, past the disk budget, its blocks
are punched (``tier._can_punch`` is cleared where that is not supported);
an open punches the free rows it could not tell apart from holes. These
functions run on the event loop thread and hand the file work to the tier's
metadata worker; they take the tier as a
:class:`~kvtier.io._tier_state.BlankingState`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvtier.io import _files
from kvtier.io._index import RowRef

log = logging.getLogger("kvtier.io")

if TYPE_CHECKING:
    from kvtier.io._tier_state import BlankingState


async def reclaim(tier: BlankingState) -> None:
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
        await blank(tier, refs, punch)


async def blank(tier: BlankingState, refs: list[RowRef], punch: bool) -> None:
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


async def settle_evictions(tier: BlankingState) -> None:
    """Return once every row evicted so far is blank (or was reused in place).

    Blanks the index's stale rows, then waits for every reclaim whose I/O is in
    flight: another batch's reclaim may have taken rows this one evicted.
    Never raises.
    """
    if tier._index.stale_rows:
        await reclaim(tier)
    if tier._blanking:
        await asyncio.wait(set(tier._blanking))


async def punch_unsure(tier: BlankingState, unsure: dict[tuple[int, int], list[int]]) -> None:
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
