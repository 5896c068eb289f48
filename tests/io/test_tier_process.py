"""NVMeTier across processes: restart, namespace lock, SIGKILL at random points."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import signal

import pytest

from kvtier.errors import NamespaceLockedError
from kvtier.io import NVMeTier

from ._child import KILL_CAPACITY, kill_key, start_child
from .conftest import GROUP_NBYTES, key, payload, tier_kwargs


async def test_restart_in_new_process_reads_identical_bytes(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    buf = slots(9)
    ranges = {}
    for i in range(3):
        for g in range(3):
            k = key(i, g)
            ranges[k] = (i % 2, 4 - i % 3 // 2)
            data = payload(k, GROUP_NBYTES[g])
            assert await tier.write_rows([(k, *ranges[k], buf.fill(3 * i + g, data))]) == [None]
    await tier.flush()
    await tier.close()
    proc = start_child("read", str(root), "4")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    got = json.loads(out)
    for k, (start, stop) in ranges.items():
        digest = hashlib.sha256(payload(k, GROUP_NBYTES[k.group_id])).hexdigest()
        assert got[f"{k.group_id}:{k.block_hash.decode()}"] == [start, stop, digest]
    assert got["0:hash-3"] == "missing"


async def test_lock_is_freed_when_holder_is_killed(tmp_path) -> None:
    root = tmp_path / "nvme"
    proc = start_child("hold", str(root))
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        tier = NVMeTier(**tier_kwargs(root))
        with pytest.raises(NamespaceLockedError):
            await tier.open()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    await tier.close()


async def test_sigkill_at_random_points_never_gives_wrong_bytes(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    rng = random.Random(20240601)
    zygote = start_child("zygote", str(root))
    assert zygote.stdin is not None
    assert zygote.stdout is not None
    kw = tier_kwargs(root, capacity_bytes=KILL_CAPACITY, segment_nbytes=256 << 10)
    written: set = set()
    survived = 0
    out = slots(20 * 40)
    try:
        for iteration in range(20):
            zygote.stdin.write(f"go {iteration}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            await asyncio.sleep(rng.uniform(0.005, 0.25))  # the writer runs ~0.25 s
            os.kill(pid, signal.SIGKILL)
            assert zygote.stdout.readline().strip() == "reaped"
            written |= {kill_key(iteration, j) for j in range(40)}
            tier = NVMeTier(**kw)
            await tier.open()
            keys = sorted(written, key=lambda k: (k.group_id, k.block_hash))
            results = await tier.read_rows([(k, out[i]) for i, k in enumerate(keys)])
            for i, (k, r) in enumerate(zip(keys, results, strict=True)):
                if isinstance(r, tuple):
                    assert r == (0, 4)
                    data = payload(k, GROUP_NBYTES[k.group_id])
                    assert bytes(out[i][: len(data)]) == data, k
                    survived += 1
                else:
                    assert r.kind in ("missing", "checksum", "trailer", "short_read"), r
            assert tier.stats()["bytes_used"] <= KILL_CAPACITY
            await tier.close()
    finally:
        zygote.kill()
        zygote.communicate(timeout=30)
    assert survived > 0
