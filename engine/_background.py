""":class:`BackgroundEngine`: a :class:`TransferEngine` on its own event-loop thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import numbers
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

from kvtier._config import EngineConfig
from kvtier._engine import TransferEngine
from kvtier._holds import Hold
from kvtier._transfer import record_event
from kvtier._types import (
    Chunk,
    ClearResult,
    EngineStats,
    LoadResult,
    OffloadKey,
    PrefetchResult,
    Residency,
    StoreResult,
)
from kvtier.errors import EngineClosedError, InvalidArgumentError
from kvtier.layout import KVLayout

T = TypeVar("T")

_CLOSED = "BackgroundEngine is closed or not started"


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        loop = asyncio.new_event_loop()
    return loop


class BackgroundEngine:
    """The same engine on a private uvloop thread, for synchronous serving loops.

    ``store``, ``load``, ``prefetch`` and ``flush`` return :class:`concurrent.futures.Future`
    objects (call ``.result()`` to block); ``lookup``, ``prefix_hits``,
    ``hold``, ``stored_range`` and ``stats`` return their values directly
    (they run on the engine thread).

    Args:
        layout: the registered GPU KV cache.
        config: sizing and policies.

    Attributes:
        engine: the :class:`TransferEngine` it runs (its coroutines belong
            to the engine thread; :meth:`TransferEngine.stats` is readable
            from any thread). ``kvtier.metrics.register_prometheus`` takes
            either.

    Raises:
        InvalidArgumentError: ``layout`` or ``config`` has the wrong type.
        BudgetError: ``cpu_bytes`` cannot hold one slot.
        ConfigError: ``NVMeConfig.capacity_bytes`` cannot hold one row.

    """

    def __init__(self, layout: KVLayout, config: EngineConfig) -> None:
        self.engine = TransferEngine(layout, config)
        self._loop = _new_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvtier-loop", daemon=True
        )
        self._closed = False
        self._lock = threading.Lock()  # orders submissions against close()
        # The Futures store/load/prefetch/flush returned: cancel() takes only these.
        self._issued: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()
        self._close_done = threading.Event()  # set once the first close() has finished
        self._close_error: BaseException | None = None

    @property
    def num_slots(self) -> int:
        """Slots in the CPU pool."""
        return self.engine.num_slots

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if not self._running():
                coro.close()
                raise EngineClosedError(_CLOSED)
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._issued.add(future)
            return future

    async def _call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def _running(self) -> bool:
        """Started and not closed (call it holding ``_lock``)."""
        return not self._closed and self._thread.is_alive()

    def _check_running(self) -> None:
        """Raise :class:`EngineClosedError` unless started and not closed."""
        with self._lock:
            if not self._running():
                raise EngineClosedError(_CLOSED)

    def _on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _query(self, fn: Any, *args: Any) -> Any:
        """Run a synchronous engine query on the engine thread and return its value.

        Called on the engine thread itself (a Future's done callback runs
        there), it runs at once: waiting for the loop from its own thread
        would block it forever.
        """
        if self._on_engine_thread():
            self._check_running()
            return fn(*args)
        return self._submit(self._call(fn, *args)).result()

    def _refuse_on_engine_thread(self, what: str) -> None:
        if self._on_engine_thread():
            raise InvalidArgumentError(
                f"BackgroundEngine.{what}() waits for the engine thread, so it cannot run on "
                "it (from a Future's done callback); call it from another thread"
            )

    def start(self) -> Self:
        """Start the loop thread and the engine (blocks until started).

        Raises:
            EngineClosedError: already started or closed.
            BudgetError, ConfigError, NamespaceLockedError: as
                :meth:`TransferEngine.start` (the thread is stopped again).
        """
        with self._lock:
            if self._closed or self._thread.ident is not None:
                raise EngineClosedError("BackgroundEngine can be started once")
            self._thread.start()
        try:
            self._submit(self.engine.start()).result()
        except BaseException:
            with contextlib.suppress(Exception):  # the start's error is the one to see
                self.close()
            raise
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def store(
        self, chunks: Sequence[Chunk], *, durable: bool = False, after: Any = None
    ) -> concurrent.futures.Future[StoreResult]:
        """:meth:`TransferEngine.store` on the engine thread; returns a Future.

        On a CUDA layout without ``after``, the copies wait for an event
        recorded here, on the CALLING thread's current stream (not the
        engine thread's): the work queued before the call.
        """
        after = self._caller_mark(after)
        return self._submit(self.engine.store(chunks, durable=durable, after=after))

    def load(
        self, chunks: Sequence[Chunk], *, after: Any = None
    ) -> concurrent.futures.Future[LoadResult]:
        """:meth:`TransferEngine.load` on the engine thread; returns a Future.

        ``after`` as for :meth:`store`: by default the copies wait for the
        work queued on the calling thread's current stream before the call.
        """
        after = self._caller_mark(after)
        return self._submit(self.engine.load(chunks, after=after))

    def _caller_mark(self, after: Any) -> Any:
        """``after``, or on a CUDA layout an event recorded now on this thread's current stream."""
        device = self.engine.layout.device
        if after is not None or device.type != "cuda":
            return after  # checked by the engine
        return record_event(device)  # pragma: no cover - CUDA hosts only

    def prefetch(self, keys: Sequence[OffloadKey]) -> concurrent.futures.Future[PrefetchResult]:
        """:meth:`TransferEngine.prefetch` on the engine thread; returns a Future."""
        return self._submit(self.engine.prefetch(keys))

    def cancel(self, future: concurrent.futures.Future[Any], timeout: float | None = None) -> bool:
        """Cancel a Future of this engine and wait until its call has ended on the engine thread.

        ``future.cancel()`` alone returns at once, while the engine thread may
        still be copying into the call's GPU blocks. After this method
        returns, nothing writes the blocks of a cancelled :meth:`load` any
        more, so they may be reused (it may also wait for other copies in
        flight).

        A Future that had already finished is left alone and ``False``
        returned at once (its call has ended).

        Args:
            future: a Future returned by :meth:`store`, :meth:`load`,
                :meth:`prefetch` or :meth:`flush`.
            timeout: seconds to wait at most (None: no limit).

        Returns:
            What ``future.cancel()`` returned (False: it had already finished).

        Raises:
            InvalidArgumentError: ``future`` is not a Future this engine
                returned, ``timeout`` is not None or a real number (``bool``
                excepted) in ``[0, threading.TIMEOUT_MAX]``, or the
                call is made on the engine thread (nothing is cancelled then).
            TimeoutError: the wait for the call (and the other work in flight
                when it was cancelled) did not end within ``timeout``.
            EngineClosedError: the engine is closed (then no call runs anyway).
        """
        if not isinstance(future, concurrent.futures.Future):
            raise InvalidArgumentError(
                f"cancel() takes a Future of this engine, got {type(future).__name__}"
            )
        with self._lock:
            ours = future in self._issued
        if not ours:  # another engine's: its copies would not be waited for
            raise InvalidArgumentError("cancel() takes a Future this engine returned")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, numbers.Real)
            or not 0 <= timeout <= threading.TIMEOUT_MAX
        ):
            raise InvalidArgumentError(
                f"timeout must be None (no limit) or seconds in [0, {threading.TIMEOUT_MAX:g}], "
                f"got {timeout!r}"
            )
        self._refuse_on_engine_thread("cancel")
        self._check_running()
        cancelled = future.cancel()
        if not cancelled and future.done():
            return False  # it had finished: its call has ended
        # Submitted after the cancellation (the loop runs them in order), so
        # the cancelled call has seen it when this starts.
        self._submit(self._settle()).result(None if timeout is None else float(timeout))
        return cancelled

    async def _settle(self) -> None:
        await asyncio.sleep(0)  # let the cancelled call react first
        # The work in flight now: a scheduled flush, then the jobs it starts,
        # then a failed job's isolation task (not work submitted later on).
        for _ in range(3):
            pending = self.engine.work_in_flight()
            if not pending:
                break
            await asyncio.wait(pending)

    def flush(self) -> concurrent.futures.Future[None]:
        """:meth:`TransferEngine.flush` on the engine thread; returns a Future."""
        return self._submit(self.engine.flush())

    def clear(self, *, nvme: bool = False) -> concurrent.futures.Future[ClearResult]:
        """:meth:`TransferEngine.clear` on the engine thread; returns a Future."""
        return self._submit(self.engine.clear(nvme=nvme))

    def lookup(self, keys: Iterable[OffloadKey]) -> list[Residency]:
        """:meth:`TransferEngine.lookup`, run on the engine thread (blocks briefly)."""
        result: list[Residency] = self._query(self.engine.lookup, keys)
        return result

    def hold(self, keys: Iterable[OffloadKey]) -> Hold:
        """:meth:`TransferEngine.hold`, run on the engine thread (blocks briefly).

        The returned :class:`Hold` may be released from any thread: the
        release runs on the engine thread (after :meth:`close` it does nothing).
        """
        held: Hold = self._query(self.engine.hold, keys)

        def on_engine_thread(release: Callable[[Hold], None], h: Hold) -> None:
            if self._on_engine_thread():
                release(h)
                return
            with contextlib.suppress(EngineClosedError):  # closing released it
                self._query(release, h)

        held.route_release(on_engine_thread)
        return held

    def prefix_hits(self, keys: Iterable[OffloadKey]) -> int:
        """:meth:`TransferEngine.prefix_hits`, run on the engine thread (blocks briefly)."""
        result: int = self._query(self.engine.prefix_hits, keys)
        return result

    def stored_range(self, key: OffloadKey) -> tuple[int, int] | None:
        """:meth:`TransferEngine.stored_range`, run on the engine thread (blocks briefly)."""
        result: tuple[int, int] | None = self._query(self.engine.stored_range, key)
        return result

    def stats(self) -> EngineStats:
        """:meth:`TransferEngine.stats`, run on the engine thread (blocks briefly)."""
        result: EngineStats = self._query(self.engine.stats)
        return result

    def close(self, *, hard: bool = False) -> None:
        """Close the engine and stop the thread (blocks until done). Idempotent.

        Calls submitted before ``close`` complete (or fail with
        :class:`EngineClosedError`); calls after it raise at once. A second
        ``close`` (from any thread) returns once the first one has finished;
        ``close(hard=True)`` during a soft close drops the rows that close
        has not written yet, as :meth:`TransferEngine.aclose` does.

        Raises:
            StorageError: the final ``fdatasync`` of the NVMe tier failed
                (raised by the first ``close`` only, once everything is
                released and the thread has stopped, as
                :meth:`TransferEngine.aclose` does).
            InvalidArgumentError: called on the engine thread (from a
                Future's done callback), where it could not wait.
        """
        self._refuse_on_engine_thread("close")
        with self._lock:
            first = not self._closed
            self._closed = True  # no submission can slip in after this point
            alive = self._thread.is_alive()
        if not first:
            if hard and alive:  # a soft close is running: drop its rows not yet written
                with contextlib.suppress(RuntimeError):  # the loop has closed already
                    self._loop.call_soon_threadsafe(self.engine._request_hard_close)
            self._close_done.wait()
            return
        try:
            if alive:
                asyncio.run_coroutine_threadsafe(self._shutdown(hard), self._loop).result()
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
            self._loop.close()
        finally:
            self._close_done.set()
        if self._close_error is not None:
            raise self._close_error

    async def _shutdown(self, hard: bool) -> None:
        """Close the engine, then settle every call still pending on the loop."""
        try:
            await self.engine.aclose(hard=hard)
        except Exception as exc:  # raised by close() once the thread has stopped
            self._close_error = exc
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
