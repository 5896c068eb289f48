"""``kvtier roundtrip`` and ``kvtier bench``: output paths, preflight checks, byte checks.

A test whose docstring starts with "Regression:" guards against a bug these
commands once had (the docstring says what must hold and how it failed); the
other tests pin behaviour that holds.
Faults come only through real seams: a RowIO wrapper (``NVMeConfig.row_io_wrapper``,
injected by handing the bench an ``NVMeConfig`` that carries one), the engine's
``load``, a file system (a private tmpfs), the kernel's AIO limit. The byte
checks themselves are never patched.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvtier._shapes import ModelShape
from kvtier.cli import main

from .cli_runs import bench_fails, bench_on_tmpfs, kvtier, needs_mount

COPY_ONLY = ("--size", "1M", "--repeat", "1", "--no-nvme")


def _bench(*args: str) -> tuple[Result, list[int]]:
    """``kvtier bench ARGS`` in-process; also the ``num_blocks`` of every data set built."""
    built: list[int] = []
    real_build = ModelShape.build

    def spy(self: ModelShape, num_blocks: int, device: Any = "cpu") -> Any:
        built.append(num_blocks)
        return real_build(self, num_blocks, device)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelShape, "build", spy)
        return CliRunner().invoke(main, ["bench", *args]), built


def _written_or_refused_up_front(res: Result, built: list[int], path: Path) -> None:
    """Either the run wrote ``path``, or it was refused with a usage error before the run."""
    if res.exit_code == 0 and path.exists():
        return
    assert isinstance(res.exception, SystemExit), (
        f"after the run ({len(built)} data set(s) built): escaped "
        f"{type(res.exception).__name__}: {res.exception}"
    )
    assert res.exit_code in (1, 2), res.output
    assert built == [], "refused only after the run"


# --- --json / --plot ----------------------------------------------------------------------


def test_a_plot_format_that_cannot_be_written_here_is_refused_before_the_run(
    tmp_path: Path,
) -> None:
    """Regression: a --plot format that cannot be written here (pgf without a LaTeX
    install, though FigureCanvasBase lists it) is refused before the run, or written;
    the run is not lost to a RuntimeError traceback at the end."""
    if any(shutil.which(tex) for tex in ("xelatex", "pdflatex", "lualatex")):
        pytest.skip("a LaTeX install can write pgf")
    out = tmp_path / "bench.pgf"
    res, built = _bench(*COPY_ONLY, "--plot", str(out))
    _written_or_refused_up_front(res, built, out)


@pytest.mark.parametrize("kind", ["dangling-symlink", "name-too-long"])
def test_a_json_path_that_cannot_be_opened_is_refused_before_the_run(
    tmp_path: Path, kind: str
) -> None:
    """Regression: cli.py _output_path checks the path itself, not only its folder: a
    dangling symlink (or a name over NAME_MAX) is refused before the run, or written,
    instead of to_json's open() failing after the run with a traceback."""
    if kind == "dangling-symlink":
        out = tmp_path / "bench.json"
        out.symlink_to(tmp_path / "missing-folder" / "bench.json")
    else:
        out = tmp_path / ("a" * 300 + ".json")
    res, built = _bench(*COPY_ONLY, "--json", str(out))
    _written_or_refused_up_front(res, built, out)


def test_relative_json_and_plot_paths_in_the_cwd_overwrite_existing_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    Path("r.json").write_text("old")
    Path("r.PNG").write_text("old")
    res, built = _bench(*COPY_ONLY, "--json", "r.json", "--plot", "r.PNG")
    assert res.exit_code == 0, res.output
    assert len(built) == 2  # the data set and the scheduling-overhead layout
    assert json.loads(Path("r.json").read_text())["phases"]["store"]["gbps"] > 0
    assert Path("r.PNG").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- JSON layouts -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["my-model [/v2]", "my-model [bold]x"])
