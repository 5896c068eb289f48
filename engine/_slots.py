"""The CPU tier: one page-aligned host region cut into fixed-size slots.

:class:`SlotPool` is a pure, synchronous state machine (no I/O, no awaits):

``free -> writing`` (reserved by a store, not readable) ``-> resident``
(evictable) ``<-> pinned`` (ref count > 0 while loads or NVMe writes read it).
A ``writing`` slot goes back to ``free`` when its copy fails or its store is
cancelled. Eviction never picks a key of the same call and is all or nothing.
:class:`HostRegion` owns the memory.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import mmap
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from kvtier._policy import EvictionPolicy
from kvtier._types import OffloadKey
from kvtier.errors import KVTierError

log = logging.getLogger("kvtier")


class SlotState(enum.Enum):
    """The state of one slot."""

    FREE = "free"
    WRITING = "writing"
    RESIDENT = "resident"
    PINNED = "pinned"


@dataclass
class SlotEntry:
    """What a non-free slot holds.

    Attributes:
        key: the offload key.
        slot: slot index.
        start: first stored sub-block.
        stop: one past the last stored sub-block.
        writing: True until the store's copy completed.
        refs: pins held by loads and NVMe writes.
        payload_nbytes: bytes of payload the key actually uses (for waste stats).
        hinted: made resident by a prefetch and not used since (its first use
            is then its first hit for the policy, see :meth:`SlotPool.touch`).

    """

    key: OffloadKey
    slot: int
    start: int
    stop: int
    writing: bool
    refs: int
    payload_nbytes: int
    hinted: bool = False

    @property
    def state(self) -> SlotState:
        """The derived :class:`SlotState`."""
        if self.writing:
            return SlotState.WRITING
        return SlotState.PINNED if self.refs else SlotState.RESIDENT


class SlotStateError(KVTierError):
    """An internal slot transition was illegal (a kvtier bug, never user input)."""


class SlotPool:
    """Slot bookkeeping for ``num_slots`` fixed-size slots.

    Args:
        num_slots: number of slots (``> 0``).
        policy: the eviction policy ordering resident keys.

    """

    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        self.num_slots = num_slots
        self.policy = policy
        # Freed slots (reused last-in first-out), then the never used ones from
        # ``_unused`` up: O(1) memory at construction, whatever num_slots is.
        self._free: list[int] = []
        self._unused = 0
        self._entries: dict[OffloadKey, SlotEntry] = {}
        self.evictions = 0

    # -------------------------------------------------------------- queries
    def get(self, key: OffloadKey) -> SlotEntry | None:
        """The entry of ``key`` or None."""
        return self._entries.get(key)

    def entries(self) -> Collection[SlotEntry]:
        """All non-free entries."""
        return self._entries.values()

    @property
    def free_count(self) -> int:
        """Slots in state ``free``."""
        return len(self._free) + self.num_slots - self._unused

    def count(self, state: SlotState) -> int:
        """Slots in ``state``."""
        if state is SlotState.FREE:
            return self.free_count
        return sum(1 for e in self._entries.values() if e.state is state)

    # -------------------------------------------------------------- transitions
    def reserve(
        self, requests: Sequence[tuple[OffloadKey, int, int, int]], protect: Collection[OffloadKey]
    ) -> tuple[list[SlotEntry], list[OffloadKey], list[OffloadKey]]:
        """Reserve slots (state ``writing``) for new keys, evicting as needed.

        Free slots are used first, then victims in policy order that are
        resident (not pinned, not writing) and not in ``protect``. The victims
        are chosen before anything changes, then committed together.

        Args:
            requests: ``(key, start, stop, payload_nbytes)`` for keys NOT present.
            protect: keys that must not be evicted (the keys of the same call).

        Returns:
            ``(reserved entries in request order, keys rejected for lack of
            room, keys evicted)``.

        """
        need = max(0, len(requests) - self.free_count)
        victims: list[SlotEntry] = []
        if need:
            for key in self.policy.candidates():
                entry = self._entries.get(key)  # type: ignore[call-overload]
                if entry is None or entry.writing or entry.refs or key in protect:
                    continue
                victims.append(entry)
                if len(victims) == need:
                    break
        for entry in victims:
            del self._entries[entry.key]
            # A key a prefetch brought in and nothing used was never accessed:
            # no ghost (ARC would count its next cold load as a second use).
            self.policy.remove(entry.key, evicted=not entry.hinted)
            self._free.append(entry.slot)
        self.evictions += len(victims)
        for key, *_ in requests:
            if key in self._entries:
                raise SlotStateError(f"reserve of present key {key}")
        # Ascending slots in request order: chunks stored together sit in
        # consecutive slots whenever the free list allows, and a later load of
        # them copies each layer with one call (kvtier._transfer._load_run).
        slots = sorted(self._take_free() for _ in range(min(len(requests), self.free_count)))
        reserved: list[SlotEntry] = []
        for (key, start, stop, nbytes), slot in zip(requests, slots, strict=False):
            entry = SlotEntry(key, slot, start, stop, True, 0, nbytes)
            self._entries[key] = entry
            reserved.append(entry)
        rejected = [key for key, *_ in requests[len(slots) :]]
        return reserved, rejected, [v.key for v in victims]

    def _take_free(self) -> int:
        if self._free:
            return self._free.pop()
        self._unused += 1
        return self._unused - 1

    def commit(self, key: OffloadKey, *, hint: bool = False) -> None:
        """``writing -> resident``: the store's (or promotion's) copy completed.

        ``hint``: a prefetch brought the key in; it is marked ``hinted`` and
        the policy gets ``insert_hint`` where it has one (ARC: a recently
        evicted key is not counted as used again until its first load).
        """
        entry = self._entries.get(key)
        if entry is None or not entry.writing:
            raise SlotStateError(f"commit of {key} in state {entry and entry.state}")
        entry.writing = False
        entry.hinted = hint
        insert_hint = getattr(self.policy, "insert_hint", None) if hint else None
        if insert_hint is not None:
            insert_hint(key)
        else:
            self.policy.insert(key)

    def abort(self, key: OffloadKey) -> None:
        """``writing -> free``: the copy failed or the store was cancelled."""
        entry = self._entries.get(key)
        if entry is None or not entry.writing or entry.refs:
            raise SlotStateError(f"abort of {key} in state {entry and entry.state}")
        del self._entries[key]
        self._free.append(entry.slot)

    def drop(self, key: OffloadKey) -> None:
        """``resident -> free``: forget an unpinned key (a cache reset, not an eviction).

        Raises:
            SlotStateError: the key is absent, writing or pinned.
        """
        entry = self._entries.get(key)
        if entry is None or entry.writing or entry.refs:
            raise SlotStateError(f"drop of {key} in state {entry and entry.state}")
        del self._entries[key]
        self.policy.remove(key, evicted=False)
        self._free.append(entry.slot)

    def pin(self, key: OffloadKey) -> SlotEntry:
        """Add a reference (``resident -> pinned``); a pinned slot is never evicted."""
        entry = self._entries.get(key)
        if entry is None or entry.writing:
            raise SlotStateError(f"pin of {key} in state {entry and entry.state}")
        entry.refs += 1
        return entry

    def unpin(self, key: OffloadKey) -> None:
        """Drop a reference (``pinned -> resident`` at zero)."""
        entry = self._entries.get(key)
        if entry is None or entry.refs <= 0:
            raise SlotStateError(f"unpin of {key} in state {entry and entry.state}")
        entry.refs -= 1

    def touch(self, key: OffloadKey) -> None:
        """Tell the policy that ``key`` was hit (a load, or a store of a present key).

        The first use of a key that a prefetch made resident is its first
        access, not its second: the policy gets ``first_use`` where it has
        one, else only a refresh (``refresh``).
        """
        entry = self._entries.get(key)
        if entry is not None and entry.hinted:
            entry.hinted = False
            first_use = getattr(self.policy, "first_use", None)
            if first_use is not None:
                first_use(key)
            else:
                self.refresh(key)
        else:
            self.policy.touch(key)

    def refresh(self, key: OffloadKey) -> None:
        """Tell the policy that ``key`` will be needed soon (a prefetch hint, not a use).

        Policies with a ``refresh(key)`` method move the key to the most
        recently used end of where it is (ARC: of its own list, so a hint
        never counts as a second access); others get ``touch``.
        """
        refresh = getattr(self.policy, "refresh", None)
        if refresh is not None:
            refresh(key)
        else:
            self.policy.touch(key)

    def refresh_tail_first(
        self, keys: Sequence[OffloadKey], resident: Collection[OffloadKey]
    ) -> None:
        """Refresh the ``resident`` ones of a call's ``keys``, from the last to the first.

        The call's first key then ends the most recently used, so a prefix
        chain passed head first loses its tail first.

        Args:
            keys: the call's keys, in call order.
            resident: those of them to refresh (the ones in a slot now).
        """
        for key in reversed(keys):
            if key in resident:
                self.refresh(key)


class HostRegion:
    """One page-aligned host buffer of ``num_slots * slot_nbytes`` bytes.

    An anonymous ``mmap`` (page aligned, so every slot is 4 KiB aligned as
    O_DIRECT requires), pre-faulted, and ``cudaHostRegister``-ed on CUDA hosts
    by :meth:`prefault` (falls back to pageable memory with a warning;
    ``pinned`` tells which).

    With ``fd``, the buffer is a shared mapping of that file (a ``memfd``
    that another process maps too, see :mod:`kvtier.vllm`) instead of
    private anonymous memory; everything else is the same.

    Args:
        nbytes: total bytes (a multiple of 4096, ``> 0``).
        pin: page-lock the buffer for the GPU in :meth:`prefault` (only when
            CUDA is available).
        fd: a file descriptor of at least ``nbytes`` bytes to map shared
            (``MAP_SHARED``); the caller keeps ownership of the descriptor.

    """

    def __init__(self, nbytes: int, *, pin: bool, fd: int | None = None) -> None:
        self.nbytes = nbytes
        if fd is None:
            self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Fewer TLB misses for the scattered block copies (THP "madvise" mode).
            with contextlib.suppress(OSError):
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.views = {
            w: self.tensor if w == 1 else self.tensor.view(dtype)
            for w, dtype in ((1, torch.uint8), (2, torch.int16), (4, torch.int32), (8, torch.int64))
        }
        # The same views for the CPU copy path (kvtier._transfer.host_views).
        self.host_views = {w: v.numpy() for w, v in self.views.items()}
        self.pinned = False
        self._registered = False
        self._want_pin = bool(pin) and torch.cuda.is_available()

    def prefault(self) -> None:
        """Touch every page, then page-lock the buffer where ``pin`` asked (blocks).

        Call it off the event loop: touching, and on CUDA hosts registering,
        tens of GiB takes seconds. The first copies then pay no page faults.
        ``cudaHostRegister`` runs on a thread of its own that ends right
        after: CUDA keeps the last error per host thread, and after a failed
        registration torch's next kernel-launch check on that thread would
        raise it; the error dies with the thread.
        """
        self.tensor.zero_()
        if self._want_pin and not self._registered:  # pragma: no cover - CUDA hosts only
            thread = threading.Thread(target=self._register, name="kvtier-pin")
            thread.start()
            thread.join()

    def _register(self) -> None:  # pragma: no cover - CUDA hosts only
        try:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            rc = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(rc) == 0:
                self._registered = self.pinned = True
            else:
                log.warning(
                    "kvtier: cudaHostRegister failed (%s); using pageable memory",
                    cudart.cudaGetErrorString(rc),
                )
        except Exception as exc:
            log.warning("kvtier: cudaHostRegister unavailable (%s); using pageable memory", exc)

    def slot(self, index: int, slot_nbytes: int) -> torch.Tensor:
        """The uint8 view of slot ``index`` (``slot_nbytes`` bytes, 4 KiB aligned)."""
        return self.tensor[index * slot_nbytes : (index + 1) * slot_nbytes]

    def buffer(self, index: int, slot_nbytes: int) -> memoryview:
        """A writable memoryview of slot ``index`` for row I/O; ``release()`` it after use."""
        return memoryview(self._mmap)[index * slot_nbytes : (index + 1) * slot_nbytes]

    def close(self) -> None:
        """Unregister and unmap; a second call does nothing.

        The tensor views must not be used afterwards.
        """
        if self._mmap.closed or not hasattr(self, "tensor"):
            return
        if self._registered:  # pragma: no cover - CUDA hosts only
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        del self.tensor
        self.views.clear()
        self.host_views.clear()
        try:
            self._mmap.close()
        except BufferError:
            # A view still exports the buffer; the mapping is freed with it.
            log.debug("kvtier: host region still referenced at close")
