"""Faults through real seams: a RowIO wrapper (via NVMeConfig.row_io_wrapper) and real files.

For every fault: the failing keys are reported (``LoadResult.failed``, the
error of ``flush()``, ``failures_<kind>`` in ``stats().nvme``), no wrong byte
reaches the "GPU" (a failed key's blocks keep the scribble), the other keys
succeed, and later stores and loads of healthy keys work, also after a reopen.
"""

from __future__ import annotations

import asyncio
import errno
import os
import pathlib

import pytest

import kvtier
from kvtier import errors
from kvtier.io._format import decode_trailer

from ._faultio import KeyFault, Wrapper
from ._model import BPC, Gpu, chunks, engine_config, load_check, nvme_config, store_ok

KINDS = ("eio", "enospc", "einval", "short_read", "short_write", "checksum", "trailer")


def _row_nbytes(gpu: Gpu, group_id: int) -> int:
    return -(-gpu.layout.group_nbytes(group_id, BPC) // 4096) * 4096 + 4096


def find_row(gpu: Gpu, root: pathlib.Path, k: kvtier.OffloadKey) -> tuple[pathlib.Path, int]:
    """Segment file and offset of the newest row whose trailer names ``k`` (read from disk)."""
    row = _row_nbytes(gpu, k.group_id)
    best: tuple[int, pathlib.Path, int] | None = None
    for seg in sorted(root.rglob(f"g{k.group_id}/*.kvrows")):
        data = seg.read_bytes()
        for off in range(4096, len(data) - row + 1, row):
            try:
                t = decode_trailer(data[off + row - 4096 : off + row])
            except errors.StorageError:
                continue
            if t.block_hash == k.block_hash and (best is None or t.seq > best[0]):
                best = (t.seq, seg, off)
    assert best is not None, f"no row of {k} on disk"
    return best[1], best[2]


def _failures(engine: kvtier.TransferEngine) -> dict[str, int]:
    nvme = engine.stats().nvme or {}
    return {k: int(nvme.get(f"failures_{k}", 0)) for k in KINDS}


def _only(kind: str, n: int = 1) -> dict[str, int]:
    return {k: n if k == kind else 0 for k in KINDS}


async def _healthy_afterwards(
    engine: kvtier.TransferEngine, gpu: Gpu, tag: str, first_block: int = 40
) -> list[kvtier.Chunk]:
    """New keys store, flush and load bitwise on the same engine."""
    fresh = chunks([f"{tag}-after-{i}" for i in range(4)], first_block=first_block)
    await store_ok(engine, gpu, fresh)
    await engine.flush()
    assert not (await load_check(engine, gpu, fresh)).failed
    return fresh


async def _reopen_all_load(
    gpu: Gpu, cfg: kvtier.EngineConfig, good: list[kvtier.Chunk], gone: list[kvtier.Chunk] = ()
) -> None:
    """In a new engine: the good keys load bitwise, the gone keys are MISS and load nothing."""
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        assert engine.lookup([c.key for c in gone]) == [kvtier.Residency.MISS] * len(gone)
        for i in range(0, len(good), 4):
            res = await load_check(engine, gpu, good[i : i + 4])
            assert not res.failed, res.failed
        if gone:
            res = await load_check(engine, gpu, list(gone))
            assert set(res.failed) == {c.key for c in gone}
            assert all(isinstance(e, errors.KeyNotResidentError) for e in res.failed.values())


# ------------------------------------------------------------------ read faults

READ_FAULTS = {
    "eio": {"action": "errno", "err": errno.EIO},
    "einval": {"action": "errno", "err": errno.EINVAL},
    "short_read": {"action": "short", "keep": 4096},
}


@pytest.mark.parametrize("kind", sorted(READ_FAULTS))
async def test_read_fault_fails_only_its_key(tmp_path: pathlib.Path, kind: str) -> None:
    gpu = Gpu()
    cs = chunks([f"r{i}" for i in range(6)])
    plain = engine_config(gpu, 8, nvme_config(tmp_path, request_nbytes=4096))
    async with kvtier.TransferEngine(gpu.layout, plain) as engine:
        await store_ok(engine, gpu, cs)
        await engine.flush()
    bad = cs[2]
    wrap = Wrapper(KeyFault("read", hashes=frozenset({bad.key.block_hash}), **READ_FAULTS[kind]))
    faulty = engine_config(gpu, 8, nvme_config(tmp_path, request_nbytes=4096, wrapper=wrap))
    async with kvtier.TransferEngine(gpu.layout, faulty) as engine:
        res = await load_check(engine, gpu, cs)
        assert set(res.failed) == {bad.key}
        err = res.failed[bad.key]
        assert isinstance(err, errors.StorageError)
        assert err.kind == kind
        assert len(res.loaded) == 5
        assert _failures(engine) == _only(kind)
        stats = engine.stats()
        assert stats.load_failures == 1
        assert stats.slots_pinned == stats.slots_writing == 0
        assert engine.lookup([bad.key]) == [kvtier.Residency.MISS]
        # the key can be stored again; healthy keys keep working
        await store_ok(engine, gpu, [bad])
        await engine.flush()
        assert not (await load_check(engine, gpu, [bad])).failed
        fresh = await _healthy_afterwards(engine, gpu, kind)
    await _reopen_all_load(gpu, plain, [*cs, *fresh])


async def test_read_eio_of_a_coalesced_request_fails_only_the_row_whose_own_read_fails(
    tmp_path,
) -> None:
    gpu = Gpu()
    cs = chunks([f"co{i}" for i in range(8)])
    plain = engine_config(gpu, 8, nvme_config(tmp_path))
    async with kvtier.TransferEngine(gpu.layout, plain) as engine:
        await store_ok(engine, gpu, cs)
        await engine.flush()
    bad = cs[2]  # group 0: its run holds the other group-0 rows, group 1 is another file
    # the coalesced request fails, then the bad row's own retry; the other rows' retries do not
    wrap = Wrapper(KeyFault("read", "errno", frozenset({bad.key.block_hash}), times=2))
    faulty = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=wrap))
    async with kvtier.TransferEngine(gpu.layout, faulty) as engine:
        res = await load_check(engine, gpu, cs)
        assert set(res.failed) == {bad.key}
        assert res.failed[bad.key].kind == "eio"  # type: ignore[attr-defined]
        assert set(res.loaded) == {c.key for c in cs} - {bad.key}
        assert _failures(engine) == _only("eio", 1)
        assert engine.lookup([bad.key]) == [kvtier.Residency.MISS]
        await _healthy_afterwards(engine, gpu, "co")


