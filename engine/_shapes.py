"""Synthetic KV cache layouts shaped like real models, for benchmarks.

Shapes follow the models' published configs (``config.json`` on the Hugging
Face hub): Gemma-3-270M (18 layers: 15 sliding-window + 3 full attention,
1 KV head of dim 256), Llama-3-8B (32 full attention layers, 8 KV heads of dim
128), DeepSeek-V3 (61 MLA layers, latent 512 + rope 64), DeepSeek-V3.2 (61
MLA layers plus the 61 key caches of its sparse-attention indexer, both in
vLLM's FP8 formats), Qwen3-Next-80B-A3B (48 layers: 36 gated-delta-net linear
attention + 12 full attention with 2 KV heads of dim 256). Layers are grouped
as vLLM's hybrid KV cache manager does: one group per attention type, split
into groups of equal layer counts.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvtier._hf import split_like_vllm
from kvtier.errors import InvalidArgumentError
from kvtier.layout import KVLayout


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its attention type and the shape of ONE block (page) of it.

    ``name``: the layer's name in the built :class:`KVLayout`; ``None`` names
    it ``model.layers.<index>`` by its position in :attr:`ModelShape.layers`.
    """

    kind: str
    page_shape: tuple[int, ...]
    name: str | None = None


@dataclass(frozen=True)
class ModelShape:
    """A model's KV cache shape: layers, dtype, tokens per block."""

    name: str
    layers: tuple[LayerSpec, ...]
    dtype: torch.dtype
    tokens_per_block: int

    def groups(self) -> list[list[int]]:
        """Layer indices per KV cache group, split as vLLM splits them (:func:`split_like_vllm`).

        Layers of one ``kind`` share groups, in order of first appearance.
        """
        by_kind: dict[str, list[int]] = {}
        for i, layer in enumerate(self.layers):
            by_kind.setdefault(layer.kind, []).append(i)
        return split_like_vllm(list(by_kind.values()))

    def block_nbytes(self) -> int:
        """Bytes of one block summed over all layers."""
        return sum(math.prod(lay.page_shape) for lay in self.layers) * self.dtype.itemsize

    def build(self, num_blocks: int, device: str | torch.device = "cpu") -> KVLayout:
        """Allocate ``(num_blocks, *page_shape)`` tensors per layer, filled with random bytes."""
        gen = torch.Generator().manual_seed(0)
        groups: dict[int, dict[str, torch.Tensor]] = {}
        for g, idx in enumerate(self.groups()):
            groups[g] = {}
            for i in idx:
                t = torch.empty((num_blocks, *self.layers[i].page_shape), dtype=self.dtype)
                u8 = t.view(torch.uint8)
                u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=gen))
                groups[g][self.layers[i].name or f"model.layers.{i}"] = t.to(device)
        return KVLayout.from_tensors(groups, tokens_per_block=self.tokens_per_block)


def _attn(kind: str, tpb: int, heads: int, dim: int) -> LayerSpec:
    return LayerSpec(kind, (2, tpb, heads, dim))


def _gemma3_270m(tpb: int) -> ModelShape:
    layers = [_attn("full" if (i + 1) % 6 == 0 else "sliding", tpb, 1, 256) for i in range(18)]
    return ModelShape("gemma-3-270m", tuple(layers), torch.bfloat16, tpb)


def _llama3_8b(tpb: int) -> ModelShape:
    return ModelShape(
        "llama-3-8b", tuple(_attn("full", tpb, 8, 128) for _ in range(32)), torch.bfloat16, tpb
    )


def _deepseek_v3(tpb: int) -> ModelShape:
    return ModelShape(
        "deepseek-v3", tuple(LayerSpec("mla", (tpb, 576)) for _ in range(61)), torch.bfloat16, tpb
    )