def test_a_layout_name_is_printed_verbatim(tmp_path: Path, name: str) -> None:
    """Regression: bench/report.py format_table escapes the layout's name in its rich title:
    '[/v2]' raises no MarkupError after the whole run, and '[bold]' does not vanish."""
    spec = {"name": name, "layers": [{"kind": "full", "page_shape": [2, 16, 1, 64]}]}
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(spec))
    res, _ = _bench("--layout", str(path), *COPY_ONLY)
    assert res.exit_code == 0, f"{type(res.exception).__name__}: {res.exception}"
    assert name in res.output


def test_a_quantized_dtype_in_a_layout_file_is_a_one_line_error(tmp_path: Path) -> None:
    """Regression: _shapes.py _shape_of_json refuses a quantized torch.dtype (qint8,
    quint8, qint32, quint4x2) with a one-line error, not a traceback in ModelShape.build."""
    spec = {"dtype": "qint8", "layers": [{"kind": "full", "page_shape": [2, 16, 1, 64]}]}
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(spec))
    res = kvtier("bench", "--layout", str(path), *COPY_ONLY, cwd=tmp_path)
    assert res.returncode in (1, 2), res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-1500:]
    assert "dtype" in res.stderr


@pytest.mark.parametrize(
    ("spec", "groups"),
    [
        ({"dtype": "float8_e4m3fn", "layers": [{"kind": "full", "page_shape": [1] * 70 + [64]}]},
         1),
        ({"dtype": "bool", "tokens_per_block": 2**62, "layers": [
            {"kind": "a", "page_shape": [3]}, {"kind": "b", "page_shape": [5]},
            {"kind": "b", "page_shape": [5]}]}, 3),  # layer counts 1 and 2: gcd 1
    ],
)  # fmt: skip
def test_extreme_but_valid_layout_files_run_and_are_checked(
    tmp_path: Path, spec: dict[str, Any], groups: int
) -> None:
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(spec))
    out = tmp_path / "r.json"
    res, _ = _bench("--layout", str(path), *COPY_ONLY, "--json", str(out))
    assert res.exit_code == 0, f"{type(res.exception).__name__}: {res.exception}"
    r = json.loads(out.read_text())
    assert r["layout"]["tokens_per_block"] == spec.get("tokens_per_block", 16)
    assert r["layout"]["groups"] == groups


# --- preflight ----------------------------------------------------------------------------


@needs_mount
def test_a_folder_with_little_free_space_but_enough_is_not_refused(tmp_path: Path) -> None:
    """Regression: bench/preflight.py preflight does not count 256 MiB per group (need = 4 x rows
    + groups x 256 MiB = 1.5 GiB for --size 1M); the tier's first file per group is
    min(128 MiB, capacity / (4 x groups)) ~ 64 MiB, the run's peak is ~0.76 GiB, so a
    1 GiB folder is enough and is not refused."""
    rc, out, err, left = bench_on_tmpfs(tmp_path / "small", "size=1g", "--size 1M --repeat 1")
    assert left == []
    assert rc == 0, err[-800:]
    assert "nvme_read" in out


def _aio_available() -> bool:
    try:
        from kvtier.io import select_backend

        io = select_backend("aio", "auto", "/tmp", 4, 1)
    except Exception:
        return False
    io.shutdown()  # type: ignore[attr-defined]
    return True


