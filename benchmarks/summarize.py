"""Every recorded ``kvtier bench`` run against the project's targets, one line per set of runs.

Reads the JSON files that ``kvtier bench --json`` wrote under
``benchmarks/results/`` (or the folders given), keeps the runs of the default
configuration (``gemma-3-270m``, 1 GiB, 16 blocks per chunk, random block
ids, 3 repeats, the NVMe phases on), groups them by folder and file name
(``2026-11-30/session11-3.json`` is in ``2026-11-30/session11``) and prints a
Markdown table: per set, the number of runs, then for each figure the range
over its runs and, in brackets, how many of them meet the target.

The figures (ratios are kvtier over the baseline of the same run):

- ``raw write``: the raw sequential O_DIRECT write in GB/s, the disk's ceiling
  that day (the CPU -> NVMe target is relative to it);
- ``CPU->NVMe``: ``nvme_write`` over ``raw_sequential`` (target >= 0.90);
- ``e2e``: ``nvme_write_e2e`` (store with write-through until ``flush``) over
  ``raw_sequential`` (target >= 0.90);
- ``prefetch``: ``nvme_read`` (promotion NVMe -> CPU) over
  ``raw_sequential`` (target >= 0.90). Runs made before the bench had its
  ``cold_load`` variant (``2026-11-29/``) timed a cold load as ``nvme_read``:
  their figure is shown under ``cold load`` instead;
- ``cold load``: ``cold_load`` (promotion plus the CPU -> device copy) over
  ``raw_sequential`` (no target of its own; shown for the record);
- ``store`` / ``load``: over ``plain_copy`` (target >= 0.70);
- ``lag p99``: event-loop lag during the NVMe phases in ms (target < 5).

A last line gives ranges over all runs of the figures the README quotes
beside the table: the lowest ratio to file-per-chunk (target >= 1.0x), the
store's and the plain copy's GB/s, the ratios to plain torch indexing, the
scheduling overhead, prefetch against a hashed raw read, and the full-tier
leg against a raw rewrite and against kvtier's own write into new blocks.

    python benchmarks/summarize.py
    python benchmarks/summarize.py benchmarks/results/2026-11-30
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


def _ratio(phase: str, key: str = "ratio_vs_raw_sequential") -> Figure:
    def get(phases: dict[str, Any]) -> float | None:
        value = phases.get(phase, {}).get(key)
        return None if value is None else float(value)

    return get


def _prefetch(phases: dict[str, Any]) -> float | None:
    read = phases.get("nvme_read", {})
    return float(read["ratio_vs_raw_sequential"]) if "cold_load" in read else None


def _cold_load(phases: dict[str, Any]) -> float | None:
    read = phases.get("nvme_read", {})
    if "cold_load" not in read:  # the runs of 2026-11-29/: nvme_read WAS the cold load
        return float(read["ratio_vs_raw_sequential"]) if read else None
    return float(read["cold_load"]["ratio_vs_raw_sequential"])


# (column, figure, target test or None, digits)
COLUMNS: list[tuple[str, Figure, Callable[[float], bool] | None, int]] = [
    ("raw write GB/s", _ratio("nvme_write", "raw_sequential_gbps"), None, 1),
    ("CPU->NVMe", _ratio("nvme_write"), lambda r: r >= 0.90, 2),
    ("e2e", _ratio("nvme_write_e2e"), lambda r: r >= 0.90, 2),
    ("prefetch", _prefetch, lambda r: r >= 0.90, 2),
    ("cold load", _cold_load, None, 2),
    ("store", _ratio("store", "ratio_vs_plain_copy"), lambda r: r >= 0.70, 2),
    ("load", _ratio("load", "ratio_vs_plain_copy"), lambda r: r >= 0.70, 2),
]


def default_runs(paths: Iterable[Path]) -> dict[str, list[dict[str, Any]]]:
    """The runs of the default configuration, by set (``folder/prefix``), in file order.

    Args:
        paths: JSON files or folders (searched recursively for ``*.json``).

    Returns:
        ``{set name: [run JSON, ...]}``; files that are not bench runs, ran
        another configuration, ran on a GPU host (``machine.device`` not
        ``cpu``: ``results/gpu-h200/``), or copy a run already read (same
        ``date``: ``results/bench-*.json`` copy runs kept in the dated
        folders) are skipped.
    """
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.rglob("*.json")) if path.is_dir() else [path])
    sets: dict[str, list[dict[str, Any]]] = {}
    seen: set[str] = set()
    for file in sorted(files, key=lambda f: (f.parent == RESULTS, f)):
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
            continue  # a GPU host's run: the targets are the development machine's
        seen.add(date)
        stem = file.stem.rstrip("0123456789").rstrip("-_") or file.stem
        try:
            name = f"{file.parent.relative_to(RESULTS)}/{stem}"
        except ValueError:
            name = f"{file.parent.name}/{stem}"
        sets.setdefault(name.removeprefix("./"), []).append(run)
    return sets


def _cell(values: list[float], met: Callable[[float], bool] | None, digits: int) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    text = f"{lo:.{digits}f}" if lo == hi else f"{lo:.{digits}f}-{hi:.{digits}f}"
    if met is not None:
        text += f" [{sum(map(met, values))}/{len(values)}]"
    return text


def table(sets: dict[str, list[dict[str, Any]]]) -> str:
    """The Markdown table of :func:`default_runs`' sets, oldest set first, then all runs."""
    head = ["runs", "n", *(c[0] for c in COLUMNS), "lag p99 ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ordered = sorted(sets.items(), key=lambda item: min(r["date"] for r in item[1]))
    everything = [run for _, runs in ordered for run in runs]
    for name, runs in [*ordered, ("all", everything)]:
        cells = [f"`{name}`" if name != "all" else "**all**", str(len(runs))]
        for _, figure, met, digits in COLUMNS:
            values = [v for r in runs if (v := figure(r["phases"])) is not None]
            cells.append(_cell(values, met, digits))
        lags = [float(r["loop_lag_p99_ms"]) for r in runs if r.get("loop_lag_p99_ms") is not None]
        cells.append(_cell(lags, lambda v: v < 5, 1))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each figure of :data:`COLUMNS`: its median over ``runs`` (skipping runs that lack it)."""
    out = {}
    for name, figure, _, _ in COLUMNS:
        values = [v for r in runs if (v := figure(r["phases"])) is not None]
        if values:
            out[name] = statistics.median(values)
    return out


def _span(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if values else "-"


def other_figures(runs: list[dict[str, Any]]) -> list[str]:
    """Ranges over ``runs`` of the figures the README quotes beside the table, one per line."""

    def values(phase: str, key: str, sub: str | None = None) -> list[float]:
        out = []
        for r in runs:
            d = r["phases"].get(phase, {})
            d = d.get(sub, {}) if sub else d
            if key in d:
                out.append(float(d[key]))
        return out

    overhead = [r.get("scheduling_overhead_us_per_chunk") or {} for r in runs]
    fresh = [
        float(r["phases"]["nvme_write_full"]["gbps"]) / float(r["phases"]["nvme_write"]["gbps"])
        for r in runs
        if "nvme_write_full" in r["phases"]
    ]
    fpc = values("nvme_write", "ratio_vs_file_per_chunk")
    fpc += values("nvme_read", "ratio_vs_file_per_chunk")
    return [
        f"vs file_per_chunk (write and read): lowest {min(fpc):.2f} over {len(fpc)} figures",
        f"store GB/s {_span(values('store', 'gbps'), 1)}, its plain_copy GB/s "
        f"{_span(values('store', 'plain_copy_gbps'), 1)}",
        f"vs torch_gather: store {_span(values('store', 'ratio_vs_torch_gather'))}, "
        f"load {_span(values('load', 'ratio_vs_torch_gather'))}",
        "scheduling overhead us/chunk: store "
        f"{_span([float(o['store']) for o in overhead if 'store' in o], 1)}, load "
        f"{_span([float(o['load']) for o in overhead if 'load' in o], 1)}",
        f"prefetch vs raw_checksummed: {_span(values('nvme_read', 'ratio_vs_raw_checksummed'))}",
        f"full tier vs raw_rewrite: {_span(values('nvme_write_full', 'ratio_vs_raw_rewrite'))}, "
        f"vs kvtier's own nvme_write: {_span(fresh)}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path, default=[RESULTS])
    args = ap.parse_args()
    sets = default_runs(args.paths)
    if not sets:
        raise SystemExit("no runs of the default configuration found")
    print(table(sets))
    everything = [run for runs in sets.values() for run in runs]
    med = medians(everything)
    print("\nmedian over all runs: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    print()
    print("over all runs:")
    for line in other_figures(everything):
        print(f"- {line}")


if __name__ == "__main__":
    main()
