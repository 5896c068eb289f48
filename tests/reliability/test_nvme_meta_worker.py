"""File growth and hole punching on the NVMe tier's own ``kvtier-meta`` workers.

``grow()`` (``fallocate`` of a segment, creation of a new segment file) and
``reclaim()`` (blanking stale rows) run on their own executor next to
the ``io_threads`` pool. These tests go through real seams only: a RowIO
wrapper (``row_io_wrapper``) that gates or fails ``allocate`` and the trailer
blanking, real files, a real child process killed with SIGKILL.

The wrapper can hand out wrapped handles (no ``fd`` attribute): the tier then
cannot punch holes and blanks a stale row by writing a zero trailer through
``RowIO.pwritev``, which the wrapper can see, gate and attribute to a thread.
"""

from __future__ import annotations

import asyncio
import errno
import os
import pathlib
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from kvtier.errors import StorageError
from kvtier.io import NVMeTier, RowIO
from kvtier.io._format import TRAILER_NBYTES

from ..io.conftest import Slots, key, payload, tier_kwargs

G0 = 3 * 4096 + 100  # payload of the one group used here: rows of 5 pages
ROW = 5 * 4096
STEP_ROWS = 4
CAPACITY = 16 * ROW  # growth step = capacity / (4 * groups) = 4 rows
REPO = pathlib.Path(__file__).resolve().parents[2]


class _Handle:
    """A wrapped backend handle without ``fd``: the tier cannot punch holes through it."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner


class MetaIO:
    """Real backend; gates/fails ``allocate`` and zero-trailer blanking; records worker threads."""

    def __init__(self, inner: RowIO, wrap_handles: bool) -> None:
        self.inner = inner
        self.name = inner.name
        self.direct = inner.direct
        self.wrap = wrap_handles
        self.ops: list[tuple[str, str]] = []  # (op, thread name)
        self.allocate_open = threading.Event()
        self.allocate_open.set()
        self.allocate_waiting = threading.Event()
        self.allocate_errors: list[int] = []  # errnos raised by the next allocate calls
        self.blank_open = threading.Event()
        self.blank_open.set()
        self.blank_waiting = threading.Event()
        self._lock = threading.Lock()

    def _h(self, handle: Any) -> Any:
        return handle.inner if isinstance(handle, _Handle) else handle

    def _note(self, op: str) -> None:
        with self._lock:
            self.ops.append((op, threading.current_thread().name))

    def threads_of(self, op: str) -> set[str]:
        with self._lock:
            return {t.rsplit("_", 1)[0] for o, t in self.ops if o == op}

    def open(self, path: str | os.PathLike[str], create: bool) -> Any:
        h = self.inner.open(path, create)
        return _Handle(h) if self.wrap else h

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        return self.inner.preadv(self._h(handle), bufs, file_offset)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        if len(bufs) == 1 and nbytes == TRAILER_NBYTES and file_offset != 0:
            self._note("blank")
            self.blank_waiting.set()
            assert self.blank_open.wait(30)
        elif file_offset != 0:
            self._note("write")
        return self.inner.pwritev(self._h(handle), bufs, file_offset)

    def fdatasync(self, handle: Any) -> None:
        self.inner.fdatasync(self._h(handle))

    def allocate(self, handle: Any, nbytes: int) -> None:
        self._note("allocate")
        self.allocate_waiting.set()
        assert self.allocate_open.wait(30)
        with self._lock:
            err = self.allocate_errors.pop(0) if self.allocate_errors else None
        if err is not None:
            raise OSError(err, f"injected {errno.errorcode[err]} on allocate")
        self.inner.allocate(self._h(handle), nbytes)

    def close(self, handle: Any) -> None:
        self.inner.close(self._h(handle))


class Wrap:
    """``row_io_wrapper`` that remembers its :class:`MetaIO`."""

    def __init__(self, wrap_handles: bool = False) -> None:
        self.wrap_handles = wrap_handles
        self.io: MetaIO | None = None

    def __call__(self, inner: RowIO) -> RowIO:
        self.io = MetaIO(inner, self.wrap_handles)
        return self.io  # type: ignore[return-value]


def _kwargs(root: pathlib.Path, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "group_nbytes": {0: G0},
        "capacity_bytes": CAPACITY,
        "segment_nbytes": 8 << 20,
        "io_threads": 1,
        "direct_io": "off",
    }
    base.update(over)
    return tier_kwargs(root, **base)


async def _open(root: pathlib.Path, **over: Any) -> NVMeTier:
    tier = NVMeTier(**_kwargs(root, **over))
    await tier.open()
    return tier


async def _write(tier: NVMeTier, slots: Slots, ids: Sequence[int], salt: int = 0) -> list[Any]:
    rows = []
    for i in ids:
        k = key(i)
        rows.append((k, 0, 4, slots.fill(i % slots.count, payload(k, G0, salt))))
    return await asyncio.wait_for(tier.write_rows(rows), 10)


async def _read_all(tier: NVMeTier, slots: Slots, ids: Sequence[int], salt: int = 0) -> dict:
    """id -> True (intact), False (wrong bytes) or the error kind."""
    out: dict[int, Any] = {}
    for i in ids:
        k = key(i)
        (res,) = await tier.read_rows([(k, slots[0])])
        if isinstance(res, BaseException):
            out[i] = getattr(res, "kind", repr(res))
        else:
            out[i] = bytes(slots[0][:G0]) == payload(k, G0, salt)
    return out


def _disk(tier: NVMeTier) -> tuple[int, int, list[pathlib.Path]]:
    """(apparent bytes, file count, leftover temporary files) of a tier's segments."""
    files = list(tier.directory.glob("g*/*.kvrows"))
    return sum(p.stat().st_size for p in files), len(files), list(tier.directory.rglob("*.tmp"))


