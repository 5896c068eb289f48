"""How the pieces of a layout share memory (``kvtier._aliasing``), checked byte by byte.

A load job whose chunks may write the same bytes is copied in plan order
(the later call wins); the check must never miss a shared byte, and should
not see one where there is none (that would only cost batching).
"""

from __future__ import annotations

import random

import pytest
import torch

import kvtier
from kvtier import _aliasing as aliasing
from kvtier import _transfer as transfer


def _specs(layout: kvtier.KVLayout, bpc: int) -> dict[int, tuple[transfer.PieceSpec, ...]]:
    out = {}
    for g in layout.group_ids:
        out[g] = transfer.piece_specs(layout.group(g), layout.layer_offsets(g, bpc))
    return out


def _bytes(spec: transfer.PieceSpec, block: int) -> set[int]:
    """Every address block ``block`` of the piece covers."""
    view = spec.gpu8[block]
    base = spec.gpu8.untyped_storage().data_ptr()
    offsets = torch.arange(spec.gpu8.untyped_storage().nbytes(), dtype=torch.int64)
    flat = offsets.as_strided(view.shape, view.stride(), view.data_ptr() - base)
    return {base + int(a) for a in flat.flatten()}


def _check_shifts(specs: list[transfer.PieceSpec]) -> None:
    """block_shifts lists exactly the block pairs that share bytes (or gives up: None)."""
    prints = [aliasing.footprint(s, i) for i, s in enumerate(specs)]
    for i, p in enumerate(prints):
        for j, q in enumerate(prints):
            if i == j or p is None or q is None:
                continue
            shifts = aliasing.block_shifts(p, q)
            if shifts is None:
                continue
            nb_p, nb_q = specs[i].gpu8.shape[0], specs[j].gpu8.shape[0]
            for b in range(nb_p):
                pb = _bytes(specs[i], b)
                for c in range(nb_q):
                    meet = bool(pb & _bytes(specs[j], c))
                    assert meet == ((c - b) in shifts), (i, j, b, c, shifts)


@pytest.mark.parametrize("seed", range(12))
def test_block_shifts_match_the_bytes_of_random_strided_views(seed: int) -> None:
    rng = random.Random(seed)
    memory = torch.zeros(4096, dtype=torch.uint8)
    specs = []
    stride0 = rng.choice([16, 24, 40, 64])  # one block stride for all (else: None, not tested)
    for _ in range(3):
        # A view whose blocks and elements never overlap (the layout refuses others):
        # rows of n1 bytes (every st1-th), n0 rows st0 apart, pages stride0 apart.
        nb = rng.randint(2, 6)
        st1 = rng.choice([1, 2])
        n1 = rng.randint(1, 4)
        st0 = n1 * st1 + rng.randint(0, 3)
        n0 = rng.randint(1, max(1, stride0 // st0))
        if (n0 - 1) * st0 + (n1 - 1) * st1 + 1 > stride0:
            n0 = 1
        start = rng.randrange(0, 128)
        view = memory.as_strided((nb, n0, n1), (stride0, st0, st1), start)
        layout = kvtier.KVLayout.from_tensors({0: {"v": view}})
        specs.extend(_specs(layout, 1)[0])
    _check_shifts(specs)


def _labels(groups: dict[int, dict[str, torch.Tensor]], **kw: object) -> tuple[set[int], bool]:
    layout = kvtier.KVLayout.from_tensors(groups, **kw)  # type: ignore[arg-type]
    by_id = {id(s): s for s in _specs(layout, 2).values()}
    label, mixed = aliasing.analyse(by_id)
    return set(label.values()), bool(mixed)


def test_kv_first_halves_and_separate_tensors_are_independent() -> None:
    kv = torch.zeros((2, 8, 4, 16), dtype=torch.float16)
    other = torch.zeros((8, 2, 4, 16), dtype=torch.float16)
    labels, mixed = _labels({0: {"kv": kv}, 1: {"o": other}}, block_dim={"kv": 1, "o": 0})
    assert len(labels) == 2
    assert not mixed


def test_one_tensor_in_two_groups_is_checked_by_block_id() -> None:
    t = torch.zeros((8, 2, 16), dtype=torch.float16)
    labels, mixed = _labels({0: {"a": t}, 1: {"b": t}})
    assert len(labels) == 1
    assert not mixed


def test_one_tensor_with_two_block_dims_is_mixed() -> None:
    t = torch.zeros((8, 8, 16), dtype=torch.uint8)
    _, mixed = _labels({0: {"a": t}, 1: {"b": t}}, block_dim={"a": 0, "b": 1})
    assert mixed


def test_a_load_plan_over_mixed_pieces_goes_in_order_only_when_two_chunks_touch_them() -> None:
    t = torch.zeros((8, 8, 16), dtype=torch.uint8)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}, 1: {"b": t}}, block_dim={"a": 0, "b": 1})
    specs = _specs(layout, 1)

    def copy(g: int, block: int) -> transfer.ChunkCopy:
        return transfer.ChunkCopy(specs[g], {}, 0, (block,), 0, 16)

    assert not aliasing.pages_written_twice([copy(0, 1)])
    assert aliasing.pages_written_twice([copy(0, 1), copy(1, 5)])  # t[1, 5] twice
    assert not aliasing.pages_written_twice([copy(0, 1), copy(0, 2)])  # one view: by block id
    cache: dict[frozenset[int], aliasing.Aliasing] = {}
    assert aliasing.pages_written_twice([copy(0, 1), copy(0, 1)], cache)
    assert len(cache) == 1  # the analysis is kept for the engine's groups
