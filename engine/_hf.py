"""KV cache groups of a transformers model config, grouped as vLLM groups them.

:func:`hf_kv_groups` reads a transformers 5.x config and allocates one paged
tensor per cached layer (or two for recurrent layers: conv and recurrent state),
then sorts the layers into KV cache groups the way vLLM's hybrid KV cache
manager does (``vllm/v1/core/kv_cache_utils.py``,
``_get_kv_cache_groups_uniform_page_size``):

1. Layers with the same cache spec (kind, window, shapes, dtypes) form a type;
   types are ordered by their first layer.
2. ``group_size`` is the smallest layer count among the types; when the largest
   count is below ``1.25 *`` the smallest, the largest count is used instead
   (vLLM's rule, so that e.g. 12 sliding + 13 full layers form 2 groups, not 3).
3. Each type of ``n`` layers is split into ``ceil(n / group_size)`` groups,
   interleaved: group ``i`` of the type gets ``layers[i::num_groups]``. With
   vLLM's n:1 patterns (Gemma3 5:1, Llama4 3:1, Qwen3-Next 3:1) every group has
   the same number of layers; otherwise the last groups of a type are one layer
   short (vLLM pads them with a padding layer; kvtier simply has fewer layers).

Tensor shapes (``B = num_blocks``, ``T = tokens_per_block``; block dim 0):

* full / sliding / chunked attention: ``(B, 2, T, num_kv_heads, head_dim)``
  in ``dtype`` (index 1: 0 = K, 1 = V), named ``model.layers.<i>.self_attn``.
* MLA (DeepSeek-V2/V3): ``(B, T, kv_lora_rank + qk_rope_head_dim)`` in ``dtype``:
  the normalised latent followed by the rotary key, the two tensors that
  transformers' DeepSeek-V3 attention caches (and vLLM's MLA cache holds).
* linear attention (Qwen3-Next, Qwen3.5 gated DeltaNet): one block holds one
  sequence's state snapshot, two tensors: ``<name>.conv_state`` of shape
  ``(B, 2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads *
  linear_value_head_dim, linear_conv_kernel_dim)`` in ``dtype`` and
  ``<name>.recurrent_state`` of shape ``(B, linear_num_value_heads,
  linear_key_head_dim, linear_value_head_dim)`` in ``float32`` (transformers'
  torch gated-delta-rule keeps the recurrent state in float32 whatever the
  model dtype), named ``model.layers.<i>.linear_attn``.
* mamba (Jamba): ``<name>.conv_state`` of shape ``(B, mamba_expand *
  hidden_size, mamba_d_conv)`` in ``dtype`` and ``<name>.recurrent_state`` of
  shape ``(B, mamba_expand * hidden_size, mamba_d_state)`` in ``float32``, named
  ``model.layers.<i>.mamba``. Mamba2 families (Bamba, Falcon-H1, GraniteMoeHybrid,
  Nemotron-H) keep states of other shapes and are refused (``ValueError``).

Attention sinks (GPT-OSS) are weights, not cache: they change no shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "KIND_OF_LAYER_TYPE",
    "MAMBA_MODEL_TYPES",
    "HFKVGroups",
    "blocks_to_cache",
    "cache_to_blocks",
    "hf_kv_groups",
    "resident_blocks",
]

KIND_OF_LAYER_TYPE: dict[str, str] = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear",
    "mamba": "mamba",
    "attention": "full",
}
"""transformers ``config.layer_types`` entry -> kvtier group kind."""

MAMBA_MODEL_TYPES = frozenset({"jamba"})
"""Model families whose ``linear_attention`` layers are Mamba (SSM) layers of Jamba's shapes."""

_MAMBA2_MODEL_TYPES = frozenset({"bamba", "falcon_h1", "granitemoehybrid", "nemotron_h"})
"""Families with Mamba2 layers: their conv state also holds the B/C projections and
their SSM state is per head, ``(n_heads, d_head, d_state)``; not mapped (refused)."""

