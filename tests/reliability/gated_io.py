"""A real RowIO backend with switches (gates, one-shot errors), engines on it, NVMe row helpers.

Shared by the NVMe tier test modules of this package (index, restart, sync, row reuse).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import pathlib
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

import kvtier
from kvtier.errors import StorageError
from kvtier.io import NVMeTier, RowIO
from kvtier.io._format import TRAILER_NBYTES

from ..io.conftest import GROUP_NBYTES, Slots, key, payload
from ..io.faults import DelegatingRowIO
from ._model import Gpu, chunks, engine_config, nvme_config

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


async def read_payload(
    tier: NVMeTier, buf: Slots, k: kvtier.OffloadKey, i: int = 0
) -> bytes | None:
    """The payload of a visible key read into slot ``i`` (its range must be 0..4), or None."""
    (got,) = await tier.read_rows([(k, buf[i])])
    if isinstance(got, BaseException):
        return None
    assert got == (0, 4), (k, got)
    return bytes(buf[i][: GROUP_NBYTES[k.group_id]])


async def visible_payloads(tier: NVMeTier) -> dict[kvtier.OffloadKey, bytes | None]:
    """Every visible key's payload, read by :func:`read_payload` (None: its read failed)."""
    buf = Slots(1, 8 * 4096)
    try:
        return {k: await read_payload(tier, buf, k) for k in list(tier.keys())}
    finally:
        buf.close()


class SyncGateIO(GateIO):
    """GateIO whose fdatasync can wait on a gate (then fail or not) and whose writes can wait."""

    def __init__(self, inner: RowIO, **kw: Any) -> None:
        super().__init__(inner, **kw)
        self.sync_gate: threading.Event | None = None
        self.sync_entered = threading.Event()
        self.write_gate: threading.Event | None = None  # the next row write waits on it
        self.write_entered = threading.Event()
        self.syncs = 0
        self.paths: dict[Any, str] = {}
        self.fail_sync_of: set[str] = set()  # 'g<group>/<n>.kvrows' whose every fdatasync fails

    def open(self, path: Any, create: bool) -> Any:
        handle = super().open(path, create)
        p = pathlib.Path(path)  # a new segment is opened as <n>.kvrows.tmp, then renamed
        self.paths[self._fd(handle)] = f"{p.parent.name}/{p.name.removesuffix('.tmp')}"
        return handle

    def fdatasync(self, handle: Any) -> None:
        gate = self.sync_gate
        if gate is not None:
            self.sync_entered.set()
            gate.wait(20)
        with self.lock:
            self.syncs += 1
        if self.paths.get(self._fd(handle)) in self.fail_sync_of:
            raise OSError(errno.EIO, "injected EIO on the fdatasync of one segment")
        super().fdatasync(handle)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        gate = None
        if nbytes > TRAILER_NBYTES:  # a row write, not a blanking
            with self.lock:
                gate, self.write_gate = self.write_gate, None  # blocks one request
        if gate is not None:
            self.write_entered.set()
            gate.wait(20)
        return super().pwritev(handle, bufs, file_offset)


class SyncHolder(Holder):
    """``row_io_wrapper`` that keeps the :class:`SyncGateIO` it made (one per tier)."""

    io: SyncGateIO | None

    def __call__(self, inner: RowIO) -> RowIO:
        self.io = SyncGateIO(inner, **self.kw)
        return self.io


class LateIO(SyncGateIO):
    """SyncGateIO whose next row write can wait on a gate *after* its bytes were written."""

    def __init__(self, inner: RowIO, **kw: Any) -> None:
        super().__init__(inner, **kw)
        self.after_write_gate: threading.Event | None = None
        self.after_write_entered = threading.Event()

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        n = super().pwritev(handle, bufs, file_offset)
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        gate = None
        if nbytes > TRAILER_NBYTES:
            with self.lock:
                gate, self.after_write_gate = self.after_write_gate, None
        if gate is not None:
            self.after_write_entered.set()
            gate.wait(20)
        return n


class LateHolder(SyncHolder):
    """``row_io_wrapper`` that keeps the :class:`LateIO` it made (one per tier)."""

    io: LateIO | None  # type: ignore[assignment]

    def __call__(self, inner: RowIO) -> RowIO:
        self.io = LateIO(inner, **self.kw)
        return self.io


def engine_tier(engine: kvtier.TransferEngine) -> NVMeTier:
    """The NVMe tier of an engine that has one."""
    assert engine._writer is not None
    return engine._writer._tier


GatedEngine = tuple[
    Gpu, kvtier.TransferEngine, NVMeTier, Any, list[kvtier.Chunk]
]  # what gated_engine yields


@contextlib.asynccontextmanager
async def gated_engine(
    tmp_path: pathlib.Path,
    holder: Any,
    tags: Sequence[str],
    io_type: type[RowIO] = SyncGateIO,
    slots: int = 8,
) -> AsyncIterator[GatedEngine]:
    """An open engine of ``slots`` slots whose NVMe RowIO is ``holder``'s gated ``io_type``.

    Yields ``(gpu, engine, tier, io, chunks)``: ``chunks`` of group 0, one per tag.
    """
    gpu = Gpu()
    cfg = engine_config(gpu, slots, nvme_config(tmp_path, wrapper=holder))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        io = holder.io
        assert isinstance(io, io_type)
        yield gpu, engine, engine_tier(engine), io, chunks(list(tags), group_id=0)


def segment_rows(path: pathlib.Path) -> dict[int, tuple[bytes, int]]:
    """Row index -> (block hash, seq) of every non-blank trailer of a group-0 segment."""
    from kvtier.io._format import decode_trailer

    data = path.read_bytes()
    out = {}
    for i, off in enumerate(range(4096, len(data) - ROW0 + 1, ROW0)):
        trailer = data[off + ROW0 - TRAILER_NBYTES : off + ROW0]
        if any(trailer):
            t = decode_trailer(trailer)
            out[i] = (t.block_hash, t.seq)
    return out


def nvme_stat(bg: kvtier.BackgroundEngine, name: str) -> int:
    """The NVMe tier's stat ``name`` of a background engine."""
    nvme = bg.stats().nvme
    assert nvme is not None
    return int(nvme[name])


def until_true_blocking(cond: Any, what: str, limit_s: float = 10.0) -> None:
    """Poll ``cond`` from this thread every 2 ms; fail naming ``what`` after ``limit_s``."""
    done = threading.Event()
    for _ in range(int(limit_s / 0.002)):
        if cond():
            return
        done.wait(0.002)
    raise AssertionError(f"timed out waiting for {what}")


async def failed_durable_store(
    engine: kvtier.TransferEngine, gpu: Gpu, io: SyncGateIO, chunk: kvtier.Chunk
) -> None:
    """A durable store of ``chunk`` whose fdatasync fails (EIO): StorageError."""
    io.fdatasync_error = 1
    gpu.write(chunk)
    with pytest.raises(StorageError):
        await engine.store([chunk], durable=True)
