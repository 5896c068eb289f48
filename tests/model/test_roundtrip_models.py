"""Real-model round trips through kvtier: store, drop, reopen, load, resume bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvtier._models import TINY_MODELS
from kvtier.roundtrip import (
    RoundtripReport,
    RoundtripSuite,
    aroundtrip,
    block_hashes,
    run_roundtrip,
)

pytestmark = pytest.mark.model


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _single(report: RoundtripReport | RoundtripSuite) -> RoundtripReport:
    assert isinstance(report, RoundtripReport)
    return report


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_tiny_model_roundtrip_is_bitwise(name: str, dtype: str, tmp_path: Path) -> None:
    report = _single(run_roundtrip(name, dtype=dtype, root=tmp_path))
    assert report.ok, report.format()
    assert report.tokens_equal
    assert report.logits_equal
    assert report.store_stats.evictions == 0
    assert report.num_keys == report.keys_fit_largest
    assert sum(g.loaded for g in report.groups) == report.num_keys
    # The CPU budget holds exactly the keys; slots sized for the sum would hold fewer.
    if len(report.groups) > 1:
        assert report.keys_fit_sum < report.keys_fit_largest
    # Every group had something to store, on CPU and NVMe.
    assert all(g.keys > 0 for g in report.groups)
    assert report.nvme_write_failures == 0
    assert list(tmp_path.glob("**/g*/*.kvrows"))


def test_tiny_all_suite(tmp_path: Path) -> None:
    suite = run_roundtrip("tiny-all", prompt_tokens=40, decode_tokens=2, root=tmp_path)
    assert isinstance(suite, RoundtripSuite)
    assert suite.ok, suite.format()
    assert [r.model for r in suite.reports] == sorted(TINY_MODELS)
    assert "OK" in suite.format()


async def test_async_variant(tmp_path: Path) -> None:
    report = await aroundtrip(
        "tiny-gpt-oss", prompt_tokens=70, blocks_per_chunk=2, decode_tokens=2, root=tmp_path
    )
    assert report.ok, report.format()


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3-next", "tiny-deepseek-v3"])
def test_flipped_payload_bit_is_a_failed_load(name: str, tmp_path: Path) -> None:
    """Negative control: one flipped payload bit on NVMe is caught by the checksum."""
    report = _single(run_roundtrip(name, root=tmp_path, corrupt_one_row=True, decode_tokens=2))
    assert len(report.failed) + report.missing == 1, report.format()
    assert sum(g.loaded for g in report.groups) == report.num_keys - 1
    assert not report.ok
    assert not report.logits_equal


@pytest.mark.parametrize(
    ("name", "prompt_tokens", "group"),
    [
        ("tiny-gemma3", 200, 0),  # sliding
        ("tiny-gemma3", 200, 5),  # full
        ("tiny-jamba", 200, 0),  # mamba state
        ("tiny-qwen3-next", 200, 0),  # linear-attention state
        ("tiny-deepseek-v3", 200, 0),  # MLA latent
        # Chunked attention (chunk 32) only reads the current chunk: resuming at
        # 176 (mid-chunk) needs the chunked group; resuming at 192 would not.
        ("tiny-llama4", 180, 0),
    ],
)
def test_skipping_one_group_breaks_bitwise_equality(
    name: str, prompt_tokens: int, group: int, tmp_path: Path
) -> None:
    """Negative control: the comparison is sensitive to every kind of group."""
    report = _single(
        run_roundtrip(
            name, prompt_tokens=prompt_tokens, root=tmp_path, skip_group=group, decode_tokens=2
        )
    )
    assert not report.failed
    assert report.missing == 0
    assert report.groups[group].loaded == 0
    assert not report.logits_equal
    assert not report.ok


def test_chunked_group_is_dead_at_a_chunk_boundary(tmp_path: Path) -> None:
    """Resuming exactly at a chunk boundary, Llama4's chunked layers read no cached token."""
    report = _single(
        run_roundtrip(
            "tiny-llama4", prompt_tokens=200, root=tmp_path, skip_group=0, decode_tokens=2
        )
    )
    assert report.resume_tokens % 32 == 0
    assert report.logits_equal
    assert report.tokens_equal


def test_block_hashes_are_chained_and_stable() -> None:
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2
    assert all(len(h) == 32 for h in a)
    assert a == block_hashes(list(range(40)), 16)
    b = block_hashes([99, *range(1, 40)], 16)
    assert a[0] != b[0]
    assert a[1] != b[1]
    assert block_hashes(list(range(15)), 16) == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dtype"):
        run_roundtrip("tiny-gemma3", dtype="float16")
    with pytest.raises(ValueError, match="unknown model"):
        run_roundtrip("tiny-nope")
    with pytest.raises(ValueError, match="prompt_tokens"):
        run_roundtrip("tiny-gemma3", prompt_tokens=16)


@pytest.mark.slow
def test_gemma3_270m_1000_tokens(tmp_path: Path) -> None:
    report = _single(run_roundtrip("gemma3-270m", prompt_tokens=1000, root=tmp_path))
    assert report.ok, report.format()
    assert [g.kind for g in report.groups] == ["sliding"] * 5 + ["full"]
    assert report.keys_fit_sum < report.keys_fit_largest
