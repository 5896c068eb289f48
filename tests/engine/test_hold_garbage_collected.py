"""A garbage-collected Hold is released, and ``rows_pinned``.

Only real seams: the public API, ``NVMeConfig(row_io_wrapper=...)`` RowIO
wrappers over the real backend, real threads, the real cyclic GC, real
``logging`` handlers, real child processes. A test whose docstring starts
"Regression" guards against a bug the Hold once had; every other test is a
guarantee.

The child processes run this module:
``python -m tests.engine.test_hold_garbage_collected child MODE``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import gc
import logging
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
from prometheus_client import CollectorRegistry

import kvtier
from kvtier.metrics import register_prometheus
from tests.engine.helpers import (
    Gate,
    chunk_chain,
    keys_of,
    logged,
    loop_errors,
    nvme_only,
    nvme_rows,
    one_group,
    settle,
    until,
)

M, C, N = kvtier.Residency.MISS, kvtier.Residency.CPU, kvtier.Residency.NVME
WARNING = "garbage-collected without release()"
REPO = Path(__file__).resolve().parents[2]


def _waituntil(cond: Any, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return bool(cond())


@contextlib.contextmanager
def _unraisable() -> Iterator[list[Any]]:
    """Collect exceptions raised in ``__del__`` ("Exception ignored in ...")."""
    seen: list[Any] = []
    old = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append((u.exc_type, u.exc_value, u.object))
    try:
        yield seen
    finally:
        sys.unraisablehook = old


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    """Only explicit gc.collect() calls collect cycles (on the thread that makes them)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Cycle:
    """A request object in a reference cycle that owns a Hold."""

    def __init__(self, held: kvtier.Hold) -> None:
        self.held = held
        self.me = self


# ===================================================================== pin counts


async def test_a_dropped_hold_leaves_the_pins_of_another_hold_and_a_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 * slot, 1)) as engine:
        chain = chunk_chain("a", 3, 0)
        await engine.store(chain)
        box = [engine.hold([*keys_of(chain), chain[2].key])]  # a2 twice: pinned twice
        other = engine.hold(keys_of(chain[:2]))
        assert engine.stats().slots_pinned == 3
        # a load of the chain pins it too; the first hold is dropped while the load runs
        loading = asyncio.ensure_future(
            engine.load([kvtier.Chunk(c.key, [40 + i]) for i, c in enumerate(chain)])
        )
        await asyncio.sleep(0)
        box.clear()
        gc.collect()
        out = await loading
        assert out.loaded == tuple(keys_of(chain))
        await settle()
        assert logged(caplog, WARNING) == 1
        # `other` still pins a0 and a1; a2 is evictable again
        assert engine.stats().slots_pinned == 2
        res = await engine.store(chunk_chain("x", 3, 10))
        assert len(res.stored) == 2
        assert len(res.rejected) == 1
        assert engine.lookup(keys_of(chain)) == [C, C, M]
        other.release()
        assert engine.stats().slots_pinned == 0
        res = await engine.store(chunk_chain("y", 4, 20))
        assert len(res.stored) == 4  # every slot can be taken: no pin was left behind
    assert logged(caplog, WARNING) == 1


async def test_two_holds_of_one_row_count_it_once_and_a_drop_leaves_the_other(
    tmp_path: Path,
) -> None:
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(4 * slot, 1, nvme=nvme_rows(tmp_path, slot, 2))
    a = chunk_chain("a", 1, 0)
    await nvme_only(layout, config, a)
    async with kvtier.TransferEngine(layout, config) as engine:
        registry = CollectorRegistry()
        register_prometheus(engine, registry)
        box = [engine.hold(keys_of(a))]
        kept = engine.hold(keys_of(a))
        assert kept.residency == (N,)
        assert engine.stats().nvme["rows_pinned"] == 1  # rows, not pins
        box.clear()
        gc.collect()
        await settle()
        assert engine.stats().nvme["rows_pinned"] == 1
        assert registry.get_sample_value("kvtier_nvme_rows_pinned") == 1
        # a held row is not taken: the tier has one free row for two writes
        with pytest.raises(kvtier.errors.NotDurableError):
            await engine.store(chunk_chain("x", 2, 10), durable=True)
        assert engine.lookup(keys_of(a)) == [N]
        kept.release()
        assert engine.stats().nvme["rows_pinned"] == 0
        assert registry.get_sample_value("kvtier_nvme_rows_pinned") == 0


