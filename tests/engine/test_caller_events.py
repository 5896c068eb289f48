"""The caller's stream event reaches the copy job of its call, on every path (CPU-runnable).

On CUDA each store/load call records an event on the calling thread's current
stream (``TransferEngine._mark``) and the job that copies its chunks waits for
it (``CopyExecutor.submit(..., after)``). The GPU tests check the ordering on
a device (``test_gpu_streams.py``); here ``_mark`` hands out numbered markers
on CPU layouts and the executor records what each job was told to wait for:
coalesced calls, the slow load path (waiting for a store in flight, NVMe
promotion), a failed job's per-call retries and ``BackgroundEngine``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier import _transfer
from tests.engine.helpers import filled_layout, key, same


class _Marker:
    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"mark{self.n}"


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[Any]]]:
    """Number each call's mark; record (direction, after) of every job submitted."""
    counter = itertools.count()

    def mark(self: kvtier.TransferEngine, after: Any) -> Any:
        return after if after is not None else _Marker(next(counter))

    recorded: list[tuple[str, list[Any]]] = []
    real = _transfer.CopyExecutor.submit

    def submit(
        self: _transfer.CopyExecutor,
        plan: Any,
        done: Any,
        after: Sequence[Any] = (),
        **kw: Any,
    ) -> None:
        recorded.append((self.direction, list(after)))
        real(self, plan, done, after, **kw)

    monkeypatch.setattr(kvtier.TransferEngine, "_mark", mark)
    monkeypatch.setattr(_transfer.CopyExecutor, "submit", submit)
    return recorded


def _names(after: list[Any]) -> list[str]:
    return [repr(a) for a in after]


async def test_coalesced_calls_pass_every_callers_mark_to_their_job(
    jobs: list[tuple[str, list[Any]]],
) -> None:
    layout, t = filled_layout((32, 2, 64), dtype=torch.float16, seed=3, name="t")
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2)) as engine:
        a, b = kvtier.Chunk(key("a", 0), [0, 1]), kvtier.Chunk(key("b", 0), [2, 3])
        await asyncio.gather(engine.store([a]), engine.store([b]))  # marks 0, 1: one job
        src = t.clone()
        t.zero_()
        await asyncio.gather(engine.load([a]), engine.load([b]))  # marks 2, 3: one job
    assert [d for d, _ in jobs] == ["store", "load"]  # one job per direction
    assert _names(jobs[0][1]) == ["mark0", "mark1"]
    assert _names(jobs[1][1]) == ["mark2", "mark3"]
    assert same(t[:4], src[:4])


async def test_an_explicit_after_is_passed_as_given(jobs: list[tuple[str, list[Any]]]) -> None:
    layout, _ = filled_layout((32, 2, 64), dtype=torch.float16, seed=3, name="t")
    mine = _Marker(99)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2)) as engine:
        await engine.store([kvtier.Chunk(key("x", 0), [5])], after=mine)
        await engine.load([kvtier.Chunk(key("x", 0), [6])], after=mine)
    assert [after for _, after in jobs] == [[mine], [mine]]


async def test_the_slow_load_path_keeps_the_mark_of_its_call(
    jobs: list[tuple[str, list[Any]]], tmp_path: Path
) -> None:
    """A load that waits for a store in flight, and one that promotes from NVMe."""
    layout, t = filled_layout((32, 2, 64), dtype=torch.float16, seed=3, name="t")
    nvme = kvtier.NVMeConfig(root=str(tmp_path), capacity_bytes=16 << 20, namespace="ev")
    config = kvtier.EngineConfig(layout.slot_nbytes(2), 2, nvme=nvme)  # one slot
    async with kvtier.TransferEngine(layout, config) as engine:
        a, b = kvtier.Chunk(key("a", 0), [0, 1]), kvtier.Chunk(key("b", 0), [2, 3])
        store = asyncio.ensure_future(engine.store([a]))  # mark0
        await asyncio.sleep(0)
        out = await engine.load([kvtier.Chunk(a.key, [8, 9])])  # mark1, waits for the store
        assert not out.failed
        await store
        await engine.flush()
        assert len((await engine.store([b])).stored) == 1  # mark2: evicts a from the slot
        await engine.flush()
        assert engine.lookup([a.key]) == [kvtier.Residency.NVME]
        out = await engine.load([kvtier.Chunk(a.key, [10, 11])])  # mark3, promotes
        assert not out.failed
        assert engine.stats().nvme_hits == 1
    assert [(d, _names(after)) for d, after in jobs] == [
        ("store", ["mark0"]),
        ("load", ["mark1"]),
        ("store", ["mark2"]),
        ("load", ["mark3"]),
    ]
    assert same(t[8:10], t[0:2])
    assert same(t[10:12], t[0:2])


async def test_a_failed_jobs_calls_are_copied_again_each_with_its_own_mark(
    jobs: list[tuple[str, list[Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, _ = filled_layout((32, 2, 64), dtype=torch.float16, seed=3, name="t")
    real = _transfer.run_plan
    failures = iter([True])

    def flaky(plan: Any, direction: str, *rest: Any, **kw: Any) -> None:
        if direction == "store" and len(plan) == 2 and next(failures, False):
            raise RuntimeError("injected copy failure")
        real(plan, direction, *rest, **kw)

    monkeypatch.setattr(_transfer, "run_plan", flaky)
    config = kvtier.EngineConfig(1 << 20, 2, copy_threads=1)  # the job is one unit
    async with kvtier.TransferEngine(layout, config) as engine:
        a, b = kvtier.Chunk(key("a", 0), [0, 1]), kvtier.Chunk(key("b", 0), [2, 3])
        ra, rb = await asyncio.gather(engine.store([a]), engine.store([b]))
        assert ra.stored == (a.key,)  # each call copied again on its own: both succeed
        assert rb.stored == (b.key,)
    assert [(d, _names(after)) for d, after in jobs] == [
        ("store", ["mark0", "mark1"]),
        ("store", ["mark0"]),
        ("store", ["mark1"]),
    ]


def test_background_engine_passes_the_callers_after(jobs: list[tuple[str, list[Any]]]) -> None:
    layout, _ = filled_layout((32, 2, 64), dtype=torch.float16, seed=3, name="t")
    mine = _Marker(7)
    with kvtier.BackgroundEngine(layout, kvtier.EngineConfig(1 << 20, 2)) as engine:
        engine.store([kvtier.Chunk(key("bg", 0), [4])], after=mine).result(30)
        engine.load([kvtier.Chunk(key("bg", 0), [5])]).result(30)  # marked on the engine
    assert jobs[0] == ("store", [mine])
    assert jobs[1][0] == "load"
    assert _names(jobs[1][1]) == ["mark0"]
