"""``kvtier inspect ROOT``: a read-only summary of an NVMe root (blocks; no locks taken)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import re
import stat
from typing import Any

from kvtier.errors import StorageError
from kvtier.io._files import SEGMENT_SUFFIX, list_segments
from kvtier.io._format import (
    HEADER_NBYTES,
    TRAILER_NBYTES,
    decode_header,
    decode_trailer,
    is_blank,
)

__all__ = ["REMOVING_PREFIX", "folders_of", "inspect_root", "is_namespace", "other_formats"]

_GROUP_NAME = re.compile(r"g(0|[1-9][0-9]*)")
_NAMESPACE_NAME = re.compile(r".+-[0-9a-f]{16}")  # <namespace>-<digest16>, as the tier names it
REMOVING_PREFIX = ".kvtier-removing-"
"""Name prefix of a namespace directory that ``kvtier remove`` is deleting."""


def _invalid_segment(info: dict[str, Any], error: str) -> dict[str, Any]:
    info.update(header_valid=False, error=error, rows=0, valid_rows=0, invalid_rows=0)
    return info


def _inspect_segment(path: pathlib.Path, digest: bytes | None, group_id: int) -> dict[str, Any]:
    """Summarize one segment; an unusable entry is reported with ``error`` (never raises)."""
    info: dict[str, Any] = {"file": path.name, "nbytes": 0}
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a directory, a FIFO (open would block)...
            return _invalid_segment(info, "not a regular file")
        info["nbytes"] = st.st_size
        with open(path, "rb") as f:
            try:
                header = decode_header(f.read(HEADER_NBYTES))
            except (StorageError, ValueError) as exc:
                return _invalid_segment(info, str(exc))
            row = header.row_nbytes
            if row <= TRAILER_NBYTES or row % TRAILER_NBYTES:
                return _invalid_segment(info, f"segment header: row_nbytes {row} invalid")
            allocated = min(header.num_rows, max(0, (st.st_size - HEADER_NBYTES) // row))
            valid = invalid = 0
            # rows past the first one the file does not hold in full have no trailer
            for i in range(min(header.num_rows, allocated + 1)):
                f.seek(HEADER_NBYTES + i * row + row - TRAILER_NBYTES)
                raw = f.read(TRAILER_NBYTES)
                if len(raw) < TRAILER_NBYTES:
                    invalid += int(bool(raw))
                    continue
                if is_blank(raw):
                    continue
                try:
                    trailer = decode_trailer(raw)
                except (StorageError, ValueError):
                    invalid += 1
                    continue
                ok = trailer.group_id == group_id and (digest is None or trailer.digest == digest)
                valid += ok
                invalid += not ok
    except OSError as exc:  # a dangling link, no permission, EIO
        return _invalid_segment(info, f"cannot read: {exc.strerror or exc}")
    info.update(
        header_valid=digest is None or header.digest == digest,
        row_nbytes=row,
        rows=header.num_rows,
        allocated_rows=allocated,
        valid_rows=valid,
        invalid_rows=invalid,
    )
    return info


def _read_format(
    directory: pathlib.Path, errors: list[str]
) -> tuple[dict[str, Any] | None, bytes | None]:
    """``format.json`` as a dict (None when missing or unusable) and its digest."""
    path = directory / "format.json"
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block
            errors.append("format.json: not a regular file")
            return None, None
        fmt = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, RecursionError) as exc:  # not JSON, not UTF-8, too deep
        errors.append(f"format.json: unreadable: {exc}")
        return None, None
    if not isinstance(fmt, dict):
        errors.append(f"format.json: not a JSON object ({type(fmt).__name__})")
        return None, None
    if "digest" not in fmt:
        errors.append("format.json: no digest")
        return fmt, None
    try:
        return fmt, bytes.fromhex(fmt["digest"])
    except (TypeError, ValueError):
        errors.append(f"format.json: digest {fmt['digest']!r} is not hex")
        return fmt, None


def _inspect_group(group_dir: pathlib.Path, digest: bytes | None, group_id: int) -> dict[str, Any]:
    segs = [
        _inspect_segment(group_dir / f"{n}{SEGMENT_SUFFIX}", digest, group_id)
        for n in list_segments(group_dir)
    ]
    return {
        "segments": segs,
        "rows": sum(s["rows"] for s in segs),
        "allocated_rows": sum(s.get("allocated_rows", 0) for s in segs),
        "valid_rows": sum(s["valid_rows"] for s in segs),
        "invalid_rows": sum(s["invalid_rows"] for s in segs),
    }


def lock_holder(lock: pathlib.Path) -> int | None:
    """The pid written in ``lock`` if a live engine holds its flock, else None.

    The pid in the file stays after a close or a crash; only the flock tells
    whether the namespace is in use now (probed without taking it for long).
    """
    if not lock.exists():
        return None
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO would block
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = os.pread(fd, 32, 0).strip()
        except OSError:
            return -1
        return int(pid) if pid.isdigit() and len(pid) < 20 else -1  # bytes: ASCII only
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def is_namespace(path: pathlib.Path) -> bool:
    """A folder named like a namespace directory, or holding a ``format.json``.

    Not one that ``kvtier remove`` is deleting (``.kvtier-removing-*``).
    """
    if path.name.startswith(REMOVING_PREFIX):
        return False
    try:
        return path.is_dir() and (
            _NAMESPACE_NAME.fullmatch(path.name) is not None or (path / "format.json").is_file()
        )
    except OSError:
        return False


def other_formats(root: pathlib.Path, directory: pathlib.Path, namespace: str) -> list[str]:
    """Names of the other namespace folders under ``root`` made for ``namespace`` (blocks).

    Folders of another format (layout, ``blocks_per_chunk`` or row size) of
    the same namespace label: a tier never uses them, and they keep their
    disk space until ``kvtier remove``. Read-only; unreadable entries are
    skipped.
    """
    return [name for name in folders_of(root, namespace) if name != directory.name]


def folders_of(root: pathlib.Path, namespace: str) -> list[str]:
    """Names of the namespace folders under ``root`` whose ``format.json`` names ``namespace``.

    Read-only (blocks); unreadable entries are skipped.
    """
    out = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    for path in entries:
        if not is_namespace(path):
            continue
        fmt, _ = _read_format(path, [])
        if fmt is not None and fmt.get("namespace") == namespace:
            out.append(path.name)
    return out


def _usage(directory: pathlib.Path) -> tuple[float | None, int]:
    """Newest modification time of a segment file (Unix seconds, or None) and disk bytes.

    The time is that of the rows (the group folders' files): an engine that
    only opens the namespace rewrites ``lock``, not them. Disk bytes are
    ``st_blocks * 512`` of every file under the folder.
    """
    newest, disk = None, 0
    with contextlib.suppress(OSError):
        for dirpath, _, files in os.walk(directory):
            in_group = _GROUP_NAME.fullmatch(os.path.basename(dirpath)) is not None
            for f in files:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(dirpath, f))
                    disk += st.st_blocks * 512
                    if in_group and (newest is None or st.st_mtime > newest):
                        newest = st.st_mtime
    return newest, disk


def inspect_root(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Summarize every namespace directory under ``root`` without modifying anything.

    A namespace directory is a folder named ``<namespace>-<16 hex digits>`` (as
    the tier names them) or holding a ``format.json``; other entries are
    ignored.

    Valid rows are rows whose trailer decodes and matches the directory's
    digest and group; payload checksums are not verified (that reads all data).

    Args:
        root: the NVMe root given to the tier.

    Returns:
        ``{"root": str, "namespaces": [{"directory", "format" (format.json
        as a dict, or None), "locked_by_pid", "groups": {group_id:
        {"segments": [...], "rows", "allocated_rows", "valid_rows",
        "invalid_rows"}}, "last_written" (newest modification of a segment
        file, Unix seconds, or None), "disk_nbytes" (disk space of the
        folder's files), "errors": [str]}]}``; ``rows`` is the row count
        the segment headers announce (the most rows the present files may
        grow to; the tier adds segment files as it needs them),
        ``allocated_rows`` the rows the files hold now. Garbage is
        reported, never raised: an unusable segment entry (a directory, a
        dangling link, a bad header) has ``header_valid`` False and an
        ``error``; a bad ``format.json`` (not an object, a non-hex digest)
        or an entry ``g*`` that is not a group folder is described in
        ``errors``. A ``format.json`` without a usable digest leaves the
        rows' digests unchecked.

    Raises:
        FileNotFoundError, NotADirectoryError: ``root`` is not a directory.

    """
    base = pathlib.Path(root)
    namespaces = []
    for directory in sorted(p for p in base.iterdir() if is_namespace(p)):
        errors: list[str] = []
        fmt, digest = _read_format(directory, errors)
        groups: dict[int, dict[str, Any]] = {}
        try:
            entries = sorted(directory.glob("g*"))
        except OSError as exc:
            entries = []
            errors.append(f"cannot list: {exc}")
        for group_dir in entries:
            m = _GROUP_NAME.fullmatch(group_dir.name)
            if m is None or not group_dir.is_dir():
                errors.append(f"{group_dir.name}: not a group folder (g<n>)")
                continue
            try:
                groups[int(m.group(1))] = _inspect_group(group_dir, digest, int(m.group(1)))
            except OSError as exc:
                errors.append(f"{group_dir.name}: cannot list: {exc}")
        pid = lock_holder(directory / "lock")
        last_written, disk_nbytes = _usage(directory)
        namespaces.append(
            {
                "directory": directory.name,
                "format": fmt,
                "locked_by_pid": pid,
                "last_written": last_written,
                "disk_nbytes": disk_nbytes,
                "groups": groups,
                "errors": errors,
            }
        )
    return {"root": str(base), "namespaces": namespaces}
