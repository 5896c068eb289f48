"""kv_connector_extra_config of KVTierOffloadingSpec: parsed values and start-up errors."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvtier.errors import KVTierError
from kvtier.vllm._config import VLLMConfigError, default_namespace, parse_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_parses_the_documented_keys() -> None:
    cfg = parse_config(
        {
            "spec_name": "KVTierOffloadingSpec",
            "spec_module_path": "kvtier.vllm",
            "blocks_per_chunk": 1,
            "cpu_bytes": "8589934592",  # quoted on a command line
            "nvme_root": "/mnt/nvme/kvtier",
            "nvme_capacity_bytes": 1 << 40,
            "namespace": "gemma",
            "eviction": "arc",
            "io_backend": "posix",
        }
    )
    assert cfg.cpu_bytes == 8 << 30
    assert (cfg.nvme_root, cfg.nvme_capacity_bytes, cfg.namespace) == (
        "/mnt/nvme/kvtier",
        1 << 40,
        "gemma",
    )
    assert (cfg.eviction, cfg.io_backend) == ("arc", "posix")


def test_defaults_are_a_cpu_only_lru_tier() -> None:
    cfg = parse_config({"cpu_bytes": 1 << 30})
    assert (cfg.nvme_root, cfg.eviction, cfg.io_backend, cfg.namespace) == (
        None,
        "lru",
        "auto",
        None,
    )


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({}, "cpu_bytes"),
        ({"cpu_bytes": -1}, "cpu_bytes"),
        ({"cpu_bytes": "8G"}, "cpu_bytes"),
        ({"cpu_bytes": True}, "cpu_bytes"),
        ({"cpu_bytes": 1 << 30, "nvme_root": "/tmp/x"}, "nvme_capacity_bytes"),
        ({"cpu_bytes": 1 << 30, "nvme_capacity_bytes": 1 << 30}, "nvme_capacity_bytes"),
        ({"cpu_bytes": 1 << 30, "nvme_root": "", "nvme_capacity_bytes": 1 << 30}, "nvme_root"),
        ({"cpu_bytes": 1 << 30, "eviction": "fifo"}, "eviction"),
        ({"cpu_bytes": 1 << 30, "io_backend": "spdk"}, "io_backend"),
        ({"cpu_bytes": 1 << 30, "namespace": ""}, "namespace"),
        ({"cpu_bytes": 1 << 30, "io_threads": 0}, "io_threads"),
        ({"cpu_bytes": 1 << 30, "cpu_byte": 1}, "cpu_byte"),
        ({"cpu_bytes": 1 << 30, "rendezvous_timeout_s": float("nan")}, "rendezvous_timeout_s"),
    ],
)
def test_bad_values_fail_naming_the_key(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(VLLMConfigError) as info:
        parse_config(extra)
    assert str(info.value).startswith(f"{key}:")
    assert isinstance(info.value, KVTierError)
    assert isinstance(info.value, ValueError)


def test_default_namespace_separates_models_layouts_and_ranks() -> None:
    names = {
        default_namespace("google/gemma-3-270m", "float32", "NHD", 0),
        default_namespace("google/gemma-3-270m", "float32", "NHD", 1),
        default_namespace("google/gemma-3-1b", "float32", "NHD", 0),
        default_namespace("google/gemma-3-270m", "bfloat16", "NHD", 0),
        default_namespace("google/gemma-3-270m", "float32", "HND", 0),
    }
    assert len(names) == 5
    assert default_namespace("m", "float32", None, 0) == default_namespace("m", "float32", None, 0)


def _offloading_config(extra: dict[str, Any], world_size: int = 1) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers.0",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="e",
        model=OffloadingModelConfig("m", "float32"),
        cache=OffloadingCacheConfig(16, 1),
        parallel=OffloadingParallelConfig(0, world_size, world_size, 1, 1, 1, 0, 1, None, False),
    )


def test_spec_fails_start_up_on_a_bad_value() -> None:
    pytest.importorskip("vllm")
    from kvtier.vllm import KVTierOffloadingSpec

    with pytest.raises(VLLMConfigError, match=r"^eviction:"):
        KVTierOffloadingSpec(_offloading_config({"cpu_bytes": 1 << 20, "eviction": "mru"}))


def test_spec_refuses_more_than_one_worker() -> None:
    pytest.importorskip("vllm")
    from kvtier.vllm import KVTierOffloadingSpec

    with pytest.raises(VLLMConfigError, match="world size 2"):
        KVTierOffloadingSpec(_offloading_config({"cpu_bytes": 1 << 20}, world_size=2))


def test_spec_derives_the_namespace_from_model_and_rank() -> None:
    pytest.importorskip("vllm")
    from kvtier.vllm import KVTierOffloadingSpec

    spec = KVTierOffloadingSpec(_offloading_config({"cpu_bytes": 1 << 20}))
    assert spec.namespace == default_namespace("m", "float32", None, 0)


def test_import_kvtier_does_not_import_vllm() -> None:
    code = "import sys, kvtier; print('vllm' in sys.modules, 'kvtier.vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
