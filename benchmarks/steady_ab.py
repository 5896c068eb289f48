"""A full NVMe tier: how an evicted row is freed and reused, in three policies.

The NVMe tier alone (rows from resident CPU slots, as ``tier_io.py``). A tier
with room for the data set is filled, then new keys are written: every row
evicts one. Keys draw their group at random, so under strict LRU most
evictions free a row of another group than the one written, as when the
group mix of a serving engine's stores shifts. Alternating in every repeat:

- ``window``: kvtier as it is (``eviction_window=32``): a write evicts the
  least recently used key of its own group when it is among the 32 least
  recently used keys, and overwrites that row in place; otherwise as
  ``strict``.
- ``strict``: strict LRU (``eviction_window=1``): an evicted row
  of another group is blanked by zeroing its 4 KiB trailer and keeps its
  blocks; its group's next write overwrites it in place.
- ``punched``: the alternative of punching freed rows, restored from outside
  for this measurement: strict LRU, and such a row is blanked with a punched hole
  (``fallocate(PUNCH_HOLE)``), so its next write lands in unallocated blocks.
- ``overlapped``: as ``window``, but the rows of other groups that a batch
  evicts are blanked while its rows are written (the alternative
  ordering, restored from outside), not before: a crash could then leave more valid
  rows than ``capacity_bytes``, and a restart drop a flushed key to fit an
  evicted one. What writing after the blanking costs.
- ``raw_overwrite``: a raw sequential overwrite of one written file (same
  backend, O_DIRECT mode, 4 MiB requests, threads, ``fdatasync``).
- ``raw_fresh``: the same raw write into a new, freshly allocated file.

    python benchmarks/steady_ab.py               # 1 GiB, 6 groups of 772 KiB rows, 3 repeats
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import uvloop
from tier_io import raw  # benchmarks/ is the script's folder

import kvtier
import kvtier.io._blanking as blanking
import kvtier.io._files as files
import kvtier.io._writes as writes
from kvtier._slots import HostRegion
from kvtier.io import NVMeTier, select_backend


@contextlib.contextmanager
def punching() -> Iterator[None]:
    """The policy before: every row blanked is punched, within the disk budget too."""
    blank = files.blank_rows
    files.blank_rows = lambda io, h, spec, rows, punch=True: blank(io, h, spec, rows, True)
    try:
        yield
    finally:
        files.blank_rows = blank


@contextlib.contextmanager
def overlapped() -> Iterator[None]:
    """Blank a batch's evicted rows while its rows are written (the alternative ordering)."""
    reserve, settle = writes.reserve_rows, writes.settle_evictions
    before_writes: set[int] = set()  # tiers whose next settle is write_batch's first

    def reserve_rows(tier: NVMeTier, *a: object) -> object:
        before_writes.add(id(tier))
        return reserve(tier, *a)  # type: ignore[arg-type]

    async def settle_evictions(tier: NVMeTier) -> None:
        if id(tier) in before_writes:  # overlap the blanking with the writes
            before_writes.discard(id(tier))
            tier._spawn(blanking.reclaim(tier))
            return
        await settle(tier)

    writes.reserve_rows, writes.settle_evictions = reserve_rows, settle_evictions  # type: ignore[assignment]
    try:
        yield
    finally:
        writes.reserve_rows, writes.settle_evictions = reserve, settle


async def full_tier(
    root: str, args: argparse.Namespace, region: HostRegion, seed: int, window: int
) -> float:
    """Fill a tier, then time writing as many new keys (each evicts one); seconds."""
    slot = args.row_payload + 4096
    nrows = args.size // slot
    tier = NVMeTier(
        root=root, namespace="steady", capacity_bytes=nrows * slot,
        layout_description={"bench": "steady_ab"}, blocks_per_chunk=16,
        group_nbytes=dict.fromkeys(range(args.groups), args.row_payload),
        io_threads=args.threads, request_nbytes=args.request, eviction_window=window,
    )  # fmt: skip
    await tier.open()
    rng = random.Random(seed)

    async def write(tag: str) -> None:
        keys = [
            kvtier.OffloadKey(
                hashlib.sha256(f"{tag}{i}".encode()).digest(), rng.randrange(args.groups)
            )
            for i in range(nrows)
        ]
        sem = asyncio.Semaphore(2)

        async def one(first: int) -> None:
            async with sem:
                idx = range(first, min(nrows, first + 32))
                res = await tier.write_rows([(keys[i], 0, 16, region.buffer(i, slot)) for i in idx])
                assert all(r is None for r in res), res

        await asyncio.gather(*(one(b) for b in range(0, nrows, 32)))
        await tier.flush()

    await write("fill")
    t0 = time.perf_counter()
    await write("next")
    dt = time.perf_counter() - t0
    assert tier.stats()["evictions"] == nrows
    await tier.close()
    return dt


async def main(args: argparse.Namespace) -> None:
    slot = args.row_payload + 4096
    total = args.size // slot * slot
    tmp = tempfile.mkdtemp(prefix="kvtier-steady-ab-", dir=args.dir)
    try:
        io = select_backend("auto", "auto", tmp)
        region = HostRegion(total, pin=False)
        np.frombuffer(region.buffer(0, total), dtype=np.uint8)[:] = np.random.default_rng(
            0
        ).integers(0, 256, total, dtype=np.uint8)  # not zeros: a virtual disk may skip those
        loop = asyncio.get_running_loop()
        path = os.path.join(tmp, "raw.bin")
        res: dict[str, list[float]] = {
            "raw_fresh": [],
            "raw_overwrite": [],
            "window": [],
            "overlapped": [],
            "strict": [],
            "punched": [],
        }
        for r in range(args.repeat):
            for fresh in (True, False):
                dt = await loop.run_in_executor(
                    None, raw, io, path, region, total, args.request, args.threads, True, fresh
                )
                res["raw_fresh" if fresh else "raw_overwrite"].append(dt)
            names = ["window", "overlapped", "strict", "punched"]
            for name in names[r % 4 :] + names[: r % 4]:
                root = os.path.join(tmp, name)
                patch = {"punched": punching, "overlapped": overlapped}.get(name)
                with patch() if patch else contextlib.nullcontext():
                    window = 32 if name in ("window", "overlapped") else 1
                    res[name].append(await full_tier(root, args, region, r, window))
                shutil.rmtree(root)
            print(r, {k: round(total / v[-1] / 1e9, 2) for k, v in res.items()}, flush=True)
        region.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    gbps = {k: total / statistics.median(v) / 1e9 for k, v in res.items()}
    print(
        f"{total / 1e9:.2f} GB, median of {args.repeat}: "
        + ", ".join(f"{k} {v:.2f} GB/s" for k, v in gbps.items())
        + f"; window/overlapped {gbps['window'] / gbps['overlapped']:.2f}x, "
        f"window/strict {gbps['window'] / gbps['strict']:.2f}x, "
        f"strict/punched {gbps['strict'] / gbps['punched']:.2f}x, "
        f"window/raw_overwrite {gbps['window'] / gbps['raw_overwrite']:.2f}x"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1 << 30, help="bytes")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--row-payload", type=int, default=786432, help="bytes (gemma-3-270m)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--request", type=int, default=4 << 20, help="bytes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None)
    uvloop.run(main(p.parse_args()))
