"""The NVMe tier's pure, synchronous state: segment growth, row allocator, key index, LRU.

:class:`RowIndex` composes three parts: the segment table
(:mod:`kvtier.io._segments`), the row allocator (:mod:`kvtier.io._rows`) and
the key index (:mod:`kvtier.io._key_index`). It decides evictions, which
need the keys and the rows, and keeps the parts' counts consistent.

No I/O and no awaits happen here (httpcore style): :class:`~kvtier.io.NVMeTier`
mutates a :class:`RowIndex` synchronously on the event loop thread and performs
file I/O outside it.

Capacity is counted in rows, not files: ``bytes_used`` is the sum of
``row_nbytes`` over the rows that hold or are about to hold data (visible,
reserved, zombie) and never exceeds ``capacity_bytes``. Eviction is one LRU
over the keys of all groups, with one refinement (:meth:`RowIndex.reserve`):
a write that needs one row of room evicts the least recently used key of its
own group instead of the least recently used key when that key is among the
oldest few evictable keys (``eviction_window``, at most 1/32 of the keys),
because the writer then overwrites the evicted row in place and nothing
needs blanking.
Any other evicted row stays in its group's segment and becomes a free row of
that group. Segment files grow lazily, ``grow_rows``
rows at a time, so rows allocated on disk (``allocated_nbytes``) exceed the
rows in use only by free rows.

Every row allocated on disk is in exactly one state:

* free: in its group's free heap; its trailer is blank (never written,
  blanked, or undecodable at open), so a restart cannot find a key in it, or
  it could not be read at open: a later open may find its old key again, with
  its own bytes and a sequence number below every write since (``SEQ_JUMP``);
* reserved: handed to a write in flight (by :meth:`RowIndex.take_free` or,
  as an evicted row of the writer's group, by :meth:`RowIndex.reserve`);
* visible: holds a key's fully written row (in the LRU);
* zombie: dropped while a read pins it; becomes stale on the last :meth:`RowIndex.unpin`;
* stale: holds no visible key but may still hold a valid trailer on disk; the
  tier blanks the trailer (:meth:`RowIndex.take_stale`, then
  :meth:`RowIndex.reclaimed`) before the row becomes free, so that an evicted,
  dropped, discarded or replaced key does not come back after a restart.

A row keeps its disk blocks when it is blanked (its 4 KiB trailer is zeroed),
so that the next write into it overwrites written blocks: on ext4 that runs
at about 1.8-2x a write into blocks that were punched or freshly allocated
(measured on the development machine; README "Steady state"). Only when the
rows holding blocks exceed the disk budget (:attr:`RowIndex.over_budget`, a
workload that moved to other groups) are rows punched: stale rows, then free
rows of the groups with the most free bytes (:meth:`RowIndex.take_to_punch`).
Punched rows are counted apart (``held_nbytes`` = allocated minus punched).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping

from kvtier.io._key_index import KeyIndex, RowEntry
from kvtier.io._rows import RowAllocator, RowRef
from kvtier.io._segments import Growth, SegmentTable
from kvtier.keys import OffloadKey

__all__ = ["DEFERRED", "Growth", "RowEntry", "RowIndex", "RowRef"]


WINDOW_SHARE = 32
"""Default ``window_share`` of :class:`RowIndex`: the eviction window is at most
``1/WINDOW_SHARE`` of the keys (read when an index is created)."""


SEQ_JUMP = 1 << 32
"""How far sequence numbers jump at an open that could not read (or found invalid) anything.

