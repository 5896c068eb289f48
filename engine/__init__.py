"""kvtier: an asyncio transfer engine for LLM KV caches (GPU, pinned CPU slots, NVMe).

Public names are re-exported here once; see DESIGN.md section 6.
"""

from kvtier._background import BackgroundEngine
from kvtier._config import EngineConfig, NVMeConfig
from kvtier._engine import TransferEngine
from kvtier._holds import Hold
from kvtier._policy import ARCPolicy, EvictionPolicy, LRUPolicy
from kvtier._types import (
    Chunk,
    ClearResult,
    EngineStats,
    LoadResult,
    Medium,
    PrefetchResult,
    Residency,
    StoreResult,
)
from kvtier.errors import EngineClosedError, KVTierError
from kvtier.keys import OffloadKey
from kvtier.layout import KVLayout

__all__ = [
    "ARCPolicy",
    "BackgroundEngine",
    "Chunk",
    "ClearResult",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "EvictionPolicy",
    "Hold",
    "KVLayout",
    "KVTierError",
    "LRUPolicy",
    "LoadResult",
    "Medium",
    "NVMeConfig",
    "OffloadKey",
    "PrefetchResult",
    "Residency",
    "StoreResult",
    "TransferEngine",
]
