"""Plain value types of the public API: keys, chunks, residency and results."""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import BlockIdError, ChunkRangeError, InvalidArgumentError
from kvtier.keys import OffloadKey

# OffloadKey is defined in kvtier.keys; the name stays importable from here, so
# that keys pickled by versions that defined it here (kvtier._types) still load.
__all__ = ["OffloadKey"]


class Medium(enum.Enum):
    """Where bytes live: ``GPU``, ``CPU`` (pinned slots) or ``NVME`` (row files)."""

    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"


class Residency(enum.Enum):
    """Where a key can be loaded from right now.

    ``MISS``: nowhere. ``PENDING``: a store or promotion is in flight (a load
    waits for it). ``CPU``: a resident CPU slot. ``NVME``: on NVMe only (a load
    promotes it through a CPU slot).
    """

    MISS = "miss"
    PENDING = "pending"
    CPU = "cpu"
    NVME = "nvme"


def _block_id(value: Any) -> int:
    """``operator.index(value)``, refusing booleans (Python, NumPy and torch bools)."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        raise TypeError(f"{value!r} is a bool, not a block id")
    return operator.index(value)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A chunk transfer request: GPU blocks of one key's sub-blocks.

    Attributes:
        key: the offload key.
        block_ids: GPU block ids of sub-blocks ``offset .. offset+len(block_ids)``
            of the chunk, in order. Partial chunks (``offset > 0`` or fewer than
            ``blocks_per_chunk`` ids) are legal.
        offset: index of the first sub-block inside the chunk (``>= 0``).

    Raises:
        BlockIdError: ``block_ids`` is not an ordered sequence of ints (floats,
            strings, bools, bool tensors and None are rejected, never
            truncated; so are sets and mappings, which have no order).
        ChunkRangeError: ``block_ids`` is empty or ``offset`` negative.

    """

    key: OffloadKey
    block_ids: tuple[int, ...]
    offset: int = 0

    def __init__(self, key: OffloadKey, block_ids: Sequence[int], offset: int = 0) -> None:
        if not isinstance(key, OffloadKey):
            raise InvalidArgumentError(f"Chunk.key must be an OffloadKey, got {type(key).__name__}")
        if (
            isinstance(block_ids, str | bytes | Set | Mapping)  # no order, or not ints
            or not isinstance(block_ids, Iterable)
            or "bool" in str(getattr(block_ids, "dtype", ""))  # a mask, not a block table
        ):
            raise BlockIdError(
                f"Chunk for {key}: block_ids must be an ordered sequence of ints, "
                f"got {block_ids!r:.80}"
            )
        try:
            ids = tuple(b if type(b) is int else _block_id(b) for b in block_ids)
        except TypeError as exc:
            raise BlockIdError(f"Chunk for {key}: block_ids must be ints: {exc}") from None
        if not ids:
            raise ChunkRangeError(f"Chunk for {key} has no block_ids")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ChunkRangeError(f"Chunk for {key}: offset must be an int >= 0, got {offset!r}")
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "block_ids", ids)
        object.__setattr__(self, "offset", offset)

    @property
    def stop(self) -> int:
        """One past the last sub-block index covered (``offset + len(block_ids)``)."""
        return self.offset + len(self.block_ids)


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of :meth:`TransferEngine.store`.

    Attributes:
        stored: keys whose bytes are now in CPU slots (and queued for NVMe).
        skipped: keys already present (CPU, NVMe or in flight); nothing copied.
        rejected: keys that found no free or evictable slot, or whose copy failed.

    """

    stored: tuple[OffloadKey, ...] = ()
    skipped: tuple[OffloadKey, ...] = ()
    rejected: tuple[OffloadKey, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of :meth:`TransferEngine.load`.

    Attributes:
        loaded: keys whose bytes are now in their GPU blocks.
        failed: keys that could not be loaded, with the error; their GPU blocks
            received no bytes from kvtier.

    """

    loaded: tuple[OffloadKey, ...] = ()
    failed: dict[OffloadKey, BaseException] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """Outcome of :meth:`TransferEngine.prefetch`.

    Attributes:
        promoted: keys this call read from NVMe into CPU slots (trailer and
            checksum verified); a load of them is now a CPU hit.
        resident: keys that were in a CPU slot already, or whose store or
            promotion by another call was in flight and has completed.
        failed: keys not in a CPU slot after the call, with the error:
            :class:`~kvtier.errors.KeyNotResidentError` (on no medium, or
            evicted from NVMe before its read), a
            :class:`~kvtier.errors.StorageError` (the read or its checksum
            failed: the row was dropped, the key is a MISS now), or a
            :class:`~kvtier.errors.KVTierError` (no free or evictable slot).

    """

    promoted: tuple[OffloadKey, ...] = ()
    resident: tuple[OffloadKey, ...] = ()
    failed: dict[OffloadKey, BaseException] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClearResult:
    """Outcome of :meth:`TransferEngine.clear`.

    Attributes:
        cpu_dropped: keys dropped from CPU slots (their slots are free now).
        nvme_dropped: keys whose NVMe rows were dropped and blanked
            (``clear(nvme=True)``; 0 otherwise).
        kept: keys left in CPU slots because a :class:`Hold` pins them, or a
            store, load or promotion that started while ``clear`` waited
            still uses them; with ``nvme=True`` also held NVMe-only keys.

    """

    cpu_dropped: int = 0
    nvme_dropped: int = 0
    kept: tuple[OffloadKey, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of engine counters (see :meth:`TransferEngine.stats`).

    Byte counts are in bytes, times in seconds. ``failures`` counts failed
    copies (``"transfer"``) and failed promotions by kind (``"checksum"``,
    ``"eio"``, ...); ``nvme`` holds the NVMe tier's counters (None without NVMe;
    the keys are listed in :meth:`kvtier.io.NVMeTier.stats`: among them
    ``evictions``, the tier's rows evicted for capacity, and
    ``window_evictions``, those of them that skipped an older key of another
    group, see ``NVMeConfig.eviction_window``). ``evictions`` here counts CPU
    slot evictions.

    Attributes:
        num_slots: CPU slots in the pool (``cpu_bytes // slot_nbytes``).
        slot_nbytes: bytes per slot (largest group's chunk + 4 KiB trailer).
        slots_free: slots holding no key.
        slots_writing: slots reserved by a store (or promotion) whose copy is
            in flight; not readable yet.
        slots_resident: slots holding a key that may be evicted now.
        slots_pinned: slots holding a key that may not be evicted now: a
            load copies from it, its NVMe row is queued or being written
            (write-through), or a :class:`~kvtier.Hold` holds it. A store
            that finds every slot writing or pinned rejects its keys;
            ``await engine.flush()`` waits until the rows are written and
            their slots evictable again.
        keys_per_group: resident keys per group id (pinned included; keys whose
            store is still copying are not).
        payload_nbytes: payload bytes of the keys in slots.
        reserved_nbytes: ``slot_nbytes`` times occupied slots.
        slot_waste_nbytes: ``reserved_nbytes - payload_nbytes``.
        hits: keys a load found in a CPU slot.
        nvme_hits: keys a load found only on NVMe and promoted into a CPU
            slot (a hit rate over both tiers is
            ``(hits + nvme_hits) / (hits + nvme_hits + misses)``). Both
            count a key once it is in a CPU slot for the load, before the
            copy to the GPU: a load cancelled after that counts too (its
            promoted keys stay in CPU slots; loading them again counts them
            in ``hits``).
        misses: keys a load found on no medium (or without the requested
            sub-blocks).
        evictions: keys evicted from CPU slots.
        rejected: keys a store, or a promotion (load or prefetch of a key on
            NVMe only), could not place: no free or evictable slot. A
            rejected promotion leaves the row on NVMe.
        store_bytes: payload bytes copied device -> CPU (``store_seconds``:
            summed job time).
        load_bytes: payload bytes copied CPU -> device (``load_seconds``).
        store_jobs: copy jobs run per direction (``load_jobs`` likewise).
        load_failures: keys a load failed after finding them (copy or
            promotion errors; a cancelled load counts none).
        pinned_memory: the pool is page-locked (CUDA hosts).
        holds_dropped: :class:`~kvtier.Hold` s garbage-collected without
            ``release()`` (the engine released them then; the first one is
            logged as a warning).
    """

    num_slots: int
    slot_nbytes: int
    slots_free: int
    slots_writing: int
    slots_resident: int
    slots_pinned: int
    keys_per_group: dict[int, int]
    payload_nbytes: int
    reserved_nbytes: int
    slot_waste_nbytes: int
    hits: int
    misses: int
    evictions: int
    rejected: int
    store_bytes: int
    store_seconds: float
    load_bytes: int
    load_seconds: float
    store_jobs: int
    load_jobs: int
    load_failures: int
    pinned_memory: bool
    nvme: dict[str, object] | None = None
    failures: dict[str, int] = field(default_factory=dict)
    nvme_hits: int = 0
    holds_dropped: int = 0
