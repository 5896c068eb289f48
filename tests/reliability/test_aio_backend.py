"""The opt-in ``io_backend="aio"`` NVMe backend: real files, real kernel AIO.

Every test here goes through a real seam: a real :class:`AioContext` on
O_DIRECT files, a real :class:`NVMeTier` or :class:`TransferEngine`, a
submitting wrapper for fault injection, a child process killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import pytest
import torch

import kvtier
from kvtier.errors import ConfigError
from kvtier.io import AioRowIO, NVMeTier
from kvtier.io._aio import AioContext, aio_supported
from kvtier.io._rowio import probe_direct_io
from tests.engine import nvme_child
from tests.engine.helpers import same
from tests.io.conftest import GROUP_NBYTES, Slots, key, payload, tier_kwargs
from tests.io.faults import DelegatingRowIO

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def aio_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    if not aio_supported():
        pytest.skip("no Linux AIO context here")
    if not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT here")
    return tmp_path


def _aio_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvtier-aio" and t.is_alive()]


def _aio_nr() -> int:
    return int(pathlib.Path("/proc/sys/fs/aio-nr").read_text())


def _buf(nbytes: int, fill: int = 0) -> memoryview:
    mm = mmap.mmap(-1, nbytes)
    mm.write(bytes((fill + i) & 0xFF for i in range(256)) * (nbytes // 256))
    return memoryview(mm)


def _slot_nbytes() -> int:
    return 8 * 4096  # >= the largest row of GROUP_NBYTES (trailer and padding included)


# -- AioContext / AioRowIO ---------------------------------------------------------------


def test_cancelled_request_future_does_not_kill_the_reaper(aio_dir: pathlib.Path) -> None:
    """Regression: a cancelled request future does not kill the reaper.

    Anybody may ``cancel()`` the future returned by ``submit`` while it is
    pending (``asyncio.wrap_future`` does exactly that when the awaiting task is
    cancelled, e.g. by ``asyncio.run`` cancelling leftover tasks at shutdown).
    Were it a plain ``concurrent.futures.Future``, the reaper would call
    ``fut.set_result`` on a CANCELLED future when the kernel completes the
    request -> ``InvalidStateError`` escapes ``_reap``, the reaper thread dies,
    and every other completed/queued request (and every later one) never
    completes: callers hang forever, queued iocbs are never submitted. Hence
    ``fut.set_running_or_notify_cancel()`` before submitting (then ``cancel()``
    returns False), or completion guarded by ``if not fut.cancelled()`` /
    ``contextlib.suppress(InvalidStateError)``.
    """
    io = AioRowIO(depth=1)
    h = io.open(aio_dir / "f", create=True)
    errors: list[BaseException] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment]
    try:
        io.allocate(h, 64 * 4096)
        bufs = [_buf(4 * 4096, fill=i) for i in range(8)]
        futs = [io.submit_pwritev(h, [b], i * 4 * 4096) for i, b in enumerate(bufs)]
        # Queued behind depth=1, still pending: the fix makes it uncancellable
        # (the kernel may already use its buffer), so cancel() must say no.
        assert not futs[-1].cancel()
        later = io.submit_preadv(h, [_buf(4096)], 0)
        try:
            assert later.result(timeout=5) == 4096
            assert [f.result(timeout=5) for f in futs] == [4 * 4096] * 8
        except TimeoutError:
            pytest.fail(f"requests never completed: the reaper died with {errors!r}")
        assert errors == []
        assert _aio_threads()  # the reaper is still alive
    finally:
        threading.excepthook = old_hook
        io.close(h)
        io.shutdown()


def test_mixed_reads_and_writes_far_beyond_depth_are_bitwise(aio_dir: pathlib.Path) -> None:
    """Writes and reads interleaved, 10x the depth, multi-iovec, from two threads."""
    io = AioRowIO(depth=3)
    h = io.open(aio_dir / "f", create=True)
    try:
        n = 30
        io.allocate(h, n * 3 * 4096)
        first = [_buf(3 * 4096, fill=i) for i in range(n)]
        for i, b in enumerate(first):  # a known base, written without AIO
            assert io.pwritev(h, [b], i * 3 * 4096) == 3 * 4096
        second = [_buf(3 * 4096, fill=100 + i) for i in range(n)]
        back = [_buf(3 * 4096) for _ in range(n)]
        futs: list[tuple[str, int, Future[int]]] = []
        lock = threading.Lock()

        def go(parity: int) -> None:
            for i in range(parity, n, 2):
                if i % 3 == 0:  # rewrite, three iovecs
                    b = second[i]
                    f = io.submit_pwritev(h, [b[:4096], b[4096:8192], b[8192:]], i * 3 * 4096)
                    kind = "w"
                else:  # read, three iovecs
                    b = back[i]
                    f = io.submit_preadv(h, [b[:4096], b[4096:8192], b[8192:]], i * 3 * 4096)
                    kind = "r"
                with lock:
                    futs.append((kind, i, f))

        ts = [threading.Thread(target=go, args=(p,)) for p in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert all(f.result(timeout=10) == 3 * 4096 for _, _, f in futs)
        for kind, i, _ in futs:
            if kind == "r":
                assert bytes(back[i]) == bytes(first[i]), i
        fd = os.open(aio_dir / "f", os.O_RDONLY)
        try:
            for i in range(0, n, 3):
                assert os.pread(fd, 3 * 4096, i * 3 * 4096) == bytes(second[i]), i
        finally:
            os.close(fd)
    finally:
        io.close(h)
        io.shutdown()


def test_short_completion_in_the_middle_of_a_multi_iovec_read(aio_dir: pathlib.Path) -> None:
    """EOF falls inside the second of three iovecs: the count is exact, bytes before it right."""
    io = AioRowIO(depth=2)
    h = io.open(aio_dir / "f", create=True)
    try:
        src = _buf(5 * 4096, fill=3)
        assert io.pwritev(h, [src], 0) == 5 * 4096
        a, b, c = _buf(2 * 4096), _buf(4 * 4096), _buf(2 * 4096)
        assert io.submit_preadv(h, [a, b, c], 0).result(timeout=5) == 5 * 4096
        assert bytes(a) + bytes(b[: 3 * 4096]) == bytes(src)
    finally:
        io.close(h)
        io.shutdown()


def test_close_with_many_queued_requests_completes_them_and_frees_the_context(
    aio_dir: pathlib.Path,
) -> None:
    before_nr, before_threads = _aio_nr(), set(_aio_threads())
    io = AioRowIO(depth=2)
    h = io.open(aio_dir / "f", create=True)
    io.allocate(h, 200 * 4096)
    bufs = [_buf(2 * 4096, fill=i) for i in range(100)]
    futs = [io.submit_pwritev(h, [b], i * 2 * 4096) for i, b in enumerate(bufs)]
    io.shutdown()  # with ~98 requests still queued in user space
    assert all(f.done() for f in futs)
    assert [f.result() for f in futs] == [2 * 4096] * 100
    with pytest.raises(RuntimeError):
        io.submit_pwritev(h, [bufs[0]], 0)
    io.close(h)
    assert set(_aio_threads()) == before_threads
    assert _aio_nr() == before_nr
    fd = os.open(aio_dir / "f", os.O_RDONLY)
    try:
        assert os.pread(fd, 2 * 4096, 99 * 2 * 4096) == bytes(bufs[99])
    finally:
        os.close(fd)


# -- the tier --------------------------------------------------------------------------


async def test_open_with_a_huge_depth_is_a_config_error_and_leaks_nothing(
    aio_dir: pathlib.Path,
) -> None:
    max_nr = int(pathlib.Path("/proc/sys/fs/aio-max-nr").read_text())
    before_nr, before_threads = _aio_nr(), set(_aio_threads())
    threads = max_nr  # depth = 4 * io_threads > fs.aio-max-nr: io_setup fails
    tier = NVMeTier(
        **tier_kwargs(aio_dir / "nvme", io_backend="aio", direct_io="on", io_threads=threads)
    )
    with pytest.raises(ConfigError, match="aio"):
        await tier.open()
    await tier.close()
    assert set(_aio_threads()) == before_threads
    assert _aio_nr() == before_nr
    # The namespace lock was released: the same namespace opens again at once.
    tier = NVMeTier(**tier_kwargs(aio_dir / "nvme", io_backend="aio", direct_io="on"))
    await asyncio.wait_for(tier.open(), 10)
    await tier.close()
    assert set(_aio_threads()) == before_threads
    assert _aio_nr() == before_nr


async def test_tier_many_concurrent_calls_beyond_depth_bitwise_and_close_frees(
    aio_dir: pathlib.Path,
) -> None:
    """io_threads=1: depth 4; 48 rows in 24 concurrent write calls, reads racing writes."""
    before_nr, before_threads = _aio_nr(), set(_aio_threads())
    kw = tier_kwargs(
        aio_dir / "nvme", io_backend="aio", direct_io="on", io_threads=1, request_nbytes=4096 * 8
    )
    n = 48
    keys = [key(i, i % 3) for i in range(n)]
    src, out = Slots(n, _slot_nbytes()), Slots(n, _slot_nbytes())
    tier = NVMeTier(**kw)
    await tier.open()
    try:
        assert tier._aio is not None
        for i, k in enumerate(keys):
            src.fill(i, payload(k, GROUP_NBYTES[k.group_id], salt=1))
        calls = [
            tier.write_rows([(keys[i], 0, 4, src[i]), (keys[i + 1], 0, 4, src[i + 1])])
            for i in range(0, n, 2)
        ]
        results = await asyncio.gather(*calls)
        assert all(r == [None, None] for r in results)
        # Second round: rewrite half (new keys) while reading the first half back.
        keys2 = [key(1000 + i, i % 3) for i in range(n // 2)]
        src2 = Slots(n // 2, _slot_nbytes())
        for i, k in enumerate(keys2):
            src2.fill(i, payload(k, GROUP_NBYTES[k.group_id], salt=2))
        writes = [tier.write_rows([(k, 0, 4, src2[i])]) for i, k in enumerate(keys2)]
        reads = [tier.read_rows([(k, out[i])]) for i, k in enumerate(keys)]
        got = await asyncio.gather(*writes, *reads)
        assert all(r == [None] for r in got[: len(writes)])
        assert all(r == [(0, 4)] for r in got[len(writes) :])
        for i, k in enumerate(keys):
            nb = GROUP_NBYTES[k.group_id]
            assert bytes(out[i][:nb]) == payload(k, nb, salt=1), i
        out2 = Slots(n // 2, _slot_nbytes())
        got = await tier.read_rows([(k, out2[i]) for i, k in enumerate(keys2)])
        assert got == [(0, 4)] * len(keys2)
        for i, k in enumerate(keys2):
            nb = GROUP_NBYTES[k.group_id]
            assert bytes(out2[i][:nb]) == payload(k, nb, salt=2), i
        # Close while many writes are still queued beyond the depth.
        src3 = Slots(n, _slot_nbytes())
        keys3 = [key(5000 + i, i % 3) for i in range(n)]
        for i, k in enumerate(keys3):
            src3.fill(i, payload(k, GROUP_NBYTES[k.group_id], salt=3))
        pending = [
            asyncio.ensure_future(tier.write_rows([(k, 0, 4, src3[i])]))
            for i, k in enumerate(keys3)
        ]
        await asyncio.sleep(0)
    finally:
        await asyncio.wait_for(tier.close(), 20)
    assert all(t.done() for t in pending)
    assert set(_aio_threads()) == before_threads
    assert _aio_nr() == before_nr
    # All accepted writes are on disk after a clean close.
    tier = NVMeTier(**kw)
    await tier.open()
    try:
        out3 = Slots(n, _slot_nbytes())
        got = await tier.read_rows([(k, out3[i]) for i, k in enumerate(keys3)])
        for i, k in enumerate(keys3):
            if pending[i].result() == [None]:
                assert got[i] == (0, 4)
                nb = GROUP_NBYTES[k.group_id]
                assert bytes(out3[i][:nb]) == payload(k, nb, salt=3), i
    finally:
        await tier.close()


class _Blocking(DelegatingRowIO):
    """A wrapper with only the blocking RowIO methods (no submit_*): worker threads."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.reads = self.writes = 0

    def preadv(self, handle: int, bufs: Sequence[memoryview], file_offset: int) -> int:
        self.reads += 1
        return self.inner.preadv(handle, bufs, file_offset)

    def pwritev(self, handle: int, bufs: Sequence[memoryview], file_offset: int) -> int:
        self.writes += 1
        return self.inner.pwritev(handle, bufs, file_offset)


