"""The NVMe tier's pure, synchronous state: row allocator, key index and LRU.

No I/O and no awaits happen here (httpcore style): :class:`~kvtier.io.NVMeTier`
mutates a :class:`RowIndex` synchronously on the event loop thread and performs
file I/O outside it. Every row is in exactly one state:

* free: in the group's free heap;
* reserved: handed out by :meth:`RowIndex.take_free`, :meth:`RowIndex.evict`
  for a write in flight (in no other structure);
* visible: holds a key's fully written row (in ``_entries`` and the LRU);
* zombie: dropped while a read pins it; freed on the last :meth:`RowIndex.unpin`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass

from kvtier._types import OffloadKey

__all__ = ["RowEntry", "RowIndex", "RowRef"]


@dataclass(frozen=True, order=True, slots=True)
class RowRef:
    """Position of one row: group, segment number, row index in the segment."""

    group_id: int
    segment: int
    row: int


@dataclass(frozen=True, slots=True)
class RowEntry:
    """A visible row: where it is, the stored sub-block range and its sequence number."""

    ref: RowRef
    start: int
    stop: int
    seq: int


class RowIndex:
    """Row allocation, key lookup and LRU eviction over fixed-size rows.

    Args:
        row_nbytes: bytes of one row per group id.
        capacity_bytes: bound on the sum of ``num_rows * row_nbytes`` over all
            segments of all groups.
        rows_per_segment: rows of a full new segment per group id.

    """

    def __init__(
        self,
        row_nbytes: Mapping[int, int],
        capacity_bytes: int,
        rows_per_segment: Mapping[int, int],
    ) -> None:
        self._row_nbytes = dict(row_nbytes)
        self._rows_per_segment = dict(rows_per_segment)
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self._segments: dict[int, dict[int, int]] = {g: {} for g in row_nbytes}
        self._next_segment: dict[int, int] = dict.fromkeys(row_nbytes, 0)
        self._free: dict[int, list[RowRef]] = {g: [] for g in row_nbytes}
        self._lru: dict[int, OrderedDict[OffloadKey, RowEntry]] = {
            g: OrderedDict() for g in row_nbytes
        }
        self._pending: dict[OffloadKey, set[int]] = {}
        self._pins: dict[RowRef, int] = {}
        self._zombies: set[RowRef] = set()
        self._seq = 0
        self.evictions = 0

    # -- segments ---------------------------------------------------------------

    def segments(self, group_id: int) -> dict[int, int]:
        """Segment number -> number of rows, for one group (a copy)."""
        return dict(self._segments[group_id])

    def rebuild(
        self,
        segments: Mapping[tuple[int, int], int],
        rows: Iterable[tuple[RowRef, OffloadKey, int, int, int]],
    ) -> None:
        """Set the state found on disk at open (call once, on an empty index).

        Args:
            segments: ``(group_id, segment) -> num_rows`` of every usable segment.
            rows: ``(ref, key, start, stop, seq)`` of every valid row. For a key
                found in several rows the highest ``seq`` wins; the other rows
                and every row not listed become free. LRU order follows ``seq``.

        """
        best: dict[OffloadKey, RowEntry] = {}
        for ref, key, start, stop, seq in rows:
            old = best.get(key)
            if old is None or seq > old.seq:
                best[key] = RowEntry(ref, start, stop, seq)
            self._seq = max(self._seq, seq)
        used = {e.ref for e in best.values()}
        for (g, seg), num_rows in sorted(segments.items()):
            self._segments[g][seg] = num_rows
            self._next_segment[g] = max(self._next_segment[g], seg + 1)
            self.bytes_used += num_rows * self._row_nbytes[g]
            for i in range(num_rows):
                ref = RowRef(g, seg, i)
                if ref not in used:
                    self._free[g].append(ref)
            heapq.heapify(self._free[g])
        for key, entry in sorted(best.items(), key=lambda kv: kv[1].seq):
            self._lru[key.group_id][key] = entry

    def skip_segment(self, group_id: int, segment: int) -> None:
        """Never hand out ``segment`` (an unusable file with that number exists)."""
        self._next_segment[group_id] = max(self._next_segment[group_id], segment + 1)

    def plan_segment(self, group_id: int) -> tuple[int, int] | None:
        """Reserve capacity for a new segment of ``group_id``.

        Returns:
            ``(segment number, num_rows)``, with ``num_rows`` limited by the
            remaining capacity; ``None`` when not even one row fits. The caller
            creates the file, then calls :meth:`commit_segment` or
            :meth:`abandon_segment`.

        """
        row = self._row_nbytes[group_id]
        num_rows = min(
            self._rows_per_segment[group_id], (self.capacity_bytes - self.bytes_used) // row
        )
        if num_rows <= 0:
            return None
        seg = self._next_segment[group_id]
        self._next_segment[group_id] = seg + 1
        self.bytes_used += num_rows * row
        return seg, num_rows

    def commit_segment(self, group_id: int, segment: int, num_rows: int) -> None:
        """Add the rows of a created segment to the free rows."""
        self._segments[group_id][segment] = num_rows
        for i in range(num_rows):
            heapq.heappush(self._free[group_id], RowRef(group_id, segment, i))

    def abandon_segment(self, group_id: int, num_rows: int) -> None:
        """Return the capacity reserved by :meth:`plan_segment` (creation failed)."""
        self.bytes_used -= num_rows * self._row_nbytes[group_id]

    # -- allocation -------------------------------------------------------------

    def take_free(self, group_id: int) -> RowRef | None:
        """Reserve the lowest free row of a group (consecutive calls give consecutive rows)."""
        free = self._free[group_id]
        return heapq.heappop(free) if free else None

    def evict(self, group_id: int, protect: Container[OffloadKey]) -> RowRef | None:
        """Drop the least recently used unpinned, unprotected key of a group.

        Returns:
            Its row, now reserved for the caller; ``None`` when no key qualifies.

        """
        lru = self._lru[group_id]
        for key, entry in lru.items():
            if key not in protect and entry.ref not in self._pins:
                del lru[key]
                self.evictions += 1
                return entry.ref
        return None

    def release(self, ref: RowRef) -> None:
        """Return a reserved or dropped row to the free rows (deferred while pinned)."""
        if ref in self._pins:
            self._zombies.add(ref)
        else:
            heapq.heappush(self._free[ref.group_id], ref)

    # -- writes -----------------------------------------------------------------

    def begin_write(self, key: OffloadKey) -> int:
        """Register a write of ``key`` in flight; return its new sequence number."""
        self._seq += 1
        self._pending.setdefault(key, set()).add(self._seq)
        return self._seq

    def _end_write(self, key: OffloadKey, seq: int) -> bool:
        seqs = self._pending.get(key)
        if seqs is None or seq not in seqs:
            return False
        seqs.discard(seq)
        if not seqs:
            del self._pending[key]
        return True

    def finish_write(self, key: OffloadKey, ref: RowRef, seq: int, start: int, stop: int) -> bool:
        """Publish a completed row write.

        The key becomes visible at ``ref`` unless it was discarded meanwhile or
        a newer write (higher ``seq``) is already visible; then ``ref`` is freed.
        A replaced older row is freed (deferred while a read pins it).

        Returns:
            Whether the row became visible.

        """
        lru = self._lru[key.group_id]
        old = lru.get(key)
        if not self._end_write(key, seq) or (old is not None and old.seq > seq):
            self.release(ref)
            return False
        lru[key] = RowEntry(ref, start, stop, seq)
        lru.move_to_end(key)
        if old is not None:
            self.release(old.ref)
        return True

    def fail_write(self, key: OffloadKey, ref: RowRef, seq: int) -> None:
        """Forget a failed write and free its row."""
        self._end_write(key, seq)
        self.release(ref)

    # -- lookups and reads ------------------------------------------------------

    def lookup(self, key: OffloadKey) -> RowEntry | None:
        """Return the visible entry of a key, or None (does not touch the LRU)."""
        lru = self._lru.get(key.group_id)
        return None if lru is None else lru.get(key)

    def keys(self) -> list[OffloadKey]:
        """All visible keys, groups in id order, least recently used first."""
        return [k for g in sorted(self._lru) for k in self._lru[g]]

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def pin(self, key: OffloadKey) -> RowEntry | None:
        """Look up a visible key and pin its row against reuse until :meth:`unpin`."""
        entry = self.lookup(key)
        if entry is not None:
            self._pins[entry.ref] = self._pins.get(entry.ref, 0) + 1
        return entry

    def unpin(self, ref: RowRef) -> None:
        """Undo one :meth:`pin`; a row dropped meanwhile becomes free now."""
        n = self._pins[ref] - 1
        if n:
            self._pins[ref] = n
            return
        del self._pins[ref]
        if ref in self._zombies:
            self._zombies.discard(ref)
            heapq.heappush(self._free[ref.group_id], ref)

    def touch(self, key: OffloadKey) -> None:
        """Mark a visible key most recently used."""
        lru = self._lru[key.group_id]
        if key in lru:
            lru.move_to_end(key)

    def drop(self, key: OffloadKey, ref: RowRef | None = None) -> bool:
        """Forget a visible key (only if it is still at ``ref`` when given); free its row.

        Returns:
            Whether the key was dropped.

        """
        lru = self._lru.get(key.group_id)
        entry = None if lru is None else lru.get(key)
        if lru is None or entry is None or (ref is not None and entry.ref != ref):
            return False
        del lru[key]
        self.release(entry.ref)
        return True

    def discard(self, key: OffloadKey) -> None:
        """Forget a key: drop it and keep writes in flight from publishing it."""
        self._pending.pop(key, None)
        self.drop(key)

    def free_rows(self, group_id: int) -> int:
        """Return the number of free rows of a group."""
        return len(self._free[group_id])
