"""Lookups of unknown groups, the checksummed raw baselines, kvikio, the torch copy path.

* ``lookup`` / ``prefix_hits`` raising ``UnknownGroupError``: no
  state change, valid keys around the bad one, ``BackgroundEngine``, closed
  engines, and the sibling query ``stored_range``.
* ``kvtier bench``'s ``raw_checksummed`` baselines: the bytes they
  move, every request hashed exactly once, odd totals, requests larger than
  the total, one I/O thread, buffered/direct, posix/aio, pools shut down.
* The kvikio adapter on a stand-in ``kvikio`` module (kvikio needs
  a CUDA driver): EOF handling across iovecs, zero-length buffers, files that
  change size under a read, the errno mapping, kvikio's ``defaults`` APIs.
* The torch copy path run on CPU tensors: multi-piece
  pages, odd payload prefixes, several layers, aliases, partial and
  single-block chunks; round trips, slot bytes against the NumPy path (also
  through NVMe rows), and blocks that no chunk names.
* ``HostRegion.prefault`` on a host without CUDA.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier import errors
from kvtier._slots import HostRegion
from kvtier.bench import BenchConfig, baselines
from kvtier.bench.baselines import Baselines
from kvtier.errors import storage_error_kind
from kvtier.io import KvikioRowIO, PosixRowIO
from kvtier.io._aio import aio_supported
from kvtier.io._format import payload_checksum
from kvtier.io._rowio import _kvikio_oserror, probe_direct_io

from ..engine.copy_layouts import CASES, NB, LayoutCase, check_loaded, layout_case
from ..engine.helpers import fill_random, key, same
from ..io.kvikio_standin import StandInKvikio, defaults_2502, new_defaults

REPO = Path(__file__).resolve().parents[2]


# ====================================================================== 1. lookup


def _one_group_layout(nb: int = 16) -> tuple[kvtier.KVLayout, torch.Tensor]:
    t = torch.empty((nb, 1024), dtype=torch.uint8)
    fill_random(t, 61)
    return kvtier.KVLayout.from_tensors({0: {"a": t}}), t


BAD = kvtier.OffloadKey(b"\x01" * 16, 7)  # group 7: the layout has only group 0


async def test_lookup_with_a_bad_key_among_valid_ones_raises_and_changes_nothing() -> None:
    layout, t = _one_group_layout()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 << 20, 2)) as engine:
        cpu = [key(f"c{i}", 0) for i in range(3)]
        await engine.store([kvtier.Chunk(k, [2 * i, 2 * i + 1]) for i, k in enumerate(cpu)])
        miss = key("never", 0)
        before = engine.stats()
        for keys in (
            [*cpu, BAD],  # bad key last: the valid ones before it were already looked at
            [BAD, *cpu],
            [cpu[0], BAD, miss],
            [miss, BAD],  # prefix_hits would stop at the miss: the whole list is checked first
        ):
            with pytest.raises(errors.UnknownGroupError, match="7"):
                engine.lookup(keys)
            with pytest.raises(errors.UnknownGroupError):
                engine.prefix_hits(keys)
            with pytest.raises(errors.UnknownGroupError):
                engine.lookup(iter(keys))  # a one-shot iterable, as the signature allows
        assert engine.stats() == before
        assert engine.lookup([*cpu, miss]) == [kvtier.Residency.CPU] * 3 + [kvtier.Residency.MISS]
        assert engine.prefix_hits([*cpu, miss]) == 3
        assert engine.lookup([]) == []
        assert engine.prefix_hits([]) == 0
        # Every stored key still loads bitwise after the failed lookups.
        before_t = t.clone()
        t.zero_()
        res = await engine.load([kvtier.Chunk(k, [2 * i, 2 * i + 1]) for i, k in enumerate(cpu)])
        assert not res.failed
        assert same(t[:6], before_t[:6])


async def test_lookup_type_errors_and_group_errors_are_both_invalid_argument() -> None:
    # Which one is raised depends on which bad item comes first; both are
    # InvalidArgumentError (and ValueError), so a caller catching that sees both.
    layout, _ = _one_group_layout()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 << 20, 2)) as engine:
        with pytest.raises(errors.UnknownGroupError):
            engine.lookup([BAD, None])  # type: ignore[list-item]
        with pytest.raises(errors.InvalidArgumentError) as info:
            engine.lookup([None, BAD])  # type: ignore[list-item]
        assert not isinstance(info.value, errors.UnknownGroupError)
        assert isinstance(info.value, ValueError)


async def test_lookup_on_an_engine_not_open_says_closed_before_checking_groups() -> None:
    layout, _ = _one_group_layout()
    engine = kvtier.TransferEngine(layout, kvtier.EngineConfig(4 << 20, 2))
    with pytest.raises(errors.EngineClosedError):
        engine.lookup([BAD])
    with pytest.raises(errors.EngineClosedError):
        engine.prefix_hits([BAD])
    async with engine:
        with pytest.raises(errors.UnknownGroupError):
            engine.lookup([BAD])
    with pytest.raises(errors.EngineClosedError):
        engine.lookup([BAD])
    with pytest.raises(errors.EngineClosedError):
        engine.prefix_hits([BAD])


def test_background_engine_lookup_raises_unknown_group_and_stays_usable() -> None:
    layout, t = _one_group_layout()
    before_t = t.clone()
    with kvtier.BackgroundEngine(layout, kvtier.EngineConfig(4 << 20, 2)) as engine:
        good = key("bg", 0)
        engine.store([kvtier.Chunk(good, [4, 5])]).result(10)
        with pytest.raises(errors.UnknownGroupError, match="7"):
            engine.lookup([good, BAD])
        with pytest.raises(errors.UnknownGroupError):
            engine.prefix_hits(k for k in [good, BAD])
        assert engine.lookup([good]) == [kvtier.Residency.CPU]
        assert engine.prefix_hits([good, kvtier.OffloadKey(b"\x02" * 16, 0)]) == 1
        t.zero_()
        assert not engine.load([kvtier.Chunk(good, [9, 10])]).result(10).failed
    assert same(t[9:11], before_t[4:6])
    with pytest.raises(errors.EngineClosedError):
        engine.lookup([BAD])


async def test_stored_range_of_an_unknown_group_raises_like_lookup() -> None:
    """Regression: ``stored_range`` raises for an unknown group, not a MISS.

    ``lookup`` and ``prefix_hits`` raise ``UnknownGroupError`` for a key of a
    group the layout does not have ("such a key is a caller's bug, not a
    miss"), as ``store``, ``load`` and ``prefetch`` do. The third query,
    ``TransferEngine.stored_range``, must not only check the key's type and
    return ``None`` (a MISS) for the same key, or the same caller bug is
    reported by one query and hidden by the other: it calls
    ``self.layout.group(key.group_id)`` after the isinstance check (and
    documents UnknownGroupError).
    """
    layout, _ = _one_group_layout()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 << 20, 2)) as engine:
        with pytest.raises(errors.UnknownGroupError):
            engine.lookup([BAD])
        with pytest.raises(errors.UnknownGroupError):
            engine.stored_range(BAD)


# ====================================================================== 2. bench baselines


@dataclass
class _Hashed:
    """What the bench hashed: (checksum, nbytes) per call, recorded thread-safely."""

    calls: list[tuple[int, int]]
    lock: threading.Lock


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> _Hashed:
    rec = _Hashed([], threading.Lock())

    def counting(view: memoryview) -> int:
        value = payload_checksum(view)
        with rec.lock:
            rec.calls.append((value, memoryview(view).nbytes))
        return value

    monkeypatch.setattr(baselines, "payload_checksum", counting)
    return rec


def _bench_cases() -> Iterator[Any]:
    shapes = [
        # (total asked, request): the bench rounds the total up to 4 KiB
        (5 * 4096 + 1, 16384),  # odd total: 24 KiB, requests of 16 + 8 KiB (last short)
        (3 * 4096, 1 << 20),  # one request, larger than the total
        (12345, 4096),  # many one-page requests
    ]
    modes = [("posix", "off"), ("posix", "on"), ("aio", "on")]
    for backend, direct in modes:
        for threads in (1, 3):
            for total, req in shapes:
                yield pytest.param(
                    backend,
                    direct,
                    threads,
                    total,
                    req,
                    id=f"{backend}-{direct}-t{threads}-{total}-{req}",
                )


@pytest.mark.parametrize(("backend", "direct", "threads", "total", "req"), list(_bench_cases()))
def test_checksummed_raw_baselines_move_the_same_bytes_and_hash_each_request_once(
    tmp_path: Path, hashed: _Hashed, backend: str, direct: str, threads: int, total: int, req: int
) -> None:
    if backend == "aio" and not aio_supported():
        pytest.skip("no Linux AIO context here")
    if direct == "on" and not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT on this filesystem")
    cfg = BenchConfig(io_backend=backend, direct_io=direct, request_nbytes=req, io_threads=threads)
    base = Baselines(cfg, str(tmp_path), total, 4096, 1)
    try:
        assert base.io.direct is (direct == "on")
        n = base.total
        assert n % 4096 == 0
        assert n >= total
        data = torch.randint(
            0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)
        )
        base.buf.tensor[:n] = data
        raw = data.numpy().tobytes()
        offsets = range(0, n, req)
        expected = sorted(
            (payload_checksum(raw[off : off + min(req, n - off)]), min(req, n - off))
            for off in offsets
        )
        assert len(set(expected)) == len(expected)  # random data: one checksum per request

        assert base.raw_write(checksum=True) > 0
        assert sorted(hashed.calls) == expected  # every request's own bytes, once each
        assert (tmp_path / "raw.bin").read_bytes()[:n] == raw

        hashed.calls.clear()
        base.buf.tensor[:n] = 0
        assert base.raw_read(checksum=True) > 0
        assert torch.equal(base.buf.tensor[:n], data)
        assert sorted(hashed.calls) == expected  # hashed after the bytes landed

        hashed.calls.clear()
        assert base.raw_write() > 0  # the plain baselines, on the same object, hash nothing
        base.buf.tensor[:n] = 0
        assert base.raw_read() > 0
        assert torch.equal(base.buf.tensor[:n], data)
        assert hashed.calls == []
    finally:
        base.close()


def test_bench_close_shuts_down_its_io_and_hash_pools(tmp_path: Path) -> None:
    cfg = BenchConfig(io_backend="posix", direct_io="off", request_nbytes=4096, io_threads=2)
    base = Baselines(cfg, str(tmp_path), 8 * 4096, 4096, 1)
    assert base.hash_pool._max_workers == max(1, min(2, os.cpu_count() or 1))
    base.raw_write(checksum=True)
    base.raw_read(checksum=True)
    threads = [*base.pool._threads, *base.hash_pool._threads]
    assert threads  # both pools ran something
    base.close()
    assert not any(t.is_alive() for t in threads)
    for pool in (base.pool, base.hash_pool):
        with pytest.raises(RuntimeError):
            pool.submit(int)


def test_checksummed_raw_write_writes_its_bytes_under_python_dash_o(tmp_path: Path) -> None:
    """Regression: under ``python -O`` the raw baselines do their I/O.

    ``Baselines._sequential`` (engine/bench/baselines.py) must not issue a request
    inside an ``assert`` (``assert op(h, [...], off) == size`` on the posix
    path, ``assert fut.result() == sizes[i]`` on the aio path; the same in
    ``files_write``/``files_read``): ``-O`` strips asserts, so the posix
    write/read would never be made (the file stays zeros while ``raw_write``
    reports a time and the ``raw_checksummed`` write still hashes every
    request), and on the aio path the read's hashes would be submitted before
    the reads completed. It calls first, then checks: ``done = op(...); if
    done != size: raise OSError(...)`` (the same for ``fut.result()``).
    """
    script = textwrap.dedent(
        f"""
        import os, sys
        from kvtier.bench import BenchConfig
        from kvtier.bench.baselines import Baselines
        cfg = BenchConfig(io_backend="posix", direct_io="off", request_nbytes=8192, io_threads=2)
        base = Baselines(cfg, {str(tmp_path)!r}, 5 * 4096, 4096, 1)
        base.buf.tensor[: base.total] = 7
        base.raw_write(checksum=True)
        with open(os.path.join({str(tmp_path)!r}, "raw.bin"), "rb") as f:
            print(f.read().count(7), base.total)
        base.close()
        """
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    written, total = map(int, out.stdout.split())
    assert written == total


# ====================================================================== 3. kvikio adapter


@pytest.fixture
def kvikio(monkeypatch: pytest.MonkeyPatch) -> StandInKvikio:
    module = StandInKvikio()
    monkeypatch.setitem(sys.modules, "kvikio", module)
    return module


def _file(path: Path, nbytes: int) -> bytes:
    data = os.urandom(nbytes)
    path.write_bytes(data)
    return data


def _bufs(*sizes: int, fill: int = 0xEE) -> list[memoryview]:
    return [memoryview(bytearray([fill]) * n) for n in sizes]


def test_kvikio_read_straddling_eof_across_iovecs_matches_posix(
    kvikio: StandInKvikio, tmp_path: Path
) -> None:
    data = _file(tmp_path / "f", 10000)
    results = {}
    for io in (PosixRowIO(False), KvikioRowIO(False, 2)):
        h = io.open(tmp_path / "f", False)
        try:
            bufs = _bufs(4096, 4096, 4096, 4096)
            n = io.preadv(h, bufs, 4096)  # 4096 + 1808 bytes, then the end
            results[io.name] = (n, [bytes(b) for b in bufs])
        finally:
            io.close(h)
    assert results["kvikio"] == results["posix"]
    n, got = results["kvikio"]
    assert n == 10000 - 4096
    assert got[0] == data[4096:8192]
    assert got[1][:1808] == data[8192:]
    assert got[1][1808:] == b"\xee" * (4096 - 1808)  # past the end: not written
    assert got[2] == got[3] == b"\xee" * 4096
    # kvikio was asked for exactly the bytes that exist: no EOF error to map
    assert kvikio.calls == [("pread", 4096, 4096), ("pread", 1808, 8192)]


@pytest.mark.parametrize("offset", [10000, 12288, 1 << 30])
def test_kvikio_read_starting_at_or_past_eof_is_zero_without_a_kvikio_call(
    kvikio: StandInKvikio, tmp_path: Path, offset: int
) -> None:
    _file(tmp_path / "f", 10000)
    io = KvikioRowIO(False, 2)
    h = io.open(tmp_path / "f", False)
    try:
        bufs = _bufs(4096, 4096)
        assert io.preadv(h, bufs, offset) == 0
        assert all(bytes(b) == b"\xee" * 4096 for b in bufs)
        assert kvikio.calls == []
    finally:
        io.close(h)


def test_kvikio_read_ending_exactly_at_eof_stops_before_the_next_iovec(
    kvikio: StandInKvikio, tmp_path: Path
) -> None:
    data = _file(tmp_path / "f", 8192)
    io = KvikioRowIO(False, 2)
    h = io.open(tmp_path / "f", False)
    try:
        bufs = _bufs(4096, 4096, 4096)
        assert io.preadv(h, bufs, 0) == 8192
        assert bytes(bufs[0]) + bytes(bufs[1]) == data
        assert len(kvikio.calls) == 2
    finally:
        io.close(h)


def test_kvikio_direct_read_cut_at_an_unaligned_eof(kvikio: StandInKvikio, tmp_path: Path) -> None:
    # Direct mode checks the request (aligned buffers and offset), then cuts the
    # last buffer at the file's end: the cut itself may be unaligned.
    data = _file(tmp_path / "f", 2 * 4096 + 100)
    io = KvikioRowIO(True, 2)
    h = io.open(tmp_path / "f", False)
    with mmap.mmap(-1, 3 * 4096) as m:
        try:
            view = memoryview(m)
            bufs = [view[i * 4096 : (i + 1) * 4096] for i in range(3)]
            assert io.preadv(h, bufs, 0) == 2 * 4096 + 100
            assert bytes(view[: 2 * 4096 + 100]) == data
            with pytest.raises(errors.AlignmentError):
                io.preadv(h, [view[1:4097]], 0)
            for b in bufs:
                b.release()
            view.release()
        finally:
            io.close(h)


def test_kvikio_zero_length_iovec_does_not_end_the_request(
    kvikio: StandInKvikio, tmp_path: Path
) -> None:
    """Regression: a zero-length buffer does not end the request.

    ``_each_buffer`` (io/_rowio.py) computes ``want`` (the bytes to ask of
    this buffer). Breaking when it is 0 is meant for a read that reached the
    end of the file; it must not fire for a zero-length buffer, for writes as
    well as reads, or ``pwritev(h, [a, b"", c], 0)`` writes ``a`` only and
    returns ``len(a)``, which the caller takes for a short (failed) write,
    and ``preadv`` likewise leaves ``c`` unread. POSIX ``pwritev``/``preadv``
    skip an empty iovec, and so does the adapter: it goes on when
    ``nbytes == 0`` and breaks only when ``limit`` cut ``want`` to 0.
    """
    results = {}
    for io in (PosixRowIO(False), KvikioRowIO(False, 2)):
        h = io.open(tmp_path / io.name, True)
        try:
            wrote = io.pwritev(
                h, [memoryview(b"a" * 100), memoryview(b""), memoryview(b"c" * 50)], 0
            )
            bufs = _bufs(100, 0, 50)
            read = io.preadv(h, bufs, 0)
            results[io.name] = (wrote, read, bytes(bufs[2]))
        finally:
            io.close(h)
    assert results["posix"] == (150, 150, b"c" * 50)
    assert results["kvikio"] == results["posix"]


def test_kvikio_read_racing_a_truncate_raises_eio_not_a_short_count(
    kvikio: StandInKvikio, tmp_path: Path
) -> None:
    # The file shrinks between the adapter's fstat and kvikio's read: kvikio
    # meets the end of the file and raises; the adapter maps that to
    # OSError(EIO) (the tier counts it as "eio"), where the posix backend
    # would return a short count. The tier never shrinks a segment under a
    # read, so this only documents the behaviour.
    _file(tmp_path / "f", 3 * 4096)
    kvikio.before_read = lambda fd: os.ftruncate(fd, 4096 + 10)
    io = KvikioRowIO(False, 2)
    h = io.open(tmp_path / "f", False)
    try:
        with pytest.raises(OSError) as info:
            io.preadv(h, _bufs(4096, 4096, 4096), 0)
        assert info.value.errno == errno.EIO
        assert isinstance(info.value.__cause__, RuntimeError)
        assert "EOF" in str(info.value)
    finally:
        io.close(h)


def test_kvikio_read_racing_a_growing_file_is_cut_at_the_size_it_saw(
    kvikio: StandInKvikio, tmp_path: Path
) -> None:
    data = _file(tmp_path / "f", 4096 + 100)
    extra = os.urandom(8192)

    def grow(fd: int) -> None:
        if os.fstat(fd).st_size < 4096 + 100 + len(extra):
            os.pwrite(fd, extra, 4096 + 100)

    kvikio.before_read = grow
    io = KvikioRowIO(False, 2)
    h = io.open(tmp_path / "f", False)
    try:
        bufs = _bufs(4096, 4096, 4096)
        assert io.preadv(h, bufs, 0) == 4096 + 100  # short, as the contract allows
        assert bytes(bufs[0]) + bytes(bufs[1][:100]) == data
        assert bytes(bufs[1][100:]) == b"\xee" * (4096 - 100)
    finally:
        io.close(h)


KVIKIO_MESSAGES = [
    # kvikio's own wording (posix_io.hpp: "POSIX error on pwrite: " + strerror(errno))
    ("POSIX error on pwrite: No space left on device", errno.ENOSPC, "enospc"),
    ("POSIX error on pwrite: Disk quota exceeded", errno.EDQUOT, "enospc"),
    ("POSIX error on pwrite: File too large", errno.EFBIG, "other"),
    ("POSIX error on pwrite: Invalid argument", errno.EINVAL, "einval"),
    ("POSIX error on pwrite: Bad file descriptor", errno.EBADF, "other"),
    ("POSIX error on pwrite: Input/output error", errno.EIO, "eio"),
    # errno names instead of texts
    ("cuFile: EDQUOT", errno.EDQUOT, "enospc"),
    ("cuFile: EFBIG", errno.EFBIG, "other"),
    # not one it maps: EIO
    ("POSIX error on pwrite: Permission denied", errno.EIO, "eio"),
    ("POSIX error on pread: EOF", errno.EIO, "eio"),
    # several named: a fixed priority (ENOSPC, EIO, EINVAL, EBADF, EFBIG, EDQUOT),
    # not the order in the text
    ("Invalid argument after No space left on device", errno.ENOSPC, "enospc"),
    ("EDQUOT while handling Input/output error", errno.EIO, "eio"),
    ("Bad file descriptor; Invalid argument", errno.EINVAL, "einval"),
]


@pytest.mark.parametrize(("text", "code", "kind"), KVIKIO_MESSAGES)
def test_kvikio_runtime_errors_become_oserrors_with_the_errno_they_name(
    kvikio: StandInKvikio, tmp_path: Path, text: str, code: int, kind: str
) -> None:
    assert _kvikio_oserror(RuntimeError(text)).errno == code
    io = KvikioRowIO(False, 2)
    h = io.open(tmp_path / "f", True)
    try:
        kvikio.fail = text
        with pytest.raises(OSError) as info:
            io.pwritev(h, [memoryview(bytearray(4096))], 0)
        assert info.value.errno == code
        assert text in str(info.value)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert storage_error_kind(info.value) == kind
        io.allocate(h, 4096)  # a read asks kvikio only for bytes the file has
        kvikio.fail = text
        with pytest.raises(OSError) as info:
            io.preadv(h, _bufs(4096), 0)
        assert info.value.errno == code
    finally:
        io.close(h)


@pytest.mark.parametrize(
    "defaults",
    [
        types.SimpleNamespace(),  # neither API
        types.SimpleNamespace(get=lambda name: None, set=lambda *a: None),  # get gives None
        types.SimpleNamespace(get_num_threads=lambda: (_ for _ in ()).throw(RuntimeError("x"))),
    ],
    ids=["no-api", "get-none", "get-raises"],
)
def test_kvikio_defaults_without_a_known_api_only_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path, defaults: Any
) -> None:
    module = StandInKvikio(defaults)
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setattr("kvtier.io._rowio._warned_threads", [])  # a fresh process
    with caplog.at_level(logging.WARNING, logger="kvtier.io"):
        io = KvikioRowIO(False, 4)
        KvikioRowIO(False, 4)  # another tier of the same process: no second warning
    assert sum("thread pool" in r.getMessage() for r in caplog.records) == 1
    h = io.open(tmp_path / "f", True)  # the backend still works
    try:
        assert io.pwritev(h, [memoryview(b"x" * 4096)], 0) == 4096
    finally:
        io.close(h)


def test_kvikio_25_04_defaults_set_raises_the_pool_and_never_lowers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    defaults = new_defaults({"num_threads": 1})
    monkeypatch.setitem(sys.modules, "kvikio", StandInKvikio(defaults))
    KvikioRowIO(False, 4)
    assert defaults.threads["num_threads"] == 4
    defaults.threads["num_threads"] = 16
    KvikioRowIO(False, 4)
    assert defaults.threads["num_threads"] == 16


def test_kvikio_25_02_thread_pool_is_raised_to_io_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: on older kvikio the pool is raised (a no-op call left it at 1 thread).

    ``_raise_kvikio_threads`` (io/_rowio.py) must not use
    ``defaults.set_num_threads(threads)`` when ``get_num_threads`` exists.
    In every kvikio that has ``get_num_threads`` (before the ``get``/``set``
    API, whose deprecation notices say ``since="25.04"``; 25.02 is admitted
    by ``kvikio-cu12>=25.2`` in pyproject.toml) ``set_num_threads`` is a
    ``@contextlib.contextmanager`` (python/kvikio/kvikio/defaults.py):
    calling it without ``with`` only builds a generator and changes nothing,
    so the pool would stay at kvikio's 1 thread and the tier's ``io_threads``
    requests would run one at a time. The stand-in of
    tests/io/test_kvikio_adapter.py models ``set_num_threads`` as a plain
    setter, so only this test catches it. On that API the adapter calls
    ``defaults.num_threads_reset(threads)`` (it is the setter there).
    """
    defaults = defaults_2502({"num_threads": 1})
    monkeypatch.setitem(sys.modules, "kvikio", StandInKvikio(defaults))
    KvikioRowIO(False, 4)
    assert defaults.threads["num_threads"] == 4


# ====================================================================== 4. torch copy path


def _chunks(case: LayoutCase) -> list[kvtier.Chunk]:
    """Per group: scattered, single-block (last and first sub-block), consecutive partial."""
    out = []
    for g in case.groups:
        b = 10 * g
        specs = [
            ([b + 9, b + 2, b + 7, b + 5][: case.bpc], 0),
            ([b + 6], case.bpc - 1),
            ([b + 0], 0),
            ([b + 3, b + 4], 1),
        ]
        out += [kvtier.Chunk(key(f"{g}.{i}", g), ids, off) for i, (ids, off) in enumerate(specs)]
    return out


def _moved(c: kvtier.Chunk) -> kvtier.Chunk:
    return kvtier.Chunk(c.key, [NB - 1 - b for b in c.block_ids], c.offset)


async def _run(
    case: LayoutCase, monkeypatch: pytest.MonkeyPatch, torch_path: bool
) -> tuple[list[torch.Tensor], int]:
    """Store the chunks, capture their slots, scribble, load them into other blocks, check.

    Returns the slot images and how many copies went through the torch path's
    device buffer (``_staged_copy``, which every torch copy goes through).
    """
    import kvtier._transfer as transfer

    staged = [0]
    real = transfer._staged_copy

    def counting(*a: Any, **k: Any) -> None:
        staged[0] += 1
        real(*a, **k)

    case.restore()  # both paths start from the same cache bytes
    chunks = _chunks(case)
    moved = [_moved(c) for c in chunks]
    before = case.pages()
    with monkeypatch.context() as m:
        m.setattr(transfer, "_staged_copy", counting)
        if torch_path:
            m.setattr("kvtier._engine.host_pieces", lambda *a, **k: None)
        cfg = kvtier.EngineConfig(4 << 20, case.bpc)
        async with kvtier.TransferEngine(case.layout(), cfg) as engine:
            res = await engine.store(chunks)
            assert len(res.stored) == len(chunks)
            region = engine._region
            assert region is not None
            images = [
                region.slot(engine._pool.get(c.key).slot, engine.slot_nbytes).clone()
                for c in chunks
            ]
            case.scribble()
            out = await engine.load(moved)
            assert not out.failed, out.failed
            check_loaded(case, before, list(zip(chunks, moved, strict=True)))
            case.scribble()
            out = await engine.load(chunks)  # back into the blocks they came from
            assert not out.failed, out.failed
            check_loaded(case, before, [(c, c) for c in chunks])
    return images, staged[0]


@pytest.mark.parametrize("name", CASES)
async def test_torch_path_round_trips_and_writes_the_numpy_paths_slot_bytes(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    case = layout_case(name)
    numpy_images, numpy_staged = await _run(case, monkeypatch, torch_path=False)
    torch_images, torch_staged = await _run(case, monkeypatch, torch_path=True)
    assert numpy_staged == 0  # the NumPy path never stages
    assert torch_staged > 0  # every torch copy goes through the device buffer
    for i, (a, b) in enumerate(zip(numpy_images, torch_images, strict=True)):
        assert same(a, b), f"slot of chunk {i}: the NumPy and torch paths differ"


async def test_rows_written_by_one_copy_path_load_bitwise_on_the_other(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Slot bytes are the NVMe row format: a CUDA host's rows (torch path) must
    # read back bitwise on a CPU host (NumPy path), and the reverse.
    case = layout_case("bf16-prefix171-then-wide-layers")
    chunks = _chunks(case)

    def cfg(ns: str) -> kvtier.EngineConfig:
        nv = kvtier.NVMeConfig(
            root=tmp_path, capacity_bytes=16 << 20, namespace=ns, io_backend="posix",
            io_threads=2, segment_nbytes=1 << 20, request_nbytes=1 << 20,
        )  # fmt: skip
        return kvtier.EngineConfig(4 << 20, case.bpc, nvme=nv)

    for writer_torch, ns in ((True, "torch-to-numpy"), (False, "numpy-to-torch")):
        case.restore()
        before = case.pages()
        for torch_path in (writer_torch, not writer_torch):
            with monkeypatch.context() as m:
                if torch_path:
                    m.setattr("kvtier._engine.host_pieces", lambda *a, **k: None)
                async with kvtier.TransferEngine(case.layout(), cfg(ns)) as engine:
                    if torch_path is writer_torch:
                        res = await engine.store(chunks, durable=True)
                        assert len(res.stored) == len(chunks)
                        continue
                    residency = engine.lookup([c.key for c in chunks])
                    assert residency == [kvtier.Residency.NVME] * len(chunks)
                    case.scribble()
                    out = await engine.load(chunks)
                    assert not out.failed, out.failed
        check_loaded(case, before, [(c, c) for c in chunks])


# ====================================================================== 5. HostRegion


@pytest.mark.parametrize("pin", [True, False])
def test_host_region_prefault_on_a_host_without_cuda(pin: bool) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-host behaviour")
    names = {t.name for t in threading.enumerate()}
    region = HostRegion(3 * 4096, pin=pin)
    assert not region.pinned
    region.tensor.fill_(0x5A)
    region.prefault()
    assert not region.pinned  # nothing to page-lock without CUDA
    assert int(region.tensor.count_nonzero()) == 0  # prefault touches (zeroes) every page
    region.tensor[:10] = 7
    buf = region.buffer(1, 4096)
    buf[:3] = b"abc"
    buf.release()
    region.prefault()  # twice: fine, and zeroes again (call it before any data goes in)
    assert not region.pinned
    assert int(region.tensor.count_nonzero()) == 0
    assert region.host_views[4].shape == (3 * 1024,)
    region.close()
    assert "kvtier-pin" not in {t.name for t in threading.enumerate()} - names


@pytest.mark.parametrize("pin", [True, False])
def test_host_region_closed_before_prefault(pin: bool) -> None:
    region = HostRegion(4096, pin=pin)
    region.close()  # never prefaulted, never registered: unmaps cleanly
    assert not region.pinned
    assert region.views == {}
    assert region.host_views == {}


def test_host_region_close_twice_is_a_no_op() -> None:
    region = HostRegion(2 * 4096, pin=False)
    region.prefault()
    view = region.buffer(0, 4096)  # still exported: the unmap waits for the view
    region.close()
    region.close()
    assert region.views == {}
    view.release()
    other = HostRegion(4096, pin=False)
    other.close()
    other.close()
    assert other._mmap.closed


async def test_engine_start_prefaults_without_pinning_on_cpu() -> None:
    layout, _ = _one_group_layout()
    async with kvtier.TransferEngine(layout, kvtier.EngineConfig(4 << 20, 2)) as engine:
        region = engine._region
        assert region is not None
        assert not region.pinned
        assert int(region.tensor.count_nonzero()) == 0
