"""BackgroundEngine, start/close races, eviction and odd roots.

Areas:

* ``BackgroundEngine``: ``cancel()``, ``close()`` while calls (or ``start()``)
  are in flight, from two threads, calls after close, calls made from the
  engine thread itself (a Future's done callback), bad arguments to ``cancel``.
* ``TransferEngine.aclose()`` racing ``start()``.
* Eviction: a store evicting a key of its own call; ARC against LRU with a full
  CPU tier whose fresh keys are pinned by row writes.
* Stores, loads and prefetches of the same keys at once, with an NVMe tier of
  three rows (constant capacity eviction), partial chunks, two groups of
  different row sizes; partial chunks across a restart.
* Layouts with aliased tensors and groups sharing storage.
* ``kvtier inspect`` / ``kvtier remove`` on odd roots.
* ``stats()`` after failures; bad input changes nothing.

Faults are injected only through ``NVMeConfig.row_io_wrapper`` (a real
backend underneath) or observed in a child process. A test headed
"Regression" guards against a bug the engine once had.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import kvtier
from kvtier.cli import main as cli_main
from kvtier.errors import (
    BlockIdError,
    ChunkRangeError,
    DuplicateKeyError,
    EngineClosedError,
    InvalidArgumentError,
    KeyNotResidentError,
    KVTierError,
    NamespaceLockedError,
    NotDurableError,
    NotStoredError,
    StorageError,
    UnknownGroupError,
)
from kvtier.io import inspect_root, remove_namespace

from ..engine.helpers import fill_random, filled_layout, key, same
from ..io.faults import DelegatingRowIO
from ._faultio import KeyFault, Wrapper
from .background_engines import (
    BPC,
    await_for,
    blocked_durable_store,
    closed_seen,
    engine_cfg,
    nvme_cfg,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
R = kvtier.Residency


# ====================================================================== helpers


def _consistent(st: kvtier.EngineStats) -> None:
    assert st.slots_free + st.slots_writing + st.slots_resident + st.slots_pinned == st.num_slots
    assert st.reserved_nbytes == (st.num_slots - st.slots_free) * st.slot_nbytes
    assert st.slot_waste_nbytes == st.reserved_nbytes - st.payload_nbytes
    assert sum(st.keys_per_group.values()) == st.num_slots - st.slots_free
    if st.nvme is not None:
        assert st.nvme["bytes_used"] <= st.nvme["capacity_bytes"]


def _unstick_engine_thread(bg: kvtier.BackgroundEngine) -> None:
    """Cancel the Future the engine thread is blocked on inside ``Future.result`` (cleanup)."""
    frame = sys._current_frames().get(bg._thread.ident or -1)
    while frame is not None:
        me = frame.f_locals.get("self")
        if frame.f_code.co_name == "result" and isinstance(me, concurrent.futures.Future):
            me.cancel()
            return
        frame = frame.f_back


# ====================================================================== BackgroundEngine


# Regression: a second BackgroundEngine.close() does not return at once while the first is still
# closing (namespace lock held); close() promises 'blocks until done'
def test_background_close_from_two_threads_both_return_after_the_engine_is_closed(
    tmp_path: Path,
) -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    slow = key("slow", 0)
    fault = KeyFault("write", "block", hashes=frozenset({slow.block_hash}))
    bg = kvtier.BackgroundEngine(
        layout, engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=Wrapper(fault)))
    )
    bg.start()
    first = threading.Thread(target=bg.close, name="first-close")
    release = threading.Timer(1.0, fault.gate.set)
    try:
        bg.store([kvtier.Chunk(slow, [0, 1])]).result(10)
        wait_for(lambda: fault.hits == 1, "the row write to block")
        first.start()  # waits for the blocked row write (a soft close drains it)
        wait_for(lambda: closed_seen(bg), "the first close to begin")
        release.start()  # the write completes 1 s from now
        bg.close()  # the second close: must return only once the engine is closed
        # The namespace lock is free once the engine is closed.
        other = kvtier.BackgroundEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path)))
        other.start()
        other.close()
        assert not first.is_alive()
    finally:
        fault.gate.set()
        release.cancel()
        if first.ident is not None:
            first.join(10)


# Regression: cancel() of a load that already finished does not raise TimeoutError while an
# unrelated durable store waits for its row (_settle must not wait for every engine task)
def test_background_cancel_of_a_finished_load_does_not_wait_for_other_durable_stores(
    tmp_path: Path,
) -> None:
    layout, t = filled_layout((32, 4096), seed=71, name="a")
    a, slow = key("a", 0), key("slow", 0)
    fault = KeyFault("write", "block", hashes=frozenset({slow.block_hash}))
    bg = kvtier.BackgroundEngine(
        layout, engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=Wrapper(fault)))
    )
    bg.start()
    try:
        bg.store([kvtier.Chunk(a, [0, 1])], durable=True).result(10)
        durable = bg.store([kvtier.Chunk(slow, [2, 3])], durable=True)
        wait_for(lambda: fault.hits == 1, "the durable row write to block")
        load = bg.load([kvtier.Chunk(a, [4, 5])])
        assert load.result(10).loaded == (a,)
        assert same(t[4:6], t[0:2])
        # The load has ended; nothing writes its blocks. cancel() returns False at once.
        assert bg.cancel(load, timeout=1.0) is False
    finally:
        fault.gate.set()
        with contextlib.suppress(Exception):
            durable.result(10)
        bg.close()


# Regression: BackgroundEngine.close() does not swallow the StorageError of a failed final
# fdatasync that TransferEngine.aclose() raises (_shutdown must not suppress Exception)
def test_background_close_reports_a_failed_final_fdatasync(tmp_path: Path) -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    wrap = Wrapper()
    bg = kvtier.BackgroundEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=wrap)))
    bg.start()
    bg.store([kvtier.Chunk(key("dirty", 0), [0, 1])]).result(10)  # written through, not synced
    wait_for(lambda: bg.stats().nvme["rows_written"] == 1, "the row write")  # type: ignore[index]
    wrap.faults.append(KeyFault("fdatasync", "errno"))
    try:
        with pytest.raises(StorageError):
            bg.close()  # TransferEngine.aclose() raises StorageError here
    finally:
        bg.close()
        # The lock is released either way.
        other = kvtier.BackgroundEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path)))
        other.start()
        other.close()


def test_transfer_engine_aclose_raises_the_failed_final_fdatasync(tmp_path: Path) -> None:
    """Control for the test above: the engine itself reports it."""
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    wrap = Wrapper()

    async def main() -> None:
        engine = kvtier.TransferEngine(
            layout, engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=wrap))
        )
        await engine.start()
        await engine.store([kvtier.Chunk(key("dirty", 0), [0, 1])])
        await await_for(lambda: engine.stats().nvme["rows_written"] == 1, "the row write")  # type: ignore[index]
        wrap.faults.append(KeyFault("fdatasync", "errno"))
        with pytest.raises(StorageError):
            await engine.aclose()

    asyncio.run(main())


# Regression: a BackgroundEngine call made on the engine thread (a Future's done callback)
# returns or raises, instead of deadlocking the engine forever
def test_background_call_from_a_done_callback_does_not_deadlock() -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    bg = kvtier.BackgroundEngine(layout, engine_cfg(layout, 4))
    bg.start()
    a = key("a", 0)
    got: dict[str, Any] = {}
    done = threading.Event()

    def callback(_: concurrent.futures.Future[Any]) -> None:
        try:
            got["lookup"] = bg.lookup([a])
        except BaseException as exc:
            got["error"] = exc
        done.set()

    try:
        fut = bg.store([kvtier.Chunk(a, [0, 1])])
        fut.add_done_callback(callback)  # runs on the engine thread when the store ends
        assert done.wait(3), "the engine thread is deadlocked in lookup()"
        assert got.get("lookup") == [R.CPU] or isinstance(got.get("error"), KVTierError)
    finally:
        if not done.is_set():
            _unstick_engine_thread(bg)
            done.wait(5)
        bg.close()


# Regression: BackgroundEngine.cancel(not_a_future) raises a typed InvalidArgumentError, not
# AttributeError
def test_background_cancel_of_a_non_future_is_a_typed_error() -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    with (
        kvtier.BackgroundEngine(layout, engine_cfg(layout, 4)) as bg,
        pytest.raises(InvalidArgumentError),
    ):
        bg.cancel("not a future")  # type: ignore[arg-type]


# Regression: BackgroundEngine.cancel(fut, timeout='1') raises InvalidArgumentError and does not
# cancel the call (not: cancel it, then raise TypeError, bad input changing state untyped)
def test_background_cancel_with_a_bad_timeout_changes_nothing(tmp_path: Path) -> None:
    with blocked_durable_store(tmp_path) as (bg, durable, _):
        assert not durable.done()
        try:
            with pytest.raises(InvalidArgumentError):
                bg.cancel(durable, timeout="1")  # type: ignore[arg-type]
        finally:
            still_pending = not durable.cancelled()
        assert still_pending, "the bad call cancelled the durable store"


def test_background_calls_after_close_raise_at_once_and_close_is_idempotent(tmp_path: Path) -> None:
    layout, t = filled_layout((32, 4096), seed=71, name="a")
    a = key("a", 0)
    bg = kvtier.BackgroundEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path)))
    bg.start()
    fut = bg.store([kvtier.Chunk(a, [0, 1])], durable=True)
    assert fut.result(10).stored == (a,)
    bg.close()
    bg.close()
    calls: list[Callable[[], object]] = [
        lambda: bg.store([kvtier.Chunk(a, [0, 1])]),
        lambda: bg.load([kvtier.Chunk(a, [2, 3])]),
        lambda: bg.prefetch([a]),
        bg.flush,
        lambda: bg.lookup([a]),
        lambda: bg.prefix_hits([a]),
        lambda: bg.stored_range(a),
        bg.stats,
        lambda: bg.cancel(fut),
        bg.start,
    ]
    before = t.clone()
    for call in calls:
        with pytest.raises(EngineClosedError):
            call()
    assert same(t, before)
    assert bg.engine.stats().nvme["rows_resident"] == 1  # type: ignore[index]
    # The key survived: a new engine finds it on NVMe.
    with kvtier.BackgroundEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path))) as again:
        assert again.lookup([a]) == [R.NVME]
        assert again.load([kvtier.Chunk(a, [8, 9])]).result(10).loaded == (a,)
    assert same(t[8:10], t[0:2])


def test_background_engine_threads_store_load_cancel_then_close_midway() -> None:
    """Four threads store, load and cancel on their own blocks; a fifth closes meanwhile.

    Every Future ends; every load that reports a key wrote its exact bytes; a
    call after close raises EngineClosedError at once; no slot stays pinned.
    """
    nb = 160
    t = torch.empty((nb, 4096), dtype=torch.uint8)
    fill_random(t, 5)
    src = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    bg = kvtier.BackgroundEngine(layout, engine_cfg(layout, 6))
    bg.start()
    futures: list[concurrent.futures.Future[Any]] = []
    checks: list[
        tuple[concurrent.futures.Future[Any], kvtier.OffloadKey, list[int], list[int]]
    ] = []
    lock = threading.Lock()
    errors_seen: list[BaseException] = []
    started = threading.Barrier(5)

    def worker(w: int) -> None:
        rnd = random.Random(w)
        base_src, base_dst = 8 * w, 40 + 30 * w
        started.wait()
        for i in range(60):
            k = key(f"{w}-{i % 4}", 0)
            srcb = [base_src + 2 * (i % 4), base_src + 2 * (i % 4) + 1]
            dst = [base_dst + 2 * (i % 4), base_dst + 2 * (i % 4) + 1]  # one key per pair
            try:
                if rnd.random() < 0.5:
                    f = bg.store([kvtier.Chunk(k, srcb)])
                else:
                    f = bg.load([kvtier.Chunk(k, dst)])
                    with lock:
                        checks.append((f, k, srcb, dst))
                with lock:
                    futures.append(f)
                if rnd.random() < 0.3:
                    bg.cancel(f, timeout=10)
                else:
                    with contextlib.suppress(concurrent.futures.CancelledError):
                        f.result(10)
            except EngineClosedError:
                return
            except BaseException as exc:
                errors_seen.append(exc)
                return

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    started.wait()
    time.sleep(0.05)
    bg.close()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    assert not errors_seen, errors_seen
    assert all(f.done() for f in futures)
    # A destination pair only ever receives one key's bytes (any load of it,
    # cancelled or not, writes those exact bytes or nothing): once a load of
    # it succeeded, it holds them.
    loaded = 0
    for f, k, srcb, dst in checks:
        if f.cancelled() or f.exception() is not None:
            continue
        if k in f.result().loaded:
            loaded += 1
            assert same(t[dst], src[srcb])
    assert loaded > 0
    st = bg.engine.stats()
    assert st.slots_pinned == 0
    assert st.slots_writing == 0
    with pytest.raises(EngineClosedError):
        bg.store([kvtier.Chunk(key("late", 0), [0, 1])])


# ====================================================================== close racing start


_CLOSE_DURING_START = textwrap.dedent(
    """
    import asyncio, sys, threading, time
    import torch, kvtier
    t = torch.zeros((32, 4096), dtype=torch.uint8)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    cfg = kvtier.EngineConfig(256 << 20, 2)  # a pool whose pre-faulting takes a while

    async def engine_case():
        engine = kvtier.TransferEngine(layout, cfg)
        start = asyncio.ensure_future(engine.start())
        await asyncio.sleep(0)  # start() is now pre-faulting the pool in a worker thread
        await engine.aclose()
        try:
            await start
        except BaseException:
            pass
        try:
            engine.lookup([])
        except kvtier.EngineClosedError:
            print("CLOSED", flush=True)

    def background_case():
        bg = kvtier.BackgroundEngine(layout, cfg)
        def starter():
            try:
                bg.start()
            except kvtier.KVTierError:
                pass
        th = threading.Thread(target=starter)
        th.start()
        while bg.engine._lifecycle.state != "starting":
            time.sleep(0.0001)
        bg.close()
        th.join()
        print("CLOSED", flush=True)

    if sys.argv[1] == "engine":
        asyncio.run(engine_case())
    else:
        background_case()
    """
)


# Regression: aclose()/close() while start() pre-faults the CPU pool does not unmap the pool under
# the worker thread, where the process would die with SIGSEGV
@pytest.mark.parametrize("case", ["engine", "background"])
def test_close_while_start_prefaults_does_not_crash_the_process(case: str, tmp_path: Path) -> None:
    script = tmp_path / "close_during_start.py"
    script.write_text(_CLOSE_DURING_START)
    proc = subprocess.run(
        [sys.executable, "-P", str(script), case],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"rc={proc.returncode} stderr={proc.stderr[-2000:]}"
    assert "CLOSED" in proc.stdout


class _SlowOpen(DelegatingRowIO):
    """Blocks opening segment files until ``gate`` is set (the tier's scan at start)."""

    entered = threading.Event()
    gate = threading.Event()

    def open(self, path: str | os.PathLike[str], create: bool) -> Any:
        type(self).entered.set()
        type(self).gate.wait(10)
        return self.inner.open(path, create)


# Regression: after aclose() during start() returns 'closed', start() must not finish with the
# engine open again (pool unmapped) holding the namespace lock, which no aclose releases
async def test_aclose_during_start_leaves_the_engine_closed_and_the_namespace_free(
    tmp_path: Path,
) -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    async with kvtier.TransferEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path))) as first:
        await first.store([kvtier.Chunk(key("k", 0), [0, 1])], durable=True)
    _SlowOpen.entered.clear()
    _SlowOpen.gate.clear()
    engine = kvtier.TransferEngine(
        layout, engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=_SlowOpen))
    )
    start = asyncio.ensure_future(engine.start())
    try:
        await await_for(_SlowOpen.entered.is_set, "the tier scan")
        # aclose waits for the start in progress (its scan is held): release the
        # scan while aclose waits (set only after aclose, the gate would let aclose
        # return only once the held open timed out after 10 s).
        closing = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0.05)
        assert not closing.done()
        _SlowOpen.gate.set()
        await asyncio.wait_for(closing, 10)
        with contextlib.suppress(KVTierError):
            await start
        with pytest.raises(EngineClosedError):
            engine.lookup([key("k", 0)])
        async with kvtier.TransferEngine(
            layout, engine_cfg(layout, 4, nvme_cfg(tmp_path))
        ) as again:
            assert again.lookup([key("k", 0)]) == [R.NVME]
    finally:
        _SlowOpen.gate.set()
        with contextlib.suppress(BaseException):
            await start
        # cleanup of what a buggy start() left open (the lock, the tier's threads)
        if engine._nvme is not None:
            await engine._nvme.close()
        for ex in engine._executors.values():
            ex.close()


