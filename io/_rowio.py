"""RowIO: the synchronous I/O backends of the NVMe tier, and their selection.

Every method of a :class:`RowIO` blocks; the tier calls them only from its own
worker threads, never from the event loop thread. Short counts are returned,
not raised: the caller decides that a short read or write is a failure.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import importlib.util
import logging
import mmap
import os
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvtier.errors import ConfigError
from kvtier.io._align import ALIGN, buffer_address, check_direct

__all__ = [
    "AioRowIO",
    "KvikioRowIO",
    "PosixRowIO",
    "RowIO",
    "SubmittingRowIO",
    "kvikio_available",
    "probe_direct_io",
    "select_backend",
]

log = logging.getLogger("kvtier.io")

IO_BACKENDS = ("auto", "posix", "kvikio", "aio")
"""The values of ``io_backend`` (:func:`select_backend`)."""

IOV_MAX = 1024
"""Most iovecs one ``preadv``/``pwritev`` call may take on Linux."""


@runtime_checkable
class RowIO(Protocol):
    """A file I/O backend for row files. All methods block (worker threads only).

    Attributes:
        name: short backend name (``"posix"``, ``"kvikio"``, ...).
        direct: whether requests bypass the page cache (O_DIRECT); then every
            buffer address, buffer length and file offset must be 4 KiB aligned.

    """

    name: str
    direct: bool

    def open(self, path: str | os.PathLike[str], create: bool) -> Any:
        """Open ``path`` read-write (creating it when ``create``); return a handle.

        Raises:
            OSError: the file cannot be opened.

        """
        ...

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        """Read into ``bufs`` in order from ``file_offset``; return bytes read.

        Raises:
            OSError: the backend failed (errno kept).
            AlignmentError: direct mode and a buffer or the offset is misaligned.

        """
        ...

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        """Write ``bufs`` in order at ``file_offset``; return bytes written.

        Raises:
            OSError: the backend failed (errno kept).
            AlignmentError: direct mode and a buffer or the offset is misaligned.

        """
        ...

    def fdatasync(self, handle: Any) -> None:
        """Make written data durable. Raises OSError."""
        ...

    def allocate(self, handle: Any, nbytes: int) -> None:
        """Make the file at least ``nbytes`` long, reserving blocks where possible.

        ``posix_fallocate``; where the filesystem does not support it,
        ``ftruncate`` (never shrinks). Raises OSError (e.g. ENOSPC).
        """
        ...

    def close(self, handle: Any) -> None:
        """Close the handle. Raises OSError."""
        ...


class SubmittingRowIO(RowIO, Protocol):
    """A :class:`RowIO` that can also queue row requests and return at once (``"aio"``).

    The tier sends row reads and writes through these methods when the class
    of the backend (or of the ``row_io_wrapper`` around it) defines them
    (:func:`submits`); everything else uses the blocking methods on worker
    threads.
    """

    def submit_pwritev(
        self, handle: Any, bufs: Sequence[memoryview], file_offset: int
    ) -> concurrent.futures.Future[int]:
        """Queue a write; the future gets the bytes written or the OSError."""
        ...

    def submit_preadv(
        self, handle: Any, bufs: Sequence[memoryview], file_offset: int
    ) -> concurrent.futures.Future[int]:
        """Queue a read; the future gets the bytes read or the OSError."""
        ...


def submits(row_io: object) -> bool:
    """Whether ``row_io``'s class defines ``submit_pwritev`` and ``submit_preadv``.

    Looked up on the class: a wrapper that forwards unknown attributes to the
    backend (``__getattr__``) is not taken for a submitting one, so its own
    ``preadv``/``pwritev`` still see every row request.
    """
    cls = type(row_io)
    return callable(getattr(cls, "submit_pwritev", None)) and callable(
        getattr(cls, "submit_preadv", None)
    )


def _check_request(bufs: Sequence[memoryview], file_offset: int) -> None:
    offset = file_offset
    for buf in bufs:
        check_direct(buffer_address(buf), memoryview(buf).nbytes, offset)
        offset += memoryview(buf).nbytes


def _allocate_fd(fd: int, nbytes: int) -> None:
    size = os.fstat(fd).st_size
    if size >= nbytes:
        return
    try:
        os.posix_fallocate(fd, size, nbytes - size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # not supported here
            raise
        os.ftruncate(fd, nbytes)


class PosixRowIO:
    """``os.preadv``/``os.pwritev`` on file descriptors, optionally with O_DIRECT.

    Args:
        direct: open files with ``O_DIRECT``; then :meth:`preadv` and
            :meth:`pwritev` check every iovec with
            :func:`kvtier.io._align.check_direct` before the system call.

    """

    def __init__(self, direct: bool) -> None:
        self.direct = bool(direct)
        self.name = "posix"

    def __repr__(self) -> str:
        return f"PosixRowIO(direct={self.direct})"

    def open(self, path: str | os.PathLike[str], create: bool) -> int:
        """Open ``path`` O_RDWR (plus O_CREAT, O_DIRECT as configured); return the fd."""
        flags = os.O_RDWR | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o644)

    def preadv(self, handle: int, bufs: Sequence[memoryview], file_offset: int) -> int:
        """See :meth:`RowIO.preadv`."""
        if self.direct:
            _check_request(bufs, file_offset)
        return os.preadv(handle, bufs, file_offset)

    def pwritev(self, handle: int, bufs: Sequence[memoryview], file_offset: int) -> int:
        """See :meth:`RowIO.pwritev`."""
        if self.direct:
            _check_request(bufs, file_offset)
        return os.pwritev(handle, bufs, file_offset)

    def fdatasync(self, handle: int) -> None:
        """See :meth:`RowIO.fdatasync`."""
        os.fdatasync(handle)

    def allocate(self, handle: int, nbytes: int) -> None:
        """See :meth:`RowIO.allocate`."""
        _allocate_fd(handle, nbytes)

    def close(self, handle: int) -> None:
        """See :meth:`RowIO.close`."""
        os.close(handle)


class AioRowIO(PosixRowIO):
    """The posix backend plus Linux AIO submission for row reads and writes.

    The blocking methods are :class:`PosixRowIO`'s (segment headers, scans,
    blanking use them); :meth:`submit_pwritev` and :meth:`submit_preadv`
    queue a request in the kernel and return a future at once, so requests do
    not wait for a worker thread to get the GIL back (see
    :mod:`kvtier.io._aio`). Needs O_DIRECT.

    Args:
        depth: most requests queued in the kernel at once.

    Raises:
        OSError: no AIO context could be created.

    """

    def __init__(self, depth: int) -> None:
        from kvtier.io._aio import AioContext

        super().__init__(direct=True)
        self.name = "aio"
        self._ctx = AioContext(depth)

    def __repr__(self) -> str:
        return f"AioRowIO(depth={self._ctx.depth})"

    def submit_pwritev(
        self, handle: int, bufs: Sequence[memoryview], file_offset: int
    ) -> concurrent.futures.Future[int]:
        """Queue a write of ``bufs`` at ``file_offset``; the future gets the bytes written.

        Raises:
            AlignmentError: a buffer or the offset is not 4 KiB aligned
                (checked before anything is queued).

        """
        _check_request(bufs, file_offset)
        return self._ctx.submit(True, handle, [memoryview(b) for b in bufs], file_offset)

    def submit_preadv(
        self, handle: int, bufs: Sequence[memoryview], file_offset: int
    ) -> concurrent.futures.Future[int]:
        """Queue a read into ``bufs`` from ``file_offset``; the future gets the bytes read.

        Raises:
            AlignmentError: a buffer or the offset is not 4 KiB aligned.

        """
        _check_request(bufs, file_offset)
        return self._ctx.submit(False, handle, [memoryview(b) for b in bufs], file_offset)

    def shutdown(self) -> None:
        """Wait for queued requests, then free the AIO context (blocks; idempotent)."""
        self._ctx.close()


def _each_buffer(
    op: Any, bufs: Sequence[memoryview], file_offset: int, limit: int | None = None
) -> int:
    """Run ``op(buf, nbytes, offset).get()`` for consecutive buffers; stop at a short one.

    ``limit``: the file size for reads. kvikio raises at end of file where
    POSIX returns a short count (``KVIKIO_EXPECT(nbytes_processed != 0, ...)``
    in ``cpp/include/kvikio/detail/posix_io.hpp``), so reads are cut at
    ``limit`` and come back short, as the RowIO contract says.

    Returns the bytes done in all (the caller treats a short total as failure).

    Raises:
        OSError: kvikio's ``RuntimeError`` (it carries no errno), mapped to the
            errno its message names (ENOSPC, EIO, ...), else EIO.
    """
    done = 0
    for buf in bufs:
        nbytes = memoryview(buf).nbytes
        if nbytes == 0:  # nothing to move; an empty iovec does not end the request
            continue
        want = nbytes if limit is None else max(0, min(nbytes, limit - file_offset - done))
        if want == 0:  # at the end of the file
            break
        view = memoryview(buf).cast("B")[:want] if want < nbytes else buf
        try:
            n = int(op(view, want, file_offset + done).get())
        except RuntimeError as exc:
            raise _kvikio_oserror(exc) from exc
        done += n
        if n != nbytes:
            break
    return done


_KVIKIO_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EINVAL, errno.EBADF, errno.EFBIG, errno.EDQUOT)


def _kvikio_oserror(exc: RuntimeError) -> OSError:
    """The OSError for a kvikio RuntimeError: the errno whose text it quotes, else EIO."""
    text = str(exc)
    for code in _KVIKIO_ERRNOS:
        if os.strerror(code) in text or errno.errorcode[code] in text:
            return OSError(code, f"kvikio: {text}")
    return OSError(errno.EIO, f"kvikio: {text}")


def _raise_kvikio_threads(kvikio: Any, threads: int) -> None:
    """Give kvikio's thread pool at least ``threads`` threads (it defaults to 1).

    Requests of ``gds_threshold`` bytes (1 MiB) or more go through that pool;
    with one thread the tier's ``io_threads`` requests would run one at a
    time. Never lowers a setting the process chose. Newer kvikio has
    ``defaults.get/set("num_threads")``; older releases
    ``get_num_threads``/``num_threads_reset`` (their ``set_num_threads`` is a
    context manager that changes nothing unless entered,
    ``python/kvikio/kvikio/defaults.py``).
    """
    try:
        defaults = getattr(kvikio, "defaults", None)
        if defaults is None:  # kvikio 26.x: a submodule that ``import kvikio`` does not load
            defaults = importlib.import_module("kvikio.defaults")
        if hasattr(defaults, "get_num_threads"):
            if defaults.get_num_threads() < threads:
                defaults.num_threads_reset(threads)
        elif int(defaults.get("num_threads")) < threads:
            defaults.set("num_threads", threads)
    except Exception as exc:  # an API this code does not know: keep kvikio's setting
        if not _warned_threads:  # once per process, not once per tier
            _warned_threads.append(True)
            log.warning("kvtier: could not raise kvikio's thread pool to %d: %s", threads, exc)


_warned_threads: list[bool] = []


class _KvikioHandle:
    __slots__ = ("cufile", "fd")

    def __init__(self, cufile: Any, fd: int) -> None:
        self.cufile = cufile
        self.fd = fd


class KvikioRowIO:
    """kvikio ``CuFile`` pread/pwrite (GDS where available), one call per iovec.

    kvikio is imported when the object is created, never at module import.
    A plain POSIX descriptor is kept next to each CuFile for ``fdatasync`` and
    ``allocate``. The blocking ``IOFuture.get()`` runs in the caller's worker
    thread, never on the event loop.

    Reads past the end of the file come back short and kvikio's errors as
    OSError with an errno (see :func:`_each_buffer`), as the RowIO contract
    asks; in direct mode every request is alignment-checked like the posix
    backend's.

    Args:
        direct: whether O_DIRECT works on the target filesystem (kvikio
            decides itself how it opens files; for host buffers it does
            ``pread``/``pwrite`` in its thread pool).
        threads: the tier's ``io_threads``: kvikio's thread pool is raised to
            at least this many threads.

    Raises:
        ImportError: kvikio is not installed.

    """

    def __init__(self, direct: bool = True, threads: int = 4) -> None:
        import kvikio

        self._kvikio = kvikio
        self.direct = bool(direct)
        self.name = "kvikio"
        _raise_kvikio_threads(kvikio, threads)

    def __repr__(self) -> str:
        return f"KvikioRowIO(direct={self.direct})"

    def open(self, path: str | os.PathLike[str], create: bool) -> _KvikioHandle:
        """Open ``path`` read-write through kvikio (creating it when ``create``)."""
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o644)
        try:
            cufile = self._kvikio.CuFile(os.fspath(path), "r+")
        except BaseException:
            os.close(fd)
            raise
        return _KvikioHandle(cufile, fd)

    def preadv(self, handle: _KvikioHandle, bufs: Sequence[memoryview], file_offset: int) -> int:
        """See :meth:`RowIO.preadv`; one ``CuFile.pread`` per buffer, stops at a short one."""
        if self.direct:
            _check_request(bufs, file_offset)
        return _each_buffer(handle.cufile.pread, bufs, file_offset, os.fstat(handle.fd).st_size)

    def pwritev(self, handle: _KvikioHandle, bufs: Sequence[memoryview], file_offset: int) -> int:
        """See :meth:`RowIO.pwritev`; one ``CuFile.pwrite`` per buffer, stops at a short one."""
        if self.direct:
            _check_request(bufs, file_offset)
        return _each_buffer(handle.cufile.pwrite, bufs, file_offset)

    def fdatasync(self, handle: _KvikioHandle) -> None:
        """See :meth:`RowIO.fdatasync`."""
        os.fdatasync(handle.fd)

    def allocate(self, handle: _KvikioHandle, nbytes: int) -> None:
        """See :meth:`RowIO.allocate`."""
        _allocate_fd(handle.fd, nbytes)

    def close(self, handle: _KvikioHandle) -> None:
        """See :meth:`RowIO.close`."""
        try:
            handle.cufile.close()
        finally:
            os.close(handle.fd)


def kvikio_available() -> bool:
    """Whether kvikio imports AND a CUDA driver loads (blocks; imports torch).

    True only when ``kvikio`` is importable, ``libcuda.so.1`` loads and
    ``torch.cuda.is_available()``.
    """
    if importlib.util.find_spec("kvikio") is None:
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
        import kvikio  # noqa: F401
        import torch
    except (ImportError, OSError):
        return False
    return bool(torch.cuda.is_available())


def probe_direct_io(probe_dir: str | os.PathLike[str]) -> bool:
    """Whether O_DIRECT really works in ``probe_dir`` (blocks: writes a file).

    Writes an aligned 4 KiB pattern to a temporary file with O_DIRECT, reads it
    back with O_DIRECT, compares and removes the file.

    Returns:
        True when the round trip succeeded bit for bit.

    Raises:
        OSError: the probe file cannot be created even without O_DIRECT
            (e.g. the directory is not writable).

    """
    path = os.path.join(os.fspath(probe_dir), f".kvtier-odirect-probe-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.close(fd)
    pattern = bytes(range(256)) * (ALIGN // 256)
    try:
        with mmap.mmap(-1, ALIGN) as out, mmap.mmap(-1, ALIGN) as back:
            out.write(pattern)
            try:
                fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:
                return False
            try:
                ok = os.pwritev(fd, [out], 0) == ALIGN and os.preadv(fd, [back], 0) == ALIGN
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a full filesystem: read only
                    return _probe_direct_read(probe_dir, back)
                return False
            finally:
                os.close(fd)
            return ok and back[:] == pattern
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _probe_direct_read(probe_dir: str | os.PathLike[str], buf: mmap.mmap) -> bool:
    """Whether an O_DIRECT read of a segment file's first 4 KiB returns its bytes.

    The probe of a full filesystem, where the write probe cannot allocate a
    block: False when the folder holds no segment file yet.
    """
    for path in sorted(pathlib.Path(probe_dir).glob("g*/*.kvrows"))[:1]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            try:
                n = os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
            with open(path, "rb") as f:
                return n == ALIGN and buf[:] == f.read(ALIGN)
        except OSError:
            return False
    return False


def select_backend(
    io_backend: str,
    direct_io: str,
    probe_dir: str | os.PathLike[str],
    aio_depth: int = 16,
    io_threads: int = 4,
) -> RowIO:
    """Choose and construct the RowIO backend (blocks: probes the filesystem).

    Args:
        io_backend: ``"auto"`` (kvikio when :func:`kvikio_available`, else
            posix), ``"posix"``, ``"kvikio"`` or ``"aio"`` (posix with Linux
            AIO submission of row requests; needs O_DIRECT).
        direct_io: ``"auto"`` (probe O_DIRECT in ``probe_dir``; on failure log
            a warning and use buffered I/O), ``"on"`` or ``"off"``.
        probe_dir: an existing writable directory on the target filesystem.
        aio_depth: requests queued in the kernel at once (``"aio"`` only).
        io_threads: the caller's I/O threads (``"kvikio"``: its thread pool
            gets at least this many).

    Returns:
        The backend; its ``direct`` attribute tells whether O_DIRECT is used.

    Raises:
        ConfigError: unknown option value; ``io_backend="kvikio"`` without
            kvikio or a CUDA driver; ``direct_io="on"`` where O_DIRECT fails;
            ``io_backend="aio"`` without O_DIRECT or a Linux AIO context.

    """
    if io_backend not in IO_BACKENDS:
        raise ConfigError(f"io_backend must be auto, posix, kvikio or aio, got {io_backend!r}")
    if direct_io not in ("auto", "on", "off"):
        raise ConfigError(f"direct_io must be auto, on or off, got {direct_io!r}")
    direct = False
    if direct_io != "off":
        direct = probe_direct_io(probe_dir)
        if not direct and direct_io == "on":
            raise ConfigError(f"direct_io='on' but O_DIRECT does not work in {probe_dir}")
        if not direct:
            log.warning("O_DIRECT does not work in %s; falling back to buffered I/O", probe_dir)
    if io_backend == "aio":
        if not direct:
            raise ConfigError(
                f"io_backend='aio' needs O_DIRECT, which is off or fails in {probe_dir}"
            )
        try:
            return AioRowIO(aio_depth)
        except OSError as exc:
            raise ConfigError(f"io_backend='aio': no Linux AIO context: {exc}") from exc
    use_kvikio = io_backend == "kvikio" or (io_backend == "auto" and kvikio_available())
    if use_kvikio:
        if io_backend == "kvikio" and not kvikio_available():
            raise ConfigError("io_backend='kvikio' needs kvikio and a loadable CUDA driver")
        return KvikioRowIO(direct, io_threads)
    return PosixRowIO(direct)
