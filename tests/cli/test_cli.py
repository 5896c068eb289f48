"""Smoke tests of the command line, each in a subprocess, as an operator runs it."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .cli_runs import kvtier

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layout", ["gemma-3-270m", "qwen3-next"])
def test_bench_tiny_size_reports_every_phase_and_cleans_up(tmp_path: Path, layout: str) -> None:
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    res = kvtier(
        "bench",
        "--layout",
        layout,
        "--size",
        "24M",
        "--repeat",
        "1",
        "--blocks-per-chunk",
        "4",
        "--inflight-batches",
        "2",
        "--json",
        str(out),
        "--plot",
        str(plot),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "nvme_write" in res.stdout
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert set(phases) == {
        "store",
        "load",
        "nvme_write",
        "nvme_write_full",
        "nvme_write_e2e",
        "nvme_read",
    }
    for p in phases.values():
        assert p["gbps"] > 0
        assert p["p99_ms"] >= p["p50_ms"] > 0, p
        # the table prints every latency with three decimals (its columns line up)
        assert f"{p['p50_ms']:.3f}" in res.stdout
        assert f"{p['p99_ms']:.3f}" in res.stdout
    for name in ("nvme_write", "nvme_write_e2e", "nvme_read"):
        assert phases[name]["ratio_vs_raw_sequential"] > 0
        assert phases[name]["raw_checksummed_gbps"] > 0
        assert phases[name]["ratio_vs_raw_checksummed"] > 0
    assert "raw_checksummed" in res.stdout
    assert phases["nvme_write_full"]["ratio_vs_raw_rewrite"] > 0
    assert phases["nvme_write_full"]["ratio_vs_raw_rewrite_xxh3"] > 0
    assert phases["nvme_write_full"]["bytes"] == phases["nvme_write"]["bytes"]
    assert "raw_rewrite_xxh3" in res.stdout
    for name in ("store", "load"):
        assert phases[name]["pipelined"]["ratio_vs_plain_copy"] > 0
    assert result["config"]["inflight_batches"] == 2
    assert phases["nvme_read"]["ratio_vs_file_per_chunk"] > 0
    assert phases["nvme_read"]["cold_load"]["ratio_vs_raw_sequential"] > 0
    assert "cold_load" in res.stdout
    assert result["io"]["verified_repeats"] == 1
    assert result["io"]["tmpdir_removed"] is True
    assert result["config"]["gc_freeze"] is True
    assert result["gc_frozen_objects"] > 10_000  # torch alone leaves ~165k objects
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p for p in tmp_path.iterdir() if p.name.startswith("kvtier-bench-")] == []


def test_bench_json_layout_file(tmp_path: Path) -> None:
    spec = {
        "name": "custom",
        "dtype": "float16",
        "tokens_per_block": 8,
        "layers": [
            {"kind": "full", "page_shape": [2, 8, 2, 64]},
            {"kind": "sliding", "page_shape": [2, 8, 2, 64]},
        ],
    }
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(spec))
    out = tmp_path / "bench.json"
    res = kvtier(
        "bench", "--layout", str(path), "--size", "4M", "--repeat", "1", "--no-nvme",
        "--no-gc-freeze", "--json", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "custom" in res.stdout
    result = json.loads(out.read_text())
    assert result["config"]["gc_freeze"] is False
    assert result["gc_frozen_objects"] == 0


@pytest.mark.parametrize(("nvme", "repeat"), [(False, 1), (True, 2)])
async def test_the_progress_bar_total_is_the_number_of_steps_the_bench_reports(
    tmp_path: Path, nvme: bool, repeat: int
) -> None:
    from kvtier.bench import BenchConfig, bench_steps, run_bench

    cfg = BenchConfig(
        size_bytes=2 << 20, repeat=repeat, nvme=nvme, device="cpu", root=str(tmp_path),
        direct_io="off",
    )  # fmt: skip
    steps: list[str] = []
    await run_bench(cfg, progress=steps.append)
    assert len(steps) == bench_steps(cfg)
    assert len(set(steps)) == len(steps)  # every step says which one it is
    per_repeat = [sum(f"repeat {r + 1}/{repeat}" in s for s in steps) for r in range(repeat)]
    assert per_repeat == [(len(steps) - 3) // repeat] * repeat


async def test_run_bench_freezes_its_set_up_heap_only_for_the_phases() -> None:
    from kvtier.bench import BenchConfig, run_bench

    cfg = BenchConfig(size_bytes=2 << 20, repeat=1, nvme=False, device="cpu")
    assert gc.get_freeze_count() == 0
    result = await run_bench(cfg)
    assert result["gc_frozen_objects"] > 10_000
    assert gc.get_freeze_count() == 0  # unfrozen again
    gc.freeze()  # a caller that froze its heap itself: left as it is
    try:
        frozen = gc.get_freeze_count()
        result = await run_bench(cfg)
        # Frozen objects still die by reference counting, so the count can only
        # fall; a second freeze by the bench would add its set-up heap to it.
        assert frozen // 2 < result["gc_frozen_objects"] <= frozen
        assert frozen // 2 < gc.get_freeze_count() <= frozen  # still frozen, nothing added
    finally:
        gc.unfreeze()


def test_bench_rejects_bad_options(tmp_path: Path) -> None:
    assert kvtier("bench", "--size", "lots", cwd=tmp_path).returncode != 0
    res = kvtier("bench", "--layout", "no-such-model", "--size", "1M", cwd=tmp_path)
    assert res.returncode != 0
    assert "unknown layout" in res.stderr
    res = kvtier("bench", "--dir", str(tmp_path / "missing"), "--size", "1M", cwd=tmp_path)
    assert res.returncode == 2
    assert "does not exist" in res.stderr
    assert "Traceback" not in res.stderr


def test_roundtrip_unknown_model_is_a_usage_error(tmp_path: Path) -> None:
    res = kvtier("roundtrip", "--model", "gemma-3-270m", cwd=tmp_path)
    assert res.returncode == 2
    assert "unknown model 'gemma-3-270m'" in res.stderr
    assert "gemma3-270m" in res.stderr
    assert "Traceback" not in res.stderr


def test_inspect_of_a_folder_without_namespaces_says_so(tmp_path: Path) -> None:
    (tmp_path / "some-folder").mkdir()
    res = kvtier("inspect", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 1
    assert "no kvtier namespace folder" in res.stderr
    assert "some-folder" not in res.stdout


def test_bench_on_the_aio_backend_verifies_every_byte(tmp_path: Path) -> None:
    from kvtier.io._aio import aio_supported

    if not aio_supported():
        pytest.skip("no Linux AIO context here")
    out = tmp_path / "bench.json"
    res = kvtier(
        "bench", "--io-backend", "aio", "--direct-io", "on", "--size", "24M", "--repeat", "1",
        "--json", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["io"]["backend"] == "AioRowIO"
    assert result["io"]["verified_repeats"] == 1  # store -> NVMe -> load compared bitwise
    assert result["phases"]["nvme_write"]["ratio_vs_raw_sequential"] > 0
    assert result["phases"]["nvme_write"]["ratio_vs_raw_checksummed"] > 0
    assert result["phases"]["nvme_read"]["ratio_vs_raw_checksummed"] > 0


def test_bench_without_nvme_reports_no_nvme_figures(tmp_path: Path) -> None:
    res = kvtier("bench", "--no-nvme", "--size", "16M", "--repeat", "1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "scheduling overhead" in res.stdout
    assert "event-loop lag" not in res.stdout
    assert "nvme_write" not in res.stdout


def _store_rows(root: Path) -> None:
    """An engine in a child process stores 5 keys (3 in group 0, 2 in group 1) under ``root``."""
    code = textwrap.dedent(
        """
        import asyncio, sys, torch, kvtier

        async def main(root):
            a = torch.ones(8, 4096, dtype=torch.uint8)
            b = torch.ones(8, 1024, dtype=torch.uint8)
            layout = kvtier.KVLayout.from_tensors({0: {"a": a}, 1: {"b": b}})
            nv = kvtier.NVMeConfig(
                root=root, capacity_bytes=1 << 24, namespace="ns1", segment_nbytes=1 << 20
            )
            async with kvtier.TransferEngine(layout, kvtier.EngineConfig(1 << 20, 2, nvme=nv)) as e:
                keys = [kvtier.OffloadKey(bytes([i + 1]), i % 2) for i in range(5)]
                await e.store([kvtier.Chunk(k, [i]) for i, k in enumerate(keys)], durable=True)

        asyncio.run(main(sys.argv[1]))
        """
    )
    subprocess.run([sys.executable, "-c", code, str(root)], check=True, timeout=120, cwd=REPO)


def test_inspect_lists_namespaces_and_rows(tmp_path: Path) -> None:
    _store_rows(tmp_path)
    res = kvtier("inspect", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "namespace=ns1" in res.stdout
    assert "g0: " in res.stdout
    info = json.loads(kvtier("inspect", str(tmp_path), "--json", cwd=tmp_path).stdout)
    (ns,) = info["namespaces"]
    assert ns["locked_by_pid"] is None  # the engine closed: no live holder
    assert ns["groups"]["0"]["valid_rows"] == 3
    assert ns["groups"]["1"]["valid_rows"] == 2
    g0 = ns["groups"]["0"]
    assert 3 <= g0["allocated_rows"] <= g0["rows"]
    assert f"g0: {g0['allocated_rows']} rows allocated, 3 valid, 0 invalid, in " in res.stdout
    # one line per namespace tells formats apart: layers, dtype, page shape and row size
    row0, row1 = ns["format"]["row_nbytes"]["0"], ns["format"]["row_nbytes"]["1"]
    assert (
        f"format: g0: 1 x uint8 [4096], rows of {row0} B; g1: 1 x uint8 [1024], rows of {row1} B;"
        in res.stdout
    )
    assert ns["last_written"] is not None
    written = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ns["last_written"]))
    assert f"rows last written {written}" in res.stdout
    assert "held by no engine" in res.stdout
    assert ns["disk_nbytes"] > 0
    assert f"{ns['disk_nbytes'] / 2**20:.1f} MiB on disk" in res.stdout
    assert f"can grow to {g0['rows']} rows" in res.stdout


async def test_inspect_of_a_folder_whose_engine_wrote_nothing_says_no_valid_rows(
    tmp_path: Path,
) -> None:
    import torch

    import kvtier as kv  # ``kvtier`` is this module's CLI runner

    layout = kv.KVLayout.from_tensors({0: {"a": torch.ones(8, 4096, dtype=torch.uint8)}})
    nv = kv.NVMeConfig(root=tmp_path, capacity_bytes=1 << 24, namespace="idle")
    async with kv.TransferEngine(layout, kv.EngineConfig(1 << 20, 2, nvme=nv)):
        pass  # its start created the first segment file: the folder looks recently written
    res = kvtier("inspect", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "namespace=idle" in res.stdout
    assert "; no valid rows (segment files last changed 20" in res.stdout
    assert "rows last written" not in res.stdout


def test_remove_asks_refuses_a_held_namespace_and_frees_it_once_released(
    tmp_path: Path,
) -> None:
    import fcntl

    _store_rows(tmp_path)
    (name,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("ns1-")]
    res = kvtier("remove", str(tmp_path), name, cwd=tmp_path)  # no --yes, no answer
    assert res.returncode == 1
    assert "nothing removed (answer y, or pass --yes)" in res.stderr
    assert (tmp_path / name / "format.json").is_file()
    fd = os.open(tmp_path / name / "lock", os.O_RDWR)  # this process plays a live engine
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        res = kvtier("remove", str(tmp_path), name, "--yes", cwd=tmp_path)
        assert res.returncode == 1
        assert f"held by a live engine (pid {os.getpid()})" in res.stderr
        assert (tmp_path / name / "format.json").is_file()
    finally:
        os.close(fd)
    res = kvtier("remove", str(tmp_path), name, "--yes", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"removed {name}:" in res.stdout
    assert list(tmp_path.iterdir()) == []
    res = kvtier("remove", str(tmp_path), "../etc", "--yes", cwd=tmp_path)
    assert res.returncode == 1
    assert "expected the name of a namespace directory" in res.stderr
    res = kvtier("remove", str(tmp_path), name, "--yes", cwd=tmp_path)  # removed already
    assert res.returncode == 1
    assert f"no folder '{name}' under {tmp_path}" in res.stderr


def test_remove_refuses_a_held_folder_before_asking(tmp_path: Path) -> None:
    import fcntl

    _store_rows(tmp_path)
    (name,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("ns1-")]
    fd = os.open(tmp_path / name / "lock", os.O_RDWR)  # this process plays a live engine
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        res = kvtier("remove", str(tmp_path), name, cwd=tmp_path, input="y\n")
    finally:
        os.close(fd)
    assert res.returncode == 1
    assert "[y/N]" not in res.stdout  # no question about a folder it cannot remove
    assert f"held by a live engine (pid {os.getpid()})" in res.stderr
    assert (tmp_path / name / "format.json").is_file()
    res = kvtier("remove", str(tmp_path), name, cwd=tmp_path, input="y\n")
    assert res.returncode == 0, res.stderr
    assert "[y/N]: \nremoved " in res.stdout  # the piped answer ends the prompt's line


def test_remove_given_the_namespace_label_names_its_folders(tmp_path: Path) -> None:
    _store_rows(tmp_path)
    (name,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("ns1-")]
    res = kvtier("remove", str(tmp_path), "ns1", "--yes", cwd=tmp_path)
    assert res.returncode == 1
    assert f"no folder 'ns1' under {tmp_path}" in res.stderr
    assert f"the folders of namespace 'ns1' are: {name}" in res.stderr
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "format.json").write_text('{"namespace": "a/b"}')
    (tmp_path / "a_b-0123456789abcdef").mkdir()  # the folder name's first part, given alone
    res = kvtier("remove", str(tmp_path), "a_b", "--yes", cwd=tmp_path)
    assert res.returncode == 1
    assert "folders whose name starts so: a_b-0123456789abcdef" in res.stderr
    assert (tmp_path / name / "format.json").is_file()
    res = kvtier("remove", str(tmp_path), name, cwd=tmp_path, input="y\n")  # piped answer
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize(
    "moment",
    [
        "kvtier-bench-*/tier*",  # in the NVMe phases
        "kvtier-bench-*/files/*",  # the file-per-chunk baseline writing on its threads
    ],
)
def test_bench_stopped_by_sigterm_removes_its_directory(tmp_path: Path, moment: str) -> None:
    """SIGTERM cancels the run at an await; the baseline threads end before the cleanup.

    (A KeyboardInterrupt raised by the signal handler once hung the run, and a
    baseline thread still writing recreated the removed folder.)
    """
    with subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "bench", "--size", "128M", "--repeat", "20"],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    ) as proc:
        deadline = time.monotonic() + 120
        try:
            while not list(tmp_path.glob(moment)):
                assert proc.poll() is None, "bench ended before its NVMe phases"
                assert time.monotonic() < deadline, "the NVMe phases never started"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 1
    assert "Aborted!" in err.decode()
    assert "Traceback" not in err.decode()
    assert list(tmp_path.iterdir()) == []


def test_the_table_caption_names_a_size_below_one_mib_in_kib() -> None:
    from kvtier.bench.report import format_size

    assert format_size(1024) == "1 KiB"  # was "0 MiB" in the caption of `--size 1K`
    assert format_size(1536) == "1.5 KiB"
    assert format_size(24 << 20) == "24 MiB"
    assert format_size(3 << 30) == "3 GiB"
    assert format_size(100) == "100 bytes"
