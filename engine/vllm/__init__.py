"""kvtier as a vLLM offloading backend (``kvtier.vllm``; needs vLLM 0.32).

Name it in vLLM's ``kv_transfer_config``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
                                   "spec_module_path": "kvtier.vllm",
                                   "cpu_bytes": 8589934592}}

``import kvtier`` never imports this package, and importing this package
imports vLLM only when one of the vLLM-facing names below is first used
(PEP 562 ``__getattr__``), so :func:`parse_config` works without vLLM. See
docs/vllm.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.vllm._config import BackendConfig, VLLMConfigError, parse_config

if TYPE_CHECKING:
    from kvtier.vllm._manager import KVTierOffloadingManager
    from kvtier.vllm._spec import KVTierOffloadingSpec
    from kvtier.vllm._worker import KVTierOffloadingWorker

_LAZY = {
    "KVTierOffloadingManager": "kvtier.vllm._manager",
    "KVTierOffloadingSpec": "kvtier.vllm._spec",
    "KVTierOffloadingWorker": "kvtier.vllm._worker",
}

__all__ = [
    "BackendConfig",
    "KVTierOffloadingManager",
    "KVTierOffloadingSpec",
    "KVTierOffloadingWorker",
    "VLLMConfigError",
    "parse_config",
]


def __getattr__(name: str) -> Any:
    """Import the vLLM-facing classes on first use (they import vLLM)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
