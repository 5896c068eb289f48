"""The copy phases and the scheduling overhead.

``store`` and ``load`` between the device blocks and the CPU slots, one call
at a time and pipelined, against a plain torch copy of the same bytes and
plain torch indexing of the same blocks; and the engine's time per chunk
when the copy itself costs almost nothing.
"""

from __future__ import annotations

import statistics
import time

import torch

import kvtier
from kvtier._shapes import LayerSpec, ModelShape
from kvtier._slots import HostRegion
from kvtier._transfer import ChunkCopy, PieceSpec, piece_specs, slot_views
from kvtier.bench.config import BenchConfig
from kvtier.bench.data import _batches, _check, _chunks, _digests, _scribble
from kvtier.bench.timing import Phase, _copy_pass
from kvtier.layout import KVLayout, round_up


async def _copy_phases(
    cfg: BenchConfig, layout: KVLayout, chunks: list[kvtier.Chunk], report: dict[str, Phase]
) -> None:
    bpc = cfg.blocks_per_chunk
    engine_cfg = kvtier.EngineConfig(
        len(chunks) * layout.slot_nbytes(bpc),
        bpc,
        max_batch_chunks=cfg.batch_chunks,
    )
    batches = _batches(chunks, cfg.batch_chunks)
    payload = sum(
        len(c.block_ids) * layout.group(c.key.group_id).block_payload_nbytes for c in chunks
    )
    # The plain-copy baseline moves the same bytes between two buffers as large
    # as the whole data set, a fresh window per batch, so neither side is warm
    # in the CPU caches (a repeated small copy would run from L2/L3).
    src = torch.empty(payload, dtype=torch.uint8, device=cfg.device).fill_(1)
    dst = HostRegion(round_up(payload), pin=True)
    dst.prefault()
    per_batch = min(cfg.batch_chunks, len(chunks))  # never more slots than chunks
    gather_region = HostRegion(per_batch * layout.slot_nbytes(bpc), pin=True)
    specs = {
        g: piece_specs(layout.group(g), layout.layer_offsets(g, bpc)) for g in layout.group_ids
    }
    gather_region.prefault()
    store, load = report["store"], report["load"]
    store.nbytes = load.nbytes = payload
    for phase in (store, load):
        phase.baselines["plain_copy"] = []
        phase.baselines["torch_gather"] = []
        phase.variants["pipelined"] = []
    sizes = [
        sum(len(c.block_ids) * layout.group(c.key.group_id).block_payload_nbytes for c in batch)
        for batch in batches
    ]

    def plain(direction: str) -> float:
        t0 = time.perf_counter()
        window = 0
        for n in sizes:
            if direction == "store":
                dst.tensor[window : window + n].copy_(src[window : window + n])
            else:
                src[window : window + n].copy_(dst.tensor[window : window + n])
            window += n
            if src.is_cuda:
                torch.cuda.synchronize()
        return time.perf_counter() - t0

    def gather(direction: str) -> float:
        t0 = time.perf_counter()
        for batch in batches:
            _torch_gather(layout, specs, batch, gather_region, bpc, direction)
        return time.perf_counter() - t0

    # Whole passes alternate inside every repeat: kvtier one call at a time,
    # the plain copy, the torch gather, then kvtier with ``inflight_batches``
    # calls in flight (how a serving loop overlaps the steps of its requests).
    # Alternating per batch instead slowed every kvtier call that followed a
    # torch-gather batch (measured on the 2-vCPU VM: stores 15-35% slower, the
    # same with OMP_NUM_THREADS=1), so passes alternate as in the NVMe phases.
    # kvtier's loads put back every byte its stores took (checked after each
    # pass, not timed); the torch-gather load scatters ONE batch of slots into
    # every batch's blocks, so an untimed kvtier load restores the cache after it.
    original = _digests(layout)

    def check(what: str) -> None:
        _check(_digests(layout) == original, f"bench {what}: the KV cache changed bytes")

    for _ in range(cfg.repeat):
        async with kvtier.TransferEngine(layout, engine_cfg) as engine:
            for direction, phase in (("store", store), ("load", load)):
                if direction == "load":
                    _scribble(layout)  # not timed: the load must write every byte back
                phase.seconds.append(await _copy_pass(engine, batches, direction, 1, phase))
                if direction == "load":
                    check("store -> load")
                phase.baselines["plain_copy"].append(plain(direction))
                phase.baselines["torch_gather"].append(gather(direction))
            await _copy_pass(engine, batches, "load", cfg.inflight_batches, None)
            check("restore after the torch-gather load")
        async with kvtier.TransferEngine(layout, engine_cfg) as engine:
            for direction, phase in (("store", store), ("load", load)):
                if direction == "load":
                    _scribble(layout)
                phase.variants["pipelined"].append(
                    await _copy_pass(engine, batches, direction, cfg.inflight_batches, None)
                )
            check("pipelined store -> load")
    dst.close()
    gather_region.close()


def _torch_gather(
    layout: KVLayout,
    specs: dict[int, tuple[PieceSpec, ...]],
    batch: list[kvtier.Chunk],
    region: HostRegion,
    bpc: int,
    direction: str,
) -> None:
    """Baseline: the same blocks moved with plain torch indexing, one call per chunk and layer.

    What a serving engine writes without kvtier: ``slot.copy_(kv[block_ids])``
    to store and ``kv[block_ids] = slot`` to load, into the same slot layout.
    """
    slot_nbytes = layout.slot_nbytes(bpc)
    for i, c in enumerate(batch):
        g = c.key.group_id
        copy = ChunkCopy(
            specs[g],
            region.views,
            i * slot_nbytes,
            c.block_ids,
            c.offset,
            0,
        )
        idx = torch.tensor(c.block_ids, device=layout.device)
        for spec in copy.specs:
            gpu, slot = slot_views(copy, spec)
            if direction == "store":
                slot.copy_(gpu[idx])
            else:  # index_put_ takes its values on the destination's device
                gpu[idx] = slot.to(gpu.device)
    if layout.device.type == "cuda":
        torch.cuda.synchronize()


async def _scheduling_overhead(
    cfg: BenchConfig, shape: ModelShape, nchunks: int
) -> dict[str, float]:
    """Engine time per chunk when the copy itself costs ~nothing (16-byte pages).

    Same groups, layers, chunk count and batching as the data set, so this is
    what kvtier adds per chunk (validation, slot bookkeeping, job coalescing,
    thread hand-off, one vectorised call per layer) on top of the copy.
    """
    tiny = ModelShape(
        shape.name,
        tuple(LayerSpec(lay.kind, (16,)) for lay in shape.layers),
        torch.uint8,
        shape.tokens_per_block,
    )
    bpc = cfg.blocks_per_chunk
    groups = len(tiny.groups())
    layout = tiny.build(bpc * (nchunks // groups + 1), cfg.device)
    chunks = _chunks(layout, tiny, bpc, cfg.seed, cfg.block_order)
    batches = _batches(chunks, cfg.batch_chunks)
    ecfg = kvtier.EngineConfig(
        len(chunks) * layout.slot_nbytes(bpc), bpc, max_batch_chunks=cfg.batch_chunks
    )
    runs: dict[str, list[float]] = {"store": [], "load": []}
    for _ in range(max(3, cfg.repeat)):  # the median: a lone pass may catch a pause
        async with kvtier.TransferEngine(layout, ecfg) as engine:
            for direction, secs in runs.items():
                secs.append(await _copy_pass(engine, batches, direction, 1, None))
    return {d: round(1e6 * statistics.median(secs) / len(chunks), 2) for d, secs in runs.items()}