def _assert_allocation_matches_files(tier: NVMeTier) -> None:
    size, nfiles, temps = _disk(tier)
    st = tier.stats()
    assert not temps
    assert st["segments"] == nfiles
    assert size == st["bytes_allocated"] + 4096 * nfiles, (size, st["bytes_allocated"], nfiles)


def _new_threads(before: set[threading.Thread], prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name.startswith(prefix)]


def _gone(threads: list[threading.Thread]) -> list[str]:
    for t in threads:
        t.join(5)
    return [t.name for t in threads if t.is_alive()]


# ---------------------------------------------------------------- the point of the change


async def test_growth_and_blanking_run_on_the_meta_worker_and_writes_on_the_io_workers(
    tmp_path,
) -> None:
    wrap = Wrap(wrap_handles=True)
    slots = Slots(4, 8 * 4096)
    tier = await _open(tmp_path, row_io_wrapper=wrap)
    try:
        await _write(tier, slots, range(6))  # creates and then extends the segment
        tier.discard(key(0))
        tier.discard(key(1))
        assert await _write(tier, slots, [10]) == [None]  # blanks rows 0 and 1 first
        await tier.drain()
        io = wrap.io
        assert io is not None
        assert io.threads_of("allocate") == {"kvtier-meta"}
        assert io.threads_of("blank") == {"kvtier-meta"}
        assert io.threads_of("write") == {"kvtier-io"}
        _assert_allocation_matches_files(tier)
    finally:
        await tier.close()
        slots.close()


async def test_a_write_to_free_rows_does_not_wait_for_a_blocked_growth_with_one_io_thread(
    tmp_path,
) -> None:
    """With io_threads=1, a fallocate blocked on the I/O pool used to stall every row write."""
    wrap = Wrap()
    slots = Slots(4, 8 * 4096)
    tier = await _open(tmp_path, row_io_wrapper=wrap, io_threads=1)
    io = wrap.io
    assert io is not None
    try:
        await tier.drain()  # the first segment (4 rows) exists
        io.allocate_open.clear()
        io.allocate_waiting.clear()
        assert await _write(tier, slots, [0, 1]) == [None, None]  # 2 free left: grow ahead
        assert await asyncio.to_thread(io.allocate_waiting.wait, 5)
        # The growth ahead is stuck in fallocate on kvtier-meta; the only I/O
        # worker is free, so a write to a free row completes meanwhile.
        assert await _write(tier, slots, [2]) == [None]
        assert (await _read_all(tier, slots, [0, 1, 2])) == {0: True, 1: True, 2: True}
    finally:
        io.allocate_open.set()
    await tier.drain()
    _assert_allocation_matches_files(tier)
    await tier.close()
    slots.close()


