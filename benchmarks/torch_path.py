"""The copy phases of ``kvtier bench`` through the torch path (the CUDA hosts' code) on CPU tensors.

On a CPU-only host the engine copies with NumPy on its copy threads; on a CUDA
host it issues torch calls (per chunk, layer and piece: an ``index_select``
and a copy) from the event loop thread. This runs the bench's copy phases
(``--no-nvme``) once with the NumPy path and once with it disabled (the torch
path then runs on the same CPU tensors, as the tests do), and prints store and
load GB/s and the scheduling overhead per chunk (16-byte pages: what issuing
the calls costs when the copy costs nothing). On a GPU, dispatching and
launching each call costs about as much as here or more, so the torch path's
overhead per chunk hints whether a store of a many-layer model is bound by
launching there (``benchmarks/gpu_check.sh`` measures it on a real GPU).

    python benchmarks/torch_path.py --layout deepseek-v3 --size 256M
"""

from __future__ import annotations

import argparse
import asyncio

import kvtier._engine
from kvtier.bench import BenchConfig, run_bench
from kvtier.cli import parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layout", default="gemma-3-270m")
    ap.add_argument("--size", default="256M", help="bytes per phase (e.g. 256M, 1G)")
    args = ap.parse_args()
    numpy_path = kvtier._engine.host_pieces
    for path in ("numpy", "torch"):
        kvtier._engine.host_pieces = numpy_path if path == "numpy" else lambda *a, **k: None
        cfg = BenchConfig(
            layout=args.layout, size_bytes=parse_size(args.size), repeat=1, nvme=False
        )
        r = asyncio.run(run_bench(cfg))
        ph, us = r["phases"], r["scheduling_overhead_us_per_chunk"]
        print(
            f"{args.layout} {path:5s} path: store {ph['store']['gbps']:.2f} GB/s, "
            f"load {ph['load']['gbps']:.2f} GB/s; scheduling overhead per chunk: "
            f"store {us['store']:.1f} us, load {us['load']:.1f} us"
        )


if __name__ == "__main__":
    main()