_NO_CACHE_TYPES = frozenset({"dummy", "moe", "mlp"})
_KINDS = frozenset({"full", "sliding", "chunked", "linear", "mamba", "mla"})
_RECURRENT_STATE_DTYPE = torch.float32


@dataclass(frozen=True)
class HFKVGroups:
    """The paged KV cache tensors of a model, grouped into KV cache groups.

    Attributes:
        groups: ``group_id -> {tensor name: paged tensor}``; tensors have the
            block dimension first (see the module docstring for shapes).
        block_dim: the block dimension of every tensor (always ``0``).
        tokens_per_block: ``group_id -> tokens per block``. For linear / mamba
            groups a block is one state snapshot taken at a block boundary of
            that many tokens.
        kinds: ``group_id -> "full" | "sliding" | "chunked" | "linear" | "mamba" | "mla"``.
        layer_index: tensor name -> model layer index.
        window: ``group_id -> attention window in tokens`` (sliding window or
            attention chunk size), ``None`` for unbounded or recurrent groups.
    """

    groups: dict[int, dict[str, torch.Tensor]]
    block_dim: int | dict[str, int]
    tokens_per_block: dict[int, int]
    kinds: dict[int, str]
    layer_index: dict[str, int]
    window: dict[int, int | None]

    def layers_of(self, group_id: int) -> list[int]:
        """Return the distinct model layer indices of group ``group_id``, in order."""
        seen: dict[int, None] = {}
        for name in self.groups[group_id]:
            seen.setdefault(self.layer_index[name], None)
        return list(seen)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def _is_mla(config: Any) -> bool:
    return getattr(config, "kv_lora_rank", None) is not None and hasattr(config, "qk_rope_head_dim")


def _layer_kinds(config: Any) -> list[str | None]:
    """Return one kvtier kind per model layer (``None``: the layer has no cache)."""
    num_layers = int(config.num_hidden_layers)
    model_type = str(getattr(config, "model_type", ""))
    layer_types = getattr(config, "layer_types", None)
    if model_type == "jamba" or (layer_types is None and hasattr(config, "layers_block_type")):
        layer_types = list(config.layers_block_type)
    if layer_types is None:
        layer_types = []
        for _ in range(num_layers):
            if getattr(config, "sliding_window", None) is not None:
                layer_types.append("sliding_attention")
            elif getattr(config, "attention_chunk_size", None) is not None:
                layer_types.append("chunked_attention")
            else:
                layer_types.append("full_attention")
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config.layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    sharing = getattr(config, "kv_sharing_modes", None)
    kinds: list[str | None] = []
    for i, layer_type in enumerate(layer_types):
        if layer_type in _NO_CACHE_TYPES or (sharing is not None and sharing[i] == "reuse"):
            kinds.append(None)
            continue
        try:
            kind = KIND_OF_LAYER_TYPE[layer_type]
        except KeyError:
            raise ValueError(f"layer {i}: unsupported layer type {layer_type!r}") from None
        if kind in ("linear", "mamba") and model_type in _MAMBA2_MODEL_TYPES:
            raise ValueError(
                f"layer {i}: {model_type} has Mamba2 layers, whose states kvtier does not map"
            )
        if kind == "linear" and model_type in MAMBA_MODEL_TYPES:
            kind = "mamba"
        if kind == "full" and _is_mla(config):
            kind = "mla"
        kinds.append(kind)
    return kinds


