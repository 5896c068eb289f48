"""From the user's KV cache tensors to per-group transfer regions.

A :class:`KVLayout` records, for every KV cache group, the distinct layer
regions that one GPU block of that group owns, as strided ``uint8`` (or wider
integer) views of the user's tensors. No tensor is ever copied at
registration: every region is a view, so strides, aliases between groups and
packed (interleaved) layouts are preserved exactly.

Slot layout (DESIGN.md section 2): inside a CPU slot, group ``g`` starts at
offset 0, layer-major. For each distinct layer ``l`` in registration order,
``blocks_per_chunk`` payloads of ``l`` lie back to back; sub-block ``j`` of
layer ``l`` sits at ``offset_l + j * payload_l``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import LayoutError, UnknownGroupError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ALIGN = 4096
"""Slot and row alignment in bytes (O_DIRECT and page size)."""

TRAILER_NBYTES = 4096
"""Bytes reserved at the end of every slot and row for the row trailer."""

_WIDE_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def round_up(n: int, align: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``align`` (both non-negative ints, align > 0)."""
    return -(-n // align) * align


@dataclass(frozen=True)
class Piece:
    """A rectangular part of one page's payload.

    Attributes:
        view: strided view of the layer tensor, shape ``(num_blocks, *shape)``,
            dtype ``int64``/``int32``/``int16``/``uint8`` (the widest that the
            strides allow); row ``b`` is this piece of block ``b``'s page.
        page_start: byte offset of the piece inside the page payload.
        nbytes: bytes of the piece per block.
        itemsize: bytes per element of ``view``.

    """

    view: torch.Tensor
    page_start: int
    nbytes: int
    itemsize: int
    view8: torch.Tensor


@dataclass(frozen=True)
class LayerRegion:
    """One distinct layer of one group: what a block of it transfers.

    Attributes:
        names: layer names that view these identical bytes (copied once).
        payload_nbytes: bytes transferred per block (unpadded prefix of the page).
        page_nbytes: bytes of a full page (one block of this layer).
        pieces: rectangular parts covering ``[0, payload_nbytes)`` of the page.
        num_blocks: size of the block dimension.
        dtype: the user's dtype (recorded for ``describe()``).
        shape: the user's tensor shape.
        block_dim: the user's block dimension.

    """

    names: tuple[str, ...]
    payload_nbytes: int
    page_nbytes: int
    pieces: tuple[Piece, ...]
    num_blocks: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    block_dim: int


@dataclass(frozen=True)
class GroupLayout:
    """The distinct layer regions of one KV cache group, in registration order."""

    group_id: int
    layers: tuple[LayerRegion, ...]
    num_blocks: int
    tokens_per_block: int

    @functools.cached_property
    def block_payload_nbytes(self) -> int:
        """Bytes one GPU block of this group transfers (sum over distinct layers)."""
        return sum(layer.payload_nbytes for layer in self.layers)


def _merge_dims(shape: list[int], stride: list[int]) -> tuple[list[int], list[int]]:
    """Drop size-1 dims and merge adjacent dims that are contiguous with each other."""
    dims = [(s, st) for s, st in zip(shape, stride, strict=True) if s != 1]
    if not dims:
        return [1], [1]
    out = [list(dims[-1])]
    for size, st in reversed(dims[:-1]):
        inner_size, inner_stride = out[0]
        if st == inner_size * inner_stride:
            out[0] = [size * inner_size, inner_stride]
        else:
            out.insert(0, [size, st])
    return [d[0] for d in out], [d[1] for d in out]


def _widen(view: torch.Tensor, extra_offsets: tuple[int, ...] = ()) -> tuple[torch.Tensor, int]:
    """Reinterpret a uint8 view as the widest integer dtype its geometry allows."""
    for width, dtype in _WIDE_DTYPES:
        if width == 1:
            return view, 1
        if view.size(-1) % width or view.stride(-1) != 1:
            continue
        if any(st % width for st in view.stride()[:-1]) or view.data_ptr() % width:
            continue
        if any(o % width for o in extra_offsets):
            continue
        try:
            return view.view(dtype), width
        except RuntimeError:
            continue
    return view, 1


def _pieces(page: torch.Tensor, payload: int) -> tuple[Piece, ...]:
    """Split the first ``payload`` bytes of each page (row-major) into rectangular views.

    Args:
        page: uint8 view ``(num_blocks, d1, ..., dk)`` with merged dims.
        payload: bytes to cover, ``0 < payload <= d1*...*dk``.

    """
    pieces: list[Piece] = []
    dims = list(page.shape[1:])
    index: list[int] = []  # fixed leading indices
    start = 0
    remaining = payload
    level = 0
    while remaining > 0:
        inner = math.prod(dims[level + 1 :])
        q, r = divmod(remaining, inner)
        if q:
            sl: tuple[Any, ...] = (slice(None), *index, slice(0, q))
            view = page[sl]
            nbytes = q * inner
            wide, width = _widen(view, (start, payload))
            pieces.append(Piece(wide, start, nbytes, width, view))
            start += nbytes
        if r == 0:
            break
        index.append(q)
        remaining = r
        level += 1
    return tuple(pieces)


def _byte_view(tensor: torch.Tensor, block_dim: int) -> torch.Tensor:
    """A uint8 view ``(num_blocks, *page_dims)`` of ``tensor`` with merged page dims."""
    u8 = tensor.unsqueeze(-1)
    if tensor.dtype != torch.uint8:
        u8 = u8.view(torch.uint8)
    u8 = u8.movedim(block_dim, 0)
    shape, stride = _merge_dims(list(u8.shape[1:]), list(u8.stride()[1:]))
    return u8.as_strided([u8.size(0), *shape], [u8.stride(0), *stride], u8.storage_offset())


_MAX_SEGMENTS = 1 << 24
"""Largest number of contiguous byte runs checked exactly for overlaps."""


def _segment_starts(view: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Start addresses (int64, every block) and length of the contiguous runs of a page view.

    ``view`` is ``(num_blocks, d1, ..., dk)`` uint8 with merged dims; every run
    is ``dk * stride_k`` bytes long when ``stride_k == 1``, else 1 byte. Returns
    None when there are more than ``_MAX_SEGMENTS`` runs.
    """
    shape, stride = list(view.shape), list(view.stride())
    if stride[-1] == 1:
        run, outer, outer_stride = shape[-1], shape[:-1], stride[:-1]
    else:
        run, outer, outer_stride = 1, shape, stride
    if math.prod(outer) > _MAX_SEGMENTS:
        return None
    starts = torch.zeros((), dtype=torch.int64) + view.data_ptr()
    for size, st in zip(outer, outer_stride, strict=True):
        starts = (starts.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * st).flatten()
    return starts.flatten(), run


def _first_overlap(runs: list[tuple[torch.Tensor, int]]) -> tuple[int, int] | None:
    """Indices of two run lists that share a byte, or ``(i, i)`` for a self-overlap.

    Exact: every run of every list, sorted by start; a run that begins before
    the furthest end seen so far overlaps an earlier one.
    """
    starts = torch.cat([r[0] for r in runs])
    ends = torch.cat([r[0] + r[1] for r in runs])
    owner = torch.cat([torch.full_like(r[0], i) for i, r in enumerate(runs)])
    order = torch.argsort(starts, stable=True)
    starts, ends, owner = starts[order], ends[order], owner[order]
    reach, _ = torch.cummax(ends, dim=0)
    clash = torch.nonzero(starts[1:] < reach[:-1])
    if clash.numel() == 0:
        return None
    i = int(clash[0, 0]) + 1
    # the earlier run that reaches past starts[i]
    j = int(torch.nonzero(ends[:i] > starts[i])[0, 0])
    return int(owner[j]), int(owner[i])


def _check_disjoint(
    group_id: int,
    regions: list[LayerRegion],
    layer_runs: list[tuple[tuple[torch.Tensor, int] | None, torch.device]],
) -> None:
    """Raise LayoutError when two blocks or two layers of one group share a byte.

    Exact over every block (layers on one device are checked together, one
    sort of absolute addresses); pages with more than ``_MAX_SEGMENTS`` runs
    in all are not checked.
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, (runs, device) in enumerate(layer_runs):
        if runs is not None:
            by_device.setdefault(device, []).append(i)
    for members in by_device.values():
        clash = _first_overlap([layer_runs[i][0] for i in members])  # type: ignore[misc]
        if clash is None:
            continue
        a, b = (regions[members[k]].names[0] for k in clash)
        if a == b:
            raise LayoutError(
                f"group {group_id}: layer {a!r} has blocks (or parts of one page) that share "
                "bytes (an expanded / stride-0 or self-overlapping view)"
            )
        raise LayoutError(f"group {group_id}: layer {b!r} overlaps layer {a!r}")


def byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """Absolute bytes ``[first, end)`` that a tensor view can touch (any strides, any dtype)."""
    dims = list(zip(t.shape, t.stride(), strict=True))
    low = sum(min(0, st * (n - 1)) for n, st in dims)
    high = sum(max(0, st * (n - 1)) for n, st in dims)
    item = t.element_size()
    return t.data_ptr() + low * item, t.data_ptr() + (high + 1) * item


def page_intervals(view: torch.Tensor, block: int) -> list[tuple[int, int]]:
    """Absolute byte intervals ``[start, end)`` of one block's page of a layer view."""
    got = _segment_starts(view[block : block + 1])
    if got is None:  # too many runs: the page's bounding extent (conservative)
        return [byte_extent(view[block])]
    starts, run = got
    return [(int(x), int(x) + run) for x in starts.tolist()]


def _check_names_are_unique(groups: Mapping[Any, Any]) -> None:
    """Raise LayoutError when one layer name stands for different tensors in two groups.

    ``block_dim`` and ``payload_nbytes`` are keyed by layer name, so a name
    must mean one tensor (the same tensor in several groups is an alias).
    """
    owner: dict[Any, tuple[Any, torch.Tensor]] = {}
    for group_id, layers in groups.items():  # mappings of str names (checked by the caller)
        for name, tensor in layers.items():
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.layout != torch.strided
                or tensor.is_nested
                or tensor.device.type == "meta"
            ):
                continue  # reported with its layer
            first = owner.setdefault(name, (group_id, tensor))
            other = first[1]
            if other is not tensor and (
                other.device != tensor.device
                or other.dtype != tensor.dtype
                or other.shape != tensor.shape
                or other.stride() != tensor.stride()
                or other.data_ptr() != tensor.data_ptr()
            ):
                raise LayoutError(
                    f"layer name {name!r} stands for different tensors in groups {first[0]} "
                    f"and {group_id}: block_dim and payload_nbytes are keyed by layer name, "
                    "so give each tensor its own name (the same tensor may appear in "
                    "several groups)"
                )


class KVLayout:
    """The registered GPU KV cache, grouped by KV cache group.

    Build it with :meth:`from_tensors` or :meth:`from_hf_config`.
    """

    def __init__(self, groups: Mapping[int, GroupLayout], device: torch.device) -> None:
        """Use :meth:`from_tensors`; this constructor takes validated groups."""
        self._groups = dict(sorted(groups.items()))
        self.device = device

    # ------------------------------------------------------------------ build
    @classmethod
    def from_tensors(
        cls,
        groups: Mapping[int, Mapping[str, torch.Tensor]],
        block_dim: int | Mapping[str, int] = 0,
        payload_nbytes: Mapping[str, int] | None = None,
        tokens_per_block: int | Mapping[int, int] = 16,
    ) -> KVLayout:
        """Register the GPU KV cache tensors of each KV cache group.

        Args:
            groups: ``{group_id: {layer_name: tensor}}``. Tensors of any dtype and
                any strides (the last dimension must be contiguous unless the
                dtype is one byte wide), all on one device. The same tensor may
                appear in several groups (aliases); two names of one group that
                view identical bytes are copied once.
            block_dim: the ``num_blocks`` dimension, one int for all layers or
                ``{layer_name: int}`` (layers it leaves out use 0). Negative
                values count from the end. A layer of four or more dims with
                size 2 along it is logged as a warning: vLLM's
                ``(2, num_blocks, ...)`` K/V tensors take ``block_dim=1``.
            payload_nbytes: optional ``{layer_name: bytes}``: only this prefix of
                each page (in row-major order of the page's dims) is transferred.
            tokens_per_block: tokens per GPU block, one int or ``{group_id: int}``.

        Returns:
            The layout. No tensor is copied; regions are views.

        Raises:
            LayoutError: empty groups, a non-tensor, mixed devices, a meta or
                sparse tensor, a bad block dimension, layers of one group with
                different ``num_blocks``, one layer name for different tensors
                in two groups, a payload outside ``(0, page bytes]``, an
                expanded view (a dimension of size > 1 with stride 0),
                overlapping layers inside one group (compared by address on
                each device, also across storages that map the same memory),
                or a bad ``tokens_per_block``.

        """
        if not isinstance(groups, Mapping) or not groups:
            raise LayoutError("KVLayout needs at least one group of layer tensors")
        for group_id, layers in groups.items():
            if not isinstance(layers, Mapping) or not layers:
                raise LayoutError(f"group {group_id!r} has no {{layer_name: tensor}} mapping")
            for name in layers:
                if not isinstance(name, str) or not name:
                    raise LayoutError(f"group {group_id!r}: layer names must be str, got {name!r}")
        if payload_nbytes is None:
            payload_nbytes = {}
        elif not isinstance(payload_nbytes, Mapping):
            raise LayoutError(
                f"payload_nbytes must be {{layer_name: bytes}} or None, got {payload_nbytes!r:.80}"
            )
        payload_nbytes = dict(payload_nbytes)
        known_names = {n for layers in groups.values() for n in layers}
        unknown = set(payload_nbytes) - known_names
        if unknown:
            raise LayoutError(f"payload_nbytes names unknown layers: {sorted(map(repr, unknown))}")
        if isinstance(block_dim, Mapping) and set(block_dim) - known_names:
            raise LayoutError(
                f"block_dim names unknown layers: {sorted(map(repr, set(block_dim) - known_names))}"
            )
        _check_names_are_unique(groups)
        device: torch.device | None = None
        built: dict[int, GroupLayout] = {}
        two_blocks: list[str] = []  # layers whose block dim has size 2: vLLM's K/V dim?
        for group_id, layers in groups.items():
            if (
                isinstance(group_id, bool)
                or not isinstance(group_id, int)
                or not 0 <= group_id < 1 << 32
            ):
                raise LayoutError(f"group_id must be an int in [0, 2**32), got {group_id!r}")
            tpb = (
                tokens_per_block.get(group_id)
                if isinstance(tokens_per_block, Mapping)
                else tokens_per_block
            )
            if isinstance(tpb, bool) or not isinstance(tpb, int) or tpb <= 0:
                raise LayoutError(f"tokens_per_block for group {group_id} must be > 0: {tpb!r}")
            regions: list[LayerRegion] = []
            seen: dict[tuple[Any, ...], int] = {}
            layer_runs: list[tuple[tuple[torch.Tensor, int] | None, torch.device]] = []
            for name, tensor in layers.items():
                if not isinstance(tensor, torch.Tensor):
                    raise LayoutError(f"layer {name!r}: expected a torch.Tensor")
                if tensor.is_conj() or tensor.is_neg():
                    raise LayoutError(
                        f"layer {name!r}: a lazy conj/neg view; register tensor.resolve_conj()"
                        " / .resolve_neg() (its bytes are not the values)"
                    )
                if (
                    tensor.layout != torch.strided  # sparse (COO, CSR, ...) or nested
                    or tensor.is_nested
                    or tensor.device.type == "meta"
                    or tensor.is_quantized
                ):
                    raise LayoutError(
                        f"layer {name!r}: {tensor.device}/{tensor.layout} tensors are not supported"
                    )
                if device is None:
                    device = tensor.device
                elif tensor.device != device:
                    raise LayoutError(
                        f"layer {name!r} is on {tensor.device}, other layers on {device}"
                    )
                bd = block_dim.get(name, 0) if isinstance(block_dim, Mapping) else block_dim
                if (
                    isinstance(bd, bool)
                    or not isinstance(bd, int)
                    or not -tensor.dim() <= bd < tensor.dim()
                ):
                    raise LayoutError(
                        f"layer {name!r}: block_dim {bd!r} invalid for shape {tuple(tensor.shape)}"
                    )
                bd %= tensor.dim()
                if tensor.size(bd) == 2 and tensor.dim() >= 4 and max(tensor.shape) > 2:
                    two_blocks.append(name)
                if tensor.dtype.itemsize > 1 and tensor.stride(-1) != 1 and tensor.size(-1) != 1:
                    raise LayoutError(f"layer {name!r}: the last dimension must be contiguous")
                if tensor.numel() == 0:
                    raise LayoutError(f"layer {name!r} is empty: shape {tuple(tensor.shape)}")
                dims = zip(tensor.shape, tensor.stride(), strict=True)
                if any(n > 1 and st == 0 for n, st in dims):
                    raise LayoutError(  # its blocks (or elements) would share bytes
                        f"layer {name!r} is an expanded view (a dimension of size > 1 with "
                        f"stride 0: shape {tuple(tensor.shape)}, strides {tensor.stride()})"
                    )
                view = _byte_view(tensor, bd)
                page_nbytes = math.prod(view.shape[1:])
                payload = payload_nbytes.get(name, page_nbytes)
                if (
                    isinstance(payload, bool)
                    or not isinstance(payload, int)
                    or not 0 < payload <= page_nbytes
                ):
                    raise LayoutError(
                        f"layer {name!r}: payload_nbytes {payload!r} outside (0, {page_nbytes}]"
                    )
                ident = (view.data_ptr(), tuple(view.shape), tuple(view.stride()), payload)
                if ident in seen:
                    old = regions[seen[ident]]
                    regions[seen[ident]] = LayerRegion(
                        (*old.names, name),
                        old.payload_nbytes,
                        old.page_nbytes,
                        old.pieces,
                        old.num_blocks,
                        old.dtype,
                        old.shape,
                        old.block_dim,
                    )
                    continue
                runs = _segment_starts(view)
                # by device, not storage: two storages may map the same memory
                # (torch.frombuffer, from_numpy, DLPack, CUDA IPC)
                layer_runs.append((runs, view.device))
                seen[ident] = len(regions)
                regions.append(
                    LayerRegion(
                        (name,),
                        payload,
                        page_nbytes,
                        _pieces(view, payload),
                        view.size(0),
                        tensor.dtype,
                        tuple(tensor.shape),
                        bd,
                    )
                )
            _check_disjoint(group_id, regions, layer_runs)
            nbs = {r.num_blocks for r in regions}
            if len(nbs) != 1:
                raise LayoutError(f"group {group_id}: layers disagree on num_blocks: {sorted(nbs)}")
            built[group_id] = GroupLayout(group_id, tuple(regions), nbs.pop(), tpb)
        if isinstance(tokens_per_block, Mapping):
            extra = set(tokens_per_block) - set(built)
            if extra:
                names = sorted(map(repr, extra))
                raise LayoutError(f"tokens_per_block names unknown groups: {names}")
        assert device is not None
        if two_blocks:
            log.warning(
                "kvtier: layers %s have 2 blocks along block_dim; for vLLM's "
                "(2, num_blocks, ...) K/V tensors pass block_dim=1",
                ", ".join(two_blocks[:4]) + (", ..." if len(two_blocks) > 4 else ""),
            )
        return cls(built, device)

    @classmethod
    def from_hf_config(
        cls,
        config: PretrainedConfig,
        num_blocks: int,
        tokens_per_block: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVLayout:
        """Allocate a paged KV cache for a transformers config and register it.

        Layers are grouped as vLLM's hybrid KV cache manager does: one group per
        attention type, split into groups of equal layer counts (see
        :func:`kvtier._hf.hf_kv_groups`).

        Args:
            config: a transformers ``PretrainedConfig`` (with ``layer_types`` for
                hybrid models).
            num_blocks: GPU blocks per layer tensor (``> 0``).
            tokens_per_block: tokens per GPU block (``> 0``).
            dtype: the KV cache dtype.
            device: where to allocate the tensors.

        Returns:
            The layout, owning freshly zeroed tensors (``layout.tensors()``).

        Raises:
            LayoutError: the config has no supported attention layers.

        """
        from kvtier._hf import hf_kv_groups

        g = hf_kv_groups(config, num_blocks, tokens_per_block, dtype, device)
        return cls.from_tensors(
            groups=g.groups, block_dim=g.block_dim, tokens_per_block=g.tokens_per_block
        )

    # ------------------------------------------------------------------ queries
    @property
    def group_ids(self) -> tuple[int, ...]:
        """The registered group ids, sorted."""
        return tuple(self._groups)

    def group(self, group_id: int) -> GroupLayout:
        """The :class:`GroupLayout` of ``group_id``.

        Raises:
            UnknownGroupError: the layout has no such group.

        """
        try:
            return self._groups[group_id]
        except (KeyError, TypeError):
            raise UnknownGroupError(
                f"group_id {group_id!r} is not registered (groups: {list(self._groups)})"
            ) from None

    def group_nbytes(self, group_id: int, blocks_per_chunk: int) -> int:
        """Unpadded bytes of one chunk of ``group_id``.

        ``blocks_per_chunk * sum(payload of the group's distinct layers)``
        (DESIGN.md section 2).

        Raises:
            UnknownGroupError: unknown group.

        """
        return blocks_per_chunk * self.group(group_id).block_payload_nbytes

    def slot_nbytes(self, blocks_per_chunk: int) -> int:
        """Bytes of one CPU slot: sized for the LARGEST group, never the sum.

        ``round_up(max_g group_nbytes(g), 4096) + 4096``; the last 4 KiB hold
        the row trailer (DESIGN.md sections 2 and 5).
        """
        largest = max(self.group_nbytes(g, blocks_per_chunk) for g in self._groups)
        return round_up(largest) + TRAILER_NBYTES

    def layer_offsets(self, group_id: int, blocks_per_chunk: int) -> tuple[int, ...]:
        """Byte offset of each distinct layer's region inside a slot of ``group_id``."""
        offsets, pos = [], 0
        for layer in self.group(group_id).layers:
            offsets.append(pos)
            pos += blocks_per_chunk * layer.payload_nbytes
        return tuple(offsets)

    def tensors(self) -> dict[int, dict[str, torch.Tensor]]:
        """``{group_id: {layer_name: uint8 page view (num_blocks, *page)}}`` for inspection."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for g, group in self._groups.items():
            out[g] = {}
            for layer in group.layers:
                base = layer.pieces[0].view
                for name in layer.names:
                    out[g][name] = base
        return out

    def describe(self) -> dict[str, Any]:
        """A JSON-able description: groups, layers, dtypes, shapes, payloads, tokens_per_block.

        With ``blocks_per_chunk`` this feeds the NVMe format digest, so it
        contains everything that decides the bytes of a row and nothing that
        does not (no addresses, no ``num_blocks``: resizing the GPU cache keeps
        the NVMe rows reusable).
        """
        return {
            "groups": [
                {
                    "group_id": g.group_id,
                    "tokens_per_block": g.tokens_per_block,
                    "layers": [
                        {
                            "names": list(layer.names),
                            "dtype": str(layer.dtype).removeprefix("torch."),
                            "page_shape": [
                                n for i, n in enumerate(layer.shape) if i != layer.block_dim
                            ],
                            "block_dim": layer.block_dim,
                            "page_nbytes": layer.page_nbytes,
                            "payload_nbytes": layer.payload_nbytes,
                        }
                        for layer in g.layers
                    ],
                }
                for g in self._groups.values()
            ]
        }

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{g}: {len(gl.layers)} layers, {gl.num_blocks} blocks of "
            f"{gl.block_payload_nbytes} B in all"
            for g, gl in self._groups.items()
        )
        return f"KVLayout({parts}; device={self.device})"
