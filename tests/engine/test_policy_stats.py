"""Eviction policies and the slot pool, EngineStats, the Prometheus export.

Faults come only through real seams: a RowIO wrapper (``NVMeConfig.row_io_wrapper``)
over the real posix backend and real files. A test whose docstring starts with
"Regression:" guards against a bug these once had; the docstring says what must
hold and how it failed.
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

import kvtier
from kvtier import errors
from kvtier._policy import ARCPolicy
from kvtier.metrics import register_prometheus, unregister_prometheus
from tests.engine.helpers import key
from tests.engine.policy_rig import (
    PAGE,
    ROW,
    check_invariants,
    policy_config,
    policy_key,
    policy_layout,
)
from tests.reliability._faultio import KeyFault, Wrapper

# ----------------------------------------------------------------------------- policies


async def test_lru_order_follows_loads_stores_and_prefetch_not_lookups() -> None:
    layout = policy_layout()
    async with kvtier.TransferEngine(layout, policy_config(3)) as engine:
        a, b, c, d, e, f = (policy_key(n) for n in "abcdef")
        for i, k in enumerate((a, b, c)):
            await engine.store([kvtier.Chunk(k, [i])])
        # queries are not uses: a stays least recently used
        engine.lookup([a])
        assert engine.prefix_hits([a, b]) == 2
        assert engine.stored_range(a) == (0, 1)
        await engine.store([kvtier.Chunk(d, [3])])  # evicts a
        assert engine.lookup([a, b, c, d]) == [kvtier.Residency.MISS] + [kvtier.Residency.CPU] * 3
        await engine.load([kvtier.Chunk(b, [10])])  # order now c, d, b
        await engine.store([kvtier.Chunk(e, [4])])  # evicts c
        assert engine.lookup([c]) == [kvtier.Residency.MISS]
        res = await engine.store([kvtier.Chunk(d, [5])])  # present: skipped, but a use
        assert res.skipped == (d,)
        # order now b, e, d; a prefetch of a resident key is a hint (LRU: refresh = touch)
        assert (await engine.prefetch([b])).resident == (b,)
        await engine.store([kvtier.Chunk(f, [6])])  # evicts e
        assert engine.lookup([b, d, e, f]) == [
            kvtier.Residency.CPU,
            kvtier.Residency.CPU,
            kvtier.Residency.MISS,
            kvtier.Residency.CPU,
        ]
        assert engine.stats().evictions == 3


async def test_arc_ghost_lists_stay_bounded_and_disjoint_from_live_keys() -> None:
    layout = policy_layout()
    async with kvtier.TransferEngine(layout, policy_config(4, "arc")) as engine:
        rnd = random.Random(7)
        for i in range(200):
            await engine.store([kvtier.Chunk(policy_key(i % 37), [i % 8])])
            if rnd.random() < 0.4:
                await engine.load([kvtier.Chunk(policy_key(rnd.randrange(37)), [20])])
            check_invariants(engine)
        arc = engine._pool.policy
        assert isinstance(arc, ARCPolicy)
        assert len(arc.b1) + len(arc.b2) <= 2 * engine.num_slots
        assert 0.0 <= arc.p <= engine.num_slots
        assert engine.stats().evictions > 100


async def _arc_ghost_then_scan(tmp_path: Path, *, prefetch: bool, load: bool) -> tuple:
    """ARC, 4 slots: ``a`` evicted into B1 (row on NVMe), then prefetched and/or loaded,
    then a scan of 8 new keys. Returns (a's residency after the scan, p before the scan)."""
    layout = policy_layout()
    cfg = policy_config(4, "arc", tmp_path)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        a = policy_key("a")
        for i, name in enumerate("abcd"):
            await engine.store([kvtier.Chunk(policy_key(name), [i])])
        await engine.flush()  # rows written: the slots are evictable
        await engine.store([kvtier.Chunk(policy_key("e"), [4])])  # evicts a (T1 LRU) -> ghost B1
        await engine.flush()
        arc = engine._pool.policy
        assert engine.lookup([a]) == [kvtier.Residency.NVME]
        assert a in arc.b1
        if prefetch:
            assert (await engine.prefetch([a])).promoted == (a,)
        if load:
            assert not (await engine.load([kvtier.Chunk(a, [30])])).failed
        await engine.flush()
        p = arc.p
        for i in range(8):
            await engine.store([kvtier.Chunk(policy_key(f"scan{i}"), [10 + i])])
            await engine.flush()
        check_invariants(engine)
        return engine.lookup([a])[0], p


async def test_arc_cold_load_of_a_ghost_key_is_a_use_that_survives_a_scan(tmp_path: Path) -> None:
    # control for the test below: a real re-reference of a ghost key goes to T2
    residency, p = await _arc_ghost_then_scan(tmp_path, prefetch=False, load=True)
    assert p >= 1.0
    assert residency is kvtier.Residency.CPU


async def test_arc_prefetch_of_a_ghost_key_without_a_load_is_not_a_use(tmp_path: Path) -> None:
    """Regression: a prefetch of an ARC ghost key (in B1/B2) is not counted as a ghost hit
    at promotion time (SlotPool.commit -> ARCPolicy.insert moving it to T2 and adapting p):
    README says a prefetch is a hint, not a use, until its load comes."""
    residency, p = await _arc_ghost_then_scan(tmp_path, prefetch=True, load=False)
    assert p == 0.0  # a hint must not adapt ARC's target
    # never used since its eviction: a one-time scan evicts it like any once-seen key
    assert residency is kvtier.Residency.NVME


@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_policy_agrees_with_pool_under_faults_cancellations_and_rejections(
    tmp_path: Path, eviction: str
) -> None:
    layout = policy_layout(2)
    names = list(range(24))

    def k2(n: int) -> kvtier.OffloadKey:
        return key(f"mix-{n}", n % 2)

    bad = frozenset(k2(n).block_hash for n in names if n % 7 == 3)
    wrapper = Wrapper(
        KeyFault("write", "errno", bad, times=6),
        KeyFault("read", "errno", bad, times=6),
        KeyFault("read", "short", frozenset({k2(5).block_hash}), times=3),
    )
    cfg = policy_config(5, eviction, tmp_path, wrapper, layout=layout, bpc=2)
    rnd = random.Random(11)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        tasks: list[asyncio.Future] = []
        for _ in range(150):
            op = rnd.random()
            ns = rnd.sample(names, rnd.randint(1, 4))
            if op < 0.4:
                coro = engine.store(
                    [kvtier.Chunk(k2(n), [2 * i, 2 * i + 1]) for i, n in enumerate(ns)]
                )
            elif op < 0.75:
                coro = engine.load(
                    [kvtier.Chunk(k2(n), [20 + 2 * i, 21 + 2 * i]) for i, n in enumerate(ns)]
                )
            elif op < 0.9:
                coro = engine.prefetch([k2(n) for n in ns])
            else:
                coro = engine.flush()
            task = asyncio.ensure_future(coro)
            if rnd.random() < 0.2:
                for _ in range(rnd.randint(0, 3)):
                    await asyncio.sleep(0)
                task.cancel()
            tasks.append(task)
            if rnd.random() < 0.3:
                await asyncio.gather(*tasks, return_exceptions=True)
                tasks = []
            check_invariants(engine)
        await asyncio.gather(*tasks, return_exceptions=True)
        unreported: set[kvtier.OffloadKey] = set()
        try:  # failed rows not yet reported by a flush of the mix
            await engine.flush()
        except errors.NotDurableError as exc:
            unreported = set(exc.failed)
        assert unreported <= {k2(n) for n in names if n % 7 == 3}
        await engine.flush()  # every failure reported once
        check_invariants(engine)
        s = engine.stats()
        assert s.slots_pinned == s.slots_writing == 0
        assert s.evictions > 0
        assert s.nvme is not None
        assert s.nvme["write_failures"] > 0
        assert (
            s.failures.get("eio", 0) + s.failures.get("short_read", 0)
            == (s.nvme["promotion_failures"])
        )


# ----------------------------------------------------------------------------- stats


async def test_stats_count_exactly_what_happened_across_faults_close_and_reopen(
    tmp_path: Path,
) -> None:
    layout = policy_layout()
    k = [policy_key(i) for i in range(8)]
    wrapper = Wrapper(
        KeyFault("write", "errno", frozenset({k[0].block_hash}), times=1),
        KeyFault("read", "errno", frozenset({k[1].block_hash}), times=1),
    )
    async with kvtier.TransferEngine(layout, policy_config(4, "lru", tmp_path, wrapper)) as engine:
        await engine.store([kvtier.Chunk(k[i], [i]) for i in range(4)])
        with pytest.raises(errors.NotDurableError) as info:
            await engine.flush()
        assert set(info.value.failed) == {k[0]}
        # the next store evicts k0..k3; k0 has no NVMe copy: it is lost (an eviction)
        await engine.store([kvtier.Chunk(k[i], [i]) for i in range(4, 8)])
        await engine.flush()
        assert engine.lookup(k[:4]) == [kvtier.Residency.MISS] + [kvtier.Residency.NVME] * 3
        s = engine.stats()
        assert (s.evictions, s.slots_resident, s.slots_pinned) == (4, 4, 0)
        # load: k0 a miss, k1 a failed promotion (EIO), k2 an NVMe hit (2 more evictions)
        res = await engine.load([kvtier.Chunk(k[j], [20 + j]) for j in (1, 2, 0)])
        assert res.loaded == (k[2],)
        assert isinstance(res.failed[k[0]], errors.KeyNotResidentError)
        assert isinstance(res.failed[k[1]], errors.StorageError)
        await engine.load([kvtier.Chunk(k[2], [30])])  # now a CPU hit
        s = engine.stats()
        assert (s.hits, s.nvme_hits, s.misses, s.load_failures) == (1, 1, 1, 1)
        assert s.failures == {"eio": 1}
        assert (s.evictions, s.rejected) == (6, 0)
        assert (s.store_bytes, s.store_jobs) == (8 * PAGE, 2)
        assert (s.load_bytes, s.load_jobs) == (2 * PAGE, 2)
        assert s.store_seconds > 0
        assert s.load_seconds > 0
        assert (s.slots_free, s.slots_resident) == (1, 3)
        assert s.keys_per_group == {0: 3}
        assert s.payload_nbytes == 3 * PAGE
        assert s.reserved_nbytes == 3 * ROW
        assert s.slot_waste_nbytes == 3 * (ROW - PAGE)
        nv = s.nvme
        assert nv is not None
        assert (nv["rows_written"], nv["write_failures"]) == (7, 1)
        assert (nv["promotions"], nv["promotion_failures"]) == (1, 1)
        assert nv["failures_eio"] == 2  # one write, one read
        assert nv["rows_resident"] == 6  # the failed read dropped k1's row
        assert engine.lookup([k[1]]) == [kvtier.Residency.MISS]
        before = s
    after = engine.stats()  # closed: the counters as they were
    for name in ("hits", "nvme_hits", "misses", "load_failures", "evictions", "rejected",
                 "store_bytes", "load_bytes", "store_jobs", "load_jobs", "failures"):  # fmt: skip
        assert getattr(after, name) == getattr(before, name), name
    assert after.nvme is not None
    assert after.nvme["rows_written"] == 7
    async with kvtier.TransferEngine(layout, policy_config(4, "lru", tmp_path)) as engine:
        s = engine.stats()
        assert (s.hits, s.misses, s.evictions, s.store_bytes, s.slots_free) == (0, 0, 0, 0, 4)
        assert s.nvme is not None
        assert s.nvme["rows_resident"] == 6
        assert engine.lookup(k[:3]) == [kvtier.Residency.MISS] * 2 + [kvtier.Residency.NVME]
        assert not (await engine.load([kvtier.Chunk(k[3], [40])])).failed
        assert (engine.stats().nvme_hits, engine.stats().load_bytes) == (1, PAGE)


async def test_pinned_write_through_slots_reject_stores_and_promotions_and_are_counted(
    tmp_path: Path,
) -> None:
    layout = policy_layout()
    gate = KeyFault("write", "block")  # every row write waits until the gate opens
    wrapper = Wrapper(gate)
    old = policy_key("old")
    # a row on NVMe only, written by an earlier engine
    async with kvtier.TransferEngine(layout, policy_config(2, "lru", tmp_path)) as engine:
        await engine.store([kvtier.Chunk(old, [9])])
    async with kvtier.TransferEngine(layout, policy_config(2, "arc", tmp_path, wrapper)) as engine:
        try:
            res = await engine.store([kvtier.Chunk(policy_key(i), [i]) for i in range(3)])
            assert len(res.stored) == 2
            assert res.rejected == (policy_key(2),)
            await asyncio.sleep(0.05)
            s = engine.stats()
            assert (s.slots_pinned, s.slots_resident, s.rejected, s.evictions) == (2, 0, 1, 0)
            # no slot to promote into: a rejected promotion, the row stays on NVMe
            out = await engine.load([kvtier.Chunk(old, [20])])
            assert old in out.failed
            assert engine.lookup([old]) == [kvtier.Residency.NVME]
            s = engine.stats()
            assert (s.rejected, s.evictions, s.slots_pinned) == (2, 0, 2)
            check_invariants(engine)
        finally:
            gate.gate.set()
        await engine.flush()
        assert engine.stats().slots_pinned == 0
        assert not (await engine.load([kvtier.Chunk(old, [20])])).failed  # evicts one now
        s = engine.stats()
        assert (s.evictions, s.nvme_hits, s.slots_pinned) == (1, 1, 0)
        check_invariants(engine)


async def test_keys_per_group_counts_resident_keys_only() -> None:
    """Regression: keys_per_group (and kvtier_resident_keys{tier='cpu'}) counts no key
    whose store is still in flight (state writing, lookup PENDING); it is documented as
    resident."""
    layout = policy_layout()
    async with kvtier.TransferEngine(layout, policy_config(4)) as engine:
        task = asyncio.ensure_future(engine.store([kvtier.Chunk(policy_key("p"), [1])]))
        await asyncio.sleep(0)
        try:
            assert engine.lookup([policy_key("p")]) == [kvtier.Residency.PENDING]
            s = engine.stats()
            assert s.slots_writing == 1
            assert s.keys_per_group.get(0, 0) == 0
        finally:
            await task


# ----------------------------------------------------------------------------- prometheus


def _samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in registry.collect() for s in f.samples]