def _layer_specs(
    config: Any, kind: str, layer: int, dtype: torch.dtype
) -> tuple[str, list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Return the tensor name prefix and ``(suffix, per-block shape, dtype)`` list of a layer."""
    prefix = f"model.layers.{layer}"
    if kind in ("full", "sliding", "chunked"):
        num_kv_heads = int(
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        )
        head_dim = getattr(config, "head_dim", None) or (
            int(config.hidden_size) // int(config.num_attention_heads)
        )
        return f"{prefix}.self_attn", [("", (2, -1, num_kv_heads, int(head_dim)), dtype)]
    if kind == "mla":
        width = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        return f"{prefix}.self_attn", [("", (-1, width), dtype)]
    if kind == "linear":
        key_dim = int(config.linear_num_key_heads) * int(config.linear_key_head_dim)
        value_dim = int(config.linear_num_value_heads) * int(config.linear_value_head_dim)
        conv = (2 * key_dim + value_dim, int(config.linear_conv_kernel_dim))
        recurrent = (
            int(config.linear_num_value_heads),
            int(config.linear_key_head_dim),
            int(config.linear_value_head_dim),
        )
        return f"{prefix}.linear_attn", [
            (".conv_state", conv, dtype),
            (".recurrent_state", recurrent, _RECURRENT_STATE_DTYPE),
        ]
    if kind == "mamba":
        inner = int(config.mamba_expand) * int(config.hidden_size)
        return f"{prefix}.mamba", [
            (".conv_state", (inner, int(config.mamba_d_conv)), dtype),
            (".recurrent_state", (inner, int(config.mamba_d_state)), _RECURRENT_STATE_DTYPE),
        ]
    raise ValueError(f"unsupported kind {kind!r}")


def _window(config: Any, kind: str) -> int | None:
    if kind == "sliding":
        return int(config.sliding_window)
    if kind == "chunked":
        return int(config.attention_chunk_size)
    return None


def split_like_vllm(types: list[list[int]]) -> list[list[int]]:
    """Split per-type layer lists into groups of equal layer counts (vLLM's rule).

    The group size is the smallest type's layer count, or the largest when
    it is under 1.25x the smallest; each type of ``n`` layers becomes
    ``ceil(n / size)`` groups that take its layers in turn (interleaved:
    ``layers[i::groups]``), as vLLM's ``_get_kv_cache_groups_uniform_page_size``
    does (vLLM pads a short group with empty layers; kvtier sizes each group
    by its own layers and needs no padding).

    Args:
        types: the layer indices of each attention type, in model order.

    Returns:
        The layer indices of each group, the types' groups in ``types`` order.
    """
    counts = [len(layers) for layers in types]
    group_size = min(counts)
    if max(counts) < group_size * 1.25:
        group_size = max(counts)
    grouped: list[list[int]] = []
    for layers in types:
        num_groups = math.ceil(len(layers) / group_size)
        grouped.extend(layers[i::num_groups] for i in range(num_groups))
    return grouped


def hf_kv_groups(
    config: Any,
    num_blocks: int,
    tokens_per_block: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> HFKVGroups:
    """Allocate a model's paged KV cache and group its layers as vLLM does.

    Args:
        config: a transformers 5.x config (a multimodal config is reduced to
            its decoder text config).
        num_blocks: blocks per tensor (``> 0``).
        tokens_per_block: tokens per block (``> 0``), for every group.
        dtype: dtype of K/V, latent and conv-state tensors; recurrent states
            are float32.
        device: where to allocate (zero-filled).

    Returns:
        The groups, tensors and per-group metadata (:class:`HFKVGroups`).

    Raises:
        ValueError: bad sizes, or a layer type that kvtier cannot map.
    """
    if num_blocks <= 0 or tokens_per_block <= 0:
        raise ValueError(
            f"num_blocks ({num_blocks}) and tokens_per_block ({tokens_per_block}) must be > 0"
        )
    config = _text_config(config)
    model_type = getattr(config, "model_type", type(config).__name__)
    try:
        kinds_per_layer = _layer_kinds(config)
    except (AttributeError, TypeError, RuntimeError) as exc:
        raise ValueError(f"cannot read the layer types of a {model_type} config: {exc}") from exc
    # 1. One type per distinct spec, ordered by first layer.
    spec_of_type: dict[tuple[Any, ...], list[int]] = {}
    layer_specs: dict[int, tuple[str, list[tuple[str, tuple[int, ...], torch.dtype]]]] = {}
    for layer, kind in enumerate(kinds_per_layer):
        if kind is None:
            continue
        try:  # a family kvtier does not know lacks the attributes (or has them per layer)
            prefix, specs = _layer_specs(config, kind, layer, dtype)
            window = _window(config, kind)
        except (AttributeError, TypeError, RuntimeError) as exc:
            raise ValueError(
                f"layer {layer}: cannot size a {kind!r} cache from a {model_type} config: {exc}"
            ) from exc
        layer_specs[layer] = (prefix, specs)
        type_key = (kind, window, tuple((s, shape, d) for s, shape, d in specs))
        spec_of_type.setdefault(type_key, []).append(layer)
    if not spec_of_type:
        raise ValueError("the config has no cached layer")
    type_of_layer = {layer: key for key, layers in spec_of_type.items() for layer in layers}
    # 2-3. Split to equal layer counts.
    groups: dict[int, dict[str, torch.Tensor]] = {}
    kinds: dict[int, str] = {}
    windows: dict[int, int | None] = {}
    layer_index: dict[str, int] = {}
    for group_id, layers in enumerate(split_like_vllm(list(spec_of_type.values()))):
        kind, window, _ = type_of_layer[layers[0]]
        tensors: dict[str, torch.Tensor] = {}
        for layer in layers:
            prefix, specs = layer_specs[layer]
            for suffix, shape, tensor_dtype in specs:
                full_shape = (num_blocks, *(tokens_per_block if d == -1 else d for d in shape))
                name = prefix + suffix
                tensors[name] = torch.zeros(full_shape, dtype=tensor_dtype, device=device)
                layer_index[name] = layer
        groups[group_id] = tensors
        kinds[group_id] = kind
        windows[group_id] = window
    return HFKVGroups(
        groups=groups,
        block_dim=0,
        tokens_per_block=dict.fromkeys(groups, tokens_per_block),
        kinds=kinds,
        layer_index=layer_index,
        window=windows,
    )


# ------------------------------------------------------------- DynamicCache <-> blocks
def resident_blocks(kind: str, window: int | None, num_tokens: int, tokens_per_block: int) -> range:
    """Logical blocks of a group that hold cache state after ``num_tokens`` tokens.

    * full / MLA: every block ``0 .. ceil(num_tokens / T)``.
    * sliding / chunked: transformers' ``DynamicSlidingWindowLayer`` keeps the
      last ``window - 1`` tokens, so only the blocks overlapping positions
      ``[num_tokens - min(num_tokens, window - 1), num_tokens)``.
    * linear / mamba: the one block that ends at ``num_tokens`` (it carries the
      state snapshot taken there).

    Args:
        kind: the group kind (see :class:`HFKVGroups`).
        window: the group's window in tokens, or ``None``.
        num_tokens: tokens in the cache (``> 0``).
        tokens_per_block: tokens per block ``T``.

    Returns:
        A range of logical block indices.

    Raises:
        ValueError: ``num_tokens`` or ``tokens_per_block`` is not positive, or
            an unknown ``kind``.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown group kind {kind!r} (one of {sorted(_KINDS)})")
    if num_tokens <= 0 or tokens_per_block <= 0:
        raise ValueError(
            f"num_tokens ({num_tokens}) and tokens_per_block ({tokens_per_block}) must be > 0"
        )
    num_blocks = -(-num_tokens // tokens_per_block)
    if kind in ("linear", "mamba"):
        return range(num_blocks - 1, num_blocks)
    first = (num_tokens - _kept_tokens(kind, window, num_tokens)) // tokens_per_block
    return range(first, num_blocks)


def _kept_tokens(kind: str, window: int | None, num_tokens: int) -> int:
    if kind in ("sliding", "chunked") and window is not None:
        return min(num_tokens, window - 1)
    return num_tokens


def _token_rows(
    kind: str, window: int | None, num_tokens: int, tokens_per_block: int
) -> tuple[int, int, int]:
    """Return ``(number of resident blocks, first row, stop row)`` of the kept tokens."""
    blocks = resident_blocks(kind, window, num_tokens, tokens_per_block)
    base = blocks.start * tokens_per_block
    kept = _kept_tokens(kind, window, num_tokens)
    return len(blocks), num_tokens - kept - base, num_tokens - base


def _check_ids(
    group_id: int, block_tables: Mapping[int, Sequence[int]], expected: int
) -> torch.Tensor:
    if group_id not in block_tables:
        raise ValueError(f"no block table for group {group_id}")
    block_ids = block_tables[group_id]
    if len(block_ids) != expected:
        raise ValueError(
            f"group {group_id}: {len(block_ids)} block ids for {expected} resident blocks"
        )
    return torch.as_tensor(list(block_ids), dtype=torch.long)


def _paged_value(
    name: str, kind: str, layer: Any, paged: torch.Tensor, rows: tuple[int, int, int], tpb: int
) -> torch.Tensor:
    """The resident blocks of one cache layer, shaped ``(blocks, *paged.shape[1:])``.

    Raises:
        ValueError: the layer's shape, dtype or token count does not match ``paged``.
    """
    nres, row0, row1 = rows
    if kind in ("linear", "mamba"):
        states = layer.conv_states if name.endswith(".conv_state") else layer.recurrent_states
        src: torch.Tensor = states[0]  # (batch 1, *state shape)
        if tuple(src.shape[1:]) != tuple(paged.shape[1:]):
            raise ValueError(f"{name}: cache state {tuple(src.shape)} != paged {paged.shape}")
    elif kind == "mla":
        src = torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)
    else:
        src = torch.stack([layer.keys[0], layer.values[0]]).transpose(1, 2)
    if src.dtype != paged.dtype:  # a cast would not page out the cache bitwise
        raise ValueError(f"{name}: cache dtype {src.dtype} != paged tensor dtype {paged.dtype}")
    if kind in ("linear", "mamba"):
        return src
    tokens_held = src.shape[0] if kind == "mla" else src.shape[1]
    if tokens_held != row1 - row0:
        raise ValueError(f"{name}: cache holds {tuple(src.shape)}, expected {row1 - row0} tokens")
    if kind == "mla":
        buf = paged.new_zeros((nres * tpb, *paged.shape[2:]))
        buf[row0:row1] = src
        return buf.view(nres, tpb, *paged.shape[2:])
    buf = paged.new_zeros((2, nres * tpb, *paged.shape[3:]))
    buf[:, row0:row1] = src
    return buf.view(2, nres, tpb, *paged.shape[3:]).transpose(0, 1)


def cache_to_blocks(
    cache: Any,
    kv: HFKVGroups,
    num_tokens: int,
    block_tables: Mapping[int, Sequence[int]],
) -> None:
    """Copy a transformers ``DynamicCache`` (batch 1) into the paged block tensors.

    Positions outside the cache (the part of a sliding window block that the
    layer already dropped, the tail of a partial last block) are written as zeros.
    Every argument is checked before the first paged tensor is written.

    Args:
        cache: a ``DynamicCache`` holding ``num_tokens`` tokens of one sequence.
        kv: the paged tensors (:func:`hf_kv_groups`).
        num_tokens: tokens in the cache.
        block_tables: ``group_id -> GPU block ids`` of that group's resident
            blocks (:func:`resident_blocks`), in order.

    Raises:
        ValueError: a table is missing or has the wrong length; a cache layer
            holds another number of tokens (also by its ``cumulative_length``
            where it has one), another state shape, or another dtype than
            its paged tensor (nothing is cast). Nothing was written then.
    """
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for group_id, tensors in kv.groups.items():
        kind, window = kv.kinds[group_id], kv.window[group_id]
        tpb = kv.tokens_per_block[group_id]
        rows = _token_rows(kind, window, num_tokens, tpb)
        ids = _check_ids(group_id, block_tables, rows[0])
        for name, paged in tensors.items():
            layer: Any = cache.layers[kv.layer_index[name]]
            seen = getattr(layer, "cumulative_length", None)
            if isinstance(seen, int) and seen != num_tokens:
                raise ValueError(f"{name}: the cache has seen {seen} tokens, not {num_tokens}")
            writes.append((paged, ids, _paged_value(name, kind, layer, paged, rows, tpb)))
    for paged, ids, value in writes:
        paged[ids] = value


def _set_linear_length(layer: Any, num_tokens: int) -> None:
    """Give a rebuilt linear / mamba layer the token count the paged-out one had.

    transformers >= 5.25 counts a recurrent layer's tokens in
    ``cumulative_length_linear`` (a 0-d tensor) and ``DynamicCache.get_seq_length``
    reads it; earlier 5.x releases have no such counter.
    """
    length = getattr(layer, "cumulative_length_linear", None)
    if isinstance(length, torch.Tensor):
        length.fill_(num_tokens)
    elif length is not None:
        layer.cumulative_length_linear = num_tokens


def blocks_to_cache(
    config: Any,
    kv: HFKVGroups,
    num_tokens: int,
    block_tables: Mapping[int, Sequence[int]],
) -> Any:
    """Rebuild a transformers ``DynamicCache`` (batch 1) from the paged block tensors.

    The inverse of :func:`cache_to_blocks`: the result holds, bitwise, the same
    K/V (or latent, or conv/recurrent state) values and the same sequence
    bookkeeping (``cumulative_length``, ``has_previous_state``) as the cache
    that was paged out, so a model continues from it exactly as from the original.

    Args:
        config: the model's transformers config.
        kv: the paged tensors.
        num_tokens: tokens the cache held.
        block_tables: ``group_id -> GPU block ids`` of the resident blocks.

    Returns:
        A ``DynamicCache(config=config)`` with every cached layer initialised.

    Raises:
        ValueError: a table is missing or has the wrong length, or
            ``num_tokens`` is not positive.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for group_id, tensors in kv.groups.items():
        kind, window = kv.kinds[group_id], kv.window[group_id]
        tpb = kv.tokens_per_block[group_id]
        nres, row0, row1 = _token_rows(kind, window, num_tokens, tpb)
        ids = _check_ids(group_id, block_tables, nres)
        for name, paged in tensors.items():
            layer: Any = cache.layers[kv.layer_index[name]]
            if kind in ("linear", "mamba"):
                state = paged[ids[0]].unsqueeze(0).clone()
                if name.endswith(".conv_state"):
                    layer.lazy_initialization(
                        conv_states=state, state_idx=0, conv_kernel_size=state.shape[-1]
                    )
                    layer.conv_states[0].copy_(state)
                    layer.has_previous_state[0] = True
                else:
                    layer.lazy_initialization(recurrent_states=state, state_idx=0)
                    layer.recurrent_states[0].copy_(state)
                _set_linear_length(layer, num_tokens)
                continue
            if kind == "mla":
                rows = paged[ids].reshape(nres * tpb, paged.shape[-1])[row0:row1]
                split = int(_text_config(config).kv_lora_rank)
                keys = rows[:, :split].contiguous()[None, None]
                values = rows[:, split:].contiguous()[None, None]
            else:
                rows = paged[ids].transpose(0, 1).reshape(2, nres * tpb, *paged.shape[3:])
                rows = rows[:, row0:row1].transpose(1, 2)  # (2, heads, tokens, head_dim)
                keys, values = rows[0].contiguous()[None], rows[1].contiguous()[None]
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = num_tokens
    return cache