# ------------------------------------------------------------------ write faults

WRITE_FAULTS = {
    "eio": {"action": "errno", "err": errno.EIO},
    "enospc": {"action": "errno", "err": errno.ENOSPC},
    "einval": {"action": "errno", "err": errno.EINVAL},
    "short_write": {"action": "short", "keep": 4096},
}


@pytest.mark.parametrize("kind", sorted(WRITE_FAULTS))
async def test_write_fault_fails_only_its_key_and_flush_reports_it(tmp_path, kind) -> None:
    gpu = Gpu()
    cs = chunks([f"w{i}" for i in range(6)])
    bad = cs[3]
    wrap = Wrapper(
        KeyFault("write", hashes=frozenset({bad.key.block_hash}), times=1, **WRITE_FAULTS[kind])
    )
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, request_nbytes=4096, wrapper=wrap))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, cs)
        with pytest.raises(errors.NotDurableError) as info:
            await engine.flush()
        assert set(info.value.failed) == {bad.key}
        assert info.value.kind == kind
        assert isinstance(info.value, errors.StorageError)
        assert _failures(engine) == _only(kind)
        nvme = engine.stats().nvme or {}
        assert nvme["write_failures"] == 1
        assert nvme["rows_written"] == 5
        await engine.flush()  # reported once; nothing new failed
        # the key is still served from its CPU slot; the others went to NVMe
        assert not (await load_check(engine, gpu, cs)).failed
        fresh = await _healthy_afterwards(engine, gpu, kind)
        stats = engine.stats()
        assert stats.slots_pinned == stats.slots_writing == 0
    good = [c for c in cs if c is not bad]
    await _reopen_all_load(gpu, cfg, [*good, *fresh], gone=[bad])


async def test_durable_store_reports_its_failed_rows(tmp_path) -> None:
    gpu = Gpu()
    cs = chunks(["d0", "d1", "d2"])
    bad = cs[1]
    wrap = Wrapper(KeyFault("write", "errno", frozenset({bad.key.block_hash}), times=1))
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, request_nbytes=4096, wrapper=wrap))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        for c in cs:
            gpu.write(c)
        with pytest.raises(errors.NotDurableError) as info:
            await engine.store(cs, durable=True)
        assert set(info.value.failed) == {bad.key}
        assert info.value.result is not None
        assert set(info.value.result.stored) == {c.key for c in cs}
        assert not (await load_check(engine, gpu, cs)).failed  # all three are in CPU slots
        res = await engine.store(chunks(["d3"], first_block=40), durable=True)
        assert len(res.stored) == 1
    await _reopen_all_load(gpu, cfg, [cs[0], cs[2]], gone=[bad])


