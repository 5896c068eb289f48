"""Prometheus collectors for :class:`~kvtier.TransferEngine` (optional dependency).

``prometheus_client`` is imported only when :func:`register_prometheus` is
called. The export reads :meth:`TransferEngine.stats` at scrape time, so it
adds no cost to the hot path.

One collector per registry and metric namespace holds every engine exported
there (told apart by their constant labels), so each metric is ONE family
whose samples carry each engine's labels: two collectors yielding the same
family name would give an exposition with two ``# TYPE`` lines for it, which
Prometheus' OpenMetrics parser refuses. Engines are held by weak reference,
and a closed engine exports nothing.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvtier._background import BackgroundEngine
    from kvtier._engine import TransferEngine

_RESERVED_LABELS = frozenset({"state", "tier", "group_id", "outcome", "direction", "kind"})
"""Labels of the metrics themselves: a constant label of that name would be overwritten."""

_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")

Ident = tuple[tuple[str, str], ...]

# registry -> {namespace: its collector} (weak: registries come and go)
_EXPORTERS: weakref.WeakKeyDictionary[Any, dict[str, _Exporter]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _samples(s: Any) -> Iterator[tuple[str, str, str, dict[str, str], float]]:
    """``(type, name, help, labels, value)`` of one engine's stats snapshot."""
    for state, n in (
        ("free", s.slots_free),
        ("writing", s.slots_writing),
        ("resident", s.slots_resident),
        ("pinned", s.slots_pinned),
    ):
        yield "gauge", "slots", "CPU slots by state", {"state": state}, n
    keys = "resident keys per tier and group"
    for g, n in s.keys_per_group.items():
        yield "gauge", "resident_keys", keys, {"tier": "cpu", "group_id": str(g)}, n
    nvme: dict[str, Any] = dict(s.nvme or {})
    if nvme:
        rows = float(nvme.get("rows_resident", 0))
        yield "gauge", "resident_keys", keys, {"tier": "nvme", "group_id": "all"}, rows
    waste = "reserved slot bytes not used by payload"
    yield "gauge", "slot_waste_bytes", waste, {}, s.slot_waste_nbytes
    yield "gauge", "slot_reserved_bytes", "bytes of occupied slots", {}, s.reserved_nbytes
    for outcome, n in (("hit", s.hits), ("nvme_hit", s.nvme_hits), ("miss", s.misses)):
        yield "counter", "lookups", "load lookups by outcome", {"outcome": outcome}, n
    for direction, n, sec in (
        ("store", s.store_bytes, s.store_seconds),
        ("load", s.load_bytes, s.load_seconds),
    ):
        labels = {"direction": direction}
        yield "counter", "transfer_bytes", "payload bytes copied per direction", labels, n
        yield "counter", "transfer_seconds", "seconds spent in copy jobs per direction", labels, sec
    yield "counter", "evictions", "CPU slot evictions", {}, s.evictions
    for kind, n in s.failures.items():
        yield "counter", "failures", "failed copies and promotions by kind", {"kind": kind}, n
    yield "counter", "rejected", "stored keys rejected for lack of a slot", {}, s.rejected
    doc = "holds garbage-collected without release() (released then)"
    yield "counter", "holds_dropped", doc, {}, s.holds_dropped
    if nvme:
        for direction in ("read", "write"):
            labels = {"direction": direction}
            n = float(nvme.get(f"{direction}_bytes", 0))
            yield "counter", "nvme_bytes", "NVMe bytes per direction", labels, n
            sec = float(nvme.get(f"{direction}_seconds", 0))
            yield "counter", "nvme_seconds", "NVMe I/O seconds per direction", labels, sec
        for k, v in nvme.items():
            if k.startswith("failures_"):
                kind = {"kind": k.removeprefix("failures_")}
                yield "counter", "nvme_failures", "NVMe failures by kind", kind, float(v)
        pinned = float(nvme.get("rows_pinned", 0))
        doc = "NVMe rows that may not be evicted now (reads in flight, holds)"
        yield "gauge", "nvme_rows_pinned", doc, {}, pinned
        used = float(nvme.get("bytes_used", 0))
        yield "gauge", "nvme_bytes_used", "bytes of NVMe rows in use", {}, used
        fallback = float(nvme.get("direct_io_fallback", 0))
        doc = "1 when O_DIRECT was unavailable and buffered I/O is used"
        yield "gauge", "direct_io_fallback", doc, {}, fallback
        bad = float(nvme.get("checksum_failures", 0))
        yield "counter", "checksum_failures", "rows whose checksum did not match", {}, bad
        evicted = float(nvme.get("evictions", 0))
        yield "counter", "nvme_evictions", "NVMe rows evicted for capacity", {}, evicted
        window = float(nvme.get("window_evictions", 0))
        doc = "NVMe evictions of the writer's own group's key out of strict LRU order"
        yield "counter", "nvme_window_evictions", doc, {}, window
        full = float(nvme.get("disk_full_evictions", 0))
        doc = "NVMe evictions because the filesystem was full below capacity_bytes"
        yield "counter", "nvme_disk_full_evictions", doc, {}, full
    doc = "1 when the CPU pool is page-locked"
    yield "gauge", "pinned_memory", doc, {}, float(s.pinned_memory)


def _snapshot(engine: TransferEngine) -> Any:
    """``engine.stats()``, retried when a scrape thread catches the loop mid-change."""
    for _ in range(8):
        try:
            return engine.stats()
        except (RuntimeError, AttributeError):  # a dict changed size; a close in progress
            continue
    return None


