"""KVTierOffloadingManager: vLLM's OffloadingManager semantics over kvtier's slots and rows."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_offload.base import LookupResult, Medium

from tests.vllm.conftest import PAGE, Backend, make_backend

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def _payload(b: Backend, group: int, block: int) -> list[torch.Tensor]:
    """The bytes of ``block`` that a key of ``group`` stores (see conftest.canonical_caches)."""
    t0, t1 = b.tensors
    if group == 0:
        return [t0[block].clone(), t1[block].clone()]
    if group == 1:
        return [t1[block].clone()]
    return [t1[block, : PAGE - 256].clone()]


def test_stored_keys_hit_and_load_their_bytes_into_other_blocks(backend: Backend) -> None:
    b = backend
    keys = [(b.key(i, g), 3 * i + g) for i in range(2) for g in (0, 1, 2)]
    want = {k: _payload(b, g, blk) for (k, blk), g in zip(keys, [0, 1, 2] * 2, strict=True)}
    b.store(keys)
    assert [b.manager.lookup(k, b.ctx) for k, _ in keys] == [HIT] * 6
    for t in b.tensors:
        t.zero_()
    targets = [(k, 40 + i) for i, (k, _) in enumerate(keys)]
    b.load(targets)
    for (k, dst), g in zip(targets, [0, 1, 2] * 2, strict=True):
        got = _payload(b, g, dst)
        assert all(torch.equal(x, y) for x, y in zip(got, want[k], strict=True))


def test_unknown_key_is_a_miss(backend: Backend) -> None:
    assert backend.manager.lookup(backend.key(99), backend.ctx) == MISS


def test_store_in_flight_is_pending_until_complete_store(backend: Backend) -> None:
    b = backend
    k = b.key(1)
    out = b.manager.prepare_store([k], b.ctx)
    assert out is not None
    assert out.keys_to_store == [k]
    assert b.manager.lookup(k, b.ctx) == PENDING
    b.manager.complete_store([k], b.ctx)
    assert b.manager.lookup(k, b.ctx) == HIT


def test_prepare_store_skips_present_keys(backend: Backend) -> None:
    b = backend
    b.store([(b.key(1), 1)])
    out = b.manager.prepare_store([b.key(1), b.key(2)], b.ctx)
    assert out is not None
    assert out.keys_to_store == [b.key(2)]
    assert len(out.store_spec.block_ids) == 1


def test_prepare_store_reports_evictions_and_never_evicts_keys_of_its_call() -> None:
    b = make_backend(4)
    try:
        b.store([(b.key(i), i) for i in range(4)])  # full: LRU order 3, 2, 1, 0 (key 0 newest)
        out = b.manager.prepare_store([b.key(3), b.key(2), b.key(10), b.key(11)], b.ctx)
        assert out is not None
        assert out.keys_to_store == [b.key(10), b.key(11)]
        assert sorted(out.evicted_keys) == sorted([b.key(0), b.key(1)])
        assert b.manager.lookup(b.key(3), b.ctx) == HIT
        assert b.manager.lookup(b.key(2), b.ctx) == HIT
        assert b.manager.lookup(b.key(0), b.ctx) == MISS
    finally:
        b.close()


def test_prepare_load_pins_until_complete_load() -> None:
    b = make_backend(2)
    try:
        b.store([(b.key(1), 1), (b.key(2), 2)])
        b.manager.prepare_load([b.key(1), b.key(2)], b.ctx)
        assert b.manager.prepare_store([b.key(3)], b.ctx) is None  # nothing evictable
        assert b.manager.lookup(b.key(1), b.ctx) == HIT
        b.manager.complete_load([b.key(1), b.key(2)], b.ctx)
        out = b.manager.prepare_store([b.key(3)], b.ctx)
        assert out is not None
        assert len(out.evicted_keys) == 1
    finally:
        b.close()


def test_failed_store_frees_its_slots() -> None:
    b = make_backend(2)
    try:
        out = b.manager.prepare_store([b.key(1), b.key(2)], b.ctx)
        assert out is not None
        assert len(out.keys_to_store) == 2
        b.manager.complete_store([b.key(1), b.key(2)], b.ctx, success=False)
        assert b.manager.lookup(b.key(1), b.ctx) == MISS
        out = b.manager.prepare_store([b.key(3), b.key(4)], b.ctx)
        assert out is not None
        assert out.evicted_keys == []
        assert len(out.keys_to_store) == 2
    finally:
        b.close()


def test_n_slots_hold_n_keys_of_any_group_mix() -> None:
    n = 9
    b = make_backend(n)
    try:
        assert b.manager.num_slots == n
        keys = [(b.key(i, i % 3), i) for i in range(n)]
        out = b.store(keys)
        assert out.evicted_keys == []
        assert [b.manager.lookup(k, b.ctx) for k, _ in keys] == [HIT] * n
        assert b.manager.prepare_store([b.key(100, 2)], b.ctx).evicted_keys != []  # full at n
    finally:
        b.close()


def test_events_report_stores_and_evictions() -> None:
    b = make_backend(1)
    try:
        b.store([(b.key(1), 1)])
        b.store([(b.key(2), 2)])
        events = list(b.manager.take_events())
        assert [(e.keys, e.removed, e.medium) for e in events] == [
            ([b.key(1)], False, Medium.CPU),
            ([b.key(1)], True, Medium.CPU),
            ([b.key(2)], False, Medium.CPU),
        ]
        assert list(b.manager.take_events()) == []
    finally:
        b.close()


def test_reset_cache_empties_the_cpu_tier(backend: Backend) -> None:
    b = backend
    b.store([(b.key(1), 1)])
    b.manager.reset_cache()
    assert b.manager.lookup(b.key(1), b.ctx) == MISS
    assert list(b.manager.resident()) == []


def test_reset_cache_keeps_nvme_rows_and_promotes_them(tmp_path: pathlib.Path) -> None:
    b = make_backend(8, str(tmp_path))
    try:
        want = _payload(b, 1, 5)
        b.store([(b.key(1, 1), 5)])
        assert b.until(b.key(1, 1), HIT) == HIT
        _wait_written(b)
        b.manager.reset_cache()
        assert b.manager.lookup(b.key(1, 1), b.ctx) == PENDING
        assert b.manager.has_pending_work()
        assert b.until(b.key(1, 1), HIT) == HIT
        b.tensors[1].zero_()
        b.load([(b.key(1, 1), 7)])
        assert torch.equal(_payload(b, 1, 7)[0], want[0])
        hits = b.manager.get_stats().data["data"]["vllm:kvtier_offload_hits"]
        assert hits == {("nvme",): 1}
    finally:
        b.close()


def _wait_written(b: Backend) -> None:
    nvme = b.manager._nvme
    assert nvme is not None
    import time

    deadline = time.monotonic() + 30
    while b.manager._io_pinned and time.monotonic() < deadline:
        b.manager.lookup(b.key(0), b.ctx)  # collects finished writes
        time.sleep(0.005)
    assert not b.manager._io_pinned


def test_restart_serves_keys_from_nvme_rows(tmp_path: pathlib.Path) -> None:
    b = make_backend(8, str(tmp_path))
    keys = [(b.key(i, g), 3 * i + g) for i in range(2) for g in (0, 1, 2)]
    want = {k: _payload(b, g, blk) for (k, blk), g in zip(keys, [0, 1, 2] * 2, strict=True)}
    b.store(keys)
    b.close()  # flushes the rows
    b = make_backend(8, str(tmp_path), seed=1)  # other GPU contents: nothing to reuse but rows
    try:
        assert [b.manager.lookup(k, b.ctx) for k, _ in keys] == [PENDING] * 6
        assert [b.until(k, HIT) for k, _ in keys] == [HIT] * 6
        targets = [(k, 50 + i) for i, (k, _) in enumerate(keys)]
        b.load(targets)
        for (k, dst), g in zip(targets, [0, 1, 2] * 2, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(_payload(b, g, dst), want[k], strict=True))
    finally:
        b.close()


def test_corrupt_row_is_a_miss_and_counted(tmp_path: pathlib.Path) -> None:
    b = make_backend(8, str(tmp_path))
    keys = [(b.key(i, 1), i) for i in range(3)]
    b.store(keys)
    b.close()
    (segment,) = tmp_path.glob("*/g1/*.kvrows")
    with open(segment, "r+b") as f:  # one payload byte of the first row
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    b = make_backend(8, str(tmp_path))
    try:
        assert [b.manager.lookup(k, b.ctx) for k, _ in keys] == [PENDING] * 3
        final = [b.until(k, HIT, timeout_s=10) for k, _ in keys]
        assert sorted(final, key=lambda r: r.value) == [MISS, HIT, HIT]
        assert b.manager.lookup(keys[final.index(MISS)][0], b.ctx) == MISS  # stays a miss
        stats = b.manager.get_stats().data["data"]
        assert stats["vllm:kvtier_offload_nvme_failures"] == {(): 1}
    finally:
        b.close()


def test_a_promotion_never_evicts_keys_looked_up_in_the_same_step(tmp_path: pathlib.Path) -> None:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    b = make_backend(2, str(tmp_path))
    b.store([(b.key(1), 1)])
    b.close()  # key 1 now only on NVMe for the next start
    b = make_backend(2, str(tmp_path))
    try:
        b.store([(b.key(2), 2), (b.key(3), 3)])  # the two slots are full
        _wait_written(b)  # their write-through no longer pins them
        assert b.manager.lookup(b.key(2), b.ctx) == HIT
        assert b.manager.lookup(b.key(3), b.ctx) == HIT
        assert b.manager.lookup(b.key(1), b.ctx) == MISS  # both slots were looked up
        b.manager.on_schedule_end(ScheduleEndContext((), ()))
        assert b.manager.lookup(b.key(1), b.ctx) == PENDING  # now it may evict one
        assert b.until(b.key(1), HIT) == HIT
    finally:
        b.close()