# ---------------------------------------------------------------- close vs meta work in flight


@pytest.mark.parametrize("blocked", ["grow_segment", "create_segment"])
async def test_close_waits_for_a_growth_in_flight_on_the_meta_worker(tmp_path, blocked) -> None:
    wrap = Wrap()
    slots = Slots(4, 8 * 4096)
    before = set(threading.enumerate())
    tier = await _open(tmp_path, row_io_wrapper=wrap, segment_nbytes=4096 + 6 * ROW)
    io = wrap.io
    assert io is not None
    await tier.drain()  # segment 0 with 4 of its 6 rows
    io.allocate_open.clear()
    io.allocate_waiting.clear()
    # grow_segment: 2 rows written, 2 free -> extend segment 0 to its 6 rows.
    # create_segment: after that, 6 written -> segment 1 is created ahead.
    if blocked == "create_segment":
        io.allocate_open.set()
        assert await _write(tier, slots, [0, 1]) == [None, None]
        await tier.drain()
        io.allocate_open.clear()
        io.allocate_waiting.clear()
        assert await _write(tier, slots, [2, 3, 4, 5]) == [None] * 4
    else:
        assert await _write(tier, slots, [0, 1]) == [None, None]
    written = [0, 1] if blocked == "grow_segment" else [0, 1, 2, 3, 4, 5]
    assert await asyncio.to_thread(io.allocate_waiting.wait, 5)
    closing = asyncio.ensure_future(tier.close())
    await asyncio.sleep(0.2)
    try:
        assert not closing.done()  # a file of the tier is being grown under the meta worker
    finally:
        io.allocate_open.set()
    await asyncio.wait_for(closing, 10)
    assert not _gone(_new_threads(before, "kvtier-"))
    again = await _open(tmp_path)
    try:
        _assert_allocation_matches_files(again)
        assert again.stats()["segments"] == (1 if blocked == "grow_segment" else 2)
        got = await _read_all(again, slots, written)
        assert got == dict.fromkeys(written, True)
    finally:
        await again.close()
        slots.close()


async def test_hard_close_of_a_batch_whose_stale_rows_are_being_blanked(tmp_path) -> None:
    wrap = Wrap(wrap_handles=True)
    slots = Slots(4, 8 * 4096)
    before = set(threading.enumerate())
    tier = await _open(tmp_path, row_io_wrapper=wrap)
    io = wrap.io
    assert io is not None
    assert await _write(tier, slots, range(4)) == [None] * 4
    await tier.flush()
    tier.discard(key(1))
    io.blank_open.clear()
    writing = asyncio.ensure_future(_write(tier, slots, [7]))
    assert await asyncio.to_thread(io.blank_waiting.wait, 5)
    closing = asyncio.ensure_future(tier.close())
    await asyncio.sleep(0.2)
    try:
        assert not writing.done()
        assert not closing.done()
    finally:
        io.blank_open.set()
    assert await writing == [None]
    await asyncio.wait_for(closing, 10)
    assert tier.stats()["reclaim_failures"] == 0
    assert not _gone(_new_threads(before, "kvtier-"))
    again = await _open(tmp_path)
    try:
        got = await _read_all(again, slots, [0, 1, 2, 3, 7])
        assert got == {0: True, 1: "missing", 2: True, 3: True, 7: True}
        _assert_allocation_matches_files(again)
    finally:
        await again.close()
        slots.close()


