"""``EngineConfig.copy_backend``: the Triton kernel, NumPy and torch executors of one plan.

The Triton kernel runs here on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``): the same kernel, the same descriptor table as on a
CUDA host. Each backend must leave the same bytes as the NumPy executor.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random

import pytest
import torch

import kvtier
from kvtier import _copytable, _transfer, errors
from kvtier._copykernel import execute_kernel
from tests.engine.copy_layouts import CASES, NB, CopyRig, layout_case
from tests.engine.helpers import fill_random, key, same

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _plan(rig: CopyRig, rng: random.Random, bpc: int) -> list[_transfer.ChunkCopy]:
    plan, slot = [], 0
    for g in rig.layout.group_ids:
        ids = rng.sample(range(NB), bpc)
        plan.append(rig.copy(g, slot, ids))
        start = rng.randrange(bpc)
        plan.append(rig.copy(g, slot + 1, rng.sample(range(NB), bpc - start), start))
        slot += 2
    return plan


@needs_triton
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("case", CASES)
def test_kernel_copies_the_bytes_numpy_copies(case: str) -> None:
    """Store with the kernel, then load with NumPy (and the reverse): both round trip."""
    c = layout_case(case)
    rig = CopyRig(c.layout(), c.bpc)
    plan = _plan(rig, random.Random(case), c.bpc)
    for store_with, load_with in (
        (execute_kernel, _copytable.execute),
        (_copytable.execute, execute_kernel),
    ):
        c.restore()
        rig.region.host_views[1][:] = 0
        store_with(_transfer.plan_table(plan, store=True))
        slots = rig.region.host_views[1].copy()
        rig.region.host_views[1][:] = 0
        _copytable.execute(_transfer.plan_table(plan, store=True))
        assert (rig.region.host_views[1] == slots).all()  # the kernel wrote what NumPy writes
        c.scribble()
        load_with(_transfer.plan_table(plan, store=False))
        for name, t in c.flat():
            pristine = c.pristine[name]
            bdim = c.block_dim[name]
            for copy in plan:
                if name not in c.groups[_group_of(rig, copy)]:
                    continue
                for b in copy.block_ids:
                    got = t.select(bdim, b).contiguous().view(torch.uint8).flatten()
                    want = pristine.select(bdim, b).contiguous().view(torch.uint8).flatten()
                    payload = c.payload.get(name, len(want))
                    assert torch.equal(got[:payload], want[:payload]), (name, b)


def _group_of(rig: CopyRig, copy: _transfer.ChunkCopy) -> int:
    return next(g for g in rig.layout.group_ids if rig.host[g] is copy.host)


def _layout(n: int = 32) -> tuple[kvtier.KVLayout, list[torch.Tensor]]:
    kv = torch.empty(2, n, 4, 8, dtype=torch.bfloat16)  # K/V-first
    full = torch.empty(n, 40, dtype=torch.uint8)
    fill_random(kv, 1)
    fill_random(full, 2)
    layout = kvtier.KVLayout.from_tensors(
        {0: {"kv": kv}, 1: {"full": full}}, block_dim={"kv": 1, "full": 0}
    )
    return layout, [kv, full]


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("kernel", marks=needs_triton),
        "dma",
        "torch",
        "auto",
    ],
)
async def test_engine_round_trips_bitwise_with_each_backend(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full and partial chunks of a K/V-first and a flat group; a load that writes a page twice."""
    if backend == "kernel":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    layout, tensors = _layout()
    pristine = [t.clone() for t in tensors]
    cfg = kvtier.EngineConfig(1 << 20, 4, copy_backend=backend, copy_threads=2)
    chunks = [
        kvtier.Chunk(key("a", 0), (3, 9, 1, 30)),
        kvtier.Chunk(key("b", 1), (5, 6, 7, 8)),
        kvtier.Chunk(key("c", 1), (12, 2), offset=2),
    ]
    async with kvtier.TransferEngine(layout, cfg) as engine:
        assert len((await engine.store(chunks)).stored) == 3
        for t in tensors:
            t.view(torch.uint8).fill_(0xEE)
        res = await engine.load(chunks)
        assert not res.failed
        kv, full = tensors
        for b in (3, 9, 1, 30):
            assert same(kv[:, b], pristine[0][:, b])
        for b in (5, 6, 7, 8, 12, 2):
            assert torch.equal(full[b], pristine[1][b])
        # two calls of one iteration write block 20: the later call wins
        one = kvtier.Chunk(key("b", 1), (20, 21, 22, 23))
        two = kvtier.Chunk(key("c", 1), (20, 24), offset=2)
        out = await asyncio.gather(engine.load([one]), engine.load([two]))
        assert not any(r.failed for r in out)
        assert torch.equal(full[20], pristine[1][12])
        assert torch.equal(full[21], pristine[1][6])


def test_an_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(errors.ConfigError, match="copy_backend"):
        kvtier.EngineConfig(1 << 20, 4, copy_backend="cuda")


def test_the_kernel_backend_without_the_interpreter_is_refused_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layout, _ = _layout()
    with pytest.raises(errors.ConfigError, match="kernel"):
        kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 4, copy_backend="kernel"))


@needs_triton
@pytest.mark.usefixtures("interpreter")
async def test_kernel_store_and_load_in_flight_together_both_land() -> None:
    """A store and a load of one iteration run on two copy threads: both launch the kernel."""
    t = torch.empty(512, 8, 32, dtype=torch.uint8)  # 4 runs of 64 bytes per block
    fill_random(t, 3)
    pristine = t.clone()
    layout = kvtier.KVLayout.from_tensors({0: {"x": t}}, block_dim=0)
    cfg = kvtier.EngineConfig(layout.slot_nbytes(16) * 128, 16, copy_backend="kernel")
    async with kvtier.TransferEngine(layout, cfg) as engine:
        for i in range(12):
            first = [
                kvtier.Chunk(key(f"a{i}.{j}", 0), range(16 * j, 16 * j + 16)) for j in range(4)
            ]
            assert len((await engine.store(first)).stored) == 4
            more = [
                kvtier.Chunk(key(f"b{i}.{j}", 0), range(16 * j, 16 * j + 16)) for j in range(4, 8)
            ]
            back = [
                kvtier.Chunk(c.key, range(16 * (j + 20), 16 * (j + 21)))
                for j, c in enumerate(first)
            ]
            stored, loaded = await asyncio.gather(engine.store(more), engine.load(back))
            assert len(stored.stored) == 4
            assert not loaded.failed
            assert same(t[320:384], pristine[0:64])
            t[320:384] = 0
