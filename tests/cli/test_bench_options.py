"""``kvtier bench`` as an operator drives it: options, layouts, paths, signals.

Bad input must end in a one-line error and a non-zero exit before the long
work (allocating the data set, the timed phases) starts, with no traceback
and no temporary folder left behind; a good run must report every figure
the README lists and verify every byte. A test whose docstring starts with
"Regression:" guards against a bug the bench once had; the docstring says
what must hold and how it failed.

Failing cases run in-process through click's ``CliRunner`` (fast: no
``import torch`` per case); a spy on ``ModelShape.build`` (it still builds)
tells whether the data set was allocated before the error. Runs that an
operator would see end to end, signals, memory limits and private mounts run
in a subprocess, as ``test_cli.py`` does.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvtier._shapes import ModelShape
from kvtier.cli import main

from .cli_runs import bench_on_tmpfs, kvtier, needs_mount

TINY = ("--size", "4M", "--repeat", "1")


def _bench_in_process(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Result, list[int]]:
    """``kvtier bench ARGS`` through CliRunner; also the ``num_blocks`` of every data set built."""
    built: list[int] = []
    real_build = ModelShape.build

    def spy(self: ModelShape, num_blocks: int, device: Any = "cpu") -> Any:
        built.append(num_blocks)
        return real_build(self, num_blocks, device)

    monkeypatch.setattr(ModelShape, "build", spy)
    return CliRunner().invoke(main, ["bench", *args]), built


def _clean_error(res: Result, *needles: str) -> None:
    """A click error (exit 1 or 2, ``Error: ...``), not an escaped exception."""
    assert isinstance(res.exception, SystemExit), (
        f"escaped {type(res.exception).__name__}: {res.exception}"
    )
    assert res.exit_code in (1, 2), res.output
    assert "Error:" in res.output, res.output
    for needle in needles:
        assert needle in res.output, res.output


def _limited_memory() -> None:  # preexec_fn: a huge allocation fails instead of swapping/OOM
    resource.setrlimit(resource.RLIMIT_AS, (24 << 30, 24 << 30))


def _kvtier_limited(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=_limited_memory,
    )


def _no_bench_dirs(*folders: Path) -> None:
    for folder in folders:
        assert [p.name for p in folder.iterdir() if p.name.startswith("kvtier-bench-")] == []


# --- options rejected up front ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--size", "0"), "must be positive"),
        (("--size", "0.5"), "must be positive"),
        (("--size", "-1"), "is not a size"),
        (("--size", "1P"), "is not a size"),
        (("--size", "1e9"), "is not a size"),
        (("--size", ""), "is not a size"),
        (("--request-size", "1000"), "multiple of 4 KiB"),
        (("--request-size", "0"), "must be positive"),
        (("--repeat", "0"), "--repeat"),
        (("--blocks-per-chunk", "0"), "--blocks-per-chunk"),
        (("--batch-chunks", "0"), "--batch-chunks"),
        (("--io-threads", "-1"), "--io-threads"),
        (("--inflight-batches", "0"), "--inflight-batches"),
        (("--tokens-per-block", "0"), "--tokens-per-block"),
        (("--io-backend", "nonsense"), "--io-backend"),
        (("--direct-io", "maybe"), "--direct-io"),
        (("--block-order", "backwards"), "--block-order"),
    ],
)
def test_bad_option_values_are_usage_errors_before_anything_is_built(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], needle: str
) -> None:
    res, built = _bench_in_process(monkeypatch, *args)
    _clean_error(res, needle)
    assert res.exit_code == 2
    assert built == []


@pytest.mark.parametrize("option", ["--size", "--request-size"])
def test_a_bad_size_names_its_option(monkeypatch: pytest.MonkeyPatch, option: str) -> None:
    """Regression: a parse_size error names the option that was bad."""
    res, _ = _bench_in_process(monkeypatch, option, "0")
    _clean_error(res)
    assert option in res.output  # not only "Invalid value: '0': the size must be positive"


@pytest.mark.parametrize("size", ["4KiB", "4kb", "1.5M", " 2 m ", "3000"])
def test_size_suffixes_are_binary_units(size: str) -> None:
    from kvtier.cli import parse_size

    want = {"4KiB": 4096, "4kb": 4096, "1.5M": 3 << 19, " 2 m ": 2 << 20, "3000": 3000}[size]
    assert parse_size(size) == want


# --- output paths: checked before the run, not after it ---------------------------------


@pytest.mark.parametrize("where", ["a directory", "a missing folder"])
def test_an_unwritable_json_path_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Regression: --json is checked before the run; a bad path is a one-line error,
    not a traceback after the whole run."""
    path = tmp_path if where == "a directory" else tmp_path / "missing" / "out.json"
    res, built = _bench_in_process(monkeypatch, *TINY, "--no-nvme", "--json", str(path))
    _clean_error(res, "--json")
    assert built == []  # refused before the data set is allocated


