"""``kvtier inspect ROOT``: a read-only summary of an NVMe root (blocks; no locks taken)."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
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

__all__ = ["inspect_root"]


def _inspect_segment(path: pathlib.Path, digest: bytes | None, group_id: int) -> dict[str, Any]:
    info: dict[str, Any] = {"file": path.name, "nbytes": path.stat().st_size}
    with open(path, "rb") as f:
        try:
            header = decode_header(f.read(HEADER_NBYTES))
        except StorageError as exc:
            info.update(header_valid=False, error=str(exc), rows=0, valid_rows=0, invalid_rows=0)
            return info
        payload_region = header.row_nbytes - TRAILER_NBYTES
        valid = invalid = 0
        for i in range(header.num_rows):
            f.seek(HEADER_NBYTES + i * header.row_nbytes + payload_region)
            raw = f.read(TRAILER_NBYTES)
            if len(raw) < TRAILER_NBYTES:
                invalid += int(bool(raw))
                continue
            if is_blank(raw):
                continue
            try:
                trailer = decode_trailer(raw)
            except StorageError:
                invalid += 1
                continue
            ok = trailer.group_id == group_id and (digest is None or trailer.digest == digest)
            valid += ok
            invalid += not ok
    info.update(
        header_valid=digest is None or header.digest == digest,
        row_nbytes=header.row_nbytes,
        rows=header.num_rows,
        allocated_rows=min(
            header.num_rows, max(0, (info["nbytes"] - HEADER_NBYTES) // header.row_nbytes)
        ),
        valid_rows=valid,
        invalid_rows=invalid,
    )
    return info


def _lock_holder(lock: pathlib.Path) -> int | None:
    """The pid written in ``lock`` if a live engine holds its flock, else None.

    The pid in the file stays after a close or a crash; only the flock tells
    whether the namespace is in use now (probed without taking it for long).
    """
    if not lock.exists():
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = lock.read_text().strip()
        return int(pid) if pid.isdigit() else -1
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def inspect_root(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Summarize every namespace directory under ``root`` without modifying anything.

    Valid rows are rows whose trailer decodes and matches the directory's
    digest and group; payload checksums are not verified (that reads all data).

    Args:
        root: the NVMe root given to the tier.

    Returns:
        ``{"root": str, "namespaces": [{"directory", "format" (format.json or
        None), "locked_by_pid", "groups": {group_id: {"segments": [...],
        "rows", "valid_rows", "invalid_rows"}}}]}``; a segment's ``rows``
        is its header's row count, ``allocated_rows`` the rows its file holds.

    Raises:
        FileNotFoundError, NotADirectoryError: ``root`` is not a directory.

    """
    base = pathlib.Path(root)
    namespaces = []
    for directory in sorted(p for p in base.iterdir() if p.is_dir()):
        fmt: dict[str, Any] | None = None
        try:
            fmt = json.loads((directory / "format.json").read_text())
        except (OSError, ValueError):
            fmt = None
        digest = bytes.fromhex(fmt["digest"]) if fmt and "digest" in fmt else None
        groups: dict[int, dict[str, Any]] = {}
        for group_dir in sorted(directory.glob("g*")):
            if not group_dir.name[1:].isdigit():
                continue
            g = int(group_dir.name[1:])
            segs = [
                _inspect_segment(group_dir / f"{n}{SEGMENT_SUFFIX}", digest, g)
                for n in list_segments(group_dir)
            ]
            groups[g] = {
                "segments": segs,
                "rows": sum(s["rows"] for s in segs),
                "valid_rows": sum(s["valid_rows"] for s in segs),
                "invalid_rows": sum(s["invalid_rows"] for s in segs),
            }
        pid = _lock_holder(directory / "lock")
        namespaces.append(
            {
                "directory": directory.name,
                "format": fmt,
                "locked_by_pid": pid,
                "groups": groups,
            }
        )
    return {"root": str(base), "namespaces": namespaces}
