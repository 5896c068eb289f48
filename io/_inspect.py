"""``kvtier inspect ROOT``: a read-only summary of an NVMe root (blocks; no locks taken).

With ``verify=True`` it also reads every row and checks it as a tier read
does (:func:`kvtier.io._files.validate_trailer`, then
:func:`kvtier.io._files.payload_matches`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.errors import StorageError
from kvtier.io._align import round_up
from kvtier.io._files import (
    SEGMENT_SUFFIX,
    GroupSpec,
    list_segments,
    payload_matches,
    validate_trailer,
)
from kvtier.io._format import (
    HEADER_NBYTES,
    TRAILER_NBYTES,
    RowTrailer,
    SegmentHeader,
    decode_header,
    decode_trailer,
    is_blank,
)

__all__ = ["REMOVING_PREFIX", "folders_of", "inspect_root", "is_namespace", "other_formats"]

_GROUP_NAME = re.compile(r"g(0|[1-9][0-9]*)")
_NAMESPACE_NAME = re.compile(r".+-[0-9a-f]{16}")  # <namespace>-<digest16>, as the tier names it
REMOVING_PREFIX = ".kvtier-removing-"
"""Name prefix of a namespace directory that ``kvtier remove`` is deleting."""


MAX_PROBLEMS = 20
"""Rows of one segment that ``verify`` describes in ``problems`` (the rest are counted)."""

Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)``: called as ``verify`` reads the segment files."""


@dataclass(frozen=True, slots=True)
class _GroupFormat:
    """What ``format.json`` says about one group's rows (None: it does not say)."""

    group_id: int
    digest: bytes | None
    row_nbytes: int | None
    blocks_per_chunk: int | None


@dataclass(slots=True)
class _Reading:
    """Bytes a ``verify`` pass has gone through, reported to its progress callback."""

    progress: Progress | None
    total: int
    done: int = 0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress(min(self.done, self.total), self.total)


def _invalid_segment(info: dict[str, Any], error: str, verify: bool) -> dict[str, Any]:
    info.update(header_valid=False, error=error, rows=0, valid_rows=0, invalid_rows=0)
    if verify:
        info.update(corrupt_rows=0, torn_rows=0, blank_rows=0, truncated=False, problems=[])
    return info


def _header_mismatch(header: SegmentHeader, fmt: _GroupFormat) -> str:
    """Why a tier would not use this segment's header for the group ('' if it would)."""
    if fmt.digest is not None and header.digest != fmt.digest:
        return "segment header does not match the format: digest differs"
    if header.group_id != fmt.group_id:
        return f"segment header does not match the format: group {header.group_id}"
    if fmt.row_nbytes is not None and header.row_nbytes != fmt.row_nbytes:
        return (
            f"segment header does not match the format: rows of {header.row_nbytes} B, "
            f"format.json says {fmt.row_nbytes} B"
        )
    return ""


def _row_spec(base: GroupSpec, fmt: _GroupFormat, trailer: RowTrailer) -> tuple[GroupSpec, str]:
    """The spec a row's trailer is validated against, and why it cannot be ('' if it can).

    ``format.json`` does not record the unpadded payload size: a trailer's
    ``payload_nbytes`` is accepted when it pads to the rows' payload region,
    as the tier's own sizes do. Fields ``format.json`` lacks (digest,
    ``blocks_per_chunk``) are taken from the header and the trailer.
    """
    if round_up(trailer.payload_nbytes) != base.payload_region or trailer.payload_nbytes <= 0:
        return base, (
            f"payload_nbytes {trailer.payload_nbytes} does not fit the rows' payload region "
            f"of {base.payload_region} B"
        )
    bpc = fmt.blocks_per_chunk if fmt.blocks_per_chunk is not None else max(trailer.stop, 1)
    return dataclasses.replace(
        base, payload_nbytes=trailer.payload_nbytes, blocks_per_chunk=bpc
    ), ""


