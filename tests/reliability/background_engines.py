"""Engine race test helpers: engine and NVMe configs, waits, a durable store held in its write."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kvtier
from kvtier.errors import EngineClosedError

from ..engine.helpers import filled_layout, key
from ._faultio import KeyFault, Wrapper

BPC = 2


def nvme_cfg(
    root: Path, *, ns: str = "races", wrapper: Any = None, capacity: int = 16 << 20
) -> kvtier.NVMeConfig:
    """A 16 MiB NVMe tier (1 MiB segments) under ``root``, its RowIO wrapped by ``wrapper``."""
    return kvtier.NVMeConfig(
        root=root,
        capacity_bytes=capacity,
        namespace=ns,
        segment_nbytes=1 << 20,
        row_io_wrapper=wrapper,
    )


def engine_cfg(
    layout: kvtier.KVLayout, slots: int, nvme: kvtier.NVMeConfig | None = None, **kw: Any
) -> kvtier.EngineConfig:
    """``slots`` slots of ``BPC`` blocks of ``layout``; ``kw`` goes to the EngineConfig."""
    return kvtier.EngineConfig(slots * layout.slot_nbytes(BPC), BPC, nvme=nvme, **kw)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``cond`` from this thread every 2 ms; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


async def await_for(cond: Callable[[], bool], what: str, limit_s: float = 10.0) -> None:
    """Poll ``cond`` on the running loop every 2 ms; fail naming ``what`` after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def closed_seen(bg: kvtier.BackgroundEngine) -> bool:
    """Whether ``bg`` refuses new calls (its close has begun), through the public API."""
    try:
        bg.lookup([])
    except EngineClosedError:
        return True
    return False


@contextlib.contextmanager
def blocked_durable_store(
    tmp_path: Path,
) -> Iterator[tuple[kvtier.BackgroundEngine, concurrent.futures.Future[Any], kvtier.OffloadKey]]:
    """A BackgroundEngine whose durable store of one key waits in its row write.

    Yields ``(engine, the store's Future, its key)``; on exit the write is
    released, the store awaited and the engine closed.
    """
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    slow = key("slow", 0)
    fault = KeyFault("write", "block", hashes=frozenset({slow.block_hash}))
    bg = kvtier.BackgroundEngine(
        layout, engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=Wrapper(fault)))
    )
    bg.start()
    durable = bg.store([kvtier.Chunk(slow, [0, 1])], durable=True)
    try:
        wait_for(lambda: fault.hits == 1, "the durable row write to block")
        yield bg, durable, slow
    finally:
        fault.gate.set()
        with contextlib.suppress(BaseException):
            durable.result(10)
        bg.close()
