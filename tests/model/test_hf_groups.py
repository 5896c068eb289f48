"""KV cache groups of transformers configs, grouped as vLLM groups them (kvtier._hf)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier._hf import (  # noqa: E402
    blocks_to_cache,
    cache_to_blocks,
    hf_kv_groups,
    resident_blocks,
)
from kvtier._models import TINY_MODELS, load_model  # noqa: E402

pytestmark = pytest.mark.model

T = 16


def _layer_counts(g: Any) -> dict[int, int]:
    return {gid: len(g.layers_of(gid)) for gid in g.groups}


def _shapes(g: Any, gid: int) -> set[tuple[tuple[int, ...], torch.dtype]]:
    return {(tuple(t.shape), t.dtype) for t in g.groups[gid].values()}


def test_gemma3_270m_shape_config_six_groups_of_three() -> None:
    # Gemma-3-270M: 18 layers, 15 sliding (window 512) + 3 full, 1 KV head of 256.
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=18, num_key_value_heads=1, head_dim=256, sliding_window=512
    )
    g = hf_kv_groups(config, 3, T, torch.bfloat16)
    assert list(g.kinds.values()) == ["sliding"] * 5 + ["full"]
    assert set(_layer_counts(g).values()) == {3}
    assert g.layers_of(0) == [0, 6, 12]  # vLLM interleaves: layers[i::num_groups]
    assert g.layers_of(5) == [5, 11, 17]
    assert g.window == {0: 512, 1: 512, 2: 512, 3: 512, 4: 512, 5: None}
    for gid in g.groups:
        assert _shapes(g, gid) == {((3, 2, T, 1, 256), torch.bfloat16)}
    assert g.block_dim == 0
    assert g.tokens_per_block == dict.fromkeys(range(6), T)


def test_gemma3_default_pads_like_vllm() -> None:
    # 22 sliding + 4 full: group size 4, sliding split in 6 groups of 4,4,4,4,3,3
    # (vLLM pads the short ones with a padding layer).
    g = hf_kv_groups(transformers.Gemma3TextConfig(), 1, T, torch.bfloat16)
    kinds = Counter(g.kinds.values())
    assert kinds == {"sliding": 6, "full": 1}
    counts = _layer_counts(g)
    assert max(counts.values()) == 4
    assert min(counts.values()) == 3
    assert sum(counts.values()) == 26


def test_llama4_chunked_and_full() -> None:
    g = hf_kv_groups(transformers.Llama4TextConfig(), 1, T, torch.bfloat16)
    assert Counter(g.kinds.values()) == {"chunked": 3, "full": 1}
    assert set(_layer_counts(g).values()) == {12}
    chunked = next(gid for gid, k in g.kinds.items() if k == "chunked")
    assert g.window[chunked] == 8192
    assert _shapes(g, chunked) == {((1, 2, T, 8, 128), torch.bfloat16)}


@pytest.mark.parametrize(
    ("name", "linear_groups", "per_group"),
    [("Qwen3NextConfig", 3, 12), ("Qwen3_5TextConfig", 3, 8)],
)
def test_qwen_linear_attention_and_full(name: str, linear_groups: int, per_group: int) -> None:
    config = getattr(transformers, name)()
    g = hf_kv_groups(config, 1, T, torch.bfloat16)
    assert Counter(g.kinds.values()) == {"linear": linear_groups, "full": 1}
    assert set(_layer_counts(g).values()) == {per_group}
    linear = next(gid for gid, k in g.kinds.items() if k == "linear")
    conv_dim = (
        2 * config.linear_num_key_heads * config.linear_key_head_dim
        + config.linear_num_value_heads * config.linear_value_head_dim
    )
    assert _shapes(g, linear) == {
        ((1, conv_dim, config.linear_conv_kernel_dim), torch.bfloat16),
        (
            (
                1,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
            ),
            torch.float32,
        ),
    }
    assert g.window[linear] is None


def test_jamba_mamba_and_full() -> None:
    config = transformers.JambaConfig()
    g = hf_kv_groups(config, 1, T, torch.bfloat16)
    assert Counter(g.kinds.values()) == {"mamba": 7, "full": 1}
    assert set(_layer_counts(g).values()) == {4}
    mamba = next(gid for gid, k in g.kinds.items() if k == "mamba")
    inner = config.mamba_expand * config.hidden_size
    assert _shapes(g, mamba) == {
        ((1, inner, config.mamba_d_conv), torch.bfloat16),
        ((1, inner, config.mamba_d_state), torch.float32),
    }
    full = next(gid for gid, k in g.kinds.items() if k == "full")
    assert _shapes(g, full) == {((1, 2, T, 8, 128), torch.bfloat16)}


def test_deepseek_v3_mla_latent() -> None:
    config = transformers.DeepseekV3Config()
    g = hf_kv_groups(config, 2, T, torch.bfloat16)
    assert g.kinds == {0: "mla"}
    assert len(g.layers_of(0)) == 61
    assert _shapes(g, 0) == {((2, T, 512 + 64), torch.bfloat16)}


def test_gpt_oss_sliding_and_full_with_sinks() -> None:
    # 18 + 18 alternating layers; attention sinks are weights and change no cache shape.
    g = hf_kv_groups(transformers.GptOssConfig(), 1, T, torch.bfloat16)
    assert g.kinds == {0: "sliding", 1: "full"}
    assert _layer_counts(g) == {0: 18, 1: 18}
    assert g.layers_of(0) == list(range(0, 36, 2))
    assert g.window[0] == 128
    assert _shapes(g, 0) == _shapes(g, 1) == {((1, 2, T, 8, 64), torch.bfloat16)}


def test_near_equal_counts_use_the_largest_group_size() -> None:
    # vLLM: when max < 1.25 * min the largest count is the group size (12 sw + 13 full -> 2 groups).
    config = transformers.GptOssConfig(
        num_hidden_layers=25, layer_types=["sliding_attention"] * 12 + ["full_attention"] * 13
    )
    g = hf_kv_groups(config, 1, T, torch.bfloat16)
    assert _layer_counts(g) == {0: 12, 1: 13}


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        hf_kv_groups(transformers.GptOssConfig(), 0, T, torch.bfloat16)


@pytest.mark.parametrize(
    ("kind", "window", "tokens", "expected"),
    [
        ("full", None, 192, range(0, 12)),
        ("mla", None, 200, range(0, 13)),
        ("sliding", 32, 192, range(10, 12)),  # keeps 31 tokens: 161..191
        ("sliding", 32, 20, range(0, 2)),
        ("chunked", 32, 192, range(10, 12)),
        ("linear", None, 192, range(11, 12)),
        ("mamba", None, 192, range(11, 12)),
    ],
)
def test_resident_blocks(kind: str, window: int | None, tokens: int, expected: range) -> None:
    assert resident_blocks(kind, window, tokens, T) == expected


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for layer in cache.layers:
        if hasattr(layer, "conv_states"):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            out += [layer.keys, layer.values]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_pack_unpack_is_bitwise(name: str, dtype: torch.dtype) -> None:
    """Cache -> paged blocks (shuffled block ids) -> cache gives torch.equal tensors."""
    model = load_model(name, dtype)
    tokens = 100
    ids = torch.randint(3, 250, (1, tokens), generator=torch.Generator().manual_seed(0))
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    num_blocks = tokens // T + 3
    g = hf_kv_groups(model.config, num_blocks, T, dtype)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables = {
        gid: perm[: len(resident_blocks(g.kinds[gid], g.window[gid], tokens, T))]
        for gid in g.groups
    }
    cache_to_blocks(cache, g, tokens, tables)
    rebuilt = blocks_to_cache(model.config, g, tokens, tables)
    a, b = _cache_tensors(cache), _cache_tensors(rebuilt)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape
        assert x.dtype == y.dtype
        assert torch.equal(x, y)
    assert rebuilt.get_seq_length() == cache.get_seq_length() == tokens