def _verify_rows(
    fd: int, base: GroupSpec, fmt: _GroupFormat, allocated: int, reading: _Reading
) -> dict[str, Any]:
    """Read and check rows ``0..allocated-1`` of an open segment (see :func:`inspect_root`)."""
    counts = {"valid_rows": 0, "corrupt_rows": 0, "torn_rows": 0, "blank_rows": 0}
    problems: list[dict[str, Any]] = []

    def problem(kind: str, row: int, error: str) -> None:
        counts[f"{kind}_rows"] += 1
        if len(problems) < MAX_PROBLEMS:
            problems.append({"row": row, "kind": kind, "error": error})

    region = base.payload_region
    view = memoryview(bytearray(base.row_nbytes))
    for i in range(allocated):
        offset = base.row_offset(i)
        try:
            n = os.preadv(fd, [view[region:]], offset + region)
            if n < TRAILER_NBYTES:
                problem("torn", i, "the file ends inside the row's trailer (it shrank)")
                continue
            if is_blank(view[region:]):
                counts["blank_rows"] += 1
                continue
            try:
                trailer = decode_trailer(view[region:])
            except StorageError as exc:
                problem("corrupt", i, exc.strerror or str(exc))
                continue
            spec, why = _row_spec(base, fmt, trailer)
            why = why or validate_trailer(spec, trailer)
            if why:
                problem("corrupt", i, f"trailer mismatch: {why}")
                continue
            if os.preadv(fd, [view[:region]], offset) < region:
                problem("torn", i, "the file ends inside the row's payload (it shrank)")
            elif payload_matches(spec, view, trailer):
                counts["valid_rows"] += 1
            else:
                problem("corrupt", i, "payload checksum mismatch")
        except OSError as exc:  # EIO: the row cannot be read
            problem("corrupt", i, f"cannot read: {exc.strerror or exc}")
        finally:
            reading.advance(base.row_nbytes)
    return {**counts, "problems": problems}


