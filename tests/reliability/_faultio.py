"""A RowIO wrapper that injects faults into the rows of chosen keys (real backend, real files).

Rows are recognised by their trailer, the last 4 KiB of every row buffer: on a
write the engine has sealed it before the request; on a read it is known once
the real read returned, so read faults are decided after the real I/O (an EIO
may leave garbage in the slot, which the tier must never use).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier import OffloadKey
from kvtier.errors import StorageError
from kvtier.io import NVMeTier, RowIO
from kvtier.io._format import TRAILER_NBYTES, decode_trailer

from ..io.conftest import Slots


@dataclass
class KeyFault:
    """One fault.

    Attributes:
        op: ``"write"``, ``"read"``, ``"fdatasync"`` or ``"allocate"``.
        action: ``"errno"`` (raise ``OSError(err)``), ``"short"`` (rows
            before the target in full, then ``keep`` bytes of it; returns that
            count), ``"torn"`` (write only the payload of the target row,
            leaving the old trailer on disk, and report full success),
            ``"block"`` (wait on ``gate`` before doing the real I/O),
            ``"delay"`` (sleep ``delay_s`` before doing the real I/O).
        hashes: block hashes of the target rows (empty: every row).
        err: errno of an ``"errno"`` fault.
        keep: bytes of the target row a short request moves.
        times: how many requests to fail.
        hits: requests failed so far.
        gate: the event a ``"block"`` fault waits for.
        delay_s: seconds a ``"delay"`` fault sleeps.

    """

    op: str
    action: str
    hashes: frozenset[bytes] = frozenset()
    err: int = errno.EIO
    keep: int = 0
    times: int = 1 << 30
    hits: int = 0
    gate: threading.Event = field(default_factory=threading.Event)
    delay_s: float = 0.0

    def wait(self) -> None:
        """A ``"block"`` or ``"delay"`` fault: wait before the real I/O (worker thread)."""
        if self.action == "block":
            self.gate.wait(30)
        else:
            time.sleep(self.delay_s)


def row_hash(buf: memoryview) -> bytes | None:
    """The block hash named by a row buffer's trailer, or None (no valid trailer)."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes <= TRAILER_NBYTES:
        return None
    try:
        return decode_trailer(mv[mv.nbytes - TRAILER_NBYTES :]).block_hash
    except StorageError:
        return None


class KeyFaultIO:
    """Delegates to a real RowIO; fails the requests that touch the rows of target keys."""

    def __init__(self, inner: RowIO, faults: Sequence[KeyFault] = ()) -> None:
        self.inner = inner
        self.name = inner.name
        self.direct = inner.direct
        self.faults = list(faults)
        self._lock = threading.Lock()

    def _take(self, op: str, bufs: Sequence[memoryview] | None) -> tuple[KeyFault, int] | None:
        """The first active fault of ``op`` matching a row of ``bufs`` and that row's index."""
        hashes = [row_hash(b) for b in bufs] if bufs is not None else [None]
        with self._lock:
            for fault in self.faults:
                if fault.op != op or fault.hits >= fault.times:
                    continue
                for i, h in enumerate(hashes):
                    row = bufs is None or h is not None
                    if row and (not fault.hashes or h in fault.hashes):
                        fault.hits += 1
                        return fault, i
        return None

    def open(self, path: str | os.PathLike[str], create: bool) -> Any:
        return self.inner.open(path, create)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        hit = self._take("write", bufs)
        if hit is None:
            return self.inner.pwritev(handle, bufs, file_offset)
        fault, i = hit
        before = sum(memoryview(b).nbytes for b in bufs[:i])
        if fault.action in ("block", "delay"):
            fault.wait()
            return self.inner.pwritev(handle, bufs, file_offset)
        if fault.action == "errno":
            raise OSError(fault.err, f"injected {errno.errorcode[fault.err]} on write")
        if fault.action == "short":
            n = self.inner.pwritev(handle, bufs[:i], file_offset) if i else 0
            if n == before and fault.keep:
                n += self.inner.pwritev(
                    handle, [memoryview(bufs[i])[: fault.keep]], file_offset + before
                )
            return n
        if fault.action == "torn":
            target = memoryview(bufs[i])
            n = self.inner.pwritev(handle, bufs[:i], file_offset) if i else 0
            self.inner.pwritev(
                handle, [target[: target.nbytes - TRAILER_NBYTES]], file_offset + before
            )
            after = file_offset + before + target.nbytes
            if bufs[i + 1 :]:
                self.inner.pwritev(handle, bufs[i + 1 :], after)
            return sum(memoryview(b).nbytes for b in bufs)
        raise AssertionError(fault.action)

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        waits = [f for f in self.faults if f.op == "read" and f.action in ("block", "delay")]
        if waits and memoryview(bufs[0]).nbytes > TRAILER_NBYTES:  # a row read, not a scan
            waits[0].wait()
        n = self.inner.preadv(handle, bufs, file_offset)
        hit = self._take("read", bufs)
        if hit is None or hit[0].action in ("block", "delay"):
            return n
        fault, i = hit
        if fault.action == "errno":
            raise OSError(fault.err, f"injected {errno.errorcode[fault.err]} on read")
        if fault.action == "short":
            return min(n, sum(memoryview(b).nbytes for b in bufs[:i]) + fault.keep)
        raise AssertionError(fault.action)

    def fdatasync(self, handle: Any) -> None:
        if self._take("fdatasync", None) is not None:
            raise OSError(errno.EIO, "injected EIO on fdatasync")
        self.inner.fdatasync(handle)

    def allocate(self, handle: Any, nbytes: int) -> None:
        hit = self._take("allocate", None)
        if hit is not None:
            raise OSError(hit[0].err, "injected failure of allocate")
        self.inner.allocate(handle, nbytes)

    def close(self, handle: Any) -> None:
        self.inner.close(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Wrapper:
    """``row_io_wrapper`` for :class:`kvtier.NVMeConfig`: remembers the KeyFaultIO it made."""

    def __init__(self, *faults: KeyFault) -> None:
        self.faults = list(faults)
        self.io: KeyFaultIO | None = None

    def __call__(self, inner: RowIO) -> RowIO:
        self.io = KeyFaultIO(inner)
        self.io.faults = self.faults  # shared: faults added later apply too
        return self.io


async def until_set(event: threading.Event, what: str = "the held I/O never started") -> None:
    """Return once ``event`` (set by a RowIO wrapper's held request) is set; fail after 30 s."""
    for _ in range(3000):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def rig_factory(cls: Any, holder: list[Any]) -> Any:
    """A ``row_io_wrapper`` that wraps the backend in ``cls`` and appends the rig to ``holder``."""
    return lambda inner: holder.append(cls(inner)) or holder[-1]


REPO = pathlib.Path(__file__).resolve().parents[2]


def kill_child(args: Sequence[str], err_path: pathlib.Path, delay: float) -> bool:
    """Run ``python -m ARGS`` from the repository, SIGKILL it ``delay`` s after its "ready" line.

    The child's stderr goes to ``err_path``. Raises AssertionError (with the
    end of that stderr) when no "ready" line comes within 30 s.

    Returns:
        Whether the child was still alive when killed.
    """
    with err_path.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
        )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline().strip() if ready else "(no line in 30 s)"
        if line != "ready":
            proc.kill()
            proc.communicate(timeout=30)
            raise AssertionError(f"{line}: {err_path.read_text()[-3000:]}")
        time.sleep(delay)
        alive = proc.poll() is None
        if alive:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    return alive


