"""What issuing the copies costs per chunk: NumPy path, torch path batched, torch path per chunk.

On a CPU-only host the engine copies with NumPy on its copy threads; on a CUDA
host it issues torch calls from the event loop thread (a job runs as one
``run_plan`` on the copy stream). The torch path copies the chunks of a job
that share a group and sub-block range together through a device buffer
laid out like their slots: one ``index_select`` (store) or ``index_copy_``
(load) per piece for the batch, and one ``torch._foreach_copy_`` of one
contiguous copy per chunk. The ``per_chunk`` variant copies each chunk as a
batch of its own (``_torch_chunk``, what a load job that writes one page
twice does).

Pages of 16 bytes make the copy itself cost nothing, so the figure is the
time spent issuing it (validation, slot bookkeeping and the calls) per chunk,
as ``kvtier bench``'s "scheduling overhead". One copy thread, so that on
these CPU tensors a job is one ``run_plan`` call, as on a CUDA stream. The
variants alternate, 5 rounds; medians. On a GPU each call also launches a
kernel or a DMA, so this only hints at the loop thread's cost there
(``benchmarks/gpu_check.sh`` measures a real GPU).

    python benchmarks/torch_path.py --layout deepseek-v3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence

import torch

import kvtier
import kvtier._engine
import kvtier._transfer
from kvtier._shapes import LayerSpec, ModelShape, model_shape
from kvtier.bench.data import _batches, _chunks

NUMPY_PATH = kvtier._engine.host_pieces
BATCHED = kvtier._transfer._run_torch


def _per_chunk(
    plan: Sequence[kvtier._transfer.ChunkCopy], store: bool, aliasing: object = None
) -> None:
    for copy in plan:  # called as _run_torch(plan, store, aliasing)
        kvtier._transfer._torch_chunk(copy, store)


VARIANTS = {
    "numpy": (NUMPY_PATH, BATCHED),
    "torch": (None, BATCHED),
    "per_chunk": (None, _per_chunk),
}


async def _pass(
    layout: kvtier.KVLayout, chunks: list[kvtier.Chunk], bpc: int, batch: int
) -> dict[str, float]:
    cfg = kvtier.EngineConfig(len(chunks) * layout.slot_nbytes(bpc), bpc, copy_threads=1)
    out = {}
    async with kvtier.TransferEngine(layout, cfg) as engine:
        for direction in ("store", "load"):
            t0 = time.perf_counter()
            for b in _batches(chunks, batch):
                res = await getattr(engine, direction)(b)
                assert not getattr(res, "failed", None), res
                assert not getattr(res, "rejected", None), f"{direction} rejected keys: {res}"
            out[direction] = 1e6 * (time.perf_counter() - t0) / len(chunks)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layout", default="gemma-3-270m")
    ap.add_argument("--chunks", type=int, default=192)
    ap.add_argument("--batch-chunks", type=int, default=32, help="chunks per call")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    real = model_shape(args.layout)
    shape = ModelShape(
        real.name,
        tuple(LayerSpec(lay.kind, (16,)) for lay in real.layers),
        torch.uint8,
        real.tokens_per_block,
    )
    bpc = 16
    layout = shape.build(bpc * (args.chunks // len(shape.groups()) + 1))
    chunks = _chunks(layout, shape, bpc, 0, "random")[: args.chunks]
    runs: dict[str, dict[str, list[float]]] = {v: {"store": [], "load": []} for v in VARIANTS}
    for _ in range(args.rounds):
        for name, (host, run_torch) in VARIANTS.items():
            kvtier._engine.host_pieces = host or (lambda *a, **k: None)
            kvtier._transfer._run_torch = run_torch
            for direction, us in asyncio.run(_pass(layout, chunks, bpc, args.batch_chunks)).items():
                runs[name][direction].append(us)
    kvtier._engine.host_pieces, kvtier._transfer._run_torch = NUMPY_PATH, BATCHED
    print(
        f"{args.layout}: {args.chunks} chunks of {bpc} blocks, {args.batch_chunks} per call, "
        f"us per chunk (median of {args.rounds})"
    )
    for name, dirs in runs.items():
        store, load = (statistics.median(dirs[d]) for d in ("store", "load"))
        print(f"  {name:9s} store {store:7.1f}  load {load:7.1f}")


if __name__ == "__main__":
    main()
