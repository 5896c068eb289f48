"""The key of the offload tiers: one chunk of one KV cache group.

Public and small, so that both packages import it: the engine (``kvtier``)
and the NVMe tier (``kvtier.io``) name keys by :class:`OffloadKey`, and
``kvtier.io`` depends on the engine only through this module and
:mod:`kvtier.errors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.errors import InvalidArgumentError

__all__ = ["OffloadKey"]


@dataclass(frozen=True, repr=False)
class OffloadKey:
    """Names one chunk of ONE KV cache group.

    Attributes:
        block_hash: the chunk's content hash (bytes, 1..64 long; an instance of
            a bytes subclass is copied to plain bytes), e.g. the hash of the
            last block of the chunk chained from token ids.
        group_id: the KV cache group (``>= 0``).

    Raises:
        InvalidArgumentError: ``block_hash`` is not 1..64 bytes or
            ``group_id`` is not a non-negative int.

    """

    # ``_hash`` is a slot, not a field (asdict/astuple/replace ignore it):
    # computed once, as keys are hashed several times per chunk on the loop.
    __slots__ = ("_hash", "block_hash", "group_id")
    if TYPE_CHECKING:  # for mypy only: at run time _hash is not a dataclass field
        _hash: int = field(init=False, repr=False, compare=False)

    block_hash: bytes
    group_id: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_hash, bytes):
            raise InvalidArgumentError(
                f"OffloadKey.block_hash must be bytes (e.g. a hash digest), got "
                f"{type(self.block_hash).__name__} {self.block_hash!r:.80}"
            )
        if type(self.block_hash) is not bytes:  # a subclass: its own bytes, not its methods
            object.__setattr__(self, "block_hash", bytes(self.block_hash))
        if not 1 <= len(self.block_hash) <= 64:
            raise InvalidArgumentError(
                f"OffloadKey.block_hash must be 1..64 bytes long, got {len(self.block_hash)}"
            )
        if isinstance(self.group_id, bool) or not isinstance(self.group_id, int):
            raise InvalidArgumentError(f"OffloadKey.group_id must be int, got {self.group_id!r}")
        if not 0 <= self.group_id < 1 << 32:
            raise InvalidArgumentError(
                f"OffloadKey.group_id must be in [0, 2**32), got {self.group_id}"
            )
        object.__setattr__(self, "_hash", hash((self.block_hash, self.group_id)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # Any OffloadKey naming the same (block_hash, group_id) is the same key,
        # an instance of a subclass too (the generated __eq__ wants one class).
        if isinstance(other, OffloadKey):
            return self.group_id == other.group_id and self.block_hash == other.block_hash
        return NotImplemented

    def __repr__(self) -> str:
        # Hex, not a bytes literal: readable in logs and error messages, and eval()-able.
        hex_ = self.block_hash.hex()
        return f"OffloadKey(block_hash=bytes.fromhex({hex_!r}), group_id={self.group_id})"

    def __reduce__(self) -> tuple[type[OffloadKey], tuple[bytes, int]]:
        # Rebuilt (and re-hashed) on unpickling: str/bytes hashes differ per process.
        return OffloadKey, (self.block_hash, self.group_id)

    def __setstate__(self, state: Sequence[Any]) -> None:
        # Pickles made by versions whose state was ``[block_hash, group_id]``.
        block_hash, group_id = state
        object.__setattr__(self, "block_hash", block_hash)
        object.__setattr__(self, "group_id", group_id)
        self.__post_init__()