# ====================================================================== eviction


# Regression: a store never evicts a key of its own call (a skipped, present key) to place
# another; SlotPool.reserve protects every key of the call, not only the new ones
# (_prepare_store by_key)
@pytest.mark.parametrize("policy", ["lru", "arc"])
async def test_store_never_evicts_a_present_key_of_the_same_call(policy: str) -> None:
    layout, _t = filled_layout((32, 4096), seed=71, name="a")
    a, b, c = key("a", 0), key("b", 0), key("c", 0)
    async with kvtier.TransferEngine(layout, engine_cfg(layout, 2, eviction=policy)) as engine:
        await engine.store([kvtier.Chunk(a, [0, 1])])
        # A serving loop stores the whole prefix again: a is cached, b and c are new.
        res = await engine.store(
            [kvtier.Chunk(a, [0, 1]), kvtier.Chunk(b, [2, 3]), kvtier.Chunk(c, [4, 5])]
        )
        assert res.skipped == (a,)
        assert engine.lookup([a]) == [R.CPU], "the call evicted its own key a"
        assert engine.stats().evictions == 0


def test_store_present_key_of_the_same_call_pool_level_control() -> None:
    """The pool honours ``protect``: the engine just does not pass the skipped keys."""
    from kvtier._policy import LRUPolicy
    from kvtier._slots import SlotPool

    pool = SlotPool(1, LRUPolicy())
    a, b = key("a", 0), key("b", 0)
    (entry,), _, _ = pool.reserve([(a, 0, 2, 8)], protect=set())
    pool.commit(entry.key)
    entries, rejected, evicted = pool.reserve([(b, 0, 2, 8)], protect={a, b})
    assert (entries, rejected, evicted) == ([], [b], [])


