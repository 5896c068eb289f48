"""KvikioRowIO's adaptation of kvikio to the RowIO contract, on a host without CUDA.

kvikio needs a CUDA driver even for host buffers, so on this machine a small
stand-in module plays kvikio's part. It does real ``pread``/``pwrite`` and
reproduces the two behaviours of kvikio that the adapter exists for, as
kvikio's sources state them:

- a read that reaches the end of the file raises ``RuntimeError`` instead of
  returning a short count (``KVIKIO_EXPECT(nbytes_processed != 0, ...)`` in
  ``cpp/include/kvikio/detail/posix_io.hpp``);
- POSIX errors arrive as ``RuntimeError`` with the strerror text, no errno;
- ``defaults`` holds the thread-pool size (``KVIKIO_NTHREADS``, default 1).

The real kvikio runs the whole conformance suite (``TestKvikio`` in
``test_rowio.py``) where a GPU exists.
"""

from __future__ import annotations

import errno
import os
import sys
import types
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from kvtier.io import KvikioRowIO, NVMeTier, RowIO

from .conftest import GROUP_NBYTES, key, payload, tier_kwargs
from .test_rowio import RowIOConformance


class _Future:
    def __init__(self, run: Callable[[], int]) -> None:
        self._run = run

    def get(self) -> int:
        return self._run()


class _StandInKvikio(types.ModuleType):
    """``kvikio`` as far as KvikioRowIO uses it: CuFile, IOFuture.get(), defaults."""

    def __init__(self, api: str) -> None:
        super().__init__("kvikio")
        self.fail_writes: int | None = None  # errno of the next pwrite, then None
        self.pread_calls = 0
        self.defaults = types.SimpleNamespace()
        threads = {"num_threads": 1}
        if api == "old":  # kvikio < 25.02
            self.defaults.get_num_threads = lambda: threads["num_threads"]
            self.defaults.set_num_threads = lambda n: threads.update(num_threads=n)
        else:
            self.defaults.get = lambda name: threads[name]
            self.defaults.set = lambda name, value: threads.update({name: value})
        self.threads = threads
        kvikio = self

        class CuFile:
            def __init__(self, path: str, flags: str = "r") -> None:
                assert flags == "r+"
                self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

            def pread(self, buf: Any, size: int, file_offset: int = 0) -> _Future:
                kvikio.pread_calls += 1

                def run() -> int:
                    n = os.preadv(self._fd, [memoryview(buf)[:size]], file_offset)
                    if n == 0:
                        raise RuntimeError("POSIX error on pread: EOF")
                    return n

                return _Future(run)

            def pwrite(self, buf: Any, size: int, file_offset: int = 0) -> _Future:
                def run() -> int:
                    if kvikio.fail_writes is not None:
                        code, kvikio.fail_writes = kvikio.fail_writes, None
                        raise RuntimeError(f"POSIX error on pwrite: {os.strerror(code)}")
                    return os.pwritev(self._fd, [memoryview(buf)[:size]], file_offset)

                return _Future(run)

            def close(self) -> None:
                os.close(self._fd)

        self.CuFile = CuFile


@pytest.fixture
def kvikio(monkeypatch: pytest.MonkeyPatch) -> _StandInKvikio:
    module = _StandInKvikio("new")
    monkeypatch.setitem(sys.modules, "kvikio", module)
    return module


class TestKvikioAdapter(RowIOConformance):
    """The RowIO-level conformance tests, on KvikioRowIO over the stand-in."""

    tier_options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def row_io(self, kvikio: _StandInKvikio) -> RowIO:
        return KvikioRowIO(direct=True, threads=2)

    async def test_tier_detects_short_io(self) -> None:  # type: ignore[override]
        pytest.skip("the tier picks kvikio only where a CUDA driver loads (TestKvikio)")

    async def test_tier_round_trip(self) -> None:  # type: ignore[override]
        pytest.skip("covered below through row_io_wrapper")


def test_a_read_across_the_end_of_the_file_is_short(kvikio: _StandInKvikio, tmp_path) -> None:
    io = KvikioRowIO(direct=True)
    h = io.open(tmp_path / "f", create=True)
    try:
        io.allocate(h, 3 * 4096)
        out = memoryview(bytearray(os.urandom(3 * 4096)))
        back = [memoryview(bytearray(2 * 4096)), memoryview(bytearray(2 * 4096))]
        io.direct = False  # bytearrays are not page aligned; the cut is what is tested
        assert io.pwritev(h, [out], 0) == 3 * 4096
        assert io.preadv(h, back, 0) == 3 * 4096  # the second buffer is cut at the end
        assert bytes(back[0]) + bytes(back[1][:4096]) == bytes(out)
        calls = kvikio.pread_calls
        assert io.preadv(h, back, 3 * 4096) == 0  # wholly past the end: no kvikio call
        assert kvikio.pread_calls == calls
    finally:
        io.close(h)


@pytest.mark.parametrize(
    ("code", "expected"),
    [(errno.ENOSPC, errno.ENOSPC), (errno.EIO, errno.EIO), (errno.EPERM, errno.EIO)],
)
def test_kvikio_errors_become_oserrors_with_their_errno(
    kvikio: _StandInKvikio, tmp_path, code: int, expected: int
) -> None:
    io = KvikioRowIO(direct=False)
    h = io.open(tmp_path / "f", create=True)
    try:
        kvikio.fail_writes = code
        with pytest.raises(OSError) as info:
            io.pwritev(h, [memoryview(bytearray(4096))], 0)
        assert info.value.errno == expected  # EPERM is not one it maps: EIO
        assert isinstance(info.value.__cause__, RuntimeError)
    finally:
        io.close(h)


@pytest.mark.parametrize("api", ["old", "new"])
def test_kvikio_thread_pool_is_raised_to_io_threads_never_lowered(
    monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    module = _StandInKvikio(api)
    monkeypatch.setitem(sys.modules, "kvikio", module)
    KvikioRowIO(threads=4)
    assert module.threads["num_threads"] == 4  # from kvikio's default of 1
    module.threads["num_threads"] = 16  # the process chose more
    KvikioRowIO(threads=4)
    assert module.threads["num_threads"] == 16


async def test_tier_over_kvikio_round_trips_and_fails_only_the_enospc_row(
    kvikio: _StandInKvikio, tmp_path, slots
) -> None:
    tier = NVMeTier(
        **tier_kwargs(
            tmp_path / "nvme",
            direct_io="on",
            request_nbytes=GROUP_NBYTES[0],  # one row per request
            row_io_wrapper=lambda inner: KvikioRowIO(direct=inner.direct, threads=2),
        )
    )
    await tier.open()
    try:
        buf, out = slots(4), slots(4)
        rows = [(key(i, 0), 0, 4, buf.fill(i, payload(key(i, 0), 9000))) for i in range(4)]
        assert await tier.write_rows(rows[:3]) == [None] * 3
        kvikio.fail_writes = errno.ENOSPC
        (err,) = await tier.write_rows(rows[3:])
        assert err is not None
        assert err.kind == "enospc"
        await tier.flush()
        assert set(tier.keys()) == {key(i, 0) for i in range(3)}
        got = await tier.read_rows([(key(i, 0), out[i]) for i in range(3)])
        assert got == [(0, 4)] * 3
        for i in range(3):
            assert bytes(out[i][:9000]) == bytes(buf[i][:9000])
        assert tier.stats()["failures_enospc"] == 1
    finally:
        await tier.close()