A row that could not be read holds a sequence number from an earlier session;
this session's numbers start above it unless more than 2**32 writes were made
after the highest row that was read. The 64-bit field of the trailer holds
2**32 such jumps.
"""


DEFERRED = RowRef(-2, -2, -2)
"""What :meth:`RowIndex.reserve` returns with ``(False, DEFERRED)``: room needs
keys of other groups only, and ``evict_others`` was False (nothing evicted)."""


class RowIndex:
    """Row allocation, key lookup and global LRU eviction over fixed-size rows.

    Args:
        row_nbytes: bytes of one row per group id.
        capacity_bytes: bound on ``bytes_used`` (rows in use, all groups).
        rows_per_segment: most rows of one segment file per group id.
        grow_rows: rows added per growth step per group id (``>= 1``).
        eviction_window: how far down the LRU :meth:`reserve` may look for a
            key of the writer's own group (``>= 1``; 1 is strict LRU). The
            window counts evictable keys only (pinned keys and keys of the
            writing call are skipped) and is at most the number of keys
            divided by ``window_share`` (a tier of fewer than
            ``2 * window_share`` keys evicts in strict LRU order).
        window_share: see ``eviction_window`` (``>= 1``; default
            :data:`WINDOW_SHARE`, 32).

    Attributes:
        bytes_used: row bytes of visible, reserved and zombie rows plus the
            capacity reserved for writes that have no row yet.
        allocated_nbytes: row bytes allocated in segment files (every state),
            growths in progress included.
        disk_budget_nbytes: ``capacity_bytes`` plus one growth step per group;
            growth shrinks its step to keep :attr:`growth_held_nbytes` within it (but
            always grows at least one row). Past it (:attr:`over_budget`),
            the tier punches free rows until ``held_nbytes`` is back within.
        evictions: keys evicted by LRU so far.
        window_evictions: those of ``evictions`` that took the writer's own
            group's key out of strict LRU order (``eviction_window``).
        disk_full_evictions: those of ``evictions`` made because the
            writer's segments could not grow (the filesystem was full): its
            own group's key (:meth:`evict_own`), or, for a group with no key
            to take, keys of other groups whose rows are punched
            (:meth:`take_for_disk`).

    """

    def __init__(
        self,
        row_nbytes: Mapping[int, int],
        capacity_bytes: int,
        rows_per_segment: Mapping[int, int],
        grow_rows: Mapping[int, int],
        eviction_window: int = 1,
        window_share: int | None = None,
    ) -> None:
        if window_share is None:
            window_share = WINDOW_SHARE
        if eviction_window < 1 or window_share < 1:
            raise ValueError(
                f"eviction_window and window_share must be >= 1: {eviction_window}, {window_share}"
            )
        self.eviction_window = eviction_window
        self._window_share = window_share
        self._row_nbytes = dict(row_nbytes)
        self.capacity_bytes = capacity_bytes
        self._table = SegmentTable(row_nbytes, rows_per_segment, grow_rows)
        self._rows = RowAllocator(row_nbytes)
        self._keys = KeyIndex(row_nbytes)
        self.disk_budget_nbytes = capacity_bytes + sum(
            self._table.grow_step_nbytes(g) for g in self._row_nbytes
        )
        self.evictions = 0
        self.window_evictions = 0
        self.disk_full_evictions = 0

    def row_nbytes(self, group_id: int) -> int:
        """Bytes of one row of a group."""
        return self._row_nbytes[group_id]

    @property
    def bytes_used(self) -> int:
        """Row bytes of visible, reserved and zombie rows plus reservations without a row."""
        return self._rows.bytes_used

    @property
    def allocated_nbytes(self) -> int:
        """Row bytes allocated in segment files (every state), growths in progress included."""
        return self._table.allocated_nbytes

    # -- segments ---------------------------------------------------------------

    def segments(self, group_id: int) -> dict[int, tuple[int, int]]:
        """Segment number -> ``(num_rows, allocated rows)``, for one group (a copy)."""
        return self._table.segments(group_id)

    def rebuild(
        self,
        segments: Mapping[tuple[int, int], tuple[int, int]],
        rows: Iterable[tuple[RowRef, OffloadKey, int, int, int]],
        *,
        blind: bool = False,
        holes: Iterable[RowRef] = (),
    ) -> None:
        """Set the state found on disk at open (call once, on an empty index).

        Args:
            segments: ``(group_id, segment) -> (num_rows, allocated rows)`` of
                every usable segment.
            rows: ``(ref, key, start, stop, seq)`` of every valid row. For a key
                found in several rows the highest ``seq`` wins and the other
                rows are stale; rows not listed are free. LRU order follows
                ``seq``; while the winners exceed ``capacity_bytes`` the least
                recently used are evicted (stale).
            blind: something could not be read or was invalid (a row's
                trailer, a whole segment): the next sequence numbers start ``SEQ_JUMP`` above
                the highest one read, so a row that a later open reads again
                (a key of an earlier session, with its own bytes) never
                outranks a write of this session.
            holes: allocated rows found without disk blocks (punched in an
                earlier session); the free ones count as punched, so that
                ``held_nbytes`` starts as the blocks the files hold (without
                it every allocated row counts as holding blocks).

        """
        visible, losers = self._keys.rebuild(rows)
        taken = visible | set(losers)
        for (g, seg), (num_rows, allocated) in sorted(segments.items()):
            self._table.add(g, seg, num_rows, allocated)
            self._rows.extend_free(
                g, (ref for i in range(allocated) if (ref := RowRef(g, seg, i)) not in taken)
            )
        self._rows.stale.extend(losers)
        for ref in holes:
            if ref not in taken:
                self._rows.add_hole(ref)  # punched in an earlier session: done, not promised
        if blind:
            self._keys.seq += SEQ_JUMP
        for key in self._keys.lru:
            self._rows.bytes_used += self._row_nbytes[key.group_id]
        while self._rows.bytes_used > self.capacity_bytes:
            key, entry = self._keys.lru.popitem(last=False)
            self.evictions += 1
            self._rows.release(entry.ref)

    def skip_segment(self, group_id: int, segment: int) -> None:
        """Never hand out ``segment`` (an unusable file with that number exists)."""
        self._table.skip_segment(group_id, segment)

    def plan_growth(self, group_id: int, max_rows: int | None = None) -> Growth:
        """Plan allocating more rows for a group: extend a segment or start a new one.

        The step is ``grow_rows`` rows, fewer where :attr:`growth_held_nbytes`
        would exceed ``disk_budget_nbytes`` (never fewer than one row; rows
        punched in other groups hold no blocks, so they leave room once
        their punch is done), at most ``max_rows`` when given (a step that
        did not fit on the filesystem is tried again as one row),
        and never beyond a segment's ``num_rows``. The caller serializes growths of a group,
        performs the I/O, then calls :meth:`commit_growth` or :meth:`abandon_growth`.
        """
        room = (self.disk_budget_nbytes - self.growth_held_nbytes) // self._row_nbytes[group_id]
        return self._table.plan_growth(group_id, room, max_rows)

    def grow_step_nbytes(self, group_id: int) -> int:
        """Bytes of one full growth step of a group (``grow_rows`` rows)."""
        return self._table.grow_step_nbytes(group_id)

    def commit_growth(self, plan: Growth) -> None:
        """The planned rows exist on disk (blank): add them to the free rows."""
        self._table.commit_growth(plan)
        self._rows.push_free(
            RowRef(plan.group_id, plan.segment, i) for i in range(plan.start, plan.stop)
        )

    def abandon_growth(self, plan: Growth) -> None:
        """The growth failed: forget the planned rows (a new segment number is not reused)."""
        self._table.abandon_growth(plan)

    def growth_nbytes(self, group_id: int) -> int:
        """Disk bytes a one-row growth of a group takes: its row, and a header for a new segment."""
        return self._table.growth_nbytes(group_id)

    def wants_growth(self, group_id: int) -> bool:
        """Whether a group should grow ahead of need.

        True when its free rows are at most half a growth step and a full step
        still fits in ``disk_budget_nbytes`` (growth ahead never takes the
        last rows of the budget: an on-demand growth for a waiting write may).
        """
        step = self._table.grow_rows[group_id]
        room = self.disk_budget_nbytes - self.growth_held_nbytes
        low = self._rows.free_rows(group_id) <= step // 2
        return low and room >= step * self._row_nbytes[group_id]

    # -- capacity and allocation ------------------------------------------------

    def reserve(
        self, group_id: int, protect: Container[OffloadKey], evict_others: bool = True
    ) -> tuple[bool, RowRef | None]:
        """Reserve capacity for one row of ``group_id``, evicting LRU keys of any group.

        Evicts the least recently used unpinned keys not in ``protect``, of
        all groups, until the row fits; evicts nothing when even evicting
        every such key would not make room. One exception: when one row of
        ``group_id`` is enough room, the least recently used evictable key of
        ``group_id`` is evicted instead if it is among the first ``window``
        evictable keys, ``window = min(eviction_window, len(self) //
        window_share)``; its row is handed to the writer, who overwrites it
        in place, where another group's row would have to be blanked (a
        4 KiB write) before it is free. Fewer than ``window`` evictable keys
        are then older than the victim (pinned and protected keys, skipped,
        are not counted). (Approximate LRU in the manner of
        Redis' sampled eviction, https://redis.io/docs/latest/develop/reference/eviction/,
        with the sample taken from the LRU end.)

        Args:
            group_id: the writer's group.
            protect: keys never evicted (those of the writing call).
            evict_others: False, for a writer whose group has no free row at
                hand: when the keys to evict for room include none of
                ``group_id`` (no row would be handed over), nothing is
                evicted and ``(False, DEFERRED)`` returned: the writer grows
                first, then reserves (on a full filesystem it takes its own
                group's key, :meth:`evict_own`, and evicts nothing else).

        Returns:
            ``(False, None)``: no room (the row is larger than the capacity, or
            the capacity is held by pinned, protected or in-flight rows).
            ``(False, DEFERRED)``: ``evict_others`` is False and room needs
            keys of other groups only (nothing evicted).
            ``(True, ref)``: room reserved; ``ref`` is an evicted row of the
            same group, now reserved for the caller, or ``None``: take a row
            with :meth:`take_free` (growing the group when there is none), or
            give the reservation back with :meth:`unreserve`.

        """
        row = self._row_nbytes[group_id]
        if row > self.capacity_bytes:
            return False, None
        need = self._rows.bytes_used + row - self.capacity_bytes
        if 0 < need <= row and (ref := self._own_victim(group_id, protect)) is not None:
            return True, ref
        victims: list[OffloadKey] = []
        if need > 0:
            found = self._keys.victims(need, protect, self._rows.pins)
            if found is None:
                return False, None
            victims = found
            if not evict_others and all(key.group_id != group_id for key in victims):
                return False, DEFERRED  # none of them would hand a row over: grow first
        own: RowRef | None = None
        for key in victims:
            entry = self._keys.lru.pop(key)
            self.evictions += 1
            if own is None and entry.ref.group_id == group_id:
                own = entry.ref  # its bytes stay counted: they are the reservation
            else:
                self._rows.release(entry.ref)
        if own is None:
            self._rows.bytes_used += row
        return True, own

    def _own_victim(self, group_id: int, protect: Container[OffloadKey]) -> RowRef | None:
        """Evict the LRU key of ``group_id`` if it is within the window; its row, or None."""
        window = min(self.eviction_window, len(self._keys) // self._window_share)
        if window <= 1:  # strict LRU (the loop in reserve hands back an own first victim)
            return None
        found = self._keys.oldest_of(group_id, protect, self._rows.pins, window)
        if found is None:
            return None
        key, seen = found
        entry = self._keys.lru.pop(key)
        self.evictions += 1
        self.window_evictions += seen > 0  # strict LRU would have taken another
        return entry.ref  # its bytes stay counted: they are the reservation

    def evict_own(
        self, group_id: int, protect: Container[OffloadKey], reserved: bool = True
    ) -> RowRef | None:
        """Give a write of ``group_id`` that found no row the row of its group's LRU key.

        For a write whose group has no free row and cannot grow (the
        filesystem is full): the least recently used key of ``group_id`` that
        is neither pinned (a read in flight) nor in ``protect`` is evicted,
        wherever it stands in the LRU order, and its row is handed to the
        writer, who overwrites it in place, as a window eviction's is.

        Args:
            group_id: the writer's group.
            protect: keys never evicted (those of the writing call).
            reserved: whether the write holds a reservation of :meth:`reserve`.
                True: the reservation and the evicted key then share that
                row, so ``bytes_used`` drops by one row. False: the row is
                the write's reservation (``bytes_used`` unchanged).

        Returns:
            The row, now reserved for the caller, or None: no such key (the
            reservation is unchanged).

        """
        found = self._keys.oldest_of(group_id, protect, self._rows.pins)
        if found is None:
            return None
        entry = self._keys.lru.pop(found[0])
        self.evictions += 1
        self.disk_full_evictions += 1
        if reserved:
            self._rows.bytes_used -= self._row_nbytes[group_id]
        return entry.ref

    def take_for_disk(
        self,
        group_id: int,
        nbytes: int,
        protect: Container[OffloadKey],
        keys: bool,
        skip: Container[RowRef] = (),
    ) -> list[RowRef]:
        """Give a group that cannot grow disk blocks of other groups, to be punched.

        For a write of ``group_id`` whose segments cannot grow (the
        filesystem is full below ``capacity_bytes``). With ``keys`` False:
        free rows of other groups that hold their blocks, as far as the
        index knows, those of the groups with the most free rows first, none
        of ``skip``. With ``keys`` True: the
        least recently used keys of other groups that are neither pinned nor
        in ``protect``, evicted (counted in ``evictions`` and
        ``disk_full_evictions``). Either until their rows add up to
        ``nbytes``. The rows count as punched at once (:meth:`mark_punched`):
        the caller punches them, then gives them back with :meth:`reclaimed`
        (they become free rows of their groups).

        Args:
            group_id: the writer's group (its own free rows and keys are left alone).
            nbytes: disk bytes the write needs (:meth:`growth_nbytes`).
            protect: keys never evicted (those of the writing call).
            keys: evict keys (True) or take free rows (False).
            skip: rows not to take (punched for this write already).

        Returns:
            The rows to punch; ``[]`` when there is none, or, with ``keys``,
            when the evictable keys of other groups hold less than ``nbytes``
            (nothing is evicted then).
        """
        if not keys:
            return self._rows.take_other_free(group_id, nbytes, skip)
        victims = self._keys.victims(nbytes, protect, self._rows.pins, skip_group=group_id)
        if victims is None:
            return []
        refs: list[RowRef] = []
        for key in victims:
            entry = self._keys.lru.pop(key)
            self.evictions += 1
            self.disk_full_evictions += 1
            self._rows.bytes_used -= self._row_nbytes[key.group_id]
            refs.append(entry.ref)
        self._rows.mark_punched(refs)
        return refs

    def unreserve(self, group_id: int) -> None:
        """Give back a reservation of :meth:`reserve` that got no row."""
        self._rows.bytes_used -= self._row_nbytes[group_id]

    def take_free(self, group_id: int, holes: bool = True) -> RowRef | None:
        """Take the lowest free row of a group for a reservation (None: grow first).

        Args:
            group_id: the group.
            holes: whether a punched row may be taken. False: the lowest free
                row that holds its disk blocks, or None when every free row
                is punched (the caller then allocates one first,
                :func:`kvtier.io._files.fill_row`, since on a full filesystem
                a write into a hole fails with ENOSPC; it is then given back
                with :meth:`reclaimed` ``(punched=True)``).
        """
        return self._rows.take_free(group_id, holes)

    def has_row(self, group_id: int) -> bool:
        """Whether a group has a free row that holds its disk blocks (not punched)."""
        return self._rows.has_row(group_id)

    def free_rows(self, group_id: int) -> int:
        """Return the number of free rows of a group."""
        return self._rows.free_rows(group_id)

    @property
    def held_nbytes(self) -> int:
        """Row bytes that hold disk blocks: allocated rows but the punched ones.

        Rows being punched count as punched already (:meth:`mark_punched`).
        """
        return self._table.allocated_nbytes - self._rows.holed_nbytes

    @property
    def growth_held_nbytes(self) -> int:
        """:attr:`held_nbytes` plus the rows whose punch is not done yet.

        What growth plans against: room that a punch in flight has only
        promised is not on disk yet (and the punch may fail).
        """
        return self.held_nbytes + self._rows.promised_nbytes

    @property
    def over_budget(self) -> bool:
        """Whether the rows holding disk blocks exceed ``disk_budget_nbytes``.

        Growth always takes at least one row, so a workload that moves to
        other groups can allocate past the budget while the old groups' free
        rows keep their blocks. The tier then punches rows (stale ones, then
        :meth:`take_to_punch`) until it is back within.
        """
        return self.held_nbytes > self.disk_budget_nbytes

    def punched(self, ref: RowRef) -> bool:
        """Whether an allocated row counts as punched (holds no disk blocks)."""
        return ref in self._rows.holed

    def take_stale(self) -> list[RowRef]:
        """Hand the stale rows to the caller, who blanks their trailers, then :meth:`reclaimed`."""
        return self._rows.take_stale()

    def mark_punched(self, refs: Iterable[RowRef]) -> None:
        """Count rows taken for blanking as punched now, before the I/O.

        So that a concurrent reclaim does not punch for the same excess;
        :meth:`reclaimed` settles it. Until then growth does not count on
        the room they will leave (:attr:`growth_held_nbytes`).
        """
        self._rows.mark_punched(refs)

    def take_to_punch(self, nbytes: int) -> list[RowRef]:
        """Take free rows that hold blocks, at least ``nbytes`` of them, to be punched.

        From the groups with the most free bytes first (the groups the
        workload left), their highest rows first (:meth:`take_free` hands out
        the lowest, which keep their blocks). The rows leave the free rows
        and count as punched at once; give them back with :meth:`reclaimed`.
        """
        return self._rows.take_to_punch(nbytes)

    def reclaimed(self, refs: Iterable[RowRef], punched: bool = False) -> None:
        """Rows from :meth:`take_stale` or :meth:`take_to_punch`, now blank, become free.

        ``punched``: their disk blocks were released (else they hold blocks).
        """
        self._rows.reclaimed(refs, punched)

    @property
    def stale_rows(self) -> int:
        """Rows waiting for :meth:`take_stale`."""
        return len(self._rows.stale)

    # -- writes -----------------------------------------------------------------

    def begin_write(self, key: OffloadKey) -> int:
        """Register a write of ``key`` in flight; return its new sequence number."""
        return self._keys.begin_write(key)

    def abandon_write(self, key: OffloadKey, seq: int) -> None:
        """Forget a write registered by :meth:`begin_write` that never got a row."""
        self._keys.end_write(key, seq)

    def finish_write(self, key: OffloadKey, ref: RowRef, seq: int, start: int, stop: int) -> bool:
        """Publish a completed row write.

        The key becomes visible at ``ref`` unless it was discarded meanwhile or
        a newer write (higher ``seq``) was published; then ``ref`` becomes
        stale. Publishing makes older writes of the key in flight unpublishable
        (even if the key is evicted meanwhile). A replaced older row becomes
        stale (a zombie while a read pins it).

        Returns:
            Whether the row became visible.

        """
        visible, stale = self._keys.publish(key, ref, seq, start, stop)
        if stale is not None:
            self._rows.release(stale)
        return visible

    def fail_write(self, key: OffloadKey, ref: RowRef, seq: int, hole: bool = False) -> None:
        """Forget a failed write; its row becomes stale (it may hold part of a trailer).

        With ``hole``, the row is instead counted as punched at once
        (:meth:`mark_punched`) and left to the caller, who punches it and gives
        it back with :meth:`reclaimed`: for a write that ran out of space, whose
        row may lack disk blocks.
        """
        self._keys.end_write(key, seq)
        if not hole:
            self._rows.release(ref)
            return
        self._rows.bytes_used -= self._row_nbytes[ref.group_id]
        self._rows.mark_punched([ref])

    # -- lookups and reads ------------------------------------------------------

    def lookup(self, key: OffloadKey) -> RowEntry | None:
        """Return the visible entry of a key, or None (does not touch the LRU)."""
        return self._keys.lookup(key)

    def keys(self) -> list[OffloadKey]:
        """All visible keys, groups in id order, least recently used first."""
        return self._keys.keys()

    def lru_keys(self) -> list[OffloadKey]:
        """All visible keys of all groups, least recently used first."""
        return self._keys.lru_keys()

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def rows_pinned(self) -> int:
        """Rows pinned now (by reads in flight and holds), dropped ones included."""
        return len(self._rows.pins)

    def pin(self, key: OffloadKey) -> RowEntry | None:
        """Look up a visible key and pin its row against eviction and reuse until :meth:`unpin`."""
        entry = self._keys.lookup(key)
        if entry is not None:
            self._rows.pin(entry.ref)
        return entry

    def unpin(self, ref: RowRef) -> None:
        """Undo one :meth:`pin`; a row dropped meanwhile becomes stale now."""
        self._rows.unpin(ref)

    def touch(self, key: OffloadKey, rank: int | None = None) -> None:
        """Mark a visible key used, now or at ``rank`` (:meth:`reserve_ranks`)."""
        self._keys.touch(key, rank)

    def reserve_ranks(self, n: int) -> int:
        """Take ``n`` recency numbers now for later touches; the first of them."""
        return self._keys.reserve_ranks(n)

    def drop(self, key: OffloadKey, ref: RowRef | None = None) -> bool:
        """Forget a visible key (only if it is still at ``ref`` when given); its row goes stale.

        Returns:
            Whether the key was dropped.

        """
        entry = self._keys.remove(key, ref)
        if entry is None:
            return False
        self._rows.release(entry.ref)
        return True

    def discard(self, key: OffloadKey) -> None:
        """Forget a key: drop it and keep writes in flight from publishing it."""
        self._keys.pending.pop(key, None)
        self.drop(key)

    # -- the parts' state, read by invariant checks -----------------------------

    @property
    def _free(self) -> dict[int, list[RowRef]]:
        return self._rows.free

    @property
    def _stale(self) -> list[RowRef]:
        return self._rows.stale

    @property
    def _holed(self) -> set[RowRef]:
        return self._rows.holed

    @property
    def _promised(self) -> set[RowRef]:
        return self._rows.promised

    @property
    def _pins(self) -> dict[RowRef, int]:
        return self._rows.pins

    @property
    def _zombies(self) -> set[RowRef]:
        return self._rows.zombies

    @property
    def _lru(self) -> OrderedDict[OffloadKey, RowEntry]:
        return self._keys.lru

    @property
    def _pending(self) -> dict[OffloadKey, set[int]]:
        return self._keys.pending

    @property
    def _seq(self) -> int:
        return self._keys.seq

    @property
    def _segments(self) -> dict[int, dict[int, list[int]]]:
        return self._table.table

    @property
    def _grow_rows(self) -> dict[int, int]:
        return self._table.grow_rows
