"""The tricky layouts of the copy-path tests, and the check of what a load wrote.

Multi-piece pages, odd payload prefixes shifting later layers to byte-aligned
slot offsets, aliases in and across groups, strided slices, K/V-first pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kvtier
from kvtier import _transfer
from kvtier._slots import HostRegion
from tests.engine.helpers import fill_random, same

NB = 40  # blocks per layer: group g stores from 10g..10g+9 and loads into 39-b


@dataclass
class LayoutCase:
    """The tensors of one layout case, their pristine bytes, and views of their pages."""

    groups: dict[int, dict[str, torch.Tensor]]
    block_dim: dict[str, int]
    payload: dict[str, int]
    bpc: int
    staged: bool  # some layer has several pieces per page

    def __post_init__(self) -> None:
        self.pristine = {n: t.clone() for n, t in self.flat()}

    def flat(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for layers in self.groups.values() for n, t in layers.items()]

    def restore(self) -> None:
        for n, t in self.flat():
            t.copy_(self.pristine[n])

    def scribble(self) -> None:
        for _, t in self.flat():
            (t.view(torch.uint8) if t.dtype != torch.uint8 else t).fill_(0xEE)

    def layout(self) -> kvtier.KVLayout:
        return kvtier.KVLayout.from_tensors(
            self.groups, block_dim=self.block_dim, payload_nbytes=self.payload
        )

    def pages(self) -> dict[str, tuple[torch.Tensor, int]]:
        """``{name: (uint8 pages (NB, page bytes) in row-major order, payload bytes)}``."""
        out = {}
        for name, t in self.flat():
            pages = t.movedim(self.block_dim[name], 0).contiguous().clone().view(torch.uint8)
            pages = pages.reshape(NB, -1)
            out[name] = (pages, self.payload.get(name, pages.shape[1]))
        return out

    def sharing(self, name: str) -> list[int]:
        """Groups with a layer on the same storage as ``name``."""
        ptr = dict(self.flat())[name].untyped_storage().data_ptr()
        return [
            g
            for g, layers in self.groups.items()
            if any(t.untyped_storage().data_ptr() == ptr for t in layers.values())
        ]


def _t(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    fill_random(t, seed)
    return t


def layout_case(name: str) -> LayoutCase:
    """The case named ``name`` (one of :data:`CASES`), its tensors filled at random."""
    if name == "kv-first-f16-prefix171":
        # pages of 2 x 120 B (K, V); 171 B = K + 51 B of V: 3 pieces, byte wide
        t = _t((2, NB, 3, 20), torch.float16, 1)
        return LayoutCase({0: {"kv": t}}, {"kv": 1}, {"kv": 171}, 4, True)
    if name == "bf16-prefix171-then-wide-layers":
        # an odd first layer shifts the later layers to odd slot offsets; the
        # last one has several pieces too (K, then 44 B of V), at such an offset
        a = _t((2, NB, 3, 20), torch.bfloat16, 2)
        w = _t((NB, 2, 8, 16), torch.bfloat16, 3)
        kv = _t((2, NB, 4, 16), torch.float32, 4)  # K/V-first: pages of 2 x 256 B
        return LayoutCase(
            {0: {"a": a, "w": w, "kv": kv}},
            {"a": 1, "w": 0, "kv": 1},
            {"a": 171, "kv": 300},
            4,
            True,
        )
    if name == "aliases-in-and-across-groups":
        t = _t((2, NB, 8, 8), torch.float16, 5)  # K/V-first, 2 pieces
        u = _t((NB, 5, 8), torch.uint8, 6)[:, :, :7]  # rows of 7 B, 8 B apart
        return LayoutCase(
            {0: {"t": t, "t_alias": t[:], "u": u}, 1: {"t1": t}},
            {"t": 1, "t_alias": 1, "u": 0, "t1": 1},
            {"u": 33, "t1": 200},  # u: 4 rows of 7 B + 5 B; t1: K + 72 B of V
            3,
            True,
        )
    if name == "strided-slice-prefix":
        base = _t((NB, 2, 64), torch.float16, 7)
        s = base[:, :, :48]  # rows of 96 B, 128 B apart inside the page
        return LayoutCase({0: {"s": s}}, {"s": 0}, {"s": 150}, 4, True)
    if name == "single-piece-layers":
        a = _t((NB, 4, 32), torch.bfloat16, 8)
        b = _t((2, NB, 16), torch.float16, 9)  # K/V-first: one strided piece (2, 32 B)
        return LayoutCase({0: {"a": a, "b": b}}, {"a": 0, "b": 1}, {}, 4, False)
    raise AssertionError(name)


CASES = [  # the names layout_case knows
    "kv-first-f16-prefix171",
    "bf16-prefix171-then-wide-layers",
    "aliases-in-and-across-groups",
    "strided-slice-prefix",
    "single-piece-layers",
]


def check_loaded(
    case: LayoutCase,
    before: dict[str, tuple[torch.Tensor, int]],
    pairs: list[tuple[kvtier.Chunk, kvtier.Chunk]],
) -> None:
    """Loaded blocks hold their source's payload; every other byte is still the scribble."""
    after = case.pages()
    loaded: dict[int, set[int]] = {}
    for src, dst in pairs:
        g = src.key.group_id
        loaded.setdefault(g, set()).update(dst.block_ids)
        for name in case.groups[g]:
            (pb, payload), (pa, _) = before[name], after[name]
            assert same(pa[list(dst.block_ids), :payload], pb[list(src.block_ids), :payload]), name
    for name, (pages, _) in after.items():
        written = {b for g in case.sharing(name) for b in loaded.get(g, set())}
        rest = sorted(set(range(NB)) - written)
        assert bool((pages[rest] == 0xEE).all()), f"{name}: a block of no chunk was written"
        ptr = dict(case.flat())[name].untyped_storage().data_ptr()
        for g in case.sharing(name):
            ids = sorted(loaded.get(g, set()))
            widest = max(
                after[n][1]
                for n, t in case.groups[g].items()
                if t.untyped_storage().data_ptr() == ptr
            )
            assert bool((pages[ids, widest:] == 0xEE).all()), f"{name}: past the payload"


class CopyRig:
    """A layout's pieces over a real pool, and chunk copies into its slots."""

    def __init__(self, layout: kvtier.KVLayout, bpc: int, num_slots: int = 8) -> None:
        self.layout, self.bpc = layout, bpc
        self.slot_nbytes = layout.slot_nbytes(bpc)
        self.region = HostRegion(num_slots * self.slot_nbytes, pin=False)
        self.specs = {
            g: _transfer.piece_specs(layout.group(g), layout.layer_offsets(g, bpc))
            for g in layout.group_ids
        }
        self.host = {
            g: _transfer.host_pieces(
                self.specs[g], self.region.host_views, self.slot_nbytes, num_slots, bpc
            )
            for g in layout.group_ids
        }

    def copy(
        self, g: int, slot: int, block_ids: Sequence[int], start: int = 0
    ) -> _transfer.ChunkCopy:
        n = len(block_ids) * self.layout.group(g).block_payload_nbytes
        return _transfer.ChunkCopy(
            self.specs[g], self.region.views, slot * self.slot_nbytes, tuple(block_ids), start,
            n, self.host[g], slot,
        )  # fmt: skip