@pytest.mark.parametrize("policy", ["lru", "arc"])
async def test_full_tier_with_pinned_fresh_keys_rejects_and_arc_keeps_the_hot_key(
    tmp_path: Path, policy: str
) -> None:
    """Four slots; a hot key used twice; fresh keys pinned by blocked row writes.

    While every other slot is pinned, a store evicts only the hot key (the one
    evictable slot) or rejects; it never evicts a pinned key and never waits.
    Once the rows are written, a scan of one-time keys evicts the hot key under
    LRU but not under ARC.
    """
    layout, t = filled_layout((64, 4096), seed=71, name="a")
    hot = key("hot", 0)
    fresh = [key(f"f{i}", 0) for i in range(3)]
    fault = KeyFault("write", "block", hashes=frozenset(k.block_hash for k in fresh))
    cfg = engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=Wrapper(fault)), eviction=policy)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        try:
            await engine.store([kvtier.Chunk(hot, [0, 1])], durable=True)
            assert (await engine.load([kvtier.Chunk(hot, [40, 41])])).loaded == (hot,)
            await engine.store(
                [kvtier.Chunk(k, [2 + 2 * i, 3 + 2 * i]) for i, k in enumerate(fresh)]
            )
            await await_for(lambda: fault.hits >= 1, "the blocked row writes")
            st = engine.stats()
            assert st.slots_pinned == 3
            assert st.slots_resident == 1
            extra = [key(f"x{i}", 0) for i in range(2)]
            res = await engine.store(
                [kvtier.Chunk(k, [20 + 2 * i, 21 + 2 * i]) for i, k in enumerate(extra)]
            )
            assert len(res.stored) == 1
            assert len(res.rejected) == 1
            assert engine.lookup(fresh) == [R.CPU] * 3  # pinned: never evicted
            assert engine.lookup([hot]) == [R.NVME]  # the only evictable slot
            fault.gate.set()
            await engine.flush()
            assert (await engine.load([kvtier.Chunk(hot, [42, 43])])).loaded == (hot,)
            await engine.load([kvtier.Chunk(hot, [44, 45])])  # used again: hot
            await engine.flush()
            scan = [key(f"s{i}", 0) for i in range(6)]
            for i, k in enumerate(scan):
                await engine.store([kvtier.Chunk(k, [30 + (2 * i) % 10, 31 + (2 * i) % 10])])
                await engine.flush()
            _consistent(engine.stats())
            where = engine.lookup([hot])
            assert where == ([R.CPU] if policy == "arc" else [R.NVME])
            assert engine.stats().slots_pinned == 0
        finally:
            fault.gate.set()  # before aclose drains the rows
    assert same(t[44:46], t[0:2])