async def test_wrapper_without_submit_uses_blocking_path_and_still_frees_context(
    aio_dir: pathlib.Path,
) -> None:
    before_nr, before_threads = _aio_nr(), set(_aio_threads())
    made: list[_Blocking] = []

    def wrap(inner: Any) -> _Blocking:
        made.append(_Blocking(inner))
        return made[-1]

    kw = tier_kwargs(aio_dir / "nvme", io_backend="aio", direct_io="on", row_io_wrapper=wrap)
    keys = [key(i, i % 3) for i in range(6)]
    src, out = Slots(6, _slot_nbytes()), Slots(6, _slot_nbytes())
    tier = NVMeTier(**kw)
    await tier.open()
    try:
        assert tier._aio is None
        for i, k in enumerate(keys):
            src.fill(i, payload(k, GROUP_NBYTES[k.group_id]))
        assert await tier.write_rows([(k, 0, 4, src[i]) for i, k in enumerate(keys)]) == [None] * 6
        got = await tier.read_rows([(k, out[i]) for i, k in enumerate(keys)])
        assert got == [(0, 4)] * 6
        for i, k in enumerate(keys):
            nb = GROUP_NBYTES[k.group_id]
            assert bytes(out[i][:nb]) == payload(k, nb)
        assert made[0].reads > 0
        assert made[0].writes > 0
    finally:
        await tier.close()
    assert set(_aio_threads()) == before_threads
    assert _aio_nr() == before_nr


