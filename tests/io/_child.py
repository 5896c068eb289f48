"""Subprocess side of the restart, lock and SIGKILL tests (``python -m tests.io._child``).

Commands:
    hold ROOT            open a tier, print "ready", sleep until killed
    read ROOT N          open a tier, read keys 0..N-1 of groups 0..2, print JSON
    dump ROOT JSON       open a tier with tier_kwargs overrides JSON, read every
                         visible key, print {"g:hash": [start, stop, sha256]}
    zygote ROOT          for every "go ITER" line on stdin: fork a writer child,
                         print its pid, reap it, print "reaped"
    evict ROOT CLOSE     fill a tier of EVICT_CAPACITY with EVICT_ORDER, whose
                         last key evicts the first (a key of another group),
                         flush; close the tier if CLOSE is "1", else exit
                         without closing (a crash after the flush)

The parent side starts it with :func:`start_child`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import mmap
import os
import pathlib
import subprocess
import sys

from kvtier.io import NVMeTier

from .conftest import GROUP_NBYTES, key, payload, tier_kwargs

REPO = pathlib.Path(__file__).resolve().parents[2]


def start_child(*args: str, **kw) -> subprocess.Popen:
    """Run this module in a new process with ``args`` (a command above), stdin and stdout piped."""
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # differs from ours on purpose
    return subprocess.Popen(
        [sys.executable, "-m", "tests.io._child", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        **kw,
    )


KILL_CAPACITY = 48 * 5 * 4096  # small: writers evict and reuse rows
EVICT_CAPACITY = 4 * 20480 + 2 * 16384  # four rows of group 0 and two of group 2
EVICT_ORDER = [(0, 0), (10, 2), (11, 2), (1, 0), (2, 0), (3, 0), (12, 2)]  # (i, group)


async def _hold(root: str) -> None:
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    print("ready", flush=True)
    await asyncio.sleep(3600)


async def _read(root: str, n: int) -> None:
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    mm = mmap.mmap(-1, 3 * n * 8 * 4096)
    view = memoryview(mm)
    keys = [key(i, g) for g in range(3) for i in range(n)]
    bufs = [view[j * 8 * 4096 : (j + 1) * 8 * 4096] for j in range(len(keys))]
    results = await tier.read_rows(list(zip(keys, bufs, strict=True)))
    out = {}
    for k, buf, r in zip(keys, bufs, results, strict=True):
        name = f"{k.group_id}:{k.block_hash.decode()}"
        if isinstance(r, tuple):
            out[name] = [r[0], r[1], hashlib.sha256(buf[: GROUP_NBYTES[k.group_id]]).hexdigest()]
        else:
            out[name] = getattr(r, "kind", repr(r))
    await tier.close()
    print(json.dumps(out), flush=True)


async def _dump(root: str, overrides: str) -> None:
    over = json.loads(overrides)
    if "group_nbytes" in over:
        over["group_nbytes"] = {int(g): n for g, n in over["group_nbytes"].items()}
    tier = NVMeTier(**tier_kwargs(root, **over))
    await tier.open()
    keys = tier.keys()
    group_nbytes = over.get("group_nbytes", GROUP_NBYTES)
    slot = max(tier.row_nbytes(g) for g in group_nbytes)
    mm = mmap.mmap(-1, max(1, len(keys)) * slot)
    view = memoryview(mm)
    bufs = [view[j * slot : (j + 1) * slot] for j in range(len(keys))]
    results = await tier.read_rows(list(zip(keys, bufs, strict=True)))
    out = {}
    for k, buf, r in zip(keys, bufs, results, strict=True):
        name = f"{k.group_id}:{k.block_hash.decode()}"
        nbytes = group_nbytes[k.group_id]
        out[name] = (
            [*r, hashlib.sha256(buf[:nbytes]).hexdigest()] if isinstance(r, tuple) else r.kind
        )
    await tier.close()
    print(json.dumps(out), flush=True)


def kill_key(iteration: int, j: int):
    """The j-th key written by writer ``iteration``: new keys plus rewrites of older ones."""
    i = iteration * 40 + j if j % 4 else (iteration * 40 + j) // 3
    return key(i, j % 3)


async def _write_forever(root: str, iteration: int) -> None:
    tier = NVMeTier(**tier_kwargs(root, capacity_bytes=KILL_CAPACITY, segment_nbytes=256 << 10))
    await tier.open()
    mm = mmap.mmap(-1, 4 * 8 * 4096)
    view = memoryview(mm)
    for start in [s for _ in range(15) for s in range(0, 40, 4)]:  # ~0.25 s of rewrites
        rows = []
        for j in range(start, start + 4):
            k = kill_key(iteration, j)
            slot = view[(j - start) * 8 * 4096 : (j - start + 1) * 8 * 4096]
            slot[: GROUP_NBYTES[k.group_id]] = payload(k, GROUP_NBYTES[k.group_id])
            rows.append((k, 0, 4, slot))
        await tier.write_rows(rows)
        if start % 8 == 0:
            await tier.flush()
    await tier.close()
    await asyncio.sleep(3600)  # wait for the kill with the lock released


async def _evict(root: str, close: bool) -> None:
    tier = NVMeTier(**tier_kwargs(root, capacity_bytes=EVICT_CAPACITY, grow_ahead=False))
    await tier.open()
    mm = mmap.mmap(-1, 8 * 4096)
    slot = memoryview(mm)
    for i, g in EVICT_ORDER:  # one call each: sequence numbers (the LRU) follow the order
        k = key(i, g)
        slot[: GROUP_NBYTES[g]] = payload(k, GROUP_NBYTES[g])
        assert await tier.write_rows([(k, 0, 4, slot)]) == [None]
    await tier.flush()
    print(json.dumps({"evictions": tier.stats()["evictions"]}), flush=True)
    if close:
        await tier.close()
    else:
        os._exit(0)  # no close: a crash after the flush


def _zygote(root: str) -> None:
    for line in sys.stdin:
        iteration = int(line.split()[1])
        pid = os.fork()
        if pid == 0:
            try:
                asyncio.run(_write_forever(root, iteration))
            finally:
                os._exit(0)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)


def main() -> None:
    cmd, root = sys.argv[1], sys.argv[2]
    if cmd == "hold":
        asyncio.run(_hold(root))
    elif cmd == "read":
        asyncio.run(_read(root, int(sys.argv[3])))
    elif cmd == "dump":
        asyncio.run(_dump(root, sys.argv[3]))
    elif cmd == "zygote":
        _zygote(root)
    elif cmd == "evict":
        asyncio.run(_evict(root, sys.argv[3] == "1"))
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