async def test_many_holds_dropped_at_once_and_from_many_threads_return_every_pin(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Thousands of holds over CPU and NVMe-only keys: every pin comes back, once.

    One warning for the first dropped hold; every one is counted in
    ``stats().holds_dropped`` (a burst of aborted requests does not flood the log).
    """
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(4 * slot, 1, nvme=nvme_rows(tmp_path, slot, None))
    chain = chunk_chain("a", 8, 0)
    await nvme_only(layout, config, chain[:4])
    async with kvtier.TransferEngine(layout, config) as engine:
        await engine.store(chain[4:])
        registry = CollectorRegistry()
        register_prometheus(engine, registry)
        holds = [engine.hold(keys_of(chain)) for _ in range(2000)]
        assert holds[0].residency == (N,) * 4 + (C,) * 4
        assert engine.stats().slots_pinned == 4
        assert engine.stats().nvme["rows_pinned"] == 4
        # half dropped here at once, half on eight threads at once
        shares = [holds[1000 + i :: 8] for i in range(8)]
        del holds[1000:]
        barrier = threading.Barrier(8)

        def drop(share: list[kvtier.Hold]) -> None:
            barrier.wait(10)
            share.clear()
            gc.collect()

        threads = [threading.Thread(target=drop, args=(s,)) for s in shares]
        del shares
        for th in threads:
            th.start()
        holds.clear()
        for th in threads:
            th.join(30)
        assert await until(lambda: engine.stats().slots_pinned == 0)
        assert await until(lambda: engine.stats().nvme["rows_pinned"] == 0)
        await settle()
        assert engine.stats().slots_pinned == 0
        assert registry.get_sample_value("kvtier_nvme_rows_pinned") == 0
        assert logged(caplog, WARNING) == 1
        assert engine.stats().holds_dropped == 2000
        assert registry.get_sample_value("kvtier_holds_dropped_total") == 2000
        # nothing is pinned twice or left: new keys evict every CPU key
        res = await engine.store(chunk_chain("x", 4, 20))
        assert len(res.stored) == 4
        assert C not in engine.lookup(keys_of(chain[4:]))  # written through: on NVMe now


# ===================================================================== loads in flight


async def test_a_hold_dropped_while_its_nvme_key_is_read_keeps_the_row_until_the_read_ends(
    tmp_path: Path,
) -> None:
    layout, t, slot = one_group()
    gate = Gate()
    config = kvtier.EngineConfig(
        4 * slot, 1, nvme=nvme_rows(tmp_path, slot, None, row_io_wrapper=gate.wrap)
    )
    a = chunk_chain("a", 2, 0)
    await nvme_only(layout, config, a)
    async with kvtier.TransferEngine(layout, config) as engine:
        box = [engine.hold(keys_of(a))]
        assert engine.stats().nvme["rows_pinned"] == 2
        gate.armed = True
        first = asyncio.ensure_future(engine.load([kvtier.Chunk(a[0].key, [40])]))
        assert await until(gate.reading.is_set)
        # a second load of a0 waits for the promotion in flight
        second = asyncio.ensure_future(engine.load([kvtier.Chunk(a[0].key, [41])]))
        await settle()
        assert not second.done()
        box.clear()
        gc.collect()
        await settle()
        # a1 is free again; a0's row is still read
        assert engine.stats().nvme["rows_pinned"] == 1
        gate.opened.set()
        assert (await first).loaded == (a[0].key,)
        assert (await second).loaded == (a[0].key,)
        assert engine.stats().nvme["rows_pinned"] == 0
        assert engine.stats().slots_pinned == 0
        assert bytes(t[41].numpy()) == bytes(t[0].numpy())


async def test_rows_pinned_with_reads_in_flight_and_after_failed_reads(tmp_path: Path) -> None:
    layout, _, slot = one_group()
    gate = Gate()
    config = kvtier.EngineConfig(
        4 * slot, 1, nvme=nvme_rows(tmp_path, slot, 3, row_io_wrapper=gate.wrap)
    )
    a = chunk_chain("a", 3, 0)
    await nvme_only(layout, config, a)
    async with kvtier.TransferEngine(layout, config) as engine:
        registry = CollectorRegistry()
        register_prometheus(engine, registry)
        gate.armed = True
        gate.fail = True
        box = [engine.hold(keys_of(a[:1]))]
        loads = [
            asyncio.ensure_future(engine.load([kvtier.Chunk(c.key, [40 + i])]))
            for i, c in enumerate(a[:2])
        ]
        assert await until(gate.reading.is_set)
        await settle()
        assert engine.stats().nvme["rows_pinned"] == 2  # a0 (hold and read), a1 (read)
        assert registry.get_sample_value("kvtier_nvme_rows_pinned") == 2
        gate.opened.set()
        outs = await asyncio.gather(*loads)
        assert all(o.failed for o in outs)
        assert engine.lookup(keys_of(a)) == [M, M, N]
        # a0's failed row is still held (a zombie row counts); a1's is free
        assert engine.stats().nvme["rows_pinned"] == 1
        box.clear()
        gc.collect()
        await settle()
        assert engine.stats().nvme["rows_pinned"] == 0
        assert registry.get_sample_value("kvtier_nvme_rows_pinned") == 0
        kept = engine.hold(keys_of(a[2:]))  # held at close
        assert engine.stats().nvme["rows_pinned"] == 1
        # both failed rows can be taken again, and a2's is untouched
        res = await engine.store(chunk_chain("x", 2, 10), durable=True)
        assert len(res.stored) == 2
        assert engine.lookup(keys_of(a)) == [M, M, N]
    assert kept.released
    assert engine.stats().nvme["rows_pinned"] == 0  # aclose released it before the tier closed


# ===================================================================== GC anywhere


async def test_a_hold_dropped_in_a_done_callback_and_by_gc_on_a_read_thread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Collected in a load's done callback (the loop) and, in a cycle, by a gc.collect() that
    runs on the executor thread of an NVMe read: both released once, on the loop."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    gate = Gate()
    config = kvtier.EngineConfig(
        4 * slot, 1, nvme=nvme_rows(tmp_path, slot, None, row_io_wrapper=gate.wrap)
    )
    a, b = chunk_chain("a", 1, 0), chunk_chain("b", 1, 1)
    await nvme_only(layout, config, a)
    with _gc_off(), loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            await engine.store(b)
            box = [engine.hold(keys_of(b))]
            cyc = _Cycle(engine.hold([*keys_of(a), *keys_of(b)]))
            del cyc  # unreachable now, collected by the read thread below
            collected_on: list[str] = []

            def collect_on_the_read_thread() -> float:  # runs in the read, before it
                gc.collect()
                collected_on.append(threading.current_thread().name)
                return 0.0

            gate.delay = collect_on_the_read_thread
            loading = asyncio.ensure_future(engine.load([kvtier.Chunk(a[0].key, [40])]))
            loading.add_done_callback(lambda _: (box.clear(), gc.collect()))
            out = await loading
            gate.delay = None
            assert out.loaded == (a[0].key,)
            assert collected_on
            assert collected_on[0] != threading.current_thread().name
            await settle()
            assert not box
            await engine.flush()  # b's write-through pins its slot until written
            assert engine.stats().slots_pinned == 0
            assert engine.stats().nvme["rows_pinned"] == 0
            assert logged(caplog, WARNING) == 1
            assert engine.stats().holds_dropped == 2
            res = await engine.store(chunk_chain("x", 4, 10))
            assert len(res.stored) == 4  # every slot free or evictable
    assert not errors


async def test_holds_collected_at_any_allocation_while_the_engine_works(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """gen-0 collections every few allocations: Hold.__del__ runs in the middle of the
    engine's own code (stores, loads, promotions, holds, releases)."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    config = kvtier.EngineConfig(6 * slot, 1, nvme=nvme_rows(tmp_path, slot, None))
    base = chunk_chain("n", 6, 0)
    await nvme_only(layout, config, base)
    threshold = gc.get_threshold()
    dropped = 0
    with loop_errors() as errors:
        async with kvtier.TransferEngine(layout, config) as engine:
            gc.set_threshold(5, 2, 2)
            try:
                for i in range(60):
                    chain = chunk_chain(f"s{i}", 2, 10 + (i % 20) * 2)
                    await engine.store(chain, durable=i % 3 == 0)
                    keys = [*keys_of(chain), base[i % 6].key]
                    _Cycle(engine.hold(keys))  # a cycle: dropped unreleased
                    dropped += 1
                    with engine.hold(keys):  # released
                        pass
                    out = await engine.load([kvtier.Chunk(base[(i + 1) % 6].key, [60])])
                    assert out.failed == {} or all(
                        isinstance(e, kvtier.errors.KeyNotResidentError)
                        for e in out.failed.values()
                    )
            finally:
                gc.set_threshold(*threshold)
            gc.collect()
            assert await until(lambda: engine.stats().holds_dropped == dropped)
            assert logged(caplog, WARNING) == 1
            await settle()
            await engine.flush()  # write-through pins a stored slot until written
            assert engine.stats().slots_pinned == 0
            assert engine.stats().nvme["rows_pinned"] == 0
    assert not errors


# ===================================================================== logging


async def test_a_dropped_hold_is_released_with_logging_disabled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(2 * slot, 1)) as engine:
        a = chunk_chain("a", 2, 0)
        await engine.store(a)
        box = [engine.hold(keys_of(a))]
        logging.disable(logging.CRITICAL)
        try:
            box.clear()
            gc.collect()
            await settle()
        finally:
            logging.disable(logging.NOTSET)
        assert logged(caplog, WARNING) == 0
        assert engine.stats().slots_pinned == 0


