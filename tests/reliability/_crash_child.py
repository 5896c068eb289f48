"""SIGKILL targets for test_crash.py and test_namespace_lock.py.

``python -m tests.reliability._crash_child hold ROOT``: open an engine on
ROOT, store and flush the keys of :func:`hold_chunks`, print ``ready`` and
sleep until killed.

``python -m tests.reliability._crash_child zygote``:

The zygote imports torch and kvtier once, then for every line
``go PHASE ROOT LOG KNOWN SEED`` on stdin forks a child that runs an engine on
``ROOT`` with the PHASE workload until it is killed, prints the child's pid,
reaps it and prints ``reaped``.

The child appends one line per event to LOG (``os.write`` on an O_APPEND file,
so every line written before the kill survives it):

``R``               the engine is open
``B op`` / ``E op`` an operation (store, flush, load) begins / ends
``A name:g ...``    keys about to be stored
``F name:g ...``    keys whose store returned ``stored`` before a flush that returned
``X name:g ...``    keys that flush reported not durable (NotDurableError)
``BAD name:g``      a load returned wrong bytes (never expected)
``ERR text``        the child failed
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import traceback
from dataclasses import dataclass

import torch
import uvloop

import kvtier
from kvtier import errors

from ._model import Gpu, chunks_for, engine_config, key, load_check, nvme_config


@dataclass(frozen=True)
class Phase:
    """A workload: CPU slots, NVMe capacity and the weights of store, flush and load."""

    slots: int
    capacity_bytes: int
    store: int
    flush: int
    load: int
    strict_alternation: bool = False


PHASES = {
    # write-through of many stores, the odd flush
    "store": Phase(slots=32, capacity_bytes=64 << 20, store=8, flush=1, load=1),
    # a flush after every store
    "flush": Phase(
        slots=32, capacity_bytes=64 << 20, store=1, flush=1, load=0, strict_alternation=True
    ),
    # three CPU slots: every store and promotion evicts
    "evict": Phase(slots=3, capacity_bytes=64 << 20, store=5, flush=2, load=3),
    # loads of NVMe-only keys of earlier lives: promotions
    "promote": Phase(slots=4, capacity_bytes=64 << 20, store=2, flush=2, load=6),
    # NVMe rows evicted and reused (10 group-0 rows of capacity)
    "nvme_evict": Phase(
        slots=8, capacity_bytes=10 * 12288, store=1, flush=1, load=0, strict_alternation=True
    ),
}

NAMESPACE = "crash"
STORE_BLOCKS = 0  # stores use GPU blocks [0, 12) of each group
LOAD_BLOCKS = 16  # loads use [16, 28)


def config(gpu: Gpu, phase: str, root: str, slots: int | None = None) -> kvtier.EngineConfig:
    p = PHASES[phase]
    nv = nvme_config(
        root, capacity_bytes=p.capacity_bytes, namespace=NAMESPACE, segment_nbytes=1 << 20
    )
    return engine_config(gpu, slots or p.slots, nv)


def name(k: kvtier.OffloadKey, names: dict[kvtier.OffloadKey, str]) -> str:
    return f"{names[k]}:{k.group_id}"


def parse(token: str) -> kvtier.OffloadKey:
    n, g = token.rsplit(":", 1)
    return key(n, int(g))


class Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, *words: str) -> None:
        os.write(self.fd, (" ".join(words) + "\n").encode())


async def work(phase: str, root: str, log: Log, known: list[str], seed: int) -> None:
    p = PHASES[phase]
    rng = random.Random(seed)
    gpu = Gpu(num_blocks=32)
    names: dict[kvtier.OffloadKey, str] = {}
    older = [parse(t) for t in known]
    for t, k in zip(known, older, strict=True):
        names[k] = t.rsplit(":", 1)[0]
    async with kvtier.TransferEngine(gpu.layout, config(gpu, phase, root)) as engine:
        log("R")
        stored: list[kvtier.OffloadKey] = []
        unflushed: list[kvtier.OffloadKey] = []
        n = 0
        last = "flush"
        while n < 3000:
            if p.strict_alternation:
                op = "store" if last == "flush" else "flush"
            else:
                op = rng.choices(["store", "flush", "load"], [p.store, p.flush, p.load])[0]
            last = op
            if op == "store":
                batch = []
                for _ in range(rng.randint(1, 3)):
                    k = key(f"{phase}-{seed}-{n}", n % 2)
                    names[k] = f"{phase}-{seed}-{n}"
                    batch.append(k)
                    n += 1
                cs = chunks_for(batch, STORE_BLOCKS)
                for c in cs:
                    gpu.write(c)
                log("A", *(name(k, names) for k in batch))
                log("B", "store")
                res = await engine.store(cs)
                log("E", "store")
                stored.extend(res.stored)
                unflushed.extend(res.stored)
            elif op == "flush":
                covered, unflushed = unflushed, []
                log("B", "flush")
                failed: set[kvtier.OffloadKey] = set()
                try:
                    await engine.flush()
                except errors.NotDurableError as exc:
                    failed = set(exc.failed)
                    log("X", *(name(k, names) for k in failed if k in names))
                log("E", "flush")
                log("F", *(name(k, names) for k in covered if k not in failed))
            else:
                pool = stored + older
                if not pool:
                    continue
                picked = list(dict.fromkeys(rng.choice(pool) for _ in range(3)))
                cs = chunks_for(picked, LOAD_BLOCKS)
                log("B", "load")
                try:
                    await load_check(engine, gpu, cs)
                except AssertionError as exc:
                    log("BAD", str(exc).replace("\n", " "))
                log("E", "load")
        log("DONE")
    await asyncio.sleep(3600)


def child(phase: str, root: str, log_path: str, known_path: str, seed: int) -> None:
    log = Log(log_path)
    try:
        torch.set_num_threads(1)
        with open(known_path) as f:
            known = f.read().split()
        runner = uvloop.run if seed % 2 else asyncio.run
        runner(work(phase, root, log, known, seed))
    except BaseException:
        log("ERR", traceback.format_exc().replace("\n", " | "))
    finally:
        os._exit(0)


def zygote() -> None:
    for line in sys.stdin:
        _, phase, root, log_path, known_path, seed = line.split()
        pid = os.fork()
        if pid == 0:
            child(phase, root, log_path, known_path, int(seed))
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)


# ------------------------------------------------------------------ parent side


@dataclass
class Life:
    """What one child's log says."""

    attempted: set[kvtier.OffloadKey]
    flushes: list[set[kvtier.OffloadKey]]
    in_progress: str
    bad: list[str]


