"""Bad input: every case raises a typed error and changes no state.

Extends tests/engine/test_api.py (which covers the basic store/load/construction
cases) with calls on an engine that has an NVMe tier, NVMe-only keys, lookups,
configuration values and unusable NVMe roots. For every call on an open engine:
the error is a :class:`kvtier.KVTierError` AND a :class:`ValueError`,
``engine.stats()`` is equal before and after, and every stored key (CPU and
NVMe-only) still loads bitwise.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

import kvtier
from kvtier import errors

from ._model import BPC, Gpu, chunks, engine_config, key, load_check, nvme_config, store_ok, tree

REPO = pathlib.Path(__file__).resolve().parents[2]
SLOTS = 4


@dataclass
class Witness:
    """An engine with keys on CPU (and NVMe), NVMe only, and a partial chunk on NVMe only."""

    engine: kvtier.TransferEngine
    gpu: Gpu
    nvme_only: list[kvtier.Chunk]
    cpu: list[kvtier.Chunk]
    partial: kvtier.Chunk

    async def verify(self) -> None:
        """Every stored key loads bitwise (at most SLOTS keys per call)."""
        for batch in (self.nvme_only, [self.partial], self.cpu):
            res = await load_check(self.engine, self.gpu, batch)
            assert not res.failed, res.failed
            await self.engine.flush()


@pytest.fixture
async def witness(tmp_path: pathlib.Path) -> AsyncIterator[Witness]:
    gpu = Gpu()
    cfg = engine_config(gpu, SLOTS, nvme_config(tmp_path / "nvme"))
    async with kvtier.TransferEngine(gpu.layout, cfg) as engine:
        first = chunks(["w0", "w1", "w2"])
        partial = kvtier.Chunk(key("wp", 0), [40, 41], offset=1)
        await store_ok(engine, gpu, [*first, partial])
        await engine.flush()
        cpu = chunks(["w3", "w4", "w5", "w6"], first_block=16)
        await store_ok(engine, gpu, cpu)  # evicts the first four from CPU
        await engine.flush()
        residency = engine.lookup([c.key for c in [*first, partial, *cpu]])
        assert residency == [kvtier.Residency.NVME] * 4 + [kvtier.Residency.CPU] * 4
        yield Witness(engine, gpu, first, cpu, partial)


def _c(name: object, blocks: list[int], group_id: int = 0, offset: int = 0) -> kvtier.Chunk:
    return kvtier.Chunk(key(name, group_id), blocks, offset)


STORE: dict[str, Callable[[Witness], Any]] = {
    "a mapping of chunks": lambda w: {c.key: c for c in w.cpu},
    "a generator of chunks": lambda w: (c for c in chunks(["n0", "n1"])),
    "None": lambda w: None,
    "a str": lambda w: "chunks",
    "bytes": lambda w: b"chunks",
    "None among chunks": lambda w: [_c("n0", [0]), None],
    "block id 2**40": lambda w: [_c("n0", [0, 2**40])],
    "offset == blocks_per_chunk": lambda w: [_c("n0", [0], offset=BPC)],
    "a key twice, already on NVMe": lambda w: [w.nvme_only[0], w.nvme_only[0]],
}

LOAD: dict[str, Callable[[Witness], Any]] = {
    "a mapping of chunks": lambda w: {c.key: c for c in w.cpu},
    "a generator of chunks": lambda w: iter(w.cpu),
    "a key instead of a chunk": lambda w: [w.cpu[0].key],
    "NVMe-only key and a CPU key on one GPU block": lambda w: [
        kvtier.Chunk(w.nvme_only[0].key, [60]),
        kvtier.Chunk(w.cpu[0].key, [60]),
    ],
}

LOOKUP: dict[str, Callable[[kvtier.TransferEngine, Witness], Any]] = {
    "lookup(one OffloadKey)": lambda e, w: e.lookup(w.cpu[0].key),
    "lookup(a str)": lambda e, w: e.lookup("w0"),
    "lookup([a Chunk])": lambda e, w: e.lookup([w.cpu[0]]),
    "lookup([None])": lambda e, w: e.lookup([None]),
    "prefix_hits([bytes])": lambda e, w: e.prefix_hits([w.cpu[0].key.block_hash]),
    "prefix_hits(None)": lambda e, w: e.prefix_hits(None),
    "lookup([key of an unknown group])": lambda e, w: e.lookup(
        [w.cpu[0].key, kvtier.OffloadKey(w.cpu[0].key.block_hash, 99)]
    ),
    "prefix_hits([key of an unknown group])": lambda e, w: e.prefix_hits(
        [w.cpu[0].key, kvtier.OffloadKey(w.cpu[0].key.block_hash, 99)]
    ),
}


async def _check_unchanged(witness: Witness, call: Callable[[], Any], awaitable: bool) -> None:
    engine = witness.engine
    before = engine.stats()
    residency = engine.lookup([c.key for c in [*witness.nvme_only, *witness.cpu]])

    async def attempt() -> None:
        result = call()
        if awaitable:
            await result

    with pytest.raises(errors.InvalidArgumentError) as info:
        await attempt()
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, kvtier.KVTierError)
    assert engine.stats() == before
    assert engine.lookup([c.key for c in [*witness.nvme_only, *witness.cpu]]) == residency
    await witness.verify()


@pytest.mark.parametrize("case", sorted(STORE))
async def test_bad_store_on_nvme_engine_changes_nothing(witness: Witness, case: str) -> None:
    await _check_unchanged(witness, lambda: witness.engine.store(STORE[case](witness)), True)


@pytest.mark.parametrize("case", sorted(LOAD))
async def test_bad_load_on_nvme_engine_changes_nothing(witness: Witness, case: str) -> None:
    for c in witness.nvme_only:
        witness.gpu.scribble(c)
    await _check_unchanged(witness, lambda: witness.engine.load(LOAD[case](witness)), True)
    assert all(witness.gpu.holds(c) for c in witness.nvme_only)  # reloaded by verify()


NOT_STORED = {
    "NVMe-only partial key, sub-block 0 never stored": lambda: _c("wp", [50, 51, 52], offset=0),
    "NVMe-only partial key, offset past the stored range": lambda: _c("wp", [50], offset=3),
}


@pytest.mark.parametrize("case", sorted(NOT_STORED))
async def test_load_of_sub_blocks_never_stored_fails_that_key_alone(
    witness: Witness, case: str
) -> None:
    # Not bad input (the caller may not know the stored range after a restart):
    # the key fails with NotStoredError, nothing is promoted or copied for it,
    # and the other key of the call loads.
    engine = witness.engine
    bad, good = NOT_STORED[case](), witness.nvme_only[0]
    for c in [*witness.nvme_only, bad]:
        witness.gpu.scribble(c)
    before = engine.stats()
    assert before.nvme is not None
    res = await engine.load([bad, good])
    assert res.loaded == (good.key,)
    assert isinstance(res.failed[bad.key], errors.NotStoredError)
    after = engine.stats()
    assert after.nvme is not None
    assert after.misses == before.misses + 1
    assert after.nvme["promotions"] == before.nvme["promotions"] + 1  # the good key only
    assert engine.lookup([bad.key]) == [kvtier.Residency.NVME]
    assert witness.gpu.holds(good)
    assert witness.gpu.untouched(bad)
    await witness.verify()


@pytest.mark.parametrize("case", sorted(LOOKUP))
async def test_bad_lookup_raises_typed_error(witness: Witness, case: str) -> None:
    await _check_unchanged(witness, lambda: LOOKUP[case](witness.engine, witness), False)


async def test_lookup_of_an_unknown_group_names_the_group(witness: Witness) -> None:
    # A key of a group the layout does not have is a caller's bug, not a MISS:
    # lookup says so as store, load and prefetch do.
    with pytest.raises(errors.UnknownGroupError, match="99"):
        witness.engine.lookup([kvtier.OffloadKey(witness.cpu[0].key.block_hash, 99)])


# ------------------------------------------------------------------ construction

_GPU = Gpu(num_blocks=8)


def _nv(**kw: Any) -> kvtier.NVMeConfig:
    return kvtier.NVMeConfig(
        **{"root": "/tmp/kvtier-never-created", "capacity_bytes": 1 << 20, **kw}
    )


CONSTRUCTION: dict[str, tuple[Callable[[], Any], type[errors.KVTierError]]] = {
    "engine: layout is a str": (
        lambda: kvtier.TransferEngine("layout", kvtier.EngineConfig(1 << 20)),  # type: ignore[arg-type]
        errors.InvalidArgumentError,
    ),
    "engine: config is a dict": (
        lambda: kvtier.TransferEngine(_GPU.layout, {"cpu_bytes": 1 << 20}),  # type: ignore[arg-type]
        errors.InvalidArgumentError,
    ),
    "engine: blocks_per_chunk makes the slot exceed the budget": (
        lambda: kvtier.TransferEngine(
            _GPU.layout, kvtier.EngineConfig(_GPU.layout.slot_nbytes(BPC), blocks_per_chunk=2 * BPC)
        ),
        errors.BudgetError,
    ),
    "engine: NVMe capacity below one row of the largest group": (
        lambda: kvtier.TransferEngine(
            _GPU.layout,
            kvtier.EngineConfig(
                1 << 20, BPC, nvme=_nv(capacity_bytes=_GPU.layout.slot_nbytes(BPC) - 4096)
            ),
        ),
        errors.ConfigError,
    ),
    "config: cpu_bytes=True": (lambda: kvtier.EngineConfig(cpu_bytes=True), errors.BudgetError),
    "config: cpu_bytes is a float": (
        lambda: kvtier.EngineConfig(cpu_bytes=1e6),
        errors.BudgetError,
    ),
    "config: max_batch_chunks=0": (
        lambda: kvtier.EngineConfig(1 << 20, max_batch_chunks=0),
        errors.ConfigError,
    ),
    "config: nvme is a path": (
        lambda: kvtier.EngineConfig(1 << 20, nvme="/tmp/nvme"),  # type: ignore[arg-type]
        errors.ConfigError,
    ),
    "nvme: root=None": (lambda: _nv(root=None), errors.ConfigError),
    "nvme: empty root": (lambda: _nv(root=""), errors.ConfigError),
    "nvme: grow_ahead not a bool": (lambda: _nv(grow_ahead="yes"), errors.ConfigError),
    "nvme: empty namespace": (lambda: _nv(namespace=""), errors.ConfigError),
    "nvme: request_nbytes not a 4 KiB multiple": (
        lambda: _nv(request_nbytes=4097),
        errors.ConfigError,
    ),
    "nvme: io_threads=0": (lambda: _nv(io_threads=0), errors.ConfigError),
    "nvme: eviction_window=0": (lambda: _nv(eviction_window=0), errors.ConfigError),
    "nvme: eviction_window=2.5": (lambda: _nv(eviction_window=2.5), errors.ConfigError),
    "nvme: segment_nbytes=True": (lambda: _nv(segment_nbytes=True), errors.ConfigError),
    "nvme: capacity_bytes is a float": (lambda: _nv(capacity_bytes=1e9), errors.ConfigError),
    "key: 65-byte block_hash": (
        lambda: kvtier.OffloadKey(b"x" * 65, 0),
        errors.InvalidArgumentError,
    ),
    "key: group_id=True": (lambda: kvtier.OffloadKey(b"x", True), errors.InvalidArgumentError),
    "chunk: offset=True": (
        lambda: kvtier.Chunk(kvtier.OffloadKey(b"x", 0), [0], offset=True),
        errors.ChunkRangeError,
    ),
    "chunk: key is a str": (
        lambda: kvtier.Chunk("x", [0]),  # type: ignore[arg-type]
        errors.InvalidArgumentError,
    ),
}


@pytest.mark.parametrize("case", sorted(CONSTRUCTION))
def test_bad_construction_raises_typed_value_error(case: str) -> None:
    make, error = CONSTRUCTION[case]
    with pytest.raises(error) as info:
        make()
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, kvtier.KVTierError)
    assert not os.path.exists("/tmp/kvtier-never-created")


@pytest.mark.parametrize(
    "block_ids",
    [[1.5], "12", None, [True], [None], 7],
    ids=["float", "str", "None", "bool", "None-id", "int"],
)
def test_chunk_block_ids_must_be_ints(block_ids: Any) -> None:
    # Never truncated or split: 1.5 is not block 1 and "12" is not blocks (1, 2).
    with pytest.raises(errors.BlockIdError) as info:
        kvtier.Chunk(kvtier.OffloadKey(b"x", 0), block_ids)
    assert isinstance(info.value, ValueError)


# ------------------------------------------------------------------ start-time


async def _failed_start(engine: kvtier.TransferEngine, error: type[Exception]) -> Exception:
    before = engine.stats()
    with pytest.raises(error) as info:
        await engine.start()
    assert isinstance(info.value, kvtier.KVTierError)
    assert engine.stats() == before
    with pytest.raises(kvtier.EngineClosedError):
        await engine.store(chunks(["x"]))
    await engine.aclose()
    return info.value


async def test_cpu_budget_beyond_memory_is_a_budget_error(witness: Witness) -> None:
    huge = engine_config(witness.gpu, (1 << 50) // witness.gpu.slot_nbytes)
    before = witness.engine.stats()
    exc = await _failed_start(kvtier.TransferEngine(witness.gpu.layout, huge), errors.BudgetError)
    assert isinstance(exc, ValueError)
    assert "cpu_bytes" in str(exc)
    assert witness.engine.stats() == before
    await witness.verify()


async def test_nvme_root_is_a_file(witness: Witness, tmp_path: pathlib.Path) -> None:
    root = tmp_path / "file"
    root.write_bytes(b"not a directory")
    cfg = engine_config(witness.gpu, 2, nvme_config(root))
    exc = await _failed_start(kvtier.TransferEngine(witness.gpu.layout, cfg), errors.ConfigError)
    assert isinstance(exc, ValueError)
    assert str(root) in str(exc)
    assert root.read_bytes() == b"not a directory"
    await witness.verify()


async def test_nvme_root_below_a_file(witness: Witness, tmp_path: pathlib.Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    cfg = engine_config(witness.gpu, 2, nvme_config(tmp_path / "file" / "nvme"))
    await _failed_start(kvtier.TransferEngine(witness.gpu.layout, cfg), errors.ConfigError)
    await witness.verify()


async def test_nvme_root_immutable_for_root_too(witness: Witness, tmp_path: pathlib.Path) -> None:
    root = tmp_path / "immutable"
    root.mkdir()
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    if subprocess.run(["chattr", "+i", str(root)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here (no CAP_LINUX_IMMUTABLE or unsupported fs)")
    try:
        cfg = engine_config(witness.gpu, 2, nvme_config(root))
        exc = await _failed_start(
            kvtier.TransferEngine(witness.gpu.layout, cfg), errors.ConfigError
        )
        assert str(root) in str(exc)
        assert tree(root) == {}
    finally:
        subprocess.run(["chattr", "-i", str(root)], check=True)
    await witness.verify()


async def test_kvikio_backend_without_kvikio(witness: Witness, tmp_path: pathlib.Path) -> None:
    from kvtier.io._rowio import kvikio_available

    if kvikio_available():
        pytest.skip("kvikio and a CUDA driver are available here")
    nv = kvtier.NVMeConfig(root=tmp_path / "k", capacity_bytes=1 << 20, io_backend="kvikio")
    cfg = engine_config(witness.gpu, 2, nv)
    exc = await _failed_start(kvtier.TransferEngine(witness.gpu.layout, cfg), errors.ConfigError)
    assert "kvikio" in str(exc)
    await witness.verify()


# ------------------------------------------------------------------ mount namespaces


@pytest.fixture(scope="module")
def namespace_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run tests/reliability/_ns_child.py in a private mount namespace (once per module).

    It mounts a read-only bind and a ramfs (no O_DIRECT) that only it can see.
    """
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("unshare/mount are not installed")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a private namespace: {probe.stderr.decode().strip()}")
    base = tmp_path_factory.mktemp("mounts")
    ro, ram = base / "ro", base / "ram"
    ro.mkdir()
    ram.mkdir()
    script = (
        f"mount --bind -o ro {ro} {ro} && mount -t ramfs none {ram} && "
        f"exec {sys.executable} -m tests.reliability._ns_child {ro} {ram}"
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "case", ["read-only bind mount", "read-only bind mount, namespace dir exists"]
)
def test_nvme_root_on_read_only_mount(namespace_cases: dict[str, Any], case: str) -> None:
    got = namespace_cases[case]
    assert got["error"] == "ConfigError", got
    assert got["value_error"], got
    assert got["stats_unchanged"], got
    assert got["tree_unchanged"], got
    assert "not writable" in got["message"] or "cannot create" in got["message"], got


def test_direct_io_on_where_odirect_fails(namespace_cases: dict[str, Any]) -> None:
    got = namespace_cases["direct_io=on on ramfs"]
    if got.get("odirect_works"):
        pytest.skip("O_DIRECT works on ramfs here")
    assert got["error"] == "ConfigError", got
    assert got["value_error"], got
    assert got["stats_unchanged"], got
    assert "O_DIRECT" in got["message"], got
    auto = namespace_cases["direct_io=auto on ramfs"]
    assert auto == {"direct_io": False, "direct_io_fallback": 1, "loaded_bitwise": True}
