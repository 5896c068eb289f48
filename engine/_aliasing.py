"""How the pieces of a layout share memory, and whether a load job writes a page twice.

Two groups may register one tensor (vLLM's hybrid allocator shares a tensor
between groups), and one tensor may be registered with two block dims: their
blocks then share bytes at the same or at other block ids. The analysis runs
once per engine on the pieces' byte views; a load job of chunks that write a
common page is then copied in plan order, so that the later call wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import torch


class _Spec(Protocol):
    """What the analysis reads of a piece (``kvtier._transfer.PieceSpec``)."""

    @property
    def gpu8(self) -> torch.Tensor: ...


class _Copy(Protocol):
    """What :func:`pages_written_twice` reads of a chunk copy (``kvtier._transfer.ChunkCopy``)."""

    @property
    def specs(self) -> tuple[_Spec, ...]: ...
    @property
    def block_ids(self) -> tuple[int, ...]: ...


def pages_written_twice(
    plan: Sequence[_Copy], cache: dict[frozenset[int], Aliasing] | None = None
) -> bool:
    """Whether two chunks of a load may write the same bytes of the cache.

    Such a load job is copied in plan order, chunk by chunk (torch path) or on
    one copy thread (CPU path), so that the later call wins. How the plan's
    groups share memory comes from :func:`analyse`: groups whose pieces
    share bytes block for block (one tensor registered in two groups, two
    storages over the same memory) are checked together by block id; pieces
    that share bytes between DIFFERENT block ids (one tensor with two block
    dims) make a chunk of one of their groups and a later chunk of the other
    count as overlapping.

    Args:
        plan: a load job's chunk copies.
        cache: ``{group ids: analyse result}`` kept by the caller (the
            groups of an engine do not change), or None. An entry under
            ``ALL_GROUPS`` (:meth:`kvtier._transfer.CopyExecutor.know_groups`) serves every
            plan: labels of all the groups may join two groups that only
            meet through a third, which makes a load copy in order where it
            need not, never the reverse.
    """
    if len(plan) < 2:
        return False
    groups: dict[int, tuple[_Spec, ...]] = {}
    for copy in plan:
        groups.setdefault(id(copy.specs), copy.specs)
    ids = frozenset(groups)
    found = None if cache is None else cache.get(ids, cache.get(ALL_GROUPS))
    if found is None:
        found = analyse(groups)
        if cache is not None:
            cache[ids] = found
    label, mixed = found
    written: dict[int, set[int]] = {}  # label -> block ids written so far
    earlier: set[int] = set()  # groups of the chunks before this one
    for copy in plan:
        sid = id(copy.specs)
        if any(other in earlier for other in mixed.get(sid, ())):
            return True
        earlier.add(sid)
        seen = written.setdefault(label[sid], set())
        before = len(seen)
        seen.update(copy.block_ids)
        if len(seen) != before + len(copy.block_ids):
            return True
    return False


Aliasing = tuple[dict[int, int], dict[int, frozenset[int]]]
ALL_GROUPS: frozenset[int] = frozenset()
"""The :func:`pages_written_twice` cache key of the analysis of all of an engine's groups."""


class Footprint(NamedTuple):
    """Where one piece's blocks lie: block ``b`` in ``ptr + b*stride + [lo, hi)`` of each run."""

    lo: int  # first and last+1 address any block can reach
    hi: int
    ptr: int
    stride: int
    runs: tuple[tuple[int, int], ...] | None  # None: too many to list
    blocks: int
    group: int  # id of the group's specs


MAX_RUNS = 64
"""Contiguous runs of one block listed per piece; more make the piece "mixed" if it aliases."""


def footprint(spec: _Spec, group: int) -> Footprint | None:
    """The piece's :class:`Footprint` (bytes view; torch views have no negative strides)."""
    view = spec.gpu8
    if view.numel() == 0:
        return None
    dims = [(n, st) for n, st in zip(view.shape[1:], view.stride()[1:], strict=True) if n > 1]
    run, i = 1, len(dims)
    while i and dims[i - 1][1] == run:  # the contiguous innermost dims make one run
        run *= dims[i - 1][0]
        i -= 1
    starts = [0]
    for n, st in dims[:i]:
        starts = [o + j * st for o in starts for j in range(n)]
        if len(starts) > MAX_RUNS:
            break
    runs = tuple((o, o + run) for o in starts) if len(starts) <= MAX_RUNS else None
    page = 1 + sum((n - 1) * st for n, st in dims)
    ptr, stride = view.data_ptr(), view.stride(0)
    nb = view.shape[0]
    return Footprint(ptr, ptr + (nb - 1) * stride + page, ptr, stride, runs, nb, group)