@pytest.mark.skipif(not _aio_available(), reason="needs Linux AIO")
def test_the_aio_contexts_a_run_holds_are_checked_before_the_run(tmp_path: Path) -> None:
    """Regression: bench/preflight.py preflight checks both AIO contexts of 4 x io_threads events
    that the run holds at once (the baselines' and the tier's), not one; where only one
    fits in fs.aio-max-nr the run must not fail after the copy phases and raw baselines
    (io_setup EAGAIN at 'kvtier CPU -> NVMe')."""
    max_nr = int(Path("/proc/sys/fs/aio-max-nr").read_text())
    in_use = int(Path("/proc/sys/fs/aio-nr").read_text())
    depth = (max_nr - in_use) // 2 + 1024  # one context fits, two do not
    if depth > max_nr - in_use - 1024:
        pytest.skip("aio-nr too close to aio-max-nr")
    threads = -(-depth // 4)
    res, built = _bench(
        "--size", "1M", "--repeat", "1", "--io-backend", "aio", "--io-threads", str(threads),
        "--dir", str(tmp_path),
    )  # fmt: skip
    assert isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 0 or built == [], res.output[-500:]
    assert list(tmp_path.iterdir()) == []


# --- the byte checks ----------------------------------------------------------------------


class _CorruptOnDisk:
    """Writes rows with one payload bit flipped to files whose path holds ``marker``.

    The caller's buffer (a CPU slot) is flipped back after the write: only the
    bytes on disk are wrong, as after a torn or misdirected write.
    """

    def __init__(self, inner: Any, marker: str, hits: list[str]) -> None:
        self.inner, self.marker, self.hits = inner, marker, hits
        self.paths: dict[Any, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open(self, path: Any, create: bool) -> Any:
        handle = self.inner.open(path, create)
        self.paths[handle] = str(path)
        return handle

    def pwritev(self, handle: Any, bufs: Any, file_offset: int) -> int:
        path = self.paths.get(handle, "")
        mv = memoryview(bufs[0]).cast("B") if bufs else None
        if self.marker not in path or mv is None or mv.nbytes <= 4096:
            return int(self.inner.pwritev(handle, bufs, file_offset))
        mv[100] ^= 1
        try:
            n = int(self.inner.pwritev(handle, bufs, file_offset))
        finally:
            mv[100] ^= 1
        self.hits.append(path)
        return n


def _bench_with_corrupt_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: str
) -> tuple[bool, list[str]]:
    """run_bench where NVMe rows written under a path holding ``marker`` are corrupt on disk."""
    hits: list[str] = []
    failed = bench_fails(tmp_path, monkeypatch, lambda io: _CorruptOnDisk(io, marker, hits), 1)
    return failed, hits


def test_rows_written_corrupt_by_the_cpu_to_nvme_leg_fail_the_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    detected, hits = _bench_with_corrupt_writes(tmp_path, monkeypatch, f"{os.sep}tier0{os.sep}")
    assert hits  # the fault was injected
    assert detected
    assert list(tmp_path.iterdir()) == []


def test_rows_written_corrupt_by_write_through_fail_the_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: bench/nvme_phases.py run_nvme_phases reads back the rows nvme_write_e2e wrote
    before the e2e root is removed: a write-through path writing wrong bytes fails the
    run instead of being timed and reported as a good figure."""
    detected, hits = _bench_with_corrupt_writes(tmp_path, monkeypatch, f"-e2e{os.sep}")
    assert hits  # the fault was injected
    assert detected


def test_rows_written_corrupt_on_the_full_tier_fail_the_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvme_write_full's rows (a full tier, every row evicting one) are loaded back and
    checked too: wrong bytes there fail the run instead of giving a figure."""
    detected, hits = _bench_with_corrupt_writes(tmp_path, monkeypatch, f"-full{os.sep}")
    assert hits  # the fault was injected
    assert detected
    assert list(tmp_path.iterdir()) == []


def test_a_pipelined_load_that_writes_nothing_fails_the_bench(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: bench/copy_phases.py run_copy_phases scribbles over the cache before it checks
    'pipelined store -> load', so a pipelined load that writes nothing fails the run
    (it once passed on a cache the load's own data already filled)."""
    import kvtier
    from kvtier.bench import BenchConfig, run_bench

    real_load = kvtier.TransferEngine.load
    engines: list[int] = []
    skipped: list[int] = []

    async def load(self: Any, chunks: Any) -> Any:
        if id(self) not in engines:
            engines.append(id(self))
        if engines.index(id(self)) == 1:  # the copy phases' second engine: pipelined
            skipped.append(len(chunks))
            return await real_load(self, [])  # reports success, copies nothing
        return await real_load(self, chunks)

    monkeypatch.setattr(kvtier.TransferEngine, "load", load)
    cfg = BenchConfig(
        layout="llama-3-8b", size_bytes=1, blocks_per_chunk=1, repeat=1, device="cpu",
        nvme=False,
    )  # fmt: skip
    detected = False
    try:
        asyncio.run(run_bench(cfg))
    except AssertionError:
        detected = True
    assert skipped  # the fault was injected
    assert detected


# --- roundtrip ----------------------------------------------------------------------------


@pytest.mark.model
def test_roundtrip_root_reused_with_other_sizes_and_after_a_corrupt_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from kvtier.roundtrip import RoundtripReport, run_roundtrip

    def run(**kw: Any) -> RoundtripReport:
        r = run_roundtrip("tiny-qwen3-next", decode_tokens=1, root=tmp_path, **kw)
        assert isinstance(r, RoundtripReport)
        return r

    base = {"prompt_tokens": 40}
    first = run(**base)
    assert first.ok
    assert first.already_stored == 0
    for other in ({"block_tokens": 8}, {"blocks_per_chunk": 2}, {"prompt_tokens": 41}):
        r = run(**(base | other))
        assert r.ok, r.format()
        assert r.already_stored == 0  # a namespace of its own
    bad = run(**base, corrupt_one_row=True)
    assert not bad.ok
    assert bad.already_stored > 0  # every key of the first run found on NVMe
    assert len(bad.failed) == 1
    healed = run(**base)  # the corrupt row was dropped: stored again, the rest reused
    assert healed.ok, healed.format()
    assert healed.already_stored > 0
    assert not healed.failed
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 4


# --- what a refusal advises -------------------------------------------------------------


def test_a_missing_layout_file_is_named_as_such(tmp_path: Path) -> None:
    from kvtier._shapes import model_shape
    from kvtier.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="no such file"):
        model_shape(str(tmp_path / "missing.json"))
    with pytest.raises(InvalidArgumentError, match="unknown layout"):
        model_shape("llama-9")


def test_one_chunk_per_group_too_big_for_memory_advises_fewer_blocks_per_chunk() -> None:
    from kvtier.bench import BenchConfig, preflight
    from kvtier.errors import ConfigError

    # qwen3-next blocks are ~21 MB: 4096 of them are ~80 GiB whatever --size says
    cfg = BenchConfig(layout="qwen3-next", size_bytes=1, blocks_per_chunk=4096, nvme=False)
    with pytest.raises(ConfigError, match="smaller --blocks-per-chunk") as err:
        preflight(cfg)
    assert "smaller --size" not in str(err.value)


@needs_mount
def test_a_filesystem_too_small_for_any_size_says_so(tmp_path: Path) -> None:
    rc, _out, err, left = bench_on_tmpfs(tmp_path / "tiny", "size=8m", "--size 1M --repeat 1")
    assert rc == 1, err
    assert "no --size fits" in err
    assert "Traceback" not in err
    assert left == []


def test_the_json_config_records_a_layout_files_own_block_size(tmp_path: Path) -> None:
    from kvtier.bench import BenchConfig, run_bench

    path = tmp_path / "tpb.json"
    layers = [
        {"kind": "full", "page_shape": [2, 8, 1, 64]},
        {"kind": "sliding", "page_shape": [2, 8, 1, 64]},
    ]
    path.write_text(json.dumps({"tokens_per_block": 8, "layers": layers}))
    cfg = BenchConfig(
        layout=str(path), size_bytes=1 << 20, tokens_per_block=32, repeat=1, nvme=False,
        device="cpu",
    )  # fmt: skip
    result = asyncio.run(run_bench(cfg))
    assert result["layout"]["tokens_per_block"] == 8
    assert result["config"]["tokens_per_block"] == 8