async def test_exposition_is_valid_openmetrics_with_unique_series(tmp_path: Path) -> None:
    layout = policy_layout()
    k = [policy_key(i) for i in range(3)]
    wrapper = Wrapper(KeyFault("read", "errno", frozenset({k[0].block_hash}), times=1))
    registry = CollectorRegistry()
    async with kvtier.TransferEngine(layout, policy_config(2, "lru", tmp_path, wrapper)) as engine:
        collector = register_prometheus(engine, registry, labels={"rank": "0"})
        # stored reversed (a call's first chunk ends its newest): k0 is the oldest
        await engine.store([kvtier.Chunk(x, [i]) for i, x in enumerate(k[:2])][::-1])
        await engine.flush()
        await engine.store([kvtier.Chunk(k[2], [2])])  # evicts k0
        await engine.flush()
        await engine.load([kvtier.Chunk(k[0], [10])])  # read EIO
        fams = list(om_parse(om_generate_latest(registry).decode()))
        types = {f.name: f.type for f in fams}
        assert len(types) == len(fams)
        for f in fams:
            for s in f.samples:
                assert s.labels.get("rank") == "0"
                if f.type == "counter":
                    assert s.name == f.name + "_total"
        series = _samples(registry)
        ids = [(n, tuple(sorted(lab.items()))) for n, lab, _ in series]
        assert len(ids) == len(set(ids))
        text = generate_latest(registry).decode()
        type_lines = [ln for ln in text.splitlines() if ln.startswith("# TYPE ")]
        assert len(type_lines) == len(set(type_lines)) == len(fams)
        value = registry.get_sample_value
        assert value("kvtier_failures_total", {"rank": "0", "kind": "eio"}) == 1
        assert value("kvtier_nvme_failures_total", {"rank": "0", "kind": "eio"}) == 1
        assert value("kvtier_evictions_total", {"rank": "0"}) == engine.stats().evictions == 2
        assert value("kvtier_slots", {"rank": "0", "state": "free"}) == engine.stats().slots_free
        unregister_prometheus(collector, registry)
        assert _samples(registry) == []
        again = register_prometheus(engine, registry, labels={"rank": "0"})  # allowed again
        assert value("kvtier_lookups_total", {"rank": "0", "outcome": "miss"}) == 0
        assert value("kvtier_lookups_total", {"rank": "0", "outcome": "nvme_hit"}) == 0
    # closed: a scrape still works and exports nothing of it (its pool is gone)
    assert _samples(registry) == []
    unregister_prometheus(again, registry)


