"""Property-based fuzzing of bad input.

The rule under test (README "Errors", docs/DESIGN.md section 6,
``kvtier.errors``): bad input gets a clear typed error and changes no state;
nothing already stored is lost. Bad arguments raise a subclass of
:class:`kvtier.KVTierError` that is also a :class:`ValueError`.

Hypothesis draws malformed and borderline values of many Python types (numpy
scalars, bools, floats, huge and negative ints, str/bytes of 0/1/64/65 bytes,
tensors, generators, unordered sets, nested lists, None, objects with a custom
``__index__``/``__eq__``/``__hash__``, subclasses of int/bytes/list/Chunk,
long lists, duplicated keys) for key and chunk construction, every query and
transfer of a two-group engine with an NVMe tier that already holds keys (CPU
and NVMe-only, full and partial), its :class:`kvtier.BackgroundEngine` twin,
the configuration classes and ``KVLayout.from_tensors``. Each example checks:
the call succeeds exactly when an oracle written from the docstrings says the
input is valid, or raises the documented typed error; after a rejected call
``stats()``, ``lookup`` and ``stored_range`` of the stored keys are unchanged
and they still load byte for byte; valid calls still work afterwards.

Inputs where the code once differed from its documentation have a minimal
regression test each (the property strategies leave those inputs out, so
that the properties test everything else), under a comment that says what
must hold and how it failed.

The engine properties run one engine per test on a private asyncio loop
(examples inside it), every awaited call bounded by a timeout (a hang fails).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import decimal
import enum
import fractions
import hashlib
import numbers
import operator
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import errors

from ._model import BPC, Gpu, at_rest, engine_config, key, nvme_config

NUM_BLOCKS = 64
GROUPS = (0, 1)
CALL_TIMEOUT_S = 20.0


def _settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        database=None,  # no .hypothesis folder in the repository
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
    )


def _attempt(call: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """``(result, None)``, or ``(None, the exception)`` (a hang is a test failure)."""
    try:
        return call(), None
    except (TimeoutError, concurrent.futures.TimeoutError):
        pytest.fail(f"the call did not return within {CALL_TIMEOUT_S} s")
    except Exception as exc:
        return None, exc


def _assert_arg_error(exc: BaseException, *allowed: type[errors.InvalidArgumentError]) -> None:
    """A bad argument: a KVTierError that is also a ValueError (of one of ``allowed``)."""
    assert isinstance(exc, kvtier.KVTierError), f"bare {type(exc).__name__}: {exc}"
    assert isinstance(exc, ValueError), f"{type(exc).__name__} is not a ValueError: {exc}"
    assert isinstance(exc, errors.InvalidArgumentError), type(exc)
    if allowed:
        assert isinstance(exc, allowed), f"{type(exc).__name__} not in {allowed}: {exc}"


# ---------------------------------------------------------------------- odd values


class Idx:
    """An object with a custom ``__index__`` (a valid block id where the int is)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"Idx({self.value})"


class NonIntIndex:
    """``__index__`` returns a float: ``operator.index`` raises TypeError."""

    def __index__(self) -> Any:
        return 1.5

    def __repr__(self) -> str:
        return "NonIntIndex()"


class EqAll:
    """Equal to everything, with a fixed hash (collides with whatever it likes)."""

    def __init__(self, h: int) -> None:
        self.h = h

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return self.h

    def __repr__(self) -> str:
        return f"EqAll({self.h})"


class MyInt(int):
    pass


class MyBytes(bytes):
    pass


class MyList(list):  # type: ignore[type-arg]
    pass


class MyChunk(kvtier.Chunk):
    pass


class Color(enum.IntEnum):
    RED = 1


_NP_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]

ODD_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(max_magnitude=10),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.builds(np.bool_, st.booleans()),
    st.builds(np.float32, st.floats(-10, 10, width=32)),
    st.builds(lambda: decimal.Decimal("1")),
    st.builds(lambda: fractions.Fraction(1, 1)),
    st.builds(NonIntIndex),
    st.builds(EqAll, st.integers(0, 3)),
    st.builds(lambda: torch.tensor(1.0)),
    st.builds(lambda: torch.tensor([1, 2])),
    st.builds(lambda: object()),
)


def _index(value: Any) -> int | None:
    """The block id the docs make of ``value``, or None when it must be rejected.

    ``Chunk``: "a sequence of ints (floats, strings, bools and None are
    rejected, never truncated)". Ints, numpy ints, int tensors of one element
    and objects with ``__index__`` are ints; bools of any kind are not.
    """
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def block_id_values(lo: int = -3, hi: int = NUM_BLOCKS + 3) -> st.SearchStrategy[Any]:
    """Block ids of many types: mostly ints near the valid range, some odd values."""
    near = st.integers(lo, hi)
    return st.one_of(
        near,
        near,
        st.integers(min_value=2**31, max_value=2**80),
        st.integers(min_value=-(2**80), max_value=-1),
        st.builds(lambda t, v: t(v), st.sampled_from(_NP_INTS), st.integers(0, 70)),
        st.builds(lambda v: torch.tensor(v), st.integers(0, 70)),
        st.builds(lambda v: torch.tensor([v]), st.integers(0, 70)),
        st.builds(lambda v: torch.tensor(v, dtype=torch.int32), st.integers(0, 70)),
        st.builds(Idx, st.integers(-2, 70)),
        st.builds(MyInt, st.integers(-2, 70)),
        st.builds(lambda v: Color.RED, st.none()),
        st.lists(st.integers(0, 5), max_size=2),  # nested list
        ODD_SCALARS,
    )


@dataclass
class Box:
    """``items`` in a container of kind ``kind`` (``make`` builds a fresh one: a
    generator can be consumed once), or a non-container standing for them."""

    kind: str
    items: list[Any]
    make: Callable[[], Any]

    def __repr__(self) -> str:
        return f"<{self.kind} of {self.items!r:.300}>"


def _gen(items: list[Any]) -> Iterator[Any]:
    yield from items


def _object_array(items: list[Any]) -> Any:
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out


def boxes(items: list[Any], only: Sequence[str] = ()) -> st.SearchStrategy[Box]:
    """``items`` in one of many containers (ordered, or not a container at all)."""
    kinds: dict[str, Callable[[], Any]] = {
        "list": lambda: list(items),
        "tuple": lambda: tuple(items),
        "MyList": lambda: MyList(items),
        "generator": lambda: _gen(items),
        "deque": lambda: collections.deque(items),
        "np-object-array": lambda: _object_array(items),
        "None": lambda: None,
        "str": lambda: "".join(str(i) for i in items) or "0",
        "bytes": lambda: bytes(range(min(len(items), 3))) or b"\x00",
        "int": lambda: len(items),
    }
    if items and all(type(i) is int and -(2**63) <= i < 2**63 for i in items):
        kinds["int64-tensor"] = lambda: torch.tensor(items, dtype=torch.int64)
        kinds["np-int64-array"] = lambda: np.array(items, dtype=np.int64)
    names = sorted(only or kinds)
    return st.sampled_from(names).map(lambda k: Box(k, list(items), kinds[k]))


# ---------------------------------------------------------------------- OffloadKey / Chunk

HASHES = st.one_of(
    st.binary(min_size=0, max_size=0),
    st.binary(min_size=1, max_size=1),
    st.binary(min_size=64, max_size=64),
    st.binary(min_size=65, max_size=65),
    st.binary(min_size=0, max_size=70),
    st.binary(min_size=1, max_size=64).map(MyBytes),
    st.binary(min_size=1, max_size=64).map(bytearray),
    st.binary(min_size=1, max_size=64).map(memoryview),
    st.binary(min_size=1, max_size=64).map(np.bytes_),
    st.text(min_size=1, max_size=64),
    st.integers(),
    st.none(),
    st.builds(lambda: torch.zeros(4, dtype=torch.uint8)),
)

