"""The growth rig (held or slowed growth, failing punched-row fills) and its punch variant.

:class:`GrowthRig` extends the :class:`~tests.reliability.full_fs.FullFsRig`;
:class:`PunchRig` wraps every handle and makes hole punches fail or wait.
"""

from __future__ import annotations

import errno
import functools
import os
import pathlib
import random
import shutil
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier import OffloadKey
from kvtier.errors import StorageError
from kvtier.io import NVMeTier, RowIO
from kvtier.io._format import TRAILER_NBYTES, decode_trailer

from ..io.conftest import Slots
from ._faultio import rig_factory
from .full_fs import HEADER, ROW, A, FullFsRig, fill_fs, fs_key, groups_kwargs, key_rows, reopened


def on_disk(directory: pathlib.Path) -> dict[OffloadKey, int]:
    """What a restart would find: every key with a decodable trailer, its highest sequence."""
    best: dict[OffloadKey, int] = {}
    for path in directory.glob("g*/*.kvrows"):
        row = ROW[int(path.parent.name[1:])]
        fd = os.open(path, os.O_RDONLY)
        try:
            for i in range((os.fstat(fd).st_size - HEADER) // row):
                raw = os.pread(fd, TRAILER_NBYTES, HEADER + (i + 1) * row - TRAILER_NBYTES)
                if not any(raw):
                    continue
                try:
                    trailer = decode_trailer(raw)
                except StorageError:
                    continue
                k = OffloadKey(trailer.block_hash, trailer.group_id)
                best[k] = max(best.get(k, -1), trailer.seq)
        finally:
            os.close(fd)
    return best


def valid_nbytes(directory: pathlib.Path) -> int:
    """Row bytes a restart would count (one row per key)."""
    return sum(ROW[k.group_id] for k in on_disk(directory))


class GrowthHandle:
    """A segment handle of :class:`GrowthRig` (the real one inside); its ``fd`` may fail."""

    __slots__ = ("real", "rig")

    def __init__(self, real: Any, rig: GrowthRig) -> None:
        self.real = real
        self.rig = rig

    @property
    def fd(self) -> int:
        # _files.fill_row allocates a punched row's blocks through the handle's fd
        if self.rig.fill_faults and sys._getframe(1).f_code.co_name == "fill_row":
            self.rig.fill_faults -= 1
            self.rig.fill_failed += 1
            raise OSError(errno.EIO, "injected EIO on a punched row's allocation")
        return self.real


class GrowthRig(FullFsRig):
    """The :class:`FullFsRig`, plus: growth held (``hold_alloc``) or slowed
    (``alloc_delay``); ``fill_faults`` EIOs on a punched row's allocation (handles
    wrapped, ``wrap=True``);
    ``watch``: after every row write (row writes serialized), the row bytes a restart
    would find on disk, their maximum in ``worst``."""

    def __init__(self, inner: RowIO, wrap: bool = False) -> None:
        super().__init__(inner)
        self.wrap = wrap
        self.hold_alloc = False
        self.alloc_held = threading.Event()
        self.alloc_release = threading.Event()
        self.alloc_delay = 0.0
        self.allocs = 0
        self.fill_faults = 0
        self.fill_failed = 0
        self.watch: pathlib.Path | None = None
        self.worst = 0
        self.checks = 0
        self._row_lock = threading.Lock()

    def _real(self, handle: Any) -> Any:
        return handle.real if isinstance(handle, GrowthHandle) else handle

    def open(self, path: str | os.PathLike[str], create: bool) -> Any:
        handle = self.inner.open(path, create)
        return GrowthHandle(handle, self) if self.wrap else handle

    def close(self, handle: Any) -> None:
        self.inner.close(self._real(handle))

    def fdatasync(self, handle: Any) -> None:
        self.inner.fdatasync(self._real(handle))

    def preadv(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        return super().preadv(self._real(handle), bufs, file_offset)

    def allocate(self, handle: Any, nbytes: int) -> None:
        self.allocs += 1
        if self.hold_alloc:
            self.alloc_held.set()
            assert self.alloc_release.wait(30)
        if self.alloc_delay:
            time.sleep(self.alloc_delay)
        super().allocate(self._real(handle), nbytes)

    def pwritev(self, handle: Any, bufs: Sequence[memoryview], file_offset: int) -> int:
        handle = self._real(handle)
        if self.watch is None or sum(memoryview(b).nbytes for b in bufs) == TRAILER_NBYTES:
            return super().pwritev(handle, bufs, file_offset)
        with self._row_lock:
            try:
                return super().pwritev(handle, bufs, file_offset)
            finally:
                self.worst = max(self.worst, valid_nbytes(self.watch))
                self.checks += 1


def growth_rig(holder: list[GrowthRig], wrap: bool = False) -> Any:
    """``row_io_wrapper`` that appends the :class:`GrowthRig` of each tier opened to ``holder``."""
    return rig_factory(functools.partial(GrowthRig, wrap=wrap), holder)


async def open_tier(root: pathlib.Path, groups: Mapping[int, int], **over: Any) -> NVMeTier:
    """An open tier of ``groups`` under ``root`` (``grow_ahead`` off unless told)."""
    over.setdefault("grow_ahead", False)
    tier = NVMeTier(**groups_kwargs(root, groups, **over))
    await tier.open()
    return tier


FS = (1 << 20) + 4096  # one growth step of an 8 KiB group (127 rows) and its header


class PunchHandle(GrowthHandle):
    """A segment handle whose ``fd``, asked for by ``_files._punch_hole``, may fail or wait."""

    __slots__ = ()

    @property
    def fd(self) -> int:
        rig = self.rig
        if isinstance(rig, PunchRig) and sys._getframe(1).f_code.co_name == "_punch_hole":
            rig.punches += 1
            if rig.hold_punch:
                rig.hold_punch = False
                rig.punch_held.set()
                assert rig.punch_release.wait(30)
            if rig.punch_faults:
                rig.punch_faults -= 1
                raise OSError(rig.punch_errno, "injected failure of fallocate(PUNCH_HOLE)")
        return self.real


class PunchRig(GrowthRig):
    """The ``GrowthRig`` rig with wrapped handles, plus: ``punch_faults`` punches fail with
    ``punch_errno``; ``hold_punch``: the next punch waits for ``punch_release``;
    ``tenant``: a folder that another tenant fills to the last page right before every
    growth allocates (it takes what a punch gave back)."""

    def __init__(self, inner: RowIO) -> None:
        super().__init__(inner, wrap=True)
        self.punches = 0
        self.punch_faults = 0
        self.punch_errno = errno.EIO
        self.hold_punch = False
        self.punch_held = threading.Event()
        self.punch_release = threading.Event()
        self.tenant: Any = None
        self.tenant_files: list[Any] = []

    def open(self, path: str | os.PathLike[str], create: bool) -> Any:
        return PunchHandle(self.inner.open(path, create), self)

    def allocate(self, handle: Any, nbytes: int) -> None:
        if self.tenant is not None:
            self.tenant_files.append(fill_fs(self.tenant, f"tenant{len(self.tenant_files)}"))
        super().allocate(handle, nbytes)


async def fill_with_a(tier: NVMeTier, buf: Slots) -> list[OffloadKey]:
    """Write keys of group A one per call until the filesystem is full of them."""
    keys = []
    while tier.stats()["disk_full_evictions"] == 0:
        k = fs_key(f"a{len(keys)}", A)
        assert await tier.write_rows(key_rows(buf, [k])) == [None]
        keys.append(k)
        assert len(keys) < 2000
    held = set(tier.keys())
    return [k for k in keys if k in held]


def row_blocks(tier: NVMeTier) -> int:
    """Bytes of disk blocks of the tier's segment files, headers left out."""
    paths = list(tier.directory.glob("g*/*.kvrows"))
    return sum(p.stat().st_blocks * 512 for p in paths) - HEADER * len(paths)


async def reopened_copy(
    tier: NVMeTier, root: Any, groups: dict[int, int]
) -> tuple[dict[OffloadKey, bytes | None], dict[str, Any]]:
    """What a crash now would leave: the keys a reopen of a copy of the live folder finds."""
    copy = root.parent.parent / f"copy{random.randrange(1 << 30)}"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("*.lock", "lock"))
    try:
        return await reopened(copy, groups)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
