"""The engine's counters and the :class:`~kvtier.EngineStats` snapshot made of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier._slots import SlotPool, SlotState
from kvtier._transfer import ChunkCopy
from kvtier._types import EngineStats


@dataclass
class Counters:
    """What the engine counts since its start (see :class:`~kvtier.EngineStats`)."""

    hits: int = 0
    nvme_hits: int = 0
    misses: int = 0
    rejected: int = 0
    load_failures: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_jobs: int = 0
    load_jobs: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def count_job(
        self,
        direction: str,
        plan: Sequence[ChunkCopy],
        seconds: float,
        error: BaseException | None,
    ) -> None:
        """Count one copy job.

        Args:
            direction: ``"store"`` or ``"load"``.
            plan: the job's copies (their ``nbytes`` are counted).
            seconds: the job's wall time.
            error: the job's error, if it failed (counted as a ``transfer`` failure).
        """
        nbytes = sum(c.nbytes for c in plan)
        if error is not None:
            self.failures["transfer"] = self.failures.get("transfer", 0) + 1
        if direction == "store":
            self.store_jobs += 1
            self.store_bytes += nbytes
            self.store_seconds += seconds
        else:
            self.load_jobs += 1
            self.load_bytes += nbytes
            self.load_seconds += seconds


def engine_stats(
    pool: SlotPool,
    c: Counters,
    *,
    slot_nbytes: int,
    pinned_memory: bool,
    nvme: dict[str, Any] | None,
    holds_dropped: int,
) -> EngineStats:
    """A snapshot of the pool's slots and the counters (never blocks).

    The slot figures come from one pass over the pool, so they add up to
    ``num_slots`` also when another thread (a metrics scrape) reads them while
    the engine's loop runs.

    Args:
        pool: the engine's slot pool.
        c: the engine's counters.
        slot_nbytes: bytes per CPU slot.
        pinned_memory: whether the host region is page-locked.
        nvme: the NVMe tier's counters, or None without a tier.
        holds_dropped: holds garbage-collected unreleased.
    """
    num_slots = pool.num_slots
    per_group: dict[int, int] = {}
    payload = 0
    states = dict.fromkeys(SlotState, 0)
    for e in list(pool.entries()):  # one snapshot: a scrape thread may read mid-change
        state = e.state
        states[state] += 1
        payload += e.payload_nbytes
        if state is not SlotState.WRITING:
            g = e.key.group_id
            per_group[g] = per_group.get(g, 0) + 1
    occupied = sum(states.values())
    return EngineStats(
        num_slots=num_slots,
        slot_nbytes=slot_nbytes,
        slots_free=num_slots - occupied,
        slots_writing=states[SlotState.WRITING],
        slots_resident=states[SlotState.RESIDENT],
        slots_pinned=states[SlotState.PINNED],
        keys_per_group=dict(sorted(per_group.items())),
        payload_nbytes=payload,
        reserved_nbytes=occupied * slot_nbytes,
        slot_waste_nbytes=occupied * slot_nbytes - payload,
        hits=c.hits,
        misses=c.misses,
        evictions=pool.evictions,
        rejected=c.rejected,
        store_bytes=c.store_bytes,
        store_seconds=c.store_seconds,
        load_bytes=c.load_bytes,
        load_seconds=c.load_seconds,
        store_jobs=c.store_jobs,
        load_jobs=c.load_jobs,
        load_failures=c.load_failures,
        pinned_memory=pinned_memory,
        nvme=nvme,
        failures=dict(c.failures),
        nvme_hits=c.nvme_hits,
        holds_dropped=holds_dropped,
    )
