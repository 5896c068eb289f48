"""Recorded ``kvtier bench`` runs of the default command: each figure's median and spread.

Reads the JSON files that ``kvtier bench --json`` wrote under
``benchmarks/results/`` (or the files and folders given), keeps the runs of
the default configuration (``gemma-3-270m``, 1 GiB, 16 blocks per chunk,
random block ids, 3 repeats, the NVMe phases on) on a CPU-only host, and
prints one Markdown table: per phase, kvtier's throughput, each baseline's,
and kvtier over the baseline, each as the median over the runs with the
spread (lowest-highest) in brackets. Ratios are those of each run (kvtier's
median repeat over the baseline's, measured in the same invocation); the
medians of GB/s are over runs, so the median ratio is not the ratio of the
median GB/s.

The rows, as ``kvtier bench`` names its phases and baselines (the
benchmarks page of the docs says what each measures): ``store`` and ``load``
against ``plain_copy`` and ``torch_gather``; ``nvme_write`` (CPU -> NVMe)
against ``raw_sequential`` and ``file_per_chunk``; ``nvme_write_full`` (a
full tier) against ``raw_rewrite``; ``nvme_write_e2e`` (store with
write-through until ``flush``) against ``raw_sequential``; ``nvme_read``
(prefetch, NVMe -> CPU) against ``raw_sequential`` and ``file_per_chunk``;
``cold_load`` against ``raw_sequential``; then the scheduling overhead per
chunk and the event-loop lag p99 during the NVMe phases.

    python benchmarks/summarize.py
    python benchmarks/summarize.py benchmarks/results/2026-12-01-cpu2-bench-1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

DEFAULTS = {
    "layout": "gemma-3-270m",
    "size_bytes": 1 << 30,
    "blocks_per_chunk": 16,
    "block_order": "random",
    "repeat": 3,
    "nvme": True,
}

Figure = Callable[[dict[str, Any]], float | None]


def _get(*path: str) -> Figure:
    """A figure read from a run's JSON at ``path`` (None where a run lacks it)."""

    def get(run: dict[str, Any]) -> float | None:
        value: Any = run
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return None if value is None else float(value)

    return get


def _phase(phase: str, *path: str) -> Figure:
    if phase == "cold_load":
        return _get("phases", "nvme_read", "cold_load", *path)
    return _get("phases", phase, *path)


def _vs(phase: str, baseline: str, gbps_of: str | None = None) -> tuple[str, Figure, Figure]:
    """A baseline of ``phase``: its name, its GB/s (in ``gbps_of``'s figures) and kvtier's ratio."""
    return (
        baseline,
        _phase(gbps_of or phase, f"{baseline}_gbps"),
        _phase(phase, f"ratio_vs_{baseline}"),
    )


# (phase, [(baseline, baseline GB/s, ratio)]); kvtier's GB/s is the phase's "gbps"
PHASES: list[tuple[str, list[tuple[str, Figure, Figure]]]] = [
    ("store", [_vs("store", "plain_copy"), _vs("store", "torch_gather")]),
    ("load", [_vs("load", "plain_copy"), _vs("load", "torch_gather")]),
    ("nvme_write", [_vs("nvme_write", "raw_sequential"), _vs("nvme_write", "file_per_chunk")]),
    ("nvme_write_full", [_vs("nvme_write_full", "raw_rewrite")]),
    ("nvme_write_e2e", [_vs("nvme_write_e2e", "raw_sequential")]),
    ("nvme_read", [_vs("nvme_read", "raw_sequential"), _vs("nvme_read", "file_per_chunk")]),
    ("cold_load", [_vs("cold_load", "raw_sequential", gbps_of="nvme_read")]),
]


def default_runs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The runs of the default configuration on a CPU-only host, oldest first.

    Args:
        paths: JSON files or folders (searched recursively for ``*.json``).

    Returns:
        The runs' JSON. Files that are not bench runs, ran another
        configuration, ran on a GPU host (``machine.device`` not ``cpu``), or
        copy a run already read (same ``date``) are skipped.
    """
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.rglob("*.json")) if path.is_dir() else [path])
    runs: list[dict[str, Any]] = []
    seen: set[str] = set()
    for file in files:
        try:
            run = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(run, dict) or "phases" not in run or "config" not in run:
            continue
        config = run["config"]
        date = str(run.get("date"))
        if any(config.get(k) != v for k, v in DEFAULTS.items()) or date in seen:
            continue
        if run.get("machine", {}).get("device", "cpu") != "cpu":
            continue
        seen.add(date)
        runs.append(run)
    return sorted(runs, key=lambda r: str(r.get("date")))


def _values(runs: list[dict[str, Any]], figure: Figure) -> list[float]:
    return [v for r in runs if (v := figure(r)) is not None]


def cell(values: list[float], digits: int = 2, unit: str = "") -> str:
    """``median (lowest-highest)`` of ``values`` with ``unit`` after each figure; ``-`` if none."""
    if not values:
        return "-"
    med = f"{statistics.median(values):.{digits}f}{unit}"
    lo, hi = min(values), max(values)
    if len(values) == 1 or lo == hi:
        return med
    return f"{med} ({lo:.{digits}f}-{hi:.{digits}f})"


def table(runs: list[dict[str, Any]]) -> str:
    """The Markdown table of ``runs``' figures: median and spread of each."""
    lines = [
        "| phase | kvtier GB/s | baseline GB/s | kvtier / baseline |",
        "|---|---|---|---|",
    ]
    for phase, baselines in PHASES:
        first = True
        for name, base_gbps, ratio in baselines:
            ours = cell(_values(runs, _phase(phase, "gbps")), 1) if first else ""
            base = cell(_values(runs, base_gbps), 1)
            lines.append(
                f"| {f'`{phase}`' if first else ''} | {ours} | `{name}` {base} "
                f"| {cell(_values(runs, ratio), unit='x')} |"
            )
            first = False
    for name in ("store", "load"):
        us = cell(_values(runs, _get("scheduling_overhead_us_per_chunk", name)), 1)
        lines.append(f"| scheduling overhead, {name} | {us} us/chunk | - | - |")
    lag = cell(_values(runs, _get("loop_lag_p99_ms")), 1)
    lines.append(f"| event-loop lag p99, NVMe phases | {lag} ms | - | - |")
    return "\n".join(lines)


def caption(runs: list[dict[str, Any]]) -> str:
    """One line: how many runs, of which dates, on how many CPUs."""
    dates = sorted({str(r.get("date", ""))[:10] for r in runs})
    cpus = sorted({str(r.get("machine", {}).get("cpus", "?")) for r in runs})
    return (
        f"{len(runs)} runs of `kvtier bench` (defaults) on {', '.join(dates)}, "
        f"{'/'.join(cpus)} CPUs: median (lowest-highest)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path, default=[RESULTS])
    args = ap.parse_args()
    runs = default_runs(args.paths)
    if not runs:
        raise SystemExit("no runs of the default configuration found")
    print(caption(runs))
    print()
    print(table(runs))


if __name__ == "__main__":
    main()
