"""Fixtures for the vLLM backend's tests: a real worker and manager in one process.

The worker side (:class:`kvtier.vllm.KVTierOffloadingWorker`) registers CPU
tensors shaped like vLLM's canonical KV caches and serves the slot memory;
the manager side attaches to it over the same abstract socket vLLM's
scheduler process uses.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

with warnings.catch_warnings():
    # vLLM and the torch modules it loads warn at import (deprecations); the
    # suite turns warnings into errors, so load them once here, quietly.
    warnings.simplefilter("ignore")
    # Where vLLM is meant to be installed (``.ci/run`` sets
    # KVTIER_REQUIRE_VLLM=1), a missing vLLM or a skipped test is a failure.
    if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm")
    import kvtier.vllm._spec  # noqa: F401  (imports vLLM)

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    get_offload_group_idx,
    make_offload_key,
)

from kvtier._config import NVMeConfig
from kvtier.vllm import KVTierOffloadingManager, KVTierOffloadingWorker
from kvtier.vllm._nvme import NVMeSide
from kvtier.vllm._shm import attach
from kvtier.vllm._worker import layout_from_canonical

REQUIRE_VLLM = os.environ.get("KVTIER_REQUIRE_VLLM") == "1"
PAGE = 1024  # bytes per block of each canonical tensor
NUM_BLOCKS = 64
GROUPS = (0, 1, 2)  # three vLLM KV cache groups over two shared tensors


def canonical_caches(seed: int = 0) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    """Two int8 ``(NUM_BLOCKS, PAGE)`` tensors shared by three groups.

    Group 0 uses both tensors (full payload), groups 1 and 2 use tensor 1
    only, group 2 with an unpadded payload of ``PAGE - 256`` bytes.
    """
    g = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=g)
        for _ in range(2)
    ]
    refs = [
        [CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)],
        [CanonicalKVCacheRef(1, PAGE)],
        [CanonicalKVCacheRef(1, PAGE - 256)],
    ]
    return tensors, CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors], refs)


@dataclass
class Backend:
    """One worker and one manager sharing slot memory, as in vLLM's two processes."""

    worker: KVTierOffloadingWorker
    manager: KVTierOffloadingManager
    tensors: list[torch.Tensor]
    ctx: ReqContext
    jobs: Iterator[int]
    region: Any  # the manager side's mapping of the slots

    def key(self, n: int, group: int = 0) -> bytes:
        return make_offload_key(n.to_bytes(32, "big"), group)

    def store(self, keys_blocks: list[tuple[bytes, int]]) -> Any:
        """prepare_store, the worker's copy, complete_store; returns prepare_store's output."""
        keys_blocks = sorted(keys_blocks, key=lambda kb: get_offload_group_idx(kb[0]))
        out = self.manager.prepare_store([k for k, _ in keys_blocks], self.ctx)
        if out is None or not out.keys_to_store:
            return out
        blocks = dict(keys_blocks)
        self.copy(
            "store", out.keys_to_store, [blocks[k] for k in out.keys_to_store], out.store_spec
        )
        self.manager.complete_store(out.keys_to_store, self.ctx)
        return out

    def load(self, keys_blocks: list[tuple[bytes, int]]) -> None:
        """prepare_load, the worker's copy into the blocks, complete_load."""
        keys_blocks = sorted(keys_blocks, key=lambda kb: get_offload_group_idx(kb[0]))
        keys = [k for k, _ in keys_blocks]
        spec = self.manager.prepare_load(keys, self.ctx)
        self.copy("load", keys, [b for _, b in keys_blocks], spec)
        self.manager.complete_load(keys, self.ctx)

    def copy(self, direction: str, keys: list[bytes], block_ids: list[int], cpu_spec: Any) -> None:
        """Run one job through the worker; ``keys`` sorted by group, as vLLM sends them."""
        assert [get_offload_group_idx(k) for k in keys] == sorted(
            get_offload_group_idx(k) for k in keys
        )
        sizes = [0] * len(GROUPS)
        ids: list[int] = []
        for g in GROUPS:
            for k, b in zip(keys, block_ids, strict=True):
                if get_offload_group_idx(k) == g:
                    sizes[g] += 1
                    ids.append(b)
        gpu = GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=[0] * len(GROUPS))
        job = next(self.jobs)
        if direction == "store":
            assert self.worker.submit_store(job, gpu, cpu_spec)
        else:
            assert self.worker.submit_load(job, cpu_spec, gpu)
        self.worker.wait({job})
        results = self.worker.get_finished()
        assert [r.job_id for r in results] == [job]
        assert results[0].success

    def until(self, key: bytes, want: Any, timeout_s: float = 30.0) -> Any:
        """Poll ``lookup(key)`` (as vLLM's scheduler steps do) until it answers ``want``."""
        deadline = time.monotonic() + timeout_s
        while (got := self.manager.lookup(key, self.ctx)) != want and time.monotonic() < deadline:
            time.sleep(0.005)
        return got

    def close(self) -> None:
        self.manager.shutdown()
        self.worker.shutdown()
        self.region.close()


def make_backend(
    cpu_slots: int,
    nvme_root: str | None = None,
    *,
    seed: int = 0,
    eviction: str = "lru",
    capacity_bytes: int = 64 << 20,
) -> Backend:
    tensors, caches = canonical_caches(seed)
    layout = layout_from_canonical(caches, GROUPS, [16] * len(GROUPS))
    slot = layout.slot_nbytes(1)
    engine_id = uuid.uuid4().hex
    worker = KVTierOffloadingWorker(
        layout, GROUPS, 1, cpu_slots * slot, engine_id, 0, copy_threads=1
    )
    header, region = attach(engine_id, 0, 10)
    nvme = None
    if nvme_root is not None:
        nvme = NVMeSide(
            NVMeConfig(
                root=nvme_root, capacity_bytes=capacity_bytes, namespace="test", direct_io="off"
            ),
            region,
            header["slot_nbytes"],
            header["layout"],
            header["blocks_per_chunk"],
            {int(g): n for g, n in header["group_nbytes"].items()},
        )
    manager = KVTierOffloadingManager(
        header["num_slots"], eviction, enable_events=True, nvme=nvme, blocks_per_chunk=1
    )
    return Backend(worker, manager, tensors, ReqContext("req"), itertools.count(), region)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """With ``KVTIER_REQUIRE_VLLM=1``, a skipped test of this folder fails."""
    report = yield
    if REQUIRE_VLLM and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped while KVTIER_REQUIRE_VLLM=1: {report.longrepr}"
    return report


@pytest.fixture
def backend() -> Iterator[Backend]:
    b = make_backend(8)
    yield b
    b.close()