@pytest.mark.parametrize("where", ["a missing folder", "a directory", "an unknown format"])
def test_a_bad_plot_path_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Regression: --plot's path is checked before the run, not only whether
    matplotlib is there (and not first used after the whole run)."""
    plots = tmp_path / "plots"
    plots.mkdir()
    path = {
        "a missing folder": tmp_path / "missing" / "p.png",
        "a directory": plots,  # must not exit 0 with a PNG written next to it as plots.png
        "an unknown format": tmp_path / "p.txt",
    }[where]
    res, built = _bench_in_process(monkeypatch, *TINY, "--no-nvme", "--plot", str(path))
    _clean_error(res, "--plot")
    assert built == []
    assert not (tmp_path / "plots.png").exists()


def test_plot_without_matplotlib_is_refused_before_the_run(tmp_path: Path) -> None:
    """A stand-in ``matplotlib`` package that fails to import plays 'not installed'."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(fake)}
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", *TINY, "--plot", str(tmp_path / "p.png")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-2000:]
    assert "--plot needs matplotlib" in res.stderr
    assert "Traceback" not in res.stderr
    assert res.stdout == ""  # no table: nothing ran
    assert time.monotonic() - t0 < 60
    _no_bench_dirs(tmp_path)


# --- I/O backend and direct I/O ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--io-backend", "kvikio"), "kvikio"),  # no CUDA driver on this machine
        (("--io-backend", "aio", "--direct-io", "off"), "O_DIRECT"),  # contradictory
    ],
)
def test_an_unusable_io_backend_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], needle: str
) -> None:
    """Regression: the backend is checked before the run, not first in the NVMe
    phases (after the data set is built and the copy phases ran)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("kvikio may load here")
    res, built = _bench_in_process(monkeypatch, *TINY, "--dir", str(tmp_path), *args)
    _clean_error(res, needle)
    _no_bench_dirs(tmp_path)
    assert built == []  # refused before the data set is allocated


def test_kvikio_is_not_needed_without_nvme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res, built = _bench_in_process(
        monkeypatch, "--size", "1", "--repeat", "1", "--no-nvme", "--io-backend", "kvikio"
    )
    assert res.exit_code == 0, res.output
    assert built[0] == 16  # the data set (the scheduling-overhead pass builds its own)


# --- layout files ----------------------------------------------------------------------


def _layout_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "layout.json"
    path.write_text(text)
    return str(path)


def _one_layer(**fields: Any) -> str:
    layer = {"kind": "full", "page_shape": [2, 16]} | fields.pop("layer", {})
    return json.dumps({"layers": [layer], **fields})


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("not json", "Expecting value"),
        ("[1, 2]", "layout file"),
        ('{"name": "x"}', "layout file"),  # no layers
        (_one_layer(layer={"page_shape": 7}), "layout file"),
        (_one_layer(dtype="no_such_dtype"), "layout file"),
        (_one_layer(tokens_per_block="many"), "layout file"),
        (_one_layer(tokens_per_block=0), "tokens_per_block"),
        (_one_layer(tokens_per_block=-3), "tokens_per_block"),
    ],
)
def test_malformed_layout_files_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, needle: str
) -> None:
    res, _ = _bench_in_process(monkeypatch, "--layout", _layout_file(tmp_path, text), *TINY)
    _clean_error(res, needle)


@pytest.mark.parametrize(
    "text",
    [
        _one_layer(layer={"page_shape": [0, 16]}),  # ZeroDivisionError
        _one_layer(layer={"page_shape": [-2, 16]}),  # RuntimeError: negative dimension
        _one_layer(layer={"page_shape": [2.5, 16]}),  # TypeError in torch.empty
        _one_layer(layer={"page_shape": "abc"}),  # TypeError in math.prod
        _one_layer(layer={"kind": ["full"]}),  # TypeError: unhashable type: 'list'
        json.dumps({"layers": []}),  # ZeroDivisionError
        _one_layer(dtype="cuda"),  # a torch attribute that is no dtype
    ],
    ids=["zero-dim", "negative-dim", "float-dim", "string-shape", "list-kind", "no-layers",
         "non-dtype"],
)  # fmt: skip
def test_layout_files_with_bad_values_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    """Regression: model_shape() checks a layout file's values, not only that it parses;
    a bad value is a one-line error, not a traceback in block_nbytes()/build()/groups()."""
    res, built = _bench_in_process(
        monkeypatch, "--layout", _layout_file(tmp_path, text), *TINY, "--no-nvme"
    )
    _clean_error(res, "layout file")
    assert built == []


def test_a_layout_file_runs_every_nvme_phase_and_verifies_it(tmp_path: Path) -> None:
    """The README's JSON form, through the NVMe phases (test_cli.py runs it with --no-nvme)."""
    spec = {
        "name": "custom-nvme",
        "dtype": "float16",
        "tokens_per_block": 8,
        "layers": [{"kind": "full", "page_shape": [2, 8, 2, 64]}] * 2
        + [{"kind": "mamba", "page_shape": [3000]}] * 4,  # groups of 2 layers: 1 + 2
    }
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps(spec))
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "bench.json"
    res = kvtier(
        "bench", "--layout", str(layout), "--size", "1M", "--repeat", "1",
        "--blocks-per-chunk", "3", "--direct-io", "off", "--dir", str(work),
        "--json", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["layout"]["name"] == "custom-nvme"
    assert result["layout"]["groups"] == 3
    assert result["io"]["direct_io"] is False
    assert result["io"]["verified_repeats"] == 1
    assert result["io"]["tmpdir_removed"] is True
    assert Path(result["io"]["tmpdir"]).parent == work  # --dir was used ...
    assert list(work.iterdir()) == []  # ... and left empty
    _no_bench_dirs(tmp_path)


# --- sizes beyond the machine -----------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "size"),
    [
        ({"layers": [{"kind": "full", "page_shape": [1024]}]}, "1T"),  # --size too large
        ({"layers": [{"kind": "full", "page_shape": [1 << 40]}]}, "4M"),  # one block too large
    ],
    ids=["size-1T", "huge-page"],
)
def test_a_data_set_beyond_memory_is_a_one_line_error(
    tmp_path: Path, layout: dict[str, Any], size: str
) -> None:
    """Regression: --size is checked against memory; the allocation error does not
    escape as a traceback."""
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(layout))
    res = _kvtier_limited(
        "bench", "--layout", str(path), "--size", size, "--repeat", "1", cwd=tmp_path
    )
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "Error:" in res.stderr
    _no_bench_dirs(tmp_path)


