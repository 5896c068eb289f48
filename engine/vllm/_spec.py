"""``KVTierOffloadingSpec``: the object vLLM builds from ``kv_connector_extra_config``.

vLLM constructs the spec in the scheduler process (EngineCore) and in each
model worker; the two never share a Python object. ``__init__`` only checks
the configuration (both processes fail start-up on a bad value, naming the
key). :meth:`get_worker` (worker process, after the KV caches are
allocated) registers the layout and makes the shared slot memory;
:meth:`get_manager` (scheduler process, later) receives that memory and the
slot description from the worker and opens the NVMe tier.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier._config import NVMeConfig
from kvtier.vllm import _manager
from kvtier.vllm._config import VLLMConfigError, default_namespace, parse_config
from kvtier.vllm._manager import KVTierOffloadingManager
from kvtier.vllm._nvme import NVMeSide
from kvtier.vllm._shm import attach
from kvtier.vllm._worker import KVTierOffloadingWorker, layout_from_canonical


class KVTierOffloadingSpec(OffloadingSpec):
    """kvtier as a vLLM offloading backend (``spec_name: "KVTierOffloadingSpec"``).

    Args:
        config: vLLM's normalized offloading configuration; its
            ``extra_config`` is ``kv_connector_extra_config``
            (:func:`kvtier.vllm._config.parse_config` lists the keys).

    Raises:
        VLLMConfigError: a bad key or value (the message names the key), or
            a parallel layout this backend does not support (world size > 1,
            ``canonical_layout``).
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The Prometheus metrics :meth:`KVTierOffloadingManager.get_stats` feeds."""
        return {
            _manager.METRIC_HITS: OffloadingCounterMetadata(
                "Chunks loaded from kvtier, by the tier that held them (cpu, nvme).",
                ("tier",),
            ),
            _manager.METRIC_NVME_BYTES: OffloadingCounterMetadata(
                "Bytes of NVMe rows read (promotions) and written (write-through).",
                ("direction",),
            ),
            _manager.METRIC_NVME_SECONDS: OffloadingCounterMetadata(
                "Seconds spent in NVMe row reads and writes.", ("direction",)
            ),
            _manager.METRIC_FAILURES: OffloadingCounterMetadata(
                "NVMe rows that failed to write or to verify (those prefixes are recomputed)."
            ),
            _manager.METRIC_SLOTS_USED: OffloadingGaugeMetadata(
                "Fraction of kvtier's CPU slots in use."
            ),
        }

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.backend = parse_config(self.extra_config)
        par = config.parallel
        if par.world_size != 1:
            raise VLLMConfigError(
                f"tensor_parallel_size/pipeline_parallel_size: KVTierOffloadingSpec supports one "
                f"worker per engine for now, got world size {par.world_size} (tp {par.tp_size}, "
                f"pp {par.pp_size}); run one engine per GPU (data parallel) instead"
            )
        if config.canonical_layout:
            raise VLLMConfigError(
                "canonical_layout: not supported by KVTierOffloadingSpec (it stores each "
                "worker's pages as they are)"
            )
        self.namespace = self.backend.namespace or default_namespace(
            config.model.name, config.model.dtype, config.kv_cache_layout, par.rank
        )
        self._manager: KVTierOffloadingManager | None = None
        self._worker: KVTierOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """Register the KV caches and make the shared slot memory (worker process)."""
        if self._worker is None:
            groups = self.config.groups
            layout = layout_from_canonical(
                kv_caches, [g.group_id for g in groups], [g.tokens_per_block for g in groups]
            )
            self._worker = KVTierOffloadingWorker(
                layout,
                [g.group_id for g in groups],
                self.blocks_per_chunk,
                self.backend.cpu_bytes,
                self.config.engine_id,
                self.config.parallel.rank,
                self.backend.copy_threads,
            )
        return self._worker

    def get_manager(self) -> OffloadingManager:
        """Receive the slot memory from the worker and open the NVMe tier (scheduler process).

        Blocks at start-up until the worker has handed the memory over (at
        most ``rendezvous_timeout_s``).
        """
        if self._manager is None:
            cfg = self.backend
            header, region = attach(
                self.config.engine_id, self.config.parallel.rank, cfg.rendezvous_timeout_s
            )
            nvme = None
            if cfg.nvme_root is not None:
                assert cfg.nvme_capacity_bytes is not None
                try:
                    nvme = NVMeSide(
                        NVMeConfig(
                            root=cfg.nvme_root,
                            capacity_bytes=cfg.nvme_capacity_bytes,
                            namespace=self.namespace,
                            io_backend=cfg.io_backend,
                            direct_io=cfg.direct_io,
                            io_threads=cfg.io_threads,
                        ),
                        region,
                        int(header["slot_nbytes"]),
                        header["layout"],
                        int(header["blocks_per_chunk"]),
                        {int(g): int(n) for g, n in header["group_nbytes"].items()},
                    )
                except BaseException:
                    region.close()
                    raise
            self._region = region
            self._manager = KVTierOffloadingManager(
                int(header["num_slots"]),
                cfg.eviction,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                nvme=nvme,
                blocks_per_chunk=int(header["blocks_per_chunk"]),
            )
        return self._manager