# ====================================================================== same keys, tiny NVMe


_NB = 256
_NK = 14


def _two_group_layout() -> tuple[kvtier.KVLayout, dict[int, list[torch.Tensor]]]:
    t0 = torch.empty((_NB, 4096), dtype=torch.uint8)
    t1a = torch.empty((_NB, 6144), dtype=torch.uint8)
    t1b = torch.empty((_NB, 6144), dtype=torch.uint8)
    for i, x in enumerate((t0, t1a, t1b)):
        fill_random(x, 300 + i)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t0}, 1: {"b": t1a, "c": t1b}})
    return layout, {0: [t0], 1: [t1a, t1b]}


def _spec(bpc: int) -> dict[int, tuple[kvtier.OffloadKey, int, int, int, list[int]]]:
    """Key i: (key, group, offset, n sub-blocks, source blocks); partial chunks of both groups."""
    out = {}
    for i in range(_NK):
        g = i % 2
        o = (i // 2) % 3
        n = 1 + (i % (bpc - o))
        out[i] = (key(f"k{i}", g), g, o, n, list(range(4 * i, 4 * i + n)))
    return out


@pytest.mark.parametrize("seed", [0, 1])
async def test_same_keys_stored_loaded_prefetched_at_once_with_three_nvme_rows(
    tmp_path: Path, seed: int
) -> None:
    bpc = 4
    layout, tens = _two_group_layout()
    src = {g: [x.clone() for x in xs] for g, xs in tens.items()}
    spec = _spec(bpc)
    rnd = random.Random(seed)
    slot = layout.slot_nbytes(bpc)
    cfg = kvtier.EngineConfig(
        3 * slot,
        bpc,
        eviction="arc" if seed % 2 else "lru",
        nvme=kvtier.NVMeConfig(tmp_path, 3 * slot, namespace="same", segment_nbytes=1 << 20),
    )
    nxt = [64]

    def targets(m: int) -> list[int]:
        if nxt[0] + m > _NB:
            nxt[0] = 64
        out = list(range(nxt[0], nxt[0] + m))
        nxt[0] += m
        return out

    def holds(i: int, tgt: list[int], s: int) -> bool:
        _, g, _, _, ids = spec[i]
        return all(
            torch.equal(x[tgt], r[ids[s : s + len(tgt)]])
            for x, r in zip(tens[g], src[g], strict=True)
        )

    async with kvtier.TransferEngine(layout, cfg) as engine:

        async def load(i: int) -> None:
            k, g, o, n, _ = spec[i]
            outside = rnd.random() < 0.2 and o + n < bpc
            s = 0 if outside else rnd.randrange(n)
            m = n - s + 1 if outside else rnd.randrange(1, n - s + 1)
            tgt = targets(m)
            for x in tens[g]:
                x[tgt] = 0xEE
            res = await engine.load([kvtier.Chunk(k, tgt, offset=o + s)])
            if k in res.loaded:
                assert not outside
                assert holds(i, tgt, s)
            else:
                err = res.failed[k]
                assert isinstance(err, KVTierError)
                if outside:
                    assert isinstance(err, NotStoredError | KeyNotResidentError)
                for x in tens[g]:
                    assert bool((x[tgt] == 0xEE).all()), "a failed load wrote its blocks"

        async def store(idx: list[int]) -> None:
            res = await engine.store(
                [kvtier.Chunk(spec[i][0], spec[i][4], offset=spec[i][2]) for i in idx]
            )
            assert len(res.stored) + len(res.skipped) + len(res.rejected) == len(idx)

        for _ in range(24):
            ops = []
            for _ in range(rnd.randrange(2, 7)):
                c = rnd.random()
                if c < 0.35:
                    ops.append(store(rnd.sample(range(_NK), rnd.randrange(1, 4))))
                elif c < 0.75:
                    ops.append(load(rnd.randrange(_NK)))
                elif c < 0.9:
                    ops.append(engine.prefetch([spec[i][0] for i in rnd.sample(range(_NK), 2)]))
                else:
                    ops.append(engine.flush())
            for r in await asyncio.gather(*ops, return_exceptions=True):
                if isinstance(r, BaseException) and not isinstance(r, NotDurableError):
                    raise r
            _consistent(engine.stats())
        await engine.flush()
        st = engine.stats()
        assert st.slots_pinned == st.slots_writing == 0
        assert st.nvme["evictions"] > 0  # type: ignore[index]
        _consistent(st)
    # Restart: every key found loads its exact stored sub-blocks, nothing else.
    async with kvtier.TransferEngine(layout, cfg) as engine:
        keys = [spec[i][0] for i in range(_NK)]
        where = engine.lookup(keys)
        assert set(where) <= {R.NVME, R.MISS}
        assert R.NVME in where
        for i in range(_NK):
            if where[i] is not R.NVME:
                continue
            k, _g, o, n, _ = spec[i]
            assert engine.stored_range(k) == (o, o + n)
            tgt = targets(n)
            res = await engine.load([kvtier.Chunk(k, tgt, offset=o)])
            assert res.loaded == (k,), res.failed
            assert holds(i, tgt, 0)


async def test_partial_chunks_with_offsets_survive_a_restart_in_two_groups(tmp_path: Path) -> None:
    bpc = 4
    layout, tens = _two_group_layout()
    src = {g: [x.clone() for x in xs] for g, xs in tens.items()}
    cases = [  # (key, group, offset, source blocks)
        (key("p0", 0), 0, 1, [3, 4]),
        (key("p1", 1), 1, 2, [7, 8]),
        (key("p2", 1), 1, 3, [11]),
        (key("p3", 0), 0, 0, [12, 13, 14]),
    ]
    nv = kvtier.NVMeConfig(tmp_path, 16 << 20, namespace="partial", segment_nbytes=1 << 20)
    cfg = kvtier.EngineConfig(8 * layout.slot_nbytes(bpc), bpc, nvme=nv)
    async with kvtier.TransferEngine(layout, cfg) as engine:
        res = await engine.store(
            [kvtier.Chunk(k, ids, offset=o) for k, _, o, ids in cases], durable=True
        )
        assert len(res.stored) == 4
        # the same keys again, wider: skipped, the range stays
        again = await engine.store([kvtier.Chunk(k, [20, 21, 22, 23]) for k, _, _, _ in cases])
        assert len(again.skipped) == 4
    async with kvtier.TransferEngine(layout, cfg) as engine:
        keys = [c[0] for c in cases]
        assert engine.lookup(keys) == [R.NVME] * 4
        for k, _, o, ids in cases:
            assert engine.stored_range(k) == (o, o + len(ids))
        before = engine.stats()
        # Outside the stored range: that key alone fails, counted as a miss; nothing written.
        for x in tens[1]:
            x[100:104] = 0xEE
        res = await engine.load(
            [
                kvtier.Chunk(keys[1], [100, 101, 102], offset=1),
                kvtier.Chunk(keys[0], [104], offset=2),
            ]
        )
        assert isinstance(res.failed[keys[1]], NotStoredError)
        assert res.loaded == (keys[0],)
        assert all(bool((x[100:103] == 0xEE).all()) for x in tens[1])
        assert engine.stats().misses == before.misses + 1
        assert torch.equal(
            tens[0][0][104], src[0][0][4]
        )  # sub-block 2 of p0 = its 2nd source block
        # Every key, whole stored range and the last sub-block alone, after the promotion.
        for j, (k, g, o, ids) in enumerate(cases):
            tgt = list(range(110 + 8 * j, 110 + 8 * j + len(ids)))
            res = await engine.load([kvtier.Chunk(k, tgt, offset=o)])
            assert res.loaded == (k,)
            for x, r in zip(tens[g], src[g], strict=True):
                assert torch.equal(x[tgt], r[ids])
            last = [150 + j]
            res = await engine.load([kvtier.Chunk(k, last, offset=o + len(ids) - 1)])
            assert res.loaded == (k,)
            for x, r in zip(tens[g], src[g], strict=True):
                assert torch.equal(x[last], r[ids[-1:]])
        _consistent(engine.stats())


# ====================================================================== aliased layouts


async def test_aliased_and_shared_storage_groups_round_trip_and_reject_overlapping_loads(
    tmp_path: Path,
) -> None:
    t = torch.empty((32, 4096), dtype=torch.uint8)
    u = torch.empty((32, 2048), dtype=torch.int16)
    fill_random(t, 11)
    fill_random(u, 12)
    groups = {
        0: {"a": t[:, :2048], "a_again": t[:, :2048], "u": u},  # a duplicate name: copied once
        1: {"b": t[:, 1024:3072]},  # overlaps group 0's bytes in the same blocks
        2: {"c": t[:, 3072:]},  # shares the storage, disjoint bytes
    }
    layout = kvtier.KVLayout.from_tensors(groups)
    assert layout.group_nbytes(0, BPC) == BPC * (2048 + 4096)
    ref_t, ref_u = t.clone(), u.clone()
    k0, k1, k2 = key("g0", 0), key("g1", 1), key("g2", 2)
    cfg = kvtier.EngineConfig(8 * layout.slot_nbytes(BPC), BPC, nvme=nvme_cfg(tmp_path, ns="alias"))
    async with kvtier.TransferEngine(layout, cfg) as engine:
        res = await engine.store(
            [kvtier.Chunk(k0, [0, 1]), kvtier.Chunk(k1, [2, 3]), kvtier.Chunk(k2, [4, 5])],
            durable=True,
        )
        assert len(res.stored) == 3
    async with kvtier.TransferEngine(layout, cfg) as engine:
        await engine.prefetch([k1])
        before = engine.stats()
        where = engine.lookup([k0, k1, k2])
        for bad in (
            [kvtier.Chunk(k0, [10, 11]), kvtier.Chunk(k1, [11, 12])],
            [kvtier.Chunk(k1, [20]), kvtier.Chunk(k0, [20])],
        ):
            snapshot = t.clone()
            with pytest.raises(BlockIdError):
                await engine.load(bad)
            assert torch.equal(t, snapshot)
        assert engine.stats() == before
        assert engine.lookup([k0, k1, k2]) == where
        t[10:16] = 0
        u[10:12] = 0
        # g0 and g2 in the same blocks (disjoint bytes), g1 elsewhere: allowed
        res = await engine.load(
            [kvtier.Chunk(k0, [10, 11]), kvtier.Chunk(k2, [10, 11]), kvtier.Chunk(k1, [12, 13])]
        )
        assert set(res.loaded) == {k0, k1, k2}
        assert torch.equal(t[10:12, :2048], ref_t[0:2, :2048])
        assert torch.equal(u[10:12], ref_u[0:2])
        assert torch.equal(t[10:12, 3072:], ref_t[4:6, 3072:])
        assert torch.equal(t[12:14, 1024:3072], ref_t[2:4, 1024:3072])
        assert not bool(t[10:12, 2048:3072].any())  # no group covers these bytes
        _consistent(engine.stats())


# ====================================================================== inspect / remove


def test_inspect_and_remove_on_odd_roots(tmp_path: Path) -> None:
    runner = CliRunner()
    empty = tmp_path / "empty"
    empty.mkdir()
    res = runner.invoke(cli_main, ["inspect", str(empty)])
    assert res.exit_code == 1
    assert "no kvtier namespace folder" in res.output
    assert inspect_root(empty) == {
        "root": str(empty),
        "namespaces": [],
        "payloads_verified": False,
    }
    res = runner.invoke(cli_main, ["remove", "--yes", str(empty), "nothing-0123456789abcdef"])
    assert res.exit_code == 1
    assert "no folder 'nothing-0123456789abcdef'" in res.output
    assert os.listdir(empty) == []

    root = tmp_path / "odd"
    root.mkdir()
    (root / "notes.txt").write_text("foreign")
    (root / "file-0123456789abcdef").write_text("a file named like a namespace")
    ns = root / "junk-0123456789abcdef"
    (ns / "g0").mkdir(parents=True)
    (ns / "g0" / "0.kvrows").write_bytes(os.urandom(9000))  # garbage header
    (ns / "g0" / "007.kvrows").write_bytes(b"foreign")  # not a segment name: ignored
    (ns / "g0" / "1.kvrows").mkdir()  # a directory with a segment name
    (ns / "gx").write_text("not a group")
    (ns / "format.json").write_text(json.dumps({"digest": 5}))
    info = inspect_root(root)
    assert [n["directory"] for n in info["namespaces"]] == ["junk-0123456789abcdef"]
    junk = info["namespaces"][0]
    assert junk["locked_by_pid"] is None
    segs = junk["groups"][0]["segments"]
    assert [s["file"] for s in segs] == ["0.kvrows", "1.kvrows"]
    assert all(s["header_valid"] is False and s["error"] for s in segs)
    assert any("gx" in e for e in junk["errors"])
    assert any("digest" in e for e in junk["errors"])
    res = runner.invoke(cli_main, ["inspect", "--json", str(root)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["namespaces"][0]["directory"] == "junk-0123456789abcdef"
    for name in ("notes.txt", "file-0123456789abcdef", "../odd", "missing-0123456789abcdef"):
        with pytest.raises(InvalidArgumentError):
            remove_namespace(root, name)
    assert sorted(os.listdir(root)) == [
        "file-0123456789abcdef",
        "junk-0123456789abcdef",
        "notes.txt",
    ]
    assert remove_namespace(root, "junk-0123456789abcdef") > 0
    assert sorted(os.listdir(root)) == ["file-0123456789abcdef", "notes.txt"]


async def test_inspect_and_remove_a_namespace_of_another_format_next_to_a_live_engine(
    tmp_path: Path,
) -> None:
    old_layout, _ = filled_layout((32, 4096), seed=1, name="a")
    new_layout, t = filled_layout((32, 8192), seed=2, name="a")
    async with kvtier.TransferEngine(
        old_layout, engine_cfg(old_layout, 4, nvme_cfg(tmp_path))
    ) as old:
        await old.store(
            [kvtier.Chunk(key(i, 0), [2 * i, 2 * i + 1]) for i in range(3)], durable=True
        )
    new_cfg = engine_cfg(new_layout, 4, nvme_cfg(tmp_path))
    async with kvtier.TransferEngine(new_layout, new_cfg) as engine:
        await engine.store([kvtier.Chunk(key("n", 0), [0, 1])], durable=True)
        info = inspect_root(tmp_path)
        assert len(info["namespaces"]) == 2  # same namespace label, two formats
        by_lock = {n["locked_by_pid"] is not None: n for n in info["namespaces"]}
        live, stale = by_lock[True], by_lock[False]
        assert live["locked_by_pid"] == os.getpid()
        assert live["groups"][0]["valid_rows"] == 1
        assert live["groups"][0]["invalid_rows"] == 0
        assert stale["groups"][0]["valid_rows"] == 3
        assert stale["groups"][0]["invalid_rows"] == 0
        assert live["format"]["digest"] != stale["format"]["digest"]
        # the live one is refused, nothing deleted; the old one goes
        with pytest.raises(NamespaceLockedError):
            remove_namespace(tmp_path, live["directory"])
        res = CliRunner().invoke(cli_main, ["remove", "--yes", str(tmp_path), live["directory"]])
        assert res.exit_code == 1
        assert "live engine" in res.output
        assert remove_namespace(tmp_path, stale["directory"]) > 0
        assert [n["directory"] for n in inspect_root(tmp_path)["namespaces"]] == [live["directory"]]
        out = await engine.load([kvtier.Chunk(key("n", 0), [4, 5])])
        assert out.loaded == (key("n", 0),)
    assert same(t[4:6], t[0:2])
    # The old layout starts afresh: nothing of its rows is left.
    async with kvtier.TransferEngine(
        old_layout, engine_cfg(old_layout, 4, nvme_cfg(tmp_path))
    ) as old:
        assert old.lookup([key(i, 0) for i in range(3)]) == [R.MISS] * 3
    async with kvtier.TransferEngine(new_layout, new_cfg) as engine:
        assert engine.lookup([key("n", 0)]) == [R.NVME]


# ====================================================================== stats and bad input


# Regression: a promotion that finds no free CPU slot counts in ``rejected``, as a store that
# finds no slot does (not nowhere for prefetch, nor only in load_failures for a load); it is
# not a failed read (the row stays on NVMe), so ``failures`` stays empty.
async def test_a_promotion_without_a_free_slot_is_counted_as_rejected(tmp_path: Path) -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    k, x = key("k", 0), key("x", 0)
    async with kvtier.TransferEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path))) as engine:
        await engine.store([kvtier.Chunk(k, [0, 1])], durable=True)
    fault = KeyFault("write", "block", hashes=frozenset({x.block_hash}))
    cfg = engine_cfg(layout, 1, nvme_cfg(tmp_path, wrapper=Wrapper(fault)))
    try:
        async with kvtier.TransferEngine(layout, cfg) as engine:
            await engine.store([kvtier.Chunk(x, [2, 3])])  # the only slot: pinned by its write
            await await_for(lambda: fault.hits == 1, "the blocked write")
            before = engine.stats().rejected
            res = await engine.prefetch([k])
            st = engine.stats()
            fault.gate.set()
            assert isinstance(res.failed[k], KVTierError)
            assert st.rejected == before + 1
            assert st.nvme["promotion_failures"] == 0  # type: ignore[index]
            assert st.failures == {}
            assert engine.lookup([k]) == [R.NVME]  # still on NVMe
    finally:
        fault.gate.set()


