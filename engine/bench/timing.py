"""What the phases measure with.

:class:`Phase` holds the figures of one phase and its baselines,
:class:`LagMonitor` the event loop's lag, and :func:`_copy_pass` times one pass
of engine calls (store, load or prefetch) over every batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import kvtier
from kvtier.bench.data import _check


@dataclass
class Phase:
    """Figures of one phase: kvtier and its baselines (GB/s = 1e9 bytes/s)."""

    name: str
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    batch_seconds: list[float] = field(default_factory=list)
    baselines: dict[str, list[float]] = field(default_factory=dict)
    variants: dict[str, list[float]] = field(default_factory=dict)
    """kvtier run another way (``pipelined``): seconds per repeat."""
    counts: dict[str, list[int]] = field(default_factory=dict)
    """Events per repeat (``new_keys_evicted``), reported as they are."""

    def gbps(self, seconds: list[float]) -> float:
        """Throughput of the median repeat."""
        return self.nbytes / statistics.median(seconds) / 1e9 if seconds else 0.0

    def summary(self) -> dict[str, Any]:
        """JSON-able figures: GB/s, p50/p99 batch latency (ms), ratios to baselines."""
        out: dict[str, Any] = {"bytes": self.nbytes, "gbps": round(self.gbps(self.seconds), 3)}
        if self.batch_seconds:
            lat = sorted(self.batch_seconds)
            out["p50_ms"] = round(1e3 * lat[len(lat) // 2], 3)
            out["p99_ms"] = round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3)
        bases = {name: self.gbps(secs) for name, secs in self.baselines.items()}

        def ratios(gbps: float) -> dict[str, float | None]:
            return {f"ratio_vs_{b}": round(gbps / v, 3) if v else None for b, v in bases.items()}

        for name, base in bases.items():
            out[f"{name}_gbps"] = round(base, 3)
        out |= ratios(self.gbps(self.seconds))
        for name, secs in self.variants.items():
            out[name] = {"gbps": round(self.gbps(secs), 3)} | ratios(self.gbps(secs))
        out |= {name: list(values) for name, values in self.counts.items()}
        return out


class LagMonitor:
    """Measures event-loop lag: how late a 1 ms sleep wakes up (seconds)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            self.samples.append(max(0.0, time.perf_counter() - t0 - 0.001))

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[None]:
        """Sample lag while the block runs."""
        self._task = asyncio.ensure_future(self._run())
        try:
            yield
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def p99_ms(self) -> float:
        """99th percentile lag in milliseconds."""
        if not self.samples:
            return 0.0
        s = sorted(self.samples)
        return 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))]


def _first(failed: dict[Any, BaseException]) -> str:
    """One failure of many, and how many there were (a one-line message)."""
    if not failed:
        return ""
    key, err = next(iter(failed.items()))
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return f"{key}: {err}{more}"


async def _copy_pass(
    engine: kvtier.TransferEngine,
    batches: list[list[kvtier.Chunk]],
    direction: str,
    inflight: int,
    phase: Phase | None,
) -> float:
    """Store, load or prefetch every batch, ``inflight`` calls at a time; returns the seconds.

    Per-call latency goes to ``phase.batch_seconds`` when ``phase`` is given.
    """
    sem = asyncio.Semaphore(inflight)

    async def one(batch: list[kvtier.Chunk]) -> None:
        async with sem:
            t0 = time.perf_counter()
            if direction == "store":
                res = await engine.store(batch)
                _check(len(res.stored) == len(batch), "bench store rejected keys")
            elif direction == "prefetch":
                pre = await engine.prefetch([c.key for c in batch])
                _check(not pre.failed, f"bench prefetch failed: {_first(pre.failed)}")
                _check(len(pre.promoted) == len(batch), "bench prefetch promoted too few keys")
            else:
                out = await engine.load(batch)
                _check(not out.failed, f"bench load failed: {_first(out.failed)}")
            if phase is not None:
                phase.batch_seconds.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in batches))
    return time.perf_counter() - t0
