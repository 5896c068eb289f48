"""benchmarks/summarize.py: the README's table of the recorded bench runs, medians and spreads."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "summarize.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_summarize", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(date: str, write: float, prefetch: float, store: float, **config: Any) -> dict[str, Any]:
    cfg = {
        "layout": "gemma-3-270m",
        "size_bytes": 1 << 30,
        "blocks_per_chunk": 16,
        "block_order": "random",
        "repeat": 3,
        "nvme": True,
        **config,
    }
    return {
        "date": date,
        "machine": {"device": "cpu", "cpus": 2},
        "config": cfg,
        "loop_lag_p99_ms": 1.5,
        "scheduling_overhead_us_per_chunk": {"store": 12.0, "load": 11.0},
        "phases": {
            "store": {"gbps": 14.0, "plain_copy_gbps": 20.0, "ratio_vs_plain_copy": store},
            "load": {"ratio_vs_plain_copy": 0.75},
            "nvme_write": {
                "raw_sequential_gbps": 4.0,
                "ratio_vs_raw_sequential": write,
                "ratio_vs_file_per_chunk": 2.0,
            },
            "nvme_write_e2e": {"ratio_vs_raw_sequential": write - 0.05},
            "nvme_read": {
                "ratio_vs_raw_sequential": prefetch,
                "ratio_vs_file_per_chunk": 1.1,
                "cold_load": {"ratio_vs_raw_sequential": 0.8},
            },
        },
    }


def _write(path: Path, run: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run))


def _cells(table: str, phase: str, baseline: str) -> list[str]:
    """The cells of the table row of ``phase`` against ``baseline`` (a phase's later rows)."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    current = None
    for cells in rows:
        current = cells[0] or current
        if current == f"`{phase}`" and cells[2].startswith(f"`{baseline}`"):
            return cells
    raise AssertionError(f"no row for {phase} vs {baseline} in\n{table}")


def test_medians_and_spreads_of_the_default_runs_only(tmp_path: Path) -> None:
    _write(tmp_path / "a-1.json", _run("2026-01-01T00:00:00", 0.85, 0.95, 0.72))
    _write(tmp_path / "a-2.json", _run("2026-01-01T00:01:00", 0.93, 0.97, 0.66))
    _write(tmp_path / "a-3.json", _run("2026-01-01T00:02:00", 0.80, 0.90, 0.70))
    # Another configuration, a copy of a run already read, a GPU host's run: left out.
    _write(tmp_path / "a-4.json", _run("2026-01-01T00:03:00", 0.5, 0.5, 0.1, repeat=1))
    _write(tmp_path / "b" / "copy.json", _run("2026-01-01T00:01:00", 0.93, 0.97, 0.66))
    gpu = _run("2026-01-01T00:04:00", 0.5, 0.5, 0.2)
    gpu["machine"] = {"device": "cuda", "cuda": "NVIDIA H200"}
    _write(tmp_path / "a-5.json", gpu)
    (tmp_path / "b" / "notes.json").write_text("[1, 2]")
    mod = _module()
    runs = mod.default_runs([tmp_path])
    assert [r["date"] for r in runs] == [
        "2026-01-01T00:00:00",
        "2026-01-01T00:01:00",
        "2026-01-01T00:02:00",
    ]
    table = mod.table(runs)
    assert _cells(table, "nvme_write", "raw_sequential")[3] == "0.85x (0.80-0.93)"
    assert _cells(table, "nvme_read", "raw_sequential")[3] == "0.95x (0.90-0.97)"
    assert _cells(table, "store", "plain_copy")[1:] == [
        "14.0",
        "`plain_copy` 20.0",
        "0.70x (0.66-0.72)",
    ]
    assert _cells(table, "cold_load", "raw_sequential")[3] == "0.80x"
    assert "| scheduling overhead, store | 12.0 us/chunk |" in table
    assert mod.caption(runs).startswith("3 runs of `kvtier bench` (defaults) on 2026-01-01, 2 CPUs")


def test_a_figure_that_no_run_has_is_a_dash(tmp_path: Path) -> None:
    run = _run("2026-01-01T00:00:00", 0.9, 0.88, 0.7)
    del run["phases"]["nvme_read"]["cold_load"]
    _write(tmp_path / "old.json", run)
    mod = _module()
    table = mod.table(mod.default_runs([tmp_path]))
    assert _cells(table, "cold_load", "raw_sequential")[1:] == ["-", "`raw_sequential` -", "-"]
    assert _cells(table, "nvme_read", "raw_sequential")[3] == "0.88x"


def test_recorded_results_as_in_the_readme_and_the_benchmarks_page() -> None:
    """It runs on the repository's results; the README and the docs show its table as printed."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) >= 10
    caption = out.splitlines()[0]
    for page in (REPO / "README.md", REPO / "docs" / "benchmarks.md"):
        text = page.read_text()
        for line in [caption, *table]:
            assert line in text, f"{page.name} differs from summarize.py's output: {line}"