GROUP_IDS = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([2**32 - 1, 2**32, 2**63, -(2**63)]),
    st.builds(lambda t, v: t(v), st.sampled_from(_NP_INTS), st.integers(0, 3)),
    st.builds(MyInt, st.integers(-1, 3)),
    st.builds(lambda: Color.RED),
    st.builds(Idx, st.integers(0, 3)),
    ODD_SCALARS,
)


def _key_valid(block_hash: Any, group_id: Any) -> bool:
    """OffloadKey's docstring: bytes 1..64 long, a non-negative int group (< 2**32)."""
    hash_ok = isinstance(block_hash, bytes) and 1 <= len(block_hash) <= 64
    gid_ok = isinstance(group_id, int) and not isinstance(group_id, bool) and 0 <= group_id < 2**32
    return hash_ok and gid_ok


@_settings(400)
@given(block_hash=HASHES, group_id=GROUP_IDS)
def test_offload_key_accepts_exactly_what_its_docstring_says(
    block_hash: Any, group_id: Any
) -> None:
    valid = _key_valid(block_hash, group_id)
    k, exc = _attempt(lambda: kvtier.OffloadKey(block_hash, group_id))
    if exc is not None:
        assert not valid, f"valid key rejected: {exc!r}"
        _assert_arg_error(exc)
        return
    assert valid, f"invalid key accepted: {k!r}"
    assert k == kvtier.OffloadKey(bytes(block_hash), int(group_id))
    assert hash(k) == hash(kvtier.OffloadKey(bytes(block_hash), int(group_id)))
    assert eval(repr(k), {"OffloadKey": kvtier.OffloadKey}) == k


_K = kvtier.OffloadKey(b"\x01" * 16, 0)

OFFSETS = st.one_of(
    st.integers(-2, BPC + 1),
    st.integers(min_value=2**40, max_value=2**80),
    st.booleans(),
    st.builds(lambda t, v: t(v), st.sampled_from(_NP_INTS), st.integers(0, 3)),
    st.builds(MyInt, st.integers(0, 3)),
    st.floats(0, 3),
    st.none(),
    st.text(max_size=2),
)


@st.composite
def chunk_inputs(draw: st.DrawFn) -> tuple[Box, Any]:
    if draw(st.integers(0, 9)) == 0:  # a long list, maybe with one odd id in it
        items: list[Any] = list(range(draw(st.integers(1000, 20000))))
        if draw(st.booleans()):
            items.insert(draw(st.integers(0, len(items))), draw(block_id_values()))
    else:
        items = draw(st.lists(block_id_values(), max_size=6))
    box = draw(boxes(items))
    offset = draw(OFFSETS)
    return box, offset


@_settings(400)
@given(chunk_inputs())
def test_chunk_accepts_exactly_what_its_docstring_says(args: tuple[Box, Any]) -> None:
    box, offset = args
    container = box.make()
    iterable = not isinstance(container, str | bytes) and isinstance(container, Iterable)
    ids = [_index(v) for v in box.items]
    ids_ok = iterable and all(i is not None for i in ids)
    offset_ok = isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0
    valid = ids_ok and bool(ids) and offset_ok
    c, exc = _attempt(lambda: kvtier.Chunk(_K, container, offset))
    if exc is not None:
        assert not valid, f"valid chunk rejected ({box!r}, offset={offset!r}): {exc!r}"
        if not ids_ok:
            # block_ids errors come first (BlockIdError), else ChunkRangeError
            _assert_arg_error(exc, errors.BlockIdError)
        else:
            _assert_arg_error(exc, errors.ChunkRangeError)
        return
    assert valid, f"invalid chunk accepted: {box!r}, offset={offset!r} -> {c!r:.200}"
    assert c.block_ids == tuple(ids)
    assert all(type(b) is int for b in c.block_ids), c.block_ids  # plain ints, no tensors
    assert c.offset == offset
    assert c.stop == offset + len(ids)


# ---------------------------------------------------------------------- the engine rig


def _hash(name: object) -> bytes:
    return hashlib.blake2b(f"bad-input-fuzz:{name}".encode(), digest_size=16).digest()


@dataclass
class Rig:
    """A two-group engine with an NVMe tier holding keys on CPU and on NVMe only.

    ``nvme_only``: two full keys and a partial one (sub-blocks 1..3 of group
    0), written by an earlier engine on the same namespace; ``cpu``: two
    full keys and a partial one (sub-block 2 of group 1), stored by this
    engine and flushed (so on NVMe too).
    """

    loop: asyncio.AbstractEventLoop
    gpu: Gpu
    engine: Any  # TransferEngine or BackgroundEngine
    nvme_only: list[kvtier.Chunk]
    cpu: list[kvtier.Chunk]
    background: bool = False

    @property
    def witness(self) -> list[kvtier.Chunk]:
        return [*self.nvme_only, *self.cpu]

    @property
    def witness_keys(self) -> list[kvtier.OffloadKey]:
        return [c.key for c in self.witness]

    def run(self, aw: Awaitable[Any]) -> Any:
        async def bounded() -> Any:
            return await asyncio.wait_for(aw, CALL_TIMEOUT_S)

        return self.loop.run_until_complete(bounded())

    def result(self, fut: concurrent.futures.Future[Any]) -> Any:
        return fut.result(CALL_TIMEOUT_S)

    def snapshot(self) -> tuple[Any, ...]:
        e = self.engine
        keys = self.witness_keys
        return (e.stats(), e.lookup(keys), tuple(e.stored_range(k) for k in keys))

    def quiesce(self) -> None:
        """Wait until every row is written and no slot is pinned or writing."""
        if self.background:
            self.result(self.engine.flush())
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while time.monotonic() < deadline:
                s = self.engine.stats()
                if s.slots_pinned == 0 and s.slots_writing == 0:
                    return
                time.sleep(0.002)
            pytest.fail(f"not at rest: {self.engine.stats()}")
        self.run(self.engine.flush())
        self.run(at_rest(self.engine))

    def _load(self, cs: list[kvtier.Chunk]) -> kvtier.LoadResult:
        for c in cs:
            self.gpu.scribble(c)
        if self.background:
            res: kvtier.LoadResult = self.result(self.engine.load(cs))
        else:
            res = self.run(self.engine.load(cs))
        for c in cs:
            assert c.key in res.loaded, (c.key, res)
            assert self.gpu.holds(c), f"{c.key} loaded WRONG bytes"
        return res

    def scratch(self, chunks: Sequence[kvtier.Chunk]) -> list[kvtier.Chunk]:
        """The same keys and sub-blocks on blocks 48.. of their group (reads back)."""
        out, nxt = [], dict.fromkeys(GROUPS, 48)
        for c in chunks:
            g = c.key.group_id
            n = len(c.block_ids)
            out.append(kvtier.Chunk(c.key, list(range(nxt[g], nxt[g] + n)), c.offset))
            nxt[g] += n
        return out

    def verify_cpu(self) -> None:
        """The CPU keys load byte for byte (a CPU hit: nothing moves between tiers)."""
        self._load(self.scratch(self.cpu))
        self.quiesce()

    def verify_all(self) -> None:
        """Every stored key loads byte for byte, then a fresh key stores and loads."""
        self._load(self.scratch(self.nvme_only))
        self._load(self.scratch(self.cpu))
        k = kvtier.OffloadKey(_hash(f"final-{id(self)}"), 1)
        src = kvtier.Chunk(k, [20, 21, 22, 23])
        self.gpu.write(src)
        if self.background:
            res = self.result(self.engine.store([src]))
        else:
            res = self.run(self.engine.store([src]))
        assert res.stored == (k,), res
        self._load(self.scratch([src]))
        self.quiesce()
        assert all(r is not kvtier.Residency.MISS for r in self.engine.lookup(self.witness_keys))


