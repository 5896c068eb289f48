"""NVMeTier: round trips, coalescing, overwrite, capacity/LRU, layout changes, config errors."""

from __future__ import annotations

import math
import os
import pathlib

import pytest

from kvtier.errors import (
    AlignmentError,
    ConfigError,
    DuplicateKeyError,
    EngineClosedError,
    NamespaceLockedError,
    StorageError,
    UnknownGroupError,
)
from kvtier.io import NVMeTier

from .conftest import GROUP_NBYTES, key, payload, tier_kwargs
from .faults import CountingRowIO


async def test_round_trip_three_groups_partial_ranges(open_tier, slots) -> None:
    tier = await open_tier()
    assert tier.directory.name.startswith("test_rank0-")
    src, dst = slots(9, 8 * 4096), slots(9, 8 * 4096)
    rows, expect = [], {}
    ranges = [(0, 4), (1, 3), (2, 4)]
    for i in range(9):
        g = i % 3
        k = key(i, g)
        data = payload(k, GROUP_NBYTES[g])
        rows.append((k, *ranges[i % 3], src.fill(i, data)))
        expect[k] = (data, ranges[i % 3])
    results = await tier.write_rows(rows)
    assert results == [None] * 9
    assert sorted(tier.keys(), key=repr) == sorted(expect, key=repr)
    got = await tier.read_rows([(k, dst[i]) for i, k in enumerate(expect)])
    for i, (k, (data, rng)) in enumerate(expect.items()):
        assert got[i] == rng
        assert tier.stored_range(k) == rng
        assert bytes(dst[i][: len(data)]) == data
    st = tier.stats()
    assert st["rows_resident"] == 9
    assert st["write_bytes"] == sum(tier.row_nbytes(k.group_id) for k in expect)
    assert st["read_bytes"] == st["write_bytes"]
    assert st["backend"] == "posix"


async def test_row_sizes_per_group(open_tier) -> None:
    tier = await open_tier()
    assert tier.payload_region_nbytes(0) == 4 * 4096
    assert tier.row_nbytes(0) == 5 * 4096
    assert tier.row_nbytes(1) == 2 * 4096
    assert tier.row_nbytes(2) == 4 * 4096
    with pytest.raises(UnknownGroupError):
        tier.row_nbytes(7)


@pytest.mark.parametrize(("n", "request_rows"), [(10, 2), (7, 3), (5, 8)])
async def test_write_and_read_are_coalesced(open_tier, slots, n, request_rows) -> None:
    counter: list[CountingRowIO] = []

    def wrap(inner):
        counter.append(CountingRowIO(inner))
        return counter[0]

    row = 5 * 4096  # group 0
    tier = await open_tier(
        row_io_wrapper=wrap, request_nbytes=request_rows * row, segment_nbytes=4096 + 32 * row
    )
    io = counter[0]
    buf = slots(n, row)
    rows = [(key(i), 0, 4, buf.fill(i, payload(key(i), GROUP_NBYTES[0]))) for i in range(n)]
    io.reset()
    assert await tier.write_rows(rows) == [None] * n
    row_writes = [c for c in io.pwritev_calls if c[0] != 0]  # offset 0: the segment header
    assert len(row_writes) == math.ceil(n * row / (request_rows * row))
    assert sum(nb for _, nb in row_writes) == n * row
    io.reset()
    out = slots(n, row)
    got = await tier.read_rows([(key(i), out[i]) for i in reversed(range(n))])
    assert all(isinstance(r, tuple) for r in got)
    assert len(io.preadv_calls) == math.ceil(n / request_rows)
    assert tier.stats()["write_requests"] == math.ceil(n / request_rows)


async def test_overwrite_new_seq_wins_and_old_row_is_freed(open_tier, slots, tmp_path) -> None:
    tier = await open_tier()
    buf = slots(2)
    k = key(1, 1)
    await tier.write_rows([(k, 0, 2, buf.fill(0, payload(k, 4096, salt=1)))])
    await tier.write_rows([(k, 1, 4, buf.fill(1, payload(k, 4096, salt=2)))])
    assert tier.stats()["rows_resident"] == 1
    assert tier.stored_range(k) == (1, 4)
    await tier.close()
    # both rows are on disk with valid trailers; after a restart the higher seq wins
    tier2 = await open_tier()
    assert tier2.stored_range(k) == (1, 4)
    out = slots(1)
    assert await tier2.read_rows([(k, out[0])]) == [(1, 4)]
    assert bytes(out[0][:4096]) == payload(k, 4096, salt=2)


