"""Ways the CLI tests run kvtier: in a subprocess, on a private tmpfs, with a RowIO wrapper."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def kvtier(*args: str, cwd: Path, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m kvtier.cli ARGS`` in ``cwd``, offline, its output captured (300 s at most)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        cwd=cwd,
        env=env,
        # without ``input`` a prompt reads end of file, never waits
        **({"input": input} if input is not None else {"stdin": subprocess.DEVNULL}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _private_mount_supported() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True, check=False, timeout=30,
    )  # fmt: skip
    return probe.returncode == 0


needs_mount = pytest.mark.skipif(
    not _private_mount_supported(), reason="needs root and unshare -m to mount a private tmpfs"
)


def bench_on_tmpfs(
    mnt: Path, opts: str, bench_args: str, in_mnt: bool = True
) -> tuple[int, str, str, list[str]]:
    """``kvtier bench`` on a private tmpfs at ``mnt`` (gone with the process).

    Returns the bench's exit code, stdout, stderr and what it left on the tmpfs.
    """
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o {opts} tmpfs {mnt} || exit 99; "
        f"cd {mnt if in_mnt else mnt.parent}; "
        f"{sys.executable} -m kvtier.cli bench {bench_args} >{mnt.parent}/out 2>{mnt.parent}/err"
        f" </dev/null; echo $? >{mnt.parent}/rc; ls -A {mnt} >{mnt.parent}/left"
    )
    subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=True, timeout=120,
    )  # fmt: skip
    rc, out, err, left = ((mnt.parent / n).read_text() for n in ("rc", "out", "err", "left"))
    return int(rc), out, err, left.split()


def bench_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrap: Any, size_bytes: int
) -> bool:
    """Whether run_bench fails its checks when every NVMeConfig gets ``row_io_wrapper=wrap``.

    llama-3-8b, one block per chunk, one repeat, buffered I/O, under ``tmp_path``.
    """
    import kvtier
    from kvtier.bench import BenchConfig, run_bench

    real = kvtier.NVMeConfig

    def nvme_config(*args: Any, **kw: Any) -> Any:
        return real(*args, row_io_wrapper=wrap, **kw)

    monkeypatch.setattr(kvtier, "NVMeConfig", nvme_config)
    cfg = BenchConfig(
        layout="llama-3-8b", size_bytes=size_bytes, blocks_per_chunk=1, repeat=1, device="cpu",
        root=str(tmp_path), direct_io="off",
    )  # fmt: skip
    try:
        asyncio.run(run_bench(cfg))
    except AssertionError:
        return True
    return False
