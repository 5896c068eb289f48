"""Child process for NVMe restart tests: ``python -m tests.engine.nvme_child MODE ROOT``.

``store``: build the seeded 3-group layout, store every chunk, flush, exit.
``load``: build the same layout with scribbled tensors, open the same root,
check ``lookup`` says NVME, load, and compare with the seeded bytes. Prints JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

import kvtier
from tests.engine.helpers import fill_random, key, same

BPC = 4


def build(seed_data: bool) -> tuple[kvtier.KVLayout, list[torch.Tensor]]:
    # Unequal groups: 1:2:4 payload ratios, one K/V-first tensor, one unpadded payload.
    g0 = torch.empty((24, 2, 8, 1, 32), dtype=torch.bfloat16)  # 1 KiB pages
    g1 = torch.empty((2, 24, 8, 2, 32), dtype=torch.float16)  # K/V-first, 2 KiB pages
    g2 = torch.empty((24, 4096 + 512), dtype=torch.uint8)  # 4 KiB payload + padding
    tensors = [g0, g1, g2]
    for i, t in enumerate(tensors):
        fill_random(t, 100 + i) if seed_data else t.view(torch.uint8).fill_(
            0xEE
        ) if t.dtype != torch.uint8 else t.fill_(0xEE)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"full.0": g0}, 1: {"swa.0": g1}, 2: {"lin.0": g2}},
        block_dim={"full.0": 0, "swa.0": 1, "lin.0": 0},
        payload_nbytes={"lin.0": 4096},
    )
    return layout, tensors


def chunks() -> list[kvtier.Chunk]:
    out = []
    for g in range(3):
        out.append(kvtier.Chunk(key(f"c{g}a", g), [1, 5, 9, 13]))
        out.append(kvtier.Chunk(key(f"c{g}b", g), [2, 6], offset=1))  # partial chunk
    return out


def config(root: str) -> kvtier.EngineConfig:
    return kvtier.EngineConfig(
        cpu_bytes=1 << 20,
        blocks_per_chunk=BPC,
        nvme=kvtier.NVMeConfig(
            root=root, capacity_bytes=64 << 20, namespace="restart", segment_nbytes=1 << 20
        ),
    )


async def store(root: str) -> dict[str, object]:
    layout, _ = build(True)
    async with kvtier.TransferEngine(layout, config(root)) as engine:
        res = await engine.store(chunks())
        await engine.flush()
        return {"stored": len(res.stored)}


async def load(root: str) -> dict[str, object]:
    layout, tensors = build(False)
    _, expected = build(True)
    async with kvtier.TransferEngine(layout, config(root)) as engine:
        residency = [r.value for r in engine.lookup([c.key for c in chunks()])]
        out = await engine.load(chunks())
    checks = []
    for t, e, bd, ids in (
        (tensors[0], expected[0], 0, [1, 5, 9, 13, 2, 6]),
        (tensors[1], expected[1], 1, [1, 5, 9, 13, 2, 6]),
    ):
        idx = torch.tensor(ids)
        checks.append(same(t.index_select(bd, idx), e.index_select(bd, idx)))
    ids = [1, 5, 9, 13, 2, 6]
    checks.append(same(tensors[2][ids, :4096], expected[2][ids, :4096]))
    checks.append(bool((tensors[2][:, 4096:] == 0xEE).all()))  # padding never loaded
    return {
        "residency": residency,
        "loaded": len(out.loaded),
        "failed": len(out.failed),
        "equal": checks,
    }


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    result = asyncio.run(store(root) if mode == "store" else load(root))
    print(json.dumps(result))
