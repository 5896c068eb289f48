"""The NVMe phases.

``nvme_write`` on a fresh and on a full tier, ``nvme_write_e2e`` and
``nvme_read`` with ``cold_load``, each alternating with its baselines inside
every repeat, and every row read back and compared with the bytes the bench
generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import kvtier
from kvtier.bench.baselines import Baselines, drop_tree_cache
from kvtier.bench.config import SEGMENT_NBYTES, BenchConfig
from kvtier.bench.data import layout_digests, require, scribble_pages, split_batches
from kvtier.bench.timing import LagMonitor, Phase, copy_pass
from kvtier.layout import KVLayout, round_up

NVME_STEPS_PER_REPEAT = 12
"""``progress`` calls of one repeat of :func:`run_nvme_phases`."""


async def _in_thread(fn: Callable[..., float], *args: Any) -> float:
    """``fn(*args)`` on a worker thread; if the caller is cancelled, only once it ended.

    A baseline's thread keeps writing under the bench's temporary folder after
    its awaiting task is cancelled (SIGTERM, Ctrl-C): the folder may be
    removed only once the thread is done with it.
    """
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(fut)
        raise


async def run_nvme_phases(
    cfg: BenchConfig,
    layout: KVLayout,
    chunks: list[kvtier.Chunk],
    report: dict[str, Phase],
    lag: LagMonitor,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Time the NVMe phases (write, write-through, read, full-tier rewrite) against raw I/O.

    Args:
        cfg: The run's options (root, backend, request size, repeats).
        layout: The GPU-side layout whose blocks are stored.
        chunks: Every chunk of the data set (:func:`~kvtier.bench.data.make_chunks`).
        report: The phases by name; their samples and baselines are filled in.
        lag: The event-loop lag monitor of the run.
        progress: Called once per step (:data:`NVME_STEPS_PER_REPEAT` per repeat).

    Returns:
        What the run found about the disk: ``tmpdir``, ``direct_io``, ``backend``.

    Raises:
        AssertionError: Rows read back differ from what was stored.
    """
    bpc = cfg.blocks_per_chunk
    base_root = cfg.root or os.getcwd()
    tmp = tempfile.mkdtemp(prefix="kvtier-bench-", dir=base_root)
    info: dict[str, Any] = {"tmpdir": tmp}
    loop = asyncio.get_running_loop()
    baselines: Baselines | None = None
    try:
        rows = {g: round_up(layout.group_nbytes(g, bpc)) + 4096 for g in layout.group_ids}
        row_bytes = sum(rows[c.key.group_id] for c in chunks)
        write, e2e, read = report["nvme_write"], report["nvme_write_e2e"], report["nvme_read"]
        full = report["nvme_write_full"]
        write.nbytes = e2e.nbytes = read.nbytes = full.nbytes = row_bytes
        full.baselines = {"raw_rewrite": [], "raw_rewrite_xxh3": []}
        e2e.baselines = {"raw_sequential": [], "raw_checksummed": []}
        baselines = Baselines(cfg, tmp, row_bytes, max(rows.values()), len(chunks))
        info["direct_io"] = baselines.io.direct
        info["backend"] = type(baselines.io).__name__
        for phase in (write, read):
            phase.baselines = {"raw_sequential": [], "raw_checksummed": [], "file_per_chunk": []}
        read.variants["cold_load"] = []
        original = layout_digests(layout)  # the bytes the copy phases checked and left
        for r in range(cfg.repeat):
            root = os.path.join(tmp, f"tier{r}")
            nvme = kvtier.NVMeConfig(
                root=root,
                capacity_bytes=2 * row_bytes + len(rows) * SEGMENT_NBYTES,
                namespace=f"bench{r}",
                io_backend=cfg.io_backend,
                direct_io=cfg.direct_io,
                io_threads=cfg.io_threads,
                request_nbytes=cfg.request_nbytes,
                segment_nbytes=SEGMENT_NBYTES,
            )
            ecfg = kvtier.EngineConfig(
                len(chunks) * layout.slot_nbytes(bpc),
                bpc,
                nvme=nvme,
                max_batch_chunks=cfg.batch_chunks,
            )
            progress(f"repeat {r + 1}/{cfg.repeat}: raw sequential write")
            write.baselines["raw_sequential"].append(await _in_thread(baselines.raw_write))
            progress(f"repeat {r + 1}/{cfg.repeat}: raw sequential write, checksummed")
            write.baselines["raw_checksummed"].append(await _in_thread(baselines.raw_write, True))
            progress(f"repeat {r + 1}/{cfg.repeat}: kvtier CPU -> NVMe")
            staged = dataclasses.replace(ecfg, write_through=False)
            async with kvtier.TransferEngine(layout, staged) as engine:
                await _write_leg(engine, chunks, cfg, (write, lag))
            progress(f"repeat {r + 1}/{cfg.repeat}: raw rewrite")
            full.baselines["raw_rewrite"].append(await _in_thread(baselines.raw_rewrite))
            progress(f"repeat {r + 1}/{cfg.repeat}: raw rewrite, hashed")
            full.baselines["raw_rewrite_xxh3"].append(await _in_thread(baselines.raw_rewrite, True))
            progress(f"repeat {r + 1}/{cfg.repeat}: kvtier CPU -> NVMe, full tier")
            await _full_tier_write(layout, ecfg, chunks, full, lag, cfg, original, root + "-full")
            progress(f"repeat {r + 1}/{cfg.repeat}: kvtier store + write-through")
            e2e_root = root + "-e2e"
            e2e_cfg = dataclasses.replace(ecfg, nvme=dataclasses.replace(nvme, root=e2e_root))
            async with kvtier.TransferEngine(layout, e2e_cfg) as engine, lag.watch():
                t0 = time.perf_counter()
                for batch in split_batches(chunks, cfg.batch_chunks):
                    res = await engine.store(batch)
                    require(len(res.stored) == len(batch), "bench store rejected keys")
                await engine.flush()
                e2e.seconds.append(time.perf_counter() - t0)
                e2e.batch_seconds.extend(engine.write_batch_seconds)
                failures = engine.stats().nvme or {}
                require(failures.get("write_failures", 0) == 0, f"NVMe write failures: {failures}")
            # Not timed: the write-through rows load back, from NVMe, as the bytes stored.
            scribble_pages(layout)
            async with kvtier.TransferEngine(layout, e2e_cfg) as engine:
                require(
                    engine.prefix_hits([c.key for c in chunks]) == len(chunks),
                    "bench write-through rows missing on NVMe",
                )
                await copy_pass(
                    engine,
                    split_batches(chunks, cfg.batch_chunks),
                    "load",
                    cfg.inflight_batches,
                    None,
                )
            require(
                layout_digests(layout) == original,
                "round trip store + write-through -> NVMe -> load changed bytes",
            )
            shutil.rmtree(e2e_root, ignore_errors=True)
            for name in e2e.baselines:
                e2e.baselines[name].append(write.baselines[name][-1])
            progress(f"repeat {r + 1}/{cfg.repeat}: file-per-chunk write")
            write.baselines["file_per_chunk"].append(await _in_thread(baselines.files_write))

            progress(f"repeat {r + 1}/{cfg.repeat}: raw sequential read")
            read.baselines["raw_sequential"].append(await _in_thread(baselines.raw_read))
            progress(f"repeat {r + 1}/{cfg.repeat}: raw sequential read, checksummed")
            read.baselines["raw_checksummed"].append(await _in_thread(baselines.raw_read, True))
            progress(f"repeat {r + 1}/{cfg.repeat}: kvtier cold promotion")
            batches = split_batches(chunks, cfg.batch_chunks)
            for direction in ("prefetch", "load"):
                if not baselines.io.direct:
                    drop_tree_cache(root)
                scribble_pages(layout)
                async with kvtier.TransferEngine(layout, ecfg) as engine, lag.watch():
                    require(
                        engine.prefix_hits([c.key for c in chunks]) == len(chunks),
                        "bench keys missing on NVMe",
                    )
                    timed = read if direction == "prefetch" else None
                    seconds = await copy_pass(
                        engine, batches, direction, cfg.inflight_batches, timed
                    )
                    if direction == "prefetch":
                        read.seconds.append(seconds)
                        # untimed: the GPU blocks get the promoted bytes for the check
                        await copy_pass(engine, batches, "load", cfg.inflight_batches, None)
                    else:
                        read.variants["cold_load"].append(seconds)
                require(
                    layout_digests(layout) == original,
                    f"round trip store -> NVMe -> {direction} changed bytes",
                )
            info["verified_repeats"] = r + 1
            progress(f"repeat {r + 1}/{cfg.repeat}: file-per-chunk read")
            read.baselines["file_per_chunk"].append(await _in_thread(baselines.files_read))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        if baselines is not None:
            baselines.close()  # its threads are done with the folder (_in_thread)
        shutil.rmtree(tmp, ignore_errors=True)
    info["tmpdir_removed"] = not await loop.run_in_executor(None, os.path.exists, tmp)
    return info