def read_log(path: str) -> Life:
    life = Life(set(), [], "open", [])
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        word, *rest = line.split(" ")
        if word == "A":
            life.attempted |= {parse(t) for t in rest}
        elif word == "F":
            life.flushes.append({parse(t) for t in rest})
        elif word == "R":
            life.in_progress = "idle"
        elif word == "B":
            life.in_progress = rest[0]
        elif word == "E":
            life.in_progress = "idle"
        elif word == "DONE":
            life.in_progress = "done"
        elif word in ("BAD", "ERR"):
            life.bad.append(line)
    return life


async def verify(
    phase: str, root: str, attempted: set[kvtier.OffloadKey], must: set[kvtier.OffloadKey]
) -> set[kvtier.OffloadKey]:
    """Reopen ``root``: no key loads wrong bytes, every key in ``must`` loads; return the loaded."""
    gpu = Gpu(num_blocks=64)
    loaded: set[kvtier.OffloadKey] = set()
    keys = sorted(attempted, key=lambda k: (k.group_id, k.block_hash))
    async with kvtier.TransferEngine(gpu.layout, config(gpu, phase, root, slots=32)) as engine:
        residency = engine.lookup(keys)
        missing = [
            k for k, r in zip(keys, residency, strict=True) if k in must and r.value != "nvme"
        ]
        assert not missing, f"{len(missing)} flushed keys are not on NVMe after the kill"
        for g in (0, 1):
            group = [k for k in keys if k.group_id == g]
            for i in range(0, len(group), 16):
                res = await load_check(engine, gpu, chunks_for(group[i : i + 16]))
                loaded |= set(res.loaded)
        stats = engine.stats()
        assert stats.slots_pinned == stats.slots_writing == 0
    assert must <= loaded, f"{len(must - loaded)} flushed keys failed to load"
    return loaded


def run_verify(it: int, *args: object) -> set[kvtier.OffloadKey]:
    """:func:`verify` on uvloop for odd iterations, asyncio otherwise."""
    runner = uvloop.run if it % 2 else asyncio.run
    result: set[kvtier.OffloadKey] = runner(verify(*args))  # type: ignore[arg-type]
    return result


def hold_chunks() -> list[kvtier.Chunk]:
    """The keys that ``hold`` stores and flushes before it prints ``ready``."""
    return chunks_for([key(f"hold-{i}", i % 2) for i in range(6)])


async def hold(root: str) -> None:
    gpu = Gpu(num_blocks=32)
    async with kvtier.TransferEngine(gpu.layout, config(gpu, "store", root)) as engine:
        cs = hold_chunks()
        for c in cs:
            gpu.write(c)
        assert len((await engine.store(cs)).stored) == len(cs)
        await engine.flush()
        print("ready", os.getpid(), flush=True)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1:2] == ["hold"]:
        asyncio.run(hold(sys.argv[2]))
    elif sys.argv[1:] == ["zygote"]:
        zygote()
    else:
        raise SystemExit("usage: python -m tests.reliability._crash_child zygote | hold ROOT")
