"""Lifecycle: an engine's state from new to closed, the thread it runs on, and its close.

:class:`Lifecycle` holds the state of one :class:`~kvtier.TransferEngine`:
``new -> starting -> open -> closing -> closed`` (a failed start goes from
``starting`` to ``closed``), the thread and event loop that started it
(every other call must come from them) and whether the close drops the rows
not yet written (a hard close). :meth:`Lifecycle.start` and
:meth:`Lifecycle.close` run the steps the engine hands them, once each and
in order: an ``aclose()`` while ``start()`` runs waits for the step in
progress, after which the start stops and releases what it set up.

The steps themselves are the functions below: :func:`open_pool` (the CPU
pool, pre-faulted off the loop), :func:`open_nvme` (the tier and its
writer), :func:`drain` (the work in flight at the close) and
:func:`release` (everything a start set up, also after a failed step).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from kvtier._slots import HostRegion
from kvtier.errors import BudgetError, EngineClosedError, WrongThreadError

if TYPE_CHECKING:
    from kvtier._config import NVMeConfig
    from kvtier._transfer import CopyExecutor, Direction
    from kvtier._types import OffloadKey
    from kvtier._writeback import NVMeWriter, WriterParts
    from kvtier.io import NVMeTier

State = Literal["new", "starting", "open", "closing", "closed"]

Step = Callable[[], Awaitable[None]]


class Lifecycle:
    """The state of one engine, the thread and loop it started on, and its close in progress.

    Loop thread only, except :attr:`state`, :attr:`closed` and :attr:`loop`,
    which any thread may read.

    Args:
        owner: the engine's class name, for :class:`WrongThreadError` messages.

    Attributes:
        state: ``"new"``, ``"starting"``, ``"open"``, ``"closing"`` or ``"closed"``.
        loop: the event loop :meth:`start` ran on (None before it).
        hard: the close drops the rows not yet written (``aclose(hard=True)``).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.state: State = "new"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.hard = False
        self._thread: int | None = None
        # While start() runs: its end (set once it returned or raised), and
        # whether aclose() asked it to stop at its next step.
        self._started: asyncio.Future[None] | None = None
        self._close_requested = False
        self._close_task: asyncio.Task[None] | None = None

    @property
    def closed(self) -> bool:
        """Whether the engine has closed (its close ended, or its start failed)."""
        return self.state == "closed"

    def check_open(self, *, loop: bool = False) -> None:
        """Raise unless the engine is open and called from the thread it started on.

        Args:
            loop: also require the event loop it started on (its coroutines).

        Raises:
            EngineClosedError: the engine is not open.
            WrongThreadError: called from another thread (or event loop).
        """
        if self.state != "open":
            hint = ""
            if self.state == "new":
                hint = " (start it first: `async with engine:` or `await engine.start()`)"
            raise EngineClosedError(f"engine is {self.state}; no call is accepted{hint}")
        self.check_thread("a call", loop=loop)

    def check_thread(self, what: str, *, loop: bool = False) -> None:
        """Raise unless called on the thread (with ``loop``: the event loop) the start ran on.

        Args:
            what: the call, as the message names it (``"aclose()"``).
            loop: also require the event loop.

        Raises:
            WrongThreadError: called from another thread (or event loop).
        """
        if threading.get_ident() != self._thread:
            where = "thread"
        elif loop and asyncio.get_running_loop() is not self.loop:
            where = "event loop"
        else:
            return
        raise WrongThreadError(
            f"{self.owner}: {what} from another {where} than the one it started on "
            "(call it only there; a synchronous serving loop uses kvtier.BackgroundEngine)"
        )

    async def start(self, set_up: Step, release: Step) -> None:
        """Run the engine's start: ``set_up``, then the engine is open.

        ``set_up`` calls :meth:`stop_if_closing` between its steps. If it
        raises (or is stopped that way), the engine is closed and
        ``release`` frees what it had set up before the error propagates.

        Args:
            set_up: the start's steps.
            release: frees what ``set_up`` set up, all or part of it.

        Raises:
            EngineClosedError: the engine was already started or closed, or
                :meth:`close` was called while it started.
            BaseException: whatever ``set_up`` raised.
        """
        if self.state != "new":
            raise EngineClosedError(f"engine cannot start in state {self.state!r}")
        self.state = "starting"
        loop = self.loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        started = self._started = loop.create_future()
        try:
            await set_up()
        except BaseException:
            self.state = "closed"
            try:
                await release()
            finally:
                started.set_result(None)
            raise
        self.state = "open"
        started.set_result(None)

    def stop_if_closing(self) -> None:
        """Between the start's steps: raise if :meth:`close` was called meanwhile.

        Raises:
            EngineClosedError: a close is waiting for the start.
        """
        if self._close_requested:
            raise EngineClosedError("engine closed (aclose) while it was starting")

    async def close(
        self, hard: bool, drain: Step, release: Step, cancel_writes: Callable[[], None]
    ) -> None:
        """Close the engine, once: ``drain``, then ``release``; every caller waits for the end.

        Called while :meth:`start` runs, it first waits for it (which then
        stops at its next step and releases what it set up). A second call
        with ``hard`` makes the close in progress hard.

        Args:
            hard: drop the rows not yet written.
            drain: waits for the engine's work in flight (:attr:`hard` may
                change while it runs).
            release: frees what the start set up; runs even if ``drain`` raised.
            cancel_writes: drops the queued row writes now (a hard request
                while the close drains).

        Raises:
            WrongThreadError: called from another thread or event loop than
                the engine's while it is not closed (nothing changed).
            BaseException: what ``release`` raised (each caller sees it).
        """
        if self.state == "new":
            self.state = "closed"
        if self.state != "closed":
            self.check_thread("aclose()", loop=True)
        if self._started is not None and not self._started.done():
            # start() is running, or releasing after a failure: its end comes first
            self._close_requested = True
            # start() releases everything and raises; if this caller is
            # cancelled meanwhile, start() still stops at its next step.
            await asyncio.shield(self._started)
        if self._close_task is None:
            if self.state == "closed":
                return
            self._close_task = asyncio.get_running_loop().create_task(
                self._close(hard, drain, release)
            )
            self._close_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        elif hard and self.request_hard_close():
            cancel_writes()
        await asyncio.shield(self._close_task)

    async def _close(self, hard: bool, drain: Step, release: Step) -> None:
        self.state = "closing"
        self.hard |= hard
        try:
            await drain()
        finally:
            self.state = "closed"
            await release()

    def request_hard_close(self) -> bool:
        """Make the close in progress, or about to start, hard: it drops rows not yet written.

        Once the engine is closed there is nothing left to drop.

        Returns:
            True when a close is in progress: the queued row writes are to be
            cancelled now (it may be draining them), not at its next step.
        """
        if self.state == "closed":
            return False
        self.hard = True
        return self.state == "closing"