class _Gated:
    """A submitting wrapper: holds every request until ``gate`` opens, then queues it for real."""

    def __init__(self, inner: AioRowIO) -> None:
        self.inner = inner
        self.name, self.direct = inner.name, inner.direct
        self.gate = threading.Event()
        self.held = 0
        self._threads: list[threading.Thread] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _later(self, submit: Any, handle: int, bufs: list[memoryview], off: int) -> Future[int]:
        out: Future[int] = Future()
        self.held += 1

        def run() -> None:
            self.gate.wait(10)
            try:
                res = submit(handle, bufs, off).result(10)
            except BaseException as exc:
                out.set_exception(exc)
            else:
                out.set_result(res)

        t = threading.Thread(target=run, daemon=True)
        self._threads.append(t)
        t.start()
        return out

    def submit_pwritev(self, handle: int, bufs: list[memoryview], off: int) -> Future[int]:
        return self._later(self.inner.submit_pwritev, handle, bufs, off)

    def submit_preadv(self, handle: int, bufs: list[memoryview], off: int) -> Future[int]:
        return self._later(self.inner.submit_preadv, handle, bufs, off)


async def test_cancelled_read_rows_keeps_slots_busy_until_drain(aio_dir: pathlib.Path) -> None:
    """A cancelled caller: the reads still land before drain() returns, never after."""
    made: list[_Gated] = []

    def wrap(inner: AioRowIO) -> _Gated:
        made.append(_Gated(inner))
        return made[-1]

    kw = tier_kwargs(aio_dir / "nvme", io_backend="aio", direct_io="on", row_io_wrapper=wrap)
    keys = [key(i, 0) for i in range(4)]
    src, out = Slots(4, _slot_nbytes()), Slots(4, _slot_nbytes())
    tier = NVMeTier(**kw)
    await tier.open()
    try:
        made[0].gate.set()
        for i, k in enumerate(keys):
            src.fill(i, payload(k, GROUP_NBYTES[0]))
        assert await tier.write_rows([(k, 0, 4, src[i]) for i, k in enumerate(keys)]) == [None] * 4
        made[0].gate.clear()
        task = asyncio.ensure_future(tier.read_rows([(k, out[i]) for i, k in enumerate(keys)]))
        for _ in range(20):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        drained = asyncio.ensure_future(tier.drain())
        await asyncio.sleep(0.1)
        assert not drained.done()  # the reads are still in flight: slots in use
        made[0].gate.set()
        await asyncio.wait_for(drained, 10)
        for i, k in enumerate(keys):  # landed before drain returned
            assert bytes(out[i][: GROUP_NBYTES[0]]) == payload(k, GROUP_NBYTES[0])
    finally:
        made[0].gate.set()
        await tier.close()


