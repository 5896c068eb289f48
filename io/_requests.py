"""What the NVMe tier's writes and reads share: slot checks, runs, queued requests, failures.

Owns the failure kinds the tier counts (``failures_<kind>``) and how a
backend error becomes a :class:`~kvtier.errors.StorageError`; checks a
``(key, slot_buf)`` argument; cuts jobs into runs of consecutive rows (one
request each); and awaits a request queued in the AIO context. Its
functions take the tier as a :class:`~kvtier.io._tier_state.RequestState`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier.errors import InvalidArgumentError, StorageError, storage_error_kind
from kvtier.io._align import buffer_address, check_direct
from kvtier.io._index import RowRef
from kvtier.keys import OffloadKey

if TYPE_CHECKING:
    from kvtier.io._tier_state import RequestState


FAILURE_KINDS = (
    "eio", "enospc", "einval", "short_read", "short_write",
    "checksum", "trailer", "capacity", "missing", "other",
)  # fmt: skip
"""Failure kinds counted by :meth:`NVMeTier.stats` as ``failures_<kind>``."""


def as_storage_error(exc: BaseException, what: str) -> StorageError:
    """Wrap a backend exception into a :class:`StorageError` with its kind (chained)."""
    if isinstance(exc, StorageError):
        return exc
    errno_ = exc.errno if isinstance(exc, OSError) else None
    err = StorageError(storage_error_kind(exc), f"{what}: {exc}", errno_)
    err.__cause__ = exc
    return err


def fail(tier: RequestState, kind: str) -> None:
    """Count one failure of ``kind`` (unknown kinds count as ``other``)."""
    tier._counts[f"failures_{kind if kind in FAILURE_KINDS else 'other'}"] += 1


def slot_view(tier: RequestState, key: Any, buf: Any) -> memoryview:
    """Check one ``(key, slot_buf)`` argument; return ``slot_buf[:row_nbytes]`` as bytes.

    Raises:
        InvalidArgumentError: not a key, unknown group, read-only,
            non-contiguous or too short buffer.
        AlignmentError: the buffer address is not 4 KiB aligned.

    """
    if not isinstance(key, OffloadKey):
        raise InvalidArgumentError(f"expected an OffloadKey, got {type(key).__name__}")
    row = tier.row_nbytes(key.group_id)
    view = memoryview(buf)
    if not view.c_contiguous or view.readonly:
        raise InvalidArgumentError(f"slot buffer of {key} must be writable and contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes < row:
        raise InvalidArgumentError(f"slot buffer of {key} has {view.nbytes} bytes < {row}")
    check_direct(buffer_address(view), row, 0)
    return view[:row]


def make_runs(tier: RequestState, jobs: list[Any], ref: Callable[[Any], RowRef]) -> list[list[Any]]:
    """Sort jobs by row and cut them into runs of consecutive rows of one segment.

    A run holds at most ``request_nbytes // row_nbytes`` rows (at least one,
    at most IOV_MAX): one ``preadv``/``pwritev`` each.
    """
    out: list[list[Any]] = []
    for job in sorted(jobs, key=ref):
        r = ref(job)
        if out:
            p = ref(out[-1][-1])
            run = out[-1]
            if (p.group_id, p.segment, p.row + 1) == (r.group_id, r.segment, r.row) and len(
                run
            ) < tier._run_rows[r.group_id]:
                run.append(job)
                continue
        out.append([job])
    return out


async def request_done(fut: concurrent.futures.Future[int]) -> int:
    """Await a queued request; if cancelled, return only once the kernel is done with it.

    The request's buffers are slots: a task that gave up while the kernel
    still reads or writes them would let the slot be reused under the I/O.
    """
    waiter = asyncio.wrap_future(fut)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        await asyncio.wait([waiter])
        raise