def _inspect_segment(
    path: pathlib.Path, fmt: _GroupFormat, reading: _Reading | None
) -> dict[str, Any]:
    """Summarize one segment; an unusable entry is reported with ``error`` (never raises).

    ``reading`` None: trailers only. Else every allocated row is read and
    checked too (see :func:`inspect_root`).
    """
    verify = reading is not None
    digest, group_id = fmt.digest, fmt.group_id
    info: dict[str, Any] = {"file": path.name, "nbytes": 0}
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a directory, a FIFO (open would block)...
            return _invalid_segment(info, "not a regular file", verify)
        info["nbytes"] = st.st_size
        with open(path, "rb") as f:
            try:
                header = decode_header(f.read(HEADER_NBYTES))
            except (StorageError, ValueError) as exc:
                return _invalid_segment(info, str(exc), verify)
            row = header.row_nbytes
            if row <= TRAILER_NBYTES or row % TRAILER_NBYTES:
                return _invalid_segment(info, f"segment header: row_nbytes {row} invalid", verify)
            allocated = min(header.num_rows, max(0, (st.st_size - HEADER_NBYTES) // row))
            # the file ends inside a row (truncated, or a growth cut short)
            truncated = allocated < header.num_rows and HEADER_NBYTES + allocated * row < (
                st.st_size
            )
            if reading is not None:
                why = _header_mismatch(header, fmt)
                if why:
                    return _invalid_segment(info, why, verify)
                base = GroupSpec(
                    group_id,
                    header.digest,
                    0,  # set per row from its trailer: see _row_spec
                    row - TRAILER_NBYTES,
                    row,
                    fmt.blocks_per_chunk or 0,
                )
                checked = _verify_rows(f.fileno(), base, fmt, allocated, reading)
                if truncated:
                    checked["torn_rows"] += 1
                    if len(checked["problems"]) < MAX_PROBLEMS:
                        cut = st.st_size - HEADER_NBYTES - allocated * row
                        checked["problems"].append(
                            {
                                "row": allocated,
                                "kind": "torn",
                                "error": f"the file ends {cut} B into this row of {row} B",
                            }
                        )
                info.update(
                    header_valid=True,
                    row_nbytes=row,
                    rows=header.num_rows,
                    allocated_rows=allocated,
                    truncated=truncated,
                    invalid_rows=checked["corrupt_rows"] + checked["torn_rows"],
                    **checked,
                )
                return info
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
        return _invalid_segment(info, f"cannot read: {exc.strerror or exc}", verify)
    info.update(
        header_valid=digest is None or header.digest == digest,
        row_nbytes=row,
        rows=header.num_rows,
        allocated_rows=allocated,
        truncated=truncated,
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


VERIFY_COUNTS = ("valid_rows", "corrupt_rows", "torn_rows", "blank_rows")
"""The row counts of a ``verify`` pass, per segment, group and namespace."""


def _group_format(fmt: dict[str, Any] | None, digest: bytes | None, group_id: int) -> _GroupFormat:
    """The group's row size and ``blocks_per_chunk`` from ``format.json`` (None if absent)."""
    rows = fmt.get("row_nbytes") if fmt else None
    row = rows.get(str(group_id)) if isinstance(rows, dict) else None
    bpc = fmt.get("blocks_per_chunk") if fmt else None
    return _GroupFormat(
        group_id,
        digest,
        row if isinstance(row, int) and not isinstance(row, bool) else None,
        bpc if isinstance(bpc, int) and not isinstance(bpc, bool) and bpc > 0 else None,
    )


def _inspect_group(
    group_dir: pathlib.Path, fmt: _GroupFormat, reading: _Reading | None
) -> dict[str, Any]:
    segs = []
    for n in list_segments(group_dir):
        done = reading.done if reading is not None else 0
        segs.append(_inspect_segment(group_dir / f"{n}{SEGMENT_SUFFIX}", fmt, reading))
        if reading is not None:  # the header, a cut row, a segment not read: the file's size
            reading.advance(max(0, segs[-1]["nbytes"] - (reading.done - done)))
    group = {
        "segments": segs,
        "rows": sum(s["rows"] for s in segs),
        "allocated_rows": sum(s.get("allocated_rows", 0) for s in segs),
        "valid_rows": sum(s["valid_rows"] for s in segs),
        "invalid_rows": sum(s["invalid_rows"] for s in segs),
        "invalid_segments": sum(not s["header_valid"] for s in segs),
        "truncated_segments": sum(bool(s.get("truncated")) for s in segs),
    }
    if reading is not None:
        group.update({c: sum(s[c] for s in segs) for c in VERIFY_COUNTS[1:]})
    return group


def _segment_paths(directory: pathlib.Path) -> list[pathlib.Path]:
    """The segment files of a namespace folder that a ``verify`` pass reads (never raises)."""
    paths = []
    with contextlib.suppress(OSError):
        for group_dir in sorted(directory.glob("g*")):
            with contextlib.suppress(OSError):
                if _GROUP_NAME.fullmatch(group_dir.name) and group_dir.is_dir():
                    paths += [group_dir / f"{n}{SEGMENT_SUFFIX}" for n in list_segments(group_dir)]
    return paths


def _planned_nbytes(directories: list[pathlib.Path]) -> int:
    """Bytes of the regular segment files under ``directories`` (the progress total)."""
    total = 0
    for directory in directories:
        for path in _segment_paths(directory):
            with contextlib.suppress(OSError):
                st = path.stat()
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


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


def inspect_root(
    root: str | os.PathLike[str], *, verify: bool = False, progress: Progress | None = None
) -> dict[str, Any]:
    """Summarize every namespace directory under ``root`` without modifying anything.

    A namespace directory is a folder named ``<namespace>-<16 hex digits>`` (as
    the tier names them) or holding a ``format.json``; other entries are
    ignored. Files are opened read-only and no namespace lock is taken (a
    live engine's flock is only probed, see :func:`lock_holder`), so it can
    run next to a live engine.

    Without ``verify``, valid rows are rows whose trailer decodes and matches
    the directory's digest and group; payloads are not read.

    With ``verify``, every row of every segment is read and checked as a tier
    read checks it: a segment header that does not match the format (digest,
    group, row size) makes the segment invalid, as it does at a tier's open,
    and each allocated row is one of:

    - ``valid``: its trailer decodes, belongs to the format and group (digest,
      group, payload size, sub-block range) and the xxh3-64 of its payload
      region matches the trailer's checksum;
    - ``corrupt``: its trailer is not blank and does not decode (a flipped or
      zeroed byte, a foreign file), names another format or group, or its
      payload checksum does not match (a flipped byte, a torn write inside
      the file: the format cannot tell these apart), or it cannot be read
      (EIO);
    - ``torn``: the file ends inside the row (truncated, or a growth cut
      short: its trailer, if it was written, is gone), or shrank while it
      was read;
    - ``blank``: its trailer is all zeros (never written, freed or punched).

    A file cut at a row boundary looks like a file not yet grown (the tier
    grows files lazily): the rows past its end are not counted. A row that a
    live engine rewrites while it is read may be reported as corrupt (its
    trailer and payload read from different writes); run it again, or with
    no engine on the namespace, to tell.

    Args:
        root: the NVMe root given to the tier.
        verify: read and check every row's payload (reads all the data).
        progress: with ``verify``, called as ``progress(bytes_done,
            bytes_total)`` after each row (bytes of the segment files, the
            total taken from their sizes before the pass); not called
            without ``verify``.

    Returns:
        ``{"root": str, "payloads_verified": bool, "namespaces":
        [{"directory", "format" (format.json as a dict, or None),
        "locked_by_pid", "groups": {group_id: {"segments": [...], "rows",
        "allocated_rows", "valid_rows", "invalid_rows", "invalid_segments",
        "truncated_segments"}}, "last_written" (newest modification of a
        segment file, Unix seconds, or None), "disk_nbytes" (disk space of
        the folder's files, bytes), "errors": [str]}]}``; ``rows`` is the row
        count the segment headers announce (the most rows the present files
        may grow to; the tier adds segment files as it needs them),
        ``allocated_rows`` the rows the files hold in full now, ``truncated``
        (per segment) whether the file ends inside a row. With ``verify``,
        each group and segment also has ``corrupt_rows``, ``torn_rows`` and
        ``blank_rows`` (``invalid_rows`` is corrupt plus torn), each segment
        ``problems`` (up to :data:`MAX_PROBLEMS` ``{"row", "kind",
        "error"}``), each namespace ``summary`` (the four row counts and
        ``invalid_segments`` over its groups) and the result ``clean``: no
        corrupt or torn row and no invalid segment anywhere. Garbage is
        reported, never raised: an unusable segment entry (a directory, a
        dangling link, a bad header) has ``header_valid`` False and an
        ``error``; a bad ``format.json`` (not an object, a non-hex digest)
        or an entry ``g*`` that is not a group folder is described in
        ``errors``. A ``format.json`` without a usable digest leaves the
        rows' digests unchecked (with ``verify``, a row's digest must still
        match its segment header's).

    Raises:
        FileNotFoundError, NotADirectoryError: ``root`` is not a directory.

    """
    base = pathlib.Path(root)
    directories = sorted(p for p in base.iterdir() if is_namespace(p))
    reading = _Reading(progress, _planned_nbytes(directories)) if verify else None
    namespaces = []
    for directory in directories:
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
            g = int(m.group(1))
            try:
                groups[g] = _inspect_group(group_dir, _group_format(fmt, digest, g), reading)
            except OSError as exc:
                errors.append(f"{group_dir.name}: cannot list: {exc}")
        pid = lock_holder(directory / "lock")
        last_written, disk_nbytes = _usage(directory)
        ns: dict[str, Any] = {
            "directory": directory.name,
            "format": fmt,
            "locked_by_pid": pid,
            "last_written": last_written,
            "disk_nbytes": disk_nbytes,
            "groups": groups,
            "errors": errors,
        }
        if verify:
            ns["summary"] = {
                c: sum(grp[c] for grp in groups.values())
                for c in (*VERIFY_COUNTS, "invalid_segments")
            }
        namespaces.append(ns)
    info: dict[str, Any] = {"root": str(base), "payloads_verified": verify}
    if verify:
        info["clean"] = not any(
            ns["summary"][c]
            for ns in namespaces
            for c in ("corrupt_rows", "torn_rows", "invalid_segments")
        )
    info["namespaces"] = namespaces
    return info