def test_tier_task_cancelled_at_loop_shutdown_does_not_kill_the_reaper(
    aio_dir: pathlib.Path,
) -> None:
    """Regression: the tier awaits ``asyncio.wrap_future(fut)``; when its task is
    cancelled (here: ``asyncio.run`` cancels the tasks left at the end, a caller
    that forgot to close), ``wrap_future`` cancels the concurrent future, and the
    reaper must not then die on ``set_result`` of a cancelled future
    (InvalidStateError). Were it to, the same AIO context would never complete
    anything again: the reaper thread gone while requests are still pending,
    ``shutdown`` returning with them unfinished. As in the AioContext test, the
    futures are uncancellable (``set_running_or_notify_cancel()``) or cancelled
    futures are ignored in ``_reap``; a cancelled task must also not abandon a
    slot still being DMA'd.
    """
    errors: list[BaseException] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment]
    holder: dict[str, Any] = {}
    src = Slots(64, _slot_nbytes())

    async def main() -> None:
        tier = NVMeTier(
            **tier_kwargs(aio_dir / "nvme", io_backend="aio", direct_io="on", io_threads=1)
        )
        await tier.open()
        holder["tier"] = tier
        keys = [key(i, 0) for i in range(64)]
        for i, k in enumerate(keys):
            src.fill(i, payload(k, GROUP_NBYTES[0]))
        holder["forgotten"] = [  # writes left running: cancelled by asyncio.run
            asyncio.ensure_future(tier.write_rows([(k, 0, 4, src[i])])) for i, k in enumerate(keys)
        ]
        ctx = tier._backend._ctx  # type: ignore[union-attr]
        for _ in range(2000):  # return while requests are queued in the kernel
            await asyncio.sleep(0)
            with ctx._lock:
                if ctx._pending:
                    return
        pytest.skip("no request was ever pending at once here")

    try:
        asyncio.run(main())
        backend = holder["tier"]._backend
        assert isinstance(backend, AioRowIO)
        # The context must still work: a fresh request completes.
        h = backend.open(aio_dir / "probe", create=True)
        try:
            fut = backend.submit_pwritev(h, [_buf(4096)], 0)
            try:
                assert fut.result(timeout=5) == 4096
            except TimeoutError:
                pytest.fail(f"the AIO context is dead: reaper died with {errors!r}")
            assert errors == []
        finally:
            backend.close(h)
            backend.shutdown()
    finally:
        threading.excepthook = old_hook


