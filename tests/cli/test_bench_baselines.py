"""The bench's raw baselines: the bytes they move, and the checksummed variants' hashing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.bench import BenchConfig, baselines
from kvtier.bench.baselines import _Baselines
from kvtier.io._aio import aio_supported

REQ = 1 << 20


@pytest.mark.parametrize("backend", ["posix", "aio"])
def test_checksummed_raw_baselines_hash_every_request_and_move_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    if backend == "aio" and not aio_supported():
        pytest.skip("no Linux AIO context here")
    cfg = BenchConfig(io_backend=backend, request_nbytes=REQ, io_threads=2)
    total = 5 * REQ + 3 * 4096  # the last request is a short one
    base = _Baselines(cfg, str(tmp_path), total, 64 << 10, 4)
    try:
        data = torch.randint(0, 256, (total,), dtype=torch.uint8)
        base.buf.tensor[:total] = data
        hashed: list[tuple[int, int]] = []  # (checksum, nbytes) of every hashed request
        real = baselines.payload_checksum

        def counting(view: memoryview) -> int:
            value = real(view)
            hashed.append((value, view.nbytes))
            return value

        monkeypatch.setattr(baselines, "payload_checksum", counting)
        sizes = sorted([REQ] * 5 + [3 * 4096])
        expected = sorted(
            (real(memoryview(data.numpy())[off : off + n]), n)
            for off, n in zip(range(0, total, REQ), [REQ] * 5 + [3 * 4096], strict=True)
        )

        assert base.raw_write(checksum=True) > 0
        assert sorted(n for _, n in hashed) == sizes
        assert sorted(hashed) == expected  # each request's own bytes, before they went out
        on_disk = (tmp_path / "raw.bin").read_bytes()
        assert on_disk[:total] == data.numpy().tobytes()

        hashed.clear()
        base.buf.tensor[:total] = 0
        assert base.raw_read(checksum=True) > 0
        assert torch.equal(base.buf.tensor[:total], data)
        assert sorted(hashed) == expected  # hashed after the bytes landed

        hashed.clear()
        assert base.raw_write() > 0
        assert base.raw_read() > 0
        assert hashed == []  # the plain baselines hash nothing
    finally:
        base.close()