class _Exporter:
    """The collector of one registry and namespace: every engine exported there."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.engines: dict[Ident, weakref.ref[TransferEngine]] = {}

    def describe(self) -> list[Any]:
        return []

    def live(self, ident: Ident) -> bool:
        """Whether ``ident`` names an engine that is still alive and not closed."""
        ref = self.engines.get(ident)
        engine = ref() if ref is not None else None
        return engine is not None and not engine.closed

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        with _LOCK:
            engines = list(self.engines.items())
        for ident, ref in engines:
            engine = ref()
            if engine is None or engine.closed:
                continue
            stats = _snapshot(engine)
            if stats is None:
                continue
            const = dict(ident)
            for kind, name, doc, labels, value in _samples(stats):
                full = f"{self.namespace}_{name}"
                family = families.get(full)
                if family is None:
                    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    family = families[full] = cls(full, doc)
                sample = f"{full}_total" if kind == "counter" else full
                family.add_sample(sample, {**const, **labels}, float(value))
        yield from families.values()


class Export:
    """What :func:`register_prometheus` returns: one engine's place in a collector."""

    def __init__(
        self, exporter: _Exporter, ident: Ident, registry: Any, ref: weakref.ref[TransferEngine]
    ) -> None:
        self.exporter = exporter
        self.ident = ident
        self.registry = registry
        self.ref = ref


def register_prometheus(
    engine: TransferEngine | BackgroundEngine,
    registry: Any = None,
    *,
    namespace: str = "kvtier",
    labels: dict[str, str] | None = None,
) -> Export:
    """Export ``engine.stats()`` as Prometheus metrics.

    Several engines may share a registry and namespace when their constant
    ``labels`` differ: their samples then share each metric family. The
    engine is held by weak reference; once it is closed it exports nothing.

    Args:
        engine: the engine to export: a :class:`~kvtier.TransferEngine`, or a
            :class:`~kvtier.BackgroundEngine` (its ``engine`` is exported).
        registry: a ``prometheus_client.CollectorRegistry`` (default: the global REGISTRY).
        namespace: metric name prefix (a Prometheus metric name: letters,
            digits, ``_`` and ``:``, not starting with a digit).
        labels: constant labels added to every sample (e.g. ``{"rank": "0"}``);
            names of the metrics' own labels (``state``, ``tier``,
            ``group_id``, ``outcome``, ``direction``, ``kind``) are refused.

    Returns:
        The export (pass it to :func:`unregister_prometheus` to stop).

    Raises:
        ImportError: ``prometheus_client`` is not installed.
        InvalidArgumentError: ``engine`` is neither engine type (checked here:
            a scrape would fail), a live engine is already exported to ``registry``
            with the same namespace and labels (series would collide), the
            namespace is not a metric name, or a label name is invalid or
            one of the metrics' own.
    """
    import prometheus_client

    from kvtier._background import BackgroundEngine
    from kvtier._engine import TransferEngine

    if isinstance(engine, BackgroundEngine):
        engine = engine.engine
    if not isinstance(engine, TransferEngine):
        raise InvalidArgumentError(
            "engine must be a kvtier.TransferEngine or kvtier.BackgroundEngine, "
            f"got {type(engine).__name__}"
        )
    registry = registry or prometheus_client.REGISTRY
    if not isinstance(namespace, str) or not _METRIC.fullmatch(namespace):
        # prometheus_client would rewrite it (my-ns -> my_ns): two namespaces could clash
        raise InvalidArgumentError(f"namespace {namespace!r} is not a Prometheus metric name")
    labels = dict(labels or {})
    for name, value in labels.items():
        if not isinstance(name, str) or not _LABEL.fullmatch(name) or name.startswith("__"):
            raise InvalidArgumentError(f"{name!r} is not a Prometheus label name")
        if name in _RESERVED_LABELS:
            raise InvalidArgumentError(
                f"label {name!r} is a label of kvtier's own metrics: choose another name"
            )
        if not isinstance(value, str):
            raise InvalidArgumentError(f"label {name!r}: value must be a str, got {value!r}")
    ident: Ident = tuple(sorted(labels.items()))
    with _LOCK:
        exporters = _EXPORTERS.setdefault(registry, {})
        exporter = exporters.get(namespace)
        if exporter is not None and exporter.live(ident):
            raise InvalidArgumentError(
                f"an engine is already exported to this registry with labels {labels}: "
                "pass labels= (e.g. {'rank': '1'}) to tell engines apart, or stop exporting "
                "the other one first (kvtier.metrics.unregister_prometheus(export))"
            )
        if exporter is None:
            exporter = exporters[namespace] = _Exporter(namespace)
            registry.register(exporter)
        for old in [i for i in exporter.engines if not exporter.live(i)]:
            del exporter.engines[old]  # dead or closed engines: scrapes skip them anyway
        ref = exporter.engines[ident] = weakref.ref(engine)
    return Export(exporter, ident, registry, ref)


def unregister_prometheus(export: Export, registry: Any = None) -> None:
    """Stop exporting an engine registered by :func:`register_prometheus` (idempotent).

    Args:
        export: what :func:`register_prometheus` returned.
        registry: ignored (the export knows its registry); kept for callers
            that pass it.
    """
    with _LOCK:
        exporter = export.exporter
        if exporter.engines.get(export.ident) is export.ref:  # not a later engine's place
            del exporter.engines[export.ident]
        if exporter.engines:
            return
        exporters = _EXPORTERS.get(export.registry, {})
        if exporters.get(exporter.namespace) is exporter:
            del exporters[exporter.namespace]
            export.registry.unregister(exporter)
