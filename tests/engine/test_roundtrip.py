"""Bitwise round trips GPU blocks -> CPU slots -> GPU blocks on the CPU path.

Every test runs twice: with the NumPy copy path that CPU-only hosts use, and
with the torch copy path that CUDA hosts use (the same calls on CPU tensors;
selected by disabling the host views, ``kvtier._engine.host_pieces``).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import kvtier
from tests.engine.helpers import fill_random, key, same


@pytest.fixture(autouse=True, params=["numpy", "torch"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":
        monkeypatch.setattr("kvtier._engine.host_pieces", lambda *a, **k: None)
    return str(request.param)


async def _roundtrip(
    layout: kvtier.KVLayout,
    tensors: list[torch.Tensor],
    chunks: list[kvtier.Chunk],
    bpc: int,
    reload: list[kvtier.Chunk] | None = None,
) -> None:
    before = [t.clone() for t in tensors]
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(64 << 20, bpc)) as engine:
        res = await engine.store(chunks)
        assert len(res.stored) == len(chunks)
        for t in tensors:
            t.view(torch.uint8).fill_(0xAB) if t.dtype != torch.uint8 else t.fill_(0xAB)
        scribbled = [t.clone() for t in tensors]
        out = await engine.load(reload or chunks)
        assert not out.failed
    return before, scribbled


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Compare bytes, never values: random bytes make NaNs, and NaN != NaN.
    return t.contiguous().view(torch.uint8)


def _blocks_equal(a: torch.Tensor, b: torch.Tensor, block_dim: int, ids: list[int]) -> bool:
    idx = torch.tensor(ids)
    return torch.equal(
        _bytes(a.index_select(block_dim, idx)), _bytes(b.index_select(block_dim, idx))
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
async def test_block_dim0(dtype: torch.dtype) -> None:
    t = torch.empty((12, 2, 16, 2, 32), dtype=dtype)
    fill_random(t, 1)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    chunks = [kvtier.Chunk(key("c0", 0), [3, 7, 1, 0]), kvtier.Chunk(key("c1", 0), [4, 5, 6])]
    before, scribbled = await _roundtrip(layout, [t], chunks, 4)
    ids = [3, 7, 1, 0, 4, 5, 6]
    assert _blocks_equal(t, before[0], 0, ids)
    untouched = [2, 8, 9, 10, 11]
    assert _blocks_equal(t, scribbled[0], 0, untouched)


async def test_kv_first_block_dim1_two_segments() -> None:
    t = torch.empty((2, 10, 16, 4, 8), dtype=torch.bfloat16)  # (K/V, num_blocks, ...)
    fill_random(t, 2)
    layout = kvtier.KVLayout.from_tensors({0: {"kv": t}}, block_dim=1)
    assert len(layout.group(0).layers[0].pieces) == 1  # (num_blocks, 2, seg) strided piece
    chunks = [kvtier.Chunk(key("x", 0), [9, 2, 5])]
    before, scribbled = await _roundtrip(layout, [t], chunks, 3)
    assert _blocks_equal(t, before[0], 1, [9, 2, 5])
    assert _blocks_equal(t, scribbled[0], 1, [0, 1, 3, 4, 6, 7, 8])


async def test_packed_layout_copies_only_group_regions() -> None:
    # One allocation, block = [layer A of group 0 | layer B of group 1 | layer C of group 0]
    nb, page = 8, 256
    base = torch.empty((nb, 3, page), dtype=torch.uint8)
    fill_random(base, 3)
    a, b, c = base[:, 0], base[:, 1], base[:, 2]
    layout = kvtier.KVLayout.from_tensors({0: {"a": a, "c": c}, 1: {"b": b}})
    assert layout.group_nbytes(0, 2) == 2 * 2 * page
    assert layout.group_nbytes(1, 2) == 2 * page
    before = base.clone()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2)) as engine:
        await engine.store([kvtier.Chunk(key("g0", 0), [1, 6])])
        base.fill_(0)
        await engine.load([kvtier.Chunk(key("g0", 0), [1, 6])])
    assert same(base[[1, 6]][:, [0, 2]], before[[1, 6]][:, [0, 2]])
    assert int(base[:, 1].count_nonzero()) == 0  # group 1's region never written
    assert int(base[[0, 2, 3, 4, 5, 7]].count_nonzero()) == 0


async def test_tensor_shared_by_two_groups() -> None:
    t = torch.empty((16, 4, 64), dtype=torch.float16)
    fill_random(t, 4)
    layout = kvtier.KVLayout.from_tensors({0: {"shared": t}, 1: {"shared": t}})
    before = t.clone()
    chunks = [kvtier.Chunk(key("a", 0), [0, 1]), kvtier.Chunk(key("a", 1), [8, 9])]
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2)) as engine:
        assert (await engine.store(chunks)).stored
        t.zero_()
        assert not (await engine.load(chunks)).failed
        with pytest.raises(kvtier.errors.BlockIdError):
            await engine.load(
                [kvtier.Chunk(key("a", 0), [0, 1]), kvtier.Chunk(key("a", 1), [1, 9])]
            )
    assert same(t[[0, 1, 8, 9]], before[[0, 1, 8, 9]])


async def test_duplicate_view_in_one_group_copied_once() -> None:
    t = torch.empty((8, 128), dtype=torch.float32)
    fill_random(t, 5)
    other = torch.empty((8, 128), dtype=torch.float32)
    fill_random(other, 6)
    layout = kvtier.KVLayout.from_tensors({0: {"x": t, "x_alias": t[:], "y": other}})
    assert len(layout.group(0).layers) == 2
    assert layout.group(0).layers[0].names == ("x", "x_alias")
    assert layout.group_nbytes(0, 1) == 2 * 512


async def test_unpadded_payload_leaves_padding_and_neighbours() -> None:
    nb, page = 10, 1024
    t = torch.empty((nb, page), dtype=torch.uint8)
    fill_random(t, 7)
    layout = kvtier.KVLayout.from_tensors({0: {"p": t}}, payload_nbytes={"p": 700})
    assert layout.group_nbytes(0, 2) == 1400
    before = t.clone()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2)) as engine:
        await engine.store([kvtier.Chunk(key("u", 0), [2, 3])])
        t.fill_(0x5A)
        await engine.load([kvtier.Chunk(key("u", 0), [4, 5])])
    assert same(t[[4, 5], :700], before[[2, 3], :700])
    assert bool((t[[4, 5], 700:] == 0x5A).all())  # padding never copied
    assert bool((t[[0, 1, 2, 3, 6, 7, 8, 9]] == 0x5A).all())


async def test_multi_piece_payload_prefix() -> None:
    t = torch.empty((2, 6, 3, 40), dtype=torch.uint8)  # K/V-first, page = 2 segments of 120 B
    fill_random(t, 8)
    layout = kvtier.KVLayout.from_tensors({0: {"kv": t}}, block_dim=1, payload_nbytes={"kv": 170})
    assert len(layout.group(0).layers[0].pieces) == 2  # K segment (120 B) + 50 B of V
    before = t.clone()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2)) as engine:
        await engine.store([kvtier.Chunk(key("m", 0), [1, 4])])
        t.zero_()
        await engine.load([kvtier.Chunk(key("m", 0), [1, 4])])
    flat_before = before.movedim(1, 0).reshape(6, -1)
    flat = t.movedim(1, 0).reshape(6, -1)
    assert same(flat[[1, 4], :170], flat_before[[1, 4], :170])
    assert int(flat[:, 170:].count_nonzero()) == 0


async def test_multi_piece_pages_with_scattered_ids_and_partial_chunks() -> None:
    # Pages of two pieces (K, then a prefix of V) make each piece's slot view
    # strided; the torch path (CUDA) copies such a layer through one device
    # buffer laid out like the slot bytes, the NumPy path piece by piece.
    t = torch.empty((2, 16, 3, 40), dtype=torch.uint8)
    u = torch.empty((2, 16, 4, 16), dtype=torch.float16)
    fill_random(t, 18)
    fill_random(u, 19)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"kv": t, "kv2": u}}, block_dim=1, payload_nbytes={"kv": 170, "kv2": 200}
    )
    assert all(len(layer.pieces) == 2 for layer in layout.group(0).layers)
    before = (t.clone(), u.clone())
    chunks = [
        kvtier.Chunk(key("s0", 0), [9, 2, 14, 5]),
        kvtier.Chunk(key("s1", 0), [7, 0], offset=1),  # sub-blocks 1..2
        kvtier.Chunk(key("s2", 0), [11, 12, 13]),  # consecutive ids
    ]
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4)) as engine:
        assert len((await engine.store(chunks)).stored) == 3
        t.zero_()
        u.zero_()
        assert not (await engine.load(chunks)).failed
    ids = [b for c in chunks for b in c.block_ids]
    rest = sorted(set(range(16)) - set(ids))
    for now, then, keep in ((t, before[0], 170), (u, before[1], 200)):
        flat, flat_before = (x.movedim(1, 0).reshape(16, -1).view(torch.uint8) for x in (now, then))
        assert same(flat[ids, :keep], flat_before[ids, :keep])
        assert int(flat[:, keep:].count_nonzero()) == 0  # past the payload: never written
        assert int(flat[rest].count_nonzero()) == 0  # blocks of no chunk: untouched


async def test_torch_and_numpy_paths_lay_out_slots_alike(
    copy_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The slot bytes are the NVMe row format: whichever path copied them (the
    # torch one runs on CUDA hosts), a slot must hold the same bytes.
    if copy_path == "torch":
        pytest.skip("runs both paths itself")
    t = torch.empty((2, 16, 3, 40), dtype=torch.uint8)
    a = torch.empty((16, 2, 8, 16), dtype=torch.bfloat16)
    fill_random(t, 28)
    fill_random(a, 29)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"kv": t, "a": a}}, block_dim={"kv": 1, "a": 0}, payload_nbytes={"kv": 170}
    )
    chunks = [
        kvtier.Chunk(key("l0", 0), [9, 2, 14, 5]),
        kvtier.Chunk(key("l1", 0), [7, 0], offset=1),
        kvtier.Chunk(key("l2", 0), [11, 12, 13]),
    ]
    images = []
    for host_pieces in (None, lambda *a, **k: None):  # NumPy path, then torch path
        if host_pieces is not None:
            monkeypatch.setattr("kvtier._engine.host_pieces", host_pieces)
        async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4)) as engine:
            assert len((await engine.store(chunks)).stored) == 3
            region = engine._region
            assert region is not None
            images.append(
                [
                    region.slot(engine._pool.get(c.key).slot, engine.slot_nbytes).clone()
                    for c in chunks
                ]
            )
    for numpy_slot, torch_slot in zip(*images, strict=True):
        assert same(numpy_slot, torch_slot)


async def test_partial_first_and_short_last_chunk() -> None:
    t = torch.empty((16, 256), dtype=torch.float16)
    fill_random(t, 9)
    before = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    first = kvtier.Chunk(key("p0", 0), [5, 6, 7], offset=1)  # sub-blocks 1..4
    last = kvtier.Chunk(key("p1", 0), [8])  # sub-block 0 only
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4)) as engine:
        await engine.store([first, last])
        t.zero_()
        # load a sub-range of the stored range into other blocks
        out = await engine.load([kvtier.Chunk(key("p0", 0), [10, 11], offset=2), last])
        assert not out.failed
        assert engine.stored_range(key("p0", 0)) == (1, 4)
        assert engine.stored_range(key("p1", 0)) == (0, 1)
        assert engine.stored_range(key("never", 0)) is None
        # Sub-blocks never stored fail that key alone; the other key loads.
        misses = engine.stats().misses
        out = await engine.load(
            [kvtier.Chunk(key("p0", 0), [1, 2, 3, 4], offset=0), kvtier.Chunk(key("p1", 0), [12])]
        )
        assert out.loaded == (key("p1", 0),)
        assert isinstance(out.failed[key("p0", 0)], kvtier.errors.NotStoredError)
        out = await engine.load([kvtier.Chunk(key("p1", 0), [1, 2])])
        assert isinstance(out.failed[key("p1", 0)], kvtier.errors.NotStoredError)
        out = await engine.load([kvtier.Chunk(key("p0", 0), [1], offset=0)])  # below the range
        assert isinstance(out.failed[key("p0", 0)], kvtier.errors.NotStoredError)
        assert engine.stats().misses == misses + 3
        with pytest.raises(kvtier.errors.InvalidArgumentError):
            engine.stored_range("p0")  # type: ignore[arg-type]
    assert same(t[[10, 11]], before[[6, 7]])
    assert same(t[8], before[8])
    assert same(t[12], before[8])
    assert int(t[[1, 2, 3, 4]].count_nonzero()) == 0  # nothing copied for the failed key


async def test_empty_group_in_batch_and_slot_reuse_across_groups() -> None:
    a = torch.empty((8, 512), dtype=torch.uint8)
    b = torch.empty((8, 2048), dtype=torch.uint8)
    fill_random(a, 10)
    fill_random(b, 11)
    layout = kvtier.KVLayout.from_tensors({0: {"a": a}, 1: {"b": b}, 2: {"c": torch.zeros(8, 64)}})
    bpc = 2
    slot = layout.slot_nbytes(bpc)
    before_a, before_b = a.clone(), b.clone()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(2 * slot, bpc)) as engine:
        # batch with only groups 0 and 1 (group 2 empty)
        await engine.store([kvtier.Chunk(key(0, 0), [0, 1]), kvtier.Chunk(key(1, 0), [2, 3])])
        assert engine.stats().keys_per_group == {0: 2}
        # group 1 keys reuse the evicted group-0 slots
        res = await engine.store([kvtier.Chunk(key(2, 1), [4, 5]), kvtier.Chunk(key(3, 1), [6, 7])])
        assert len(res.stored) == 2
        assert engine.stats().evictions == 2
        assert engine.lookup([key(0, 0), key(1, 0)]) == [kvtier.Residency.MISS] * 2
        b.zero_()
        out = await engine.load([kvtier.Chunk(key(2, 1), [4, 5]), kvtier.Chunk(key(3, 1), [6, 7])])
        assert not out.failed
        missing = await engine.load([kvtier.Chunk(key(0, 0), [0, 1])])
        assert key(0, 0) in missing.failed
    assert same(b[4:8], before_b[4:8])
    assert same(a, before_a)


async def test_store_racing_load_of_same_key() -> None:
    t = torch.empty((8, 4096), dtype=torch.uint8)
    fill_random(t, 12)
    before = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2)) as engine:
        k = key("race", 0)
        store = asyncio.ensure_future(engine.store([kvtier.Chunk(k, [0, 1])]))
        await asyncio.sleep(0)
        assert engine.lookup([k]) == [kvtier.Residency.PENDING]
        load = asyncio.ensure_future(engine.load([kvtier.Chunk(k, [4, 5])]))
        res, out = await asyncio.gather(store, load)
        assert res.stored == (k,)
        assert out.loaded == (k,)
    assert same(t[4:6], before[0:2])


async def test_same_iteration_calls_coalesce_into_one_job() -> None:
    t = torch.empty((64, 256), dtype=torch.uint8)
    fill_random(t, 13)
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1)) as engine:
        calls = [engine.store([kvtier.Chunk(key(i, 0), [i])]) for i in range(10)]
        results = await asyncio.gather(*calls)
        assert all(len(r.stored) == 1 for r in results)
        assert engine.stats().store_jobs == 1
        loads = [engine.load([kvtier.Chunk(key(i, 0), [i + 20])]) for i in range(10)]
        await asyncio.gather(*loads)
        assert engine.stats().load_jobs == 1
    assert same(t[20:30], t[0:10])


async def test_odd_payload_layer_before_a_wide_layer() -> None:
    # Layer "odd" (1001 B payload) shifts the wide (int64) layer "wide" to an odd
    # slot offset: the copy must fall back to bytes, not misalign.
    odd = torch.empty((6, 1001), dtype=torch.uint8)
    wide = torch.empty((6, 128), dtype=torch.float64)
    fill_random(odd, 20)
    fill_random(wide, 21)
    layout = kvtier.KVLayout.from_tensors({0: {"odd": odd, "wide": wide}})
    assert layout.layer_offsets(0, 3)[1] % 8
    before = (odd.clone(), wide.clone())
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 3)) as engine:
        await engine.store([kvtier.Chunk(key("o", 0), [4, 0, 2])])
        odd.zero_()
        wide.zero_()
        await engine.load([kvtier.Chunk(key("o", 0), [1, 3, 5])])
    assert same(odd[[1, 3, 5]], before[0][[4, 0, 2]])
    assert same(wide[[1, 3, 5]], before[1][[4, 0, 2]])


async def test_groups_aliasing_one_tensor_with_different_block_dims() -> None:
    # Group 0 pages are rows t[b], group 1 pages are columns t[:, b]: they cross.
    t = torch.empty((8, 8, 64), dtype=torch.uint8)
    fill_random(t, 30)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"rows": t}, 1: {"cols": t}}, block_dim={"rows": 0, "cols": 1}
    )
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1)) as engine:
        await engine.store([kvtier.Chunk(key("r", 0), [5]), kvtier.Chunk(key("c", 1), [6])])
        with pytest.raises(kvtier.errors.BlockIdError):
            await engine.load([kvtier.Chunk(key("r", 0), [2]), kvtier.Chunk(key("c", 1), [3])])
        assert engine.stats().load_jobs == 0


async def test_packed_groups_may_load_the_same_block_id_in_one_call() -> None:
    base = torch.empty((6, 2, 512), dtype=torch.uint8)  # block = [group 0 | group 1]
    fill_random(base, 31)
    before = base.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": base[:, 0]}, 1: {"b": base[:, 1]}})
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 1)) as engine:
        await engine.store([kvtier.Chunk(key("a", 0), [1]), kvtier.Chunk(key("b", 1), [2])])
        base.zero_()
        out = await engine.load([kvtier.Chunk(key("a", 0), [4]), kvtier.Chunk(key("b", 1), [4])])
        assert not out.failed
    assert same(base[4, 0], before[1, 0])
    assert same(base[4, 1], before[2, 1])


async def test_loads_of_consecutive_slots_mixed_with_partial_chunks_and_groups(
    copy_path: str,
) -> None:
    # Full chunks stored together get consecutive slots and load with one call
    # per layer; partial chunks, another group and a gap in the slots split the runs.
    a = torch.empty((64, 2, 8, 16), dtype=torch.bfloat16)
    b = torch.empty((64, 3, 40), dtype=torch.float32)
    c = torch.empty((2, 64, 8, 8), dtype=torch.float16)  # K/V first: strided blocks
    for i, t in enumerate((a, b, c)):
        fill_random(t, 40 + i)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"a": a, "c": c}, 1: {"b": b}}, block_dim={"a": 0, "b": 0, "c": 1}
    )
    before = [t.clone() for t in (a, b, c)]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(5)).tolist()
    full0 = [kvtier.Chunk(key(f"f{i}", 0), perm[4 * i : 4 * i + 4]) for i in range(6)]
    full1 = [kvtier.Chunk(key(f"g{i}", 1), perm[4 * i : 4 * i + 4]) for i in range(3)]
    part = kvtier.Chunk(key("part", 0), perm[40:42], offset=1)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(8 << 20, 4)) as engine:
        res = await engine.store([*full0[:3], *full1, part, *full0[3:]])
        assert len(res.stored) == 10
        slots = [engine._pool.get(ch.key).slot for ch in full0]
        assert slots[:3] == sorted(slots[:3])  # one call: ascending slots
        for t in (a, b, c):
            t.zero_()
        # Same order as stored (runs), then a shuffled subset (runs of one).
        out = await engine.load([*full0[:3], part, *full0[3:], *full1])
        assert not out.failed
        ids0 = [i for ch in full0 for i in ch.block_ids] + list(part.block_ids)
        ids1 = [i for ch in full1 for i in ch.block_ids]
        assert same(a[ids0], before[0][ids0])
        assert same(c[:, ids0], before[2][:, ids0])
        assert same(b[ids1], before[1][ids1])
        rest = sorted(set(range(64)) - set(ids0))
        assert int(a[rest].count_nonzero()) == 0
        assert int(c[:, rest].count_nonzero()) == 0
        for t in (a, b, c):
            t.zero_()
        out = await engine.load([full0[4], full0[1], full0[5], full0[0]])
        assert not out.failed
        ids = [i for j in (4, 1, 5, 0) for i in full0[j].block_ids]
        assert same(a[ids], before[0][ids])
        assert same(c[:, ids], before[2][:, ids])


async def test_cpu_path_copies_without_torch_indexing(
    copy_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On CPU-only hosts both directions run on the NumPy views; the torch
    # indexing calls (the CUDA path) must not be reached.
    if copy_path == "torch":
        pytest.skip("checks the NumPy path")

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a torch indexing call on the CPU path")

    t = torch.empty((32, 2, 16, 64), dtype=torch.bfloat16)
    fill_random(t, 77)
    before = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"a": t}})
    chunks = [kvtier.Chunk(key(f"np{i}", 0), [31 - 4 * i, 5 + i, 17 - i, 20 + i]) for i in range(3)]
    monkeypatch.setattr(torch, "index_select", boom)
    monkeypatch.setattr(torch.Tensor, "index_select", boom)
    monkeypatch.setattr(torch.Tensor, "index_copy_", boom)
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4)) as engine:
        assert len((await engine.store(chunks)).stored) == 3
        t.zero_()
        assert not (await engine.load(chunks)).failed
    ids = [b for c in chunks for b in c.block_ids]
    assert same(t[ids], before[ids])