def test_batch_chunks_larger_than_the_data_set_still_runs(tmp_path: Path) -> None:
    """Regression: the torch-gather baseline sizes its region by the chunks there are,
    not by --batch-chunks (bench/copy_phases.py run_copy_phases), so a large --batch-chunks does not
    fail with ENOMEM."""
    res = _kvtier_limited("bench", *TINY, "--no-nvme", "--batch-chunks", "100000", cwd=tmp_path)
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.returncode == 0
    assert "scheduling overhead" in res.stdout


# --- the folder the bench writes in ------------------------------------------------------


@needs_mount
def test_dir_on_a_read_only_filesystem_is_a_usage_error(tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    rc, out, err, _left = bench_on_tmpfs(mnt, "size=8m,ro", f"--dir {mnt} --size 1M", False)
    assert rc == 2, err
    assert "is not writable" in err
    assert "Traceback" not in err
    assert out == ""


@needs_mount
def test_a_read_only_current_folder_is_refused_before_the_run(tmp_path: Path) -> None:
    """Regression: without --dir the current folder is checked before the run, so
    mkdtemp does not fail after the copy phases with a traceback
    (bench/nvme_phases.py run_nvme_phases)."""
    rc, _out, err, _left = bench_on_tmpfs(tmp_path / "ro", "size=8m,ro", "--size 4M --repeat 1")
    assert rc in (1, 2), err
    assert "Traceback" not in err, err[-2000:]
    assert "Error:" in err


@needs_mount
def test_a_disk_too_small_for_the_data_set_is_a_one_line_error(tmp_path: Path) -> None:
    """Regression: free space is checked before the run; ENOSPC does not escape from
    the raw baseline as a traceback after the copy phases."""
    rc, _out, err, left = bench_on_tmpfs(
        tmp_path / "small", "size=8m", "--size 16M --repeat 1 --direct-io off"
    )
    assert left == []  # the temporary folder is removed
    assert rc == 1, err
    assert "Traceback" not in err, err[-2000:]
    assert "space" in err


# --- signals ----------------------------------------------------------------------------


def _start_bench_and_wait(cwd: Path, moment: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "bench", "--size", "32M", "--repeat", "5"],
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 90
    while not glob.glob(str(cwd / moment)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the bench never reached its NVMe phases")
        time.sleep(0.01)
    return proc


def test_one_ctrl_c_in_the_nvme_phases_aborts_and_removes_the_folder(tmp_path: Path) -> None:
    proc = _start_bench_and_wait(tmp_path, "kvtier-bench-*/tier*")
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "Aborted!" in err.decode()
    assert "Traceback" not in err.decode()
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_pressed_repeatedly_still_removes_the_folder(tmp_path: Path) -> None:
    """Regression: SIGINT, like SIGTERM, cancels through the loop (cli.py _stoppable);
    a second Ctrl-C does not raise KeyboardInterrupt inside the cleanup and leave
    kvtier-bench-*/ with raw.bin."""
    proc = _start_bench_and_wait(tmp_path, "kvtier-bench-*/tier*")
    try:
        for _ in range(400):  # an operator holding Ctrl-C until it stops
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGINT)
            time.sleep(0.005)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert list(tmp_path.iterdir()) == []  # no kvtier-bench-*/ with raw.bin and tier0/


# --- every built-in layout end to end ---------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "extra", "groups"),
    [
        ("llama-3-8b", ("--io-threads", "1", "--batch-chunks", "1", "--inflight-batches", "1"), 1),
        ("deepseek-v3", ("--block-order", "sequential", "--request-size", "4K"), 1),
        ("deepseek-v3.2", ("--tokens-per-block", "64"), 2),  # MLA + indexer
    ],
)
def test_builtin_layout_reports_every_readme_figure(
    tmp_path: Path, layout: str, extra: tuple[str, ...], groups: int
) -> None:
    out = tmp_path / "bench.json"
    res = kvtier(
        "bench", "--layout", layout, "--size", "1", "--blocks-per-chunk", "2", "--repeat", "1",
        *extra, "--json", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["layout"] == r["layout"] | {"name": layout, "groups": groups, "num_blocks": 2}
    assert {"config", "date", "machine", "layout", "io", "gc_frozen_objects", "phases",
            "scheduling_overhead_us_per_chunk", "loop_lag_p99_ms"} <= set(r)  # fmt: skip
    assert r["config"]["layout"] == layout
    assert r["config"]["size_bytes"] == 1
    for opt in ("io_threads", "batch_chunks", "inflight_batches"):
        if f"--{opt.replace('_', '-')}" in extra:
            assert r["config"][opt] == 1
    ph = r["phases"]
    for name in ("store", "load"):
        p = ph[name]
        assert p["gbps"] > 0
        assert p["p99_ms"] >= p["p50_ms"] > 0
        for b in ("plain_copy", "torch_gather"):
            assert p[f"{b}_gbps"] > 0
            assert p[f"ratio_vs_{b}"] > 0
        assert p["pipelined"]["gbps"] > 0
    row_bases = ("raw_sequential", "raw_checksummed", "file_per_chunk")
    for name, bases in (("nvme_write", row_bases), ("nvme_write_e2e", row_bases[:2]),
                        ("nvme_read", row_bases)):  # fmt: skip
        p = ph[name]
        assert p["bytes"] % 4096 == 0
        assert p["bytes"] > ph["store"]["bytes"]
        assert p["gbps"] > 0
        assert p["p99_ms"] >= p["p50_ms"] > 0
        assert {f"{b}_gbps" for b in bases} <= set(p)
        assert all(p[f"ratio_vs_{b}"] > 0 for b in bases)
    assert "file_per_chunk_gbps" not in ph["nvme_write_e2e"]
    assert ph["nvme_read"]["cold_load"]["ratio_vs_raw_sequential"] > 0
    assert set(r["scheduling_overhead_us_per_chunk"]) == {"store", "load"}
    assert r["loop_lag_p99_ms"] >= 0
    assert r["io"]["verified_repeats"] == 1
    assert r["io"]["tmpdir_removed"] is True
    assert r["io"]["backend"] == "PosixRowIO"
    for text in ("nvme_write_e2e", "cold_load", "file_per_chunk", "event-loop lag"):
        assert text in res.stdout
    _no_bench_dirs(tmp_path)


# --- the byte check ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout", ["gemma-3-270m", "llama-3-8b", "deepseek-v3", "deepseek-v3.2", "qwen3-next"]
)
def test_a_load_that_moves_a_wrong_byte_fails_the_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Fault injection: the engine's load flips one byte of one block it loaded."""
    import torch

    import kvtier
    from kvtier.bench import BenchConfig, run_bench

    layouts: list[Any] = []
    real_build, real_load = ModelShape.build, kvtier.TransferEngine.load

    def build(self: ModelShape, num_blocks: int, device: Any = "cpu") -> Any:
        layouts.append(real_build(self, num_blocks, device))
        return layouts[-1]

    async def bad_load(self: Any, chunks: Any) -> Any:
        res = await real_load(self, chunks)
        c = chunks[-1]
        piece = layouts[0].group(c.key.group_id).layers[-1].pieces[0].view
        piece[c.block_ids[0]].view(torch.uint8).view(-1)[7] ^= 0x10
        return res

    monkeypatch.setattr(ModelShape, "build", build)
    monkeypatch.setattr(kvtier.TransferEngine, "load", bad_load)
    cfg = BenchConfig(
        layout=layout, size_bytes=1, blocks_per_chunk=1, repeat=1, device="cpu",
        root=str(tmp_path), direct_io="off",
    )  # fmt: skip
    with pytest.raises(AssertionError, match="changed bytes"):
        asyncio.run(run_bench(cfg))
    assert list(tmp_path.iterdir()) == []