async def test_short_write_in_a_coalesced_request_keeps_the_rows_before_the_cut(tmp_path) -> None:
    gpu = Gpu()
    cs = chunks([f"sw{i}" for i in range(6)], group_id=0)
    cut = cs[2]  # a call's rows are queued tail first: sw5, sw4, sw3 lie before the cut
    wrap = Wrapper(KeyFault("write", "short", frozenset({cut.key.block_hash}), keep=8192, times=1))
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=wrap))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, cs)
        with pytest.raises(errors.NotDurableError) as info:
            await engine.flush()
        failed = set(info.value.failed)
        assert cut.key in failed
        assert all(e.kind == "short_write" for e in info.value.failed.values())  # type: ignore[attr-defined]
        assert _failures(engine) == _only("short_write", len(failed))
    good = [c for c in cs if c.key not in failed]
    assert len(good) >= 3  # the rows written before the cut
    await _reopen_all_load(gpu, cfg, good, gone=[c for c in cs if c.key in failed])


async def test_segment_growth_enospc_fails_its_rows_then_recovers(tmp_path) -> None:
    gpu = Gpu()
    cs = chunks([f"g{i}" for i in range(6)])
    # Every growth fails until the flush: a step that does not fit is tried again as
    # one row, and once more after another group's growth in flight ends. How many
    # tries that takes depends on how the two groups' growths interleave, so the
    # fault is switched off by hand, not counted out.
    fault = KeyFault("allocate", "errno", err=errno.ENOSPC)
    wrap = Wrapper(fault)
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=wrap, grow_ahead=False))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, cs)
        with pytest.raises(errors.NotDurableError) as info:
            await engine.flush()
        fault.times = fault.hits  # the filesystem has room again
        failed = set(info.value.failed)
        assert failed == {c.key for c in cs}
        assert info.value.kind == "enospc"
        assert fault.hits >= 4  # each group: the step, then one row, at least
        assert _failures(engine) == _only("enospc", len(failed))
        assert not (await load_check(engine, gpu, cs)).failed  # served from CPU
        fresh = await _healthy_afterwards(engine, gpu, "grow")
    good = [c for c in cs if c.key not in failed]
    await _reopen_all_load(gpu, cfg, [*good, *fresh], gone=[c for c in cs if c.key in failed])


async def test_fdatasync_eio_drops_the_unsynced_keys_from_nvme_and_a_durable_store_rewrites_them(
    tmp_path,
) -> None:
    """A failed fdatasync fails the keys written since the last good sync, and only them.

    A retried fdatasync that succeeds proves nothing about them (Linux may
    mark pages clean after a failed writeback and report the error once), so
    they leave NVMe; their CPU copies stay and a durable store writes them again.
    """
    gpu = Gpu()
    wrap = Wrapper()
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=wrap))
    first, second = chunks(["f0", "f1"]), chunks(["f2", "f3"], first_block=16)
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, first)
        await engine.flush()
        wrap.faults.append(KeyFault("fdatasync", "errno", times=1))
        await store_ok(engine, gpu, second)
        with pytest.raises(errors.StorageError) as info:
            await engine.flush()
        assert info.value.kind == "eio"
        assert isinstance(info.value, kvtier.KVTierError)
        assert engine._writer is not None
        tier = engine._writer._tier
        # the keys of the segment whose sync failed (the fault fails one fdatasync)
        dropped = [c for c in second if not tier.contains(c.key)]
        assert dropped
        assert _failures(engine) == _only("eio", len(dropped))  # one per dropped key
        assert all(tier.contains(c.key) for c in first)  # synced before
        assert engine.lookup([c.key for c in dropped]) == [kvtier.Residency.CPU] * len(dropped)
        with pytest.raises(errors.NotDurableError) as named:
            await engine.flush()  # the retried sync succeeds, and names the dropped keys
        assert set(named.value.failed) == {c.key for c in dropped}
        await engine.flush()  # reported once
        assert wrap.faults[0].hits == 1
        assert not (await load_check(engine, gpu, [*first, *second])).failed  # from CPU
        res = await engine.store(second, durable=True)  # written again, synced
        assert set(res.skipped) == {c.key for c in second}
    await _reopen_all_load(gpu, cfg, [*first, *second])


