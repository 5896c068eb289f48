"""``kvtier inspect ROOT --verify`` on a real tier's files, damaged on disk after its close."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvtier.cli import main as cli_main
from kvtier.io import NVMeTier, inspect_root
from kvtier.io._format import HEADER_NBYTES, TRAILER_NBYTES, decode_trailer
from tests.io.conftest import GROUP_NBYTES, Slots, key, payload, tier_kwargs

REPO = Path(__file__).resolve().parents[2]
KEYS_PER_GROUP = 3


class Stored:
    """A closed tier's folder: per group its row size, and the row each key landed in."""

    def __init__(self, root: Path, directory: Path, row_nbytes: dict[int, int]) -> None:
        self.root = root
        self.directory = directory
        self.row_nbytes = row_nbytes

    def segment(self, group: int) -> Path:
        return self.directory / f"g{group}" / "0.kvrows"

    def row_of(self, group: int, i: int) -> int:
        """The row of ``key(i, group)`` in the group's first segment (read from the trailers)."""
        row = self.row_nbytes[group]
        data = self.segment(group).read_bytes()
        for r in range((len(data) - HEADER_NBYTES) // row):
            end = HEADER_NBYTES + (r + 1) * row
            raw = data[end - TRAILER_NBYTES : end]
            if any(raw) and decode_trailer(raw).block_hash == key(i, group).block_hash:
                return r
        raise AssertionError(f"key {i} of group {group} is in no row")

    def offset(self, group: int, row: int) -> int:
        """File offset in bytes of a row of the group's first segment."""
        return HEADER_NBYTES + row * self.row_nbytes[group]


def store(root: Path) -> Stored:
    """Write ``KEYS_PER_GROUP`` keys in each group of a real tier under ``root``, then close it."""

    async def run() -> Stored:
        tier = NVMeTier(**tier_kwargs(root))
        await tier.open()
        buf = Slots(len(GROUP_NBYTES) * KEYS_PER_GROUP, 8 * 4096)
        try:
            rows = []
            for g in GROUP_NBYTES:
                for i in range(KEYS_PER_GROUP):
                    k = key(i, g)
                    rows.append((k, 0, 4, buf.fill(len(rows), payload(k, GROUP_NBYTES[g]))))
            assert await tier.write_rows(rows) == [None] * len(rows)
        finally:
            await tier.close()
            buf.close()
        return Stored(root, tier.directory, {g: tier.row_nbytes(g) for g in GROUP_NBYTES})

    return asyncio.run(run())


def patch(path: Path, offset: int, data: bytes | None = None, *, flip: bool = False) -> None:
    """Overwrite bytes of a file in place (``flip``: invert the low bit of one byte)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if flip:
            data = bytes([os.pread(fd, 1, offset)[0] ^ 1])
        assert data is not None
        assert os.pwrite(fd, data, offset) == len(data)
    finally:
        os.close(fd)


def inspect(root: Path, *args: str) -> tuple[int, str, dict[str, Any]]:
    """Run ``kvtier inspect`` (click's runner): exit code, human output and ``--json`` result."""
    human = CliRunner().invoke(cli_main, ["inspect", *args, str(root)])
    as_json = CliRunner().invoke(cli_main, ["inspect", "--json", *args, str(root)])
    assert human.exception is None or isinstance(human.exception, SystemExit), human.output
    assert as_json.exit_code == human.exit_code, (human.output, as_json.output)
    return human.exit_code, human.stdout, json.loads(as_json.stdout)


def kvtier_process(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``kvtier`` in a child process, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=120,
        check=False,
        **({"capture_output": True} | kw),
    )


def groups(info: dict[str, Any]) -> dict[int, dict[str, Any]]:
    (ns,) = info["namespaces"]
    return {int(g): grp for g, grp in ns["groups"].items()}


def test_clean_tier_verifies_every_row_and_exits_0_without_touching_files(tmp_path) -> None:
    s = store(tmp_path)
    files = sorted(s.directory.rglob("*"))
    before = {p: hashlib.sha256(p.read_bytes()).digest() for p in files if p.is_file()}
    res = kvtier_process("inspect", "--verify", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr == ""  # not a terminal: no progress line
    assert "verified: 9 valid rows; no corrupt or torn row, no invalid segment file" in res.stdout
    assert "payloads not read" not in res.stdout
    res = kvtier_process("inspect", "--verify", "--json", str(tmp_path))
    assert res.returncode == 0
    assert res.stderr == ""
    info = json.loads(res.stdout)
    assert info["payloads_verified"] is True
    assert info["clean"] is True
    (ns,) = info["namespaces"]
    assert ns["summary"]["valid_rows"] == 3 * KEYS_PER_GROUP
    assert (ns["summary"]["corrupt_rows"], ns["summary"]["torn_rows"]) == (0, 0)
    for grp in groups(info).values():
        assert grp["valid_rows"] == KEYS_PER_GROUP
        assert (grp["corrupt_rows"], grp["torn_rows"], grp["invalid_segments"]) == (0, 0, 0)
        assert grp["blank_rows"] == grp["allocated_rows"] - KEYS_PER_GROUP > 0
    assert sorted(s.directory.rglob("*")) == files
    assert {p: hashlib.sha256(p.read_bytes()).digest() for p in before} == before


def test_flipped_payload_byte_is_one_corrupt_row_that_plain_inspect_counts_valid(
    tmp_path,
) -> None:
    s = store(tmp_path)
    row = s.row_of(0, 1)
    patch(s.segment(0), s.offset(0, row) + 5000, flip=True)

    code, out, info = inspect(tmp_path)  # trailers only
    assert code == 0
    assert "payloads not read; run with --verify to check them" in out
    assert info["payloads_verified"] is False
    assert "clean" not in info
    assert groups(info)[0]["valid_rows"] == KEYS_PER_GROUP
    assert groups(info)[0]["invalid_rows"] == 0

    code, out, info = inspect(tmp_path, "--verify")
    assert code == 1
    assert info["payloads_verified"] is True
    assert info["clean"] is False
    g = groups(info)
    assert (g[0]["corrupt_rows"], g[0]["valid_rows"], g[0]["torn_rows"]) == (1, 2, 0)
    assert all(g[n]["corrupt_rows"] == 0 and g[n]["valid_rows"] == 3 for n in (1, 2))
    (seg,) = g[0]["segments"]
    assert seg["problems"] == [
        {"row": row, "kind": "corrupt", "error": "payload checksum mismatch"}
    ]
    assert f"0.kvrows: row {row}: corrupt: payload checksum mismatch" in out
    n = g[0]["allocated_rows"]
    assert f"g0: {n} rows allocated: 2 valid, 1 corrupt, 0 torn, {n - 3} blank, in 1 " in out
    assert "verify FAILED: 1 corrupt, 0 torn rows, 0 invalid segment file(s)" in out


@pytest.mark.parametrize(
    "where",
    [0, 50, TRAILER_NBYTES - 8],  # the hash starts at byte 49
    ids=["magic", "block_hash", "trailer_checksum"],
)
def test_zeroed_trailer_bytes_make_the_row_corrupt_and_fail_the_verify(tmp_path, where) -> None:
    s = store(tmp_path)
    row = s.row_of(1, 2)
    trailer_at = s.offset(1, row) + s.row_nbytes[1] - TRAILER_NBYTES
    patch(s.segment(1), trailer_at + where, b"\0" * 8)
    code, out, info = inspect(tmp_path, "--verify")
    assert code == 1, out
    g1 = groups(info)[1]
    assert (g1["corrupt_rows"], g1["valid_rows"], g1["torn_rows"]) == (1, 2, 0)
    assert g1["segments"][0]["problems"] == [
        {
            "row": row,
            "kind": "corrupt",
            "error": "row trailer: checksum of its fields does not match",
        }
    ]
    assert f"0.kvrows: row {row}: corrupt: row trailer: checksum of its fields" in out


def test_all_zero_trailer_is_a_free_row_as_the_tier_reads_it(tmp_path) -> None:
    """The tier frees a row by zeroing its trailer: the format cannot tell this from a wipe."""
    s = store(tmp_path)
    row = s.row_of(2, 0)
    trailer_at = s.offset(2, row) + s.row_nbytes[2] - TRAILER_NBYTES
    patch(s.segment(2), trailer_at, b"\0" * TRAILER_NBYTES)
    code, _, info = inspect(tmp_path, "--verify")
    g2 = groups(info)[2]
    assert (g2["valid_rows"], g2["corrupt_rows"]) == (2, 0)
    assert g2["blank_rows"] == g2["allocated_rows"] - 2
    assert code == 0

    async def keys() -> list[Any]:
        tier = NVMeTier(**tier_kwargs(tmp_path))
        await tier.open()
        try:
            return list(tier.keys())
        finally:
            await tier.close()

    found = asyncio.run(keys())
    assert key(0, 2) not in found  # a free row for the tier too: the key is gone, not wrong
    assert key(1, 2) in found


def test_segment_cut_inside_a_row_is_torn_and_fails_the_verify(tmp_path) -> None:
    s = store(tmp_path)
    last = max(s.row_of(0, i) for i in range(KEYS_PER_GROUP))
    cut = s.offset(0, last) + s.row_nbytes[0] // 2
    os.truncate(s.segment(0), cut)

    code, out, info = inspect(tmp_path)
    assert code == 0  # trailers only: a cut is shown, not verified
    assert f"0.kvrows: truncated: the file ends inside row {last}" in out
    assert groups(info)[0]["truncated_segments"] == 1

    code, out, info = inspect(tmp_path, "--verify")
    assert code == 1
    g0 = groups(info)[0]
    assert (g0["valid_rows"], g0["torn_rows"], g0["corrupt_rows"]) == (2, 1, 0)
    assert g0["truncated_segments"] == 1
    (seg,) = g0["segments"]
    assert seg["truncated"] is True
    assert seg["allocated_rows"] == last
    half = s.row_nbytes[0] // 2
    assert seg["problems"] == [
        {
            "row": last,
            "kind": "torn",
            "error": f"the file ends {half} B into this row of {s.row_nbytes[0]} B",
        }
    ]
    assert "verify FAILED: 0 corrupt, 1 torn rows, 0 invalid segment file(s)" in out


def test_segment_with_a_damaged_header_is_invalid_and_fails_the_verify(tmp_path) -> None:
    s = store(tmp_path)
    patch(s.segment(2), 40, flip=True)
    code, out, info = inspect(tmp_path, "--verify")
    assert code == 1
    (ns,) = info["namespaces"]
    assert ns["summary"]["invalid_segments"] == 1
    (seg,) = groups(info)[2]["segments"]
    assert seg["header_valid"] is False
    assert "segment header: checksum of its fields does not match" in seg["error"]
    assert "verify FAILED: 0 corrupt, 0 torn rows, 1 invalid segment file(s)" in out


def test_verify_next_to_a_live_engine_leaves_its_lock_held(tmp_path) -> None:
    s = store(tmp_path)
    patch(s.segment(0), s.offset(0, s.row_of(0, 0)) + 7, flip=True)
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.io._child", "hold", str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        res = kvtier_process("inspect", "--verify", "--json", str(tmp_path))
        assert res.returncode == 1, res.stderr  # the flipped byte, found under the live engine
        info = json.loads(res.stdout)
        (ns,) = info["namespaces"]
        assert ns["locked_by_pid"] == child.pid
        assert groups(info)[0]["corrupt_rows"] == 1
        assert ns["summary"]["valid_rows"] == 3 * KEYS_PER_GROUP - 1
        assert child.poll() is None
        fd = os.open(s.directory / "lock", os.O_RDONLY)
        try:  # the engine holds its lock still
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        child.kill()
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()


def test_progress_line_only_on_a_terminal_stderr_and_never_with_json(tmp_path) -> None:
    store(tmp_path)
    for args, drawn in ((["--verify"], True), (["--verify", "--json"], False)):
        leader, follower = os.openpty()
        try:
            try:
                res = kvtier_process("inspect", *args, str(tmp_path), stdout=subprocess.PIPE,
                                     stderr=follower, capture_output=False)  # fmt: skip
            finally:
                os.close(follower)
            err = b""
            while True:
                try:
                    chunk = os.read(leader, 1 << 16)
                except OSError:  # EIO: the terminal's other end is closed
                    break
                if not chunk:
                    break
                err += chunk
        finally:
            os.close(leader)
        assert res.returncode == 0
        if drawn:
            assert b"\rkvtier inspect --verify: 100% (" in err, err
            assert err.endswith(b"\r")  # the line is erased at the end
        else:
            assert err == b""


def test_progress_counts_the_segment_files_bytes_and_ends_at_their_total(tmp_path) -> None:
    s = store(tmp_path)
    patch(s.segment(2), 40, flip=True)  # a segment not read still counts as gone through
    calls: list[tuple[int, int]] = []
    inspect_root(tmp_path, progress=lambda done, total: calls.append((done, total)))
    assert calls == []  # trailers only: no progress
    info = inspect_root(
        tmp_path, verify=True, progress=lambda done, total: calls.append((done, total))
    )
    size = sum(p.stat().st_size for p in s.directory.rglob("*.kvrows"))
    assert calls[-1] == (size, size)
    assert {total for _, total in calls} == {size}
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    read = [seg for grp in groups(info).values() for seg in grp["segments"] if seg["header_valid"]]
    assert len(read) == 2
    assert len(calls) >= sum(seg["allocated_rows"] for seg in read)  # per row, not per file