async def test_two_engines_in_one_registry_give_a_valid_exposition() -> None:
    """Regression: two engines in one registry (the documented labels={'rank': ...}
    set-up) expose each family once, not once per engine's collector: no duplicate
    # HELP/# TYPE lines, which OpenMetrics rejects ('Clashing name')."""
    layout = policy_layout()
    registry = CollectorRegistry()
    async with (
        kvtier.TransferEngine(layout, policy_config(2)) as e0,
        kvtier.TransferEngine(layout, policy_config(2)) as e1,
    ):
        register_prometheus(e0, registry, labels={"rank": "0"})
        register_prometheus(e1, registry, labels={"rank": "1"})
        text = generate_latest(registry).decode()
        assert text.count("# TYPE kvtier_slots gauge") == 1
        fams = list(om_parse(om_generate_latest(registry).decode()))
        slots = next(f for f in fams if f.name == "kvtier_slots")
        assert {s.labels["rank"] for s in slots.samples} == {"0", "1"}


async def test_the_labels_of_a_closed_engine_can_be_taken_again() -> None:
    """Regression: a closed engine's labels are free, not taken until
    unregister_prometheus; register_prometheus's docstring names unregister_prometheus
    (not registry.unregister)."""
    layout = policy_layout()
    registry = CollectorRegistry()
    async with kvtier.TransferEngine(layout, policy_config(2)) as first:
        register_prometheus(first, registry, labels={"rank": "0"})
        with pytest.raises(errors.InvalidArgumentError):
            register_prometheus(first, registry, labels={"rank": "0"})
    assert _samples(registry) == []
    async with kvtier.TransferEngine(layout, policy_config(3)) as second:
        export = register_prometheus(second, registry, labels={"rank": "0"})
        assert registry.get_sample_value("kvtier_slots", {"rank": "0", "state": "free"}) == 3
        unregister_prometheus(export)
    assert "unregister_prometheus" in (register_prometheus.__doc__ or "")


