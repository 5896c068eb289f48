"""Holds: keys a caller keeps from eviction, and the registry of their pins.

:class:`Hold` is what :meth:`kvtier.TransferEngine.hold` returns. The
:class:`HoldRegistry` records every hold not yet released and which NVMe rows
they hold; it pins and unpins CPU slots in the engine's
:class:`~kvtier._slots.SlotPool`. Its :meth:`HoldRegistry.promoted` is the
callback the NVMe writer is handed: a key promoted from a held row gets its
new slot pinned too. Releasing is split as a state machine: the registry
updates its records and returns the NVMe row refs to release, which the
engine hands to the tier.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Self

from kvtier._slots import SlotPool
from kvtier._types import OffloadKey, Residency

log = logging.getLogger("kvtier")


def leading(residency: Iterable[Residency], counted: tuple[Residency, ...]) -> int:
    """How many leading entries of ``residency`` are in ``counted`` (a prefix hit count)."""
    return sum(1 for _ in itertools.takewhile(lambda r: r in counted, residency))


def _no_release(held: Hold) -> None:
    """What a released hold's release calls: nothing."""


def _no_drop(pins: Pins) -> None:
    """What a released hold's collection calls: nothing."""


class Hold:
    """Keys that :meth:`TransferEngine.hold` keeps from eviction until :meth:`release`.

    A key in a CPU slot is pinned there (``EngineStats.slots_pinned`` counts
    it) and a key only on NVMe has its row pinned: neither is evicted, nor
    its slot or row reused, until the hold is released. A held NVMe-only key
    keeps its row, not a CPU slot: its load still needs a free or evictable
    slot to promote it into; once a load or prefetch has promoted it, the
    hold pins that slot too (until the release). A context manager: ``with engine.hold(keys) as
    held: ...`` releases on exit. A hold that is garbage-collected before
    its release (the last reference dropped, e.g. by a request aborted
    between its admission and its load) is released then, on the engine's
    loop: a forgotten hold does not pin its keys for the rest of the
    engine's life (``EngineStats.holds_dropped`` counts them; the engine's
    first is logged as a warning). The release runs at the loop's next
    iteration (``release()`` at once); a hold in a reference cycle waits for
    the cyclic collector. A hold cannot be copied or pickled (a copy would
    release the same pins).

    Attributes:
        keys: the keys asked for, in call order.
        residency: where each key was at the call: ``CPU`` and ``NVME`` keys
            are held; ``PENDING`` ones (a store or promotion in flight) and
            ``MISS`` ones are not.
        pins: what the hold pinned (the engine unpins it once).
    """

    __slots__ = ("__weakref__", "_dropped_fn", "_live", "_release_fn", "keys", "pins", "residency")

    def __init__(
        self,
        release: Callable[[Hold], None],
        dropped: Callable[[Pins], None],
        keys: tuple[OffloadKey, ...],
        residency: tuple[Residency, ...],
        cpu: list[OffloadKey],
        rows: list[tuple[OffloadKey, Any]],
    ) -> None:
        """Made by the engine's ``hold()``.

        Args:
            release: the engine's release of a hold (its loop thread).
            dropped: what a hold garbage-collected unreleased calls with its
                pins (any thread; the engine schedules the release on its loop).
            keys: the keys asked for.
            residency: where each one was at the call.
            cpu: the keys whose slots this hold pinned.
            rows: ``(key, row ref)`` of the NVMe rows it pinned.
        """
        self._live = True
        self._release_fn = release
        self._dropped_fn = dropped
        self.pins = Pins(cpu, rows)
        self.keys = keys
        self.residency = residency

    @property
    def prefix_hits(self) -> int:
        """Leading keys this hold holds (``CPU`` or ``NVME``).

        Unlike :meth:`TransferEngine.prefix_hits` it stops at a ``PENDING``
        key too: a key whose store is in flight is not held, and may be
        evicted before the load.
        """
        return leading(self.residency, (Residency.CPU, Residency.NVME))

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran (or the engine closed)."""
        return not self._live

    def detach(self) -> bool:
        """Mark the hold released, once: True the first time (the engine then unpins ``pins``)."""
        live, self._live = self._live, False
        # A released hold keeps no reference to its engine.
        self._release_fn, self._dropped_fn = _no_release, _no_drop
        return live

    def route_release(self, route: Callable[[Callable[[Hold], None], Hold], None]) -> None:
        """Have :meth:`release` call ``route(engine_release, self)`` instead.

        :class:`BackgroundEngine` routes the release to its engine thread this way.
        """
        inner = self._release_fn
        self._release_fn = lambda held: route(inner, held)

    def release(self) -> None:
        """Let the held keys be evicted again. Idempotent; nothing to do after the engine closed.

        Raises:
            WrongThreadError: called from another thread than the engine's
                (nothing released). A :class:`BackgroundEngine`'s hold may be
                released from any thread.
        """
        if self._live:
            self._release_fn(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<kvtier.Hold of {len(self.keys)} keys, {state}>"

    def __copy__(self) -> Hold:
        raise TypeError("a kvtier.Hold cannot be copied: each hold is released once")

    def __deepcopy__(self, memo: object) -> Hold:
        raise TypeError("a kvtier.Hold cannot be copied: each hold is released once")

    def __reduce__(self) -> Any:
        raise TypeError("a kvtier.Hold cannot be pickled: its pins live in one engine")

    def __del__(self) -> None:
        # Dropped unreleased: the engine releases its pins on its loop. No
        # module globals here: at interpreter shutdown they may be None already.
        if self._live:
            try:  # noqa: SIM105 - contextlib may be None at interpreter shutdown
                self._dropped_fn(self.pins)
            except Exception:  # a closed loop; interpreter shutdown
                pass


class Pins:
    """What one :class:`Hold` pinned, released once (on the engine's loop thread).

    ``cpu``: keys whose slots it pinned (at the call, and NVMe-only keys
    promoted since: :meth:`HoldRegistry.promoted`); ``rows``: ``(key,
    row ref)`` of the NVMe rows it pinned.
    """

    __slots__ = ("cpu", "released", "rows")

    def __init__(self, cpu: list[OffloadKey], rows: list[tuple[OffloadKey, Any]]) -> None:
        self.cpu = cpu
        self.rows = rows
        self.released = False


class HoldRegistry:
    """The holds of one engine not yet released, and the NVMe rows they hold.

    Loop thread only (a garbage-collected hold is released there too).

    Args:
        pool: the engine's slot pool, whose slots holds pin.

    Attributes:
        dropped: holds garbage-collected unreleased (then released).
    """

    def __init__(self, pool: SlotPool) -> None:
        self._pool = pool
        # Weak: a dropped hold is garbage-collected, and its __del__ has the
        # engine release its pins.
        self._holds: weakref.WeakSet[Hold] = weakref.WeakSet()
        self.dropped = 0
        # NVMe-only keys held by their rows -> {hold: times it lists the key}: a
        # promotion pins the new slot too. A dict, so ending one of many holds
        # of a shared prefix key costs O(1), not a scan of the others.
        self._row_holds: dict[OffloadKey, dict[Pins, int]] = {}

    def add(self, held: Hold) -> None:
        """Record a new hold (its CPU slots are pinned already) and the rows it holds."""
        pins = held.pins
        for key, _ in pins.rows:
            holders = self._row_holds.setdefault(key, {})
            holders[pins] = holders.get(pins, 0) + 1
        self._holds.add(held)

    def live(self) -> list[Hold]:
        """The holds not yet released."""
        return list(self._holds)

    def discard(self, held: Hold) -> None:
        """Forget ``held`` (its pins are released by :meth:`release`)."""
        self._holds.discard(held)

    def release(self, pins: Pins, *, closed: bool) -> list[Any] | None:
        """Unpin a hold's slots once; return the NVMe row refs to release, or None if done already.

        Both ways a hold ends (``Hold.release()``, and a garbage-collected
        hold's scheduled release) come here, so that a hold released at the
        close while its ``__del__`` runs on another thread is released once.

        Args:
            pins: what the hold pinned.
            closed: the engine is closed: the pool and the tier are gone,
                nothing is unpinned (an empty list is returned).
        """
        if pins.released:
            return None
        pins.released = True
        for key, _ in pins.rows:
            holders = self._row_holds.get(key)
            if holders is not None:
                holders.pop(pins, None)
                if not holders:
                    del self._row_holds[key]
        if closed:
            return []
        for key in pins.cpu:
            self._pool.unpin(key)
        return [ref for _, ref in pins.rows]

    def count_dropped(self) -> None:
        """A garbage-collected hold was released: count it, warn the first time."""
        self.dropped += 1
        if self.dropped == 1:
            with contextlib.suppress(Exception):  # a log handler that raises changes nothing
                log.warning(
                    "a kvtier.Hold was garbage-collected without release(): released it; "
                    "call release() or use it as a context manager (later ones are "
                    "counted in stats().holds_dropped, not logged)"
                )

    def promoted(self, key: OffloadKey) -> None:
        """``key`` was promoted into a slot (committed, loop thread): holds of its row pin the slot.

        So a held key that a load or prefetch brought in from NVMe stays in
        its CPU slot until the hold is released, as a key held in a slot does.
        The NVMe writer is handed this method as its promotion callback.
        """
        holders = self._row_holds.get(key)
        if holders is None:  # the common case: no hold of its row
            return
        for pins, times in holders.items():
            for _ in range(times):
                self._pool.pin(key)
                pins.cpu.append(key)
