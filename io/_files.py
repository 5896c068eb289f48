"""Blocking file-side steps of the NVMe tier; each runs in a tier worker thread.

Directory preparation and locking, segment creation, growth and scanning,
blanking of freed rows, and the coalesced row reads and writes (with trailer
encoding and verification). None of these functions may be called on the event loop thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import pathlib
import re
import stat
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError, NamespaceLockedError, StorageError, storage_error_kind
from kvtier.io._format import (
    HEADER_NBYTES,
    TRAILER_NBYTES,
    RowTrailer,
    decode_header,
    decode_trailer,
    encode_trailer,
    is_blank,
    payload_checksum,
)
from kvtier.io._index import RowEntry, RowRef
from kvtier.io._rowio import RowIO
from kvtier.keys import OffloadKey

SEGMENT_SUFFIX = ".kvrows"
NO_ROW = RowRef(-1, -1, -1)
"""The ``ref`` of a :class:`WriteJob` that has no row yet."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What the rows of one group must look like (fixed for a tier's lifetime)."""

    group_id: int
    digest: bytes
    payload_nbytes: int
    payload_region: int
    row_nbytes: int
    blocks_per_chunk: int

    def row_offset(self, row: int) -> int:
        """File offset in bytes of a row (4 KiB aligned)."""
        return HEADER_NBYTES + row * self.row_nbytes


@dataclass(slots=True)
class WriteJob:
    """One row of a ``write_rows`` call; ``buf`` is ``slot_buf[:row_nbytes]``."""

    key: OffloadKey
    start: int
    stop: int
    buf: memoryview
    pos: int
    ref: RowRef = NO_ROW
    seq: int = 0
    reserved: bool = True  # False: its capacity is reserved after its group grew


@dataclass(slots=True)
class ReadJob:
    """One row of a ``read_rows`` call; ``buf`` is ``slot_buf[:row_nbytes]``."""

    key: OffloadKey
    buf: memoryview
    entry: RowEntry
    pos: int


@dataclass(slots=True)
class ScanResult:
    """A segment found at open: handle, rows and counts (``handle`` None: unusable).

    ``num_rows`` is the header's row count, ``allocated_rows`` the rows the
    file holds in full (segment files grow lazily).
    """

    handle: Any
    num_rows: int = 0
    allocated_rows: int = 0
    rows: list[tuple[RowRef, OffloadKey, int, int, int]] = field(default_factory=list)
    invalid_rows: int = 0
    error: str = ""
    holes: list[int] = field(default_factory=list)
    """Allocated rows that hold no disk block (punched), where the filesystem tells."""
    holes_unsure: bool = False
    """``holes`` came from ``lseek(SEEK_DATA)`` (:func:`data_extents`): some may be rows
    allocated but never written, which hold their blocks."""


def prepare_directory(root: pathlib.Path, directory: pathlib.Path, format_json: str) -> int:
    """Check ``root``, create ``directory``, take its lock, write ``format.json``.

    Returns:
        The lock file descriptor (``flock`` held; released on close or death).

    Raises:
        ConfigError: ``root`` is not a directory or cannot be written.
        NamespaceLockedError: another live process (or tier) holds the lock.

    """
    try:
        if root.exists() and not root.is_dir():
            raise ConfigError(f"NVMe root {str(root)!r} exists and is not a directory")
    except OSError as exc:  # ENAMETOOLONG, ELOOP, EACCES on a parent, ...
        raise ConfigError(f"NVMe root {str(root)!r} is unusable: {exc}") from exc
    for _ in range(3):
        fd = _lock_directory(directory)
        if fd is not None:
            break
    else:
        raise NamespaceLockedError(
            f"NVMe namespace {str(directory)!r} was removed and recreated three times while "
            "this engine opened it (kvtier remove running against a live root?)"
        )
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        path = directory / "format.json"
        if not path.exists() or path.read_text(errors="replace") != format_json:
            tmp = directory / "format.json.tmp"
            tmp.write_text(format_json)
            os.replace(tmp, path)
        for stale in directory.glob(f"g*/*{SEGMENT_SUFFIX}.tmp"):
            stale.unlink()
    except OSError as exc:
        release_lock(fd)
        raise ConfigError(f"NVMe directory {str(directory)!r} is not writable: {exc}") from exc
    return fd


