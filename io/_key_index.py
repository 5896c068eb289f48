"""The NVMe tier's key index: each visible key's row, in LRU order, and the writes in flight.

Pure and synchronous, like the rest of :class:`~kvtier.io._index.RowIndex`.
One LRU over the keys of all groups. Every write of a key gets a sequence
number (:meth:`KeyIndex.begin_write`, at the call); the highest published one
wins (:meth:`KeyIndex.publish`), so a slow older write never replaces a newer
row, and a restart orders rows by the sequence numbers in their trailers.
Recency follows the calls, not the order their writes finish in: a row
published late (its batch waited for segment growth or a write slot) ranks
by its sequence number, before the rows of later calls and of later touches
(a touch takes the next number of the same counter, in memory only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, replace

from kvtier.io._rows import RowRef
from kvtier.keys import OffloadKey

__all__ = ["KeyIndex", "RowEntry"]


@dataclass(frozen=True, slots=True)
class RowEntry:
    """A visible row: where it is, the stored sub-block range and its sequence number.

    ``used``: the counter's value of the key's last touch (0: never
    touched): the time of the touch, or of the call that wrote or skipped
    the key (:meth:`KeyIndex.reserve_ranks`); the LRU ranks a key by
    :attr:`rank`.
    """

    ref: RowRef
    start: int
    stop: int
    seq: int
    used: int = 0

    @property
    def rank(self) -> int:
        """Where the key sits in the LRU: its last touch, else its write's sequence number."""
        return self.used or self.seq


