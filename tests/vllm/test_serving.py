"""kvtier as vLLM's offloading backend, in a real vLLM serving Gemma-3-270M.

Every process here is vLLM's CPU build (a front end, its EngineCore and its
model worker) started by ``serve_child.py`` with greedy sampling and prompts
that share prefixes. One scenario runs once per module, in order:

1. vLLM with no connector (the reference outputs);
2. vLLM with kvtier (CPU slots and an NVMe root): cold, then the same
   prompts from vLLM's own GPU prefix cache, then after
   ``reset_prefix_cache()`` from kvtier's CPU slots;
3. a new process on the same NVMe root (served from NVMe rows), killed with
   SIGKILL while it serves;
4. one row corrupted on disk, then a new process;
5. kvtier with CPU slots only, exactly as many as the keys stored in 2.

Token ids are compared exactly everywhere. Logprobs are compared exactly
wherever the prefill split at the same token in the same connector setup
(vLLM's GPU prefix cache against kvtier's slots or rows: only the source of
the cached KV differs). A run with vLLM's ``OffloadingConnector`` differs
from a run without one in the last bits of float32 logprobs even for a cold
prompt, before any chunk is loaded, so against the no-connector run the
logprobs are compared to 1e-4.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier._models import gemma3_270m_checkpoint
from kvtier.io._format import HEADER_NBYTES, TRAILER_NBYTES, decode_trailer, is_blank

# Five vLLM start-ups of 25-45 s each, and their prompts, on 2 cores.
pytestmark = pytest.mark.timeout(1500)

CHILD = Path(__file__).with_name("serve_child.py")
LOGPROB_TOL = 1e-4
GENERATE = {"step": "generate"}
RESET = {"step": "reset"}
METRICS = {"step": "metrics"}


def _prompts() -> list[list[int]]:
    """Four prompts: three on one 600-token prefix, one on its first 300 tokens."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 200_000) for _ in range(n)]

    base = tokens(600)
    return [base + tokens(5), base + tokens(40), base + tokens(90), base[:300] + tokens(100)]


def _plan(model: Path, connector: dict[str, Any] | None, steps: list[dict[str, Any]]) -> str:
    return json.dumps(
        {"model": str(model), "connector": connector, "prompts": _prompts(), "steps": steps}
    )


def _lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("PLAN ")]


def _serve(model: Path, connector: dict[str, Any] | None, steps: list[dict[str, Any]]) -> Any:
    """Run one vLLM process to its end; its steps' results by kind."""
    proc = subprocess.run(
        [sys.executable, str(CHILD), _plan(model, connector, steps)],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
    )
    lines = _lines(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert lines[-1]["step"] == "exit", proc.stderr[-4000:]
    return _Run(lines)


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("KVTIER_REQUIRE_VLLM", None)
    return env


class _Run:
    def __init__(self, lines: list[dict[str, Any]]) -> None:
        self.rounds = [line["outputs"] for line in lines if line["step"] == "generate"]
        metrics = [line["metrics"] for line in lines if line["step"] == "metrics"]
        self.metrics: dict[str, float] = metrics[-1] if metrics else {}

    def metric(self, name: str) -> float:
        return self.metrics.get(name, 0.0)


def _cached(outputs: list[dict[str, Any]]) -> list[int]:
    return [o["num_cached_tokens"] for o in outputs]


def _tokens(outputs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def _logprobs(outputs: list[dict[str, Any]]) -> list[list[float]]:
    return [o["logprobs"] for o in outputs]


def _close(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """Largest logprob difference of two rounds with equal token ids."""
    assert _tokens(a) == _tokens(b)
    return max(
        abs(x - y)
        for p, q in zip(_logprobs(a), _logprobs(b), strict=True)
        for x, y in zip(p, q, strict=True)
    )


def _namespace(root: Path) -> Path:
    (ns,) = [p for p in root.iterdir() if p.is_dir()]
    return ns


def _inspect(root: Path) -> dict[str, Any]:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("kvtier")), "inspect", "--json", str(root)],
        capture_output=True,
        text=True,
        check=True,
    )
    (ns,) = json.loads(out.stdout)["namespaces"]
    return ns  # type: ignore[no-any-return]