async def test_capacity_evicts_least_recently_used(open_tier, slots) -> None:
    row = 2 * 4096  # group 1
    tier = await open_tier(capacity_bytes=4 * row, segment_nbytes=4096 + 2 * row, grow_ahead=False)
    buf, out = slots(6), slots(1)
    for i in range(4):
        assert await tier.write_rows(
            [(key(i, 1), 0, 4, buf.fill(i, payload(key(i, 1), 4096)))]
        ) == [None]
    assert tier.stats()["bytes_used"] == 4 * row
    assert tier.stats()["segments"] == 2
    assert await tier.read_rows([(key(0, 1), out[0])]) == [(0, 4)]  # 0 becomes MRU
    assert await tier.write_rows([(key(4, 1), 0, 4, buf.fill(4, payload(key(4, 1), 4096)))]) == [
        None
    ]
    assert not tier.contains(key(1, 1))  # the LRU one went
    assert tier.contains(key(0, 1))
    assert tier.stats()["evictions"] == 1
    assert tier.stats()["bytes_used"] <= 4 * row
    # keys of one call never evict each other: 5 rows don't fit into 4
    rows = [(key(10 + i, 1), 0, 4, buf.fill(i, payload(key(10 + i, 1), 4096))) for i in range(5)]
    results = await tier.write_rows(rows)
    assert [r is None for r in results].count(True) == 4
    (err,) = [r for r in results if r is not None]
    assert isinstance(err, StorageError)
    assert err.kind == "capacity"
    assert tier.stats()["failures_capacity"] == 1


async def test_capacity_smaller_than_one_row_fails_with_capacity(open_tier, slots) -> None:
    tier = await open_tier(capacity_bytes=4096)
    buf = slots(1)
    (err,) = await tier.write_rows([(key(0), 0, 1, buf[0])])
    assert isinstance(err, StorageError)
    assert err.kind == "capacity"
    assert not tier.contains(key(0))


async def test_discard_and_missing(open_tier, slots) -> None:
    tier = await open_tier()
    buf = slots(2)
    await tier.write_rows([(key(0), 0, 1, buf.fill(0, payload(key(0), GROUP_NBYTES[0])))])
    tier.discard(key(0))
    assert not tier.contains(key(0))
    (err,) = await tier.read_rows([(key(0), buf[1])])
    assert isinstance(err, StorageError)
    assert err.kind == "missing"
    assert tier.stats()["failures_missing"] == 1


async def test_bad_arguments_change_nothing(open_tier, slots) -> None:
    tier = await open_tier()
    buf = slots(2)
    with pytest.raises(DuplicateKeyError):
        await tier.write_rows([(key(0), 0, 1, buf[0]), (key(0), 0, 1, buf[1])])
    with pytest.raises(ValueError, match="sub-blocks"):
        await tier.write_rows([(key(0), 2, 2, buf[0])])
    with pytest.raises(AlignmentError, match="address"):
        await tier.write_rows([(key(0), 0, 1, buf[0][8:])])
    with pytest.raises(ValueError, match="bytes"):
        await tier.write_rows([(key(0), 0, 1, buf[0][:4096])])
    with pytest.raises(UnknownGroupError):
        await tier.read_rows([(key(0, 9), buf[0])])
    assert tier.keys() == []
    assert tier.stats()["bytes_used"] == 0


