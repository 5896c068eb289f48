"""Prometheus export reflects the engine's counters."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

import kvtier
from kvtier.metrics import register_prometheus, unregister_prometheus
from tests.engine.helpers import fill_random, key


async def test_prometheus_collector_reports_engine_counters() -> None:
    t = torch.empty((16, 4096), dtype=torch.uint8)
    fill_random(t, 1)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"a": t}, 1: {"b": torch.zeros(16, 1024, dtype=torch.uint8)}}
    )
    registry = CollectorRegistry()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2)) as engine:
        register_prometheus(engine, registry, labels={"rank": "0"})
        await engine.store([kvtier.Chunk(key(1, 0), [0, 1]), kvtier.Chunk(key(2, 1), [2, 3])])
        await engine.load([kvtier.Chunk(key(1, 0), [4, 5]), kvtier.Chunk(key(3, 0), [6])])

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {"rank": "0", **labels})

        assert value("kvtier_lookups_total", outcome="hit") == 1
        assert value("kvtier_lookups_total", outcome="miss") == 1
        assert value("kvtier_lookups_total", outcome="nvme_hit") == 0
        assert value("kvtier_transfer_bytes_total", direction="store") == 2 * 4096 + 2 * 1024
        assert value("kvtier_transfer_bytes_total", direction="load") == 2 * 4096
        assert value("kvtier_slots", state="resident") == 2
        assert value("kvtier_resident_keys", tier="cpu", group_id="1") == 1
        stats = engine.stats()
        assert value("kvtier_slot_waste_bytes") == stats.slot_waste_nbytes > 0


async def test_two_engines_need_distinct_labels() -> None:
    layout = kvtier.KVLayout.from_tensors({0: {"a": torch.zeros(4, 1024, dtype=torch.uint8)}})
    registry = CollectorRegistry()
    async with (
        kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1)) as e1,
        kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1)) as e2,
    ):
        first = register_prometheus(e1, registry)
        with pytest.raises(kvtier.errors.InvalidArgumentError):
            register_prometheus(e2, registry)
        register_prometheus(e2, registry, labels={"rank": "1"})
        assert registry.get_sample_value("kvtier_slots", {"state": "free"}) == e1.num_slots
        unregister_prometheus(first, registry)
        assert registry.get_sample_value("kvtier_slots", {"state": "free"}) is None


def test_a_background_engine_is_exported_and_other_objects_are_refused() -> None:
    """register_prometheus(BackgroundEngine) exports its engine; before, it was accepted and
    every scrape of the registry then raised AttributeError (the whole /metrics page)."""
    layout = kvtier.KVLayout.from_tensors({0: {"a": torch.zeros(4, 1024, dtype=torch.uint8)}})
    registry = CollectorRegistry()
    with kvtier.BackgroundEngine(layout, kvtier.EngineConfig(1 << 20, 1)) as engine:
        register_prometheus(engine, registry)
        engine.store([kvtier.Chunk(key(1, 0), [0])]).result(30)
        text = generate_latest(registry).decode()  # a scrape, as the HTTP exporter does
        assert "kvtier_slots" in text
        assert registry.get_sample_value("kvtier_slots", {"state": "resident"}) == 1
        assert registry.get_sample_value("kvtier_holds_dropped_total") == 0
        for wrong in (object(), None, "engine"):
            with pytest.raises(kvtier.errors.InvalidArgumentError, match="TransferEngine"):
                register_prometheus(wrong, CollectorRegistry())  # type: ignore[arg-type]
    assert registry.get_sample_value("kvtier_slots", {"state": "resident"}) is None  # closed
