"""Checks of a call's arguments (keys, chunks, GPU pages) before any state changes.

:class:`CallValidator` raises the typed errors of :mod:`kvtier.errors` for bad
input; it reads the layout only, so a rejected call changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier._types import Chunk, OffloadKey
from kvtier.errors import BlockIdError, ChunkRangeError, DuplicateKeyError, InvalidArgumentError
from kvtier.layout import KVLayout, byte_extent, page_intervals


def alias_classes(layout: KVLayout) -> dict[int, int]:
    """Map each group to the smallest group id whose tensors' memory may overlap its own.

    By address extents per device, not by storage object: two storages
    may map the same memory (``torch.frombuffer``, DLPack, CUDA IPC).
    Groups whose extents touch nothing of another group's never alias
    (their loads skip the page check).
    """
    spans = sorted(  # (device, first byte, end, group) of every piece
        (str(p.view.device), *byte_extent(p.view), g)
        for g in layout.group_ids
        for lay in layout.group(g).layers
        for p in lay.pieces
    )
    cls = {g: g for g in layout.group_ids}

    def root(g: int) -> int:
        while cls[g] != g:
            g = cls[g]
        return g

    reach, head, device = -1, -1, ""
    for dev, start, end, g in spans:  # a run of overlapping extents is one class
        if dev == device and start < reach:
            a, b = root(head), root(g)
            cls[max(a, b)] = min(a, b)
            reach = max(reach, end)
        else:
            device, reach, head = dev, end, g
    return {g: root(g) for g in layout.group_ids}


def _written_twice(chunks: Sequence[Chunk], group_id: int) -> int:
    """The first GPU block of ``group_id`` that two sub-blocks of ``chunks`` write."""
    seen: set[int] = set()
    for chunk in chunks:
        if chunk.key.group_id == group_id:
            for b in chunk.block_ids:
                if b in seen:
                    return b
                seen.add(b)
    raise AssertionError("no block is written twice")  # pragma: no cover


class CallValidator:
    """Checks the keys and chunks of a call against one layout.

    Args:
        layout: the registered GPU KV cache.
        blocks_per_chunk: sub-blocks per chunk (``EngineConfig.blocks_per_chunk``).

    Attributes:
        alias_class: group id -> the smallest group id whose tensors' memory
            may overlap its own (:func:`alias_classes`).
        alias_size: group id -> how many groups its alias class has.
    """

    def __init__(self, layout: KVLayout, blocks_per_chunk: int) -> None:
        self.layout = layout
        self.blocks_per_chunk = blocks_per_chunk
        self.alias_class = alias_classes(layout)
        self.alias_size = {
            g: sum(1 for c in self.alias_class.values() if c == cls)
            for g, cls in self.alias_class.items()
        }

    def key_list(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """``keys`` as a list, each checked (:meth:`check_key`).

        Raises:
            InvalidArgumentError: ``keys`` is not an iterable of :class:`OffloadKey`
                (``UnknownGroupError``: a key of a group the layout does not have).
        """
        if isinstance(keys, OffloadKey | str | bytes) or not isinstance(keys, Iterable):
            raise InvalidArgumentError(
                f"keys must be an iterable of kvtier.OffloadKey, got {type(keys).__name__}"
            )
        keys = list(keys)
        for key in keys:
            self.check_key(key)
        return keys

    def distinct_keys(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """``keys`` as a list (one snapshot), each checked, none twice.

        Raises:
            InvalidArgumentError: ``keys`` is not a sequence of :class:`OffloadKey`;
                ``DuplicateKeyError`` for a key twice, ``UnknownGroupError`` for
                a group the layout does not have.
        """
        if isinstance(keys, OffloadKey | str | bytes) or not isinstance(keys, Sequence):
            raise InvalidArgumentError(
                f"keys must be a sequence of kvtier.OffloadKey, got {type(keys).__name__}"
            )
        keys = list(keys)  # one snapshot: checked and used
        seen: set[OffloadKey] = set()
        for key in keys:
            self.check_key(key)
            if key in seen:
                raise DuplicateKeyError(f"{key} appears twice in one call")
            seen.add(key)
        return keys

    def check_key(self, key: object) -> None:
        """Raise unless ``key`` is an :class:`OffloadKey` of a group of the layout.

        Raises:
            InvalidArgumentError: not an OffloadKey; ``UnknownGroupError`` for
                a group the layout does not have.
        """
        if not isinstance(key, OffloadKey):
            raise InvalidArgumentError(f"expected kvtier.OffloadKey, got {type(key).__name__}")
        self.layout.group(key.group_id)  # raises UnknownGroupError

    def chunks(self, chunks: Sequence[Chunk], *, load: bool) -> list[Chunk]:
        """Check a call's chunks; return the list that was checked (use that one).

        One snapshot: a sequence that yields other items on a second pass
        cannot slip a duplicate past the checks.

        Args:
            chunks: the call's chunks.
            load: a load call: also check that no GPU byte is written twice.

        Raises:
            InvalidArgumentError: not a sequence of :class:`Chunk`;
                ``UnknownGroupError`` for a group the layout does not have.
            DuplicateKeyError: a key appears twice.
            ChunkRangeError: a chunk runs past ``blocks_per_chunk``.
            BlockIdError: a block id outside the group, or (``load``) a GPU
                block or byte written twice.
        """
        if isinstance(chunks, Chunk | str | bytes) or not isinstance(chunks, Sequence):
            raise InvalidArgumentError("chunks must be a sequence of kvtier.Chunk")
        chunks = list(chunks)
        seen: set[OffloadKey] = set()
        # load: {group_id: GPU blocks written by this call}
        written: dict[int, set[int]] = {}
        bpc = self.blocks_per_chunk
        for chunk in chunks:
            if not isinstance(chunk, Chunk):
                raise InvalidArgumentError(f"expected kvtier.Chunk, got {type(chunk).__name__}")
            key = chunk.key
            group = self.layout.group(key.group_id)  # raises UnknownGroupError
            if key in seen:
                raise DuplicateKeyError(f"{key} appears twice in one call")
            seen.add(key)
            ids = chunk.block_ids
            if chunk.offset + len(ids) > bpc:
                raise ChunkRangeError(
                    f"{key}: offset {chunk.offset} + {len(ids)} block_ids > blocks_per_chunk {bpc}"
                )
            if min(ids) < 0 or max(ids) >= group.num_blocks:
                bad = next(b for b in ids if not 0 <= b < group.num_blocks)
                raise BlockIdError(
                    f"{key}: block_id {bad} outside [0, {group.num_blocks}) (the layout's "
                    "num_blocks is the size of each tensor's block_dim: for vLLM's "
                    "(2, num_blocks, ...) K/V tensors pass block_dim=1)"
                )
            if load:
                pages = written.setdefault(key.group_id, set())
                size = len(pages)
                pages.update(ids)
                if len(pages) != size + len(ids):
                    b = _written_twice(chunks, key.group_id)
                    raise BlockIdError(f"{key}: GPU block {b} is written twice by one load")
        if load and any(self.alias_size[g] > 1 for g in written):
            self._check_aliased_pages(
                {(g, b) for g, pages in written.items() if self.alias_size[g] > 1 for b in pages}
            )
        return chunks

    def _check_aliased_pages(self, pages: set[tuple[int, int]]) -> None:
        """Raise BlockIdError when pages of groups that share storage overlap in one load.

        Blocks of one group never overlap (checked at registration), so only
        pages of different groups of one alias class are compared, exactly,
        byte interval by byte interval (packed groups interleaved in one block
        do not overlap; a tensor registered with different block dims may).
        """
        shared = [(g, b) for g, b in pages if self.alias_size[g] > 1]
        if len({self.alias_class[g] for g, _ in shared}) == len({g for g, _ in shared}):
            return  # at most one group per alias class in this call
        intervals = sorted(
            (start, end, g, b)
            for g, b in shared
            for layer in self.layout.group(g).layers
            for piece in layer.pieces
            for start, end in page_intervals(piece.view8, b)
        )
        reach_end, reach_page = -1, (-1, -1)
        for start, end, g, b in intervals:
            if start < reach_end and (g, b) != reach_page:
                raise BlockIdError(
                    f"one load writes overlapping GPU bytes: block {b} of group {g} and "
                    f"block {reach_page[1]} of group {reach_page[0]} share storage"
                )
            if end > reach_end:
                reach_end, reach_page = end, (g, b)