async def _store_ok(engine: kvtier.TransferEngine, gpu: Gpu, cs: list[kvtier.Chunk]) -> None:
    for c in cs:
        gpu.write(c)
    res = await engine.store(cs)
    assert res.stored == tuple(c.key for c in cs), res
    await engine.flush()


def _witness_chunks() -> tuple[list[kvtier.Chunk], list[kvtier.Chunk]]:
    nvme_only = [
        kvtier.Chunk(key("fz-n0", 0), [0, 1, 2, 3]),
        kvtier.Chunk(key("fz-n1", 1), [0, 1, 2, 3]),
        kvtier.Chunk(key("fz-np", 0), [4, 5], offset=1),
    ]
    cpu = [
        kvtier.Chunk(key("fz-c0", 0), [8, 9, 10, 11]),
        kvtier.Chunk(key("fz-c1", 1), [8, 9, 10, 11]),
        kvtier.Chunk(key("fz-cp", 1), [12], offset=2),
    ]
    return nvme_only, cpu


def _config(gpu: Gpu, root: pathlib.Path) -> kvtier.EngineConfig:
    # 64 slots (the witness CPU keys are used on every example: never LRU);
    # no background growth: stats() stays still between two calls.
    return engine_config(gpu, 64, nvme_config(root, grow_ahead=False))


async def _prepare(gpu: Gpu, root: pathlib.Path) -> None:
    """An earlier engine leaves the NVMe-only keys on the namespace."""
    nvme_only, _ = _witness_chunks()
    async with kvtier.TransferEngine(gpu.layout, _config(gpu, root)) as first:
        await _store_ok(first, gpu, nvme_only)


@pytest.fixture
def rig(tmp_path: pathlib.Path) -> Iterator[Rig]:
    loop = asyncio.new_event_loop()
    gpu = Gpu(NUM_BLOCKS)
    root = tmp_path / "nvme"
    nvme_only, cpu = _witness_chunks()
    loop.run_until_complete(_prepare(gpu, root))
    engine = kvtier.TransferEngine(gpu.layout, _config(gpu, root))
    loop.run_until_complete(engine.start())
    r = Rig(loop, gpu, engine, nvme_only, cpu)
    try:
        r.run(_store_ok(engine, gpu, cpu))
        r.quiesce()
        assert (
            engine.lookup(r.witness_keys)
            == [kvtier.Residency.NVME] * 3 + [kvtier.Residency.CPU] * 3
        )
        yield r
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()


@pytest.fixture
def bg_rig(tmp_path: pathlib.Path) -> Iterator[Rig]:
    gpu = Gpu(NUM_BLOCKS)
    root = tmp_path / "nvme"
    nvme_only, cpu = _witness_chunks()
    asyncio.run(_prepare(gpu, root))
    with kvtier.BackgroundEngine(gpu.layout, _config(gpu, root)) as engine:
        r = Rig(asyncio.new_event_loop(), gpu, engine, nvme_only, cpu, background=True)
        try:
            for c in cpu:
                gpu.write(c)
            assert r.result(engine.store(cpu)).stored == tuple(c.key for c in cpu)
            r.quiesce()
            yield r
        finally:
            r.loop.close()


# ---------------------------------------------------------------------- engine inputs

_W_NVME, _W_CPU = _witness_chunks()
_W_ALL = [*_W_NVME, *_W_CPU]
_W_KEYS = [c.key for c in _W_ALL]

WITNESS_KEYS = st.one_of(
    st.sampled_from(_W_KEYS),
    st.sampled_from(_W_KEYS),
    # the same key built from a bytes subclass and an int subclass: equal, one key
    st.sampled_from(_W_KEYS).map(
        lambda k: kvtier.OffloadKey(MyBytes(k.block_hash), MyInt(k.group_id))
    ),
)
FRESH_KEYS = st.builds(
    lambda n, g: kvtier.OffloadKey(_hash(n), g), st.integers(0, 10**9), st.sampled_from(GROUPS)
)
UNKNOWN_GROUP_KEYS = st.builds(
    lambda n, g: kvtier.OffloadKey(_hash(n), g),
    st.integers(0, 3),
    st.sampled_from([2, 3, 99, 2**32 - 1]),
)
ANY_KEY = st.one_of(WITNESS_KEYS, FRESH_KEYS, FRESH_KEYS, UNKNOWN_GROUP_KEYS)

NOT_A_KEY = st.one_of(
    ODD_SCALARS,
    st.integers(),
    WITNESS_KEYS.map(lambda k: k.block_hash),
    WITNESS_KEYS.map(lambda k: (k.block_hash, k.group_id)),
    WITNESS_KEYS.map(lambda k: kvtier.Chunk(k, [0])),
    WITNESS_KEYS.map(lambda k: EqAll(hash(k))),
    WITNESS_KEYS.map(lambda k: [k]),
)


ODD_INT_IDS = st.one_of(
    st.just(int),
    st.just(int),
    st.sampled_from(_NP_INTS),
    st.just(torch.tensor),
    st.just(Idx),
    st.just(MyInt),
)


@st.composite
def valid_chunks(draw: st.DrawFn, *, load: bool) -> list[kvtier.Chunk]:
    """Chunks this engine accepts (distinct keys; for a load, distinct blocks per group).

    Witness keys come with sub-blocks inside or outside their stored range
    (outside: ``NotStoredError`` in ``LoadResult.failed``, not bad input);
    block ids are ints of odd types (numpy, 0-d tensors, ``__index__``).
    """
    keys = draw(st.lists(st.one_of(WITNESS_KEYS, FRESH_KEYS), max_size=4, unique=True))
    nxt = {g: draw(st.integers(0, NUM_BLOCKS - 4 * BPC)) for g in GROUPS}
    out = []
    for k in keys:
        offset = draw(st.integers(0, BPC - 1))
        n = draw(st.integers(1, BPC - offset))
        if load:
            ids = list(range(nxt[k.group_id], nxt[k.group_id] + n))
            nxt[k.group_id] += n
        else:  # a store may name one block twice
            ids = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n))
        typed = [draw(ODD_INT_IDS)(b) for b in ids]
        cls = draw(st.sampled_from([kvtier.Chunk, kvtier.Chunk, MyChunk]))
        out.append(cls(k, typed, offset))
    return out


@st.composite
def bad_chunks(draw: st.DrawFn) -> Any:
    """Something a store/load must refuse in its list (not a Chunk, or a bad Chunk)."""
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(NOT_A_KEY | WITNESS_KEYS)
    if choice == 1:  # a known key, a block id out of range
        k = draw(st.one_of(WITNESS_KEYS, FRESH_KEYS))
        bad = draw(
            st.one_of(
                st.integers(NUM_BLOCKS, NUM_BLOCKS + 3),
                st.integers(-3, -1),
                st.integers(2**40, 2**80),
                st.integers(-(2**80), -(2**40)),
                st.builds(np.uint64, st.integers(2**63, 2**64 - 1)),
            )
        )
        ids = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=BPC - 1))
        ids.insert(draw(st.integers(0, len(ids))), bad)
        return kvtier.Chunk(k, ids[:BPC])
    if choice == 2:  # offset + len beyond blocks_per_chunk
        k = draw(st.one_of(WITNESS_KEYS, FRESH_KEYS))
        offset = draw(st.one_of(st.integers(1, BPC), st.just(2**70)))
        n = draw(st.integers(max(1, BPC - offset + 1), BPC + 1))
        return kvtier.Chunk(k, list(range(n)), offset)
    return kvtier.Chunk(draw(UNKNOWN_GROUP_KEYS), [0])  # a group the layout lacks