async def _write_leg(
    engine: kvtier.TransferEngine,
    chunks: list[kvtier.Chunk],
    cfg: BenchConfig,
    timed: tuple[Phase, LagMonitor] | None = None,
) -> None:
    """The CPU -> NVMe leg on an engine with ``write_through=False``.

    Every chunk is stored into the CPU tier (not timed), then
    ``store(chunks, durable=True)`` writes the rows of these resident keys and
    syncs them: the same batches, checksums and writes as write-through.
    ``timed``: the phase that gets the seconds and the per-batch latencies of
    the write, and the monitor of the event loop's lag during it.
    """
    for batch in split_batches(chunks, cfg.batch_chunks):  # device -> CPU, not timed
        res = await engine.store(batch)
        require(len(res.stored) == len(batch), "bench store rejected keys")
    first = len(engine.write_batch_seconds)
    async with timed[1].watch() if timed else contextlib.nullcontext():
        t0 = time.perf_counter()
        # Every key is resident and not yet on NVMe: this writes their rows.
        res = await engine.store(chunks, durable=True)
        seconds = time.perf_counter() - t0
    require(len(res.skipped) == len(chunks), "bench keys left the CPU tier")
    if timed:
        timed[0].seconds.append(seconds)
        timed[0].batch_seconds.extend(list(engine.write_batch_seconds)[first:])


