"""A real RowIO backend with switches (gates, one-shot errors), and NVMe row helpers.

Shared by the index, restart and failed-sync test modules.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Sequence
from typing import Any

import kvtier
from kvtier.io import RowIO
from kvtier.io._format import TRAILER_NBYTES

from ..io.conftest import GROUP_NBYTES, Slots, key, payload
from ..io.faults import DelegatingRowIO

ROW0 = 5 * 4096  # a row of group 0 (GROUP_NBYTES[0] = 3 * 4096 + 100)
ROW1 = 2 * 4096  # a row of group 1


class Handle:
    """A segment handle that is not an int: the tier cannot punch holes through it."""

    def __init__(self, fd: int) -> None:
        self.fd_ = fd


class GateIO(DelegatingRowIO):
    """A real backend with switches: gates, one-shot errors, and optional boxed handles.

    ``box_handles``: hand the tier :class:`Handle` objects, so that blanking a
    row goes through :meth:`pwritev` (trailer overwrite) instead of a hole punch.
    """

    def __init__(self, inner: RowIO, *, box_handles: bool = False) -> None:
        super().__init__(inner)
        self.box = box_handles
        self.allocate_gate: threading.Event | None = None
        self.allocate_entered = threading.Event()
        self.read_gate: threading.Event | None = None
        self.read_entered = threading.Event()
        self.scan_read_error_at: int | None = None  # file offset of a trailer read that fails
        self.trailer_write_error = 0  # trailer-only writes (blanking) that fail with EIO
        self.fdatasync_error = 0
        self.lock = threading.Lock()

    def _fd(self, handle: Any) -> Any:
        return handle.fd_ if isinstance(handle, Handle) else handle

    def open(self, path: str | os.PathLike[str], create: bool) -> Any:
        fd = self.inner.open(path, create)
        return Handle(fd) if self.box else fd

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        if nbytes == TRAILER_NBYTES and file_offset == self.scan_read_error_at:
            raise OSError(errno.EIO, "injected EIO on a trailer read")
        if nbytes > TRAILER_NBYTES and self.read_gate is not None:
            self.read_entered.set()
            self.read_gate.wait(20)
        return self.inner.preadv(self._fd(handle), bufs, file_offset)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        if nbytes == TRAILER_NBYTES and file_offset > 4096:
            with self.lock:
                if self.trailer_write_error:
                    self.trailer_write_error -= 1
                    raise OSError(errno.EIO, "injected EIO on a trailer blanking")
        return self.inner.pwritev(self._fd(handle), bufs, file_offset)

    def fdatasync(self, handle: Any) -> None:
        with self.lock:
            if self.fdatasync_error:
                self.fdatasync_error -= 1
                raise OSError(errno.EIO, "injected EIO on fdatasync")
        self.inner.fdatasync(self._fd(handle))

    def allocate(self, handle: Any, nbytes: int) -> None:
        if self.allocate_gate is not None:
            self.allocate_entered.set()
            self.allocate_gate.wait(20)
        self.inner.allocate(self._fd(handle), nbytes)

    def close(self, handle: Any) -> None:
        self.inner.close(self._fd(handle))


class Holder:
    """``row_io_wrapper`` that keeps the :class:`GateIO` it made (one per tier)."""

    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        self.io: GateIO | None = None

    def __call__(self, inner: RowIO) -> RowIO:
        self.io = GateIO(inner, **self.kw)
        return self.io


def row_writes(buf: Slots, ids: Sequence[int], group_id: int = 0, salt: int = 0) -> list[Any]:
    """Rows to write for the keys ``key(i, group_id)``, their payloads filled into ``buf``."""
    out = []
    for n, i in enumerate(ids):
        k = key(i, group_id)
        out.append((k, 0, 4, buf.fill(n, payload(k, GROUP_NBYTES[group_id], salt))))
    return out


async def until_true(cond: Any, what: str, limit_s: float = 10.0) -> None:
    """Poll ``cond`` on the running loop every 2 ms; fail naming ``what`` after ``limit_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def payload_matches(buf: memoryview, k: kvtier.OffloadKey, salt: int = 0) -> bool:
    """Whether ``buf`` starts with the payload that :func:`row_writes` gave ``k``."""
    data = payload(k, GROUP_NBYTES[k.group_id], salt)
    return bytes(buf[: len(data)]) == data
