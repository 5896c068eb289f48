"""Crash consistency: SIGKILL at random points during store, flush, eviction and promotion.

Ten kills per phase, five phases: 50 kill points. A zygote process (torch
imported once) forks one engine child per kill point (see _crash_child.py);
the child logs, on an append-only file, the keys it is about to store and the
keys each returned ``flush()`` covered. After every kill the namespace is
reopened in this process and every key ever attempted is loaded: none loads
wrong bytes (each loaded key is checked byte for byte, a failed key's GPU
blocks stay untouched) and every key covered by a returned ``flush()`` loads.
In ``nvme_evict`` the NVMe capacity is ten rows, so older flushed keys are
evicted by design; there the keys of the last returned flush must load.
"""

from __future__ import annotations

import collections
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator

import pytest

import kvtier

from ._crash_child import PHASES, read_log, run_verify

REPO = pathlib.Path(__file__).resolve().parents[2]
KILLS_PER_PHASE = 10
TARGET_OPS = {
    "store": {"store"},
    "flush": {"flush"},
    "evict": {"store", "load"},
    "promote": {"load"},
    "nvme_evict": {"store", "flush"},
}


@pytest.fixture(scope="module")
def zygote() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability._crash_child", "zygote"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    yield proc
    proc.kill()
    proc.communicate(timeout=30)


def _wait_ready(log: pathlib.Path, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().startswith("R\n"):
            return
        time.sleep(0.002)
    pytest.fail(f"the child never opened its engine: {log.read_text() if log.exists() else ''}")


def _wait_for_op(log: pathlib.Path, ops: set[str], timeout_s: float = 2.0) -> None:
    """Return as soon as the child's log shows one of ``ops`` in progress (or at the timeout).

    Random kill times alone land mostly in the slowest operations; this puts
    half the kills inside short ones (a store of a few chunks) too.
    """
    deadline = time.monotonic() + timeout_s
    with open(log, "rb") as f:
        while time.monotonic() < deadline:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64))
            tail = f.read().decode(errors="replace").splitlines()
            if tail and tail[-1].startswith("B ") and tail[-1][2:] in ops:
                return
            time.sleep(0.0002)


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_sigkill_never_gives_wrong_bytes_and_keeps_flushed_keys(
    zygote: subprocess.Popen[str], tmp_path: pathlib.Path, phase: str
) -> None:
    assert zygote.stdin is not None
    assert zygote.stdout is not None
    rng = random.Random(zlib.crc32(phase.encode()))
    root = tmp_path / "nvme"
    attempted: set[kvtier.OffloadKey] = set()
    flushed: set[kvtier.OffloadKey] = set()
    last_flush: set[kvtier.OffloadKey] = set()
    flushed_names: list[str] = []  # "name:group" tokens the next child may load
    kills: collections.Counter[str] = collections.Counter()
    for it in range(KILLS_PER_PHASE):
        log, known = tmp_path / f"log{it}", tmp_path / f"known{it}"
        known.write_text(" ".join(flushed_names))
        seed = 1000 * it + rng.randrange(1000)
        zygote.stdin.write(f"go {phase} {root} {log} {known} {seed}\n")
        zygote.stdin.flush()
        pid = int(zygote.stdout.readline())
        _wait_ready(log)
        time.sleep(rng.uniform(0.0, 0.15))
        if it % 2:  # every other kill waits for an operation the phase is about
            _wait_for_op(log, TARGET_OPS[phase])
        os.kill(pid, signal.SIGKILL)
        assert zygote.stdout.readline().strip() == "reaped"
        life = read_log(str(log))
        assert not life.bad, life.bad
        kills[life.in_progress] += 1
        attempted |= life.attempted
        for batch in life.flushes:
            flushed |= batch
        last_flush = next((b for b in reversed(life.flushes) if b), last_flush)
        flushed_names += [
            t
            for line in log.read_text().splitlines()
            if line.startswith("F ")
            for t in line.split()[1:]
        ]
        must = last_flush if phase == "nvme_evict" else flushed
        loaded = run_verify(it, phase, str(root), attempted, must)
        assert must <= loaded
    assert flushed, "no flush returned before any kill"
    assert sum(kills[op] for op in TARGET_OPS[phase]) >= 3, kills
