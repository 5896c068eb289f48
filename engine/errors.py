"""The kvtier error hierarchy.

Every error kvtier raises derives from :class:`KVTierError`. Errors caused by a
caller's arguments also derive from :class:`ValueError` (so ``except ValueError``
keeps working in serving loops) and are raised *before* any state changes.
Backend errors are re-raised ``from`` the original exception.
"""

from __future__ import annotations

import errno
from typing import Any


class KVTierError(Exception):
    """Base class of every error raised by kvtier."""


class InvalidArgumentError(KVTierError, ValueError):
    """An argument is invalid; no state was changed."""


class LayoutError(InvalidArgumentError):
    """The registered KV cache tensors cannot form a valid layout."""


class UnknownGroupError(InvalidArgumentError):
    """A ``group_id`` that the layout does not have."""


class BlockIdError(InvalidArgumentError):
    """A GPU ``block_id`` out of range or negative, or written twice by one load."""


class ChunkRangeError(InvalidArgumentError):
    """``offset + len(block_ids)`` exceeds ``blocks_per_chunk``, or is empty."""


class DuplicateKeyError(InvalidArgumentError):
    """The same offload key appears twice in one call."""


class NotStoredError(InvalidArgumentError):
    """A load asked for sub-blocks of a key that were never stored."""


class ConfigError(InvalidArgumentError):
    """An :class:`~kvtier.EngineConfig` or :class:`~kvtier.NVMeConfig` value is invalid."""


class BudgetError(ConfigError):
    """The CPU budget cannot hold a single slot (or is not positive)."""


class EngineClosedError(KVTierError, RuntimeError):
    """The engine was closed (or not started); no call is accepted."""


class WrongThreadError(KVTierError, RuntimeError):
    """A call from another thread, or event loop, than the one the engine started on.

    Nothing was changed. The engine is not thread-safe: a synchronous
    serving loop drives it through :class:`~kvtier.BackgroundEngine`.
    """


class KeyNotResidentError(KVTierError):
    """A load found the key on no medium (evicted or never stored)."""


class TransferError(KVTierError):
    """A copy between GPU blocks and CPU slots failed."""


class StorageError(KVTierError, OSError):
    """An NVMe row read or write failed; ``kind`` names the failure class.

    Attributes:
        kind: one of ``"eio"``, ``"enospc"``, ``"einval"``, ``"short_read"``,
            ``"short_write"``, ``"checksum"``, ``"trailer"``, ``"capacity"``,
            ``"missing"``, ``"header"``, ``"dropped"`` (a row not yet written
            when ``aclose(hard=True)`` dropped it), ``"other"``.

    """

    def __init__(self, kind: str, message: str, err: int | None = None) -> None:
        super().__init__(err if err is not None else 0, message)
        self.kind = kind

    def __str__(self) -> str:
        return f"[{self.kind}] {self.strerror}"


class NotDurableError(StorageError):
    """``flush()`` or ``store(durable=True)``: some rows could not be written to NVMe.

    The keys stay in their CPU slots (loadable until evicted) but are not on
    NVMe; a restart will not find them. ``kind`` is the kind of the first failure.

    Attributes:
        failed: ``{OffloadKey: StorageError}`` of the rows that failed.
        result: the :class:`~kvtier.StoreResult` of a ``store(durable=True)``
            call (its ``stored`` keys are in CPU slots), else None.

    """

    def __init__(self, failed: dict[Any, BaseException], result: Any = None) -> None:
        first = next(iter(failed.values()))
        shown = ", ".join(f"{k} [{storage_error_kind(e)}]" for k, e in list(failed.items())[:4])
        more = f" and {len(failed) - 4} more" if len(failed) > 4 else ""
        super().__init__(
            storage_error_kind(first),
            f"{len(failed)} row(s) are not durable on NVMe: {shown}{more}",
        )
        self.failed = failed
        self.result = result


class AlignmentError(InvalidArgumentError):
    """A direct-I/O buffer address, length or file offset is not 4 KiB aligned."""


class NamespaceLockedError(KVTierError):
    """Another live engine holds the NVMe namespace lock."""


def storage_error_kind(exc: BaseException) -> str:
    """Classify an exception into a failure kind used by counters.

    Args:
        exc: the exception raised by an I/O backend or verification step.

    Returns:
        A short kind string (see :class:`StorageError`).

    """
    if isinstance(exc, StorageError):
        return exc.kind
    if isinstance(exc, OSError):
        return {
            errno.EIO: "eio",
            errno.ENOSPC: "enospc",
            errno.EINVAL: "einval",
            errno.EDQUOT: "enospc",
        }.get(exc.errno or 0, "other")
    return "other"
