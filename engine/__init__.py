"""kvtier: an asyncio transfer engine for LLM KV caches (GPU, pinned CPU slots, NVMe)."""

from kvtier._types import (
    Chunk,
    EngineStats,
    LoadResult,
    Medium,
    OffloadKey,
    Residency,
    StoreResult,
)
from kvtier.errors import EngineClosedError, KVTierError

__all__ = [
    "Chunk",
    "EngineClosedError",
    "EngineStats",
    "KVTierError",
    "LoadResult",
    "Medium",
    "OffloadKey",
    "Residency",
    "StoreResult",
]
