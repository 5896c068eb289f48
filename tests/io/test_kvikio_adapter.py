"""KvikioRowIO's adaptation of kvikio to the RowIO contract, on a host without CUDA.

kvikio needs a CUDA driver even for host buffers, so here the stand-in module
of ``kvikio_standin.py`` plays its part (real ``pread``/``pwrite``, kvikio's
end-of-file and error behaviour, its ``defaults`` APIs). The real kvikio runs
the whole conformance suite (``TestKvikio`` in ``test_rowio.py``) where a GPU
exists.
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
from .kvikio_standin import StandInKvikio, defaults_2502, new_defaults
from .rowio_conformance import RowIOConformance


@pytest.fixture
def kvikio(monkeypatch: pytest.MonkeyPatch) -> StandInKvikio:
    module = StandInKvikio()
    monkeypatch.setitem(sys.modules, "kvikio", module)
    return module


class TestKvikioAdapter(RowIOConformance):
    """The RowIO-level conformance tests, on KvikioRowIO over the stand-in."""

    tier_options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def row_io(self, kvikio: StandInKvikio) -> RowIO:
        return KvikioRowIO(direct=True, threads=2)

    async def test_tier_detects_short_io(self) -> None:  # type: ignore[override]
        pytest.skip("the tier picks kvikio only where a CUDA driver loads (TestKvikio)")

    async def test_tier_round_trip(self) -> None:  # type: ignore[override]
        pytest.skip("covered below through row_io_wrapper")


def test_a_read_across_the_end_of_the_file_is_short(kvikio: StandInKvikio, tmp_path) -> None:
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
        calls = len(kvikio.calls)
        assert io.preadv(h, back, 3 * 4096) == 0  # wholly past the end: no kvikio call
        assert len(kvikio.calls) == calls
    finally:
        io.close(h)


@pytest.mark.parametrize(
    ("code", "expected"),
    [(errno.ENOSPC, errno.ENOSPC), (errno.EIO, errno.EIO), (errno.EPERM, errno.EIO)],
)
def test_kvikio_errors_become_oserrors_with_their_errno(
    kvikio: StandInKvikio, tmp_path, code: int, expected: int
) -> None:
    io = KvikioRowIO(direct=False)
    h = io.open(tmp_path / "f", create=True)
    try:
        kvikio.fail = f"POSIX error on pwrite: {os.strerror(code)}"
        with pytest.raises(OSError) as info:
            io.pwritev(h, [memoryview(bytearray(4096))], 0)
        assert info.value.errno == expected  # EPERM is not one it maps: EIO
        assert isinstance(info.value.__cause__, RuntimeError)
    finally:
        io.close(h)


@pytest.mark.parametrize("make_defaults", [defaults_2502, new_defaults])
def test_kvikio_thread_pool_is_raised_to_io_threads_never_lowered(
    monkeypatch: pytest.MonkeyPatch, make_defaults: Callable[[dict[str, int]], Any]
) -> None:
    threads = {"num_threads": 1}  # kvikio's default
    monkeypatch.setitem(sys.modules, "kvikio", StandInKvikio(make_defaults(threads)))
    KvikioRowIO(threads=4)
    assert threads["num_threads"] == 4
    threads["num_threads"] = 16  # the process chose more
    KvikioRowIO(threads=4)
    assert threads["num_threads"] == 16


def test_kvikio_thread_pool_is_raised_where_defaults_is_a_submodule_not_yet_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # kvikio 26.10 on an H200: ``import kvikio`` leaves ``kvikio.defaults``
    # unset until ``import kvikio.defaults``; the pool stayed at 1 thread.
    threads = {"num_threads": 1}
    module = StandInKvikio(new_defaults(threads))
    defaults = types.ModuleType("kvikio.defaults")
    defaults.get = module.defaults.get  # type: ignore[attr-defined]
    defaults.set = module.defaults.set  # type: ignore[attr-defined]
    del module.defaults
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    KvikioRowIO(threads=4)
    assert threads["num_threads"] == 4


async def test_tier_over_kvikio_round_trips_and_fails_only_the_enospc_row(
    kvikio: StandInKvikio, tmp_path, slots
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
        kvikio.fail = f"POSIX error on pwrite: {os.strerror(errno.ENOSPC)}"
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
