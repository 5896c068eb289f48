"""The NVMe tier: row index, restart, faults through RowIO, concurrency.

Areas:

* The row index: capacity accounting, LRU across groups, rows freed while a
  read of them is in flight (pinned rows, zombies), stale rows and reclaim,
  growth and failed growth.
* Restart: duplicates of a key, truncated segments, foreign headers,
  discarded and evicted keys, unreadable trailers at open.
* Faults injected only through ``row_io_wrapper`` (a real backend underneath)
  or real files.
* Concurrency on one loop: writes, reads, discard, flush and close interleaved.

A test marked ``xfail(strict=True, reason="BUG: ...")`` proves a bug; a comment
headed "Regression" names a bug the tier once had.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import pathlib
import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest

import kvtier
from kvtier.errors import StorageError
from kvtier.io import NVMeTier, RowIO
from kvtier.io._format import TRAILER_NBYTES, decode_trailer, encode_trailer

from ..io.conftest import GROUP_NBYTES, Slots, hashes, key, payload, tier_kwargs
from ..io.faults import DelegatingRowIO
from ._model import Gpu, at_rest, chunks, engine_config, load_check, nvme_config, store_ok
from .gated_io import ROW0, GateIO, Holder, payload_matches, row_writes, until_true


async def _tier(root: pathlib.Path, **over: Any) -> NVMeTier:
    tier = NVMeTier(**tier_kwargs(root, **over))
    await tier.open()
    return tier


def _seg(tier: NVMeTier, group_id: int = 0, n: int = 0) -> pathlib.Path:
    return tier.directory / f"g{group_id}" / f"{n}.kvrows"


# ====================================================================== restart


# Regression: one unreadable trailer at open (EIO) does not make the whole segment
# unusable and lose every other flushed key in it: scan_segment fails that row alone.
async def test_one_unreadable_trailer_at_open_loses_only_that_row(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "nvme"
    tier = await _tier(root)
    buf = Slots(4, 8 * 4096)
    assert await tier.write_rows(row_writes(buf, range(4))) == [None] * 4
    await tier.flush()
    await tier.close()

    def wrap(inner: RowIO) -> RowIO:
        io = GateIO(inner)  # the trailer of row 2 cannot be read at open
        io.scan_read_error_at = 4096 + 2 * ROW0 + (ROW0 - TRAILER_NBYTES)
        return io

    tier3 = await _tier(root, row_io_wrapper=wrap)
    try:
        # rows 0, 1 and 3 were written and flushed: they must survive the bad row
        assert hashes(tier3) == [b"hash-0", b"hash-1", b"hash-3"]
    finally:
        await tier3.close()


# ====================================================================== row index


# Regression: discard() of a key whose write waits for a segment growth (or for
# reclaim) stops the write from publishing it: write_rows registers every write
# before its first await, not with begin_write after the growth.
async def test_discard_while_the_write_waits_for_growth_keeps_the_key_invisible(
    tmp_path: pathlib.Path,
) -> None:
    holder = Holder()
    tier = await _tier(tmp_path / "nvme", row_io_wrapper=holder, grow_ahead=False)
    try:
        assert holder.io is not None
        holder.io.allocate_gate = gate = threading.Event()
        buf = Slots(1, 8 * 4096)
        write = asyncio.ensure_future(tier.write_rows(row_writes(buf, [7])))
        await until_true(holder.io.allocate_entered.is_set, "the growth to start")
        tier.discard(key(7))  # "writes of the key in flight will not make it visible"
        gate.set()
        assert await write == [None]
        assert not tier.contains(key(7))
    finally:
        if holder.io is not None and holder.io.allocate_gate is not None:
            holder.io.allocate_gate.set()
        await tier.close()


# Regression (same cause): with a stale row to blank first, a discard two loop turns
# after the call stops the write from publishing the key (begin_write must not wait
# for reclaim()).
async def test_discard_while_the_write_blanks_stale_rows_keeps_the_key_invisible(
    tmp_path: pathlib.Path,
) -> None:
    tier = await _tier(tmp_path / "nvme")
    try:
        buf = Slots(4, 8 * 4096)
        assert await tier.write_rows(row_writes(buf, range(2))) == [None] * 2
        tier.discard(key(0))  # a stale row: the next write blanks it first
        write = asyncio.ensure_future(tier.write_rows(row_writes(buf, [7])))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        tier.discard(key(7))
        assert await write == [None]
        assert not tier.contains(key(7))
        assert tier.contains(key(1))  # the other key is untouched
    finally:
        await tier.close()


async def test_discard_while_the_row_write_is_in_flight_keeps_the_key_invisible(
    tmp_path: pathlib.Path,
) -> None:
    """Control: a discard after begin_write (the row request itself is in flight) holds."""

    class SlowWrite(GateIO):
        def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
            if sum(memoryview(b).nbytes for b in bufs) > TRAILER_NBYTES:
                self.read_entered.set()
                assert self.read_gate is not None
                self.read_gate.wait(20)
            return super().pwritev(handle, bufs, file_offset)

    made: list[SlowWrite] = []
    tier = await _tier(
        tmp_path / "nvme", row_io_wrapper=lambda inner: made.append(SlowWrite(inner)) or made[0]
    )
    try:
        made[0].read_gate = gate = threading.Event()
        buf = Slots(1, 8 * 4096)
        write = asyncio.ensure_future(tier.write_rows(row_writes(buf, [7])))
        await until_true(made[0].read_entered.is_set, "the row write to start")
        tier.discard(key(7))
        gate.set()
        assert await write == [None]
        assert not tier.contains(key(7))
        st = tier.stats()
        assert st["bytes_used"] == 0
        await tier.close()
        tier2 = await _tier(tmp_path / "nvme")
        assert hashes(tier2) == []  # the row was blanked before close
        await tier2.close()
    finally:
        if made[0].read_gate is not None:
            made[0].read_gate.set()
        await tier.close()


async def test_rows_read_while_dropped_or_replaced_are_never_reused_before_the_read_ends(
    tmp_path: pathlib.Path,
) -> None:
    """Zombies: a dropped or replaced row stays counted and untouched until its read ends."""
    holder = Holder()
    tier = await _tier(tmp_path / "nvme", row_io_wrapper=holder, capacity_bytes=3 * ROW0)
    try:
        io = holder.io
        assert io is not None
        buf = Slots(8, 8 * 4096)
        assert await tier.write_rows(row_writes(buf, [0, 1, 2])) == [None] * 3
        assert tier.stats()["bytes_used"] == 3 * ROW0
        out = Slots(2, 8 * 4096)
        io.read_gate = gate = threading.Event()
        read = asyncio.ensure_future(tier.read_rows([(key(0), out[0]), (key(1), out[1])]))
        await until_true(io.read_entered.is_set, "the read to start")
        tier.discard(key(0))  # zombie
        # key 1 is replaced by a newer row of the same key (old row: zombie)
        new1 = Slots(1, 8 * 4096)
        assert await tier.write_rows(row_writes(new1, [1])) == [None]  # key 2 made room
        assert not tier.contains(key(2))
        assert tier.stats()["bytes_used"] == 3 * ROW0  # two zombies and the new key 1
        # keys 3, 4, 5 replace each other in the one row left; the zombies stay counted
        for i in (3, 4, 5):
            more = Slots(1, 8 * 4096)
            assert await tier.write_rows(row_writes(more, [i])) == [None]
            assert tier.stats()["bytes_used"] == 3 * ROW0
            assert tier.keys() == [key(i)]
        two = Slots(2, 8 * 4096)
        (err, err2) = await tier.write_rows(row_writes(two, [8, 9]))  # no room beyond key 5's row
        assert err is None
        assert isinstance(err2, StorageError)
        assert err2.kind == "capacity"
        gate.set()
        assert await read == [(0, 4), (0, 4)]
        assert payload_matches(out[0], key(0))
        assert payload_matches(out[1], key(1))
        assert not tier.contains(key(0))
        st = tier.stats()
        assert tier.keys() == [key(8)]
        assert st["bytes_used"] == ROW0  # both zombies released on the read's end
        # their rows are reused only now (after blanking)
        assert await tier.write_rows(row_writes(two, [10, 11])) == [None, None]
        assert tier.stats()["bytes_used"] == 3 * ROW0
        # every visible key reads back its own bytes
        ks = tier.keys()
        back = Slots(len(ks), 8 * 4096)
        res = await tier.read_rows([(k, back[i]) for i, k in enumerate(ks)])
        assert res == [(0, 4)] * len(ks)
        assert all(payload_matches(back[i], k) for i, k in enumerate(ks))
    finally:
        if holder.io is not None and holder.io.read_gate is not None:
            holder.io.read_gate.set()
        await tier.close()


# ====================================================================== restart


def _copy_row(path: pathlib.Path, src: int, dst: int, row: int, **change: Any) -> None:
    """Copy row ``src`` of a segment over row ``dst``, rewriting trailer fields (re-sealed)."""
    with open(path, "r+b") as f:
        f.seek(4096 + src * row)
        data = bytearray(f.read(row))
        t = decode_trailer(bytes(data[row - TRAILER_NBYTES :]))
        fields = {
            "digest": t.digest,
            "block_hash": t.block_hash,
            "group_id": t.group_id,
            "start": t.start,
            "stop": t.stop,
            "payload_nbytes": t.payload_nbytes,
            "seq": t.seq,
            "checksum": t.checksum,
        }
        fields.update(change)
        data[row - TRAILER_NBYTES :] = encode_trailer(type(t)(**fields))
        f.seek(4096 + dst * row)
        f.write(data)


async def test_duplicate_rows_of_a_key_highest_seq_wins_and_the_losers_are_blanked(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "nvme"
    tier = await _tier(root)
    buf = Slots(2, 8 * 4096)
    assert await tier.write_rows(row_writes(buf, [0, 1])) == [None, None]
    path = _seg(tier)
    await tier.close()
    # key 0 in rows 0, 2 (seq +100, sub-blocks 1..3) and 3 (seq +50); key 1 in rows 1 and 4
    _copy_row(path, 0, 2, ROW0, seq=100, start=1, stop=3)
    _copy_row(path, 0, 3, ROW0, seq=50)
    _copy_row(path, 1, 4, ROW0)  # same seq twice: either row, same bytes
    tier = await _tier(root)
    try:
        assert hashes(tier) == [b"hash-0", b"hash-1"]
        assert tier.stored_range(key(0)) == (1, 3)
        st = tier.stats()
        assert st["bytes_used"] == 2 * ROW0
        assert st["invalid_rows_at_open"] == 0
        out = Slots(2, 8 * 4096)
        assert await tier.read_rows([(key(0), out[0]), (key(1), out[1])]) == [(1, 3), (0, 4)]
        assert payload_matches(out[0], key(0))
        assert payload_matches(out[1], key(1))
        # a new key's seq is above every seq found: after a restart it is not a loser
        assert await tier.write_rows(row_writes(buf, [5])) == [None]
    finally:
        await tier.close()
    seqs = []
    with open(path, "rb") as f:
        data = f.read()
    for off in range(4096, len(data) - ROW0 + 1, ROW0):
        trailer = data[off + ROW0 - TRAILER_NBYTES : off + ROW0]
        if any(trailer):
            seqs.append((decode_trailer(trailer).block_hash, decode_trailer(trailer).seq))
    assert sorted(h for h, _ in seqs) == [b"hash-0", b"hash-1", b"hash-5"]  # losers blanked
    assert dict(seqs)[b"hash-5"] > 100
    tier = await _tier(root)
    try:
        assert hashes(tier) == [b"hash-0", b"hash-1", b"hash-5"]
        assert tier.stored_range(key(0)) == (1, 3)
    finally:
        await tier.close()


async def test_a_segment_of_another_format_is_skipped_kept_and_its_number_never_reused(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "nvme"
    small = {"segment_nbytes": 4096 + 2 * ROW0}  # two rows of group 0 per segment
    other = await _tier(root, namespace="other", **small)
    buf = Slots(3, 8 * 4096)
    assert await other.write_rows(row_writes(buf, [0, 1])) == [None, None]
    await other.close()
    tier = await _tier(root, **small)
    assert await tier.write_rows(row_writes(buf, [2, 3])) == [None, None]
    await tier.close()
    foreign = _seg(tier, 0, 1)
    foreign.write_bytes(_seg(other, 0, 0).read_bytes())  # another digest, same group
    before = foreign.read_bytes()
    tier = await _tier(root, **small)
    try:
        assert hashes(tier) == [b"hash-2", b"hash-3"]
        assert tier.stats()["invalid_segments_at_open"] == 1
        assert await tier.write_rows(row_writes(buf, [4, 5, 6])) == [None] * 3
    finally:
        await tier.close()
    assert foreign.read_bytes() == before
    names = {p.name for p in foreign.parent.iterdir()}
    assert {"0.kvrows", "1.kvrows", "2.kvrows", "3.kvrows"} <= names  # 2, 3: new numbers
    tier = await _tier(root, **small)
    try:
        assert hashes(tier) == [b"hash-2", b"hash-3", b"hash-4", b"hash-5", b"hash-6"]
        out = Slots(5, 8 * 4096)
        ks = [key(i) for i in range(2, 7)]
        assert await tier.read_rows([(k, out[i]) for i, k in enumerate(ks)]) == [(0, 4)] * 5
        assert all(payload_matches(out[i], k) for i, k in enumerate(ks))
    finally:
        await tier.close()


@pytest.mark.parametrize("cut", ["mid_trailer", "mid_payload", "after_header"])
async def test_truncated_segment_keeps_the_whole_rows_and_grows_again(
    tmp_path: pathlib.Path, cut: str
) -> None:
    root = tmp_path / "nvme"
    tier = await _tier(root)
    buf = Slots(4, 8 * 4096)
    assert await tier.write_rows(row_writes(buf, range(4))) == [None] * 4
    path = _seg(tier)
    await tier.close()
    size = {
        "mid_trailer": 4096 + 3 * ROW0 - 100,  # row 2's trailer cut
        "mid_payload": 4096 + 2 * ROW0 + 4096,
        "after_header": 4096,
    }[cut]
    os.truncate(path, size)
    keep = [] if cut == "after_header" else [0, 1]
    tier = await _tier(root)
    try:
        assert hashes(tier) == [f"hash-{i}".encode() for i in keep]
        assert await tier.write_rows(row_writes(buf, [5, 6, 7, 8])) == [None] * 4
    finally:
        await tier.close()
    tier = await _tier(root)
    try:
        ks = [key(i) for i in [*keep, 5, 6, 7, 8]]
        assert hashes(tier) == sorted(k.block_hash for k in ks)
        out = Slots(len(ks), 8 * 4096)
        assert await tier.read_rows([(k, out[i]) for i, k in enumerate(ks)]) == [(0, 4)] * len(ks)
        assert all(payload_matches(out[i], k) for i, k in enumerate(ks))
        assert tier.stats()["invalid_rows_at_open"] == 0
    finally:
        await tier.close()


# ====================================================================== engine glue

R = kvtier.Residency


async def test_keys_evicted_from_nvme_across_groups_stay_gone_after_a_restart(
    tmp_path: pathlib.Path,
) -> None:
    gpu = Gpu()
    cs = chunks([f"ev{i}" for i in range(10)])  # groups alternate: rows of 12 KiB and 8 KiB
    cap = 3 * 12288 + 2 * 8192
    cfg = engine_config(gpu, 2, nvme_config(tmp_path, capacity_bytes=cap))
    on_nvme: dict[kvtier.OffloadKey, bool] = {}
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        for c in cs:  # two slots: older keys leave the CPU, and NVMe evicts by LRU
            await store_ok(engine, gpu, [c])
            await engine.flush()
            st = engine.stats().nvme
            assert st is not None
            assert st["bytes_used"] <= cap
        found = engine.lookup([c.key for c in cs])
        for c, r in zip(cs, found, strict=True):
            on_nvme[c.key] = r is not R.MISS
        assert 0 < sum(on_nvme.values()) < len(cs)
        assert (engine.stats().nvme or {})["evictions"] > 0
        nvme_now = engine._nvme.keys()  # the tier's own view, for the restart below
    assert {k for k, v in on_nvme.items() if v} >= set(nvme_now)
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        found = engine.lookup([c.key for c in cs])
        assert {c.key for c, r in zip(cs, found, strict=True) if r is R.NVME} == set(nvme_now)
        assert (engine.stats().nvme or {})["invalid_rows_at_open"] == 0
        for c in cs:
            res = await load_check(engine, gpu, [c])
            assert (c.key in res.loaded) == (c.key in nvme_now)


async def test_load_cancelled_during_its_promotion_copies_nothing_and_leaks_nothing(
    tmp_path: pathlib.Path,
) -> None:
    gpu = Gpu()
    cs = chunks(["cp0", "cp1", "cp2"])
    plain = engine_config(gpu, 4, nvme_config(tmp_path))
    async with kvtier.TransferEngine(gpu.layout, plain) as engine:
        await store_ok(engine, gpu, cs)
        await engine.flush()
    holder = Holder()
    cfg = engine_config(gpu, 4, nvme_config(tmp_path, wrapper=holder))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        assert holder.io is not None
        holder.io.read_gate = gate = threading.Event()
        try:
            for c in cs:
                gpu.scribble(c)
            task = asyncio.ensure_future(engine.load(cs))
            await until_true(holder.io.read_entered.is_set, "the promotion read")
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done()  # the read in flight delays the cancellation
        finally:
            gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(gpu.untouched(c) for c in cs)
        await at_rest(engine)
        # the rows were read: the keys are resident now and load bitwise
        assert engine.lookup([c.key for c in cs]) == [R.CPU] * 3
        assert not (await load_check(engine, gpu, cs)).failed


async def test_aclose_during_a_blocked_promotion_and_a_blocked_write_through(
    tmp_path: pathlib.Path,
) -> None:
    gpu = Gpu()
    old = chunks(["ac0", "ac1"])
    plain = engine_config(gpu, 6, nvme_config(tmp_path))
    async with kvtier.TransferEngine(gpu.layout, plain) as engine:
        await store_ok(engine, gpu, old)
        await engine.flush()

    class SlowAll(GateIO):
        def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
            if sum(memoryview(b).nbytes for b in bufs) > TRAILER_NBYTES and self.read_gate:
                self.read_gate.wait(20)
            return super().pwritev(handle, bufs, file_offset)

    made: list[SlowAll] = []
    cfg = engine_config(
        gpu, 6, nvme_config(tmp_path, wrapper=lambda i: made.append(SlowAll(i)) or made[0])
    )
    new = chunks(["ac2", "ac3"], first_block=20)
    engine = await kvtier.TransferEngine(gpu.layout, cfg).start()
    gate = threading.Event()
    made[0].read_gate = gate
    try:
        for c in old:
            gpu.scribble(c)
        load = asyncio.ensure_future(engine.load(old))
        await until_true(made[0].read_entered.is_set, "the promotion read")
        await store_ok(engine, gpu, new)  # its write-through blocks too
        close = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0.05)
        assert not close.done()
        with pytest.raises(kvtier.EngineClosedError):
            engine.lookup([old[0].key])
    finally:
        gate.set()
    await close
    res = await load
    assert set(res.loaded) == {c.key for c in old}
    assert all(gpu.holds(c) for c in old)
    async with kvtier.TransferEngine(gpu.layout, plain) as engine:
        assert engine.lookup([c.key for c in [*old, *new]]) == [R.NVME] * 4
        assert not (await load_check(engine, gpu, [*old, *new])).failed


async def test_store_cancelled_before_its_copy_ends_writes_no_row(tmp_path: pathlib.Path) -> None:
    gpu = Gpu()
    cs = chunks(["sc0", "sc1"])
    cfg = engine_config(gpu, 4, nvme_config(tmp_path))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        for c in cs:
            gpu.write(c)
        task = asyncio.ensure_future(engine.store(cs))
        await asyncio.sleep(0)  # the store reserved its slots and submitted the copy
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.flush()
        await at_rest(engine)
        assert engine.lookup([c.key for c in cs]) == [R.MISS] * 2
        st = engine.stats()
        assert st.slots_free == st.num_slots
        assert (st.nvme or {})["rows_resident"] == 0
        await store_ok(engine, gpu, cs)
        await engine.flush()
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        assert not (await load_check(engine, gpu, cs)).failed


class RandomFaults(DelegatingRowIO):
    """Real backend; row reads and writes fail with EIO (or go short) at random, seeded."""

    def __init__(self, inner: RowIO, seed: int) -> None:
        super().__init__(inner)
        self.rng = random.Random(seed)
        self.on = True
        self.lock = threading.Lock()

    def _roll(self, p: float) -> bool:
        with self.lock:
            return self.on and self.rng.random() < p

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        if sum(memoryview(b).nbytes for b in bufs) > TRAILER_NBYTES:
            if self._roll(0.1):
                raise OSError(errno.EIO, "random EIO on read")
            if self._roll(0.05):
                n = self.inner.preadv(handle, bufs, file_offset)
                return max(0, n - 4096)
        return self.inner.preadv(handle, bufs, file_offset)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        if sum(memoryview(b).nbytes for b in bufs) > TRAILER_NBYTES:
            if self._roll(0.1):
                raise OSError(errno.ENOSPC, "random ENOSPC on write")
            if self._roll(0.05):
                first = memoryview(bufs[0])
                return self.inner.pwritev(handle, [first[: first.nbytes // 2]], file_offset)
        return self.inner.pwritev(handle, bufs, file_offset)

    def fdatasync(self, handle: Any) -> None:
        if self._roll(0.1):
            raise OSError(errno.EIO, "random EIO on fdatasync")
        self.inner.fdatasync(handle)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_interleaving_with_faults_never_gives_wrong_bytes(
    tmp_path: pathlib.Path, seed: int
) -> None:
    rng = random.Random(seed)
    gpu = Gpu()
    cs = chunks([f"rnd{i}" for i in range(14)])
    made: list[RandomFaults] = []
    cap = 3 * 12288 + 2 * 8192
    cfg = engine_config(
        gpu,
        3,
        nvme_config(
            tmp_path,
            capacity_bytes=cap,
            request_nbytes=3 * 12288,
            wrapper=lambda i: made.append(RandomFaults(i, seed)) or made[-1],
        ),
    )
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:

        async def op(kind: str, part: list[kvtier.Chunk]) -> None:
            if kind == "store":
                for c in part:
                    gpu.write(c)
                await engine.store(part, durable=rng.random() < 0.2)
            elif kind == "load":
                await load_check(engine, gpu, part)
            elif kind == "prefetch":
                await engine.prefetch([c.key for c in part])
            elif kind == "flush":
                await engine.flush()
            else:
                engine.lookup([c.key for c in part])
                engine.prefix_hits([c.key for c in part])

        for _ in range(40):
            pool = cs[:]
            rng.shuffle(pool)
            tasks = []
            for _ in range(rng.randint(1, 4)):
                n = rng.randint(1, 3)
                part, pool = pool[:n], pool[n:]
                if not part:
                    break
                kind = rng.choice(["store", "store", "load", "load", "prefetch", "flush", "look"])
                tasks.append(asyncio.ensure_future(op(kind, part)))
            if rng.random() < 0.3 and tasks:
                await asyncio.sleep(0)
                rng.choice(tasks).cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for out in outcomes:
                if isinstance(out, BaseException) and not isinstance(
                    out, asyncio.CancelledError | kvtier.KVTierError
                ):
                    raise out
            st = engine.stats()
            assert st.nvme is not None
            assert st.nvme["bytes_used"] <= cap
            assert st.slots_free + st.slots_writing + st.slots_resident + st.slots_pinned == 3
        made[-1].on = False
        nvme = engine.stats().nvme or {}
        assert sum(v for k, v in nvme.items() if k.startswith("failures_")) > 0
        with contextlib.suppress(kvtier.KVTierError):
            await engine.flush()  # failures not reported by earlier flushes
    plain = engine_config(gpu, 3, nvme_config(tmp_path, capacity_bytes=cap))
    async with kvtier.TransferEngine(gpu.layout, plain) as engine:
        found = engine.lookup([c.key for c in cs])
        on_nvme = [c for c, r in zip(cs, found, strict=True) if r is R.NVME]
        for c in on_nvme:
            res = await load_check(engine, gpu, [c])
            assert c.key in res.loaded, res.failed  # the faults are off: every row reads back
        st = engine.stats().nvme
        assert st is not None
        assert st["bytes_used"] <= cap


# ====================================================================== stale rows, growth


async def test_discarded_and_replaced_rows_are_blanked_by_close_and_stay_gone(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "nvme"
    tier = await _tier(root)
    buf = Slots(4, 8 * 4096)
    assert await tier.write_rows(row_writes(buf, [0, 1, 2, 3])) == [None] * 4
    assert await tier.write_rows(row_writes(buf, [1], group_id=1)) == [None]
    tier.discard(key(0))
    tier.discard(key(1, 1))
    assert await tier.write_rows(
        [(key(2), 1, 3, buf.fill(0, payload(key(2), GROUP_NBYTES[0])))]
    ) == [None]  # replaces key 2's row: the old row goes stale
    st = tier.stats()
    assert st["bytes_used"] == 3 * ROW0
    await tier.close()
    tier = await _tier(root)
    try:
        assert set(tier.keys()) == {key(1), key(2), key(3)}
        assert tier.stored_range(key(2)) == (1, 3)
        assert tier.stats()["bytes_used"] == 3 * ROW0
    finally:
        await tier.close()


async def test_a_failed_blanking_is_counted_and_the_old_key_returns_only_with_its_own_bytes(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "nvme"
    holder = Holder(box_handles=True)  # no hole punching: blanking writes the trailer
    tier = await _tier(root, row_io_wrapper=holder)
    buf = Slots(2, 8 * 4096)
    assert await tier.write_rows(row_writes(buf, [0, 1])) == [None, None]
    assert holder.io is not None
    holder.io.trailer_write_error = 1
    tier.discard(key(0))
    await tier.close()
    assert tier.stats()["reclaim_failures"] == 1
    tier = await _tier(root)
    try:
        # documented: a restart may find the discarded key again, with intact bytes
        assert hashes(tier) in ([b"hash-0", b"hash-1"], [b"hash-1"])
        out = Slots(2, 8 * 4096)
        ks = tier.keys()
        assert await tier.read_rows([(k, out[i]) for i, k in enumerate(ks)]) == [(0, 4)] * len(ks)
        assert all(payload_matches(out[i], k) for i, k in enumerate(ks))
    finally:
        await tier.close()


async def test_failed_on_demand_growth_fails_its_key_and_keeps_the_accounting(
    tmp_path: pathlib.Path,
) -> None:
    class NoSpace(GateIO):
        fail_allocate = 0

        def allocate(self, handle: Any, nbytes: int) -> None:
            with self.lock:
                if self.fail_allocate:
                    self.fail_allocate -= 1
                    raise OSError(errno.ENOSPC, "injected ENOSPC on allocate")
            super().allocate(handle, nbytes)

    made: list[NoSpace] = []
    root = tmp_path / "nvme"
    tier = await _tier(
        root,
        grow_ahead=False,
        capacity_bytes=4 * ROW0,
        row_io_wrapper=lambda i: made.append(NoSpace(i)) or made[0],
    )
    try:
        buf = Slots(4, 8 * 4096)
        assert await tier.write_rows(row_writes(buf, [0])) == [None]
        made[0].fail_allocate = 2  # the next growth (extension) fails, twice
        res = await tier.write_rows(row_writes(buf, [1, 2, 3]))
        kinds = [None if r is None else getattr(r, "kind", "?") for r in res]
        assert "enospc" in kinds
        st = tier.stats()
        # A growth that fails with ENOSPC takes the row of the group's oldest key
        # not in the call (key 0) instead of failing.
        assert st["disk_full_evictions"] == 1
        assert not tier.contains(key(0, 0))
        ok = 1 + kinds.count(None) - st["disk_full_evictions"]
        assert st["bytes_used"] == ok * ROW0 == len(tier.keys()) * ROW0
        allocated = os.path.getsize(_seg(tier)) - 4096
        assert st["bytes_allocated"] == allocated
        assert st["failures_enospc"] == kinds.count("enospc")
        # the next write grows again and succeeds
        res = await tier.write_rows(row_writes(buf, [4, 5, 6]))
        assert all(r is None or r.kind == "capacity" for r in res)  # type: ignore[union-attr]
        st = tier.stats()
        assert st["bytes_used"] <= st["capacity_bytes"]
        assert st["bytes_used"] == len(tier.keys()) * ROW0
    finally:
        await tier.close()
    tier = await _tier(root)
    try:
        ks = tier.keys()
        out = Slots(len(ks), 8 * 4096)
        assert await tier.read_rows([(k, out[i]) for i, k in enumerate(ks)]) == [(0, 4)] * len(ks)
        assert all(payload_matches(out[i], k) for i, k in enumerate(ks))
    finally:
        await tier.close()
