"""NVMeTier.open(): cancellation at any point releases what the worker threads acquired."""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.io import NVMeTier, _files

from .conftest import GROUP_NBYTES, key, payload, tier_kwargs


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class _Gate:
    """Wraps a blocking step: it waits (in its worker thread) until released."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.go = threading.Event()
        self.calls = 0
        self.finished = 0
        self._cond = threading.Condition()

    def __call__(self, *args: Any) -> Any:
        with self._cond:
            self.calls += 1
        self.entered.set()
        self.go.wait(10)
        try:
            return self.fn(*args)
        finally:
            with self._cond:
                self.finished += 1
                self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Block until every call that entered has returned."""
        with self._cond:
            return self._cond.wait_for(lambda: self.finished == self.calls, timeout)


async def _cancel_inside(tier: NVMeTier, gate: _Gate) -> None:
    """Cancel ``tier.open()`` (twice) while ``gate`` holds a worker thread, then let it go."""
    task = asyncio.get_running_loop().create_task(tier.open())
    assert await asyncio.to_thread(gate.entered.wait, 10)
    task.cancel()
    await asyncio.sleep(0.01)
    task.cancel()  # a second cancel during the cleanup changes nothing
    await asyncio.sleep(0.01)
    gate.go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    # even if open() returned early, wait until the threads are done before checking
    assert await asyncio.to_thread(gate.wait_idle, 10)
    await asyncio.sleep(0.05)


async def test_cancelled_open_releases_the_namespace_lock(tmp_path, monkeypatch) -> None:
    before = _open_fds()
    gate = _Gate(_files.prepare_directory)
    monkeypatch.setattr(_files, "prepare_directory", gate)
    tier = NVMeTier(**tier_kwargs(tmp_path / "nvme"))
    await _cancel_inside(tier, gate)
    assert gate.calls == gate.finished == 1
    monkeypatch.undo()
    assert _open_fds() == before  # the lock fd the thread opened was closed
    other = NVMeTier(**tier_kwargs(tmp_path / "nvme"))
    await other.open()  # not NamespaceLockedError
    await other.close()


async def test_cancelled_open_closes_scanned_segments(tmp_path, slots, monkeypatch) -> None:
    root = tmp_path / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    buf = slots(4)
    rows = [
        (key(i, i % 2), 0, 4, buf.fill(i, payload(key(i, i % 2), GROUP_NBYTES[i % 2])))
        for i in range(4)
    ]
    assert await tier.write_rows(rows) == [None] * 4
    await tier.close()
    before = _open_fds()
    gate = _Gate(_files.scan_segment)
    monkeypatch.setattr(_files, "scan_segment", gate)
    tier = NVMeTier(**tier_kwargs(root))
    await _cancel_inside(tier, gate)
    assert gate.calls >= 1
    assert gate.calls == gate.finished
    monkeypatch.undo()
    assert _open_fds() == before  # no segment handle and no lock fd left open
    again = NVMeTier(**tier_kwargs(root))
    await again.open()
    assert again.contains(key(0))
    await again.close()


async def test_open_cancelled_at_random_points_leaks_nothing(tmp_path) -> None:
    root = tmp_path / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    t0 = time.perf_counter()
    await tier.open()
    took = time.perf_counter() - t0
    await tier.close()
    before = _open_fds()
    rng = random.Random(7)
    for i in range(60):
        tier = NVMeTier(**tier_kwargs(root))
        task = asyncio.get_running_loop().create_task(tier.open())
        await asyncio.sleep(rng.uniform(0, took))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            await tier.close()
        assert _open_fds() == before, f"cancel #{i}: fds left open"
        probe = NVMeTier(**tier_kwargs(root))
        await probe.open()  # the namespace is free again
        await probe.close()


def _stray(kind: str, g0: pathlib.Path) -> str:
    """Put a stray entry named like a segment in ``g0``; return its name."""
    if kind == "directory":
        (g0 / "1.kvrows").mkdir()
    elif kind == "dangling_symlink":
        (g0 / "1.kvrows").symlink_to(g0 / "nonexistent")
    elif kind == "fifo":
        os.mkfifo(g0 / "1.kvrows")
    elif kind == "superscript_digit":
        (g0 / "\u00b2.kvrows").write_bytes(b"\0" * 8192)  # str.isdigit() but not int()
    else:
        (g0 / "01.kvrows").mkdir()  # a leading zero: not a name the tier writes
    return next(p.name for p in g0.iterdir() if p.name != "0.kvrows")


@pytest.mark.parametrize(
    ("kind", "counted"),
    [
        ("directory", 1),
        ("dangling_symlink", 1),
        ("fifo", 1),
        ("superscript_digit", 0),
        ("leading_zero", 0),
    ],
)
async def test_stray_segment_entry_is_skipped(tmp_path, slots, kind, counted) -> None:
    root = tmp_path / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    buf = slots(60, 32 * 1024)
    first = [(key(0), 0, 4, buf.fill(0, payload(key(0), GROUP_NBYTES[0])))]
    assert await tier.write_rows(first) == [None]
    await tier.close()
    g0 = tier.directory / "g0"
    name = _stray(kind, g0)
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()  # neither a raw OSError nor a ValueError
    try:
        assert tier.contains(key(0))
        assert tier.stats()["invalid_segments_at_open"] == counted
        # enough rows for a second segment: its number skips an unusable "1.kvrows"
        rows_per_segment = ((1 << 20) - 4096) // tier.row_nbytes(0)
        n = rows_per_segment + 5
        rows = [(key(i), 0, 4, buf.fill(i, payload(key(i), GROUP_NBYTES[0]))) for i in range(1, n)]
        assert await tier.write_rows(rows) == [None] * len(rows)
        assert all(tier.contains(key(i)) for i in range(n))
    finally:
        await tier.close()
    assert (g0 / name).exists() or (g0 / name).is_symlink()  # left alone
    again = NVMeTier(**tier_kwargs(root))
    await again.open()
    assert all(again.contains(key(i)) for i in range(n))
    assert again.stats()["invalid_segments_at_open"] == counted
    await again.close()
