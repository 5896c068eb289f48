"""Filesystems full below ``capacity_bytes``: groups, keys, rows, a faulting RowIO, real mounts.

The fixtures ``tmpfs`` and ``ext4`` reach the tests through this package's conftest.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from kvtier import OffloadKey
from kvtier.io import NVMeTier, RowIO

from ..io.conftest import Slots, payload, tier_kwargs
from ..io.faults import DelegatingRowIO
from ._faultio import snapshot

TRAILER = 4096
HEADER = 4096
BIG, SMALL, MID = 0, 1, 2
G = {BIG: 9 * 4096 - 100, SMALL: 100, MID: 4096}  # rows of 40, 8 and 8 KiB
A, B = 3, 4
EQ = {A: 4096, B: 4096}  # two groups of 8 KiB rows
NB = {**G, **EQ}
ROW = {g: -(-n // 4096) * 4096 + TRAILER for g, n in NB.items()}
SLOT = max(ROW.values())


def groups_kwargs(
    root: pathlib.Path | str, groups: Mapping[int, int] = G, **over: Any
) -> dict[str, Any]:
    """``tier_kwargs`` for the groups ``groups`` (group id -> payload bytes)."""
    layout = {"groups": {str(g): {"layers": [f"l{g}"]} for g in groups}}
    return tier_kwargs(root, group_nbytes=dict(groups), layout_description=layout, **over)


def fs_key(i: int | str, group_id: int) -> OffloadKey:
    """The key ``disk-full-{i}`` of ``group_id``."""
    return OffloadKey(f"disk-full-{i}".encode(), group_id)


def trailer_tag(k: OffloadKey) -> bytes:
    """What a row's trailer holds of its key: the hash, zero padded (no prefix matches)."""
    return k.block_hash + b"\0"


def key_data(k: OffloadKey, salt: int = 0) -> bytes:
    """The payload of ``k`` (``NB`` bytes of its group)."""
    return payload(k, NB[k.group_id], salt)


def key_rows(buf: Slots, keys: Sequence[OffloadKey], salt: Mapping[OffloadKey, int] | None = None,
             first: int = 0) -> list[tuple[OffloadKey, int, int, memoryview]]:  # fmt: skip
    """Rows to write for ``keys``, their payloads filled into ``buf`` from slot ``first``."""
    salt = salt or {}
    return [(k, 0, 4, buf.fill(first + i, key_data(k, salt.get(k, 0)))) for i, k in enumerate(keys)]


class FullFsRig(DelegatingRowIO):
    """Real I/O with faults on demand.

    ``full_errno``: every ``allocate`` (segment growth) fails with it.
    ``fail`` / ``short``: row writes whose trailer names one of these tags fail
    with EIO (nothing written) / write the rows before it and the first 4 KiB
    of it, and return that count. ``hold_blank``: the next blanking write (4
    KiB past a header) waits for ``blank_release``. ``hold_reads``: row reads
    wait for ``reads_release``; ``read_delay``: row reads sleep that long.
    """

    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner)
        self.full_errno = 0
        self.fail: set[bytes] = set()
        self.short: set[bytes] = set()
        self.hold_blank = False
        self.blank_held = threading.Event()
        self.blank_release = threading.Event()
        self.hold_reads = False
        self.read_held = threading.Event()
        self.reads_release = threading.Event()
        self.read_delay = 0.0
        self._lock = threading.Lock()

    def allocate(self, handle: Any, nbytes: int) -> None:
        if self.full_errno:
            raise OSError(self.full_errno, os.strerror(self.full_errno))
        self.inner.allocate(handle, nbytes)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        if nbytes == TRAILER and file_offset > 0:
            with self._lock:
                hold, self.hold_blank = self.hold_blank, False
            if hold:
                self.blank_held.set()
                assert self.blank_release.wait(30)
            return self.inner.pwritev(handle, bufs, file_offset)
        before = 0
        for i, b in enumerate(bufs):
            mv = memoryview(b)
            t = bytes(mv[mv.nbytes - TRAILER : mv.nbytes - TRAILER + 160])
            if any(tag in t for tag in self.fail):
                raise OSError(errno.EIO, "injected EIO on a row write")
            if any(tag in t for tag in self.short):
                n = self.inner.pwritev(handle, bufs[:i], file_offset) if i else 0
                return n + self.inner.pwritev(handle, [mv[:4096]], file_offset + before)
            before += mv.nbytes
        return self.inner.pwritev(handle, bufs, file_offset)

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        if sum(memoryview(b).nbytes for b in bufs) > TRAILER:  # a row read, not a scan
            if self.hold_reads:
                self.read_held.set()
                assert self.reads_release.wait(30)
            elif self.read_delay:
                time.sleep(self.read_delay)
        return self.inner.preadv(handle, bufs, file_offset)


@pytest.fixture
def tmpfs(tmp_path: pathlib.Path) -> Iterator[Callable[[int], pathlib.Path]]:
    """``tmpfs(nbytes)``: a real tmpfs of that size mounted under ``tmp_path`` (root only)."""
    mounted: list[pathlib.Path] = []

    def mount(nbytes: int) -> pathlib.Path:
        mnt = tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        ok = False
        if os.geteuid() == 0:
            cmd = ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(mnt)]
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                ok = subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
        if not ok:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


@pytest.fixture
def ext4(tmp_path: pathlib.Path) -> Iterator[Callable[[int], pathlib.Path]]:
    """``ext4(nbytes)``: a real ext4 filesystem of that size on a loop device (root only)."""
    mounted: list[pathlib.Path] = []

    def mount(nbytes: int) -> pathlib.Path:
        image = tmp_path / f"ext4-{len(mounted)}.img"
        mnt = tmp_path / f"ext4-{len(mounted)}"
        mnt.mkdir()
        with image.open("wb") as f:
            f.truncate(nbytes)
        ok = False
        if os.geteuid() == 0 and shutil.which("mkfs.ext4"):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                made = subprocess.run(
                    ["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, timeout=30
                )
                cmd = ["mount", "-o", "loop", str(image), str(mnt)]
                ok = made.returncode == 0 and (
                    subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
                )
        if not ok:
            pytest.skip("cannot mount an ext4 loop image here (needs root and a loop device)")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def fill_fs(mnt: pathlib.Path, name: str = "filler") -> pathlib.Path:
    """Fill a filesystem to the last page with a file (another tenant); return its path."""
    path = mnt / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        block = b"\xa5" * 4096
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return path
    finally:
        os.close(fd)


def free_nbytes(mnt: pathlib.Path) -> int:
    """Bytes free to an unprivileged writer on the filesystem of ``mnt``."""
    st = os.statvfs(mnt)
    return st.f_bavail * st.f_frsize


async def fs_snapshot(tier: NVMeTier) -> dict[OffloadKey, bytes | None]:
    """Every visible key's payload (None: its read failed)."""
    return await snapshot(tier, NB, SLOT)


async def reopened(
    root: pathlib.Path, groups: Mapping[int, int] = G, **over: Any
) -> tuple[dict[OffloadKey, bytes | None], dict[str, Any]]:
    """Open the namespace (room for every row unless told), read every key, close."""
    over.setdefault("capacity_bytes", 64 << 20)
    tier = NVMeTier(**groups_kwargs(root, groups, **over))
    await tier.open()
    try:
        st = dict(tier.stats())
        return await fs_snapshot(tier), st
    finally:
        await tier.close()


def error_kinds(results: Sequence[BaseException | None]) -> list[str | None]:
    """Each result's error kind (the exception's type name if it has none), None for success."""
    return [None if r is None else getattr(r, "kind", type(r).__name__) for r in results]
