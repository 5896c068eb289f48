"""Runs inside a private mount namespace: ``python -m tests.reliability._ns_child RO RAMFS``.

``RO`` is a read-only bind mount, ``RAMFS`` a ramfs (no O_DIRECT); both are
visible to this process only. Prints one JSON object: per case the error
class, whether it is a ValueError, whether ``engine.stats()`` and the files
under the root are unchanged, and the message.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
from typing import Any

import kvtier
from kvtier.io._rowio import probe_direct_io

from ._model import Gpu, chunks, engine_config, load_check, nvme_config, store_ok, tree


async def _start_fails(gpu: Gpu, nv: kvtier.NVMeConfig, root: pathlib.Path) -> dict[str, Any]:
    engine = kvtier.TransferEngine(gpu.layout, engine_config(gpu, 2, nv))
    before, files = engine.stats(), tree(root)
    try:
        await engine.start()
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "value_error": isinstance(exc, ValueError) and isinstance(exc, kvtier.KVTierError),
            "stats_unchanged": engine.stats() == before,
            "tree_unchanged": tree(root) == files,
            "message": str(exc),
        }
    await engine.aclose()
    return {"error": None}


async def main(ro: pathlib.Path, ram: pathlib.Path) -> dict[str, Any]:
    gpu = Gpu(num_blocks=16)
    out: dict[str, Any] = {}
    out["read-only bind mount"] = await _start_fails(gpu, nvme_config(ro / "nvme"), ro)
    out["read-only bind mount, namespace dir exists"] = await _start_fails(gpu, nvme_config(ro), ro)
    case = await _start_fails(gpu, nvme_config(ram / "on", direct_io="on"), ram)
    case["odirect_works"] = probe_direct_io(ram)
    out["direct_io=on on ramfs"] = case
    cfg = engine_config(gpu, 4, nvme_config(ram / "auto", direct_io="auto"))
    cs = chunks(["ram0", "ram1"])
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await store_ok(engine, gpu, cs)
        await engine.flush()
        nvme = engine.stats().nvme or {}
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        res = await load_check(engine, gpu, cs)
    out["direct_io=auto on ramfs"] = {
        "direct_io": nvme.get("direct_io"),
        "direct_io_fallback": nvme.get("direct_io_fallback"),
        "loaded_bitwise": len(res.loaded) == 2,
    }
    return out


if __name__ == "__main__":
    result = asyncio.run(main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])))
    print(json.dumps(result))