def test_every_check_compares_with_the_bytes_the_bench_generated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: every check compares with the digests of the bytes the bench
    generated. (The torch_gather load baseline, _torch_gather in run_copy_phases, once
    wrote the last batch's slots into every batch's blocks, and the NVMe check
    compared with that cache: chunks at one batch position held the same bytes.)"""
    from kvtier._shapes import model_shape
    from kvtier.bench import BenchConfig, copy_phases, data, nvme_phases, run_bench

    seen: list[tuple[int, list[int]]] = []
    real = data.layout_digests

    def digests(layout: Any) -> list[int]:  # every digest a check takes
        seen.append((layout.group(0).num_blocks, real(layout)))
        return seen[-1][1]

    for module in (copy_phases, nvme_phases):  # the modules whose checks call it
        monkeypatch.setattr(module, "layout_digests", digests)
    cfg = BenchConfig(
        layout="llama-3-8b", size_bytes=1, blocks_per_chunk=1, batch_chunks=2, repeat=1,
        device="cpu", root=str(tmp_path), direct_io="off",
    )  # fmt: skip
    # 1 block per group is too few for 2 batches: ask for 6 blocks of llama (2 MiB each)
    cfg.size_bytes = 6 * model_shape("llama-3-8b").block_nbytes()
    result = asyncio.run(run_bench(cfg))
    assert result["io"]["verified_repeats"] == 1
    generated = real(model_shape("llama-3-8b").build(6))
    assert len(seen) >= 6  # copy phases (4) and NVMe phases (1 + 2)
    assert all(n == 6 and d == generated for n, d in seen)
