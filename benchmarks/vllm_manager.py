"""Scheduler-side call cost: kvtier's manager against vLLM's ``CPUOffloadingManager``.

Both managers get the same keys in the same order, CPU tier only, the same
slot count and LRU eviction; the two alternate inside every repeat. Each
round offloads a fresh batch of ``--batch`` keys (steady state evicts as many):
``lookup`` of every key (misses) then ``prepare_store`` / ``complete_store`` of
the batch, ``lookup`` again (hits), ``prepare_load`` / ``touch`` /
``complete_load``. Times are per call, in µs, divided by the batch size for the
batched calls (per key).

    python benchmarks/vllm_manager.py                       # 1,024 slots, 16 keys
    python benchmarks/vllm_manager.py --json out.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time
from typing import Any

from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvtier.vllm import KVTierOffloadingManager

CALLS = ("lookup", "prepare_store", "complete_store", "prepare_load", "touch", "complete_load")


def vllm_manager(num_slots: int) -> Any:
    """vLLM's CPU manager: ``num_slots`` blocks, LRU eviction (signature varies by release)."""
    params = inspect.signature(CPUOffloadingManager).parameters
    kwargs: dict[str, Any] = {}
    for name in params:
        if name in ("num_chunks", "num_blocks", "num_cpu_blocks"):
            kwargs[name] = num_slots
        elif name in ("cache_policy", "eviction_policy"):
            kwargs[name] = "lru"
        elif name == "enable_events":
            kwargs[name] = False
        elif name == "block_size":
            kwargs[name] = 32
    return CPUOffloadingManager(**kwargs)


def run_round(mgr: Any, keys: list[bytes], ctx: Any, out: dict[str, list[float]]) -> None:
    """One batch through every call; appends µs per key to ``out``."""
    clock = time.perf_counter_ns
    n = len(keys)
    for key in keys:
        t = clock()
        mgr.lookup(key, ctx)
        out["lookup"].append((clock() - t) / 1e3)
    t = clock()
    res = mgr.prepare_store(keys, ctx)
    out["prepare_store"].append((clock() - t) / 1e3 / n)
    stored = list(res.keys_to_store) if res is not None else []
    t = clock()
    mgr.complete_store(stored, ctx)
    out["complete_store"].append((clock() - t) / 1e3 / n)
    for key in keys:
        t = clock()
        mgr.lookup(key, ctx)
        out["lookup"].append((clock() - t) / 1e3)
    t = clock()
    mgr.prepare_load(stored, ctx)
    out["prepare_load"].append((clock() - t) / 1e3 / n)
    t = clock()
    mgr.touch(stored, ctx)
    out["touch"].append((clock() - t) / 1e3 / n)
    t = clock()
    mgr.complete_load(stored, ctx)
    out["complete_load"].append((clock() - t) / 1e3 / n)


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    """Parse arguments, run both managers alternately, print the table (and write JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2000, help="rounds per repeat")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    ctx = ReqContext("bench")
    times: dict[str, dict[str, list[float]]] = {
        side: {c: [] for c in CALLS} for side in ("vllm", "kvtier")
    }
    p50_by_repeat: dict[str, dict[str, list[float]]] = {
        side: {c: [] for c in CALLS} for side in times
    }
    serial = 0
    for _ in range(a.repeat):
        mgrs = {
            "vllm": vllm_manager(a.slots),
            "kvtier": KVTierOffloadingManager(
                a.slots, "lru", enable_events=False, nvme=None, blocks_per_chunk=1
            ),
        }
        batches = []
        for _ in range(a.rounds):
            batches.append([make_offload_key(i.to_bytes(32, "big"), i % 6) for i in
                            range(serial, serial + a.batch)])  # fmt: skip
            serial += a.batch
        for side, mgr in mgrs.items():
            rep: dict[str, list[float]] = {c: [] for c in CALLS}
            for keys in batches:
                run_round(mgr, keys, ctx, rep)
            for c in CALLS:
                times[side][c] += rep[c]
                p50_by_repeat[side][c].append(statistics.median(rep[c]))
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "args": vars(a),
        "calls": {},
    }
    print(f"{'call':16} {'vLLM p50':>9} {'p99':>7} {'kvtier p50':>11} {'p99':>7} {'ratio p50':>9}")
    for c in CALLS:
        row = {}
        for side in times:
            row[side] = {
                "p50_us": pct(times[side][c], 0.5),
                "p99_us": pct(times[side][c], 0.99),
                "p50_per_repeat_us": p50_by_repeat[side][c],
            }
        row["ratio_p50"] = row["kvtier"]["p50_us"] / row["vllm"]["p50_us"]
        result["calls"][c] = row
        v, k = row["vllm"], row["kvtier"]
        print(f"{c:16} {v['p50_us']:9.2f} {v['p99_us']:7.2f} {k['p50_us']:11.2f} "
              f"{k['p99_us']:7.2f} {row['ratio_p50']:9.2f}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
