"""Eviction policies for the CPU slot pool: ``lru`` (default) and ``arc``.

A policy only orders resident keys; the slot pool decides which of them are
evictable (resident, not pinned, not part of the current call).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Protocol, runtime_checkable

from kvtier.errors import ConfigError


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders resident keys for eviction. Implementations are synchronous and not thread-safe."""

    def insert(self, key: Hashable) -> None:
        """A key became resident."""

    def touch(self, key: Hashable) -> None:
        """A resident key was hit (loaded or stored again).

        A policy may also have ``refresh(key)``: a prefetch hint that the key
        is needed soon, which must not count as an access (without it the
        pool calls ``touch``); ``insert_hint(key)``: a prefetch made the key
        resident (without it the pool calls ``insert``); and
        ``first_use(key)``: the first load of such a key (without it the pool
        calls ``refresh``).
        """

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        """A key left the tier; ``evicted`` is True when the policy chose it."""

    def candidates(self) -> Iterator[Hashable]:
        """Resident keys, the best victim first.

        The iterator may be lazy: it is valid until the policy is next changed
        (the pool picks its victims before it removes any).
        """


class LRUPolicy:
    """Least recently used: the key whose last insert/touch is oldest goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        """Mark ``key`` most recently used."""
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        """Mark ``key`` most recently used (no-op when absent)."""
        if key in self._order:
            self._order.move_to_end(key)

    def refresh(self, key: Hashable) -> None:
        """A hint that ``key`` is needed soon: for LRU the same as :meth:`touch`."""
        self.touch(key)

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        """Forget ``key``."""
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        """Keys from least to most recently used (lazy: O(victims), not O(keys))."""
        return iter(self._order)


class ARCPolicy:
    """Adaptive Replacement Cache.

    From Megiddo & Modha, FAST 2003, "ARC: A Self-Tuning, Low Overhead
    Replacement Cache", Fig. 4.

    ``T1`` holds keys seen once, ``T2`` keys seen at least twice; the ghost lists
    ``B1``/``B2`` remember recently evicted keys and steer the target size
    ``p`` of ``T1``. Pinned keys are skipped by the pool, so the victim may come
    from the other list when the preferred one has nothing evictable.

    Args:
        capacity: the cache size ``c`` in keys (the number of slots), ``> 0``.

    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError(f"ARC capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self.hinted_ghosts: dict[Hashable, bool] = {}
        """Keys a prefetch brought back from a ghost list, not loaded yet -> was it ``B1``."""

    def insert(self, key: Hashable) -> None:
        """A new resident key: into ``T2`` when a ghost hit, else ``T1`` (adapts ``p``)."""
        if key in self.t1 or key in self.t2:
            self.touch(key)
            return
        if key in self.b1 or key in self.b2:
            self._ghost_hit(key, key in self.b1)
            (self.b1 if key in self.b1 else self.b2).pop(key)
        else:
            self.t1[key] = None

    def _ghost_hit(self, key: Hashable, in_b1: bool) -> None:
        """Fig. 4 cases II and III: adapt ``p`` towards the list that missed it; into ``T2``."""
        b1, b2 = len(self.b1) or 1, len(self.b2) or 1
        if in_b1:
            self.p = min(float(self.capacity), self.p + max(b2 / b1, 1.0))
        else:
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))
        self.t2[key] = None

    def insert_hint(self, key: Hashable) -> None:
        """A prefetch made ``key`` resident: the MRU end of ``T1``, not a use.

        A key remembered in a ghost list leaves it, and its ghost hit is
        applied only at its first load (:meth:`first_use`); an unused prefetch
        neither adapts ``p`` nor puts the key among the frequently used.
        """
        if key in self.t1 or key in self.t2:
            self.refresh(key)
            return
        for ghost, in_b1 in ((self.b1, True), (self.b2, False)):
            if key in ghost:
                del ghost[key]
                self.hinted_ghosts[key] = in_b1
        self.t1[key] = None

    def first_use(self, key: Hashable) -> None:
        """The first load of a prefetched key: its ghost hit if it had one, else a refresh."""
        in_b1 = self.hinted_ghosts.pop(key, None)
        if in_b1 is None or key not in self.t1:
            self.refresh(key)
            return
        del self.t1[key]
        ghost = self.b1 if in_b1 else self.b2
        ghost[key] = None  # counted in its ghost list, as insert() counts it
        self._ghost_hit(key, in_b1)
        del ghost[key]

    def touch(self, key: Hashable) -> None:
        """A hit moves ``key`` to the MRU end of ``T2``."""
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def refresh(self, key: Hashable) -> None:
        """A hint that ``key`` is needed soon: MRU end of its own list (not an access)."""
        for live in (self.t1, self.t2):
            if key in live:
                live.move_to_end(key)
                return

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        """Drop ``key``; an evicted key is remembered in its ghost list.

        A prefetched ghost never loaded goes back to the ghost list it came from.
        """
        in_b1 = self.hinted_ghosts.pop(key, None)
        if in_b1 is not None and key in self.t1:
            del self.t1[key]
            ghost = self.b1 if in_b1 else self.b2
            ghost[key] = None
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
            return
        for live, ghost in ((self.t1, self.b1), (self.t2, self.b2)):
            if key in live:
                del live[key]
                if evicted:
                    ghost[key] = None
                    while len(ghost) > self.capacity:
                        ghost.popitem(last=False)
                return

    def candidates(self) -> Iterator[Hashable]:
        """LRU of ``T1`` first when ``|T1| > p`` (else ``T2`` first), then the other list."""
        first, second = (
            (self.t1, self.t2) if len(self.t1) > self.p or not self.t2 else (self.t2, self.t1)
        )
        return itertools.chain(first, second)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build a policy by name.

    Args:
        name: ``"lru"`` or ``"arc"``.
        capacity: slots in the pool (used by ARC).

    Raises:
        ConfigError: unknown name.

    """
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    raise ConfigError(f"unknown eviction policy {name!r} (expected 'lru' or 'arc')")
