"""``kv_connector_extra_config`` of the kvtier offloading backend, parsed and checked.

Pure Python (no vLLM import), so that the checks are testable without vLLM
and run in both vLLM processes at start-up, before any memory or file is
touched. Every error is a :class:`~kvtier.errors.ConfigError` (a
:class:`~kvtier.errors.KVTierError` and a :class:`ValueError`) whose message
starts with the offending key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.io._rowio import IO_BACKENDS

VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "blocks_per_chunk",
        "block_size",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
        "connectors",
    }
)
"""Keys of ``kv_connector_extra_config`` that vLLM itself reads (0.32)."""

KVTIER_KEYS = frozenset(
    {
        "cpu_bytes",
        "nvme_root",
        "nvme_capacity_bytes",
        "namespace",
        "eviction",
        "io_backend",
        "direct_io",
        "io_threads",
        "copy_threads",
        "rendezvous_timeout_s",
    }
)
"""Keys this backend reads; any other key that vLLM does not read is refused."""


class VLLMConfigError(ConfigError):
    """A bad value in ``kv_connector_extra_config`` (names the key)."""


def _int(cfg: Mapping[str, Any], key: str, default: int | None, low: int) -> int | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, str) and re.fullmatch(r"\d+", value.strip()):
        value = int(value)  # JSON on a command line often quotes numbers
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise VLLMConfigError(f"{key}: expected an integer >= {low}, got {value!r:.80}")
    return value


def _choice(cfg: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = cfg.get(key, default)
    if value not in choices:
        raise VLLMConfigError(f"{key}: expected one of {', '.join(choices)}, got {value!r:.80}")
    return str(value)


@dataclass(frozen=True)
class BackendConfig:
    """The kvtier backend's settings, from ``kv_connector_extra_config``.

    Attributes:
        cpu_bytes: bytes of the CPU slot region shared by the two vLLM
            processes (``num_slots = cpu_bytes // slot_nbytes``).
        nvme_root: parent folder of the NVMe namespaces, or None for a
            CPU-only tier.
        nvme_capacity_bytes: bound on the NVMe rows in use (required with
            ``nvme_root``).
        namespace: NVMe namespace label, or None to derive it from the model,
            the KV cache dtype and layout, and the rank
            (:func:`default_namespace`).
        eviction: ``"lru"`` or ``"arc"`` (the CPU slots' policy).
        io_backend: ``"auto"``, ``"posix"``, ``"kvikio"`` or ``"aio"``.
        direct_io: ``"auto"``, ``"on"`` or ``"off"``.
        io_threads: NVMe I/O threads.
        copy_threads: copy threads per direction on CPU-only hosts.
        rendezvous_timeout_s: how long the scheduler waits at start-up for
            the model worker to hand over the slot memory (seconds).
    """

    cpu_bytes: int
    nvme_root: str | None = None
    nvme_capacity_bytes: int | None = None
    namespace: str | None = None
    eviction: str = "lru"
    io_backend: str = "auto"
    direct_io: str = "auto"
    io_threads: int = 4
    copy_threads: int = 2
    rendezvous_timeout_s: float = 300.0


def parse_config(extra_config: Mapping[str, Any]) -> BackendConfig:
    """Check ``kv_connector_extra_config`` and return the backend's settings.

    Args:
        extra_config: vLLM's ``kv_connector_extra_config`` mapping.

    Returns:
        The parsed :class:`BackendConfig`.

    Raises:
        VLLMConfigError: a missing or bad value, or an unknown key; the
            message starts with the key. Nothing is created.
    """
    if not isinstance(extra_config, Mapping):
        raise VLLMConfigError(
            f"kv_connector_extra_config: expected a mapping, got {extra_config!r}"
        )
    unknown = sorted(set(extra_config) - KVTIER_KEYS - VLLM_KEYS)
    if unknown:
        raise VLLMConfigError(
            f"{unknown[0]}: unknown key for KVTierOffloadingSpec (kvtier keys: "
            f"{', '.join(sorted(KVTIER_KEYS))})"
        )
    if "cpu_bytes" not in extra_config:
        raise VLLMConfigError("cpu_bytes: required (bytes of CPU slots, e.g. 8589934592)")
    cpu_bytes = _int(extra_config, "cpu_bytes", None, 4096)
    assert cpu_bytes is not None
    root = extra_config.get("nvme_root")
    if root is not None and (not isinstance(root, str) or not root.strip()):
        raise VLLMConfigError(f"nvme_root: expected a folder path, got {root!r:.80}")
    capacity = _int(extra_config, "nvme_capacity_bytes", None, 4096)
    if root is not None and capacity is None:
        raise VLLMConfigError("nvme_capacity_bytes: required with nvme_root (bytes of NVMe rows)")
    if root is None and capacity is not None:
        raise VLLMConfigError("nvme_capacity_bytes: given without nvme_root")
    namespace = extra_config.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace.strip()):
        raise VLLMConfigError(f"namespace: expected a non-empty string, got {namespace!r:.80}")
    timeout = extra_config.get("rendezvous_timeout_s", 300.0)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise VLLMConfigError(f"rendezvous_timeout_s: expected seconds > 0, got {timeout!r:.80}")
    io_threads = _int(extra_config, "io_threads", 4, 1)
    copy_threads = _int(extra_config, "copy_threads", 2, 1)
    assert io_threads is not None
    assert copy_threads is not None
    return BackendConfig(
        cpu_bytes=cpu_bytes,
        nvme_root=root,
        nvme_capacity_bytes=capacity,
        namespace=namespace,
        eviction=_choice(extra_config, "eviction", "lru", ("lru", "arc")),
        io_backend=_choice(extra_config, "io_backend", "auto", tuple(IO_BACKENDS)),
        direct_io=_choice(extra_config, "direct_io", "auto", ("auto", "on", "off")),
        io_threads=io_threads,
        copy_threads=copy_threads,
        rendezvous_timeout_s=float(timeout),
    )


def default_namespace(model: str, dtype: str, kv_cache_layout: str | None, rank: int) -> str:
    """The NVMe namespace used when ``namespace`` is not given.

    ``<model>/<dtype>/<kv_cache_layout>/rank<rank>``: a restart of the same
    model on the same root finds its rows; another model (or dtype, layout,
    rank) gets another folder. The row format digest also covers the
    layout's shapes, so rows of another layout are never read even under a
    shared namespace.
    """
    return f"{model}/{dtype}/{kv_cache_layout or 'default'}/rank{rank}"
