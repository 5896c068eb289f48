"""Side-by-side A/B of the copy path: this checkout against an older commit.

Runs ``kvtier bench --no-nvme`` for each layout, alternating the two code
versions round by round (ABBA, so that a machine that drifts hurts both
alike), and reports per layout and side the median and range of:

- the scheduling overhead (microseconds per chunk with 16-byte pages: what
  kvtier adds per chunk on top of the bytes);
- the store and load throughput and their ratios to a plain copy of the same
  bytes (``ratio_vs_plain_copy``, measured in the same run).

The older commit is checked out in a temporary ``git worktree`` and imported
in place of the installed package (``PYTHONPATH``); both sides use the same
Python, torch and NumPy.

    python benchmarks/copy_ab.py --base 83dd239 --rounds 4 \
        --layout gemma-3-270m --layout deepseek-v3.2 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_CLI = "import sys; from kvtier.cli import main; sys.exit(main())"


def _package_of(worktree: Path, into: Path) -> Path:
    """A directory holding ``kvtier`` (``engine/``) with ``kvtier.io`` (``io/``) inside it."""
    pkg = into / "kvtier"
    shutil.copytree(worktree / "engine", pkg)
    (pkg / "io").symlink_to(worktree / "io", target_is_directory=True)
    return into


def _bench(layout: str, size: str, pythonpath: Path | None, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    cmd = [sys.executable, "-c", _CLI, "bench", "--no-nvme", "--size", size]
    cmd += ["--layout", layout, "--repeat", "3", "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _figures(run: dict[str, Any]) -> dict[str, float]:
    sched = run["scheduling_overhead_us_per_chunk"]
    phases = run["phases"]
    return {
        "sched_store_us": sched["store"],
        "sched_load_us": sched["load"],
        "store_gbps": phases["store"]["gbps"],
        "load_gbps": phases["load"]["gbps"],
        "store_vs_plain": phases["store"]["ratio_vs_plain_copy"],
        "load_vs_plain": phases["load"]["ratio_vs_plain_copy"],
    }


def main() -> int:
    """Run the A/B and print (and optionally write) the medians and ranges."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the older commit (any git revision)")
    ap.add_argument("--layout", action="append", default=[], help="repeatable")
    ap.add_argument("--rounds", type=int, default=4, help="runs per side and layout")
    ap.add_argument("--size", default="128M")
    ap.add_argument("--out", help="write every run and the summary here (JSON)")
    args = ap.parse_args()
    layouts = args.layout or ["gemma-3-270m", "deepseek-v3.2"]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        lay: {"base": [], "head": []} for lay in layouts
    }
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.base],
            check=True,
        )
        try:
            base_path = _package_of(tree, Path(tmp) / "pkg")
            for r in range(args.rounds):
                order = ("base", "head") if r % 2 == 0 else ("head", "base")
                for lay in layouts:
                    for side in order:
                        path = base_path if side == "base" else None
                        run = _bench(lay, args.size, path, Path(tmp) / "run.json")
                        runs[lay][side].append(_figures(run))
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
            )
    summary: dict[str, Any] = {}
    for lay, sides in runs.items():
        summary[lay] = {}
        for side, rows in sides.items():
            summary[lay][side] = {
                k: {
                    "median": round(statistics.median(r[k] for r in rows), 3),
                    "min": min(r[k] for r in rows),
                    "max": max(r[k] for r in rows),
                }
                for k in rows[0]
            }
            line = ", ".join(
                f"{k} {v['median']} ({v['min']}-{v['max']})" for k, v in summary[lay][side].items()
            )
            print(f"{lay} {side}: {line}")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"base": args.base, "runs": runs, "summary": summary}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
