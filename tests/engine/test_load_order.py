"""Load calls into the same GPU blocks land in call order, also when the earlier one waits.

A load call whose key must first be promoted from NVMe (or whose store is in
flight) submits its copies only after that wait. A later load call that writes
one of its GPU blocks waits for it (``TransferEngine._take_turn``), so the later
call's bytes are the ones left; a later call into other blocks does not wait.
The promotion is held back through a real seam: a RowIO wrapper whose reads
wait for an event (``NVMeConfig.row_io_wrapper``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from tests.engine.helpers import Gate, fill_random, key


class _Rig:
    """One group of 16 blocks of 64 bytes; key ``x`` only on NVMe, key ``y`` in a CPU slot."""

    def __init__(self, tmp_path: Path) -> None:
        self.t = torch.empty((16, 64), dtype=torch.uint8)
        fill_random(self.t, 17)
        self.layout = kvtier.KVLayout.from_tensors({0: {"kv": self.t}})
        self.gate = Gate()  # NVMe reads wait here once armed
        nvme = kvtier.NVMeConfig(
            root=tmp_path,
            capacity_bytes=1 << 24,
            namespace="load-order",
            row_io_wrapper=self.gate.wrap,
        )
        self.config = kvtier.EngineConfig(1 << 20, 1, nvme=nvme, copy_threads=2)
        self.x, self.y = key("x", 0), key("y", 0)
        self.x_bytes, self.y_bytes = self.t[1].clone(), self.t[2].clone()

    @contextlib.asynccontextmanager
    async def engine(self) -> AsyncIterator[kvtier.TransferEngine]:
        """An open engine where ``x`` is on NVMe only and ``y`` in a CPU slot; reads gated.

        On the way out (the test passed) no load turn is left; the gate is
        opened and the engine closed in any case.
        """
        async with kvtier.TransferEngine(self.layout, self.config) as first:
            await first.store([kvtier.Chunk(self.x, [1])], durable=True)
        engine = await kvtier.TransferEngine(self.layout, self.config).start()
        try:
            assert (await engine.store([kvtier.Chunk(self.y, [2])])).stored == (self.y,)
            assert engine.lookup([self.x, self.y]) == [
                kvtier.Residency.NVME,
                kvtier.Residency.CPU,
            ]
            self.gate.armed = True
            yield engine
            assert engine._load_order.turns == []
        finally:
            self.gate.opened.set()
            await engine.aclose()

    async def x_is_reading(self) -> None:
        """Return once the promotion of ``x`` waits at the gate."""
        reading = self.gate.reading
        for _ in range(3000):
            if reading.is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the promotion of x never read")


async def test_a_later_load_into_the_same_block_waits_for_the_promotion_and_wins(
    tmp_path: Path,
) -> None:
    rig = _Rig(tmp_path)
    async with rig.engine() as engine:
        first = asyncio.ensure_future(engine.load([kvtier.Chunk(rig.x, [5])]))
        second = asyncio.ensure_future(engine.load([kvtier.Chunk(rig.y, [5])]))
        await rig.x_is_reading()
        await asyncio.sleep(0.2)
        # Without the turn the later (resident) call took the fast path and was done by now.
        assert not second.done()
        rig.gate.opened.set()
        out = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert [r.loaded for r in out] == [(rig.x,), (rig.y,)]
        assert torch.equal(rig.t[5], rig.y_bytes)  # the later call's bytes are left


async def test_a_later_load_into_other_blocks_does_not_wait_for_the_promotion(
    tmp_path: Path,
) -> None:
    rig = _Rig(tmp_path)
    async with rig.engine() as engine:
        first = asyncio.ensure_future(engine.load([kvtier.Chunk(rig.x, [5])]))
        await rig.x_is_reading()
        out = await asyncio.wait_for(engine.load([kvtier.Chunk(rig.y, [6])]), 30)
        assert out.loaded == (rig.y,)
        assert torch.equal(rig.t[6], rig.y_bytes)
        assert not first.done()  # still waiting for its row
        rig.gate.opened.set()
        assert (await asyncio.wait_for(first, 30)).loaded == (rig.x,)
        assert torch.equal(rig.t[5], rig.x_bytes)


@pytest.mark.parametrize("how", ["cancelled", "read_failed"])
async def test_an_earlier_load_that_copies_nothing_lets_the_later_one_through(
    tmp_path: Path, how: str
) -> None:
    rig = _Rig(tmp_path)
    async with rig.engine() as engine:
        before = rig.t[5].clone()
        first = asyncio.ensure_future(engine.load([kvtier.Chunk(rig.x, [5])]))
        second = asyncio.ensure_future(engine.load([kvtier.Chunk(rig.y, [5])]))
        await rig.x_is_reading()
        if how == "cancelled":
            first.cancel()
        else:
            rig.gate.fail = True
        await asyncio.sleep(0.05)
        assert not second.done()  # the promotion of x is still in flight
        rig.gate.opened.set()
        assert (await asyncio.wait_for(second, 30)).loaded == (rig.y,)
        if how == "cancelled":
            with pytest.raises(asyncio.CancelledError):
                await first
        else:
            out = await first
            assert out.loaded == ()
            assert set(out.failed) == {rig.x}
        assert not torch.equal(before, rig.y_bytes)
        assert torch.equal(rig.t[5], rig.y_bytes)


async def test_three_calls_into_one_block_land_in_call_order(tmp_path: Path) -> None:
    """x (NVMe), then y, then z, all into block 5: each waits for the call before it."""
    rig = _Rig(tmp_path)
    async with rig.engine() as engine:
        calls = [
            asyncio.ensure_future(engine.load([kvtier.Chunk(rig.x, [5])])),
            asyncio.ensure_future(engine.load([kvtier.Chunk(rig.y, [5])])),
        ]
        await rig.x_is_reading()
        z = key("z", 0)
        assert (await engine.store([kvtier.Chunk(z, [3])])).stored == (z,)
        calls.append(asyncio.ensure_future(engine.load([kvtier.Chunk(z, [5])])))
        await asyncio.sleep(0.1)
        assert not any(c.done() for c in calls)
        rig.gate.opened.set()
        out = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [r.loaded for r in out] == [(rig.x,), (rig.y,), (z,)]
        assert torch.equal(rig.t[5], rig.t[3])  # the last call's bytes


@pytest.mark.parametrize("direction", ["store", "load"])
async def test_a_job_that_cannot_start_fails_its_calls_and_never_hangs(
    monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """An exception from the executor's submit (a bug) fails the job's calls, nothing waits."""
    from kvtier import _transfer

    t = torch.empty((8, 64), dtype=torch.uint8)
    fill_random(t, 3)
    layout = kvtier.KVLayout.from_tensors({0: {"kv": t}})
    a, b = key("a", 0), key("b", 0)
    real = _transfer.CopyExecutor.submit
    broken = {"left": 1}

    def submit(self: _transfer.CopyExecutor, *args: Any, **kw: Any) -> None:
        if self.direction == direction and broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("injected: submit broke")
        real(self, *args, **kw)

    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1)) as engine:
        if direction == "load":
            assert len((await engine.store([kvtier.Chunk(a, [1]), kvtier.Chunk(b, [2])])).stored)
        monkeypatch.setattr(_transfer.CopyExecutor, "submit", submit)
        calls = [engine.store, engine.load][direction == "load"]
        out = await asyncio.wait_for(
            asyncio.gather(calls([kvtier.Chunk(a, [5])]), calls([kvtier.Chunk(b, [6])])), 10
        )
        if direction == "store":
            assert [r.rejected for r in out] == [(a,), (b,)]
            assert engine.lookup([a, b]) == [kvtier.Residency.MISS] * 2
        else:
            for r, k in zip(out, (a, b), strict=True):
                assert isinstance(r.failed[k], kvtier.errors.TransferError)
        assert engine.stats().failures["transfer"] == 1
        # the next job starts as usual
        again = await asyncio.wait_for(calls([kvtier.Chunk(a, [7])]), 10)
        assert (again.stored if direction == "store" else again.loaded) == (a,)
        if direction == "store":  # a's slot holds block 7's bytes: load them into block 0
            assert (await engine.load([kvtier.Chunk(a, [0])])).loaded == (a,)
    assert torch.equal(t[7], t[0]) if direction == "store" else torch.equal(t[7], t[1])
