"""What the row-moving functions of :mod:`kvtier.io._batches` need from their tier.

:class:`~kvtier.io._tier.NVMeTier` calls the functions of ``_batches`` with
itself; they read and update its state through this protocol, so that
``_batches`` does not import ``_tier`` (which imports ``_batches``) and the
import graph stays acyclic. ``NVMeTier`` satisfies it structurally.
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


class TierState(Protocol):
    """The attributes and helpers of an ``NVMeTier`` that ``_batches`` uses.

    See :class:`~kvtier.io._tier.NVMeTier` for what each one holds.
    """

    digest: bytes
    directory: pathlib.Path
    _layout: dict[str, Any]
    _specs: dict[int, GroupSpec]
    _row_nbytes: dict[int, int]
    _run_rows: dict[int, int]
    _index: RowIndex
    _row_io: RowIO | None
    _aio: SubmittingRowIO | None
    _segments: dict[tuple[int, int], Any]
    _segment_locks: dict[int, asyncio.Lock]
    _dirty: set[tuple[int, int]]
    _unsynced: dict[tuple[int, int], dict[int, OffloadKey]]
    _sync_failures: dict[tuple[int, int], tuple[int, StorageError]]
    _write_epoch: int
    _counts: dict[str, float]
    _grow_ahead: bool
    _ahead_paused: set[int]
    _ahead_failed: set[int]
    _growing: dict[int, asyncio.Future[None]]
    _growth_lock: asyncio.Lock
    _growth_claims: int
    _can_punch: bool
    _punch_frees: bool
    _punch_misses: int
    _punch_lock: asyncio.Lock
    _blanking: set[asyncio.Future[None]]
    _disk_was_full: bool

    def row_nbytes(self, group_id: int) -> int:
        """Bytes of one row of a group."""
        ...

    async def _run(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def _run_checksum(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def _run_meta(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def _run_kept(
        self,
        fn: Callable[..., T],
        calls: Sequence[tuple[Any, ...]],
        keep: Callable[[int, T], None],
    ) -> list[T]: ...

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]: ...
