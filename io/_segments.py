"""The NVMe tier's segment table: which segment files each group has, and how they grow.

Pure and synchronous, like the rest of :class:`~kvtier.io._index.RowIndex`:
the table plans a growth (:meth:`SegmentTable.plan_growth`), the tier
extends or creates the file, then the table records the rows as allocated
(:meth:`SegmentTable.commit_growth`) or forgets them
(:meth:`SegmentTable.abandon_growth`). A segment's header says how many
rows it may hold (``num_rows``); its file holds the first ``allocated`` of
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.io._format import HEADER_NBYTES

__all__ = ["Growth", "SegmentTable"]


@dataclass(frozen=True, slots=True)
class Growth:
    """A planned growth of one segment: rows ``start..stop`` become allocated.

    ``new``: the segment file does not exist yet (create it with a header of
    ``num_rows`` rows and room for ``stop`` rows); otherwise extend it.
    """

    group_id: int
    segment: int
    num_rows: int
    start: int
    stop: int
    new: bool


class SegmentTable:
    """Segment numbers, header rows and allocated rows per group; the bytes they allocate.

    Args:
        row_nbytes: bytes of one row per group id.
        rows_per_segment: most rows of one segment file per group id.
        grow_rows: rows added per growth step per group id (``>= 1``; at most
            ``rows_per_segment``, clamped).

    Attributes:
        allocated_nbytes: row bytes allocated in segment files (every row
            state), growths in progress included.
        table: group -> segment -> ``[num_rows (header), allocated rows (file)]``.

    """

    def __init__(
        self,
        row_nbytes: Mapping[int, int],
        rows_per_segment: Mapping[int, int],
        grow_rows: Mapping[int, int],
    ) -> None:
        self._row_nbytes = dict(row_nbytes)
        self._rows_per_segment = dict(rows_per_segment)
        self.grow_rows = {g: max(1, min(grow_rows[g], rows_per_segment[g])) for g in row_nbytes}
        self.table: dict[int, dict[int, list[int]]] = {g: {} for g in row_nbytes}
        self._next_segment: dict[int, int] = dict.fromkeys(row_nbytes, 0)
        self.allocated_nbytes = 0

    def segments(self, group_id: int) -> dict[int, tuple[int, int]]:
        """Segment number -> ``(num_rows, allocated rows)``, for one group (a copy)."""
        return {s: (n, a) for s, (n, a) in self.table[group_id].items()}

    def add(self, group_id: int, segment: int, num_rows: int, allocated: int) -> None:
        """Record a segment found at open: ``allocated`` of its ``num_rows`` rows in its file."""
        self.table[group_id][segment] = [num_rows, allocated]
        self._next_segment[group_id] = max(self._next_segment[group_id], segment + 1)
        self.allocated_nbytes += allocated * self._row_nbytes[group_id]

    def skip_segment(self, group_id: int, segment: int) -> None:
        """Never hand out ``segment`` (an unusable file with that number exists)."""
        self._next_segment[group_id] = max(self._next_segment[group_id], segment + 1)

    def plan_growth(self, group_id: int, room_rows: int, max_rows: int | None = None) -> Growth:
        """Plan allocating more rows for a group: extend a segment or start a new one.

        The step is ``grow_rows`` rows, fewer where only ``room_rows`` rows
        fit the disk budget (never fewer than one row), at most ``max_rows``
        when given, and never beyond a segment's ``num_rows``. The planned
        rows count in :attr:`allocated_nbytes` at once.
        """
        row = self._row_nbytes[group_id]
        want = max(1, min(self.grow_rows[group_id], room_rows))
        if max_rows is not None:
            want = max(1, min(want, max_rows))
        for seg, (num_rows, allocated) in sorted(self.table[group_id].items()):
            if allocated < num_rows:
                stop = min(num_rows, allocated + want)
                plan = Growth(group_id, seg, num_rows, allocated, stop, False)
                break
        else:
            seg = self._next_segment[group_id]
            self._next_segment[group_id] = seg + 1
            num_rows = self._rows_per_segment[group_id]
            plan = Growth(group_id, seg, num_rows, 0, min(num_rows, want), True)
        self.allocated_nbytes += (plan.stop - plan.start) * row
        return plan

    def commit_growth(self, plan: Growth) -> None:
        """The planned rows exist on disk: the segment's file now holds ``plan.stop`` rows."""
        self.table[plan.group_id].setdefault(plan.segment, [plan.num_rows, 0])[1] = plan.stop

    def abandon_growth(self, plan: Growth) -> None:
        """The growth failed: forget the planned rows (a new segment number is not reused)."""
        self.allocated_nbytes -= (plan.stop - plan.start) * self._row_nbytes[plan.group_id]

    def grow_step_nbytes(self, group_id: int) -> int:
        """Bytes of one full growth step of a group (``grow_rows`` rows)."""
        return self.grow_rows[group_id] * self._row_nbytes[group_id]

    def growth_nbytes(self, group_id: int) -> int:
        """Disk bytes a one-row growth of a group takes: its row, and a header for a new segment."""
        extend = any(a < n for n, a in self.table[group_id].values())
        return self._row_nbytes[group_id] + (0 if extend else HEADER_NBYTES)