# -- the engine ------------------------------------------------------------------------


def _aio_config(root: str, namespace: str = "restart") -> kvtier.EngineConfig:
    return kvtier.EngineConfig(
        cpu_bytes=1 << 20,
        blocks_per_chunk=nvme_child.BPC,
        nvme=kvtier.NVMeConfig(
            root=root,
            capacity_bytes=64 << 20,
            namespace=namespace,
            segment_nbytes=1 << 20,
            io_backend="aio",
            direct_io="on",
            io_threads=1,
        ),
    )


def _expected_ok(tensors: list[torch.Tensor], expected: list[torch.Tensor], ids: list[int]) -> bool:
    idx = torch.tensor(ids)
    return (
        same(tensors[0].index_select(0, idx), expected[0].index_select(0, idx))
        and same(tensors[1].index_select(1, idx), expected[1].index_select(1, idx))
        and same(tensors[2][ids, :4096], expected[2][ids, :4096])
    )


async def test_engine_three_groups_round_trip_on_aio(aio_dir: pathlib.Path) -> None:
    before_nr, before_threads = _aio_nr(), set(_aio_threads())
    root = str(aio_dir / "nvme")
    layout, _ = nvme_child.build(True)
    async with kvtier.TransferEngine(layout, _aio_config(root)) as engine:
        assert engine.stats().nvme["backend"] == "aio"
        res = await engine.store(nvme_child.chunks(), durable=True)
        assert len(res.stored) == 6
    layout, tensors = nvme_child.build(False)
    _, expected = nvme_child.build(True)
    async with kvtier.TransferEngine(layout, _aio_config(root)) as engine:
        keys = [c.key for c in nvme_child.chunks()]
        assert engine.lookup(keys) == [kvtier.Residency.NVME] * 6
        out = await engine.load(nvme_child.chunks())
        assert len(out.loaded) == 6
        assert not out.failed
    assert _expected_ok(tensors, expected, [1, 5, 9, 13, 2, 6])
    assert bool((tensors[2][:, 4096:] == 0xEE).all())
    assert set(_aio_threads()) == before_threads
    assert _aio_nr() == before_nr


