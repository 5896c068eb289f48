"""Prefetch: a call's NVMe-only keys promoted into CPU slots ahead of their load.

:func:`run_prefetch` runs one :meth:`kvtier.TransferEngine.prefetch` call as a
task of the engine (its close waits for it): it waits for the stores and
promotions in flight on the call's keys, then :func:`sort_keys` (no I/O)
pins the keys already resident and picks those only on NVMe, which the NVMe
writer reads into unpinned slots. Recency follows the call's order, head
first; for the policy a prefetch is a hint, not a use.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kvtier._in_flight import CallContext, on_no_medium, wait_in_flight
from kvtier._jobs import track
from kvtier._slots import SlotPool
from kvtier._types import OffloadKey, PrefetchResult

if TYPE_CHECKING:
    from kvtier._writeback import NVMeWriter
    from kvtier.io import NVMeTier


def sort_keys(
    keys: list[OffloadKey], pool: SlotPool, nvme: NVMeTier | None
) -> tuple[list[OffloadKey], list[OffloadKey], dict[OffloadKey, BaseException]]:
    """Pin the resident ones of a prefetch's ``keys``; pick those to promote.

    A resident key is pinned for the call: a store or promotion that needs
    room while the call's reads run must not evict a key it reports
    resident. The resident keys are refreshed tail first (a hint, not a
    use: the load that follows is one).

    Args:
        keys: the call's keys, in call order (none in flight).
        pool: the engine's slot pool.
        nvme: the engine's NVMe tier, or None.

    Returns:
        ``(resident, promote, failed)``: the keys pinned in their slots, the
        keys only on NVMe, and an error per key on no medium.
    """
    resident: list[OffloadKey] = []
    promote: list[OffloadKey] = []
    failed: dict[OffloadKey, BaseException] = {}
    for key in keys:
        entry = pool.get(key)
        if entry is not None and not entry.writing:
            pool.pin(key)
            resident.append(key)
        elif entry is None and nvme is not None and nvme.contains(key):
            promote.append(key)
        else:
            failed[key] = on_no_medium(key)
    for key in reversed(resident):  # the call's first key ends most recent
        pool.refresh(key)
    return resident, promote, failed


async def promote_ahead(
    keys: list[OffloadKey],
    ctx: CallContext,
    ready: dict[OffloadKey, asyncio.Future[bool]],
    pool: SlotPool,
    nvme: NVMeTier | None,
    writer: NVMeWriter | None,
) -> PrefetchResult:
    """The body of a prefetch call: wait for the keys in flight, then promote the NVMe-only ones.

    Args:
        keys: the call's keys (checked, distinct).
        ctx: set once the caller is gone: reads not started yet are skipped.
        ready: the engine's futures of keys in flight.
        pool: the engine's slot pool.
        nvme: the engine's NVMe tier, or None.
        writer: its writer (set when ``nvme`` is).

    Returns:
        :class:`PrefetchResult`; every key is unpinned again (resident and
        evictable, like a stored key).
    """
    await wait_in_flight(ready, keys, ctx)
    if ctx.cancelled:
        return PrefetchResult()
    resident, promote, failed = sort_keys(keys, pool, nvme)
    promoted: list[OffloadKey] = []
    try:
        if promote:
            assert writer is not None
            promoted, errors = await writer.promote(promote, protect=set(keys), hint=True)
            failed.update(errors)
            if promoted and resident:  # promoted after the residents were refreshed
                pool.refresh_tail_first(keys, {*resident, *promoted})
    finally:
        for key in (*resident, *promoted):
            pool.unpin(key)
    return PrefetchResult(tuple(promoted), tuple(resident), failed)


async def run_prefetch(
    keys: list[OffloadKey],
    ready: dict[OffloadKey, asyncio.Future[bool]],
    pool: SlotPool,
    nvme: NVMeTier | None,
    writer: NVMeWriter | None,
    tasks: set[asyncio.Future[Any]],
) -> PrefetchResult:
    """Run :func:`promote_ahead` as a task of the engine and await it.

    Cancellation: reads already started complete and their keys stay
    resident; reads not started yet are skipped; the result is lost.

    Args:
        keys: the call's keys (checked, distinct).
        ready: the engine's futures of keys in flight.
        pool: the engine's slot pool.
        nvme: the engine's NVMe tier, or None.
        writer: its writer (set when ``nvme`` is).
        tasks: the engine's futures in flight (its close waits for them).

    Returns:
        :class:`PrefetchResult` (``promoted``, ``resident``, ``failed``).
    """
    ctx = CallContext()
    task = asyncio.ensure_future(promote_ahead(keys, ctx, ready, pool, nvme, writer))
    track(tasks, task)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        ctx.cancelled = True  # reads not started yet are skipped
        raise