def block_shifts(p: Footprint, q: Footprint) -> set[int] | None:
    """The ``c - b`` for which block ``b`` of ``p`` and block ``c`` of ``q`` share bytes.

    None when that cannot be listed (other block strides, too many runs or
    shifts): any two blocks may then share bytes.
    """
    s = p.stride
    if s != q.stride or s <= 0 or p.runs is None or q.runs is None:
        return None
    shifts: set[int] = set()
    for a_lo, a_hi in p.runs:
        for b_lo, b_hi in q.runs:
            # p.ptr + b s + [a_lo, a_hi) meets q.ptr + c s + [b_lo, b_hi)
            # iff -(len_b + d) < (c - b) s < len_a - d, d = (q.ptr + b_lo) - (p.ptr + a_lo)
            d = (q.ptr + b_lo) - (p.ptr + a_lo)
            low = -(b_hi - b_lo + d) // s + 1  # smallest k with k s > -(len_b + d)
            high = -(-(a_hi - a_lo - d) // s) - 1  # largest k with k s < len_a - d
            low, high = max(low, 1 - p.blocks), min(high, q.blocks - 1)  # b, c are block ids
            if high - low > MAX_RUNS:
                return None
            shifts.update(range(low, high + 1))
    return shifts


def analyse(groups: Mapping[int, tuple[_Spec, ...]]) -> Aliasing:
    """How the pieces of ``groups`` (``{id(specs): specs}``) share memory.

    Pieces whose address ranges overlap are compared pairwise
    (:func:`block_shifts`): pieces whose blocks can only meet at the same
    block id join their groups' block-id labels; pieces whose blocks can meet
    at other block ids (or whose layouts differ) "mix" their groups.

    Returns:
        ``(label, mixed)``: each group's block-id label, and for each group
        the groups (itself included, when two of its own pieces mix) that
        one of its pieces mixes with: a chunk of one and a chunk of the
        other in a load job go in plan order.
    """
    prints = sorted(
        (f for sid, specs in groups.items() for spec in specs if (f := footprint(spec, sid))),
        key=lambda f: f.lo,
    )
    label = {sid: sid for sid in groups}
    mixed: dict[int, frozenset[int]] = {}
    for i, p in enumerate(prints):
        for q in prints[i + 1 :]:
            if q.lo >= p.hi:
                break  # sorted by lo: no later piece reaches into p
            shifts = block_shifts(p, q)
            if shifts is not None and not shifts:
                continue  # their blocks never share a byte
            if shifts == {0}:
                old = (label[p.group], label[q.group])
                for sid, lab in label.items():
                    if lab in old:
                        label[sid] = min(old)
                continue
            mixed[p.group] = mixed.get(p.group, frozenset()) | {q.group}
            mixed[q.group] = mixed.get(q.group, frozenset()) | {p.group}
    return label, mixed


def aliasing_labels(specs: Mapping[int, tuple[_Spec, ...]]) -> dict[int, int | None]:
    """Per group of a layout: a label shared by the groups that meet only at equal block ids.

    From :func:`analyse` over all the groups (``{group_id: pieces}``): two
    groups of one label write the same bytes only through the same block id
    (one tensor registered in both, as vLLM's hybrid allocator shares a
    tensor between groups), so their loads compare by ``(label, block id)``.
    The label is a group id (the smallest of its groups). ``None`` for every
    group of a label one of whose groups has a piece that shares bytes with
    another at other block ids (one tensor with two block dims, other block
    strides): any of its blocks may meet any block of its alias class.
    """
    group_of = {id(pieces): g for g, pieces in specs.items()}
    label, mixed = analyse({id(pieces): pieces for pieces in specs.values()})
    unsure = {label[sid] for sid, others in mixed.items() if others}
    unsure |= {label[o] for others in mixed.values() for o in others}
    return {
        g: None if label[id(pieces)] in unsure else group_of[label[id(pieces)]]
        for g, pieces in specs.items()
    }
