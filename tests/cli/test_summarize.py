"""benchmarks/summarize.py: the README's table of every recorded bench run against the targets."""

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
        "config": cfg,
        "loop_lag_p99_ms": 1.5,
        "phases": {
            "store": {"ratio_vs_plain_copy": store},
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


def test_sets_ranges_and_target_counts(tmp_path: Path) -> None:
    _write(tmp_path / "day1" / "s1-1.json", _run("2026-01-01T00:00:00", 0.85, 0.95, 0.72))
    _write(tmp_path / "day1" / "s1-2.json", _run("2026-01-01T00:01:00", 0.93, 0.97, 0.66))
    # Another configuration and a copy of a run already read: both left out.
    _write(tmp_path / "day1" / "s1-3.json", _run("2026-01-01T00:02:00", 0.5, 0.5, 0.1, repeat=1))
    _write(tmp_path / "day2" / "copy.json", _run("2026-01-01T00:01:00", 0.93, 0.97, 0.66))
    gpu = _run("2026-01-01T00:03:00", 0.5, 0.5, 0.2)  # a GPU host's run: left out too
    gpu["machine"] = {"device": "cuda", "cuda": "NVIDIA H200"}
    _write(tmp_path / "day1" / "s1-4.json", gpu)
    (tmp_path / "day2" / "notes.json").write_text("[1, 2]")
    mod = _module()
    sets = mod.default_runs([tmp_path])
    assert [len(runs) for runs in sets.values()] == [2]
    table = mod.table(sets)
    row = next(line for line in table.splitlines() if "day1/s1" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2"
    assert cells[3] == "0.85-0.93 [1/2]"  # CPU->NVMe, target 0.90
    assert cells[5] == "0.95-0.97 [2/2]"  # prefetch
    assert cells[6] == "0.80"  # cold load: no target
    assert cells[7] == "0.66-0.72 [1/2]"  # store, target 0.70
    assert "**all** | 2 |" in table
    assert mod.medians(sets["day1/s1"])["CPU->NVMe"] == (0.85 + 0.93) / 2


def test_old_runs_report_their_cold_load(tmp_path: Path) -> None:
    """Before the cold_load variant existed, nvme_read timed a cold load."""
    run = _run("2026-01-01T00:00:00", 0.9, 0.88, 0.7)
    del run["phases"]["nvme_read"]["cold_load"]
    _write(tmp_path / "old" / "bench-1.json", run)
    mod = _module()
    row = mod.table(mod.default_runs([tmp_path])).splitlines()[2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5] == "-"
    assert cells[6] == "0.88"


def test_recorded_results_as_in_the_readme() -> None:
    """The script runs on the repository's results, and the README shows its table as printed."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) >= 4
    assert "**all**" in table[-1]
    readme = (REPO / "README.md").read_text()
    others = [line for line in out.splitlines() if line.startswith(("- ", "median over"))]
    assert len(others) == 7
    for line in table + others:
        assert line in readme, f"README differs from summarize.py's output: {line}"
    lowest = float(out.split("vs file_per_chunk (write and read): lowest ", 1)[1].split()[0])
    # The targets table claims >= 1.0x file-per-chunk; a run below it is named there.
    assert lowest >= 1.0 or f"{lowest:.2f}x (" in readme, f"README does not name {lowest}"
