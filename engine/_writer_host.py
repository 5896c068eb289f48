"""What the NVMe writer (:mod:`kvtier._writeback`) needs from the engine it serves.

:class:`~kvtier._engine.TransferEngine` creates its
:class:`~kvtier._writeback.NVMeWriter` with itself; the writer reads the
engine's layout and slot pool through this protocol, so that ``_writeback``
does not import ``_engine`` (which imports ``_writeback``) and the import
graph stays acyclic. ``TransferEngine`` satisfies it structurally.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from kvtier._config import EngineConfig
from kvtier._slots import HostRegion, SlotPool
from kvtier.keys import OffloadKey
from kvtier.layout import KVLayout


class WriterCounters(Protocol):
    """The engine counters the writer updates (see :class:`~kvtier.EngineStats`)."""

    rejected: int
    failures: dict[str, int]


class WriterHost(Protocol):
    """The parts of a ``TransferEngine`` that its NVMe writer uses."""

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (``config.nvme`` is set)."""
        ...

    @property
    def layout(self) -> KVLayout:
        """The engine's KV layout."""
        ...

    @property
    def blocks_per_chunk(self) -> int:
        """GPU blocks per chunk."""
        ...

    @property
    def slot_nbytes(self) -> int:
        """Bytes per CPU slot."""
        ...

    @property
    def _pool(self) -> SlotPool: ...

    @property
    def _region(self) -> HostRegion | None: ...

    @property
    def _ready(self) -> dict[OffloadKey, asyncio.Future[bool]]: ...

    @property
    def _c(self) -> WriterCounters: ...