def _chunks_valid(box: Box, *, load: bool) -> bool:
    """The oracle of ``store`` / ``load`` (their docstrings and DESIGN section 6)."""
    container = box.make()
    if isinstance(container, kvtier.Chunk | str | bytes) or not isinstance(container, Sequence):
        return False
    seen: set[kvtier.OffloadKey] = set()
    pages: dict[int, set[int]] = {}
    for c in box.items:
        if not isinstance(c, kvtier.Chunk):
            return False
        g = c.key.group_id
        if g not in GROUPS or c.key in seen:
            return False
        seen.add(c.key)
        if c.offset + len(c.block_ids) > BPC:
            return False
        if not all(0 <= b < NUM_BLOCKS for b in c.block_ids):
            return False
        if load:
            mine = pages.setdefault(g, set())
            if len(set(c.block_ids)) != len(c.block_ids) or mine & set(c.block_ids):
                return False
            mine.update(c.block_ids)
    return True


def _keys_valid(box: Box, *, sequence: bool, unique: bool) -> bool:
    """The oracle of ``lookup`` / ``prefix_hits`` (iterables) and ``prefetch`` (sequences)."""
    container = box.make()
    if isinstance(container, kvtier.OffloadKey | str | bytes):
        return False
    if not isinstance(container, Sequence if sequence else Iterable):
        return False
    if not all(isinstance(k, kvtier.OffloadKey) and k.group_id in GROUPS for k in box.items):
        return False
    return not unique or len(set(box.items)) == len(box.items)


def _long_store(n: int, bad_at: int | None) -> list[Any]:
    """``n`` valid chunks of fresh keys, and one of an unknown group at ``bad_at``."""
    items: list[Any] = [
        kvtier.Chunk(kvtier.OffloadKey(_hash(f"long-{i}"), i % 2), [i % NUM_BLOCKS])
        for i in range(n)
    ]
    if bad_at is not None:
        items.insert(bad_at, kvtier.Chunk(kvtier.OffloadKey(_hash("bad"), 2), [0]))
    return items


VALID_BOXES = ["list", "tuple", "MyList", "deque"]