def _lock_directory(directory: pathlib.Path) -> int | None:
    """Create ``directory`` if needed and take the flock of its ``lock`` file.

    Returns:
        The locked descriptor, or None when the lock file was replaced while
        this call took it (``kvtier remove`` deleted the folder, and maybe
        an engine made it anew): the flock then sits on a deleted file, and
        the caller must try again.

    Raises:
        ConfigError: the directory cannot be created or written.
        NamespaceLockedError: another live process (or tier) holds the lock.

    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create NVMe directory {str(directory)!r}: {exc}") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"NVMe directory {str(directory)!r} is not writable")
    try:
        fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"NVMe directory {str(directory)!r} is not writable: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise NamespaceLockedError(
            f"NVMe namespace {str(directory)!r} is locked by another live engine"
        ) from exc
    if not same_file(fd, directory / "lock"):
        release_lock(fd)
        return None
    return fd


def same_file(fd: int, path: pathlib.Path) -> bool:
    """Whether ``path`` (not followed if a symlink) is still the file ``fd`` has open."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def release_lock(fd: int) -> None:
    """Release the namespace lock taken by :func:`prepare_directory`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


_SEGMENT_NAME = re.compile(r"(0|[1-9][0-9]*)" + re.escape(SEGMENT_SUFFIX))


def list_segments(group_dir: pathlib.Path) -> list[int]:
    """Segment numbers present in a group folder, ascending.

    Only names the tier writes count (``<n>.kvrows``, ``n`` in ASCII digits
    without leading zeros): other names (a superscript digit, ``007.kvrows``) are
    foreign files and are ignored. An entry with a segment name may still be
    unusable (a directory, a dangling link): :func:`scan_segment` reports it.
    """
    numbers = []
    if group_dir.is_dir():
        for path in group_dir.iterdir():
            m = _SEGMENT_NAME.fullmatch(path.name)
            if m:
                numbers.append(int(m.group(1)))
    return sorted(numbers)


def _aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)  # page aligned, zero filled


def validate_trailer(spec: GroupSpec, trailer: RowTrailer) -> str:
    """Return why a decoded trailer does not belong to this format/group ('' if fine)."""
    if trailer.digest != spec.digest:
        return "digest differs"
    if trailer.group_id != spec.group_id:
        return f"group {trailer.group_id} != {spec.group_id}"
    if trailer.payload_nbytes != spec.payload_nbytes:
        return f"payload_nbytes {trailer.payload_nbytes} != {spec.payload_nbytes}"
    if not 0 <= trailer.start < trailer.stop <= spec.blocks_per_chunk:
        return f"sub-block range {trailer.start}..{trailer.stop} invalid"
    return ""


def scan_segment(row_io: RowIO, path: pathlib.Path, spec: GroupSpec, number: int) -> ScanResult:
    """Open a segment, validate its header and read the trailer of every allocated row.

    Segment files grow lazily: a file may end before the ``num_rows`` rows
    its header announces; the rows it holds in full are allocated, the rest
    are not (a row cut in the middle counts invalid). Blank (all-zero)
    trailers are free rows; undecodable or foreign trailers are counted
    invalid (and are free space). A trailer that cannot be read (an I/O
    error, a short read) loses only its row: counted invalid, and free
    space too (its old trailer may still name
    a key, found again by a later open: see :meth:`RowIndex.rebuild`'s
    ``blind``). Nothing is written. An entry that is not a
    regular file (a directory, a FIFO) or cannot be opened (a dangling link)
    is unusable, like a bad header: never an exception.
    """
    handle: Any = None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise StorageError("header", f"{path.name} is not a regular file")
        handle = row_io.open(path, create=False)
        buf = _aligned(HEADER_NBYTES)
        if row_io.preadv(handle, [memoryview(buf)], 0) != HEADER_NBYTES:
            raise StorageError("header", "short segment header")
        header = decode_header(memoryview(buf))
        if (header.digest, header.group_id, header.row_nbytes) != (
            spec.digest,
            spec.group_id,
            spec.row_nbytes,
        ):
            raise StorageError("header", "segment header does not match the format")
        size = os.stat(path).st_size
        allocated = min(header.num_rows, max(0, (size - HEADER_NBYTES) // spec.row_nbytes))
        result = ScanResult(handle, header.num_rows, allocated)
        if allocated < header.num_rows and spec.row_offset(allocated) < size:
            result.invalid_rows += 1  # a row cut by a truncation (or a torn growth)
        extents = allocated_extents(handle, size)
        if extents is None:
            extents = data_extents(handle, size)
            result.holes_unsure = extents is not None
        if extents is not None:
            result.holes = _rows_without_blocks(spec, allocated, extents)
        view = memoryview(buf)
        for i in range(allocated):
            file_offset = spec.row_offset(i) + spec.payload_region
            try:
                n = row_io.preadv(handle, [view], file_offset)
            except OSError:
                n = -1
            if n != TRAILER_NBYTES:  # this row alone is lost
                result.invalid_rows += 1
                continue
            if is_blank(view):
                continue
            try:
                trailer = decode_trailer(view)
            except StorageError:
                result.invalid_rows += 1
                continue
            if validate_trailer(spec, trailer):
                result.invalid_rows += 1
                continue
            key = OffloadKey(trailer.block_hash, trailer.group_id)
            result.rows.append(
                (RowRef(spec.group_id, number, i), key, trailer.start, trailer.stop, trailer.seq)
            )
        return result
    except (StorageError, OSError) as exc:
        if handle is not None:
            with contextlib.suppress(OSError):
                row_io.close(handle)
        return ScanResult(None, error=str(exc))


def create_segment(
    row_io: RowIO, group_dir: pathlib.Path, number: int, header: bytes, nbytes: int
) -> Any:
    """Create ``<number>.kvrows`` atomically (temp file, fdatasync, rename); return its handle.

    The file is allocated to ``nbytes`` (header plus the first rows); the
    header may announce more rows, allocated later by :func:`grow_segment`.

    Raises:
        OSError, StorageError: the file could not be created, sized or written.

    """
    group_dir.mkdir(exist_ok=True)
    tmp = group_dir / f"{number}{SEGMENT_SUFFIX}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    handle = row_io.open(tmp, create=True)
    try:
        row_io.allocate(handle, nbytes)
        buf = _aligned(HEADER_NBYTES)
        buf.write(header)
        if row_io.pwritev(handle, [memoryview(buf)], 0) != HEADER_NBYTES:
            raise StorageError("short_write", f"short header write to {tmp}")
        row_io.fdatasync(handle)
        os.rename(tmp, group_dir / f"{number}{SEGMENT_SUFFIX}")
        dir_fd = os.open(group_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        row_io.close(handle)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return handle


def grow_segment(row_io: RowIO, handle: Any, nbytes: int, before: int | None = None) -> None:
    """Allocate a segment file up to ``nbytes`` (new rows read as zeros: blank trailers).

    A failed allocation may have extended the file with some of the blocks
    (ext4 keeps what ``fallocate`` got before ENOSPC): the file is then cut
    back to ``before`` bytes, its size before the call, which gives them
    back (no row beyond it is in use: growths of a group are serialized).

    Raises:
        OSError: e.g. ENOSPC (the file keeps its previous rows).

    """
    try:
        row_io.allocate(handle, nbytes)
    except OSError:
        if before is not None:
            with contextlib.suppress(OSError, AttributeError):
                fd = handle if isinstance(handle, int) else handle.fd
                if isinstance(fd, int) and os.fstat(fd).st_size > before:
                    os.ftruncate(fd, before)
        raise


def fill_row(handle: Any, spec: GroupSpec, row: int) -> None:
    """Allocate the disk blocks of a punched row before it is written.

    A write into a hole allocates blocks as it goes; on a full filesystem it
    fails with ENOSPC after the row was handed out. ``posix_fallocate`` of
    the row's byte range fails first instead, and the row can be given back.
    Does nothing where the filesystem does not support it or the handle has
    no file descriptor (the write then allocates).

    Raises:
        OSError: e.g. ENOSPC or EDQUOT (the blocks it got were punched again,
            as far as that worked: ext4 keeps what it allocated before failing).

    """
    fd = handle if isinstance(handle, int) else getattr(handle, "fd", None)
    if not isinstance(fd, int):
        return
    try:
        os.posix_fallocate(fd, spec.row_offset(row), spec.row_nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # not supported here
            return
        with contextlib.suppress(OSError):
            _punch_hole(fd, spec.row_offset(row), spec.row_nbytes)
        raise


_FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap), linux/fs.h
_FIEMAP_EXTENT_LAST = 0x1
_FIEMAP_HEADER = "=QQIIII"  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count
_FIEMAP_EXTENT = "=QQQQQIIII"  # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags, 3 res.


def allocated_extents(handle: Any, nbytes: int) -> list[tuple[int, int]] | None:
    """Byte ranges ``[start, stop)`` of a file's first ``nbytes`` that hold disk blocks.

    Written and unwritten (``fallocate``-d) extents both hold blocks; holes
    punched with ``fallocate(PUNCH_HOLE)`` do not. Uses the ``FS_IOC_FIEMAP``
    ioctl (``Documentation/filesystems/fiemap.rst``), which ext4, xfs and
    btrfs support.

    Returns:
        The ranges in file order, or None where the handle has no file
        descriptor or the filesystem does not answer (tmpfs, for one).

    """
    fd = handle if isinstance(handle, int) else getattr(handle, "fd", None)
    if not isinstance(fd, int):
        return None
    count = 256
    head, ext = struct.calcsize(_FIEMAP_HEADER), struct.calcsize(_FIEMAP_EXTENT)
    out: list[tuple[int, int]] = []
    start = 0
    while start < nbytes:
        buf = bytearray(head + count * ext)
        struct.pack_into(_FIEMAP_HEADER, buf, 0, start, nbytes - start, 0, 0, count, 0)
        try:
            fcntl.ioctl(fd, _FS_IOC_FIEMAP, buf)
        except OSError:
            return None
        mapped = struct.unpack_from(_FIEMAP_HEADER, buf, 0)[3]
        last = False
        for i in range(mapped):
            logical, _, length, _, _, flags, *_ = struct.unpack_from(
                _FIEMAP_EXTENT, buf, head + i * ext
            )
            out.append((logical, logical + length))
            last = bool(flags & _FIEMAP_EXTENT_LAST)
        if last or mapped < count:
            break
        start = out[-1][1]
    return out


def data_extents(handle: Any, nbytes: int) -> list[tuple[int, int]] | None:
    """Byte ranges ``[start, stop)`` of a file's first ``nbytes`` that hold data, by ``lseek``.

    ``lseek(SEEK_DATA)`` / ``lseek(SEEK_HOLE)``, for filesystems that do not
    answer ``FIEMAP`` (:func:`allocated_extents`), tmpfs for one. Punched
    holes are holes; so are, on tmpfs (and ext4), ranges allocated with
    ``fallocate`` but never written: a caller that treats every range outside
    these as punched errs on the safe side (such a row gets its blocks
    allocated again before a write).

    Returns:
        The ranges in file order, or None where the handle has no file
        descriptor or ``lseek`` does not support it.

    """
    fd = handle if isinstance(handle, int) else getattr(handle, "fd", None)
    if not isinstance(fd, int) or not hasattr(os, "SEEK_DATA"):
        return None
    out: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < nbytes:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data past pos
                    break
                raise
            if start >= nbytes:
                break
            pos = min(os.lseek(fd, start, os.SEEK_HOLE), nbytes)
            out.append((start, pos))
    except OSError:
        return None
    return out


def _rows_without_blocks(spec: GroupSpec, rows: int, extents: list[tuple[int, int]]) -> list[int]:
    """Rows ``0..rows-1`` of a segment that the extents do not cover whole (punched holes).

    A row only partly covered (a punch that failed part way) counts as a
    hole too: a write into it could fail on a full filesystem, so its blocks
    are allocated before it is written.
    """
    holes = []
    j = 0
    for i in range(rows):
        lo = spec.row_offset(i)
        hi = lo + spec.row_nbytes
        while j < len(extents) and extents[j][1] <= lo:
            j += 1
        covered = lo
        k = j
        while k < len(extents) and extents[k][0] <= covered < hi:
            covered = max(covered, extents[k][1])
            k += 1
        if covered < hi:
            holes.append(i)
    return holes


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_fallocate: Any = None


def _punch_hole(handle: Any, file_offset: int, nbytes: int) -> bool:
    """Deallocate a byte range of a segment (reads back as zeros); False where unsupported."""
    global _fallocate
    fd = handle if isinstance(handle, int) else getattr(handle, "fd", None)
    if not isinstance(fd, int):
        return False
    if _fallocate is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
        _fallocate = fn or False
    if not _fallocate:
        return False
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _fallocate(fd, mode, file_offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)}")


def blank_rows(
    row_io: RowIO, handle: Any, spec: GroupSpec, rows: Sequence[int], punch: bool = True
) -> bool:
    """Make ``rows`` free on disk: a restart finds no key there.

    With ``punch``, each row is deallocated with ``fallocate(PUNCH_HOLE)``
    (its disk blocks are released and it reads back as zeros). Without it,
    or where the filesystem or backend does not support that, its trailer
    (4 KiB, one aligned write) is overwritten with zeros and the row keeps
    its blocks, so that its next write is an overwrite of written blocks.

    A punch that fails (EIO, ENOSPC, ...) does not leave its row's key in
    place: that row's trailer, and the following rows', are zeroed instead,
    then the punch's error is raised.

    Returns:
        Whether every row was punched (its disk blocks released).

    Raises:
        OSError: a punch failed; every row is blank (the rows from the failed
            one on keep their disk blocks).
        OSError, StorageError: a trailer write failed or was short (the rows
            before it are blank).

    """
    zeros: memoryview | None = None
    punched = True
    failure: OSError | None = None
    for row in rows:
        if punch and failure is None:
            try:
                if _punch_hole(handle, spec.row_offset(row), spec.row_nbytes):
                    continue
            except OSError as exc:
                failure = exc  # zero the trailers of this row and the rest instead
        punched = False
        zeros = zeros or memoryview(_aligned(TRAILER_NBYTES))
        file_offset = spec.row_offset(row) + spec.payload_region
        if row_io.pwritev(handle, [zeros], file_offset) != TRAILER_NBYTES:
            raise StorageError("short_write", f"short trailer write at {file_offset}")
    if failure is not None:
        raise failure
    return punched


def seal_run(spec: GroupSpec, jobs: Sequence[WriteJob]) -> BaseException | None:
    """Seal each row of a run: checksum of its payload region, trailer into the slot.

    CPU only (no I/O): runs on the tier's checksum workers.

    Returns:
        None, or the exception that stopped the sealing (the run must not be
        written); never raises.

    """
    try:
        for job in jobs:
            trailer = RowTrailer(
                spec.digest,
                job.key.block_hash,
                spec.group_id,
                job.start,
                job.stop,
                spec.payload_nbytes,
                job.seq,
                payload_checksum(job.buf[: spec.payload_region]),
            )
            job.buf[spec.payload_region : spec.row_nbytes] = encode_trailer(trailer)
    except Exception as exc:
        return exc
    return None


def write_run(
    row_io: RowIO, handle: Any, spec: GroupSpec, jobs: Sequence[WriteJob]
) -> tuple[int, BaseException | None, float]:
    """Write a run of sealed rows (see :func:`seal_run`) with one pwritev.

    ``jobs`` occupy consecutive rows of one segment, in row order.

    Returns:
        ``(bytes written, exception or None, seconds)``; never raises.

    """
    t0 = time.perf_counter()
    try:
        n = row_io.pwritev(handle, [j.buf for j in jobs], spec.row_offset(jobs[0].ref.row))
        return n, None, time.perf_counter() - t0
    except Exception as exc:
        return 0, exc, time.perf_counter() - t0


def read_run(
    row_io: RowIO, handle: Any, spec: GroupSpec, jobs: Sequence[ReadJob]
) -> tuple[int | StorageError, float]:
    """Read a run of consecutive rows with one preadv (no verification: :func:`verify_run`).

    Returns:
        The bytes read, or the :class:`StorageError` of a failed request
        (the OSError's kind, chained), and the seconds spent; never raises.

    """
    t0 = time.perf_counter()
    try:
        n = row_io.preadv(handle, [j.buf for j in jobs], spec.row_offset(jobs[0].entry.ref.row))
    except Exception as exc:
        return read_failure(exc), time.perf_counter() - t0
    return n, time.perf_counter() - t0


def read_failure(exc: BaseException) -> StorageError:
    """The :class:`StorageError` of a failed row read request (the OSError's kind, chained)."""
    errno_ = exc.errno if isinstance(exc, OSError) else None
    err = StorageError(storage_error_kind(exc), f"row read failed: {exc}", errno_)
    err.__cause__ = exc
    return err


def verify_run(
    spec: GroupSpec, jobs: Sequence[ReadJob], nbytes: int | StorageError
) -> list[StorageError | None]:
    """Verify each row of a run read by :func:`read_run` (``nbytes``: its outcome).

    CPU only (no I/O): runs on the tier's checksum workers.

    Returns:
        Per job ``None`` (verified) or the :class:`StorageError` (kinds
        ``short_read``, ``trailer``, ``checksum`` or the failed request's
        kind); never raises.

    """
    if isinstance(nbytes, StorageError):
        return [nbytes] * len(jobs)
    results: list[StorageError | None] = []
    for i, job in enumerate(jobs):
        if nbytes < (i + 1) * spec.row_nbytes:
            results.append(
                StorageError("short_read", f"short read of {job.key} at {job.entry.ref}")
            )
            continue
        try:
            results.append(verify_row(spec, job))
        except Exception as exc:  # never let an unexpected error pass a row as verified
            results.append(StorageError("other", f"{job.key}: verification failed: {exc}"))
    return results


def verify_row(spec: GroupSpec, job: ReadJob) -> StorageError | None:
    """Check a row read into ``job.buf`` against its key, entry and checksum."""
    try:
        trailer = decode_trailer(job.buf[spec.payload_region : spec.row_nbytes])
    except StorageError as exc:
        return StorageError("trailer", f"{job.key}: {exc.strerror}")
    why = validate_trailer(spec, trailer)
    if not why and trailer.block_hash != job.key.block_hash:
        why = "block_hash differs"
    if not why and (trailer.seq, trailer.start, trailer.stop) != (
        job.entry.seq,
        job.entry.start,
        job.entry.stop,
    ):
        why = f"seq/range {trailer.seq}:{trailer.start}..{trailer.stop} differs from the index"
    if why:
        return StorageError("trailer", f"{job.key}: trailer mismatch: {why}")
    if not payload_matches(spec, job.buf, trailer):
        return StorageError("checksum", f"{job.key}: payload checksum mismatch")
    return None


def payload_matches(spec: GroupSpec, row: memoryview, trailer: RowTrailer) -> bool:
    """Whether the payload region of a row matches the checksum its trailer holds.

    The check a row read must pass before any of its bytes is used (after
    :func:`validate_trailer`); CPU only, one pass over the payload region.

    Args:
        spec: the row's group (its ``payload_region`` is the checksummed span).
        row: the row's bytes from its start (at least ``spec.payload_region``).
        trailer: the row's decoded trailer.

    Returns:
        True when xxh3-64 of ``row[:spec.payload_region]`` equals
        ``trailer.checksum``.

    """
    return payload_checksum(row[: spec.payload_region]) == trailer.checksum


def group_layout_json(
    layout_description: Mapping[str, Any], group_id: int, limit: int = 3000
) -> str:
    """Return the header JSON of one group: its part of the layout when it fits."""
    groups = layout_description.get("groups")
    part: Any = None
    if isinstance(groups, Mapping):
        part = groups.get(str(group_id), groups.get(group_id))
    text = json.dumps({"group_id": group_id, "layout": part}, sort_keys=True)
    if len(text) > limit:
        text = json.dumps({"group_id": group_id, "layout": "omitted: too large"})
    return text
