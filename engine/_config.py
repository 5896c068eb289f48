"""Engine configuration: :class:`EngineConfig` and :class:`NVMeConfig`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.errors import BudgetError, ConfigError

if TYPE_CHECKING:
    from kvtier.io import RowIO


def _positive_int(name: str, value: Any, error: type[ConfigError] = ConfigError) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class NVMeConfig:
    """Where and how the NVMe tier stores rows.

    Attributes:
        root: directory holding one ``<namespace>-<digest16>/`` folder per
            format; created with its parents if missing.
        capacity_bytes: upper bound of row bytes on disk (LRU eviction over rows).
            Where the filesystem fills up first (ENOSPC, EDQUOT), a new row
            takes the row of its group's least recently used key instead
            (``stats().nvme["disk_full_evictions"]``); a group with no key
            to take gets the punched rows of other groups' least recently
            used keys.
        namespace: the user's label (model id, rank); part of the format digest.
        io_backend: ``"auto"`` (kvikio when it imports and a CUDA driver loads,
            else posix), ``"posix"``, ``"kvikio"`` or ``"aio"`` (posix with row
            requests queued in the kernel through Linux AIO, up to
            ``4 * io_threads`` at once: they do not wait for a worker thread to
            get the GIL back; needs O_DIRECT).
        direct_io: ``"auto"`` (probe O_DIRECT, fall back visibly), ``"on"``
            (raise if unsupported) or ``"off"``.
        io_threads: worker threads for row I/O (``"aio"``: sets the AIO depth).
        segment_nbytes: largest size of one segment file in bytes (files grow
            lazily in steps up to it).
        request_nbytes: largest single read/write request in bytes (4 KiB multiple).
        row_io_wrapper: wraps the chosen RowIO backend (fault injection, tracing).
        grow_ahead: allocate a group's next rows (and its first segment file
            at open) in the background before writes need them; False: only
            when a write needs a row (see :class:`kvtier.io.NVMeTier`).
        eviction_window: when the tier is full, a write evicts the least
            recently used key of its own group instead of the least recently
            used key if it is among the ``eviction_window`` least recently
            used evictable keys (pinned keys and keys of the writing call are
            skipped; the window is at most 1/32 of the tier's keys, so a
            tier of fewer than 64 keys evicts in strict LRU order); the
            writer then overwrites that row in place, where a row of another
            group needs a 4 KiB trailer write to blank it first. ``1``:
            strict LRU. Default 32 (``kvtier bench`` full tier: see the
            README, "Steady state"). ``stats().nvme["window_evictions"]``
            counts the evictions that skipped an older key of another group.

    Raises:
        ConfigError: a value is out of range.

    """

    root: str | os.PathLike[str]
    capacity_bytes: int
    namespace: str = "default"
    io_backend: str = "auto"
    direct_io: str = "auto"
    io_threads: int = 4
    segment_nbytes: int = 256 << 20
    request_nbytes: int = 4 << 20
    row_io_wrapper: Callable[[RowIO], RowIO] | None = None
    grow_ahead: bool = True
    eviction_window: int = 32

    def __post_init__(self) -> None:
        _positive_int("NVMeConfig.capacity_bytes", self.capacity_bytes)
        _positive_int("NVMeConfig.eviction_window", self.eviction_window)
        if not isinstance(self.grow_ahead, bool):
            raise ConfigError(f"NVMeConfig.grow_ahead must be a bool, got {self.grow_ahead!r}")
        if self.row_io_wrapper is not None and not callable(self.row_io_wrapper):
            raise ConfigError(
                f"NVMeConfig.row_io_wrapper must be a callable or None, got {self.row_io_wrapper!r}"
            )
        _positive_int("NVMeConfig.io_threads", self.io_threads)
        _positive_int("NVMeConfig.segment_nbytes", self.segment_nbytes)
        if self.segment_nbytes < 2 * 4096:
            raise ConfigError(f"NVMeConfig.segment_nbytes must be >= 8192: {self.segment_nbytes}")
        _positive_int("NVMeConfig.request_nbytes", self.request_nbytes)
        if self.request_nbytes % 4096:
            raise ConfigError(
                f"NVMeConfig.request_nbytes must be a 4096 multiple: {self.request_nbytes}"
            )
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ConfigError(f"NVMeConfig.namespace must be a non-empty str: {self.namespace!r}")
        if self.io_backend not in ("auto", "posix", "kvikio", "aio"):
            raise ConfigError(
                f"NVMeConfig.io_backend {self.io_backend!r} not in auto/posix/kvikio/aio"
            )
        if self.direct_io not in ("auto", "on", "off"):
            raise ConfigError(f"NVMeConfig.direct_io {self.direct_io!r} not in auto/on/off")
        try:
            root = os.fspath(self.root) if isinstance(self.root, str | os.PathLike) else None
        except TypeError:
            root = None
        if not isinstance(root, str):
            raise ConfigError(f"NVMeConfig.root must be a str path, got {self.root!r}")
        if not root:
            raise ConfigError("NVMeConfig.root must not be empty (use '.' for the current folder)")
        if "\0" in root or "\0" in self.namespace:
            raise ConfigError("NVMeConfig.root and namespace must not contain NUL bytes")


COPY_BACKENDS = ("auto", "dma", "kernel", "torch")
"""The values of :attr:`EngineConfig.copy_backend`."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizing and policies.

    Attributes:
        cpu_bytes: budget of the pinned CPU pool in bytes;
            ``num_slots = cpu_bytes // layout.slot_nbytes(blocks_per_chunk)``.
        blocks_per_chunk: GPU blocks per chunk (the unit of offload), ``> 0``.
        eviction: ``"lru"`` (default) or ``"arc"``.
        nvme: the NVMe tier, or None for CPU only.
        max_batch_chunks: largest number of chunk copies coalesced into one job.
        pin_memory: page-lock the CPU pool on CUDA hosts.
        write_through: write every stored key to NVMe in the background.
        copy_threads: worker threads per direction for the CPU-only copy path
            (default: ``min(2, os.cpu_count())``); ignored on CUDA hosts.
        copy_backend: how a job's copies run. ``"auto"`` (default): on
            CPU-only hosts the job's descriptor table by NumPy (one
            fancy-indexed copy per row size), on CUDA hosts torch calls on
            the direction's stream. ``"dma"``: the table as batched copies
            (NumPy on CPU-only hosts). ``"kernel"``: the table by a Triton
            copy kernel (CPU-only hosts under ``TRITON_INTERPRET=1``, for
            checking it). ``"torch"``: torch calls per chunk and piece on
            every host. On CUDA hosts only ``"auto"`` and ``"torch"`` are
            accepted in this release (``TransferEngine`` raises
            ``ConfigError`` for the others).

    Raises:
        BudgetError: ``cpu_bytes`` is not a positive int.
        ConfigError: another value is out of range.

    """

    cpu_bytes: int
    blocks_per_chunk: int = 4
    eviction: str = "lru"
    nvme: NVMeConfig | None = None
    max_batch_chunks: int = 1024
    pin_memory: bool = True
    write_through: bool = True
    copy_threads: int = min(2, os.cpu_count() or 1)
    copy_backend: str = "auto"

    def __post_init__(self) -> None:
        _positive_int("EngineConfig.cpu_bytes", self.cpu_bytes, BudgetError)
        _positive_int("EngineConfig.copy_threads", self.copy_threads)
        _positive_int("EngineConfig.blocks_per_chunk", self.blocks_per_chunk)
        _positive_int("EngineConfig.max_batch_chunks", self.max_batch_chunks)
        if self.eviction not in ("lru", "arc"):
            raise ConfigError(f"EngineConfig.eviction {self.eviction!r} not in lru/arc")
        if self.copy_backend not in COPY_BACKENDS:
            raise ConfigError(
                f"EngineConfig.copy_backend {self.copy_backend!r} not in {'/'.join(COPY_BACKENDS)}"
            )
        if self.nvme is not None and not isinstance(self.nvme, NVMeConfig):
            raise ConfigError("EngineConfig.nvme must be an NVMeConfig or None")
        for name in ("pin_memory", "write_through"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"EngineConfig.{name} must be a bool, got {value!r}")