async def test_a_raising_log_handler_does_not_keep_a_dropped_hold_pinned() -> None:
    """Regression: a log handler that raises does not skip the release (as it did when
    the warning was logged before the release was scheduled, in one suppress block,
    and the hold's slots stayed pinned). Nothing is logged in ``__del__``; the release
    runs first, on the loop, and a raising handler changes nothing.
    """

    class Broken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:  # a log sink that is down
            raise ConnectionError("log collector unreachable")

    handler = Broken()
    logger = logging.getLogger("kvtier")
    layout, _, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(2 * slot, 1)) as engine:
        a = chunk_chain("a", 2, 0)
        await engine.store(a)
        box = [engine.hold(keys_of(a))]
        logger.addHandler(handler)
        try:
            box.clear()
            gc.collect()
        finally:
            logger.removeHandler(handler)
        await settle()
        assert engine.stats().slots_pinned == 0


# ===================================================================== close races


async def test_a_hold_dropped_on_another_thread_while_aclose_runs_is_released_once(
    tmp_path: Path,
) -> None:
    """Regression: released once, not twice, when aclose() runs while ``__del__`` runs.

    CPython clears a dying object's weak references only after ``__del__``
    returns, so ``aclose`` can find the dying hold in the engine's WeakSet and
    release it, and the release that ``__del__`` then schedules must not release
    the same pins again (``SlotStateError``, or the NVMe writer's pin of the slot
    taken). Both ways go through the hold's one ``_Pins``, released once.
    The window is held open by a wrapper around ``engine._hold_dropped`` (what
    ``Hold.__del__`` calls) that waits on the dropping thread.
    """
    layout, _, slot = one_group()
    gate = Gate()
    config = kvtier.EngineConfig(
        4 * slot, 1, nvme=nvme_rows(tmp_path, slot, None, row_io_wrapper=gate.wrap)
    )
    a, b = chunk_chain("a", 1, 0), chunk_chain("b", 1, 1)
    await nvme_only(layout, config, b)
    entered, go = threading.Event(), threading.Event()
    engine = await kvtier.TransferEngine(layout, config).start()
    dropped = engine._hold_dropped

    def slow_drop(*args: Any) -> None:  # inside Hold.__del__ on the dropping thread
        if threading.current_thread().name == "dropper":
            entered.set()
            go.wait(10)
        dropped(*args)

    engine._hold_dropped = slow_drop  # type: ignore[method-assign]
    try:
        with loop_errors() as errors:
            await engine.store(a)
            box = [engine.hold(keys_of(a))]
            assert engine.stats().slots_pinned == 1
            # a promotion in flight keeps aclose() busy (it waits for the load)
            gate.armed = True
            loading = asyncio.ensure_future(engine.load([kvtier.Chunk(b[0].key, [40])]))
            assert await until(gate.reading.is_set)
            dropper = threading.Thread(target=box.pop, name="dropper")  # the last reference
            dropper.start()
            assert await until(entered.is_set)  # inside Hold.__del__
            closing = asyncio.ensure_future(engine.aclose())
            await settle()  # aclose released the (dying) hold
            go.set()  # __del__ schedules its release now
            await asyncio.to_thread(dropper.join, 10)
            await settle()
            gate.opened.set()
            await asyncio.wait_for(closing, 30)
            out = await loading
            assert out.loaded == (b[0].key,)
    finally:
        go.set()
        gate.opened.set()
        await engine.aclose()
    assert not errors, [ctx.get("exception") for ctx in errors]
    assert engine.stats().holds_dropped == 0  # aclose released it first