# ---------------------------------------------------------------- ordering: blank vs reuse


async def test_a_row_being_blanked_is_not_handed_to_a_concurrent_write(tmp_path) -> None:
    """Stale rows blanked on the meta worker; concurrent batches on the I/O worker.

    If a stale row were reused before its blanking ended, the zero trailer
    would land on the new key's row: the key vanishes after a restart.
    """
    wrap = Wrap(wrap_handles=True)
    slots = Slots(8, 8 * 4096)
    tier = await _open(tmp_path, row_io_wrapper=wrap, grow_ahead=False)
    io = wrap.io
    assert io is not None
    assert await _write(tier, slots, range(4)) == [None] * 4  # rows 0..3, none free
    for i in (0, 1, 2):
        tier.discard(key(i))
    io.blank_open.clear()
    first = asyncio.ensure_future(_write(tier, slots, [10]))  # takes the stale rows
    assert await asyncio.to_thread(io.blank_waiting.wait, 5)
    second = asyncio.ensure_future(_write(tier, slots, [11, 12]))  # must grow, not reuse
    await asyncio.sleep(0.2)
    try:
        assert not first.done()  # its rows wait for their blanking
        # (``second`` must grow: its growth is queued behind the blanking on
        # the single meta worker, so it waits too; see the report.)
    finally:
        io.blank_open.set()
    assert await first == [None]
    assert await second == [None, None]
    await tier.close()
    again = await _open(tmp_path)
    try:
        got = await _read_all(again, slots, [0, 1, 2, 3, 10, 11, 12])
        assert got == {0: "missing", 1: "missing", 2: "missing", 3: True, 10: True, 11: True,
                       12: True}  # fmt: skip
        _assert_allocation_matches_files(again)
    finally:
        await again.close()
        slots.close()


# ---------------------------------------------------------------- growth failures


async def test_enospc_on_growth_ahead_then_on_demand_growth_recovers(tmp_path) -> None:
    wrap = Wrap()
    slots = Slots(4, 8 * 4096)
    tier = await _open(tmp_path, row_io_wrapper=wrap)
    io = wrap.io
    assert io is not None
    try:
        await tier.drain()
        io.allocate_errors[:] = [errno.ENOSPC]
        assert await _write(tier, slots, [0, 1]) == [None, None]  # growth ahead fails
        await tier.drain()
        assert 0 in tier._ahead_paused
        _assert_allocation_matches_files(tier)  # the failed plan was given back
        assert await _write(tier, slots, [2, 3, 4]) == [None] * 3  # on demand: grows
        await tier.drain()
        assert 0 not in tier._ahead_paused
        _assert_allocation_matches_files(tier)
        assert await _read_all(tier, slots, range(5)) == dict.fromkeys(range(5), True)
        assert tier.stats()["failures_enospc"] == 0
    finally:
        await tier.close()
        slots.close()


async def test_enospc_on_every_growth_fails_only_the_rows_that_need_one(tmp_path) -> None:
    wrap = Wrap()
    slots = Slots(8, 8 * 4096)
    before = set(threading.enumerate())
    tier = await _open(tmp_path, row_io_wrapper=wrap)
    io = wrap.io
    assert io is not None
    await tier.drain()
    io.allocate_errors[:] = [errno.ENOSPC] * 50
    res = await _write(tier, slots, range(6))
    assert res[:4] == [None] * 4
    assert [getattr(r, "kind", None) for r in res[4:]] == ["enospc", "enospc"]
    assert all(isinstance(r, StorageError) for r in res[4:])
    await tier.drain()
    st = tier.stats()
    assert st["failures_enospc"] == 2
    assert st["bytes_used"] == 4 * ROW
    _assert_allocation_matches_files(tier)
    io.allocate_errors.clear()
    assert await _write(tier, slots, [6]) == [None]  # space is back: on-demand growth works
    await tier.drain()
    _assert_allocation_matches_files(tier)
    await asyncio.wait_for(tier.close(), 10)
    assert not _gone(_new_threads(before, "kvtier-"))
    slots.close()