async def test_layout_changes_get_new_directories(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    base = NVMeTier(**tier_kwargs(root))
    await base.open()
    buf = slots(1)
    await base.write_rows([(key(0), 0, 4, buf.fill(0, payload(key(0), GROUP_NBYTES[0])))])
    await base.close()
    before = {p: p.read_bytes() for p in base.directory.rglob("*") if p.is_file()}
    variants = [
        {"group_nbytes": {**GROUP_NBYTES, 0: GROUP_NBYTES[0] + 4096}},
        {"blocks_per_chunk": 8},
        {"group_nbytes": {**GROUP_NBYTES, 3: 4096}},
        {"namespace": "test/rank1"},
        {"layout_description": {"groups": {"0": {"layers": ["z"]}}}},
    ]
    dirs = {base.directory}
    for over in variants:
        tier = NVMeTier(**tier_kwargs(root, **over))
        assert tier.directory not in dirs
        dirs.add(tier.directory)
        await tier.open()
        assert tier.keys() == []
        await tier.write_rows([(key(0), 0, 4, buf[0])])
        await tier.close()
    # same layout again: same directory, key still there
    same = NVMeTier(**tier_kwargs(root))
    assert same.directory == base.directory
    await same.open()
    assert same.contains(key(0))
    await same.close()
    after = {
        p: p.read_bytes() for p in base.directory.rglob("*") if p.is_file() and p.name != "lock"
    }
    assert after == {p: b for p, b in before.items() if p.name != "lock"}
    fmt = (base.directory / "format.json").read_text()
    assert '"namespace": "test/rank0"' in fmt
    assert base.digest.hex() in fmt


async def test_second_tier_on_same_namespace_is_locked(open_tier, tmp_path) -> None:
    await open_tier()
    other = NVMeTier(**tier_kwargs(tmp_path / "nvme"))
    with pytest.raises(NamespaceLockedError):
        await other.open()
    with pytest.raises(EngineClosedError):
        await other.write_rows([])


async def test_root_is_a_file(tmp_path) -> None:
    root = tmp_path / "file"
    root.write_bytes(b"x")
    tier = NVMeTier(**tier_kwargs(root))
    with pytest.raises(ConfigError, match="not a directory"):
        await tier.open()
    await tier.close()
    tier = NVMeTier(**tier_kwargs(root / "below"))
    with pytest.raises(ConfigError):
        await tier.open()


async def test_root_not_writable(tmp_path) -> None:
    if os.geteuid() == 0:
        root = pathlib.Path("/proc/kvtier-not-writable")  # procfs refuses mkdir even for root
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        root = ro / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    with pytest.raises(ConfigError, match=r"cannot create|not writable"):
        await tier.open()


@pytest.mark.parametrize(
    "over",
    [
        {"capacity_bytes": 0},
        {"blocks_per_chunk": 0},
        {"group_nbytes": {}},
        {"group_nbytes": {0: 0}},
        {"io_backend": "spdk"},
        {"direct_io": "maybe"},
        {"request_nbytes": 100},
        {"io_threads": 0},
        {"eviction_window": 0},
        {"eviction_window": True},
    ],
)
def test_bad_config(tmp_path, over) -> None:
    with pytest.raises(ConfigError):
        NVMeTier(**tier_kwargs(tmp_path, **over))


def _odirect_unsupported_dir() -> str | None:
    from kvtier.io._rowio import probe_direct_io

    for d in ("/dev/shm", "/run", "/tmp"):
        if os.path.isdir(d) and os.access(d, os.W_OK):
            try:
                if not probe_direct_io(d):
                    return d
            except OSError:
                continue
    return None


async def test_direct_io_on_without_odirect_is_config_error(tmp_path) -> None:
    d = _odirect_unsupported_dir()
    if d is None:
        pytest.skip("every candidate filesystem (tmpfs included) supports O_DIRECT here")
    root = pathlib.Path(d) / f"kvtier-test-{os.getpid()}"
    tier = NVMeTier(**tier_kwargs(root, direct_io="on"))
    try:
        with pytest.raises(ConfigError, match="O_DIRECT"):
            await tier.open()
        fallback = NVMeTier(**tier_kwargs(root, direct_io="auto"))
        await fallback.open()
        assert fallback.stats()["direct_io"] is False
        assert fallback.stats()["direct_io_fallback"] == 1
        await fallback.close()
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


async def test_direct_io_on_here(open_tier) -> None:
    tier = await open_tier(direct_io="on")
    st = tier.stats()
    assert st["direct_io"] is True
    assert st["direct_io_fallback"] == 0
    tier2 = await open_tier(direct_io="off", namespace="other")
    assert tier2.stats()["direct_io"] is False
    assert tier2.stats()["direct_io_fallback"] == 0


async def test_close_is_idempotent_and_flush_durable(open_tier, slots) -> None:
    tier = await open_tier()
    buf = slots(1)
    await tier.write_rows([(key(0), 0, 4, buf.fill(0, payload(key(0), GROUP_NBYTES[0])))])
    await tier.flush()
    await tier.flush()
    await tier.close()
    await tier.close()
    with pytest.raises(EngineClosedError):
        await tier.read_rows([(key(0), buf[0])])


async def test_growth_ahead_creates_first_segments_at_open_and_stays_ahead(
    open_tier, slots
) -> None:
    capacity, segment = 64 << 20, 1 << 20
    tier = await open_tier(capacity_bytes=capacity, segment_nbytes=segment)
    await tier.drain()
    step = min(segment - 4096, 128 << 20, capacity // (4 * len(GROUP_NBYTES)))
    rows = {g: tier.row_nbytes(g) for g in GROUP_NBYTES}
    step_rows = {g: step // r for g, r in rows.items()}
    stats = tier.stats()
    assert stats["segments"] == len(GROUP_NBYTES)  # before any write
    assert stats["rows_resident"] == 0
    assert stats["bytes_allocated"] == sum(step_rows[g] * rows[g] for g in GROUP_NBYTES)
    # Use group 1 down to half a step of free rows: it grows one step ahead.
    n = step_rows[1] - step_rows[1] // 2
    buf = slots(8)
    for start in range(0, n, 8):
        batch = [
            (key(i, 1), 0, 4, buf.fill(i - start, payload(key(i, 1), 4096, salt=i)))
            for i in range(start, min(n, start + 8))
        ]
        assert await tier.write_rows(batch) == [None] * len(batch)
    await tier.drain()
    stats = tier.stats()
    assert stats["bytes_allocated"] == sum(step_rows[g] * rows[g] for g in GROUP_NBYTES) + (
        step_rows[1] * rows[1]
    )
    assert stats["bytes_allocated"] <= capacity + sum(step_rows[g] * rows[g] for g in rows)
    assert stats["rows_resident"] == n
    out = slots(1)
    assert await tier.read_rows([(key(n - 1, 1), out[0])]) == [(0, 4)]
    assert bytes(out[0][:4096]) == payload(key(n - 1, 1), 4096, salt=n - 1)