async def test_engine_hard_close_during_write_through_on_aio(aio_dir: pathlib.Path) -> None:
    before_nr, before_threads = _aio_nr(), set(_aio_threads())
    root = str(aio_dir / "nvme")
    layout, _ = nvme_child.build(True)
    engine = kvtier.TransferEngine(layout, _aio_config(root, "hard"))
    await engine.open() if hasattr(engine, "open") else await engine.__aenter__()
    chunks = [
        kvtier.Chunk(nvme_child.key(f"h{i}", i % 3), [(4 * i + j) % 24 for j in range(4)])
        for i in range(30)
    ]
    await engine.store(chunks)  # write-through queues them all for NVMe
    await asyncio.wait_for(engine.aclose(hard=True), 20)
    assert set(_aio_threads()) == before_threads
    assert _aio_nr() == before_nr
    # Whatever reached NVMe loads bitwise; the rest is a miss.
    layout2, tensors = nvme_child.build(False)
    _, expected = nvme_child.build(True)
    async with kvtier.TransferEngine(layout2, _aio_config(root, "hard")) as engine:
        for c in chunks:
            r = engine.lookup([c.key])[0]
            assert r in (kvtier.Residency.NVME, kvtier.Residency.MISS)
            if r is kvtier.Residency.NVME:
                out = await engine.load([c])
                assert list(out.loaded) == [c.key], out.failed
                assert _group_ok(tensors, expected, c)


def _group_ok(tensors: list[torch.Tensor], expected: list[torch.Tensor], c: kvtier.Chunk) -> bool:
    ids = list(c.block_ids)
    idx = torch.tensor(ids)
    g = c.key.group_id
    if g == 0:
        return same(tensors[0].index_select(0, idx), expected[0].index_select(0, idx))
    if g == 1:
        return same(tensors[1].index_select(1, idx), expected[1].index_select(1, idx))
    return same(tensors[2][ids, :4096], expected[2][ids, :4096])


_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, {repo!r})
    import kvtier
    from tests.engine import nvme_child
    from tests.reliability.test_aio_backend import _aio_config

    async def main():
        layout, _ = nvme_child.build(True)
        async with kvtier.TransferEngine(layout, _aio_config({root!r}, "kill")) as engine:
            i = 0
            while True:
                c = kvtier.Chunk(nvme_child.key(f"k{{i}}", i % 3),
                                 [(4 * i + j) % 24 for j in range(4)])
                await engine.store([c], durable=(i % 4 == 0))
                if i == 40:
                    print("ready", flush=True)
                i += 1

    asyncio.run(main())
    """
)


async def test_sigkill_mid_write_on_aio_then_every_key_loads_bitwise_or_misses(
    aio_dir: pathlib.Path,
) -> None:
    root = str(aio_dir / "nvme")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(repo=str(REPO), root=root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
        assert line.strip() == b"ready", proc.stderr.read() if proc.stderr else b""
        time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    layout, tensors = nvme_child.build(False)
    _, expected = nvme_child.build(True)
    loaded = 0
    async with kvtier.TransferEngine(layout, _aio_config(root, "kill")) as engine:
        for i in range(2000):
            c = kvtier.Chunk(nvme_child.key(f"k{i}", i % 3), [(4 * i + j) % 24 for j in range(4)])
            r = engine.lookup([c.key])[0]
            if r is not kvtier.Residency.NVME:
                continue
            out = await engine.load([c])
            if out.loaded:
                loaded += 1
                assert _group_ok(tensors, expected, c), i
            else:  # a torn row: a counted miss, never wrong bytes
                assert engine.lookup([c.key]) == [kvtier.Residency.MISS]
    assert loaded >= 10  # the durable stores before "ready" are there


def test_aio_context_oserror_on_unsupported_depth_leaks_nothing() -> None:
    if not aio_supported():
        pytest.skip("no Linux AIO context here")
    before_nr, before_threads = _aio_nr(), set(_aio_threads())
    with pytest.raises(OSError) as exc:
        AioContext(1 << 30)
    assert exc.value.errno in (errno.EAGAIN, errno.EINVAL, errno.ENOMEM)
    assert _aio_nr() == before_nr
    assert set(_aio_threads()) == before_threads