async def test_closed_engine_is_freed_without_a_collector() -> None:
    # control for the test below
    engine = kvtier.TransferEngine(policy_layout(), policy_config(2))
    async with engine:
        await engine.store([kvtier.Chunk(policy_key(1), [1])])
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


async def test_collector_does_not_keep_a_closed_engine_alive() -> None:
    """Regression: _EngineCollector holds no strong reference to the engine: a closed
    engine does not stay alive (pool entries, policy, ghosts) and keep being exported
    (e.g. resident slots of an unmapped pool) until someone unregisters it."""
    registry = CollectorRegistry()
    engine = kvtier.TransferEngine(policy_layout(), policy_config(2))
    async with engine:
        register_prometheus(engine, registry)
        await engine.store([kvtier.Chunk(policy_key(1), [1])])
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


async def test_constant_label_clashing_with_a_metric_label_is_refused_or_kept(
    tmp_path: Path,
) -> None:
    """Regression: a constant label named like a per-metric label (kind, state,
    direction, outcome, tier, group_id) is refused, or kept in every family; it is not
    accepted and then silently overwritten (two engines told apart by it would export
    identical series)."""
    registry = CollectorRegistry()
    async with kvtier.TransferEngine(policy_layout(), policy_config(2, "lru", tmp_path)) as engine:
        try:
            register_prometheus(engine, registry, labels={"kind": "prefill"})
        except errors.InvalidArgumentError:
            return  # refused: fine
        for name, labels, _ in _samples(registry):
            assert labels.get("kind") == "prefill", (name, labels)


