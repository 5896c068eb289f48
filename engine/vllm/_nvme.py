"""The NVMe tier of the vLLM backend, on its own thread in the scheduler process.

vLLM's scheduler calls the manager synchronously and must never wait for
I/O. The :class:`~kvtier.io.NVMeTier` therefore runs on an event loop in a
thread of its own (``kvtier-nvme``); the manager hands it work with
:meth:`NVMeSide.write` / :meth:`NVMeSide.promote` (``call_soon_threadsafe``,
a few microseconds) and collects the results from :attr:`NVMeSide.done`, a
thread-safe deque, at its next call. The slot bookkeeping
(:class:`~kvtier._slots.SlotPool`) stays on the scheduler thread alone; the
thread only reads and writes the bytes of slots that the manager keeps
pinned (writes) or reserved (promotions) until their result is collected.

Residency questions (:meth:`contains`) read the tier's index from the
scheduler thread: one dict lookup, atomic under the GIL; a key evicted from
NVMe between that answer and its promotion comes back as a failed
promotion, i.e. a MISS.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from typing import Any

from kvtier._config import NVMeConfig
from kvtier._slots import HostRegion
from kvtier._types import OffloadKey
from kvtier._writeback import open_tier_for
from kvtier.errors import KVTierError, StorageError

Done = tuple[str, Any, int, Any]
"""``(kind, token, slot, result)``: kind ``"written"`` (result None or an error)
or ``"promoted"`` (result ``(start, stop)`` or an error)."""


class NVMeSide:
    """Owns the NVMe tier and its event loop thread.

    Args:
        nvme: the tier's settings.
        region: the scheduler's mapping of the slot memory.
        slot_nbytes: bytes per slot.
        layout_description: the worker's ``KVLayout.describe()``.
        blocks_per_chunk: GPU blocks per chunk.
        group_nbytes: group id -> unpadded bytes of one chunk.

    Raises:
        KVTierError: the tier did not open (the namespace is locked by
            another live engine, the root is not writable, ...).
    """

    def __init__(
        self,
        nvme: NVMeConfig,
        region: HostRegion,
        slot_nbytes: int,
        layout_description: dict[str, Any],
        blocks_per_chunk: int,
        group_nbytes: dict[int, int],
    ) -> None:
        self._region = region
        self._slot_nbytes = slot_nbytes
        self.done: collections.deque[Done] = collections.deque()
        self.counts = {"read_bytes": 0, "read_seconds": 0.0, "write_bytes": 0, "write_seconds": 0.0}
        self.failures = 0
        self._writes: list[tuple[Any, OffloadKey, int, int, int]] = []
        self._reads: list[tuple[Any, OffloadKey, int]] = []
        self._writing = False
        self._reading = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-nvme")
        self._thread.daemon = True
        self._thread.start()
        opened = asyncio.run_coroutine_threadsafe(
            open_tier_for(nvme, layout_description, blocks_per_chunk, group_nbytes), self._loop
        )
        try:
            self.tier = opened.result()
        except BaseException:
            self._stop_loop()
            raise

    # ------------------------------------------------------------ scheduler thread
    def contains(self, key: OffloadKey) -> bool:
        """Whether ``key`` has a verified-on-write row (a dict lookup; any thread)."""
        return self.tier.contains(key)

    def write(self, token: Any, key: OffloadKey, start: int, stop: int, slot: int) -> None:
        """Queue the row of the pinned ``slot``; ``("written", token, slot, err)`` follows."""
        self._loop.call_soon_threadsafe(self._add_write, (token, key, start, stop, slot))

    def promote(self, token: Any, key: OffloadKey, slot: int) -> None:
        """Read the row of ``key`` into the reserved ``slot`` (in the background).

        ``("promoted", token, slot, res)`` follows in :attr:`done`; ``res`` is
        the stored range or the read's error.
        """
        self._loop.call_soon_threadsafe(self._add_read, (token, key, slot))

    def close(self) -> None:
        """Write what is queued, make it durable, close the tier (blocks)."""
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        try:
            fut.result(timeout=120)
        except (concurrent.futures.TimeoutError, KVTierError, OSError):
            pass
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    # ------------------------------------------------------------ loop thread
    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _add_write(self, item: tuple[Any, OffloadKey, int, int, int]) -> None:
        self._writes.append(item)
        if not self._writing:
            self._writing = True
            self._spawn(self._write_loop())

    def _add_read(self, item: tuple[Any, OffloadKey, int]) -> None:
        self._reads.append(item)
        if not self._reading:
            self._reading = True
            self._spawn(self._read_loop())

    async def _write_loop(self) -> None:
        # Everything queued while a batch is written leaves together in the next.
        try:
            while self._writes:
                batch, self._writes = self._writes, []
                views = [self._region.buffer(s, self._slot_nbytes) for *_, s in batch]
                t0 = time.perf_counter()
                try:
                    results: list[BaseException | None] = await self.tier.write_rows(
                        [(k, a, b, v) for (_, k, a, b, _), v in zip(batch, views, strict=True)]
                    )
                except Exception as exc:  # the tier refused the whole call
                    results = [exc] * len(batch)
                finally:
                    for v in views:
                        v.release()
                self.counts["write_seconds"] += time.perf_counter() - t0
                for (token, key, _, _, slot), res in zip(batch, results, strict=True):
                    if res is None:
                        self.counts["write_bytes"] += self.tier.row_nbytes(key.group_id)
                    else:
                        self.failures += 1
                    self.done.append(("written", token, slot, res))
        finally:
            self._writing = False

    async def _read_loop(self) -> None:
        try:
            while self._reads:
                batch, self._reads = self._reads, []
                views = [self._region.buffer(s, self._slot_nbytes) for *_, s in batch]
                t0 = time.perf_counter()
                try:
                    results: list[tuple[int, int] | BaseException] = await self.tier.read_rows(
                        [(k, v) for (_, k, _), v in zip(batch, views, strict=True)]
                    )
                except Exception as exc:
                    results = [exc] * len(batch)
                finally:
                    for v in views:
                        v.release()
                self.counts["read_seconds"] += time.perf_counter() - t0
                for (token, key, slot), res in zip(batch, results, strict=True):
                    if isinstance(res, BaseException):
                        if not (isinstance(res, StorageError) and res.kind == "missing"):
                            self.failures += 1
                    else:
                        self.counts["read_bytes"] += self.tier.row_nbytes(key.group_id)
                    self.done.append(("promoted", token, slot, res))
        finally:
            self._reading = False

    async def _close(self) -> None:
        while self._tasks:
            await asyncio.wait(list(self._tasks))
        try:
            await self.tier.flush()
        finally:
            await self.tier.close()