# ---------------------------------------------------------------- threads


async def test_open_close_cycles_leave_no_meta_threads(tmp_path) -> None:
    before = set(threading.enumerate())
    slots = Slots(4, 8 * 4096)
    for cycle in range(4):
        tier = await _open(tmp_path, row_io_wrapper=Wrap(wrap_handles=True))
        assert await _write(tier, slots, [cycle * 10, cycle * 10 + 1]) == [None, None]
        tier.discard(key(cycle * 10))  # blanked by close(), on the meta worker
        await tier.close()
        assert tier.stats()["reclaim_failures"] == 0
        assert not _gone(_new_threads(before, "kvtier-meta"))
    assert not _gone(_new_threads(before, "kvtier-"))
    slots.close()


# ---------------------------------------------------------------- close during open


async def test_close_during_open_releases_the_namespace_lock(tmp_path) -> None:
    """close() while open() is in flight must leave the namespace reusable.

    Regression: ``close()`` in state "opening" must not run ``_close`` ->
    ``_release`` at once, shutting the executors down while ``open()``'s steps
    are still queued and before ``_keep_lock_fd`` records the lock fd. ``open()``
    would then fail with RuntimeError ("cannot schedule new futures after
    shutdown"), its own ``_release`` could not submit either, and the flock fd
    would leak: the namespace stays locked for the rest of the process.
    """
    tier = NVMeTier(**_kwargs(tmp_path))
    opening = asyncio.ensure_future(tier.open())
    await asyncio.sleep(0)
    await asyncio.wait_for(tier.close(), 10)
    await asyncio.gather(opening, return_exceptions=True)  # may fail (closed under it)
    assert tier._state == "closed"
    again = await _open(tmp_path)  # NamespaceLockedError: the lock fd leaked
    await again.close()


# ---------------------------------------------------------------- SIGKILL while growing


async def _child(root: str, segment_nbytes: int) -> None:
    """Write and flush rows until a growth ahead blocks in fallocate; print the rows written."""
    wrap = Wrap()
    slots = Slots(8, 8 * 4096)
    tier = await _open(pathlib.Path(root), row_io_wrapper=wrap, segment_nbytes=segment_nbytes)
    io = wrap.io
    assert io is not None
    await tier.drain()
    assert await _write(tier, slots, range(2)) == [None] * 2
    await tier.drain()
    io.allocate_open.clear()
    io.allocate_waiting.clear()
    n = 2
    while not io.allocate_waiting.is_set() and tier._index.free_rows(0):
        assert await _write(tier, slots, [n]) == [None]
        n += 1
        await asyncio.sleep(0.02)
    await tier.flush()
    assert await asyncio.to_thread(io.allocate_waiting.wait, 5)
    print(f"blocked {n}", flush=True)
    await asyncio.sleep(60)


@pytest.mark.parametrize("segment_rows", [6, 64])  # 6: a new segment is being created
async def test_sigkill_while_the_meta_worker_grows_a_segment(tmp_path, segment_rows) -> None:
    seg = 4096 + segment_rows * ROW
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.test_nvme_meta_worker", str(tmp_path), str(seg)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        word, n = line.split()
        assert word == "blocked"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    temps = list(tmp_path.rglob("*.kvrows.tmp"))
    assert len(temps) == (1 if segment_rows == 6 else 0)  # killed inside create_segment or not
    slots = Slots(4, 8 * 4096)
    tier = await _open(tmp_path, segment_nbytes=seg)
    try:
        _assert_allocation_matches_files(tier)
        written = range(int(n))
        assert await _read_all(tier, slots, written) == dict.fromkeys(written, True)
        assert await _write(tier, slots, range(20, 30)) == [None] * 10
        await tier.drain()
        _assert_allocation_matches_files(tier)
    finally:
        await tier.close()
        slots.close()


if __name__ == "__main__":
    asyncio.run(_child(sys.argv[1], int(sys.argv[2])))