class KeyIndex:
    """Visible keys (least recently used first), pending writes and the sequence counter.

    Args:
        row_nbytes: bytes of one row per group id.

    Attributes:
        lru: key -> its visible row, least recently used first.
        pending: key -> sequence numbers of its writes in flight.
        seq: the highest sequence number handed out or found on disk.

    """

    def __init__(self, row_nbytes: Mapping[int, int]) -> None:
        self._row_nbytes = dict(row_nbytes)
        self.lru: OrderedDict[OffloadKey, RowEntry] = OrderedDict()
        self.pending: dict[OffloadKey, set[int]] = {}
        self.seq = 0

    def rebuild(
        self, rows: Iterable[tuple[RowRef, OffloadKey, int, int, int]]
    ) -> tuple[set[RowRef], list[RowRef]]:
        """Make the newest row of each key visible, in ``seq`` order (on an empty index).

        Args:
            rows: ``(ref, key, start, stop, seq)`` of every valid row found on disk.

        Returns:
            The rows made visible, and the others (older rows of the same
            keys: stale).

        """
        best: dict[OffloadKey, RowEntry] = {}
        losers: list[RowRef] = []
        for ref, key, start, stop, seq in rows:
            old = best.get(key)
            if old is None or seq > old.seq:
                best[key] = RowEntry(ref, start, stop, seq)
                if old is not None:
                    losers.append(old.ref)
            else:
                losers.append(ref)
            self.seq = max(self.seq, seq)
        for key, entry in sorted(best.items(), key=lambda kv: kv[1].seq):
            self.lru[key] = entry
        return {e.ref for e in best.values()}, losers

    # -- writes -----------------------------------------------------------------

    def begin_write(self, key: OffloadKey) -> int:
        """Register a write of ``key`` in flight; return its new sequence number."""
        self.seq += 1
        self.pending.setdefault(key, set()).add(self.seq)
        return self.seq

    def end_write(self, key: OffloadKey, seq: int) -> bool:
        """Forget the write ``seq`` of ``key``; False if it was not in flight (discarded)."""
        seqs = self.pending.get(key)
        if seqs is None or seq not in seqs:
            return False
        seqs.discard(seq)
        if not seqs:
            del self.pending[key]
        return True

    def publish(
        self, key: OffloadKey, ref: RowRef, seq: int, start: int, stop: int
    ) -> tuple[bool, RowRef | None]:
        """End the write ``seq`` of ``key`` at ``ref`` and make it visible unless it lost.

        It loses when the key was discarded meanwhile or a newer write was
        published. Publishing makes older writes of the key in flight
        unpublishable, and the key most recently used.

        Returns:
            ``(visible, stale)``: whether the row became visible, and the row
            that holds no key now (``ref`` when it lost, the replaced row,
            or None).

        """
        old = self.lru.get(key)
        if not self.end_write(key, seq) or (old is not None and old.seq > seq):
            return False, ref
        newer = {s for s in self.pending.pop(key, ()) if s > seq}
        if newer:
            self.pending[key] = newer
        self.lru[key] = RowEntry(ref, start, stop, seq)
        self._place(key)
        return True, None if old is None else old.ref

    def _place(self, key: OffloadKey) -> None:
        """Move ``key`` to its rank's place: after every key of a lower rank.

        The LRU is sorted by rank; keys ranked after ``key`` (published or
        touched by later calls) stay after it. Costs O(those keys).
        """
        lru = self.lru
        lru.move_to_end(key)
        rank = lru[key].rank
        later: list[OffloadKey] = []
        for k in reversed(lru):
            if k == key:
                continue
            if lru[k].rank < rank:
                break
            later.append(k)
        for k in reversed(later):
            lru.move_to_end(k)

    # -- lookups ----------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> RowEntry | None:
        """Return the visible entry of a key, or None (does not touch the LRU)."""
        return self.lru.get(key)

    def keys(self) -> list[OffloadKey]:
        """All visible keys, groups in id order, least recently used first."""
        return sorted(self.lru, key=lambda k: k.group_id)

    def lru_keys(self) -> list[OffloadKey]:
        """All visible keys of all groups, least recently used first."""
        return list(self.lru)

    def __len__(self) -> int:
        return len(self.lru)

    def reserve_ranks(self, n: int) -> int:
        """Take ``n`` numbers of the counter now, for touches that land later.

        A call whose keys are touched once its writes ended (in any order)
        ranks them by the call: :meth:`touch` with ``rank=first + i``.

        Returns:
            The first of the ``n`` numbers.
        """
        first = self.seq + 1
        self.seq += n
        return first

    def touch(self, key: OffloadKey, rank: int | None = None) -> None:
        """Mark a visible key used: now (the next number), or at ``rank`` (:meth:`reserve_ranks`).

        A reserved ``rank`` places the key at its call, also before its own
        row's sequence number (the row was written after the call took its
        numbers); a touch after it in time is never undone by it.
        """
        entry = self.lru.get(key)
        if entry is None:
            return
        if rank is None:
            self.seq += 1
            rank = self.seq
        if rank > entry.used:
            self.lru[key] = replace(entry, used=rank)
            self._place(key)

    def remove(self, key: OffloadKey, ref: RowRef | None = None) -> RowEntry | None:
        """Forget a visible key (only if it is still at ``ref`` when given); its entry, or None."""
        entry = self.lru.get(key)
        if entry is None or (ref is not None and entry.ref != ref):
            return None
        del self.lru[key]
        return entry

    # -- eviction candidates ----------------------------------------------------

    def victims(
        self,
        need: int,
        protect: Container[OffloadKey],
        pinned: Container[RowRef],
        skip_group: int | None = None,
    ) -> list[OffloadKey] | None:
        """The least recently used evictable keys whose rows add up to ``need`` bytes.

        Keys whose row is ``pinned``, keys in ``protect`` and keys of
        ``skip_group`` are passed over. None when all the others together
        hold less.
        """
        victims: list[OffloadKey] = []
        freed = 0
        for key, entry in self.lru.items():
            if key.group_id == skip_group or key in protect or entry.ref in pinned:
                continue
            victims.append(key)
            freed += self._row_nbytes[key.group_id]
            if freed >= need:
                return victims
        return None

    def oldest_of(
        self,
        group_id: int,
        protect: Container[OffloadKey],
        pinned: Container[RowRef],
        window: int | None = None,
    ) -> tuple[OffloadKey, int] | None:
        """The LRU evictable key of ``group_id``, and how many evictable keys are older.

        With ``window``: None unless fewer than ``window`` evictable keys
        (of any group; those in ``protect`` or with a ``pinned`` row are not
        evictable) are older.
        """
        seen = 0
        for key, entry in self.lru.items():
            if key in protect or entry.ref in pinned:
                continue
            if key.group_id == group_id:
                return key, seen
            seen += 1
            if window is not None and seen >= window:
                return None
        return None
