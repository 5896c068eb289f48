"""Worker side: vLLM's ``OffloadingWorker`` over kvtier's layout and copy plans.

The model worker registers vLLM's canonical KV cache tensors as a
:class:`~kvtier.KVLayout` (one kvtier group per vLLM KV cache group; tensors
shared by several groups are aliases; each reference's unpadded page size is
the layer's payload), makes the shared slot memory
(:class:`~kvtier.vllm._shm.SlotMemoryServer`), and copies each job through
kvtier's :class:`~kvtier._transfer.CopyExecutor`, one per direction, on an
event loop thread of its own: NumPy calls on CPU-only hosts, a dedicated CUDA
stream per direction that first waits for the calling thread's stream on
CUDA hosts.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier._transfer import ChunkCopy, CopyExecutor, Direction, host_pieces, piece_specs
from kvtier.errors import ConfigError, TransferError
from kvtier.layout import KVLayout
from kvtier.vllm._shm import SlotMemoryServer


def layout_from_canonical(
    kv_caches: CanonicalKVCaches, group_ids: Sequence[int], tokens_per_block: Sequence[int]
) -> KVLayout:
    """Register vLLM's canonical KV caches as a :class:`KVLayout`.

    Args:
        kv_caches: ``tensors`` are ``(num_blocks, page_size_bytes)`` int8 views
            (strided for packed layouts); ``group_data_refs[i]`` lists the
            tensors of the i-th offloaded group with their unpadded page sizes.
        group_ids: vLLM's KV cache group id of each entry of ``group_data_refs``
            (the group index inside vLLM's offload keys).
        tokens_per_block: tokens per block of each group.

    Returns:
        The layout; group ``group_ids[i]`` copies the first ``page_size_bytes``
        of each block of each of its tensors.

    Raises:
        kvtier.errors.LayoutError: the tensors do not form a valid layout.
    """
    groups: dict[int, dict[str, torch.Tensor]] = {}
    payloads: dict[str, int] = {}
    for gid, refs in zip(group_ids, kv_caches.group_data_refs, strict=True):
        layers = groups.setdefault(gid, {})
        for ref in refs:
            name = f"t{ref.tensor_idx}:{ref.page_size_bytes}"
            layers[name] = kv_caches.tensors[ref.tensor_idx].tensor
            payloads[name] = ref.page_size_bytes
    return KVLayout.from_tensors(
        groups,
        block_dim=0,
        payload_nbytes=payloads,
        tokens_per_block=dict(zip(group_ids, tokens_per_block, strict=True)),
    )


class KVTierOffloadingWorker(OffloadingWorker):
    """Copies GPU blocks to and from the shared CPU slots.

    Args:
        layout: the registered KV caches.
        group_ids: vLLM's group id of each position of a job's ``group_sizes``.
        blocks_per_chunk: GPU blocks per chunk (per slot).
        cpu_bytes: bytes of slot memory.
        engine_id: vLLM's engine id (names the rendezvous with the scheduler).
        rank: the worker's rank.
        copy_threads: copy threads per direction on CPU-only hosts.

    Raises:
        ConfigError: ``cpu_bytes`` holds no slot, or the memory cannot be made.
    """

    def __init__(
        self,
        layout: KVLayout,
        group_ids: Sequence[int],
        blocks_per_chunk: int,
        cpu_bytes: int,
        engine_id: str,
        rank: int,
        copy_threads: int = 2,
    ) -> None:
        self.layout = layout
        self._group_ids = tuple(group_ids)
        self._bpc = blocks_per_chunk
        self.slot_nbytes = layout.slot_nbytes(blocks_per_chunk)
        self.num_slots = cpu_bytes // self.slot_nbytes
        if self.num_slots == 0:
            raise ConfigError(
                f"cpu_bytes: {cpu_bytes} bytes hold no slot of {self.slot_nbytes} bytes "
                "(one chunk of the largest KV cache group plus its 4 KiB trailer)"
            )
        group_nbytes = {g: layout.group_nbytes(g, blocks_per_chunk) for g in layout.group_ids}
        header = {
            "num_slots": self.num_slots,
            "slot_nbytes": self.slot_nbytes,
            "blocks_per_chunk": blocks_per_chunk,
            "group_nbytes": {str(g): n for g, n in group_nbytes.items()},
            "layout": layout.describe(),
        }
        cuda = layout.device.type == "cuda"
        self._server = SlotMemoryServer(
            engine_id, rank, self.num_slots * self.slot_nbytes, header, pin=cuda
        )
        region = self._server.region
        self._region = region
        self._payload = {g: layout.group(g).block_payload_nbytes for g in layout.group_ids}
        self._specs = {
            g: piece_specs(layout.group(g), layout.layer_offsets(g, blocks_per_chunk))
            for g in layout.group_ids
        }
        self._host = {
            g: host_pieces(
                self._specs[g],
                region.host_views,
                self.slot_nbytes,
                self.num_slots,
                blocks_per_chunk,
            )
            for g in layout.group_ids
        }
        self._num_blocks = {g: layout.group(g).num_blocks for g in layout.group_ids}
        self._cuda = cuda
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-copy")
        self._thread.daemon = True
        self._thread.start()
        self._executors: dict[Direction, CopyExecutor] = {
            d: CopyExecutor(layout.device, d, copy_threads) for d in ("store", "load")
        }
        self._cond = threading.Condition()
        self._finished: collections.deque[TransferResult] = collections.deque()
        self._pending: set[int] = set()

    # ------------------------------------------------------------------ plans
    def _plan(self, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec) -> tuple[list[ChunkCopy], int]:
        if not isinstance(cpu, BlockIDsLoadStoreSpec):
            raise TransferError(f"kvtier: expected slot ids, got {type(cpu).__name__}")
        slots = np.asarray(cpu.block_ids).tolist()
        blocks = np.asarray(gpu.block_ids).tolist()
        if len(gpu.group_sizes) != len(self._group_ids):
            raise TransferError(
                f"kvtier: a job names {len(gpu.group_sizes)} groups, the layout has "
                f"{len(self._group_ids)}"
            )
        bpc, plan, nbytes = self._bpc, [], 0
        b = s = 0
        base = self._region.views
        for pos, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if not size:
                continue
            g = self._group_ids[pos]
            skip = first % bpc
            ids = blocks[b : b + size]
            b += size
            nb = self._num_blocks[g]
            if len(ids) != size or not all(0 <= i < nb for i in ids):
                raise TransferError(f"kvtier: group {g}: block ids outside [0, {nb}): {ids[:8]}")
            # sub-blocks skip .. skip+size of consecutive chunks
            while ids:
                if s >= len(slots):
                    raise TransferError("kvtier: a job has fewer slot ids than chunks")
                slot = slots[s]
                s += 1
                if not 0 <= slot < self.num_slots:
                    raise TransferError(f"kvtier: slot {slot} outside [0, {self.num_slots})")
                take = ids[: bpc - skip]
                ids = ids[len(take) :]
                n = len(take) * self._payload[g]
                plan.append(
                    ChunkCopy(
                        self._specs[g], base, slot * self.slot_nbytes, tuple(take), skip, n,
                        self._host[g], slot,
                    )
                )  # fmt: skip
                nbytes += n
                skip = 0
        if b != len(blocks) or s != len(slots):
            raise TransferError(
                f"kvtier: a job's {len(blocks)} blocks and {len(slots)} slots do not match its "
                f"group sizes {list(gpu.group_sizes)}"
            )
        return plan, nbytes

    def _submit(
        self, job_id: int, direction: Direction, plan: list[ChunkCopy], nbytes: int
    ) -> bool:
        after: list[Any] = []
        if self._cuda:  # pragma: no cover - CUDA hosts only
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.layout.device))
            after.append(event)
        t0 = time.perf_counter()

        def done(error: BaseException | None) -> None:
            result = TransferResult(job_id, error is None, nbytes, time.perf_counter() - t0)
            with self._cond:
                self._finished.append(result)
                self._pending.discard(job_id)
                self._cond.notify_all()

        with self._cond:
            self._pending.add(job_id)
        if not plan:
            done(None)
            return True
        self._loop.call_soon_threadsafe(self._executors[direction].submit, plan, done, after)
        return True

    # ------------------------------------------------------------------ OffloadingWorker
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Copy the GPU blocks of ``src_spec`` into the slots of ``dst_spec`` (async).

        Raises:
            TransferError: the job names blocks, slots or groups outside the
                layout (nothing is copied).
        """
        plan, nbytes = self._plan(src_spec, dst_spec)
        return self._submit(job_id, "store", plan, nbytes)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Copy the slots of ``src_spec`` into the GPU blocks of ``dst_spec`` (async).

        Raises:
            TransferError: as :meth:`submit_store`.
        """
        plan, nbytes = self._plan(dst_spec, src_spec)
        return self._submit(job_id, "load", plan, nbytes)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, with bytes and seconds."""
        with self._cond:
            out = list(self._finished)
            self._finished.clear()
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Block until none of ``job_ids`` is in flight."""
        with self._cond:
            self._cond.wait_for(lambda: not (self._pending & job_ids))

    def shutdown(self) -> None:
        """Wait for jobs in flight, stop the copy threads and unmap the slots."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending, timeout=60)
        for ex in self._executors.values():
            ex.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        self._host.clear()
        self._server.close()
