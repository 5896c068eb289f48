"""inspect_root on a real root, and the public names of kvtier.io."""

from __future__ import annotations

import fcntl
import os
import pathlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner

import kvtier.io
from kvtier.cli import main as cli_main
from kvtier.io import NVMeTier, inspect_root

from .conftest import GROUP_NBYTES, key, payload, tier_kwargs


def test_all_is_sorted_and_complete() -> None:
    assert kvtier.io.__all__ == sorted(kvtier.io.__all__)
    assert set(kvtier.io.__all__) == {
        "AioRowIO",
        "FORMAT_VERSION",
        "KvikioRowIO",
        "NVMeTier",
        "PosixRowIO",
        "RowIO",
        "format_digest",
        "inspect_root",
        "remove_namespace",
        "select_backend",
    }
    for name in kvtier.io.__all__:
        assert getattr(kvtier.io, name) is not None


async def test_inspect_root_counts_rows(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    buf = slots(5)
    rows = [
        (key(i, i % 2), 0, 4, buf.fill(i, payload(key(i, i % 2), GROUP_NBYTES[i % 2])))
        for i in range(5)
    ]
    assert await tier.write_rows(rows) == [None] * 5
    await tier.close()
    other = NVMeTier(**tier_kwargs(root, blocks_per_chunk=2))
    await other.open()
    await other.close()
    # corrupt the trailer of the first group-0 row
    seg = tier.directory / "g0" / "0.kvrows"
    fd = os.open(seg, os.O_RDWR)
    os.pwrite(fd, b"\xff", 4096 + tier.payload_region_nbytes(0) + 100)
    os.close(fd)
    before = seg.read_bytes()
    info = inspect_root(root)
    assert seg.read_bytes() == before  # read-only
    names = [ns["directory"] for ns in info["namespaces"]]
    assert sorted(names) == sorted([tier.directory.name, other.directory.name])
    ns = next(n for n in info["namespaces"] if n["directory"] == tier.directory.name)
    assert ns["format"]["digest"] == tier.digest.hex()
    assert ns["format"]["namespace"] == "test/rank0"
    assert ns["groups"][0]["valid_rows"] == 2
    assert ns["groups"][0]["invalid_rows"] == 1
    assert ns["groups"][1]["valid_rows"] == 2
    assert ns["groups"][0]["rows"] == (1 << 20) // tier.row_nbytes(0)
    empty = next(n for n in info["namespaces"] if n["directory"] == other.directory.name)
    # never written: only the first segments grown ahead at open, no valid row
    assert empty["groups"]
    for g in empty["groups"].values():
        assert (g["valid_rows"], g["invalid_rows"]) == (0, 0)
        assert g["allocated_rows"] > 0


class _HeldLock:
    """A live flock on a namespace's lock file (like a running engine's)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.fd = os.open(path, os.O_RDWR)
        fcntl.flock(self.fd, fcntl.LOCK_EX)


def _hold_lock_with(data: bytes) -> Callable[[pathlib.Path], Any]:
    """A case: the lock file holds ``data`` and a live flock (kept until the test ends)."""

    def make(d: pathlib.Path) -> _HeldLock:
        (d / "lock").write_bytes(data)
        return _HeldLock(d / "lock")

    return make


def _segment_dir(d: pathlib.Path) -> None:
    (d / "g0").mkdir()
    (d / "g0" / "0.kvrows").mkdir()


def _segment_dangling(d: pathlib.Path) -> None:
    (d / "g0").mkdir()
    (d / "g0" / "0.kvrows").symlink_to(d / "nonexistent")


def _segment_fifo(d: pathlib.Path) -> None:
    (d / "g0").mkdir()
    os.mkfifo(d / "g0" / "0.kvrows")


# case -> (make garbage in a namespace directory, what the result must report)
GARBAGE: dict[str, tuple[Callable[[pathlib.Path], Any], str]] = {
    "segment_is_dir": (_segment_dir, "segment"),
    "segment_dangling_symlink": (_segment_dangling, "segment"),
    "segment_fifo": (_segment_fifo, "segment"),
    "format_json_list": (lambda d: (d / "format.json").write_text("[1, 2]"), "not a JSON object"),
    "format_json_not_utf8": (lambda d: (d / "format.json").write_bytes(b"\xff"), "format.json"),
    "format_json_deep": (lambda d: (d / "format.json").write_text("[" * 100_000), "format.json"),
    "format_json_fifo": (lambda d: os.mkfifo(d / "format.json"), "not a regular file"),
    "digest_not_hex": (lambda d: (d / "format.json").write_text('{"digest": "zz"}'), "not hex"),
    "digest_not_str": (lambda d: (d / "format.json").write_text('{"digest": 5}'), "not hex"),
    "group_dir_superscript": (lambda d: (d / "g\u00b2").mkdir(), "not a group folder"),
    "group_is_a_file": (lambda d: (d / "g0").write_bytes(b"x"), "not a group folder"),
    "lock_not_utf8_held": (_hold_lock_with(b"\xff\xfe"), "lock"),
    "lock_fifo": (lambda d: os.mkfifo(d / "lock"), "lock"),
}


def _with_timeout(fn: Callable[[], Any], seconds: float = 10) -> Any:
    """Run ``fn`` in a daemon thread: a blocking open() fails the test instead of hanging it."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "inspect blocked"
    if err:
        raise err[0]
    return out[0]


@pytest.mark.parametrize("case", list(GARBAGE))
def test_inspect_reports_garbage_instead_of_raising(tmp_path, case) -> None:
    make, expect = GARBAGE[case]
    d = tmp_path / "ns-0123456789abcdef"
    d.mkdir()
    held = make(d)
    try:
        info = _with_timeout(lambda: inspect_root(tmp_path))
        (ns,) = info["namespaces"]
        assert ns["format"] is None or isinstance(ns["format"], dict)
        if expect == "segment":
            (seg,) = ns["groups"][0]["segments"]
            assert seg["header_valid"] is False
            assert seg["error"]
            assert (seg["rows"], seg["valid_rows"], seg["invalid_rows"]) == (0, 0, 0)
        elif expect == "lock":
            assert ns["locked_by_pid"] == (-1 if isinstance(held, _HeldLock) else None)
        else:
            assert any(expect in e for e in ns["errors"]), ns["errors"]
        for args in (["inspect", str(tmp_path)], ["inspect", "--json", str(tmp_path)]):
            r = CliRunner().invoke(cli_main, args)  # inspect_root did not block above
            assert r.exit_code == 0, f"{r.output}\n{r.exception!r}"
        checked = _with_timeout(lambda: inspect_root(tmp_path, verify=True))
        (ns,) = checked["namespaces"]
        assert checked["clean"] is (expect != "segment")  # an unusable segment fails --verify
        assert ns["summary"]["invalid_segments"] == int(expect == "segment")
        for args in (
            ["inspect", "--verify", str(tmp_path)],
            ["inspect", "--verify", "--json", str(tmp_path)],
        ):
            r = CliRunner().invoke(cli_main, args)
            assert r.exit_code == int(expect == "segment"), f"{r.output}\n{r.exception!r}"
    finally:
        if isinstance(held, _HeldLock):
            os.close(held.fd)


async def test_inspect_skips_names_the_tier_does_not_write(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    buf = slots(1)
    row = [(key(0), 0, 4, buf.fill(0, payload(key(0), GROUP_NBYTES[0])))]
    assert await tier.write_rows(row) == [None]
    await tier.close()
    g0 = tier.directory / "g0"
    (g0 / "\u00b2.kvrows").write_bytes(b"\0" * 8192)
    (g0 / "00.kvrows").write_bytes((g0 / "0.kvrows").read_bytes())
    (ns,) = inspect_root(root)["namespaces"]
    assert [s["file"] for s in ns["groups"][0]["segments"]] == ["0.kvrows"]
    assert ns["groups"][0]["valid_rows"] == 1
    assert ns["errors"] == []


async def test_last_written_is_the_rows_time_and_an_open_does_not_move_it(tmp_path, slots) -> None:
    """An engine that only opens a folder (it rewrites ``lock``) leaves its time alone."""
    root = tmp_path / "nvme"
    tier = NVMeTier(**tier_kwargs(root))
    await tier.open()
    buf = slots(1)
    assert await tier.write_rows(
        [(key(0), 0, 4, buf.fill(0, payload(key(0), GROUP_NBYTES[0])))]
    ) == [None]
    await tier.close()
    (ns,) = inspect_root(root)["namespaces"]
    segments = list(tier.directory.rglob("*.kvrows"))
    assert ns["last_written"] == max(p.stat().st_mtime for p in segments)
    assert ns["disk_nbytes"] == sum(
        p.stat().st_blocks * 512 for p in tier.directory.rglob("*") if p.is_file()
    )
    for p in segments:  # rows written long ago
        os.utime(p, (1_000_000_000, 1_000_000_000))
    again = NVMeTier(**tier_kwargs(root))
    await again.open()
    await again.close()
    (ns,) = inspect_root(root)["namespaces"]
    assert ns["last_written"] == 1_000_000_000