async def test_after_fdatasync_eio_without_a_rewrite_a_restart_finds_no_unsynced_key(
    tmp_path,
) -> None:
    gpu = Gpu()
    wrap = Wrapper()
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=wrap))
    first, second = chunks(["g0", "g1"]), chunks(["g2", "g3"], first_block=16)
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, first)
        await engine.flush()
        wrap.faults.append(KeyFault("fdatasync", "errno", times=1))
        await store_ok(engine, gpu, second)
        with pytest.raises(errors.StorageError):
            await engine.flush()
        assert engine._writer is not None
        dropped = [c for c in second if not engine._writer._tier.contains(c.key)]
        assert dropped
        with pytest.raises(errors.NotDurableError):
            await engine.flush()
    # their rows were blanked at close: MISS, never a row a failed sync left behind
    kept = [c for c in second if c not in dropped]
    await _reopen_all_load(gpu, cfg, [*first, *kept], gone=dropped)


# ------------------------------------------------------------------ torn and corrupted rows


async def test_torn_row_on_a_fresh_row_is_never_loaded(tmp_path) -> None:
    gpu = Gpu()
    cs = chunks([f"t{i}" for i in range(4)])
    torn = cs[1]
    wrap = Wrapper(KeyFault("write", "torn", frozenset({torn.key.block_hash}), times=1))
    cfg = engine_config(gpu, 4, nvme_config(tmp_path, request_nbytes=4096, wrapper=wrap))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, cs)
        await engine.flush()  # the backend lied: the row's trailer was never written
        await store_ok(engine, gpu, chunks([f"t-evict{i}" for i in range(4)], first_block=16))
        await engine.flush()  # unpins the new keys: the next load may evict them
        assert engine.lookup([torn.key]) == [kvtier.Residency.NVME]
        res = await load_check(engine, gpu, cs)
        assert set(res.failed) == {torn.key}
        assert res.failed[torn.key].kind == "trailer"  # type: ignore[attr-defined]
        assert _failures(engine) == _only("trailer")
        await _healthy_afterwards(engine, gpu, "torn")
    await _reopen_all_load(gpu, cfg, [c for c in cs if c is not torn], gone=[torn])


async def test_torn_row_over_a_reused_row_is_never_loaded(tmp_path) -> None:
    gpu = Gpu()
    rows = 6
    old = chunks([f"old{i}" for i in range(rows)], group_id=0)
    new = chunks([f"new{i}" for i in range(rows)], group_id=0, first_block=32)
    torn = new[2]
    wrap = Wrapper()
    nv = nvme_config(
        tmp_path, capacity_bytes=rows * gpu.slot_nbytes, request_nbytes=4096, wrapper=wrap
    )
    cfg = engine_config(gpu, 4, nv)
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        for i in range(0, rows, 2):
            await store_ok(engine, gpu, old[i : i + 2])
            await engine.flush()
        wrap.faults.append(KeyFault("write", "torn", frozenset({torn.key.block_hash}), times=1))
        for i in range(0, rows, 2):  # evicts the old rows and reuses them
            await store_ok(engine, gpu, new[i : i + 2])
            await engine.flush()
        assert wrap.faults[0].hits == 1
        await store_ok(engine, gpu, chunks(["evict-a", "evict-b"], first_block=56))
        await engine.flush()
        for c in new:
            res = await load_check(engine, gpu, [c])
            if c is torn:
                assert res.failed[c.key].kind in ("trailer", "checksum")  # type: ignore[attr-defined]
    # after a restart the old trailer may name an evicted key again: it must never load
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        for c in [*old, *new]:
            res = await load_check(engine, gpu, [c])  # asserts: loaded => bitwise
            if c is torn:
                assert c.key in res.failed
        assert engine.stats().slots_pinned == 0


async def test_corrupted_trailer_under_a_running_engine(tmp_path) -> None:
    gpu = Gpu()
    cs = chunks([f"ct{i}" for i in range(6)])
    cfg = engine_config(gpu, 8, nvme_config(tmp_path))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, cs)
        await engine.flush()
    bad = cs[4]
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        path, off = find_row(gpu, tmp_path, bad.key)
        trailer = off + _row_nbytes(gpu, bad.key.group_id) - 4096
        with open(path, "r+b") as f:  # flip one byte of the key's trailer on disk
            f.seek(trailer + 60)
            b = f.read(1)
            f.seek(trailer + 60)
            f.write(bytes([b[0] ^ 0x40]))
        res = await load_check(engine, gpu, cs)
        assert set(res.failed) == {bad.key}
        assert res.failed[bad.key].kind == "trailer"  # type: ignore[attr-defined]
        assert _failures(engine) == _only("trailer")
        fresh = await _healthy_afterwards(engine, gpu, "ct")
    await _reopen_all_load(gpu, cfg, [*(c for c in cs if c is not bad), *fresh], gone=[bad])