async def _full_tier_write(
    layout: KVLayout,
    ecfg: kvtier.EngineConfig,
    chunks: list[kvtier.Chunk],
    phase: Phase,
    lag: LagMonitor,
    cfg: BenchConfig,
    original: list[int],
    root: str,
) -> None:
    """The CPU -> NVMe leg on a full tier: every row written evicts one (timed), then checked.

    A tier with room for exactly the data set is filled with every chunk (not
    timed), then the same blocks are stored under new keys, in another order,
    and written (``store(durable=True)``, timed as in ``nvme_write``): each row
    evicts one, mostly the oldest key of its own group (``eviction_window``;
    under strict LRU most often one of another group), as in a serving engine
    that has run long enough to fill its disk budget. Not timed: a new engine
    must find exactly the new keys the tier held at close, and no invalid row;
    it loads them from NVMe (the few that later new keys evicted come from
    ``ecfg``'s tier, written by the fresh-tier leg) and every tensor is
    compared with the bytes the bench generated.
    """
    assert ecfg.nvme is not None
    row_bytes = phase.nbytes
    nvme = dataclasses.replace(ecfg.nvme, root=root, capacity_bytes=row_bytes)
    staged = dataclasses.replace(ecfg, nvme=nvme, write_through=False)
    rng = random.Random(cfg.seed + 1)
    fresh = [
        kvtier.Chunk(kvtier.OffloadKey(b"full/" + c.key.block_hash, c.key.group_id), c.block_ids)
        for c in rng.sample(chunks, len(chunks))
    ]
    async with kvtier.TransferEngine(layout, staged) as engine:
        await _write_leg(engine, chunks, cfg)  # fill the tier, not timed
        await _write_leg(engine, fresh, cfg, (phase, lag))
        st = engine.stats().nvme or {}
        require(st.get("write_failures", 0) == 0, f"NVMe write failures: {st}")
        evictions = st.get("evictions", 0)
        require(
            isinstance(evictions, int) and evictions >= len(fresh),
            "the full tier evicted too few rows",
        )
        # of the leg's evictions (the fill evicts nothing), those that took the
        # writer's own group's key out of strict LRU order (eviction_window)
        window = st.get("window_evictions", 0)
        phase.counts.setdefault("window_evictions", []).append(
            window if isinstance(window, int) else 0
        )
        # A few of the first new keys may have been evicted by later ones (the
        # tier holds exactly the data set, and with NVMeConfig.eviction_window a
        # write evicts its own group's oldest key when it is among the oldest,
        # which late in the leg can be one of the first new keys while a key of
        # the fill is left). The live tier says which.
        tier = engine.nvme
        assert tier is not None
        kept = [c for c in fresh if tier.contains(c.key)]
    # Not timed: exactly those new keys load back from NVMe as the bytes stored
    # (a row written wrong is invalid at open, or fails its checksum); the
    # blocks of the evicted ones come back from the fresh-tier leg's tier
    # (``ecfg``: every chunk under its first key), so every tensor can be compared.
    scribble_pages(layout)
    async with kvtier.TransferEngine(layout, staged) as engine:
        on_nvme = engine.lookup([c.key for c in fresh])
        found = [
            c for c, where in zip(fresh, on_nvme, strict=True) if where is not kvtier.Residency.MISS
        ]
        invalid = (engine.stats().nvme or {}).get("invalid_rows_at_open", 0)
        require(
            found == kept and invalid == 0,
            f"the full tier's rows at reopen: {len(found)} of the {len(kept)} new keys it held, "
            f"{invalid} invalid rows",
        )
        await copy_pass(engine, split_batches(kept, cfg.batch_chunks), "load", 1, None)
    evicted = {c.key.block_hash[len(b"full/") :] for c in fresh} - {
        c.key.block_hash[len(b"full/") :] for c in kept
    }
    require(len(evicted) <= len(fresh) // 10, f"the full tier evicted {len(evicted)} new keys")
    phase.counts.setdefault("new_keys_evicted", []).append(len(evicted))
    if evicted:
        async with kvtier.TransferEngine(layout, ecfg) as engine:
            back = [c for c in chunks if c.key.block_hash in evicted]
            await copy_pass(engine, split_batches(back, cfg.batch_chunks), "load", 1, None)
    require(layout_digests(layout) == original, "store -> NVMe (full tier) -> load changed bytes")
    await asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, root, True)
