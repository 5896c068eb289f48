"""The descriptor table of a copy job (``kvtier._copytable``), checked row by row.

The reference is independent of the table: for every chunk and piece, the
byte addresses of each element of the GPU piece and of its packed place in
the slot, from the tensors' strides (``kvtier._transfer.slot_views``, the
views the torch path copies through). The table must map exactly those bytes.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import kvtier
from kvtier import _copytable, _transfer
from tests.engine.copy_layouts import CASES, NB, CopyRig, layout_case


def _byte_addresses(view: torch.Tensor) -> list[int]:
    """Address of every byte of ``view``, in row-major element order."""
    item = view.element_size()
    idx = torch.zeros(view.shape, dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(view.shape, view.stride(), strict=True)):
        shape = [1] * view.dim()
        shape[dim] = size
        idx = idx + (torch.arange(size) * stride * item).reshape(shape)
    base = view.data_ptr()
    return [base + int(a) + k for a in idx.flatten().tolist() for k in range(item)]


def _reference(plan: Sequence[_transfer.ChunkCopy], store: bool) -> dict[int, int]:
    """``{destination byte address: source byte address}`` of a plan, from the views."""
    out: dict[int, int] = {}
    for copy in plan:
        for spec in copy.specs:
            gpu, slot = _transfer.slot_views(copy, spec)
            for j, block in enumerate(copy.block_ids):
                g, s = _byte_addresses(gpu[block]), _byte_addresses(slot[j])
                pairs = zip(s, g, strict=True) if store else zip(g, s, strict=True)
                out.update(pairs)
    return out


def _table_map(table: _copytable.CopyTable) -> dict[int, int]:
    out: dict[int, int] = {}
    for s, d, n in zip(table.src.tolist(), table.dst.tolist(), table.nbytes.tolist(), strict=True):
        for k in range(n):
            out[table.lo + d + k] = table.lo + s + k
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_table_maps_exactly_the_bytes_of_the_strided_views(case: str, store: bool) -> None:
    """Full and partial chunks of every group, scattered and consecutive block ids."""
    c = layout_case(case)
    rig = CopyRig(c.layout(), c.bpc)
    rng = random.Random(case)
    plan, slot = [], 0
    for g in rig.layout.group_ids:
        for kind in ("scattered", "consecutive", "partial"):
            if kind == "scattered":
                ids = rng.sample(range(NB), c.bpc)
                start = 0
            elif kind == "consecutive":
                first = rng.randrange(NB - c.bpc)
                ids, start = list(range(first, first + c.bpc)), 0
            else:
                start = rng.randrange(c.bpc)
                ids = rng.sample(range(NB), rng.randint(1, c.bpc - start))
            plan.append(rig.copy(g, slot, ids, start))
            slot += 1
    table = _transfer.plan_table(plan, store=store)
    assert _table_map(table) == _reference(plan, store)
    if store:  # every slot byte is written once
        assert len(set(table.dst.tolist())) == len(table.dst)
    # a job of fewer groups counts its offsets from another address
    for g in rig.layout.group_ids:
        alone = [copy for copy in plan if copy.host is rig.host[g]]
        assert _table_map(_transfer.plan_table(alone, store=store)) == _reference(alone, store)


def test_consecutive_blocks_of_a_block_contiguous_cache_merge_into_one_row_per_chunk() -> None:
    t = torch.zeros(128, 2, 4, 8, dtype=torch.float16)  # 128-byte pages, block-contiguous
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}}, block_dim=0)
    rig = CopyRig(layout, 32)  # 4 KiB of payload per slot (then the slot's trailer)
    plan = [rig.copy(0, s, range(32 * s, 32 * s + 32)) for s in range(3)]
    table = _transfer.plan_table(plan, store=True)
    assert table.nbytes.tolist() == [32 * 128] * 3
    assert table.src.tolist() == [t.data_ptr() - table.lo + 32 * 128 * s for s in range(3)]
    assert table.dst.tolist() == [
        c.slot_offset + rig.region.views[1].data_ptr() - table.lo for c in plan
    ]
    scattered = [rig.copy(0, 0, [5, 1, 9, 3])]
    assert _transfer.plan_table(scattered, store=True).nbytes.tolist() == [128] * 4


def test_a_kv_first_page_is_two_runs_per_block() -> None:
    t = torch.zeros(2, 32, 4, 8, dtype=torch.bfloat16)  # K and V halves 32 blocks apart
    layout = kvtier.KVLayout.from_tensors({0: {"kv": t}}, block_dim=1)
    rig = CopyRig(layout, 2)
    table = _transfer.plan_table([rig.copy(0, 1, [7, 3])], store=True)
    assert table.nbytes.tolist() == [64] * 4
    stride = t.stride(1) * 2
    half = t.stride(0) * 2
    gpu = [a + table.lo - t.data_ptr() for a in table.src.tolist()]
    assert gpu == [7 * stride, 3 * stride, half + 7 * stride, half + 3 * stride]


def test_execute_moves_bits_of_any_pattern() -> None:
    """16-byte rows go through complex128: NaN payloads and -0.0 keep their bits."""
    t = torch.zeros(16, 16, dtype=torch.uint8)  # 16-byte pages
    patterns = [
        struct.pack("<QQ", 0x7FF0000000000001, 0xFFF8000000000123),  # signalling and quiet NaN
        struct.pack("<dd", -0.0, float("inf")),
        bytes(range(16)),
    ]
    for b, p in enumerate(patterns * 5):
        t[b] = torch.frombuffer(bytearray(p), dtype=torch.uint8)
    layout = kvtier.KVLayout.from_tensors({0: {"x": t}}, block_dim=0)
    rig = CopyRig(layout, 4)
    before = t.clone()
    plan = [rig.copy(0, s, [4 * s + 3, 4 * s + 1, 4 * s, 4 * s + 2]) for s in range(3)]
    store = _transfer.plan_table(plan, store=True)
    assert store.width == 16
    assert store.size == 16
    _copytable.execute(store)
    t.zero_()
    _copytable.execute(_transfer.plan_table(plan, store=False))
    assert torch.equal(t[:12], before[:12])


def test_overlaps_finds_a_page_written_twice() -> None:
    t = torch.zeros(16, 48, dtype=torch.uint8)
    layout = kvtier.KVLayout.from_tensors({0: {"x": t}}, block_dim=0)
    rig = CopyRig(layout, 2)
    apart = [rig.copy(0, 0, [1, 2]), rig.copy(0, 1, [3, 4])]
    twice = [rig.copy(0, 0, [1, 2]), rig.copy(0, 1, [5, 2])]
    assert not _copytable.overlaps(_transfer.plan_table(apart, store=False))
    assert _copytable.overlaps(_transfer.plan_table(twice, store=False))


def test_rows_of_mixed_sizes_and_unaligned_offsets_copy_bitwise() -> None:
    """Layers of 3-byte and 40-byte pages: rows of several sizes and byte widths."""
    a = torch.randint(0, 256, (32, 3), dtype=torch.uint8)
    b = torch.randint(0, 256, (32, 5), dtype=torch.int64)
    layout = kvtier.KVLayout.from_tensors({0: {"a": a, "b": b}}, block_dim=0)
    rig = CopyRig(layout, 4)
    ref_a, ref_b = a.clone(), b.clone()
    plan = [rig.copy(0, s, np.random.default_rng(s).permutation(32)[:4].tolist()) for s in range(4)]
    _copytable.execute(_transfer.plan_table(plan, store=True))
    a.zero_()
    b.zero_()
    _copytable.execute(_transfer.plan_table(plan, store=False))
    touched = sorted({i for c in plan for i in c.block_ids})
    assert torch.equal(a[touched], ref_a[touched])
    assert torch.equal(b[touched], ref_b[touched])
    assert not a[[i for i in range(32) if i not in touched]].any()


def test_pieces_of_many_runs_or_large_runs_keep_one_call_per_chunk_and_piece() -> None:
    """The table takes groups of small runs; a block-innermost piece or 1 KiB pages do not."""
    small = torch.zeros(64, 4, 16, dtype=torch.uint8)  # one 64-byte run per block
    inner = torch.zeros(8, 16, 64, dtype=torch.int16)  # block dim innermost: 128 runs per block
    large = torch.zeros(64, 1024, dtype=torch.uint8)  # one 1 KiB run per block
    layout = kvtier.KVLayout.from_tensors(
        {0: {"s": small}, 1: {"i": inner}, 2: {"l": large}},
        block_dim={"s": 0, "i": 2, "l": 0},
    )
    rig = CopyRig(layout, 4)
    assert [rig.host[g].table for g in (0, 1, 2)] == [True, False, False]
    assert rig.host[1].runs.per_piece == 128
