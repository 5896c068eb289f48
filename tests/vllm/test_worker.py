"""KVTierOffloadingWorker: vLLM's jobs become kvtier copy plans; bad jobs copy nothing."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvtier.errors import TransferError
from kvtier.vllm import KVTierOffloadingWorker
from kvtier.vllm._worker import layout_from_canonical
from tests.vllm.conftest import GROUPS, PAGE, canonical_caches


def _worker(
    blocks_per_chunk: int, slots: int = 4
) -> tuple[KVTierOffloadingWorker, list[torch.Tensor]]:
    tensors, caches = canonical_caches()
    layout = layout_from_canonical(caches, GROUPS, [16] * len(GROUPS))
    slot = layout.slot_nbytes(blocks_per_chunk)
    worker = KVTierOffloadingWorker(
        layout, GROUPS, blocks_per_chunk, slots * slot, uuid.uuid4().hex, 0, copy_threads=1
    )
    return worker, tensors


def _run(
    worker: KVTierOffloadingWorker, store: bool, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec
) -> None:
    submit = worker.submit_store if store else worker.submit_load
    assert submit(7, gpu, cpu) if store else submit(7, cpu, gpu)
    worker.wait({7})
    (result,) = worker.get_finished()
    assert result.success
    assert result.job_id == 7


def test_slots_are_sized_for_the_largest_group_not_the_sum() -> None:
    worker, _ = _worker(1)
    try:
        # group 0 holds two 1 KiB pages, groups 1 and 2 one page each: 4 KiB payload + trailer
        assert worker.slot_nbytes == 4096 + 4096
        assert worker.num_slots == 4
    finally:
        worker.shutdown()


def test_a_chunk_that_starts_mid_chunk_loads_back_into_its_sub_blocks() -> None:
    worker, (_, t1) = _worker(2)
    try:
        # group 1, logical blocks 1..3 (block_indices 1: skip one sub-block of the first chunk)
        sizes = [0, 3, 0]
        store = GPULoadStoreSpec([5, 6, 7], group_sizes=sizes, block_indices=[0, 1, 0])
        want = t1[[5, 6, 7]].clone()
        _run(worker, True, store, CPULoadStoreSpec([2, 3]))  # two chunks: sub-block 1, then 0..1
        t1.zero_()
        load = GPULoadStoreSpec([20, 21, 22], group_sizes=sizes, block_indices=[0, 1, 0])
        _run(worker, False, load, CPULoadStoreSpec([2, 3]))
        assert torch.equal(t1[[20, 21, 22]], want)
    finally:
        worker.shutdown()


def test_unpadded_payload_is_all_that_moves() -> None:
    worker, (_, t1) = _worker(1)
    try:
        sizes = [0, 0, 1]
        want = t1[9].clone()
        _run(
            worker,
            True,
            GPULoadStoreSpec([9], group_sizes=sizes, block_indices=[0, 0, 0]),
            CPULoadStoreSpec([0]),
        )
        t1[30] = 5
        _run(
            worker,
            False,
            GPULoadStoreSpec([30], group_sizes=sizes, block_indices=[0, 0, 0]),
            CPULoadStoreSpec([0]),
        )
        assert torch.equal(t1[30, : PAGE - 256], want[: PAGE - 256])
        assert bool((t1[30, PAGE - 256 :] == 5).all())  # the padding stays untouched
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("blocks", "slots", "sizes", "match"),
    [
        ([1], [99], [1, 0, 0], "slot 99"),
        ([1000], [0], [1, 0, 0], "block ids"),
        ([1, 2], [0], [2, 0, 0], "fewer slot ids"),
        ([1], [0, 1], [1, 0, 0], "do not match"),
    ],
)
def test_a_bad_job_raises_and_copies_nothing(
    blocks: list[int], slots: list[int], sizes: list[int], match: str
) -> None:
    worker, _ = _worker(1)
    try:
        before = worker._region.tensor.clone()
        with pytest.raises(TransferError, match=match):
            worker.submit_store(
                1,
                GPULoadStoreSpec(blocks, group_sizes=sizes, block_indices=[0, 0, 0]),
                CPULoadStoreSpec(slots),
            )
        assert torch.equal(worker._region.tensor, before)
        assert worker.get_finished() == []
    finally:
        worker.shutdown()