@st.composite
def engine_calls(draw: st.DrawFn) -> tuple[str, Box]:
    """A call with valid input, or with exactly one defect of many kinds."""
    op = draw(st.sampled_from(["store", "load", "prefetch", "lookup", "prefix_hits", "range"]))
    if op == "range":
        one = draw(
            st.one_of(
                WITNESS_KEYS,
                FRESH_KEYS,
                UNKNOWN_GROUP_KEYS,
                NOT_A_KEY,
                st.builds(MyBytes, st.binary(min_size=1, max_size=4)),
            )
        )
        return op, Box("single", [one], lambda: one)
    chunky = op in ("store", "load")
    if chunky:
        items: list[Any] = draw(valid_chunks(load=op == "load"))
    else:
        items = draw(st.lists(st.one_of(WITNESS_KEYS, FRESH_KEYS), max_size=6))
    defect = draw(
        st.sampled_from(["none", "element", "element", "container", "duplicate", "long", "set"])
    )
    if defect == "element":  # one bad element anywhere among valid ones
        bad = draw(bad_chunks() if chunky else st.one_of(UNKNOWN_GROUP_KEYS, NOT_A_KEY))
        items.insert(draw(st.integers(0, len(items))), bad)
    elif defect == "duplicate" and items:  # a key twice (for a load also its blocks)
        items.insert(draw(st.integers(0, len(items))), draw(st.sampled_from(items)))
    elif defect == "long":  # a long list, maybe with one bad element at its end
        if chunky:
            n = draw(st.integers(500, 2000))
            items = _long_store(n, draw(st.sampled_from([n, None, 0, n // 2])))
        else:
            items = [*_W_KEYS] * 300  # every key 300 times: fine for lookup, not prefetch
            if draw(st.booleans()):
                items.append(draw(NOT_A_KEY | UNKNOWN_GROUP_KEYS))
    if defect == "set":
        try:
            as_set = set(items)
        except TypeError:  # an unhashable element (a list)
            defect = "container"
        else:  # iteration order of this very set: a valid lookup answers in it
            return op, Box("set", list(as_set), lambda: as_set)
    if defect == "container":
        box = draw(boxes(items))
        if items and isinstance(items[0], kvtier.OffloadKey | kvtier.Chunk) and draw(st.booleans()):
            first = items[0]
            box = Box("one item, not in a container", [first], lambda: first)
        return op, box
    return op, draw(boxes(items, VALID_BOXES))


def _check_store(rig: Rig, box: Box, res: kvtier.StoreResult) -> None:
    assert isinstance(res, kvtier.StoreResult)
    keys = [c.key for c in box.items]
    got = [*res.stored, *res.skipped, *res.rejected]
    assert sorted(got, key=repr) == sorted(keys, key=repr), (res, keys)
    for k in _W_KEYS:
        assert k not in res.stored, f"present witness key {k} stored again: {res}"


def _check_load(rig: Rig, box: Box, res: kvtier.LoadResult) -> None:
    assert isinstance(res, kvtier.LoadResult)
    keys = {c.key for c in box.items}
    assert set(res.loaded) | set(res.failed) == keys
    assert not set(res.loaded) & set(res.failed)
    for c in box.items:
        if c.key in _W_KEYS:
            stored = next(w for w in _W_ALL if w.key == c.key)
            inside = stored.offset <= c.offset and c.stop <= stored.stop
            if inside:
                assert c.key in res.loaded, (c, res.failed.get(c.key))
                assert rig.gpu.holds(c), f"{c.key} loaded WRONG bytes"
            else:
                assert isinstance(res.failed[c.key], errors.NotStoredError), res.failed
    for exc in res.failed.values():
        assert isinstance(exc, kvtier.KVTierError), exc


def _invoke(rig: Rig, op: str, arg: Any) -> Any:
    e = rig.engine
    if rig.background:
        if op in ("store", "load", "prefetch"):
            return rig.result(getattr(e, op)(arg))
    elif op in ("store", "load", "prefetch"):
        return rig.run(getattr(e, op)(arg))
    if op == "range":
        return e.stored_range(arg)
    return getattr(e, op)(arg)


def _expected_valid(op: str, box: Box) -> bool:
    if op in ("store", "load"):
        return _chunks_valid(box, load=op == "load")
    if op == "prefetch":
        return _keys_valid(box, sequence=True, unique=True)
    if op in ("lookup", "prefix_hits"):
        return _keys_valid(box, sequence=False, unique=False)
    k = box.items[0]
    return isinstance(k, kvtier.OffloadKey) and k.group_id in GROUPS


def _exercise(rig: Rig, op: str, box: Box) -> None:
    valid = _expected_valid(op, box)
    event(f"{op}: {'valid' if valid else 'invalid'}")
    before = rig.snapshot()
    arg = box.make()
    res, exc = _attempt(lambda: _invoke(rig, op, arg))
    if exc is not None:
        assert not valid, f"{op}: valid input {box!r} rejected: {exc!r}"
        _assert_arg_error(exc)
        after = rig.snapshot()
        assert after == before, f"{op}({box!r}) raised {exc!r} but changed state"
    else:
        assert valid, f"{op}: invalid input {box!r} accepted: {res!r:.300}"
        if op == "store":
            _check_store(rig, box, res)
        elif op == "load":
            _check_load(rig, box, res)
        elif op == "prefetch":
            assert isinstance(res, kvtier.PrefetchResult)
            got = {*res.promoted, *res.resident, *res.failed}
            assert got == set(box.items)
        elif op == "lookup":
            assert len(res) == len(box.items)
            want = dict(zip(rig.witness_keys, before[1], strict=True))
            for k, r in zip(box.items, res, strict=True):
                assert r == want.get(k, r), (k, r, want.get(k))
        elif op == "prefix_hits":
            assert type(res) is int
            assert 0 <= res <= len(box.items)
        else:
            want = dict(zip(rig.witness_keys, before[2], strict=True))
            k = box.items[0]
            assert res == want.get(k, res)
            if k in want:
                assert res is not None
        rig.quiesce()
    rig.verify_cpu()


def test_engine_calls_reject_bad_input_and_change_nothing(rig: Rig) -> None:
    @_settings(300)
    @given(engine_calls())
    def inner(call: tuple[str, Box]) -> None:
        _exercise(rig, *call)

    inner()
    rig.verify_all()


def test_background_engine_rejects_bad_input_and_changes_nothing(bg_rig: Rig) -> None:
    @_settings(150)
    @given(engine_calls())
    def inner(call: tuple[str, Box]) -> None:
        _exercise(bg_rig, *call)

    inner()
    bg_rig.verify_all()


def _done_future() -> concurrent.futures.Future[int]:
    f: concurrent.futures.Future[int] = concurrent.futures.Future()
    f.set_result(1)
    return f


@_settings(80)
@given(
    future=st.one_of(
        st.builds(_done_future),
        st.builds(_done_future),
        st.none(),
        st.integers(),
        st.text(max_size=3),
        st.builds(lambda: object()),
    ),
    timeout=st.one_of(
        st.none(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-(2**70), 2**70),
        st.booleans(),
        st.text(max_size=2),
        st.builds(np.float64, st.floats(0, 10)),
        st.builds(np.int64, st.integers(0, 10)),
    ),
)
def test_background_cancel_rejects_foreign_futures_non_futures_and_bad_timeouts(
    future: Any, timeout: Any
) -> None:
    be = _bg_for_cancel()  # one started engine for every example
    own = be.flush()  # finished: an engine without an NVMe tier has nothing to flush
    own.result(timeout=10)
    timeout_ok = timeout is None or (
        isinstance(timeout, numbers.Real)
        and not isinstance(timeout, bool)
        and 0 <= timeout <= threading.TIMEOUT_MAX
    )
    # A Future this engine did not return is refused, whatever the timeout (not accepted
    # and cancelled, with the wait covering this engine's work only).
    got, exc = _attempt(lambda: be.cancel(future, timeout))
    assert exc is not None, f"cancel({future!r}, {timeout!r}) accepted"
    _assert_arg_error(exc)
    if isinstance(future, concurrent.futures.Future):
        assert future.result() == 1  # left alone
    got, exc = _attempt(lambda: be.cancel(own, timeout))
    if exc is not None:
        assert not timeout_ok, f"cancel(own, {timeout!r}): {exc!r}"
        _assert_arg_error(exc)
    else:
        assert timeout_ok, f"cancel(own, {timeout!r}) accepted"
        assert got is False  # it had finished: left alone


# Regression: a bytes subclass whose __len__ lies does not get past the 1..64-byte check.
def test_offload_key_copies_a_bytes_subclass_and_checks_its_real_length() -> None:
    class Lying(bytes):
        def __len__(self) -> int:
            return 8

    with pytest.raises(errors.InvalidArgumentError, match=r"1\.\.64 bytes"):
        kvtier.OffloadKey(Lying(b"x" * 65), 0)
    key = kvtier.OffloadKey(Lying(b"abc"), 1)
    assert type(key.block_hash) is bytes
    assert key == kvtier.OffloadKey(b"abc", 1)
    assert hash(key) == hash(kvtier.OffloadKey(b"abc", 1))


_BG: list[kvtier.BackgroundEngine] = []


def _bg_for_cancel() -> kvtier.BackgroundEngine:
    if not _BG:
        gpu = Gpu(8)
        _BG.append(kvtier.BackgroundEngine(gpu.layout, engine_config(gpu, 2)).start())
    return _BG[0]


@pytest.fixture(autouse=True, scope="module")
def _close_bg() -> Iterator[None]:
    yield
    for be in _BG:
        be.close()
    _BG.clear()


# ---------------------------------------------------------------------- configuration


@dataclass
class Field:
    valid: st.SearchStrategy[Any]
    invalid: st.SearchStrategy[Any]


_POS_BAD = st.one_of(
    st.integers(max_value=0),
    st.booleans(),
    st.floats(allow_nan=True),
    st.builds(lambda t, v: t(v), st.sampled_from(_NP_INTS), st.integers(1, 8)),
    st.text(max_size=3),
    st.none(),
)


def _mostly(usual: st.SearchStrategy[Any], *rare: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``usual`` 9 times in 10, else one of ``rare``."""
    return st.integers(0, 9).flatmap(lambda i: usual if i < 9 else st.one_of(*rare))


ENGINE_FIELDS: dict[str, Field] = {
    "cpu_bytes": Field(
        _mostly(
            st.integers(64 << 10, 4 << 20),  # room for a few slots
            st.integers(1, 64 << 10),  # maybe not one slot: BudgetError
            st.sampled_from([1 << 62, 1 << 200]),  # cannot be allocated: BudgetError
        ),
        _POS_BAD,
    ),
    "blocks_per_chunk": Field(_mostly(st.integers(1, 8), st.just(2**70)), _POS_BAD),
    "eviction": Field(
        st.sampled_from(["lru", "arc"]),
        st.one_of(
            st.sampled_from(["LRU", "", "fifo", None, 0, b"lru"]),
            st.builds(lambda: ["lru"]),
        ),
    ),
    "max_batch_chunks": Field(st.one_of(st.integers(1, 4096), st.just(2**70)), _POS_BAD),
    "copy_threads": Field(st.integers(1, 3), _POS_BAD),
    "nvme": Field(st.none(), st.sampled_from(["/tmp/x", 5, b"/tmp"]) | st.builds(dict)),
}

NVME_FIELDS: dict[str, Field] = {
    "capacity_bytes": Field(
        _mostly(st.integers(1 << 20, 64 << 20), st.integers(1, 1 << 20)), _POS_BAD
    ),
    "namespace": Field(
        st.one_of(
            st.text(min_size=1, max_size=40).filter(lambda s: "\0" not in s),
            st.sampled_from(["/", "..", "../x", "a/b", ".", "x" * 300, "\ud800"]),
        ),
        st.one_of(st.sampled_from(["", "a\0b", None, b"ns", 5])),
    ),
    "io_backend": Field(
        st.sampled_from(["auto", "posix", "aio", "kvikio"]),
        st.sampled_from(["AIO", "", "io_uring", None, 0, b"posix"]) | st.builds(lambda: ["auto"]),
    ),
    "direct_io": Field(
        st.sampled_from(["auto", "on", "off"]),
        st.sampled_from(["yes", "", None, True, 1, "ON"]),
    ),
    "io_threads": Field(st.one_of(st.integers(1, 4), st.just(10**6)), _POS_BAD),
    "segment_nbytes": Field(
        st.one_of(st.integers(8192, 1 << 24), st.just(1 << 62)),
        st.one_of(st.integers(-5, 8191), st.booleans(), st.floats(), st.none()),
    ),
    "request_nbytes": Field(
        st.integers(1, 1 << 12).map(lambda k: 4096 * k) | st.just(1 << 60),
        st.one_of(
            st.integers(-4096, 1 << 20).filter(lambda n: n <= 0 or n % 4096),
            st.booleans(),
            st.just(4096.0),
        ),
    ),
    "grow_ahead": Field(st.booleans(), st.sampled_from(["yes", 1, 0, None, np.bool_(True)])),
    "eviction_window": Field(st.one_of(st.integers(1, 100), st.just(2**80)), _POS_BAD),
}

ROOT_BAD = st.sampled_from(["", None, b"/tmp/x", 5, "a\0b"]) | st.builds(
    lambda: type("BytesPath", (os.PathLike,), {"__fspath__": lambda s: b"/tmp/x"})()
)


@st.composite
def configs(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any] | None, set[str]]:
    """Field values for EngineConfig (and NVMeConfig): 0-2 of them bad."""
    use_nvme = draw(st.booleans())
    names = list(ENGINE_FIELDS) + ([*NVME_FIELDS, "root"] if use_nvme else [])
    bad = set(draw(st.lists(st.sampled_from(names), max_size=2, unique=True)))
    eng = {n: draw(f.invalid if n in bad else f.valid) for n, f in ENGINE_FIELDS.items()}
    nv = None
    if use_nvme:
        nv = {n: draw(f.invalid if n in bad else f.valid) for n, f in NVME_FIELDS.items()}
        nv["root"] = draw(ROOT_BAD) if "root" in bad else "ROOT"
        if "nvme" in bad:
            bad.discard("nvme")
        eng.pop("nvme")
    return eng, nv, bad


_LAYOUT_GPU = Gpu(16)


def test_configs_reject_bad_values_and_valid_ones_start(tmp_path: pathlib.Path) -> None:
    counter = iter(range(10**6))

    @_settings(200)
    @given(configs())
    def inner(cfg: tuple[dict[str, Any], dict[str, Any] | None, set[str]]) -> None:
        eng, nv, bad = cfg
        valid = not bad
        root = tmp_path / f"r{next(counter)}"
        if nv is not None and nv["root"] == "ROOT":
            nv = {**nv, "root": str(root) if len(str(root)) % 2 else root}

        def make() -> kvtier.EngineConfig:
            if nv is None:
                return kvtier.EngineConfig(**eng)
            return kvtier.EngineConfig(**eng, nvme=kvtier.NVMeConfig(**nv))

        config, exc = _attempt(make)
        event(f"config: {'rejected' if exc else 'accepted'}")
        if exc is not None:
            assert not valid, f"valid config rejected: {exc!r}"
            # BudgetError is a ConfigError; cpu_bytes alone bad: BudgetError
            want = errors.BudgetError if bad == {"cpu_bytes"} else errors.ConfigError
            _assert_arg_error(exc, want)
            assert not root.exists()
            return
        assert valid, f"bad {sorted(bad)} accepted: {eng} {nv}"

        async def start() -> None:
            engine = kvtier.TransferEngine(_LAYOUT_GPU.layout, config)
            try:
                await engine.start()
            finally:
                await engine.aclose()

        try:
            _, exc = _attempt(lambda: asyncio.run(asyncio.wait_for(start(), CALL_TIMEOUT_S)))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        event(f"start: {type(exc).__name__ if exc else 'ok'}")
        if exc is not None:
            # documented: BudgetError (slot or pool), ConfigError (capacity, kvikio, O_DIRECT)
            _assert_arg_error(exc, errors.ConfigError)

    inner()


# ---------------------------------------------------------------------- KVLayout.from_tensors

_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]


@st.composite
def odd_tensors(draw: st.DrawFn) -> torch.Tensor:
    """Small tensors of many dtypes, shapes and strides (random bytes)."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    n = 1
    for s in shape:
        n *= s
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    raw = torch.randint(0, 256, (max(n, 1) * dtype.itemsize * 2,), generator=gen, dtype=torch.uint8)
    t = raw.view(dtype)[: max(n, 1) * 2]
    how = draw(
        st.sampled_from(["plain", "transpose", "step", "expand", "unsqueeze", "grad", "as_strided"])
    )
    if how == "step":
        t = t[::2][:n].reshape(shape) if shape else t[0]
        return t
    t = t[:n].reshape(shape) if shape else t[0]
    if how == "transpose" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif how == "expand" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    elif how == "unsqueeze":
        t = t.unsqueeze(draw(st.integers(0, t.dim())))
    elif how == "grad" and t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn:
        t = t.clone().requires_grad_(True)
    elif how == "as_strided" and t.dim() == 2 and t.numel() > 0:
        # overlapping blocks: block stride smaller than the page
        base = t.contiguous().reshape(-1)
        t = base.as_strided((t.shape[0], t.shape[1]), (1, 1))
    return t


def _random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)


@st.composite
def good_tensor(draw: st.DrawFn, num_blocks: int, block_dim: int) -> torch.Tensor:
    """A registrable tensor: ``num_blocks`` at ``block_dim``, last dim contiguous.

    Any dtype; the block dim anywhere but last, or last when the page is one
    element; made through a permute of a contiguous tensor when it is not
    the first dim (vLLM's ``(2, num_blocks, ...)``).
    """
    dtype = draw(st.sampled_from(_DTYPES))
    ndim = draw(st.integers(max(1, block_dim + 1), 4))
    shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    shape[block_dim] = num_blocks
    n = 1
    for d in shape:
        n *= d
    raw = _random_bytes(n * dtype.itemsize, draw(st.integers(0, 2**16)))
    t = raw.view(dtype).reshape(shape)
    if ndim >= 3 and block_dim < ndim - 1 and draw(st.booleans()):
        # block dim outermost in memory, moved to its place (strided, last dim contiguous)
        base = raw.view(dtype).reshape(
            [shape[block_dim], *shape[:block_dim], *shape[block_dim + 1 :]]
        )
        t = base.movedim(0, block_dim)
    if draw(st.integers(0, 5)) == 0 and dtype.is_floating_point and dtype.itemsize > 1:
        t = t.requires_grad_(True)  # a Parameter-like tensor
    return t


DEFECTS = [
    "none",
    "none",
    "none",
    "group_id",
    "block_dim",
    "payload",
    "tokens_per_block",
    "odd tensor",
    "num_blocks",
    "alias",
    "name",
    "no layers",
]


@st.composite
def layout_inputs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """Valid ``from_tensors`` arguments, or with one defect (or one oddity that is fine)."""
    defect = draw(st.sampled_from(DEFECTS))
    n_groups = draw(st.integers(1, 2))
    per_name_bd = draw(st.booleans())
    common_bd = draw(st.integers(0, 2))
    groups: dict[Any, Any] = {}
    bd_map: dict[str, int] = {}
    payload: dict[str, Any] = {}
    made: list[tuple[str, torch.Tensor]] = []
    for g in range(n_groups):
        nb = draw(st.integers(1, 5))
        layers: dict[str, torch.Tensor] = {}
        for i in range(draw(st.integers(1, 3))):
            name = f"L{g}.{i}"
            bd = draw(st.integers(0, 2)) if per_name_bd else common_bd
            t = draw(good_tensor(nb, bd))
            layers[name] = t
            made.append((name, t))
            if per_name_bd:
                neg = draw(st.booleans())  # negative: counted from the end
                bd_map[name] = bd - t.dim() if neg else bd
            page = t.numel() // nb * t.element_size()
            if draw(st.integers(0, 2)) == 0:
                payload[name] = draw(
                    st.sampled_from([1, page, max(1, page - 1), max(1, page // 2), min(3, page)])
                )
        groups[g] = layers
    block_dim: Any = bd_map if per_name_bd else common_bd
    tpb: Any = draw(st.one_of(st.integers(1, 2**20), st.just(2**70)))
    if draw(st.booleans()):
        tpb = {g: draw(st.integers(1, 64)) for g in groups}
    gids = list(groups)
    g0 = draw(st.sampled_from(gids))
    name0 = draw(st.sampled_from(sorted(groups[g0])))
    if defect == "group_id":
        bad_gid = draw(st.sampled_from([-1, 2**32, True, "0", None, 1.0, np.int64(0)]))
        groups = {**{g: v for g, v in groups.items() if g != g0}, bad_gid: groups[g0]}
    elif defect == "block_dim":
        bad = draw(st.sampled_from([5, -6, 2**70, True, None, 1.0, "0", np.int64(0), [0]]))
        block_dim = {**bd_map, name0: bad} if per_name_bd else bad
    elif defect == "payload":
        t = groups[g0][name0]
        page = t.numel() // max(1, t.shape[_bd(block_dim, name0, t)]) * t.element_size()
        bad = draw(st.sampled_from([0, -1, page + 1, 2**70, True, 1.5, None, np.int64(1), "1"]))
        payload = {**payload, name0: bad}
        if draw(st.integers(0, 3)) == 0:
            payload = {"nope": 1}
    elif defect == "tokens_per_block":
        bad = draw(st.sampled_from([0, -16, True, 16.0, None, "16", np.int64(16), [16]]))
        tpb = draw(st.sampled_from([bad, {g0: bad}, {**dict.fromkeys(groups, 16), 7: 16}, {}]))
    elif defect == "odd tensor":
        groups[g0] = {**groups[g0], name0: draw(odd_tensors())}
    elif defect == "num_blocks":  # layers of one group with another num_blocks (or 0)
        t = groups[g0][name0]
        d = _bd(block_dim, name0, t)
        shape = list(t.shape)
        shape[d] = draw(st.sampled_from([0, shape[d] + 1]))
        groups[g0] = {**groups[g0], f"{name0}.x": torch.zeros(shape, dtype=t.dtype)}
        if isinstance(block_dim, dict):
            block_dim = {**block_dim, f"{name0}.x": block_dim[name0]}
    elif defect == "alias":  # one tensor under another name, in this or another group
        other = draw(st.sampled_from(made))
        groups[g0] = {**groups[g0], f"{other[0]}.alias": other[1]}
        if isinstance(block_dim, dict):
            other_bd = block_dim[other[0]]
            block_dim = {**block_dim, f"{other[0]}.alias": draw(st.sampled_from([other_bd, 0]))}
    elif defect == "name":  # a name of another tensor (in another group)
        other = draw(st.sampled_from(made))
        groups[g0] = {**groups[g0], other[0]: draw(odd_tensors())}
    elif defect == "no layers":
        groups[g0] = {}
    return defect, {
        "groups": groups,
        "block_dim": block_dim,
        "payload_nbytes": payload or draw(st.sampled_from([None, {}])),
        "tokens_per_block": tpb,
    }


def _bd(block_dim: Any, name: str, t: torch.Tensor) -> int:
    d = block_dim.get(name, 0) if isinstance(block_dim, dict) else block_dim
    return int(d) % t.dim()


def _roundtrip(layout: kvtier.KVLayout, inp: dict[str, Any]) -> None:
    """Store block 0 of one group, load it into block 1: each layer's payload prefix of
    the page (row-major) is block 0's, the rest of block 1's page is untouched."""
    groups, bd, payload = inp["groups"], inp["block_dim"], inp["payload_nbytes"] or {}
    g = layout.group_ids[-1]
    if layout.group(g).num_blocks < 2:
        return
    config = kvtier.EngineConfig(layout.slot_nbytes(1), blocks_per_chunk=1)

    def page(t: torch.Tensor, name: str, b: int) -> bytes:
        x = t.detach().select(_bd(bd, name, t), b)
        dense = torch.empty(x.shape, dtype=x.dtype).copy_(x).reshape(-1)  # row-major
        return bytes(dense.view(torch.uint8).numpy().tobytes())

    src = {n: page(t, n, 0) for n, t in groups[g].items()}
    dst = {n: page(t, n, 1) for n, t in groups[g].items()}

    async def run() -> None:
        async with kvtier.TransferEngine(layout, config) as engine:
            k = kvtier.OffloadKey(b"layout", g)
            assert (await engine.store([kvtier.Chunk(k, [0])])).stored == (k,)
            res = await engine.load([kvtier.Chunk(k, [1])])
            assert res.loaded == (k,), res.failed

    asyncio.run(asyncio.wait_for(run(), CALL_TIMEOUT_S))
    event("from_tensors: round trip")
    for n, t in groups[g].items():
        p = payload.get(n, len(src[n]))
        want = src[n][:p] + dst[n][p:]
        assert page(t, n, 1) == want, f"layer {n}: block 1 is not block 0's payload + its own rest"


@_settings(300)
@given(layout_inputs())
def test_from_tensors_rejects_bad_tensors_with_layout_error(
    case: tuple[str, dict[str, Any]],
) -> None:
    defect, inp = case
    layout, exc = _attempt(lambda: kvtier.KVLayout.from_tensors(**inp))
    event(f"from_tensors, {defect}: {type(exc).__name__ if exc else 'ok'}")
    if exc is not None:
        assert defect != "none", f"valid layout rejected: {exc!r}"
        _assert_arg_error(exc, errors.LayoutError)
        return
    groups = inp["groups"]
    assert set(layout.group_ids) == set(groups)
    for gid, layers in groups.items():
        assert type(gid) is int
        assert layers, gid
        assert layout.group(gid).num_blocks == next(
            t.shape[_bd(inp["block_dim"], n, t)] for n, t in layers.items()
        )
        for t in layers.values():
            assert t.numel() > 0
    _roundtrip(layout, inp)


# --------------------------------------------------------------------- regressions
# Each is a minimal reproducer of an input the properties above leave out.

_T = torch.zeros(8, 64, dtype=torch.float16)


# Regression: Chunk's docstring: block_ids 'bools ... are rejected, never truncated'. That
# holds for a torch bool tensor too, though it passes operator.index (accepted,
# Chunk(key, torch.tensor([True, False])) would have block_ids (1, 0), and Chunk(key,
# [torch.tensor(True)]) (1,): a boolean mask passed as a block table would silently store/load
# blocks 1 and 0)
@pytest.mark.parametrize(
    "block_ids",
    [torch.tensor([True, False]), [torch.tensor(True)]],
    ids=["bool-tensor", "list-of-bool-0d-tensor"],
)
def test_chunk_rejects_bool_tensor_block_ids(block_ids: Any) -> None:
    with pytest.raises(errors.BlockIdError):
        kvtier.Chunk(_K, block_ids)


# Regression: Chunk's docstring: block_ids are the blocks of sub-blocks offset.. 'in order' and
# BlockIdError when 'block_ids is not a sequence of ints'. A set is refused, not reordered by
# hash order (Chunk(key, {5, 1, 3}).block_ids == (1, 3, 5) would take sub-block 0 from block 1
# and bring the KV cache back permuted)
@pytest.mark.parametrize("make", [set, frozenset], ids=["set", "frozenset"])
def test_chunk_rejects_unordered_block_ids(make: Callable[[list[int]], Any]) -> None:
    with pytest.raises(errors.BlockIdError):
        kvtier.Chunk(_K, make([5, 1, 3]))


# Regression: from_tensors documents LayoutError for 'empty groups, a non-tensor'; a group whose
# value is None or an int raises it, not a bare TypeError ('NoneType' object is not iterable)
# from the payload/block_dim name check, before the per-group check
@pytest.mark.parametrize("value", [None, 5], ids=["None", "int"])
def test_from_tensors_non_mapping_group_is_a_layout_error(value: Any) -> None:
    with pytest.raises(errors.LayoutError):
        kvtier.KVLayout.from_tensors({0: value})


# Regression: from_tensors: payload_nbytes is '{layer_name: bytes}' (block_dim takes 'one int
# for all layers'); payload_nbytes=64 or 'a' raises LayoutError, not a bare TypeError ('int'
# object is not iterable) or ValueError (dict update sequence), neither a KVTierError; and
# payload_nbytes=0 does not mean 'no payload' (as dict(payload_nbytes or {}) would make it)
@pytest.mark.parametrize("payload", [64, "a", [64]], ids=["int", "str", "list"])
def test_from_tensors_payload_nbytes_not_a_mapping_is_a_layout_error(payload: Any) -> None:
    with pytest.raises(errors.LayoutError):
        kvtier.KVLayout.from_tensors({0: {"a": _T}}, payload_nbytes=payload)


# Regression: from_tensors documents LayoutError for 'a meta or sparse tensor', and raises it
# for every non-strided layout, not only COO (tensor.is_sparse): a sparse CSR/CSC/BSR tensor
# must not raise a bare RuntimeError ('Sparse CSR tensors do not have strides'), nor a nested
# tensor a bare RuntimeError (strided) or NotImplementedError (jagged); _check_names_are_unique
# skips layout != torch.strided as 'reported with its layer', which must then happen
@pytest.mark.filterwarnings("ignore::UserWarning")  # "sparse CSR is in beta", "nested: prototype"
@pytest.mark.parametrize("kind", ["csr", "csc", "bsr", "nested", "jagged"])
def test_from_tensors_non_strided_tensor_is_a_layout_error(kind: str) -> None:
    dense = torch.zeros(8, 64)
    t = {
        "csr": lambda: dense.to_sparse_csr(),
        "csc": lambda: dense.to_sparse_csc(),
        "bsr": lambda: dense.to_sparse_bsr((2, 2)),
        "nested": lambda: torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(2, 3)]),
        "jagged": lambda: torch.nested.nested_tensor(
            [torch.zeros(2, 3), torch.zeros(4, 3)], layout=torch.jagged
        ),
    }[kind]()
    with pytest.raises(errors.LayoutError):
        kvtier.KVLayout.from_tensors({0: {"a": t}})


# Regression: from_tensors reports unknown names of mixed types (payload_nbytes={'x': 3, 1: 2},
# block_dim={'x': 0, 1: 0}, tokens_per_block={0: 16, 'x': 16, 1: 3}) with LayoutError, not a
# bare TypeError from sorted(...) ("'<' not supported between instances of 'str' and 'int'")
@pytest.mark.parametrize("arg", ["payload_nbytes", "block_dim", "tokens_per_block"])
def test_from_tensors_unknown_names_of_mixed_types(arg: str) -> None:
    bad: dict[Any, Any] = {"x": 3, 1: 2} if arg != "tokens_per_block" else {0: 16, "x": 16, 1: 3}
    with pytest.raises(errors.LayoutError):
        kvtier.KVLayout.from_tensors({0: {"a": _T}}, **{arg: bad})


# Regression: from_tensors takes {layer_name: tensor} (layer_name: str); a bytes (or any
# hashable) name gets a LayoutError at registration or a typed error from start() with an NVMe
# tier, not a bare TypeError ('Object of type bytes is not JSON serializable') from the format
# digest
async def test_non_str_layer_name_is_rejected_with_a_typed_error(tmp_path: pathlib.Path) -> None:
    try:
        layout = kvtier.KVLayout.from_tensors({0: {b"a": _T}})
    except errors.LayoutError:
        return
    nv = kvtier.NVMeConfig(root=str(tmp_path), capacity_bytes=1 << 24, grow_ahead=False)
    engine = kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, nvme=nv))
    try:
        with pytest.raises(kvtier.KVTierError):
            await engine.start()
    finally:
        await engine.aclose()


# Regression: NVMeConfig(row_io_wrapper=5) gets a ConfigError (its docstring: 'Raises
# ConfigError: a value is out of range'), from the config or from start(), not a bare TypeError
# ('int' object is not callable) from inside the tier (nor, for a wrapper returning None, a bare
# AssertionError); BackgroundEngine.start() the same
async def test_row_io_wrapper_not_callable_is_a_config_error(tmp_path: pathlib.Path) -> None:
    try:
        nv = kvtier.NVMeConfig(root=str(tmp_path), capacity_bytes=1 << 24, row_io_wrapper=5)  # type: ignore[arg-type]
    except errors.ConfigError:
        return
    engine = kvtier.TransferEngine(_LAYOUT_GPU.layout, engine_config(_LAYOUT_GPU, 2, nv))
    try:
        with pytest.raises(errors.ConfigError):
            await engine.start()
    finally:
        await engine.aclose()


# Regression: EngineConfig checks pin_memory and write_through like every other field:
# EngineConfig(write_through='no') and (pin_memory='no') are refused, not taken to mean True (as
# NVMeConfig rejects grow_ahead='yes' with ConfigError, which test_bad_input checks); for
# store(durable='no') see test_store_durable_must_be_a_bool
@pytest.mark.parametrize("name", ["write_through", "pin_memory"])
def test_engine_config_bool_flags_must_be_bools(name: str) -> None:
    with pytest.raises(errors.ConfigError):
        kvtier.EngineConfig(1 << 20, **{name: "no"})


# Regression: start() documents 'ConfigError: the NVMe root is unusable' (a file, below a file,
# read-only: ConfigError); a root with a component longer than NAME_MAX (255) raises it too,
# not a bare OSError ENAMETOOLONG from root.exists() in io/_files.py prepare_directory
async def test_nvme_root_name_too_long_is_a_config_error(tmp_path: pathlib.Path) -> None:
    nv = kvtier.NVMeConfig(root=str(tmp_path / ("z" * 300)), capacity_bytes=1 << 24)
    engine = kvtier.TransferEngine(_LAYOUT_GPU.layout, engine_config(_LAYOUT_GPU, 2, nv))
    try:
        with pytest.raises(errors.ConfigError):
            await engine.start()
    finally:
        await engine.aclose()


class KeySub(kvtier.OffloadKey):
    pass


# Regression: an instance of an OffloadKey subclass naming a stored key is the same key, though
# a dataclass __eq__ would require the exact class while __hash__ only covers (block_hash,
# group_id). lookup must not say MISS for a key on CPU and NVMe, nor store store it again (a
# second slot and NVMe row for one (hash, group); after a restart the later row replaces the
# first): the README says 'storing a present key is skipped'
async def test_offload_key_subclass_names_the_same_key(tmp_path: pathlib.Path) -> None:
    gpu = Gpu(16)
    cfg = engine_config(gpu, 4, nvme_config(tmp_path, grow_ahead=False))
    k = kvtier.OffloadKey(b"k" * 16, 0)
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        await engine.store([kvtier.Chunk(k, [0, 1, 2, 3])])
        sub = KeySub(b"k" * 16, 0)
        assert engine.lookup([sub]) == [kvtier.Residency.CPU]
        res = await engine.store([kvtier.Chunk(sub, [4, 5, 6, 7])])
        assert res.skipped == (sub,)


async def test_store_durable_must_be_a_bool() -> None:
    """``store(durable="no")`` is refused, not taken as durable=True."""
    gpu = Gpu(16)
    async with kvtier.TransferEngine(gpu.layout, engine_config(gpu, 4)) as engine:
        k = kvtier.OffloadKey(b"d" * 16, 0)
        with pytest.raises(errors.InvalidArgumentError):
            await engine.store([kvtier.Chunk(k, [0, 1])], durable="no")  # type: ignore[arg-type]
        assert engine.lookup([k]) == [kvtier.Residency.MISS]
