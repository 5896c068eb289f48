"""Prometheus collectors for a :class:`~kvtier.TransferEngine` (optional dependency).

``prometheus_client`` is imported only when :func:`register_prometheus` is
called. The collector reads :meth:`TransferEngine.stats` at scrape time, so
it adds no cost to the hot path.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvtier._engine import TransferEngine

# registry -> (namespace, labels) already exported there (weak: registries come and go)
_REGISTERED: weakref.WeakKeyDictionary[Any, set[tuple[str, tuple[tuple[str, str], ...]]]] = (
    weakref.WeakKeyDictionary()
)


class _EngineCollector:
    def __init__(self, engine: TransferEngine, namespace: str, labels: dict[str, str]) -> None:
        self._engine = engine
        self._ns = namespace
        self._labels = labels
        self.ident: tuple[str, tuple[tuple[str, str], ...]] = ("", ())

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ns, names = self._ns, list(self._labels)
        values = list(self._labels.values())
        # Scrapes run on the exporter's thread while the engine's loop mutates
        # its dicts: a snapshot taken mid-change raises; take another one.
        for _ in range(8):
            try:
                s = self._engine.stats()
                break
            except RuntimeError:
                continue
        else:
            return

        def gauge(name: str, doc: str, value: float, extra: dict[str, str] | None = None) -> Any:
            extra = extra or {}
            g = GaugeMetricFamily(f"{ns}_{name}", doc, labels=[*names, *extra])
            g.add_metric([*values, *extra.values()], value)
            return g

        def counter(
            name: str, doc: str, items: dict[tuple[str, ...], float], label: list[str]
        ) -> Any:
            c = CounterMetricFamily(f"{ns}_{name}", doc, labels=[*names, *label])
            for key, value in items.items():
                c.add_metric([*values, *key], value)
            return c

        slots = GaugeMetricFamily(f"{ns}_slots", "CPU slots by state", labels=[*names, "state"])
        for state, n in (
            ("free", s.slots_free),
            ("writing", s.slots_writing),
            ("resident", s.slots_resident),
            ("pinned", s.slots_pinned),
        ):
            slots.add_metric([*values, state], n)
        yield slots
        keys = GaugeMetricFamily(
            f"{ns}_resident_keys",
            "resident keys per tier and group",
            labels=[*names, "tier", "group_id"],
        )
        for g, n in s.keys_per_group.items():
            keys.add_metric([*values, "cpu", str(g)], n)
        nvme: dict[str, Any] = dict(s.nvme or {})
        if nvme:
            keys.add_metric([*values, "nvme", "all"], float(nvme.get("rows_resident", 0)))
        yield keys
        yield gauge(
            "slot_waste_bytes", "reserved slot bytes not used by payload", s.slot_waste_nbytes
        )
        yield gauge("slot_reserved_bytes", "bytes of occupied slots", s.reserved_nbytes)
        yield counter(
            "lookups",
            "load lookups by outcome",
            {("hit",): s.hits, ("nvme_hit",): s.nvme_hits, ("miss",): s.misses},
            ["outcome"],
        )
        yield counter(
            "transfer_bytes",
            "payload bytes copied per direction",
            {("store",): s.store_bytes, ("load",): s.load_bytes},
            ["direction"],
        )
        yield counter(
            "transfer_seconds",
            "seconds spent in copy jobs per direction",
            {("store",): s.store_seconds, ("load",): s.load_seconds},
            ["direction"],
        )
        yield counter("evictions", "CPU slot evictions", {(): s.evictions}, [])
        yield counter(
            "failures",
            "failed copies and promotions by kind",
            {(k,): float(v) for k, v in s.failures.items()},
            ["kind"],
        )
        yield counter("rejected", "stored keys rejected for lack of a slot", {(): s.rejected}, [])
        if nvme:
            yield counter(
                "nvme_bytes",
                "NVMe bytes per direction",
                {
                    ("read",): float(nvme.get("read_bytes", 0)),
                    ("write",): float(nvme.get("write_bytes", 0)),
                },
                ["direction"],
            )
            yield counter(
                "nvme_seconds",
                "NVMe I/O seconds per direction",
                {
                    ("read",): float(nvme.get("read_seconds", 0)),
                    ("write",): float(nvme.get("write_seconds", 0)),
                },
                ["direction"],
            )
            failures: dict[tuple[str, ...], float] = {
                (k.removeprefix("failures_"),): float(v)
                for k, v in nvme.items()
                if k.startswith("failures_")
            }
            yield counter("nvme_failures", "NVMe failures by kind", failures, ["kind"])
            yield gauge(
                "nvme_bytes_used", "bytes of NVMe rows in use", float(nvme.get("bytes_used", 0))
            )
            yield gauge(
                "direct_io_fallback",
                "1 when O_DIRECT was unavailable and buffered I/O is used",
                float(nvme.get("direct_io_fallback", 0)),
            )
            yield counter(
                "checksum_failures",
                "rows whose checksum did not match",
                {(): float(nvme.get("checksum_failures", 0))},
                [],
            )
        yield gauge("pinned_memory", "1 when the CPU pool is page-locked", float(s.pinned_memory))


def register_prometheus(
    engine: TransferEngine,
    registry: Any = None,
    *,
    namespace: str = "kvtier",
    labels: dict[str, str] | None = None,
) -> Any:
    """Export ``engine.stats()`` as Prometheus metrics.

    Args:
        engine: the engine to export.
        registry: a ``prometheus_client.CollectorRegistry`` (default: the global REGISTRY).
        namespace: metric name prefix.
        labels: constant labels added to every sample (e.g. ``{"rank": "0"}``).

    Returns:
        The collector (pass it to ``registry.unregister`` to stop exporting).

    Raises:
        ImportError: ``prometheus_client`` is not installed.
        InvalidArgumentError: an engine is already exported to ``registry``
            with the same namespace and labels (series would collide).
    """
    import prometheus_client

    registry = registry or prometheus_client.REGISTRY
    ident = (namespace, tuple(sorted((labels or {}).items())))
    taken = _REGISTERED.setdefault(registry, set())
    if ident in taken:
        raise InvalidArgumentError(
            f"an engine is already exported to this registry with labels {dict(ident[1])}: "
            "pass labels= (e.g. {'rank': '1'}) to tell engines apart, or stop exporting "
            "the other one first (kvtier.metrics.unregister_prometheus(collector))"
        )
    collector = _EngineCollector(engine, namespace, dict(labels or {}))
    registry.register(collector)
    taken.add(ident)
    collector.ident = ident
    return collector


def unregister_prometheus(collector: Any, registry: Any = None) -> None:
    """Stop exporting an engine registered by :func:`register_prometheus`."""
    import prometheus_client

    registry = registry or prometheus_client.REGISTRY
    registry.unregister(collector)
    _REGISTERED.get(registry, set()).discard(collector.ident)
