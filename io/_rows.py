"""The NVMe tier's row allocator: the state of every allocated row, and the bytes in use.

Pure and synchronous, like the rest of :class:`~kvtier.io._index.RowIndex`.
An allocated row is free (in its group's heap, lowest row first), reserved
(handed to a write in flight), visible (the key index holds it), a zombie
(dropped while a read pins it) or stale (its trailer is still to be
blanked, :meth:`RowAllocator.take_stale` then
:meth:`RowAllocator.reclaimed`). The allocator keeps the free, stale,
pinned and zombie rows; reserved and visible rows are those it holds no
record of. Apart from the state, a row counts as punched (it holds no disk
blocks) or not; a row taken to be punched counts as punched at once and as
promised until its punch is done.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["RowAllocator", "RowRef"]


@dataclass(frozen=True, order=True, slots=True)
class RowRef:
    """Position of one row: group, segment number, row index in the segment."""

    group_id: int
    segment: int
    row: int


class RowAllocator:
    """Free, stale, pinned, zombie and punched rows of every group; ``bytes_used``.

    Args:
        row_nbytes: bytes of one row per group id.

    Attributes:
        bytes_used: row bytes of visible, reserved and zombie rows plus the
            capacity reserved for writes that have no row yet (the caller
            adds a reservation; :meth:`release` takes a row's bytes off).
        free: group -> its free rows, a heap (lowest row first).
        stale: rows waiting for :meth:`take_stale`.
        holed: rows that count as punched (free, or being blanked);
            ``holed_nbytes`` their row bytes.
        promised: those of ``holed`` whose punch is not done yet;
            ``promised_nbytes`` their row bytes.
        pins: row -> pins by reads in flight and holds.
        zombies: pinned rows that were dropped (stale on the last unpin).

    """

    def __init__(self, row_nbytes: Mapping[int, int]) -> None:
        self._row_nbytes = dict(row_nbytes)
        self.bytes_used = 0
        self.free: dict[int, list[RowRef]] = {g: [] for g in row_nbytes}
        self.stale: list[RowRef] = []
        self.holed: set[RowRef] = set()
        self.holed_nbytes = 0
        self.promised: set[RowRef] = set()
        self.promised_nbytes = 0
        self.pins: dict[RowRef, int] = {}
        self.zombies: set[RowRef] = set()

    # -- free rows --------------------------------------------------------------

    def extend_free(self, group_id: int, refs: Iterable[RowRef]) -> None:
        """Add many rows of one group to its free rows (rows found free at open)."""
        self.free[group_id].extend(refs)
        heapq.heapify(self.free[group_id])

    def push_free(self, refs: Iterable[RowRef]) -> None:
        """Add rows to their groups' free rows, one by one (new rows of a growth)."""
        for ref in refs:
            heapq.heappush(self.free[ref.group_id], ref)

    def take_free(self, group_id: int, holes: bool = True) -> RowRef | None:
        """Take the lowest free row of a group (None: there is none).

        Args:
            group_id: the group.
            holes: whether a punched row may be taken. False: the lowest free
                row that holds its disk blocks, or None when every free row
                is punched.
        """
        free = self.free[group_id]
        if not free:
            return None
        if holes or free[0] not in self.holed:
            ref = heapq.heappop(free)
        else:  # rare: rows are punched only past the disk budget
            kept = [r for r in free if r in self.holed]
            full = sorted(r for r in free if r not in self.holed)
            if not full:
                return None
            ref = full[0]
            kept += full[1:]
            heapq.heapify(kept)
            self.free[group_id] = kept
        self.drop_hole(ref)  # a punched row: its blocks are allocated again
        return ref

    def has_row(self, group_id: int) -> bool:
        """Whether a group has a free row that holds its disk blocks (not punched)."""
        free = self.free[group_id]
        return bool(free) and (free[0] not in self.holed or any(r not in self.holed for r in free))

    def free_rows(self, group_id: int) -> int:
        """Return the number of free rows of a group."""
        return len(self.free[group_id])

    def take_other_free(self, group_id: int, nbytes: int, skip: Container[RowRef]) -> list[RowRef]:
        """Take free rows of groups other than ``group_id`` that hold blocks, ``nbytes`` of them.

        Those of the groups with the most free rows first, none of ``skip``;
        fewer when there are fewer. They count as punched at once
        (:meth:`mark_punched`).
        """
        refs: list[RowRef] = []
        got = 0
        rows = [
            ref
            for g, free in self.free.items()
            if g != group_id
            for ref in free
            if ref not in self.holed and ref not in skip
        ]
        rows.sort(key=lambda r: (-len(self.free[r.group_id]), r))
        for ref in rows:
            if got >= nbytes:
                break
            refs.append(ref)
            got += self._row_nbytes[ref.group_id]
        taken = set(refs)
        for g in {r.group_id for r in refs}:
            self.free[g] = [r for r in self.free[g] if r not in taken]
            heapq.heapify(self.free[g])
        self.mark_punched(refs)
        return refs

    def take_to_punch(self, nbytes: int) -> list[RowRef]:
        """Take free rows that hold blocks, at least ``nbytes`` of them, to be punched.

        From the groups with the most free bytes first, their highest rows
        first (:meth:`take_free` hands out the lowest, which keep their
        blocks). The rows leave the free rows and count as punched at once.
        """
        refs: list[RowRef] = []
        if nbytes <= 0:
            return refs
        free_bytes = {g: len(f) * self._row_nbytes[g] for g, f in self.free.items()}
        for g in sorted(free_bytes, key=lambda g: -free_bytes[g]):
            kept = []
            for ref in sorted(self.free[g], reverse=True):
                if nbytes > 0 and ref not in self.holed:
                    refs.append(ref)
                    nbytes -= self._row_nbytes[g]
                else:
                    kept.append(ref)
            if len(kept) != len(self.free[g]):
                kept.reverse()  # ascending: a valid heap
                self.free[g] = kept
            if nbytes <= 0:
                break
        self.mark_punched(refs)
        return refs

    # -- stale rows and punched rows --------------------------------------------

    def release(self, ref: RowRef) -> None:
        """A visible or reserved row holds no key any more: stale, or a zombie while pinned."""
        if ref in self.pins:
            self.zombies.add(ref)
        else:
            self.bytes_used -= self._row_nbytes[ref.group_id]
            self.stale.append(ref)

    def take_stale(self) -> list[RowRef]:
        """Hand the stale rows to the caller, who blanks their trailers, then :meth:`reclaimed`."""
        stale, self.stale = self.stale, []
        return stale

    def reclaimed(self, refs: Iterable[RowRef], punched: bool = False) -> None:
        """Rows taken to be blanked or punched, now blank, become free.

        ``punched``: their disk blocks were released (else they hold blocks).
        """
        for ref in refs:
            heapq.heappush(self.free[ref.group_id], ref)
            if ref in self.promised:
                self.promised.discard(ref)
                self.promised_nbytes -= self._row_nbytes[ref.group_id]
            if punched:
                self.add_hole(ref)
            else:
                self.drop_hole(ref)

    def add_hole(self, ref: RowRef) -> bool:
        """Count ``ref`` as punched; False if it already was."""
        if ref in self.holed:
            return False
        self.holed.add(ref)
        self.holed_nbytes += self._row_nbytes[ref.group_id]
        return True

    def drop_hole(self, ref: RowRef) -> None:
        """Count ``ref`` as holding blocks again (if it was punched)."""
        if ref in self.holed:
            self.holed.discard(ref)
            self.holed_nbytes -= self._row_nbytes[ref.group_id]

    def mark_punched(self, refs: Iterable[RowRef]) -> None:
        """Count rows taken for blanking as punched now, and promised until :meth:`reclaimed`."""
        for ref in refs:
            if self.add_hole(ref):
                self.promised.add(ref)
                self.promised_nbytes += self._row_nbytes[ref.group_id]

    # -- pins -------------------------------------------------------------------

    def pin(self, ref: RowRef) -> None:
        """Pin a row against eviction and reuse until :meth:`unpin`."""
        self.pins[ref] = self.pins.get(ref, 0) + 1

    def unpin(self, ref: RowRef) -> None:
        """Undo one :meth:`pin`; a row dropped meanwhile becomes stale now."""
        n = self.pins[ref] - 1
        if n:
            self.pins[ref] = n
            return
        del self.pins[ref]
        if ref in self.zombies:
            self.zombies.discard(ref)
            self.release(ref)
