"""RowIO conformance suite: every backend must pass (zarr StoreTests style)."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from kvtier.io import AioRowIO, KvikioRowIO, PosixRowIO, RowIO
from kvtier.io._aio import aio_supported
from kvtier.io._rowio import kvikio_available

from .rowio_conformance import RowIOConformance


class TestPosixDirect(RowIOConformance):
    tier_options: ClassVar[dict[str, Any]] = {"io_backend": "posix", "direct_io": "on"}

    def make(self) -> RowIO:
        return PosixRowIO(direct=True)


class TestPosixBuffered(RowIOConformance):
    tier_options: ClassVar[dict[str, Any]] = {"io_backend": "posix", "direct_io": "off"}

    def make(self) -> RowIO:
        return PosixRowIO(direct=False)


class TestAio(RowIOConformance):
    """The blocking methods of the ``aio`` backend (its queued ones: test_aio.py)."""

    tier_options: ClassVar[dict[str, Any]] = {"io_backend": "aio", "direct_io": "on"}

    def make(self) -> RowIO:
        if not aio_supported():
            pytest.skip("no Linux AIO context here")
        return AioRowIO(depth=4)

    @pytest.fixture
    def row_io(self) -> Iterator[RowIO]:
        io = self.make()
        yield io
        assert isinstance(io, AioRowIO)
        io.shutdown()


@pytest.mark.gpu
class TestKvikio(RowIOConformance):
    tier_options: ClassVar[dict[str, Any]] = {"io_backend": "kvikio", "direct_io": "auto"}

    def make(self) -> RowIO:
        if not kvikio_available():
            pytest.skip("kvikio or a CUDA driver is not available")
        return KvikioRowIO()


def test_buffer_address_matches_numpy_for_every_kind_of_buffer() -> None:
    """Writable views take ctypes' fast path; read-only, empty and tensor buffers the others."""
    import numpy as np

    from kvtier.io._align import buffer_address

    region = mmap.mmap(-1, 1 << 16)
    whole = memoryview(region)
    try:
        base = np.frombuffer(whole, dtype=np.uint8).__array_interface__["data"][0]
        for lo, hi in ((0, 4096), (4096, 12288), (123, 4000)):
            assert buffer_address(whole[lo:hi]) == base + lo  # writable: ctypes
            assert buffer_address(whole[lo:hi].toreadonly()) == base + lo  # Py_buffer
        assert buffer_address(whole[8:8]) == base + 8  # empty: no ctypes object fits
        assert buffer_address(whole.cast("I")[2:]) == base + 8
        data = bytes(64)
        assert buffer_address(data) == np.frombuffer(data, np.uint8).__array_interface__["data"][0]
        t = torch.zeros(16, dtype=torch.uint8)
        assert buffer_address(t) == t.data_ptr()
        with pytest.raises(BufferError):
            buffer_address(whole[::2])  # not contiguous
    finally:
        whole.release()
        region.close()