def kill_log(
    log_path: pathlib.Path, err_path: pathlib.Path, history: dict[tuple[str, int], set[int]]
) -> tuple[list[dict[str, Any]], int, dict[tuple[str, int], set[int]]]:
    """Read the JSON-lines log of a child killed with SIGKILL (the last line may be cut).

    ``{"w": [hash, group, seq]}`` lines are writes (added to ``history``),
    ``{"flushed": [[hash, group, seq], ...]}`` lines the keys a flush covered
    (``seq < 0``: any write of that key seen so far).

    Returns:
        ``(entries, index of the last flush, {(hash, group): sequence numbers
        a restart may find for a key that flush covered})``.
    """
    entries = []
    for text in log_path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # the line the kill cut
            entries.append(json.loads(text))
    last = max((i for i, e in enumerate(entries) if "flushed" in e), default=None)
    assert last is not None, (len(entries), err_path.read_text()[-2000:])
    for e in entries:
        if "w" in e:
            h, g, s = e["w"]
            history.setdefault((h, g), set()).add(s)
    allowed: dict[tuple[str, int], set[int]] = {
        (h, g): ({s} if s >= 0 else set(history[(h, g)])) for h, g, s in entries[last]["flushed"]
    }
    return entries, last, allowed


def check_found(
    found: Mapping[OffloadKey, bytes | None],
    allowed: Mapping[tuple[str, int], set[int]],
    data: Any,
) -> int:
    """Check a reopen after a kill against :func:`kill_log`'s ``allowed`` sequence numbers.

    Every key found must be allowed (not evicted or replaced before the last
    flush) and hold the bytes ``data(key, seq)`` of one of its allowed writes,
    or be unreadable (None: a row the kill tore).

    Returns:
        How many keys had their bytes checked.
    """
    checked = 0
    for k, got in found.items():
        name = (k.block_hash.decode(), k.group_id)
        assert name in allowed, f"{name} was evicted or replaced before the last flush"
        if got is not None:
            assert any(got == data(k, s) for s in allowed[name]), name
            checked += 1
    return checked


async def snapshot(
    tier: NVMeTier, nbytes: Mapping[int, int], slot_nbytes: int
) -> dict[OffloadKey, bytes | None]:
    """Every visible key's first ``nbytes[group]`` payload bytes (None: its read failed)."""
    buf = Slots(1, slot_nbytes)
    try:
        out: dict[OffloadKey, bytes | None] = {}
        for k in list(tier.keys()):
            (got,) = await tier.read_rows([(k, buf[0])])
            out[k] = None if isinstance(got, BaseException) else bytes(buf[0][: nbytes[k.group_id]])
        return out
    finally:
        buf.close()
