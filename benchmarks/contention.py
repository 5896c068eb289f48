"""What slows a raw O_DIRECT write down: another process burning CPU, copying memory or hashing.

The raw sequential write of ``kvtier bench`` (one fresh fallocated file,
4 MiB ``pwritev`` requests, 4 threads, ``fdatasync``) runs alone and next to a
second *process* (so it shares no GIL with the writer) that either spins
(CPU only), copies 64 MiB buffers with NumPy (memory bandwidth) or hashes a
64 MiB buffer with xxh3 (what kvtier's row checksums do). On a virtual disk
whose host side copies guest memory, memory traffic in the guest slows the
disk down; CPU use alone does not. The burners alternate with the quiet run
inside every repeat.

    python benchmarks/contention.py --repeat 4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

from kvtier._slots import HostRegion

BURNERS = {
    "quiet": None,
    "cpu_spin": "while True: pass",
    "memory_copy": (
        "import numpy as np\na = np.ones(64 << 20, np.uint8); b = np.empty_like(a)\n"
        "while True: np.copyto(b, a)"
    ),
    "xxh3_hashing": (
        "import numpy as np, xxhash\na = np.ones(64 << 20, np.uint8)\n"
        "while True: xxhash.xxh3_64_intdigest(a)"
    ),
}


def raw_write(
    path: str, buf: HostRegion, total: int, req: int, pool: concurrent.futures.Executor
) -> float:
    """GB/s of one sequential O_DIRECT write of ``total`` bytes to a fresh file."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    view = buf.buffer(0, buf.nbytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        os.posix_fallocate(fd, 0, total)
        t0 = time.perf_counter()
        futures = [
            pool.submit(os.pwritev, fd, [view[i : i + req]], i) for i in range(0, total, req)
        ]
        for f in futures:
            assert f.result() == req
        os.fdatasync(fd)
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        view.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--dir", default=os.getcwd(), help="folder on the filesystem to measure")
    args = ap.parse_args()
    total, req = args.size_mib << 20, 4 << 20
    buf = HostRegion(total, pin=False)
    buf.prefault()
    results: dict[str, list[float]] = {name: [] for name in BURNERS}
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-contention-", dir=args.dir) as tmp,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        for _ in range(args.repeat):
            for name, code in BURNERS.items():
                burner = subprocess.Popen([sys.executable, "-c", code]) if code else None
                try:
                    time.sleep(0.3)  # let the burner reach its loop
                    results[name].append(
                        raw_write(os.path.join(tmp, "raw.bin"), buf, total, req, pool)
                    )
                finally:
                    if burner is not None:
                        burner.kill()
                        burner.wait()
    buf.close()
    quiet = statistics.median(results["quiet"])
    for name, gbps in results.items():
        med = statistics.median(gbps)
        print(f"{name:>13}: {med:.2f} GB/s ({med / quiet:.2f}x quiet)")


if __name__ == "__main__":
    main()
