"""inspect_root on a real root, and the public names of kvtier.io."""

from __future__ import annotations

import os

import kvtier.io
from kvtier.io import NVMeTier, inspect_root

from .conftest import GROUP_NBYTES, key, payload, tier_kwargs


def test_all_is_sorted_and_complete() -> None:
    assert kvtier.io.__all__ == sorted(kvtier.io.__all__)
    assert set(kvtier.io.__all__) == {
        "FORMAT_VERSION",
        "KvikioRowIO",
        "NVMeTier",
        "PosixRowIO",
        "RowIO",
        "format_digest",
        "inspect_root",
        "select_backend",
    }
    for name in kvtier.io.__all__:
        assert getattr(kvtier.io, name) is not None


async def test_inspect_root_counts_rows(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    buf = slots(5)
    rows = [
        (key(i, i % 2), 0, 4, buf.fill(i, payload(key(i, i % 2), GROUP_NBYTES[i % 2])))
        for i in range(5)
    ]
    assert await tier.write_rows(rows) == [None] * 5
    await tier.close()
    other = NVMeTier(**tier_kwargs(root, blocks_per_chunk=2))
    await other.open()
    await other.close()
    # corrupt the trailer of the first group-0 row
    seg = tier.directory / "g0" / "0.kvrows"
    fd = os.open(seg, os.O_RDWR)
    os.pwrite(fd, b"\xff", 4096 + tier.payload_region_nbytes(0) + 100)
    os.close(fd)
    before = seg.read_bytes()
    info = inspect_root(root)
    assert seg.read_bytes() == before  # read-only
    names = [ns["directory"] for ns in info["namespaces"]]
    assert sorted(names) == sorted([tier.directory.name, other.directory.name])
    ns = next(n for n in info["namespaces"] if n["directory"] == tier.directory.name)
    assert ns["format"]["digest"] == tier.digest.hex()
    assert ns["format"]["namespace"] == "test/rank0"
    assert ns["groups"][0]["valid_rows"] == 2
    assert ns["groups"][0]["invalid_rows"] == 1
    assert ns["groups"][1]["valid_rows"] == 2
    assert ns["groups"][0]["rows"] == (1 << 20) // tier.row_nbytes(0)
    empty = next(n for n in info["namespaces"] if n["directory"] == other.directory.name)
    assert empty["groups"] == {}
