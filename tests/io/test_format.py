"""Row format: encode/decode round trips and corruption detection (hypothesis), digest."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import StorageError
from kvtier.io import FORMAT_VERSION, format_digest
from kvtier.io._format import (
    HEADER_NBYTES,
    TRAILER_NBYTES,
    RowTrailer,
    SegmentHeader,
    decode_header,
    decode_trailer,
    digest16,
    encode_header,
    encode_trailer,
    is_blank,
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)

trailers = st.builds(
    RowTrailer,
    digest=st.binary(min_size=32, max_size=32),
    block_hash=st.binary(min_size=1, max_size=64),
    group_id=u32,
    start=u32,
    stop=u32,
    payload_nbytes=u64,
    seq=u64,
    checksum=u64,
)
headers = st.builds(
    SegmentHeader,
    digest=st.binary(min_size=32, max_size=32),
    group_id=u32,
    row_nbytes=u64,
    num_rows=u64,
    layout_json=st.text(max_size=300),
)


@given(trailers)
def test_trailer_round_trip(trailer: RowTrailer) -> None:
    raw = encode_trailer(trailer)
    assert len(raw) == TRAILER_NBYTES
    assert decode_trailer(raw) == trailer
    assert decode_trailer(memoryview(raw)) == trailer
    assert not is_blank(raw)


@settings(max_examples=300)
@given(trailers, st.integers(0, TRAILER_NBYTES - 1), st.integers(1, 255))
def test_any_single_corrupted_trailer_byte_is_rejected(trailer, pos, flip) -> None:
    raw = bytearray(encode_trailer(trailer))
    raw[pos] ^= flip
    with pytest.raises(StorageError) as info:
        decode_trailer(bytes(raw))
    assert info.value.kind == "trailer"


@given(headers)
def test_header_round_trip(header: SegmentHeader) -> None:
    raw = encode_header(header)
    assert len(raw) == HEADER_NBYTES
    assert decode_header(raw) == header
    assert raw.startswith(b"KVTROWS\0")


@given(headers, st.integers(0, HEADER_NBYTES - 1), st.integers(1, 255))
def test_any_single_corrupted_header_byte_is_rejected(header, pos, flip) -> None:
    raw = bytearray(encode_header(header))
    raw[pos] ^= flip
    with pytest.raises(StorageError) as info:
        decode_header(bytes(raw))
    assert info.value.kind == "header"


def test_truncated_or_blank_blocks_are_rejected() -> None:
    t = RowTrailer(b"d" * 32, b"h", 0, 0, 1, 10, 1, 5)
    with pytest.raises(StorageError):
        decode_trailer(encode_trailer(t)[:-1])
    with pytest.raises(StorageError):
        decode_trailer(bytes(TRAILER_NBYTES))
    assert is_blank(bytes(TRAILER_NBYTES))
    with pytest.raises(ValueError, match="block_hash"):
        encode_trailer(RowTrailer(b"d" * 32, b"", 0, 0, 1, 10, 1, 5))
    with pytest.raises(ValueError, match="fit"):
        encode_header(SegmentHeader(b"d" * 32, 0, 4096, 1, "x" * 5000))


def _digest(**over):
    kw = {
        "layout_description": {"groups": {"0": [1, 2]}},
        "blocks_per_chunk": 4,
        "row_nbytes": {0: 8192, 1: 4096 * 3},
        "namespace": "m/rank0",
    }
    kw.update(over)
    return format_digest(**kw)


def test_format_digest_is_canonical_and_sensitive() -> None:
    base = _digest()
    assert len(base) == 32
    assert FORMAT_VERSION == 1
    assert len(digest16(base)) == 16
    # key order and dict construction do not matter
    assert _digest(row_nbytes={1: 4096 * 3, 0: 8192}) == base
    changed = [
        _digest(layout_description={"groups": {"0": [1, 3]}}),
        _digest(blocks_per_chunk=8),
        _digest(row_nbytes={0: 8192, 1: 4096 * 4}),
        _digest(row_nbytes={0: 8192, 1: 4096 * 3, 2: 4096}),
        _digest(namespace="m/rank1"),
    ]
    assert len({base, *changed}) == len(changed) + 1