async def open_pool(num_slots: int, slot_nbytes: int, cpu_bytes: int, pin: bool) -> HostRegion:
    """Allocate the CPU pool and pre-fault it in a worker thread.

    A failed or cancelled pre-fault is waited for (the worker thread still
    writes the region: unmapping it earlier would crash the process), then
    the region is freed and the error propagates.

    Args:
        num_slots: slots in the pool.
        slot_nbytes: bytes per slot.
        cpu_bytes: the configured budget (for the error message).
        pin: page-lock the region (``EngineConfig.pin_memory``).

    Returns:
        The pre-faulted region.

    Raises:
        BudgetError: the region cannot be allocated.
    """
    try:
        region = HostRegion(num_slots * slot_nbytes, pin=pin)
    except (OSError, MemoryError, OverflowError) as exc:
        raise BudgetError(
            f"cannot allocate the CPU pool: cpu_bytes={cpu_bytes} "
            f"({num_slots} slots of {slot_nbytes} bytes): {exc}"
        ) from exc
    prefault = asyncio.get_running_loop().run_in_executor(None, region.prefault)
    try:
        await asyncio.shield(prefault)
    except BaseException:
        while not prefault.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(prefault)
        region.close()
        raise
    return region


async def open_nvme(
    cfg: NVMeConfig, parts: WriterParts, on_promoted: Callable[[OffloadKey], None]
) -> tuple[NVMeTier, NVMeWriter]:
    """Open the NVMe tier and the writer that writes stored keys through to it.

    Args:
        cfg: the engine's ``config.nvme``.
        parts: what the writer is handed (the layout, the slot pool, the region...).
        on_promoted: called for each key a promotion committed into a slot.

    Returns:
        ``(tier, writer)``.

    Raises:
        ConfigError: the NVMe root is unusable.
        NamespaceLockedError: another engine holds the NVMe namespace.
    """
    from kvtier._writeback import NVMeWriter, open_tier

    tier = await open_tier(cfg, parts.layout, parts.blocks_per_chunk)
    try:
        writer = NVMeWriter(parts, tier, on_promoted=on_promoted)
    except BaseException:
        await tier.close()
        raise
    return tier, writer


async def drain(tasks: set[asyncio.Future[Any]], writer: Any, lifecycle: Lifecycle) -> None:
    """Wait for the engine's tasks and then its row writes, until none is left.

    Stores that finish meanwhile queue more row writes, so it loops. While
    ``lifecycle.hard`` is set the queued writes are cancelled instead.

    Args:
        tasks: the engine's futures in flight.
        writer: the engine's NVMe writer, or None.
        lifecycle: the engine's lifecycle (its ``hard`` flag).
    """
    while True:
        if lifecycle.hard and writer is not None:
            writer.cancel()
        if tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
        elif writer is not None and writer.busy:
            await writer.drain()
        else:
            break


async def release(
    tier: Any,
    writer: Any,
    executors: dict[Direction, CopyExecutor],
    host: dict[int, Any],
    region: HostRegion | None,
) -> None:
    """Free what a start set up (any part of it).

    The tier's close may raise (its final ``fdatasync`` failed); the writer,
    the copy threads and the CPU pool are released all the same.

    Args:
        tier: the NVMe tier, or None.
        writer: its writer, or None (detached: it drops the engine's parts).
        executors: the copy executors per direction (closed, then removed).
        host: the host views of ``region`` per group (removed before it is unmapped).
        region: the CPU pool, or None.

    Raises:
        StorageError: the tier's final ``fdatasync`` failed.
    """
    try:
        if tier is not None:
            await tier.close()
    finally:
        if writer is not None:
            writer.detach()
        for ex in executors.values():
            ex.close()
        executors.clear()
        host.clear()
        if region is not None:
            region.close()
