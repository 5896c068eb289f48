"""Jobs: store and load calls coalesced into copy jobs, and a failed job's calls isolated.

The calls submitted in one loop iteration are started together, as jobs of at
most ``max_batch_chunks`` copies each, on the direction's copy executor. A job
that fails is copied again call by call, so that only the calls whose own
copies fail get the error.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier._stats import Counters
from kvtier._transfer import ChunkCopy, CopyExecutor, Direction
from kvtier.errors import TransferError

log = logging.getLogger("kvtier")


@dataclass(eq=False)  # compared by identity (its copies hold tensors)
class Call:
    """One store/load call's share of a job.

    ``done(error)`` runs on the event loop once the call's copies have ended
    (``error`` is None or the :class:`TransferError`); it must not raise.
    """

    copies: list[ChunkCopy]
    done: Callable[[BaseException | None], None]
    after: Any = None  # CUDA: the torch.cuda.Event the copies wait for (see TransferEngine._mark)


def finish_calls(calls: Sequence[Call], errors: Sequence[BaseException | None]) -> None:
    """Run every call's ``done`` (one failing does not skip the others)."""
    for call, error in zip(calls, errors, strict=True):
        try:
            call.done(error)
        except Exception:
            log.exception("kvtier: finishing a call failed")


def _forget(tasks: set[asyncio.Future[Any]], task: asyncio.Future[Any]) -> None:
    """Forget a finished internal task and retrieve its outcome.

    A caller cancelled while the task ran no longer awaits it (the shield
    dropped its callback); retrieving the exception here keeps asyncio
    from logging "Task exception was never retrieved".
    """
    tasks.discard(task)
    if not task.cancelled():
        task.exception()


def track(tasks: set[asyncio.Future[Any]], fut: asyncio.Future[Any]) -> None:
    """Add ``fut`` to ``tasks`` until it is done (an engine's close waits for ``tasks``)."""
    tasks.add(fut)
    fut.add_done_callback(functools.partial(_forget, tasks))


class JobQueue:
    """The calls of both directions waiting to start, and the jobs they become.

    Args:
        counters: the engine's counters (jobs, bytes, seconds, failures).
        max_batch_chunks: the most copies one job holds.
        executors: the engine's copy executor per direction (filled at its start).
        tasks: the engine's futures in flight, which its close waits for.
    """

    def __init__(
        self,
        counters: Counters,
        max_batch_chunks: int,
        executors: dict[Direction, CopyExecutor],
        tasks: set[asyncio.Future[Any]],
    ) -> None:
        # Shared with the engine, not references to it: a closed engine is
        # freed by reference counting, without a cyclic collection.
        self._counters = counters
        self._max_batch_chunks = max_batch_chunks
        self._executors = executors
        self._tasks = tasks
        self._pending: dict[Direction, list[Call]] = {"store": [], "load": []}
        # A future per direction while a flush of pending calls is scheduled.
        self._flushing: dict[Direction, asyncio.Future[None] | None] = {"store": None, "load": None}

    def submit(self, direction: Direction, call: Call) -> None:
        """Queue ``call``; the calls queued in one loop iteration are started as jobs together."""
        self._pending[direction].append(call)
        if self._flushing[direction] is None:
            loop = asyncio.get_running_loop()
            self._flushing[direction] = tracker = loop.create_future()
            track(self._tasks, tracker)  # aclose waits until the jobs exist (and are tracked)
            loop.call_soon(self._flush_pending, direction)

    def _flush_pending(self, direction: Direction) -> None:
        tracker, self._flushing[direction] = self._flushing[direction], None
        calls, self._pending[direction] = self._pending[direction], []
        try:
            job: list[Call] = []
            size = 0
            for call in calls:
                if job and size + len(call.copies) > self._max_batch_chunks:
                    self._start(direction, job)
                    job, size = [], 0
                job.append(call)
                size += len(call.copies)
            if job:
                self._start(direction, job)
        finally:
            if tracker is not None:
                tracker.set_result(None)

    def _start(self, direction: Direction, calls: list[Call]) -> None:
        """Hand one job to the direction's executor; its end comes back as one callback."""
        plan = [c for call in calls for c in call.copies]
        tracker: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        track(self._tasks, tracker)
        t0 = time.perf_counter()
        executor = self._executors[direction]
        # A failed load job of several calls is copied again call by call BEFORE the
        # load jobs after it (the executor holds them until release()): a later call
        # into the same blocks then still wins.
        hold = direction == "load" and len(calls) > 1

        def isolated(_: asyncio.Future[None]) -> None:
            if hold:
                executor.release()
            tracker.set_result(None)

        def copied(error: BaseException | None) -> None:
            isolating = False
            try:
                self._counters.count_job(direction, plan, time.perf_counter() - t0, error)
                if error is not None and len(calls) > 1:
                    # A failed job must fail only the calls whose own copies
                    # fail: copy each call again on its own (copies are idempotent).
                    task = asyncio.ensure_future(self._isolate(direction, calls, hold))
                    task.add_done_callback(isolated)
                    track(self._tasks, task)
                    isolating = True
                    return
                finish_calls(calls, [error] * len(calls))
            except Exception:
                log.exception("kvtier: finishing a %s job failed", direction)
            finally:
                if not isolating:
                    if hold and error is not None:
                        executor.release()
                    tracker.set_result(None)

        after = [c.after for c in calls if c.after is not None]
        try:
            executor.submit(plan, copied, after, hold_on_error=hold)
        except Exception as exc:  # a bug: fail the calls rather than leave them waiting
            log.exception("kvtier: starting a %s job failed", direction)
            err = TransferError(f"{direction} job of {len(plan)} chunks could not start: {exc}")
            err.__cause__ = exc
            self._counters.count_job(direction, plan, 0.0, err)
            finish_calls(calls, [err] * len(calls))
            tracker.set_result(None)

    async def _isolate(self, direction: Direction, calls: list[Call], direct: bool) -> None:
        """Copy each call of a failed job again on its own, in call order.

        ``direct``: the executor holds the jobs after the failed one; these
        copies go past them.
        """
        errors: list[BaseException | None] = []
        for call in calls:
            try:
                after = () if call.after is None else (call.after,)
                await self._executors[direction].run(call.copies, after, direct=direct)
                errors.append(None)
            except TransferError as exc:
                errors.append(exc)
        finish_calls(calls, errors)

    def withdraw(self, direction: Direction, call: Call) -> bool:
        """Take a call out of the pending (not yet started) jobs and finish it as cancelled."""
        pending = self._pending[direction]
        if call not in pending:
            return False
        pending.remove(call)
        finish_calls([call], [asyncio.CancelledError()])
        return True
