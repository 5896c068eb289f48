"""Fault-injecting and counting RowIO wrappers: real backends, real I/O, injected failures."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.io import RowIO


class DelegatingRowIO:
    """Forwards the blocking RowIO methods to a real backend; subclasses override some.

    Every method is written out (no ``__getattr__``): the tier asks the class
    whether it has ``submit_*``, so a subclass without them gets blocking calls.
    """

    def __init__(self, inner: RowIO) -> None:
        self.inner = inner
        self.name = inner.name
        self.direct = inner.direct

    def open(self, path: str | os.PathLike[str], create: bool) -> Any:
        return self.inner.open(path, create)

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        return self.inner.preadv(handle, bufs, file_offset)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        return self.inner.pwritev(handle, bufs, file_offset)

    def fdatasync(self, handle: Any) -> None:
        self.inner.fdatasync(handle)

    def allocate(self, handle: Any, nbytes: int) -> None:
        self.inner.allocate(handle, nbytes)

    def close(self, handle: Any) -> None:
        self.inner.close(handle)


class CountingRowIO(DelegatingRowIO):
    """Delegates to a real backend and counts requests (thread safe)."""

    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner)
        self.preadv_calls: list[tuple[int, int]] = []  # (file_offset, nbytes)
        self.pwritev_calls: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        with self._lock:
            self.preadv_calls.append((file_offset, sum(memoryview(b).nbytes for b in bufs)))
        return self.inner.preadv(handle, bufs, file_offset)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        with self._lock:
            self.pwritev_calls.append((file_offset, sum(memoryview(b).nbytes for b in bufs)))
        return self.inner.pwritev(handle, bufs, file_offset)

    def reset(self) -> None:
        with self._lock:
            self.preadv_calls.clear()
            self.pwritev_calls.clear()


Match = Callable[[str, int, int], bool]  # (op, file_offset, nbytes) -> inject?


@dataclass
class Fault:
    """One injected fault.

    ``action``: ``"errno"`` (raise OSError(err)), ``"short"`` (do the real I/O
    for ``keep`` bytes and return that count), ``"torn"`` (write only the
    first ``keep`` bytes of every buffer but report full success).
    """

    op: str  # "preadv" | "pwritev" | "fdatasync" | "allocate"
    action: str
    match: Match = field(default=lambda op, off, n: True)
    err: int = errno.EIO
    keep: int = 0
    times: int = 1_000_000
    hits: int = 0


class FaultyRowIO(CountingRowIO):
    """A real backend with faults injected at chosen requests."""

    def __init__(self, inner: RowIO, faults: Sequence[Fault] = ()) -> None:
        super().__init__(inner)
        self.faults = list(faults)

    def _fault(self, op: str, file_offset: int, nbytes: int) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if (
                    fault.op == op
                    and fault.hits < fault.times
                    and fault.match(op, file_offset, nbytes)
                ):
                    fault.hits += 1
                    return fault
        return None

    def _io(self, op: str, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        fn = self.inner.preadv if op == "preadv" else self.inner.pwritev
        fault = self._fault(op, file_offset, nbytes)
        if fault is None:
            return fn(handle, bufs, file_offset)
        if fault.action == "errno":
            raise OSError(fault.err, f"injected {errno.errorcode[fault.err]}")
        if fault.action == "short":
            views, left = [], fault.keep
            for b in bufs:
                take = min(left, memoryview(b).nbytes)
                if take:
                    views.append(memoryview(b)[:take])
                left -= take
            return fn(handle, views, file_offset) if views else 0
        if fault.action == "torn":  # write only the head (the payload) of every buffer
            offset = file_offset
            for b in bufs:
                mv = memoryview(b)
                fn(handle, [mv[: fault.keep]], offset)
                offset += mv.nbytes
            return nbytes
        raise AssertionError(fault.action)

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        n = sum(memoryview(b).nbytes for b in bufs)
        with self._lock:
            self.preadv_calls.append((file_offset, n))
        return self._io("preadv", handle, bufs, file_offset)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        n = sum(memoryview(b).nbytes for b in bufs)
        with self._lock:
            self.pwritev_calls.append((file_offset, n))
        return self._io("pwritev", handle, bufs, file_offset)

    def fdatasync(self, handle: Any) -> None:
        fault = self._fault("fdatasync", 0, 0)
        if fault is not None:
            raise OSError(fault.err, "injected fdatasync failure")
        self.inner.fdatasync(handle)

    def allocate(self, handle: Any, nbytes: int) -> None:
        fault = self._fault("allocate", 0, nbytes)
        if fault is not None:
            raise OSError(fault.err, "injected allocate failure")
        self.inner.allocate(handle, nbytes)