def _corrupt_newest_row(root: Path, group_id: int, row_nbytes: int) -> None:
    """Flip one payload byte of the group's valid row with the highest sequence number."""
    seg = _namespace(root) / f"g{group_id}" / "0.kvrows"
    data = seg.read_bytes()
    newest: tuple[int, int] | None = None
    for off in range(HEADER_NBYTES, len(data) - row_nbytes + 1, row_nbytes):
        trailer = data[off + row_nbytes - TRAILER_NBYTES : off + row_nbytes]
        if is_blank(trailer):
            continue
        try:
            seq = decode_trailer(trailer).seq
        except ValueError:
            continue
        if newest is None or seq > newest[0]:
            newest = (seq, off)
    assert newest is not None
    with open(seg, "r+b") as f:
        f.seek(newest[1] + 100)
        byte = f.read(1)
        f.seek(newest[1] + 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _shmem_bytes() -> int:
    """The kernel's ``Shmem`` of /proc/meminfo: tmpfs files and memfd pages, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def _serve_and_kill(
    model: Path, connector: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Serve from a new process, then SIGKILL its whole process group mid-loop.

    Returns the first round, the metrics after it, and the seconds the
    group took to be gone.
    """
    steps = [GENERATE, METRICS, {"step": "loop"}]
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), _plan(model, connector, steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    lines: list[dict[str, Any]] = []
    try:
        assert proc.stdout is not None
        # Wait for the first round, its metrics and one round of the loop:
        # the loop is then serving (loads from kvtier's slots) when killed.
        while sum(1 for line in lines if line["step"] == "generate") < 2:
            raw = proc.stdout.readline()
            assert raw, "vLLM exited before serving"
            lines.extend(_lines(raw))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    t = time.monotonic()
    while True:  # the EngineCore and the worker are in the same process group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() - t < 30, "vLLM's processes outlived SIGKILL"
        time.sleep(0.1)
    run = _Run(lines)
    return run.rounds[0], [run.metrics], time.monotonic() - t


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = gemma3_270m_checkpoint()
    root = tmp_path_factory.mktemp("nvme")
    nvme = {"nvme_root": str(root), "nvme_capacity_bytes": 1 << 30, "direct_io": "off"}
    cpu_bytes = 256 << 20
    res: dict[str, Any] = {"root": root}
    res["ref"] = _serve(model, None, [GENERATE, GENERATE])
    res["kvtier"] = _serve(
        model, {"cpu_bytes": cpu_bytes, **nvme}, [GENERATE, GENERATE, RESET, GENERATE, METRICS]
    )
    res["stored"] = _inspect(root)
    shm_before, shmem_before = _shm(), _shmem_bytes()
    first, metrics, _ = _serve_and_kill(model, {"cpu_bytes": cpu_bytes, **nvme})
    res["nvme"], res["nvme_metrics"] = first, metrics[0]
    # vLLM's own message queues (multiprocessing's psm_* segments and a
    # semaphore) stay in /dev/shm after a SIGKILL; kvtier's slots are a
    # memfd, which the kernel frees with its last process.
    leaked = _shm() - shm_before
    leaked_nbytes = sum(os.stat(f"/dev/shm/{n}").st_blocks * 512 for n in leaked)
    res["shm_leaked"] = leaked
    res["shmem_kept"] = _shmem_bytes() - shmem_before - leaked_nbytes
    for n in leaked:
        os.unlink(f"/dev/shm/{n}")
    ns = _namespace(root)
    with open(ns / "lock", "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            res["lock_free"] = True
            fcntl.flock(f, fcntl.LOCK_UN)
        except BlockingIOError:
            res["lock_free"] = False
    groups = res["stored"]["groups"]
    res["corrupt_group"] = int(max(groups, key=lambda g: groups[g]["valid_rows"]))
    row_nbytes = groups[str(res["corrupt_group"])]["segments"][0]["row_nbytes"]
    _corrupt_newest_row(root, res["corrupt_group"], row_nbytes)
    res["corrupt"] = _serve(model, {"cpu_bytes": cpu_bytes, **nvme}, [GENERATE, METRICS])
    keys = sum(g["valid_rows"] for g in groups.values())
    slot_nbytes = max(s["row_nbytes"] for g in groups.values() for s in g["segments"])
    res["keys"] = keys
    res["exact"] = _serve(
        model, {"cpu_bytes": keys * slot_nbytes}, [GENERATE, RESET, GENERATE, METRICS]
    )
    return res


def test_outputs_with_kvtier_equal_outputs_without_a_connector(scenario: dict[str, Any]) -> None:
    ref, kv = scenario["ref"], scenario["kvtier"]
    assert _cached(kv.rounds[0]) == _cached(ref.rounds[0])
    assert _close(kv.rounds[0], ref.rounds[0]) < LOGPROB_TOL
    assert _close(kv.rounds[1], ref.rounds[1]) < LOGPROB_TOL


def test_after_reset_prefix_cache_prompts_are_served_from_cpu_slots(
    scenario: dict[str, Any],
) -> None:
    kv = scenario["kvtier"]
    _cold, gpu_cached, from_kvtier = kv.rounds
    assert all(n > 0 for n in _cached(from_kvtier))
    # Same split as vLLM's own prefix cache, and bit for bit the same outputs.
    assert _cached(from_kvtier) == _cached(gpu_cached)
    assert from_kvtier == gpu_cached
    assert _close(from_kvtier, scenario["ref"].rounds[1]) < LOGPROB_TOL
    assert kv.metric("vllm:kvtier_offload_hits{tier=cpu}") > 0
    assert kv.metric("vllm:kvtier_offload_hits{tier=nvme}") == 0
    assert kv.metric("vllm:kv_offload_load_bytes{}") > 0
    assert kv.metric("vllm:kvtier_offload_nvme_bytes{direction=write}") > 0


def test_a_new_process_is_served_from_nvme_rows(scenario: dict[str, Any]) -> None:
    gpu_cached = scenario["kvtier"].rounds[1]
    nvme = scenario["nvme"]
    assert all(n > 0 for n in _cached(nvme))
    assert _cached(nvme) == _cached(gpu_cached)
    assert nvme == gpu_cached  # tokens and logprobs, exactly
    m = scenario["nvme_metrics"]
    assert m.get("vllm:kvtier_offload_hits{tier=nvme}", 0) > 0
    assert m.get("vllm:kvtier_offload_nvme_bytes{direction=read}", 0) > 0
    assert m.get("vllm:kvtier_offload_nvme_failures{}", 0) == 0


def test_sigkill_leaves_no_shared_memory_or_lock_and_rows_are_reused(
    scenario: dict[str, Any],
) -> None:
    # The killed process had read its rows into kvtier's slots (well over
    # 8 MiB of shared pages); none of them is left, in a file or a memfd.
    assert scenario["nvme_metrics"]["vllm:kvtier_offload_nvme_bytes{direction=read}"] > 16 << 20
    assert scenario["shmem_kept"] < 8 << 20
    assert not [n for n in scenario["shm_leaked"] if "kvtier" in n]
    assert scenario["lock_free"]
    after = scenario["corrupt"].rounds[0]
    assert any(n > 0 for n in _cached(after))
    assert scenario["corrupt"].metric("vllm:kvtier_offload_hits{tier=nvme}") > 0


def test_a_corrupt_row_is_recomputed_counted_and_does_not_stop_vllm(
    scenario: dict[str, Any],
) -> None:
    run = scenario["corrupt"]
    (outputs,) = run.rounds  # every prompt answered: the engine did not stop
    assert run.metric("vllm:kvtier_offload_nvme_failures{}") == 1
    served = _cached(scenario["nvme"])
    assert all(a <= b for a, b in zip(_cached(outputs), served, strict=True))
    assert sum(_cached(outputs)) < sum(served)  # the corrupt row's prefix was recomputed
    assert _close(outputs, scenario["ref"].rounds[1]) < LOGPROB_TOL


def test_n_slots_hold_n_keys_of_any_mix_of_gemma3_groups(scenario: dict[str, Any]) -> None:
    stored = scenario["stored"]["groups"]
    assert len(stored) == 6
    assert all(g["valid_rows"] > 0 for g in stored.values())
    run = scenario["exact"]
    _cold, from_kvtier = run.rounds
    gpu_cached = scenario["kvtier"].rounds[1]
    # As many slots as keys: every key stayed, so the prompts hit as far as
    # with 256 MiB of slots, and every slot is in use.
    assert _cached(from_kvtier) == _cached(gpu_cached)
    assert from_kvtier == gpu_cached
    assert run.metric("vllm:kvtier_offload_cpu_slots_used_perc{}") == 1.0
    assert run.metric("vllm:kvtier_offload_hits{tier=cpu}") == scenario["kvtier"].metric(
        "vllm:kvtier_offload_hits{tier=cpu}"
    )
