"""The RowIO conformance tests: a base class that each backend's test class subclasses."""

from __future__ import annotations

import mmap
import os
import pathlib
from typing import Any, ClassVar

import pytest

from kvtier.errors import AlignmentError, StorageError
from kvtier.io import NVMeTier, RowIO

from .conftest import GROUP_NBYTES, key, payload, tier_kwargs
from .faults import Fault, FaultyRowIO


def _aligned(nbytes: int, fill: int | None = None) -> memoryview:
    mm = mmap.mmap(-1, nbytes)
    if fill is not None:
        mm.write(bytes((fill + i) & 0xFF for i in range(256)) * (nbytes // 256))
    return memoryview(mm)


class RowIOConformance:
    """Base class: subclasses set ``tier_options`` and implement :meth:`make`."""

    tier_options: ClassVar[dict[str, Any]] = {}

    def make(self) -> RowIO:
        raise NotImplementedError

    @pytest.fixture
    def row_io(self) -> RowIO:
        return self.make()

    def test_protocol(self, row_io: RowIO) -> None:
        assert isinstance(row_io, RowIO)
        assert isinstance(row_io.name, str)
        assert isinstance(row_io.direct, bool)

    def test_round_trip_multiple_iovecs(self, row_io: RowIO, tmp_path: pathlib.Path) -> None:
        h = row_io.open(tmp_path / "f", create=True)
        try:
            row_io.allocate(h, 64 * 1024)
            assert os.path.getsize(tmp_path / "f") >= 64 * 1024
            out = [_aligned(4096, 1), _aligned(3 * 4096, 7), _aligned(2 * 4096, 99)]
            assert row_io.pwritev(h, out, 8192) == 6 * 4096
            back = [_aligned(2 * 4096), _aligned(4 * 4096)]
            assert row_io.preadv(h, back, 8192) == 6 * 4096
            assert b"".join(bytes(b) for b in back) == b"".join(bytes(b) for b in out)
            row_io.fdatasync(h)
            # reading past the end is a short count, never an exception
            tail = [_aligned(4096)]
            assert row_io.preadv(h, tail, 128 * 1024) == 0
        finally:
            row_io.close(h)

    def test_allocate_never_shrinks(self, row_io: RowIO, tmp_path: pathlib.Path) -> None:
        h = row_io.open(tmp_path / "f", create=True)
        try:
            row_io.allocate(h, 5 * 4096)
            row_io.allocate(h, 4096)
            assert os.path.getsize(tmp_path / "f") == 5 * 4096
        finally:
            row_io.close(h)

    def test_open_missing_without_create(self, row_io: RowIO, tmp_path: pathlib.Path) -> None:
        with pytest.raises(FileNotFoundError):
            row_io.open(tmp_path / "missing", create=False)

    @pytest.mark.parametrize(
        ("what", "buf_offset", "nbytes", "file_offset"),
        [("address", 512, 4096, 0), ("length", 0, 4096 + 512, 0), ("offset", 0, 4096, 512)],
    )
    def test_misaligned_direct_requests(
        self, row_io: RowIO, tmp_path: pathlib.Path, what, buf_offset, nbytes, file_offset
    ) -> None:
        if not row_io.direct:
            pytest.skip("buffered backend: no alignment rule")
        h = row_io.open(tmp_path / "f", create=True)
        try:
            row_io.allocate(h, 64 * 1024)
            buf = _aligned(4 * 4096)[buf_offset : buf_offset + nbytes]
            for op in (row_io.pwritev, row_io.preadv):
                with pytest.raises(AlignmentError, match=what):
                    op(h, [_aligned(4096), buf], file_offset)
        finally:
            row_io.close(h)

    @pytest.mark.parametrize("op", ["pwritev", "preadv"])
    async def test_tier_detects_short_io(self, tmp_path, slots, op) -> None:
        faulty: list[FaultyRowIO] = []

        def wrap(inner: RowIO) -> RowIO:
            faulty.append(FaultyRowIO(inner))
            return faulty[0]

        kw = tier_kwargs(tmp_path / "nvme", row_io_wrapper=wrap, **self.tier_options)
        tier = NVMeTier(**kw)
        await tier.open()
        try:
            buf = slots(3)
            rows = [(key(i), 0, 4, buf.fill(i, payload(key(i), GROUP_NBYTES[0]))) for i in range(3)]
            row = tier.row_nbytes(0)
            if op == "pwritev":
                # the one request of 3 rows writes only 1.4 rows: row 0 ok, rows 1, 2 fail
                faulty[0].faults.append(
                    Fault("pwritev", "short", lambda o, off, n: off > 0, keep=row + 2 * 4096)
                )
                results = await tier.write_rows(rows)
                assert results[0] is None
                for r in results[1:]:
                    assert isinstance(r, StorageError)
                    assert r.kind == "short_write"
                assert tier.keys() == [key(0)]
                assert tier.stats()["failures_short_write"] == 2
            else:
                assert await tier.write_rows(rows) == [None] * 3
                # the 3-row read returns 1.4 rows, and the row-by-row retry of
                # rows 1 and 2 returns one page of each: both fail short_read
                first: list[int] = []

                def coalesced(o: str, off: int, n: int) -> bool:
                    first.append(off)
                    return n == 3 * row

                faulty[0].faults += [
                    Fault("preadv", "short", coalesced, keep=row + 4096, times=1),
                    Fault("preadv", "short", lambda o, off, n: off > first[0], keep=4096),
                ]
                out = slots(3)
                results = await tier.read_rows([(key(i), out[i]) for i in range(3)])
                assert results[0] == (0, 4)
                assert [getattr(r, "kind", None) for r in results[1:]] == ["short_read"] * 2
                assert tier.keys() == [key(0)]
                assert tier.stats()["failures_short_read"] == 2
        finally:
            await tier.close()

    async def test_tier_round_trip(self, tmp_path, slots) -> None:
        tier = NVMeTier(**tier_kwargs(tmp_path / "nvme", **self.tier_options))
        await tier.open()
        try:
            buf, out = slots(4), slots(4)
            rows = [
                (key(i, i % 3), 0, 4, buf.fill(i, payload(key(i, i % 3), 9000))) for i in range(4)
            ]
            assert await tier.write_rows(rows) == [None] * 4
            await tier.flush()
            got = await tier.read_rows([(key(i, i % 3), out[i]) for i in range(4)])
            assert got == [(0, 4)] * 4
            for i in range(4):
                n = min(9000, GROUP_NBYTES[i % 3])
                assert bytes(out[i][:n]) == bytes(buf[i][:n])
        finally:
            await tier.close()
