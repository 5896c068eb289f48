"""Scheduler side: kvtier's slot pool and eviction policy behind vLLM's ``OffloadingManager``.

Every call answers from the residency state held on the scheduler thread
(:class:`~kvtier._slots.SlotPool`, keyed by vLLM's packed ``OffloadKey``
bytes) and never waits for I/O. NVMe work (write-through after a store,
promotion of a key found only on NVMe) is handed to the tier's own thread
(:class:`~kvtier.vllm._nvme.NVMeSide`); its results are applied at the start
of the next call.

Slot states seen by vLLM: a reserved slot (store copy in flight, or
promotion read in flight) answers ``HIT_PENDING``; a committed slot
``HIT``. Write-through pins a committed slot until its row is written, as
the standalone engine does.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.base import OffloadKey as VKey
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier._policy import make_policy
from kvtier._slots import SlotPool
from kvtier._types import OffloadKey
from kvtier.vllm._nvme import NVMeSide

METRIC_HITS = "vllm:kvtier_offload_hits"
METRIC_NVME_BYTES = "vllm:kvtier_offload_nvme_bytes"
METRIC_NVME_SECONDS = "vllm:kvtier_offload_nvme_seconds"
METRIC_FAILURES = "vllm:kvtier_offload_nvme_failures"
METRIC_SLOTS_USED = "vllm:kvtier_offload_cpu_slots_used_perc"


def nvme_key(key: VKey) -> OffloadKey:
    """Kvtier's ``OffloadKey`` of vLLM's packed key (block hash + 4-byte big-endian group)."""
    return OffloadKey(bytes(key[:-4]), int.from_bytes(key[-4:], "big"))


class KVTierOffloadingManager(OffloadingManager):
    """vLLM's scheduler-side offloading manager over kvtier's slot pool.

    Args:
        num_slots: CPU slots (from the worker's slot description).
        eviction: ``"lru"`` or ``"arc"``.
        enable_events: collect :class:`OffloadingEvent` s for :meth:`take_events`.
        nvme: the NVMe side, or None for a CPU-only tier.
        blocks_per_chunk: GPU blocks per chunk (the stored range of a key).
    """

    def __init__(
        self,
        num_slots: int,
        eviction: str,
        *,
        enable_events: bool,
        nvme: NVMeSide | None,
        blocks_per_chunk: int,
    ) -> None:
        self._pool = SlotPool(num_slots, make_policy(eviction, num_slots))
        self._nvme = nvme
        self._bpc = blocks_per_chunk
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._promoting: set[VKey] = set()  # slots reserved for a read in flight
        self._from_nvme: set[VKey] = set()  # promoted and not loaded since
        self._io_pinned: dict[VKey, int] = {}  # write-through pins in flight
        self._detached: set[VKey] = set()  # dropped by reset_cache, I/O still in flight
        self._hits = {"cpu": 0, "nvme": 0}
        # Keys answered HIT / HIT_PENDING in this scheduler step: a promotion
        # never evicts them (the request that looked them up may load them).
        self._step_keys: set[VKey] = set()
        self._last_counts: dict[str, float] = {}
        self._last_failures = 0

    # -------------------------------------------------------------- NVMe results
    def _drain(self) -> None:
        nvme = self._nvme
        if nvme is None or not nvme.done:
            return
        pool = self._pool
        done = nvme.done
        while done:
            kind, key, _, res = done.popleft()
            if kind == "written":
                left = self._io_pinned[key] - 1
                if left:
                    self._io_pinned[key] = left
                else:
                    del self._io_pinned[key]
                pool.unpin(key)
                if key in self._detached and key not in self._io_pinned:
                    self._detached.discard(key)
                    entry = pool.get(key)
                    if entry is not None and not entry.refs:
                        pool.drop(key)
                continue
            self._promoting.discard(key)
            if key in self._detached or isinstance(res, BaseException):
                # corrupt, short or evicted row: the tier dropped it; a MISS from now on
                self._detached.discard(key)
                pool.abort(key)
                continue
            entry = pool.get(key)
            assert entry is not None
            entry.start, entry.stop = res
            pool.commit(key, hint=True)
            self._from_nvme.add(key)
            if self._events is not None:
                self._events.append(OffloadingEvent(keys=[key], medium=Medium.CPU, removed=False))

    # -------------------------------------------------------------- OffloadingManager
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Every request is offloaded chunk by chunk (vLLM's default policy)."""
        return RequestOffloadingContext()

    def lookup(self, key: VKey, req_context: ReqContext) -> LookupResult:
        """Answer from the residency state; never blocks.

        ``HIT`` only for a key committed in a CPU slot; ``HIT_PENDING`` for a
        slot whose store copy or promotion read is in flight. An NVMe-only
        key starts its promotion and is ``HIT_PENDING`` until its row is read
        and verified (then ``HIT``) or failed (then ``MISS``).
        """
        self._drain()
        entry = self._pool.get(key)
        if entry is not None:
            if key in self._detached:
                return LookupResult.MISS
            self._step_keys.add(key)
            return LookupResult.HIT_PENDING if entry.writing else LookupResult.HIT
        nvme = self._nvme
        if nvme is None:
            return LookupResult.MISS
        nkey = nvme_key(key)
        rng = nvme.tier.stored_range(nkey)
        if rng is None:
            return LookupResult.MISS
        self._step_keys.add(key)
        reserved, _, evicted = self._pool.reserve(
            [(key, rng[0], rng[1], 0)], protect=self._step_keys
        )
        if not reserved:
            self._step_keys.discard(key)
            return LookupResult.MISS  # no slot to promote into: recompute
        self._evicted(evicted)
        self._promoting.add(key)
        nvme.promote(key, nkey, reserved[0].slot)
        return LookupResult.HIT_PENDING

    def get_load_source(self, key: VKey, req_context: ReqContext) -> CacheHitSource:
        """Where a ``HIT`` came from: the host slots (NVMe hits are promoted there first)."""
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[VKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the keys' slots until :meth:`complete_load`; their slot ids in key order.

        Raises:
            kvtier._slots.SlotStateError: a key is not committed in a slot
                (vLLM asks only for keys its lookup reported as HIT).
        """
        self._drain()
        pool = self._pool
        slots = []
        for key in keys:
            slots.append(pool.pin(key).slot)
            if key in self._from_nvme:
                self._from_nvme.discard(key)
                self._hits["nvme"] += 1
            else:
                self._hits["cpu"] += 1
        return CPULoadStoreSpec(slots)

    def touch(self, keys: Collection[VKey], req_context: ReqContext) -> None:
        """Mark keys used, the last first, so the first key ends most recently used."""
        pool = self._pool
        for key in reversed(list(keys)):
            if pool.get(key) is not None:
                pool.touch(key)

    def complete_load(self, keys: Collection[VKey], req_context: ReqContext) -> None:
        """Drop the pins of :meth:`prepare_load`."""
        for key in keys:
            self._pool.unpin(key)

    def prepare_store(
        self, keys: Collection[VKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not present; report the keys it evicted.

        Keys already present (in any state) are skipped; no key of the call
        is evicted for another. Keys that find no free or evictable slot are
        left out of ``keys_to_store``; None when none of the new keys found one.
        """
        self._drain()
        pool = self._pool
        keys = list(keys)
        new = [key for key in keys if pool.get(key) is None]
        if not new:
            return PrepareStoreOutput(
                keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[]
            )
        bpc = self._bpc
        reserved, _, evicted = pool.reserve([(k, 0, bpc, 0) for k in new], protect=set(keys))
        if not reserved:
            return None
        self._evicted(evicted)
        return PrepareStoreOutput(
            keys_to_store=[e.key for e in reserved],
            store_spec=CPULoadStoreSpec([e.slot for e in reserved]),
            evicted_keys=cast(list[VKey], evicted),
        )

    def complete_store(
        self, keys: Collection[VKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Commit (``success``) or free the slots :meth:`prepare_store` reserved.

        A committed key is written through to NVMe in the background (its
        slot pinned until the row is written) unless NVMe holds it already.
        """
        self._drain()
        pool = self._pool
        stored: list[VKey] = []
        for key in keys:
            entry = pool.get(key)
            if entry is None or not entry.writing or key in self._promoting:
                continue
            if success:
                stored.append(key)
            else:
                pool.abort(key)
        nvme = self._nvme
        for key in reversed(stored):  # the call's first key ends most recently used
            pool.commit(key)
        if nvme is not None:
            for key in stored:
                nkey = nvme_key(key)
                if key in self._io_pinned or nvme.contains(nkey):
                    continue
                entry = pool.get(key)
                assert entry is not None
                pool.pin(key)
                self._io_pinned[key] = 1
                nvme.write(key, nkey, entry.start, entry.stop, entry.slot)
        if stored and self._events is not None:
            self._events.append(OffloadingEvent(keys=stored, medium=Medium.CPU, removed=False))

    def _evicted(self, keys: list[Any]) -> None:
        for key in keys:
            self._from_nvme.discard(key)
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(keys=list(keys), medium=Medium.CPU, removed=True))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """End of a scheduler step: the step's looked-up keys may be evicted again."""
        self._step_keys.clear()

    def has_pending_work(self) -> bool:
        """True while promotions are in flight, so that vLLM keeps stepping and retries."""
        self._drain()
        return bool(self._promoting)

    def reset_cache(self) -> None:
        """Empty the CPU tier; NVMe rows stay.

        Slots still read by a row write or written by a promotion are freed
        when that I/O ends (their keys are MISSes meanwhile); vLLM has
        flushed its own jobs before it calls this.
        """
        self._drain()
        pool = self._pool
        for entry in list(pool.entries()):
            key = entry.key
            if key in self._promoting or key in self._io_pinned:
                self._detached.add(key)
                if not entry.writing:
                    entry.refs = 1  # only the row write's pin is left
                continue
            entry.refs = 0  # vLLM's loads were flushed; their pins are void
            if entry.writing:
                pool.abort(key)
            else:
                pool.drop(key)
        self._from_nvme.clear()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The CPU tier's stored / removed events since the last call."""
        events = self._events
        if events:
            self._events = []
            yield from events

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Hits by tier, NVMe bytes and seconds per direction, failures, slot usage.

        Counters are increments since the last call (vLLM sums them).
        """
        self._drain()
        stats = OffloadingConnectorStats()
        for tier, n in self._hits.items():
            if n:
                stats.increase_counter(METRIC_HITS, n, (tier,))
        self._hits = {"cpu": 0, "nvme": 0}
        nvme = self._nvme
        if nvme is not None:
            counts = dict(nvme.counts)
            for direction in ("read", "write"):
                for unit, name in (("bytes", METRIC_NVME_BYTES), ("seconds", METRIC_NVME_SECONDS)):
                    k = f"{direction}_{unit}"
                    delta = counts[k] - self._last_counts.get(k, 0)
                    if delta:
                        stats.increase_counter(name, delta, (direction,))
            self._last_counts = counts
            failures = nvme.failures
            if failures != self._last_failures:
                stats.increase_counter(METRIC_FAILURES, failures - self._last_failures)
                self._last_failures = failures
        pool = self._pool
        stats.set_gauge(METRIC_SLOTS_USED, 1 - pool.free_count / pool.num_slots)
        return stats

    def shutdown(self) -> None:
        """Write what is queued to NVMe, make it durable and close the tier (blocks)."""
        if self._nvme is not None:
            self._nvme.close()

    # -------------------------------------------------------------- introspection
    @property
    def num_slots(self) -> int:
        """CPU slots of the pool."""
        return self._pool.num_slots

    def resident(self) -> Iterator[VKey]:
        """Keys committed in CPU slots (for tests and the benchmark)."""
        for entry in self._pool.entries():
            if not entry.writing and entry.key not in self._detached:
                yield cast(VKey, entry.key)