def _deepseek_v32(tpb: int) -> ModelShape:
    # MLA + indexer, two KV cache groups of 61 layers with pages of unequal size.
    # vLLM's default FP8 formats, one byte per element: the MLA latent as
    # "fp8_ds_mla", 656 bytes per token (512 FP8 values, 4 float32 scales, 64
    # bf16 rope values: FlashMLASparseBackend.get_kv_cache_shape), and the
    # indexer's key cache, 132 bytes per token (128 FP8 values and one float32
    # scale per quant block of 128: DeepseekV32IndexerCache's head_dim
    # 128 + 128 // 128 * 4, an MLAAttentionSpec of one head).
    layers: list[LayerSpec] = []
    for i in range(61):
        layers.append(LayerSpec("mla", (tpb, 656), f"model.layers.{i}.self_attn.mla_attn"))
        layers.append(
            LayerSpec("indexer", (tpb, 132), f"model.layers.{i}.self_attn.indexer.k_cache")
        )
    return ModelShape("deepseek-v3.2", tuple(layers), torch.uint8, tpb)


def _qwen3_next(tpb: int) -> ModelShape:
    # Gated DeltaNet: conv state (conv_dim=8192 x kernel 4) + recurrent state
    # (16 value heads x 128 x 128, kept in bf16 here) per sequence snapshot.
    linear = LayerSpec("linear", (8192 * 4 + 16 * 128 * 128,))
    layers = [_attn("full", tpb, 2, 256) if (i + 1) % 4 == 0 else linear for i in range(48)]
    return ModelShape("qwen3-next", tuple(layers), torch.bfloat16, tpb)


SHAPES = {
    "gemma-3-270m": _gemma3_270m,
    "llama-3-8b": _llama3_8b,
    "deepseek-v3": _deepseek_v3,
    "deepseek-v3.2": _deepseek_v32,
    "qwen3-next": _qwen3_next,
}


def model_shape(name: str, tokens_per_block: int = 16) -> ModelShape:
    """A named synthetic shape, or one read from a JSON file.

    The JSON form is ``{"name": str, "dtype": "bfloat16", "tokens_per_block": int,
    "layers": [{"kind": str, "page_shape": [int, ...]}, ...]}``.

    Raises:
        InvalidArgumentError: unknown name or malformed file.
    """
    if name in SHAPES:
        return SHAPES[name](tokens_per_block)
    if os.path.isfile(name):
        try:
            with open(name) as f:
                spec: Any = json.load(f)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"layout file {name}: {exc}") from exc
        return _shape_of_json(name, spec, tokens_per_block)
    if name.endswith(".json") or os.sep in name:
        raise InvalidArgumentError(f"layout file {name}: no such file")
    raise InvalidArgumentError(f"unknown layout {name!r}: one of {sorted(SHAPES)} or a JSON file")


_QUANTIZED = frozenset(
    getattr(torch, n)
    for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, n)
)
"""Quantized dtypes: a tensor of them cannot be filled with random bytes."""


def _shape_of_json(path: str, spec: Any, tokens_per_block: int) -> ModelShape:
    """Check a JSON layout's fields (types and sizes); see :func:`model_shape`."""

    def bad(what: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"layout file {path}: {what}")

    if not isinstance(spec, dict):
        raise bad(f"expected an object, got {type(spec).__name__}")
    layers = spec.get("layers")
    if not isinstance(layers, list) or not layers:
        raise bad('"layers" must be a non-empty list of {"kind": str, "page_shape": [int, ...]}')
    specs = []
    for i, lay in enumerate(layers):
        if not isinstance(lay, dict) or not isinstance(lay.get("kind"), str):
            raise bad(f'layers[{i}]: needs a "kind" string')
        shape = lay.get("page_shape")
        if (
            not isinstance(shape, list)
            or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
        ):
            raise bad(f'layers[{i}]: "page_shape" must be a non-empty list of ints >= 1')
        specs.append(LayerSpec(lay["kind"], tuple(shape)))
    dtype = getattr(torch, str(spec.get("dtype", "bfloat16")), None)
    if not isinstance(dtype, torch.dtype) or dtype in _QUANTIZED:
        raise bad(f'"dtype" {spec.get("dtype")!r} is not a plain torch dtype (e.g. "bfloat16")')
    tpb = spec.get("tokens_per_block", tokens_per_block)
    if not isinstance(tpb, int) or isinstance(tpb, bool) or tpb < 1:
        raise bad(f'"tokens_per_block" must be an int >= 1, got {tpb!r}')
    name = spec.get("name", os.path.basename(path))
    return ModelShape(str(name), tuple(specs), dtype, tpb)
