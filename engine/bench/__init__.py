"""``kvtier bench``: copy and NVMe throughput against baselines measured in the same run.

Phases (each reported in GB/s with p50/p99 per-batch latency):

* ``store``: device blocks -> CPU slots (``engine.store``, one call at a time)
  vs a plain torch copy of the same number of bytes between two contiguous
  buffers, and vs plain torch indexing of the same blocks. ``pipelined``: the
  same with ``inflight_batches`` calls in flight.
* ``load``: CPU slots -> device blocks (``engine.load``), the same way.
* ``nvme_write``: CPU slots -> NVMe. Every chunk is first stored into the CPU
  tier (not timed; that is the ``store`` phase), then its row is written and
  made durable (``store(chunks, durable=True)`` of the resident keys with
  ``write_through=False``: the same batches, checksums and writes as
  write-through) vs (a) a raw sequential write of one file with the same
  backend, request size, thread count and direct-I/O mode, ``fdatasync``
  included (the disk's ceiling), (a') the same raw write with every request
  first hashed with kvtier's row checksum (xxh3-64) on as many threads as the
  tier has checksum workers (``raw_checksummed``: the ceiling of any writer
  that checksums its data; hashing reads every byte once more, and on this
  2-vCPU VM that memory traffic slows the virtual disk) and (b) one file per
  chunk written to a temporary name and renamed (what most peers do).
* ``nvme_write_full``: the same leg on a full tier, where every row written
  evicts one (most often of another group): the tier, sized to the data set,
  is filled with every chunk, then the same blocks under new keys, in another
  order, are written and made durable; vs ``raw_rewrite``, the raw baseline's
  file written again in place (same requests, ``fdatasync``): blocks already
  written, as the evicted rows' are; and ``raw_rewrite_xxh3``, the same with
  every request hashed first (as ``raw_checksummed``).
* ``nvme_write_e2e``: store -> write-through -> ``flush`` of every chunk, timed
  end to end vs the same raw write. It includes the device -> CPU copies,
  which on a CPU-only host run on the same cores as the I/O threads (on a
  CUDA host they are DMA).
* ``nvme_read``: cold promotion NVMe -> CPU slots (a new engine: empty CPU
  tier; page cache dropped with ``posix_fadvise`` when I/O is buffered):
  ``engine.prefetch`` of every key, ``inflight_batches`` calls of
  ``batch_chunks`` keys at a time, vs (a) a raw sequential read of one file,
  (a') the same with every request hashed after it landed (``raw_checksummed``)
  and (b) reading each chunk file whole, all into memory as well.
  ``cold_load``: the same keys loaded cold with ``engine.load`` in another new
  engine, promotion plus the CPU -> device copy (on a CPU-only host a memory
  copy on the same cores as the I/O threads; on a CUDA host DMA).
* ``roundtrip``: after the prefetch (the keys then loaded, untimed) and after
  the cold load, every byte of every block is compared with the original
  (bitwise); a mismatch fails the run.

Baselines and kvtier alternate inside every repeat, on the same bytes, so a
noisy neighbour hurts both sides alike; the reported ratio is kvtier/baseline
of the median repeat.

Before the phases the bench collects and freezes its set-up heap
(``gc.collect(); gc.freeze()``, undone at the end), as vLLM's engine does after
start-up (``vllm/utils/gc_utils.py``, ``freeze_gc_heap``): ``import torch``
alone leaves ~165k objects that every full cyclic collection would walk,
pausing the process, kvtier's event loop and I/O threads included, for ~80 ms
(one such pause in a 0.27 s write phase cost it a third of its speed). The
raw baselines allocate almost no Python objects and so rarely trigger one;
file-per-chunk allocates a few per file, as kvtier does per row.
``gc_freeze=False`` (``--no-gc-freeze``) measures an unfrozen process.

The modules, each importing only those before it: ``config`` (the options),
``preflight``, ``data`` (the data set and its checks), ``timing`` (a phase's
figures, the loop-lag monitor, a timed pass of engine calls), ``baselines``,
``copy_phases``, ``nvme_phases``, ``run`` (:func:`run_bench`) and ``report``
(the table, JSON and plot).
"""

from kvtier.bench.config import BenchConfig
from kvtier.bench.preflight import preflight
from kvtier.bench.report import format_table, plot, to_json
from kvtier.bench.run import bench_steps, run_bench

__all__ = [
    "BenchConfig",
    "bench_steps",
    "format_table",
    "plot",
    "preflight",
    "run_bench",
    "to_json",
]