async def test_a_copy_of_a_hold_does_not_release_the_original_pins() -> None:
    """Regression: ``copy.copy(hold)`` must not make a second Hold over the same pins,
    whose collection would release the original's. A Hold refuses to be copied or pickled.
    """
    layout, _, slot = one_group()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(2 * slot, 1)) as engine:
        a = chunk_chain("a", 2, 0)
        await engine.store(a)
        held = engine.hold(keys_of(a))
        for dup in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="Hold cannot be"):
                dup(held)  # e.g. a request object copied with its hold
        gc.collect()
        await settle()
        assert engine.stats().slots_pinned == 2
        held.release()
        assert engine.stats().slots_pinned == 0


# ===================================================================== BackgroundEngine


def test_background_engine_release_then_drop_and_drop_after_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    layout, _, slot = one_group()
    a = chunk_chain("a", 2, 0)
    with _unraisable() as unraisable:
        bg = kvtier.BackgroundEngine(layout, kvtier.EngineConfig(4 * slot, 1)).start()
        try:
            bg.store(a).result(30)
            released = [bg.hold(keys_of(a))]
            released[0].release()
            released.clear()  # released, then dropped: nothing more
            gc.collect()
            # dropped in a done callback, on the engine thread
            box = [bg.hold(keys_of(a))]
            fired = threading.Event()

            def on_done(_: concurrent.futures.Future[Any]) -> None:
                box.clear()
                gc.collect()
                fired.set()

            bg.store(chunk_chain("c", 1, 5)).add_done_callback(on_done)
            assert fired.wait(30)
            assert _waituntil(lambda: bg.stats().slots_pinned == 0)
            assert logged(caplog, WARNING) == 1
            # held at close: close releases; dropped on other threads after close
            late = [bg.hold(keys_of(a)), bg.hold(keys_of(a))]
            late[1].release()
        finally:
            bg.close()
        assert late[0].released
        late[0].release()  # nothing to do
        threads = [threading.Thread(target=late.pop) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        gc.collect()
    assert not late
    assert not unraisable
    assert logged(caplog, WARNING) == 1


# ===================================================================== child processes


def _child_engine(root: str) -> tuple[kvtier.KVLayout, kvtier.EngineConfig]:
    layout, _, slot = one_group()
    return layout, kvtier.EngineConfig(4 * slot, 1, nvme=nvme_rows(Path(root), slot, None))


def _child(mode: str, root: str) -> None:  # pragma: no cover - runs in a child process
    layout, config = _child_engine(root)
    chain = chunk_chain("a", 2, 0)
    if mode == "exit_holding":
        # never released, never closed: module globals, a cycle, an asyncio engine
        bg = kvtier.BackgroundEngine(layout, config).start()
        bg.store(chain, durable=True).result(30)
        globals()["HELD"] = bg.hold(keys_of(chain))
        globals()["CYCLE"] = _Cycle(bg.hold(keys_of(chain)))
        globals()["BG"] = bg

        async def open_engine() -> None:
            small = kvtier.EngineConfig(config.cpu_bytes, 1)
            engine = await kvtier.TransferEngine(layout, small).start()
            await engine.store(chain)
            globals()["HELD2"] = engine.hold(keys_of(chain))
            globals()["ENGINE2"] = engine

        asyncio.run(open_engine())  # the loop closes with the engine open
        print("exiting", flush=True)
    elif mode == "after_loops":
        # a TransferEngine whose loop closed (never aclose'd); a hold dropped on a thread
        async def open_engine() -> kvtier.Hold:
            small = kvtier.EngineConfig(config.cpu_bytes, 1)
            engine = await kvtier.TransferEngine(layout, small).start()
            await engine.store(chain)
            globals()["ENGINE2"] = engine
            return engine.hold(keys_of(chain))

        for factory in (asyncio.new_event_loop, uvloop.new_event_loop):
            loop = factory()
            box = [loop.run_until_complete(open_engine())]
            loop.close()
            th = threading.Thread(target=box.pop)
            th.start()
            th.join()
        # a BackgroundEngine: logging shut down, then a dropped hold is still released
        with kvtier.BackgroundEngine(layout, config) as bg:
            bg.store(chain).result(30)
            logging.shutdown()
            box = [bg.hold(keys_of(chain))]
            box.clear()
            gc.collect()
            assert _waituntil(lambda: bg.stats().slots_pinned == 0), "still pinned"
            box = [bg.hold(keys_of(chain))]
        # closed: dropped on another thread
        th = threading.Thread(target=box.pop)
        th.start()
        th.join()
        print("done", flush=True)
    elif mode == "late_module":
        bg = kvtier.BackgroundEngine(layout, config).start()
        bg.store(chain).result(30)
        # referenced from a module imported before kvtier, that lives to the last phase of
        # interpreter shutdown (as a framework's registry of requests could be)
        import collections

        collections._kvtier_requests = [bg.hold(keys_of(chain))]  # type: ignore[attr-defined]
        print("exiting", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


def _run_children(tmp_path: Path, modes: list[str]) -> dict[str, subprocess.CompletedProcess[str]]:
    procs = {}
    for mode in modes:
        root = tmp_path / mode
        root.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "tests.engine.test_hold_garbage_collected",
            "child",
            mode,
            str(root),
        ]
        procs[mode] = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[mode] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def _noise(stderr: str) -> list[str]:
    bad = ("Exception ignored", "Traceback", "Error")
    return [line for line in stderr.splitlines() if any(b in line for b in bad)]


def test_exit_holding_and_holds_dropped_after_their_loop_closed_print_no_error(
    tmp_path: Path,
) -> None:
    done = _run_children(tmp_path, ["exit_holding", "after_loops"])
    exit_holding, after = done["exit_holding"], done["after_loops"]
    assert exit_holding.returncode == 0, exit_holding.stderr[-3000:]
    assert "exiting" in exit_holding.stdout
    assert not _noise(exit_holding.stderr), exit_holding.stderr[-3000:]
    assert after.returncode == 0, after.stderr[-3000:]
    assert "done" in after.stdout
    assert not _noise(after.stderr), after.stderr[-3000:]


def test_a_hold_collected_after_module_teardown_prints_no_error(tmp_path: Path) -> None:
    """Regression: ``__del__`` looks nothing up in module globals, which are None once
    shutdown clears the module (``contextlib.suppress`` there once printed "Exception
    ignored in Hold.__del__").
    """
    late = _run_children(tmp_path, ["late_module"])["late_module"]
    assert late.returncode == 0, late.stderr[-3000:]
    assert "exiting" in late.stdout
    assert not _noise(late.stderr), late.stderr[-3000:]


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    _child(sys.argv[2], sys.argv[3])
