"""NVMe tier alone (rows from resident CPU slots, no device copy) against raw sequential I/O.

Isolates kvtier's I/O path (row allocation, trailer + xxh3 checksum, coalesced
pwritev/preadv, verification on read) from the device<->CPU copy that
``kvtier bench``'s NVMe phases include. Both sides use the same RowIO backend,
O_DIRECT mode, 4 MiB requests and thread count, fresh files every repeat, and
data-set-sized buffers; they alternate inside every repeat.

    python benchmarks/tier_io.py                 # 1 GiB, 6 groups of 772 KiB rows
    python benchmarks/tier_io.py --size 64M --repeat 1 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time

import uvloop

import kvtier
from kvtier._slots import HostRegion
from kvtier.io import NVMeTier, select_backend


def raw(
    io, path: str, buf: HostRegion, total: int, req: int, threads: int, write: bool,
    fresh: bool = True,
) -> float:  # fmt: skip
    """Sequential I/O of ``total`` bytes to one file in ``req`` requests, ``threads`` in flight.

    A write goes to a new, allocated file; with ``fresh=False`` it rewrites the
    existing one in place (blocks already written).
    """
    view = buf.buffer(0, buf.nbytes)
    fresh = write and fresh
    if fresh and os.path.exists(path):
        os.unlink(path)
    t0 = time.perf_counter()
    h = io.open(path, write)
    if fresh:
        io.allocate(h, total)

    def one(i: int) -> None:
        n = min(req, total - i * req)
        done = (io.pwritev if write else io.preadv)(h, [view[i * req : i * req + n]], i * req)
        assert done == n

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(-(-total // req))))
    if write:
        io.fdatasync(h)
    dt = time.perf_counter() - t0
    io.close(h)
    view.release()
    return dt


async def tier_pass(
    root: str, args: argparse.Namespace, region: HostRegion, keys: list, write: bool
) -> float:
    """Write (then flush) or read every row through NVMeTier, ``inflight`` calls at a time."""
    tier = NVMeTier(
        root=root, namespace="tier-io", capacity_bytes=4 * args.size + (1 << 30),
        layout_description={"bench": "tier_io"}, blocks_per_chunk=16,
        group_nbytes=dict.fromkeys(range(args.groups), args.row_payload), io_threads=args.threads,
        request_nbytes=args.request,
    )  # fmt: skip
    await tier.open()
    slot = args.row_payload + 4096
    sem = asyncio.Semaphore(args.inflight)

    async def one(first: int) -> None:
        async with sem:
            idx = range(first, min(len(keys), first + args.batch))
            if write:
                res = await tier.write_rows([(keys[i], 0, 16, region.buffer(i, slot)) for i in idx])
                assert all(r is None for r in res), res
            else:
                res = await tier.read_rows([(keys[i], region.buffer(i, slot)) for i in idx])
                assert all(isinstance(r, tuple) for r in res), res

    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in range(0, len(keys), args.batch)))
    if write:
        await tier.flush()
    dt = time.perf_counter() - t0
    await tier.close()
    return dt


async def main(args: argparse.Namespace) -> dict:
    slot = args.row_payload + 4096
    nrows = max(args.groups, args.size // slot)
    total = nrows * slot
    tmp = tempfile.mkdtemp(prefix="kvtier-tier-io-", dir=args.dir)
    try:
        io = select_backend("auto", args.direct_io, tmp)
        region = HostRegion(total, pin=False)
        region.prefault()
        keys = [
            kvtier.OffloadKey(hashlib.sha256(str(i).encode()).digest(), i % args.groups)
            for i in range(nrows)
        ]
        res: dict[str, list[float]] = {
            "raw_write": [],
            "tier_write": [],
            "raw_read": [],
            "tier_read": [],
        }
        loop = asyncio.get_running_loop()
        for r in range(args.repeat):
            root = os.path.join(tmp, f"tier{r}")
            path = os.path.join(tmp, "raw.bin")
            res["raw_write"].append(
                await loop.run_in_executor(
                    None, raw, io, path, region, total, args.request, args.threads, True
                )
            )
            res["tier_write"].append(await tier_pass(root, args, region, keys, True))
            res["raw_read"].append(
                await loop.run_in_executor(
                    None, raw, io, path, region, total, args.request, args.threads, False
                )
            )
            res["tier_read"].append(await tier_pass(root, args, region, keys, False))
            shutil.rmtree(root)
        region.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    gbps = {k: round(total / statistics.median(v) / 1e9, 3) for k, v in res.items()}
    return {
        "bytes": total, "rows": nrows, "row_nbytes": slot,
        "direct_io": io.direct, "backend": type(io).__name__,
        "gbps": gbps,
        "write_ratio": round(gbps["tier_write"] / gbps["raw_write"], 3),
        "read_ratio": round(gbps["tier_read"] / gbps["raw_read"], 3),
    }  # fmt: skip


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=parse_size, default="1G")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument(
        "--row-payload",
        type=int,
        default=786432,
        help="bytes (gemma-3-270m: 3 layers x 16 blocks x 16 KiB)",
    )
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--request", type=parse_size, default="4M")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--direct-io", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    out = uvloop.run(main(a))
    g = out["gbps"]
    print(
        f"raw_write {g['raw_write']:.2f} GB/s, tier_write {g['tier_write']:.2f} GB/s "
        f"({out['write_ratio']:.2f}x); raw_read {g['raw_read']:.2f} GB/s, "
        f"tier_read {g['tier_read']:.2f} GB/s ({out['read_ratio']:.2f}x)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
