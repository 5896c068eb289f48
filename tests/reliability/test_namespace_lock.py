"""Two engines on one NVMe namespace: the second is refused with a clear, typed error.

The lock is the tier's ``flock`` on ``<namespace dir>/lock``, tested here at
engine level: in one process, across processes, and after the holder was
killed with SIGKILL (the kernel drops the lock with the process).
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

import pytest

import kvtier
from kvtier.errors import NamespaceLockedError

from ._crash_child import NAMESPACE, config, hold_chunks
from ._model import Gpu, chunks, load_check, store_ok

REPO = pathlib.Path(__file__).resolve().parents[2]


async def test_second_engine_in_one_process_is_refused(tmp_path: pathlib.Path) -> None:
    gpu = Gpu(num_blocks=32)
    cs = chunks(["l0", "l1", "l2"])
    async with kvtier.TransferEngine(gpu.layout, config(gpu, "store", str(tmp_path))) as first:
        await store_ok(first, gpu, cs)
        await first.flush()
        before = first.stats()
        second = kvtier.TransferEngine(gpu.layout, config(gpu, "store", str(tmp_path)))
        second_before = second.stats()
        with pytest.raises(NamespaceLockedError) as info:
            await second.start()
        message = str(info.value)
        assert isinstance(info.value, kvtier.KVTierError)
        assert repr(NAMESPACE) in message
        assert str(tmp_path) in message
        assert "(in this process)" in message
        assert second.stats() == second_before
        with pytest.raises(kvtier.EngineClosedError):
            second.lookup([cs[0].key])
        await second.aclose()
        # the holder is unaffected
        assert first.stats() == before
        assert not (await load_check(first, gpu, cs)).failed
        # another namespace on the same root is independent
        other = config(gpu, "store", str(tmp_path))
        nv = other.nvme
        assert nv is not None
        other_nv = kvtier.NVMeConfig(root=nv.root, capacity_bytes=nv.capacity_bytes, namespace="b")
        other = kvtier.EngineConfig(other.cpu_bytes, other.blocks_per_chunk, nvme=other_nv)
        async with kvtier.TransferEngine(gpu.layout, other) as third:
            assert third.lookup([cs[0].key]) == [kvtier.Residency.MISS]
    async with kvtier.TransferEngine(gpu.layout, config(gpu, "store", str(tmp_path))) as again:
        assert again.lookup([c.key for c in cs]) == [kvtier.Residency.NVME] * 3


async def test_lock_is_free_after_the_holder_is_sigkilled(tmp_path: pathlib.Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability._crash_child", "hold", str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    gpu = Gpu(num_blocks=32)
    try:
        assert proc.stdout is not None
        word, pid = proc.stdout.readline().split()
        assert word == "ready"
        engine = kvtier.TransferEngine(gpu.layout, config(gpu, "store", str(tmp_path)))
        with pytest.raises(
            NamespaceLockedError, match=rf"held by another open engine \(pid {pid}\)"
        ):
            await engine.start()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    async with kvtier.TransferEngine(gpu.layout, config(gpu, "store", str(tmp_path))) as engine:
        res = await load_check(engine, gpu, hold_chunks())  # flushed before "ready": all load
        assert len(res.loaded) == len(hold_chunks())
        await store_ok(engine, gpu, chunks(["after-kill"], first_block=24))
        await engine.flush()