def test_scrape_of_a_busy_background_engine_is_a_consistent_snapshot(tmp_path: Path) -> None:
    """Regression: TransferEngine.stats() read from another thread (the Prometheus scrape
    of a BackgroundEngine's engine) is one snapshot, not separate passes over the pool
    for free_count and each count(state): slots by state sum to the pool size.

    Scrape on this thread while the engine thread stores, loads, prefetches and evicts."""
    layout = policy_layout()
    cfg = policy_config(8, "lru", tmp_path)
    registry = CollectorRegistry()
    stop = threading.Event()
    torn: list[dict[str, float]] = []
    empty = scrapes = 0
    interval = sys.getswitchinterval()
    with kvtier.BackgroundEngine(layout, cfg) as bg:
        register_prometheus(bg.engine, registry)

        def work() -> None:
            i = 0
            while not stop.is_set():
                futs = [
                    bg.store([kvtier.Chunk(policy_key(4 * i + j), [j]) for j in range(4)]),
                    bg.load([kvtier.Chunk(policy_key(max(0, 4 * i - 5)), [10])]),
                    bg.prefetch([policy_key(max(0, 4 * i - 9))]),
                ]
                for f in futs:
                    f.result()
                i += 1

        worker = threading.Thread(target=work)
        sys.setswitchinterval(1e-5)  # more interleavings; nothing is mocked
        worker.start()
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 4 and not torn:
                fams = {f.name: f for f in registry.collect()}
                scrapes += 1
                if "kvtier_slots" not in fams:
                    empty += 1
                    continue
                by_state = {s.labels["state"]: s.value for s in fams["kvtier_slots"].samples}
                if sum(by_state.values()) != bg.num_slots:
                    torn.append(by_state)
        finally:
            stop.set()
            worker.join()
            sys.setswitchinterval(interval)
        assert bg.stats().evictions > 0
    assert scrapes > 0
    assert empty == 0
    assert torn == []