async def test_stats_stay_consistent_after_read_and_write_failures_and_bad_input(
    tmp_path: Path,
) -> None:
    layout, t = filled_layout((48, 4096), seed=71, name="a")
    ref = t.clone()
    bad_read, bad_write, good = key("r", 0), key("w", 0), key("g", 0)
    async with kvtier.TransferEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path))) as engine:
        await engine.store(
            [kvtier.Chunk(bad_read, [0, 1]), kvtier.Chunk(good, [2, 3])], durable=True
        )
    wrap = Wrapper(
        KeyFault("read", "errno", hashes=frozenset({bad_read.block_hash}), err=errno.EIO, times=1),
        KeyFault(
            "write", "errno", hashes=frozenset({bad_write.block_hash}), err=errno.ENOSPC, times=1
        ),
    )
    async with kvtier.TransferEngine(
        layout, engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=wrap))
    ) as engine:
        t[20:24] = 0
        # (one call each: a request of one row fails its key at once, with no retry)
        res = await engine.load([kvtier.Chunk(bad_read, [20, 21])])
        assert res.loaded == ()
        assert isinstance(res.failed[bad_read], StorageError)
        res = await engine.load([kvtier.Chunk(good, [22, 23])])
        assert res.loaded == (good,)
        assert not bool(t[20:22].any())  # the failed key wrote nothing
        assert same(t[22:24], ref[2:4])
        st = engine.stats()
        assert st.load_failures == 1
        assert st.nvme_hits == 1
        assert st.misses == 0
        assert st.failures == {"eio": 1}
        assert st.nvme["failures_eio"] == 1
        assert st.nvme["promotion_failures"] == 1
        assert engine.lookup([bad_read]) == [R.MISS]  # dropped
        await engine.store([kvtier.Chunk(bad_write, [4, 5])])
        with pytest.raises(NotDurableError) as info:
            await engine.flush()
        assert set(info.value.failed) == {bad_write}
        st = engine.stats()
        assert st.nvme["write_failures"] == 1
        assert st.nvme["failures_enospc"] == 1
        assert engine.lookup([bad_write]) == [R.CPU]  # still loadable from CPU
        _consistent(st)
        assert st.slots_pinned == 0
        # Bad input now: every call raises a typed ValueError and changes nothing.
        before = engine.stats()
        where = engine.lookup([bad_read, bad_write, good])
        ranges = [engine.stored_range(k) for k in (bad_write, good)]
        snap = t.clone()
        ghost = kvtier.OffloadKey(b"\x07" * 8, 9)
        bad_calls: list[tuple[Callable[[], Any], type[InvalidArgumentError]]] = [
            (
                lambda: engine.store([kvtier.Chunk(good, [0, 1]), kvtier.Chunk(ghost, [0])]),
                UnknownGroupError,
            ),
            (
                lambda: engine.store(
                    [kvtier.Chunk(bad_read, [0, 1]), kvtier.Chunk(bad_read, [2, 3])]
                ),
                DuplicateKeyError,
            ),
            (lambda: engine.store([kvtier.Chunk(bad_read, [0, 48])]), BlockIdError),
            (lambda: engine.store([kvtier.Chunk(bad_read, [0, 1], offset=1)]), ChunkRangeError),
            (
                lambda: engine.load(
                    [kvtier.Chunk(good, [30, 31]), kvtier.Chunk(bad_write, [31, 32])]
                ),
                BlockIdError,
            ),
            (
                lambda: engine.load([kvtier.Chunk(good, [30, 31]), kvtier.Chunk(ghost, [33])]),
                UnknownGroupError,
            ),
            (lambda: engine.load(kvtier.Chunk(good, [30, 31])), InvalidArgumentError),  # type: ignore[arg-type]
            (lambda: engine.prefetch([good, good]), DuplicateKeyError),
            (lambda: engine.prefetch([good, ghost]), UnknownGroupError),
            (lambda: engine.prefetch(good), InvalidArgumentError),  # type: ignore[arg-type]
        ]
        for call, expected in bad_calls:
            with pytest.raises(expected) as exc_info:
                await call()
            assert isinstance(exc_info.value, ValueError)
            assert isinstance(exc_info.value, KVTierError)
        for sync_call in (
            lambda: engine.lookup([good, ghost]),
            lambda: engine.prefix_hits([ghost]),
            lambda: engine.stored_range(ghost),
            lambda: engine.stored_range("nope"),  # type: ignore[arg-type]
        ):
            with pytest.raises(InvalidArgumentError):
                sync_call()
        assert engine.stats() == before
        assert engine.lookup([bad_read, bad_write, good]) == where
        assert [engine.stored_range(k) for k in (bad_write, good)] == ranges
        assert torch.equal(t, snap)
        res = await engine.load([kvtier.Chunk(good, [40, 41]), kvtier.Chunk(bad_write, [42, 43])])
        assert set(res.loaded) == {good, bad_write}
        assert same(t[40:42], ref[2:4])
        assert same(t[42:44], ref[4:6])
        res = await engine.load([kvtier.Chunk(bad_read, [44, 45])])
        assert isinstance(res.failed[bad_read], KeyNotResidentError)
