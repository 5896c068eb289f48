"""What each row-moving module of the NVMe tier needs from its tier: one protocol per module.

:class:`~kvtier.io._tier.NVMeTier` calls the functions of :mod:`~kvtier.io._writes`,
:mod:`~kvtier.io._reads`, :mod:`~kvtier.io._growth`, :mod:`~kvtier.io._disk_space`,
:mod:`~kvtier.io._blanking` and :mod:`~kvtier.io._requests` with itself;
they read and update its state through these protocols, so that none of them
imports ``_tier`` (which imports them) and the import graph stays acyclic.
``NVMeTier`` satisfies each one structurally; the attributes stay on it.

Each protocol declares what its module's functions use, and extends the
protocols of the modules whose functions they call with the tier (a growth
reclaims first: :class:`GrowthState` extends :class:`BlankingState`). The
state a protocol lists under ``# owned``, of these modules, only its own
uses (``NVMeTier`` initialises it); the rest is shared, or configuration. The modules
import one way: ``_requests`` and ``_blanking`` below ``_growth``, below
``_disk_space``, below ``_writes``; ``_reads`` uses ``_requests`` and
``_blanking``.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from kvtier.errors import StorageError
from kvtier.io._files import GroupSpec
from kvtier.io._index import RowIndex
from kvtier.io._rowio import RowIO, SubmittingRowIO
from kvtier.keys import OffloadKey

T = TypeVar("T")


class RequestState(Protocol):
    """What :mod:`~kvtier.io._requests` uses: failure counts, run lengths, row sizes.

    See :class:`~kvtier.io._tier.NVMeTier` for what each one holds.
    """

    _counts: dict[str, float]
    _run_rows: dict[int, int]

    def row_nbytes(self, group_id: int) -> int:
        """Bytes of one row of a group."""
        ...


class BlankingState(Protocol):
    """What :mod:`~kvtier.io._blanking` uses: the index, the segments, blanking in flight.

    See :class:`~kvtier.io._tier.NVMeTier` for what each one holds.
    """

    _index: RowIndex
    _specs: dict[int, GroupSpec]
    _row_io: RowIO | None
    _segments: dict[tuple[int, int], Any]
    _dirty: set[tuple[int, int]]
    _write_epoch: int
    _counts: dict[str, float]
    _can_punch: bool
    # owned
    _blanking: set[asyncio.Future[None]]

    async def _run_meta(self, fn: Callable[..., T], *args: Any) -> T: ...


class GrowthState(BlankingState, Protocol):
    """What :mod:`~kvtier.io._growth` uses: the segment files, growths and their claims.

    A growth that succeeds resets the punch bookkeeping of
    :mod:`~kvtier.io._disk_space` (``_punch_frees``, ``_punch_misses``).
    See :class:`~kvtier.io._tier.NVMeTier` for what each one holds.
    """

    digest: bytes
    directory: pathlib.Path
    _layout: dict[str, Any]
    _segment_locks: dict[int, asyncio.Lock]
    _growing: dict[int, asyncio.Future[None]]
    _punch_frees: bool
    _punch_misses: int
    _grow_ahead: bool
    # owned
    _ahead_paused: set[int]
    _ahead_failed: set[int]
    _growth_lock: asyncio.Lock
    _growth_claims: int

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]: ...


class DiskSpaceState(GrowthState, Protocol):
    """What :mod:`~kvtier.io._disk_space` uses: the punch lock, besides a growth's state.

    The punch lock is shared with :mod:`~kvtier.io._writes` (allocations wait
    for it once the filesystem was full), and the punch bookkeeping with
    :mod:`~kvtier.io._growth` (:class:`GrowthState`).
    See :class:`~kvtier.io._tier.NVMeTier` for what each one holds.
    """

    _punch_lock: asyncio.Lock


class WriteState(DiskSpaceState, RequestState, Protocol):
    """What :mod:`~kvtier.io._writes` uses: row sizes, the backends, what syncs cover.

    See :class:`~kvtier.io._tier.NVMeTier` for what each one holds.
    """

    _row_nbytes: dict[int, int]
    _aio: SubmittingRowIO | None
    # kept with NVMeTier's syncs: the keys published since a segment's last sync,
    # and its failed syncs (a row written while one failed is not published)
    _unsynced: dict[tuple[int, int], dict[int, OffloadKey]]
    _sync_failures: dict[tuple[int, int], tuple[int, StorageError]]
    # owned
    _disk_was_full: bool

    async def _run(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def _run_checksum(self, fn: Callable[..., T], *args: Any) -> T: ...


class ReadState(BlankingState, RequestState, Protocol):
    """What :mod:`~kvtier.io._reads` uses: the backends and the tier's directory.

    See :class:`~kvtier.io._tier.NVMeTier` for what each one holds.
    """

    directory: pathlib.Path
    _aio: SubmittingRowIO | None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def _run_checksum(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def _run_kept(
        self,
        fn: Callable[..., T],
        calls: Sequence[tuple[Any, ...]],
        keep: Callable[[int, T], None],
    ) -> list[T]: ...
