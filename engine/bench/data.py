"""The data set the phases move, and the checks that it keeps its bytes.

The chunks and batches of a KV cache built from a layout's shape, the row
checksum of every tensor (what every round trip is compared with) and the
checks that fail a run.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

import torch

import kvtier
from kvtier._shapes import ModelShape
from kvtier.io._format import payload_checksum
from kvtier.layout import KVLayout


def _chunks(
    layout: KVLayout, shape: ModelShape, bpc: int, seed: int, block_order: str = "random"
) -> list[kvtier.Chunk]:
    """Every block of every group in chunks of ``bpc`` blocks.

    ``block_order="random"`` scatters a chunk's blocks over the whole cache (a
    long-running server's fragmented block pool, the worst case);
    ``"sequential"`` gives each chunk consecutive block ids (a fresh pool).
    """
    rng = random.Random(seed)
    out = []
    for g in layout.group_ids:
        ids = list(range(layout.group(g).num_blocks))
        if block_order == "random":
            rng.shuffle(ids)
        for c in range(0, len(ids) - bpc + 1, bpc):
            digest = hashlib.blake2b(f"{shape.name}/{g}/{c}".encode(), digest_size=16).digest()
            out.append(kvtier.Chunk(kvtier.OffloadKey(digest, g), ids[c : c + bpc]))
    rng.shuffle(out)
    return out


def _batches(chunks: list[kvtier.Chunk], n: int) -> list[list[kvtier.Chunk]]:
    return [chunks[i : i + n] for i in range(0, len(chunks), n)]


def _piece_views(layout: KVLayout) -> Iterator[torch.Tensor]:
    """Every piece view of every layer of every group, in layout order."""
    for g in layout.group_ids:
        for lay in layout.group(g).layers:
            for p in lay.pieces:
                yield p.view


def _scribble(layout: KVLayout) -> None:
    for view in _piece_views(layout):
        view.fill_(0x5A)


def _check(ok: bool, what: str) -> None:
    """Raise ``AssertionError(what)`` unless ``ok`` (an ``assert`` would vanish under -O)."""
    if not ok:
        raise AssertionError(what)


def _digests(layout: KVLayout) -> list[int]:
    """The row checksum (xxh3-64) of every tensor's bytes: what the copy phases must keep."""
    out = []
    for piece in _piece_views(layout):
        view = piece.detach().contiguous().view(torch.uint8).cpu()
        out.append(payload_checksum(view.numpy().data.cast("B")))
    return out