async def test_segment_truncated_under_a_running_engine(tmp_path) -> None:
    gpu = Gpu()
    cs = chunks([f"tr{i}" for i in range(6)], group_id=0)
    cfg = engine_config(gpu, 8, nvme_config(tmp_path))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, cs)
        await engine.flush()
    where = {c.key: find_row(gpu, tmp_path, c.key) for c in cs}
    (path,) = {p for p, _ in where.values()}
    row = _row_nbytes(gpu, 0)
    cut_at = sorted(off for _, off in where.values())[3] + row // 2  # in the middle of a row
    cut = [c for c in cs if where[c.key][1] + row > cut_at]
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        os.truncate(path, cut_at)
        res = await load_check(engine, gpu, cs)
        assert set(res.failed) == {c.key for c in cut}
        assert {e.kind for e in res.failed.values()} == {"short_read"}  # type: ignore[attr-defined]
        assert _failures(engine) == _only("short_read", len(cut))
        assert engine.lookup([c.key for c in cut]) == [kvtier.Residency.MISS] * len(cut)
        # rows past the end are reused by new writes
        again = await _healthy_afterwards(engine, gpu, "trunc")
        await store_ok(engine, gpu, cut)
        await engine.flush()
    await _reopen_all_load(gpu, cfg, [*cs, *again])


# ------------------------------------------------------------------ a full, pinned CPU tier


async def test_every_slot_pinned_by_stalled_writes_rejects_and_never_blocks(tmp_path) -> None:
    gpu = Gpu()
    stall = KeyFault("write", "block")
    cfg = engine_config(gpu, 4, nvme_config(tmp_path, wrapper=Wrapper(stall)))
    cs = chunks([f"p{i}" for i in range(4)])
    nvme_only = chunks(["pn0"], first_block=40)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4, nvme_config(tmp_path))) as e:
        await store_ok(e, gpu, nvme_only)
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        try:
            await store_ok(engine, gpu, cs)  # four slots, each pinned by its stalled NVMe write
            await asyncio.sleep(0.05)
            assert engine.stats().slots_pinned == 4
            extra = chunks(["p-extra"], first_block=48)
            gpu.write(extra[0])
            res = await asyncio.wait_for(engine.store(extra), 5)
            assert res.rejected == (extra[0].key,)
            load = await asyncio.wait_for(load_check(engine, gpu, nvme_only), 5)
            assert set(load.failed) == {nvme_only[0].key}  # no slot to promote into
            assert not (await load_check(engine, gpu, cs)).failed  # pinned keys still load
        finally:
            stall.gate.set()
        await asyncio.wait_for(engine.flush(), 10)
        assert engine.stats().slots_pinned == 0
        await store_ok(engine, gpu, extra)
        assert not (await load_check(engine, gpu, [*extra, *nvme_only])).failed


# ------------------------------------------------------------------ durable stores of present keys


async def test_durable_store_of_a_present_key_waits_for_its_queued_row(tmp_path) -> None:
    gpu = Gpu()
    stall = KeyFault("write", "block")
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, wrapper=Wrapper(stall)))
    cs = chunks(["dp0", "dp1"])
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, cs)  # row writes stalled
        durable = asyncio.ensure_future(engine.store(cs, durable=True))
        await asyncio.sleep(0.2)
        done_early = durable.done()
        stall.gate.set()
        res = await asyncio.wait_for(durable, 10)
        assert not done_early, "store(durable=True) returned before the rows were written"
        assert set(res.skipped) == {c.key for c in cs}
    await _reopen_all_load(gpu, engine_config(gpu, 8, nvme_config(tmp_path)), cs)


async def test_durable_store_of_a_present_key_rewrites_its_failed_row(tmp_path) -> None:
    gpu = Gpu()
    cs = chunks(["dr0", "dr1"])
    bad = cs[0]
    wrap = Wrapper(KeyFault("write", "errno", frozenset({bad.key.block_hash}), times=1))
    cfg = engine_config(gpu, 8, nvme_config(tmp_path, request_nbytes=4096, wrapper=wrap))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, cs)
        with pytest.raises(errors.NotDurableError):
            await engine.flush()  # reported once...
        res = await engine.store(cs, durable=True)  # ...and made durable on request
        assert set(res.skipped) == {c.key for c in cs}
        assert (engine.stats().nvme or {})["rows_written"] == 2
    await _reopen_all_load(gpu, cfg, cs)
