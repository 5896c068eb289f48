"""A small engine for the eviction-policy and stats tests: layout, config, keys, pool invariants."""

from __future__ import annotations

from pathlib import Path

import torch

import kvtier
from kvtier._policy import ARCPolicy, LRUPolicy
from tests.engine.helpers import key
from tests.reliability._faultio import Wrapper

PAGE = 1024
ROW = 8192  # slot_nbytes(1) of the one-group layout below (1 KiB payload + 4 KiB pad + trailer)


def policy_layout(groups: int = 1) -> kvtier.KVLayout:
    """``groups`` groups of one zeroed ``(64, PAGE >> g)`` uint8 tensor each (group ``g``)."""
    tensors = {g: {f"l{g}": torch.zeros((64, PAGE >> g), dtype=torch.uint8)} for g in range(groups)}
    return kvtier.KVLayout.from_tensors(tensors)


def policy_config(
    nslots: int,
    eviction: str = "lru",
    root: Path | None = None,
    wrapper: Wrapper | None = None,
    namespace: str = "policy-stats",
    layout: kvtier.KVLayout | None = None,
    bpc: int = 1,
) -> kvtier.EngineConfig:
    """``nslots`` slots of ``layout`` under ``eviction``; with ``root``, a 4 MiB posix NVMe tier."""
    slot = (layout or policy_layout()).slot_nbytes(bpc)
    nvme = None
    if root is not None:
        nvme = kvtier.NVMeConfig(
            root=str(root),
            capacity_bytes=1 << 22,
            namespace=namespace,
            io_backend="posix",
            request_nbytes=8192,  # one row per request: a fault hits exactly one key
            row_io_wrapper=wrapper,
        )
    return kvtier.EngineConfig(nslots * slot, bpc, eviction=eviction, nvme=nvme)


def policy_key(name: object) -> kvtier.OffloadKey:
    """The group-0 key ``policy-{name}``."""
    return key(f"policy-{name}", 0)


def _live(policy: object) -> set[object]:
    """Keys the policy holds as resident (checks ARC's own invariants on the way)."""
    if isinstance(policy, LRUPolicy):
        return set(policy._order)
    assert isinstance(policy, ARCPolicy)
    t1, t2, b1, b2 = set(policy.t1), set(policy.t2), set(policy.b1), set(policy.b2)
    assert not t1 & t2
    assert not (t1 | t2) & (b1 | b2), "a key is both resident and a ghost"
    assert len(b1) <= policy.capacity
    assert len(b2) <= policy.capacity
    return t1 | t2


def check_invariants(engine: kvtier.TransferEngine) -> None:
    """Assert that the engine's stats add up and its policy holds exactly the committed slots."""
    s = engine.stats()
    assert s.slots_free + s.slots_writing + s.slots_resident + s.slots_pinned == s.num_slots
    occupied = s.num_slots - s.slots_free
    assert sum(s.keys_per_group.values()) == occupied - s.slots_writing  # resident keys only
    assert s.reserved_nbytes == occupied * s.slot_nbytes
    assert s.slot_waste_nbytes == s.reserved_nbytes - s.payload_nbytes >= 0
    committed = {e.key for e in engine._pool.entries() if not e.writing}
    assert _live(engine._pool.policy) == committed
    assert all(e.refs >= 0 for e in engine._pool.entries())
