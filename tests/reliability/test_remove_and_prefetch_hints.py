"""``kvtier remove`` and "a prefetch is a hint", under races, odd files and bad names.

* ``kvtier.io.remove_namespace`` / ``kvtier remove ROOT NAME``: names with
  path tricks, symlinks in and around the namespace folder (never followed),
  odd ``lock`` files, a folder without a lock, removals racing engine starts
  and other removals (paused at the flock with a profile hook, as a debugger
  breakpoint would, so the interleaving is exact), a read-only root, an
  engine killed with SIGKILL, an interrupted removal's hidden folder, what
  ``kvtier inspect`` shows afterwards and the byte count returned.
* ``SlotEntry.hinted`` / ``SlotPool.touch`` / ``refresh``: under ``lru`` and
  ``arc``, every order of prefetch, load and store of a key; a prefetched key
  evicted before its load; prefetches waiting for a store, cancelled
  prefetches, ``BackgroundEngine.prefetch``; no hint on a re-stored key; the
  counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import kvtier
from kvtier._policy import ARCPolicy, LRUPolicy
from kvtier.cli import main as cli_main
from kvtier.errors import (
    InvalidArgumentError,
    KVTierError,
    NamespaceLockedError,
)
from kvtier.io import inspect_root, remove_namespace
from kvtier.io._inspect import REMOVING_PREFIX, is_namespace

from ..engine.helpers import after_iterations, filled_layout, key, prefetch_chunks, prefetch_config

REPO = Path(__file__).resolve().parents[2]
FAKE = "fake-0123456789abcdef"  # named like a namespace folder


# ====================================================================== helpers


async def _namespace_with_rows(root: Path, n: int = 4) -> Path:
    """Store ``n`` chunks durably with the prefetch tests' layout and close: its folder."""
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    async with kvtier.TransferEngine(layout, prefetch_config(root)) as engine:
        res = await engine.store(prefetch_chunks(n), durable=True)
        assert len(res.stored) == n
    (folder,) = [p for p in root.iterdir() if is_namespace(p)]
    return folder


async def _opens_fresh_and_serves(root: Path) -> None:
    """An engine opening the same layout sees no old key, stores and reloads."""
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    chunks = prefetch_chunks()
    async with kvtier.TransferEngine(layout, prefetch_config(root)) as engine:
        assert engine.lookup([c.key for c in chunks]) == [kvtier.Residency.MISS] * 4
        assert len((await engine.store(chunks, durable=True)).stored) == 4
    async with kvtier.TransferEngine(layout, prefetch_config(root)) as engine:
        assert engine.lookup([c.key for c in chunks]) == [kvtier.Residency.NVME] * 4
        assert not (await engine.load(chunks)).failed


def _everything(base: Path) -> dict[str, tuple[str, bytes | str | None]]:
    """Every entry under ``base`` (links not followed): kind and content or target."""
    out: dict[str, tuple[str, bytes | str | None]] = {}
    for dirpath, dirs, files in os.walk(base):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(base))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", None)
            elif p.is_file():
                out[rel] = ("file", p.read_bytes())
            else:
                out[rel] = ("other", None)
    return out


def _du(path: Path, *, links: bool = False) -> int:
    """Disk bytes of the files under ``path`` (``st_blocks``), links not followed.

    ``links``: count the blocks a symlink itself holds (a long target takes one).
    """
    total = 0
    for dirpath, dirs, files in os.walk(path):
        for f in [*files, *dirs]:
            p = os.path.join(dirpath, f)
            counted = links if os.path.islink(p) else os.path.isfile(p)
            if counted:
                total += os.lstat(p).st_blocks * 512
    return total


def _hidden(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.startswith(REMOVING_PREFIX)]


def _cli(*args: str) -> Any:
    return CliRunner().invoke(cli_main, list(args), catch_exceptions=True)


class _PauseAtFlock:
    """Stop the first profiled thread that calls ``fcntl.flock`` until :attr:`go` is set.

    A profile hook, as a debugger's breakpoint: the code under test runs
    unchanged (whatever function takes the lock), the test only chooses when
    it goes on. Install it with ``threading.setprofile`` or ``sys.setprofile``.
    """

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and arg is fcntl.flock and not self.reached.is_set():
            self.reached.set()
            self.go.wait(30)


# ====================================================================== 1. names


@pytest.mark.parametrize(
    "make_name",
    [
        pytest.param(lambda ns: str(ns), id="absolute"),
        pytest.param(lambda ns: ns.name + "/", id="trailing-slash"),
        pytest.param(lambda ns: "./" + ns.name, id="dot-slash"),
        pytest.param(lambda ns: f"../{ns.parent.name}/{ns.name}", id="dotdot"),
        pytest.param(lambda ns: ns.name + "\0", id="nul"),
        pytest.param(lambda ns: "/", id="slash"),
        pytest.param(lambda ns: "\0", id="only-nul"),
        pytest.param(lambda ns: " " + ns.name, id="leading-space"),
        pytest.param(lambda ns: ns, id="path-object"),
        pytest.param(lambda ns: os.fsencode(ns.name), id="bytes"),
        pytest.param(lambda ns: None, id="none"),
    ],
)
async def test_a_name_with_path_tricks_is_refused_and_nothing_changes(
    tmp_path: Path, make_name: Callable[[Path], Any]
) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    ns = await _namespace_with_rows(root)
    before = _everything(tmp_path)
    with pytest.raises(InvalidArgumentError):
        remove_namespace(root, make_name(ns))
    assert _everything(tmp_path) == before


@pytest.mark.parametrize("length", [256, 300, 5000])
async def test_an_overlong_name_is_a_bad_argument_not_an_oserror(
    tmp_path: Path, length: int
) -> None:
    """Regression: a name longer than NAME_MAX is refused with ``InvalidArgumentError``.

    It must not escape as a bare ``OSError`` (ENAMETOOLONG): pathlib's
    ``path.is_symlink()`` swallows only ENOENT/ENOTDIR/EBADF/ELOOP, the
    docstring promises ``InvalidArgumentError`` for a name that is not a
    plain name, and ``kvtier remove ROOT <long name>`` (which catches
    InvalidArgumentError and NamespaceLockedError) would print a traceback.
    ``remove_namespace`` refuses ``len(os.fsencode(name)) > 255`` first.
    """
    root = tmp_path / "nvme"
    root.mkdir()
    await _namespace_with_rows(root)
    before = _everything(tmp_path)
    name = "a" * (length - 17) + "-0123456789abcdef"
    with pytest.raises(InvalidArgumentError):
        remove_namespace(root, name)
    assert _everything(tmp_path) == before
    res = _cli("remove", str(root), name, "--yes")
    assert res.exit_code == 1
    assert isinstance(res.exception, SystemExit), res.exception  # a message, not a traceback
    assert _everything(tmp_path) == before


def test_a_unicode_name_is_removed_and_only_it(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    name = "modèle-日本語-🙂-0123456789abcdef"
    (root / name / "g0").mkdir(parents=True)
    (root / name / "g0" / "0.kvrows").write_bytes(b"x" * 10_000)
    (root / "sibling-0123456789abcdef").mkdir()
    (root / "sibling-0123456789abcdef" / "keep").write_bytes(b"keep")
    assert remove_namespace(root, name) >= 10_000
    assert sorted(p.name for p in root.iterdir()) == ["sibling-0123456789abcdef"]
    assert (root / "sibling-0123456789abcdef" / "keep").read_bytes() == b"keep"


# ====================================================================== 2. symlinks


async def test_symlinks_inside_a_namespace_are_unlinked_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    ns = await _namespace_with_rows(root)
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    big = os.urandom(1 << 20) * 8  # 8 MiB of real blocks, outside the root
    (outside / "big").write_bytes(big)
    (outside / "deep" / "file").write_bytes(b"deep")
    (ns / "escape-dir").symlink_to(outside)  # a link to a directory outside
    (ns / "escape-file").symlink_to(outside / "big")  # to a file outside
    (ns / "g0" / "escape-rel").symlink_to(Path("../../..") / "outside" / "deep")  # relative
    (ns / "dangling").symlink_to(tmp_path / "nowhere")
    expected, expected_with_links = _du(ns), _du(ns, links=True)
    outside_before = _everything(outside)

    freed = remove_namespace(root, ns.name)

    assert not ns.exists()
    assert _hidden(root) == []
    assert _everything(outside) == outside_before  # every link target survives, unchanged
    assert not (tmp_path / "nowhere").exists()
    # the namespace's own blocks (its links' own blocks at most), never a link target's
    assert expected <= freed <= expected_with_links
    assert freed < len(big)
    await _opens_fresh_and_serves(root)


@pytest.mark.parametrize("name", [FAKE, f"{REMOVING_PREFIX}1-{FAKE}"])
async def test_a_namespace_folder_that_is_a_symlink_outside_is_refused(
    tmp_path: Path, name: str
) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "format.json").write_text("{}")
    (outside / "lock").write_text("")
    (outside / "precious").write_bytes(b"precious")
    (root / name).symlink_to(outside)
    before = _everything(tmp_path)
    with pytest.raises(InvalidArgumentError):
        remove_namespace(root, name)
    assert _everything(tmp_path) == before


# ====================================================================== 3. the lock file


@pytest.mark.parametrize("kind", ["symlink-to-file", "dangling-symlink", "directory", "fifo"])
async def test_an_odd_lock_is_refused_cleanly_by_the_cli_and_nothing_outside_changes(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    ns = await _namespace_with_rows(root)
    lock = ns / "lock"
    lock.unlink()
    outside = tmp_path / "outside-lock"
    if kind == "symlink-to-file":
        outside.write_bytes(b"not a pid\n")
        lock.symlink_to(outside)
    elif kind == "dangling-symlink":
        lock.symlink_to(outside)
    elif kind == "directory":
        lock.mkdir()
        (lock / "inner").write_bytes(b"inner")
    else:
        os.mkfifo(lock)
    before = _everything(tmp_path)
    res = _cli("remove", str(root), ns.name, "--yes")
    assert res.exit_code == 1
    assert isinstance(res.exception, SystemExit), res.exception
    assert "Error:" in res.output
    assert _everything(tmp_path) == before
    if kind == "symlink-to-file":  # never flocked through the link: free to take
        fd = os.open(outside, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


async def test_a_namespace_without_a_lock_file_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    ns = await _namespace_with_rows(root)
    (ns / "lock").unlink()
    assert remove_namespace(root, ns.name) > 0
    assert list(root.iterdir()) == []
    await _opens_fresh_and_serves(root)


# ====================================================================== 4. races


def test_an_engine_opening_before_a_removal_never_shares_the_namespace_with_a_newer_one(
    tmp_path: Path,
) -> None:
    """Regression: two live engines never end up holding one namespace folder.

    Engine A opens ``<ns>/lock`` (io/_files.py ``prepare_directory``:
    ``fd = os.open(directory / "lock", ...)``) and is preempted before its
    ``flock``. ``kvtier remove`` takes the lock, renames the folder away,
    deletes it and unlocks. Engine B opens the same layout: a fresh folder
    with a NEW lock file, which it locks. A resumes: its ``flock`` is on the
    old, unlinked lock inode and succeeds; were that enough, A would write
    ``format.json`` into B's folder and open it, and both engines would write
    rows into the same segment files (``kvtier remove`` unlinks lock files,
    so this can happen). The usual lock-file rule holds: after ``flock``
    succeeds, ``os.fstat(fd)`` (st_dev, st_ino) is compared with
    ``os.stat(directory / "lock", follow_symlinks=False)``; if they differ
    (or the path is gone), the engine closes and retries (or raises
    NamespaceLockedError). ``remove_namespace`` has the same check (next test).
    """
    root = tmp_path / "nvme"
    root.mkdir()
    old = asyncio.run(_namespace_with_rows(root))
    pause = _PauseAtFlock()
    first: dict[str, Any] = {}
    first_done = threading.Event()
    release = threading.Event()

    def first_engine() -> None:
        async def run() -> None:
            layout, _ = filled_layout((16, 8192), seed=5, name="a")
            engine = kvtier.TransferEngine(layout, prefetch_config(root))
            try:
                await engine.start()
            except Exception as exc:
                first["outcome"] = exc
                first_done.set()
                return
            first["outcome"] = engine
            first_done.set()
            try:
                await asyncio.to_thread(release.wait, 30)
            finally:
                await engine.aclose()

        asyncio.run(run())

    threading.setprofile(pause.profile)
    thread = threading.Thread(target=first_engine, daemon=True)
    try:
        thread.start()
        assert pause.reached.wait(30), "engine A never reached its flock"
        threading.setprofile(None)
        assert remove_namespace(root, old.name) > 0

        async def second() -> None:
            layout, _ = filled_layout((16, 8192), seed=5, name="a")
            async with kvtier.TransferEngine(layout, prefetch_config(root)) as engine_b:
                pause.go.set()
                assert await asyncio.to_thread(first_done.wait, 30)
                outcome = first["outcome"]
                assert isinstance(outcome, NamespaceLockedError), (
                    f"engine A started on the folder engine B holds: {outcome!r}"
                )
                assert (
                    engine_b.lookup([c.key for c in prefetch_chunks()])
                    == [kvtier.Residency.MISS] * 4
                )

        asyncio.run(second())
    finally:
        threading.setprofile(None)
        pause.go.set()
        release.set()
        thread.join(30)


def test_a_removal_paused_at_its_flock_never_deletes_a_live_engines_folder(
    tmp_path: Path,
) -> None:
    """Regression: a removal never deletes the folder of a live engine.

    Removal R2 opens ``<ns>/lock`` (io/_remove.py, ``fd = os.open(path /
    "lock", flags, 0o644)``) and is preempted before its ``flock``. Removal
    R1 of the same name runs to its end (the lock file is unlinked with the
    folder). An engine opens the layout: a fresh folder and a new lock it
    holds. R2 resumes: its ``flock`` is on the old unlinked inode and
    succeeds; were that enough, it would rename the live engine's folder
    away and delete every row under it. After ``flock``, R2 checks that
    ``os.fstat(fd)`` is still ``os.stat(path / "lock", follow_symlinks=False)``
    (st_dev, st_ino) and refuses (NamespaceLockedError or
    InvalidArgumentError) otherwise.
    """
    root = tmp_path / "nvme"
    root.mkdir()
    old = asyncio.run(_namespace_with_rows(root))
    pause = _PauseAtFlock()
    second: dict[str, Any] = {}

    def second_removal() -> None:
        sys.setprofile(pause.profile)
        try:
            second["outcome"] = remove_namespace(root, old.name)
        except Exception as exc:
            second["outcome"] = exc
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=second_removal, daemon=True)
    try:
        thread.start()
        assert pause.reached.wait(30), "removal R2 never reached its flock"
        assert remove_namespace(root, old.name) > 0  # R1

        async def live() -> None:
            layout, _ = filled_layout((16, 8192), seed=5, name="a")
            chunks = prefetch_chunks()
            async with kvtier.TransferEngine(layout, prefetch_config(root)) as engine:
                assert len((await engine.store(chunks, durable=True)).stored) == 4
                folder = engine._nvme.directory  # type: ignore[union-attr]
                pause.go.set()
                await asyncio.to_thread(thread.join, 30)
                assert isinstance(second["outcome"], KVTierError), (
                    f"R2 removed a live engine's folder: {second['outcome']!r}"
                )
                assert (folder / "format.json").is_file()
                assert _hidden(root) == []

        asyncio.run(live())
    finally:
        pause.go.set()
        thread.join(30)


def test_an_engine_paused_at_its_flock_while_its_folder_is_removed_fails_typed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    old = asyncio.run(_namespace_with_rows(root))
    pause = _PauseAtFlock()
    first: dict[str, Any] = {}

    def first_engine() -> None:
        async def run() -> None:
            layout, _ = filled_layout((16, 8192), seed=5, name="a")
            engine = kvtier.TransferEngine(layout, prefetch_config(root))
            try:
                await engine.start()
            except Exception as exc:
                first["outcome"] = exc
                return
            try:  # if it starts, it must be on a fresh, empty namespace
                first["keys"] = engine.lookup([c.key for c in prefetch_chunks()])
                first["outcome"] = "started"
            finally:
                await engine.aclose()

        asyncio.run(run())

    threading.setprofile(pause.profile)
    thread = threading.Thread(target=first_engine, daemon=True)
    try:
        thread.start()
        assert pause.reached.wait(30)
        threading.setprofile(None)
        assert remove_namespace(root, old.name) > 0
        pause.go.set()
        thread.join(30)
    finally:
        threading.setprofile(None)
        pause.go.set()
        thread.join(30)
    outcome = first["outcome"]
    if outcome == "started":
        assert first["keys"] == [kvtier.Residency.MISS] * 4
    else:
        assert isinstance(outcome, KVTierError), repr(outcome)
    assert _hidden(root) == []
    assert all(is_namespace(p) for p in root.iterdir())  # no stray files
    asyncio.run(_opens_fresh_and_serves(root))


def test_engine_starts_racing_removals_end_typed_or_fresh(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    keys = [c.key for c in prefetch_chunks()]
    for _ in range(8):
        ns = asyncio.run(_namespace_with_rows(root))
        barrier = threading.Barrier(2)
        got: dict[str, Any] = {}

        def start_engine(got: dict[str, Any] = got, barrier: threading.Barrier = barrier) -> None:
            async def run() -> None:
                engine = kvtier.TransferEngine(layout, prefetch_config(root))
                barrier.wait(10)
                try:
                    await engine.start()
                except KVTierError as exc:
                    got["engine"] = exc
                    return
                try:
                    got["engine"] = engine.lookup(keys)
                    res = await engine.store(prefetch_chunks(), durable=True)  # still usable
                    got["stored"] = len(res.stored) + len(res.skipped)
                finally:
                    await engine.aclose()

            asyncio.run(run())

        thread = threading.Thread(target=start_engine)
        thread.start()
        barrier.wait(10)
        try:
            removed: Any = remove_namespace(root, ns.name)
        except NamespaceLockedError as exc:
            removed = exc
        thread.join(30)
        engine = got["engine"]
        if isinstance(removed, int):
            assert removed > 0
            # the removal won: the engine saw the old rows never (fresh) or failed typed
            assert engine == [kvtier.Residency.MISS] * 4 or isinstance(engine, KVTierError), engine
        else:
            assert engine == [kvtier.Residency.NVME] * 4, engine  # it held the old folder
        if not isinstance(engine, KVTierError):
            assert got["stored"] == 4
        assert _hidden(root) == []
        assert all(is_namespace(p) for p in root.iterdir())
        for p in list(root.iterdir()):  # next round starts from a known state
            shutil.rmtree(p)


# ====================================================================== 5. environment


def test_a_read_only_root_is_refused_with_a_message_and_nothing_deleted(tmp_path: Path) -> None:
    """Regression: ``kvtier remove`` on a read-only ROOT prints a message, not a traceback.

    The lock is taken (the namespace folder itself is writable), then
    ``os.rename(path, doomed)`` (io/_remove.py) fails with EACCES/EROFS; the
    CLI (engine/cli.py ``remove``) catches OSError, not only
    InvalidArgumentError and NamespaceLockedError, so the PermissionError
    does not escape as a traceback. The same holds for a deletion that fails
    part-way: its OSError's message, 'rerun with that name', is shown
    (``click.ClickException(str(exc))``).
    """
    base = Path(tempfile.mkdtemp(prefix="kvtier-read-only-root-"))
    try:
        os.chmod(base, 0o755)
        root = base / "nvme"
        root.mkdir()
        ns = asyncio.run(_namespace_with_rows(root))
        cmd = [sys.executable, "-m", "kvtier.cli", "remove", str(root), ns.name, "--yes"]
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: chmod would not bind")
            for dirpath, dirs, files in os.walk(base):
                for name in [*dirs, *files]:
                    os.chown(os.path.join(dirpath, name), 65534, 65534, follow_symlinks=False)
            os.chown(base, 65534, 65534)
            drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            probe = [*drop, sys.executable, "-c", "import kvtier.cli"]
            if subprocess.run(probe, cwd=REPO, capture_output=True, timeout=60).returncode:
                pytest.skip("the unprivileged user cannot run kvtier here")
            cmd = [*drop, *cmd]
        os.chmod(root, 0o555)
        before = _everything(root)
        out = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
        assert out.returncode == 1, out
        assert (ns / "format.json").is_file()  # nothing deleted
        assert _hidden(root) == []
        after = _everything(root)
        after.pop(f"{ns.name}/lock", None)
        before.pop(f"{ns.name}/lock", None)
        assert after == before
        assert "Traceback" not in out.stderr, out.stderr[-1500:]
        assert "Error:" in out.stderr
    finally:
        if (base / "nvme").exists():
            os.chmod(base / "nvme", 0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_a_namespace_of_a_sigkilled_engine_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    script = textwrap.dedent(
        """
        import asyncio, pathlib, sys
        import kvtier
        from tests.engine.helpers import filled_layout, prefetch_chunks, prefetch_config

        async def main():
            layout, _ = filled_layout((16, 8192), seed=5, name="a")
            engine = kvtier.TransferEngine(layout, prefetch_config(pathlib.Path(sys.argv[1])))
            await engine.start()
            await engine.store(prefetch_chunks(), durable=True)
            print("ready", flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            (ns,) = [p for p in root.iterdir() if is_namespace(p)]
            with pytest.raises(NamespaceLockedError, match=f"pid {child.pid}"):
                remove_namespace(root, ns.name)
            assert inspect_root(root)["namespaces"][0]["locked_by_pid"] == child.pid
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
    assert (ns / "lock").read_text().strip() == str(child.pid)  # a stale pid stays in the file
    assert inspect_root(root)["namespaces"][0]["locked_by_pid"] is None
    assert remove_namespace(root, ns.name) > 0
    assert list(root.iterdir()) == []
    assert inspect_root(root)["namespaces"] == []
    asyncio.run(_opens_fresh_and_serves(root))


# ====================================================================== 6. hidden folders


async def test_an_interrupted_removal_is_invisible_and_the_namespace_starts_fresh(
    tmp_path: Path,
) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    ns = await _namespace_with_rows(root)
    hidden = root / f"{REMOVING_PREFIX}424242-{ns.name}"
    os.rename(ns, hidden)  # what a removal killed between its rename and rmtree leaves
    assert inspect_root(root)["namespaces"] == []
    res = _cli("inspect", str(root))
    assert hidden.name not in res.output
    await _opens_fresh_and_serves(root)  # the old rows are never served again
    res = _cli("inspect", str(root), "--json")
    assert res.exit_code == 0, res.output
    (listed,) = json.loads(res.output)["namespaces"]
    assert listed["directory"] == ns.name
    assert listed["groups"]["0"]["valid_rows"] == 4  # the fresh rows only
    expected = _du(hidden)
    assert remove_namespace(root, hidden.name) == expected > 0
    assert sorted(p.name for p in root.iterdir()) == [ns.name]
    res = _cli("remove", str(root), ns.name, "--yes")
    assert res.exit_code == 0, res.output
    assert f"removed {ns.name}:" in res.output
    assert list(root.iterdir()) == []
    res = _cli("inspect", str(root))
    assert res.exit_code == 1  # nothing left to list
    assert ns.name not in res.output


async def test_a_leftover_of_this_process_does_not_block_a_later_removal(tmp_path: Path) -> None:
    """Regression: a later removal of the same name in the same process does not fail
    with ENOTEMPTY.

    An earlier removal of NAME by this process may stop after its rename (its
    rmtree failed: the OSError says 'rerun with that name'), and an engine
    may since have made NAME again. Were the hidden name only
    ``.kvtier-removing-<pid>-<name>``, ``os.rename(path, doomed)`` would hit
    the non-empty leftover and raise OSError(ENOTEMPTY): NAME could not be
    removed until the leftover is (and a CLI in a container often runs under
    the same pid). The hidden name is unique: the pid plus a random suffix
    (io/_remove.py, ``doomed``).
    """
    root = tmp_path / "nvme"
    root.mkdir()
    ns = await _namespace_with_rows(root)
    leftover = root / f"{REMOVING_PREFIX}{os.getpid()}-{ns.name}"
    os.rename(ns, leftover)  # an earlier removal of this process stopped here
    ns2 = await _namespace_with_rows(root)  # the layout is used again
    assert ns2 == ns
    assert remove_namespace(root, ns.name) > 0
    assert not ns.exists()
    assert remove_namespace(root, leftover.name) > 0  # and the leftover is still finishable
    assert list(root.iterdir()) == []


# ====================================================================== 7. byte count


def test_the_byte_count_counts_blocks_of_sparse_files(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    ns = root / FAKE
    (ns / "g0").mkdir(parents=True)
    with open(ns / "g0" / "0.kvrows", "wb") as f:
        f.truncate(256 << 20)  # a 256 MiB hole
        f.seek(1 << 20)
        f.write(b"\xab" * (64 << 10))  # 64 KiB of data in it
    expected = _du(ns)
    freed = remove_namespace(root, FAKE)
    assert freed == expected  # (the empty lock it created holds no block)
    assert freed >= 64 << 10
    if expected < 32 << 20:  # the filesystem keeps holes: the apparent size is not counted
        assert freed < 32 << 20
    assert list(root.iterdir()) == []


async def test_the_byte_count_of_an_engine_namespace_covers_its_rows(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    ns = await _namespace_with_rows(root, n=8)
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    expected = _du(ns)
    freed = remove_namespace(root, ns.name)
    assert freed == expected
    assert freed >= 8 * layout.slot_nbytes(2) // 2  # at least the eight rows' payload


# ====================================================================== 8. hints: helpers


def _policy_config(root: Path, eviction: str, slots: int = 8) -> kvtier.EngineConfig:
    return dataclasses.replace(prefetch_config(root, slots=slots), eviction=eviction)


async def _on_nvme(root: Path, n: int = 8) -> kvtier.KVLayout:
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    async with kvtier.TransferEngine(layout, prefetch_config(root)) as engine:
        assert len((await engine.store(prefetch_chunks(n), durable=True)).stored) == n
    return layout


def _where(engine: kvtier.TransferEngine, k: kvtier.OffloadKey) -> str:
    """ARC: 't1', 't2', 'b1', 'b2' or '-'; LRU: the position from the MRU end ('mru-0' ...)."""
    policy = engine._pool.policy
    if isinstance(policy, ARCPolicy):
        for name in ("t1", "t2", "b1", "b2"):
            if k in getattr(policy, name):
                return name
        return "-"
    assert isinstance(policy, LRUPolicy)
    order = list(policy.candidates())
    return f"mru-{len(order) - 1 - order.index(k)}" if k in order else "-"


def _hinted(engine: kvtier.TransferEngine, k: kvtier.OffloadKey) -> bool | None:
    entry = engine._pool.get(k)
    return None if entry is None else entry.hinted


def _counters(engine: kvtier.TransferEngine) -> dict[str, Any]:
    s = engine.stats()
    nv = s.nvme or {}
    return {
        "hits": s.hits,
        "nvme_hits": s.nvme_hits,
        "misses": s.misses,
        "evictions": s.evictions,
        "rejected": s.rejected,
        "promotions": nv.get("promotions"),
        "promotion_failures": nv.get("promotion_failures"),
        "load_failures": s.load_failures,
    }


POLICIES = ["lru", "arc"]


# ====================================================================== 9. hints: orders


@pytest.mark.parametrize("eviction", POLICIES)
async def test_prefetch_then_load_is_one_use(tmp_path: Path, eviction: str) -> None:
    layout = await _on_nvme(tmp_path)
    c = prefetch_chunks(3)
    async with kvtier.TransferEngine(layout, _policy_config(tmp_path, eviction)) as engine:
        assert not (await engine.load([c[1]])).failed  # an older resident key
        res = await engine.prefetch([c[0].key])
        assert res.promoted == (c[0].key,)
        assert _hinted(engine, c[0].key) is True
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-0")
        assert not (await engine.load([c[2]])).failed  # another key loaded cold meanwhile
        assert not (await engine.load([c[0]])).failed  # the first use
        assert _hinted(engine, c[0].key) is False
        # a use refreshes recency under both policies: the key is the MRU of its list
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-0")
        if eviction == "arc":
            assert list(engine._pool.policy.t1)[-1] == c[0].key  # type: ignore[attr-defined]
        assert not (await engine.load([c[0]])).failed  # the second use
        assert _where(engine, c[0].key) == ("t2" if eviction == "arc" else "mru-0")
        assert _counters(engine) == {
            "hits": 2,
            "nvme_hits": 2,
            "misses": 0,
            "evictions": 0,
            "rejected": 0,
            "promotions": 3,
            "promotion_failures": 0,
            "load_failures": 0,
        }


@pytest.mark.parametrize("eviction", POLICIES)
async def test_load_then_prefetch_is_a_refresh_and_the_next_load_a_second_use(
    tmp_path: Path, eviction: str
) -> None:
    layout = await _on_nvme(tmp_path)
    c = prefetch_chunks(3)
    async with kvtier.TransferEngine(layout, _policy_config(tmp_path, eviction)) as engine:
        assert not (await engine.load([c[0]])).failed  # cold: one use
        assert not (await engine.load([c[1], c[2]])).failed
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-2")
        before = _counters(engine)
        res = await engine.prefetch([c[0].key])
        assert res.resident == (c[0].key,)
        assert _counters(engine) == before  # a prefetch of a resident key counts nothing
        assert _hinted(engine, c[0].key) is False  # it was used already: no hint
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-0")  # refreshed
        assert not (await engine.load([c[0]])).failed
        assert _where(engine, c[0].key) == ("t2" if eviction == "arc" else "mru-0")


@pytest.mark.parametrize("eviction", POLICIES)
async def test_prefetch_twice_then_load_is_still_one_use(tmp_path: Path, eviction: str) -> None:
    layout = await _on_nvme(tmp_path)
    c = prefetch_chunks(2)
    async with kvtier.TransferEngine(layout, _policy_config(tmp_path, eviction)) as engine:
        assert (await engine.prefetch([c[0].key])).promoted == (c[0].key,)
        assert not (await engine.load([c[1]])).failed
        assert (await engine.prefetch([c[0].key])).resident == (c[0].key,)
        assert _hinted(engine, c[0].key) is True  # still unused
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-0")
        assert (await engine.prefetch([c[0].key])).resident == (c[0].key,)
        assert not (await engine.load([c[0]])).failed
        assert _hinted(engine, c[0].key) is False
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-0")
        assert not (await engine.load([c[0]])).failed
        assert _where(engine, c[0].key) == ("t2" if eviction == "arc" else "mru-0")
        assert engine.stats().hits == 2
        assert (engine.stats().nvme or {})["promotions"] == 2


@pytest.mark.parametrize("eviction", POLICIES)
async def test_a_skipped_store_after_a_prefetch_is_the_first_use(
    tmp_path: Path, eviction: str
) -> None:
    layout = await _on_nvme(tmp_path)
    c = prefetch_chunks(2)
    async with kvtier.TransferEngine(layout, _policy_config(tmp_path, eviction)) as engine:
        await engine.prefetch([c[0].key])
        assert not (await engine.load([c[1]])).failed
        res = await engine.store([c[0]])
        assert res.skipped == (c[0].key,)
        assert _hinted(engine, c[0].key) is False  # the hint is used up
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-0")
        assert not (await engine.load([c[0]])).failed  # the second use
        assert _where(engine, c[0].key) == ("t2" if eviction == "arc" else "mru-0")
        assert engine.stats().rejected == 0


@pytest.mark.parametrize("eviction", POLICIES)
async def test_a_prefetched_key_evicted_before_its_load_then_loaded_cold_is_used_once(
    tmp_path: Path, eviction: str
) -> None:
    """Regression (arc): an unused prefetch does not count, through ARC's ghost list.

    A key only on NVMe is prefetched (T1, hinted), evicted before its load,
    then loaded cold. Were it remembered in B1 as if it had been used
    (``policy.remove(key, evicted=True)`` in ``SlotPool.reserve``,
    engine/_slots.py), ``ARCPolicy.insert`` would see a B1 ghost hit, put the
    key in T2 and grow ``p``, where a cold load of the same key without the
    prefetch leaves it in T1 with ``p`` unchanged: the hint would count as a
    use. A victim whose entry is still ``hinted`` leaves the policy without a
    ghost (``policy.remove(key, evicted=not entry.hinted)``). Under LRU the
    control run holds.
    """

    async def run(prefetch: bool, root: Path) -> tuple[str, float, dict[str, Any]]:
        layout = await _on_nvme(root)
        c = prefetch_chunks(5)
        async with kvtier.TransferEngine(layout, _policy_config(root, eviction, 3)) as engine:
            if prefetch:
                assert (await engine.prefetch([c[0].key])).promoted == (c[0].key,)
            for x in c[1:4]:  # fill the 3 slots: the prefetched key is the oldest
                assert not (await engine.load([x])).failed
            assert engine.lookup([c[0].key]) == [kvtier.Residency.NVME]
            assert not (await engine.load([c[0]])).failed  # its first use, cold
            p = getattr(engine._pool.policy, "p", 0.0)
            counters = _counters(engine)
            counters.pop("promotions")
            counters.pop("evictions")
            return _where(engine, c[0].key), p, counters

    plain = await run(False, tmp_path / "plain")
    hinted = await run(True, tmp_path / "hinted")
    if eviction == "arc":
        assert plain[:2] == ("t1", 0.0)
    assert hinted == plain


@pytest.mark.parametrize("eviction", POLICIES)
async def test_a_prefetch_waiting_for_a_store_in_flight_leaves_the_store_as_the_first_use(
    tmp_path: Path, eviction: str
) -> None:
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    c = prefetch_chunks(2)
    async with kvtier.TransferEngine(layout, _policy_config(tmp_path, eviction)) as engine:
        store = asyncio.ensure_future(engine.store([c[0]]))
        await asyncio.sleep(0)  # the store is submitted, its copy not ended
        assert engine.lookup([c[0].key]) == [kvtier.Residency.PENDING]
        res = await engine.prefetch([c[0].key])
        assert (await store).stored == (c[0].key,)
        assert res.resident == (c[0].key,)
        assert _hinted(engine, c[0].key) is False  # a stored key is never hinted
        assert (await engine.store([c[1]])).stored == (c[1].key,)
        assert not (await engine.load([c[0]])).failed  # store + load: two uses
        assert _where(engine, c[0].key) == ("t2" if eviction == "arc" else "mru-0")
        assert engine.stats().hits == 1


@pytest.mark.parametrize("eviction", POLICIES)
@pytest.mark.parametrize("first", ["prefetch", "load"])
async def test_a_load_and_a_prefetch_of_one_nvme_key_at_once_are_one_use(
    tmp_path: Path, eviction: str, first: str
) -> None:
    # Whichever call starts the promotion, the other waits for it: the load is
    # the key's one use, the prefetch a hint. No hint is left behind.
    layout = await _on_nvme(tmp_path)
    c = prefetch_chunks(2)
    async with kvtier.TransferEngine(layout, _policy_config(tmp_path, eviction)) as engine:
        prefetch = engine.prefetch([c[0].key])
        load = engine.load([c[0]])
        calls = [prefetch, load] if first == "prefetch" else [load, prefetch]
        out = await asyncio.gather(*(asyncio.ensure_future(x) for x in calls))
        res, loaded = (out[0], out[1]) if first == "prefetch" else (out[1], out[0])
        assert loaded.loaded == (c[0].key,)
        assert (res.promoted, res.resident) == (
            ((c[0].key,), ()) if first == "prefetch" else ((), (c[0].key,))
        )
        assert _hinted(engine, c[0].key) is False
        assert not (await engine.load([c[1]])).failed
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-1")
        assert not (await engine.load([c[0]])).failed  # the second use
        assert _where(engine, c[0].key) == ("t2" if eviction == "arc" else "mru-0")
        assert (engine.stats().nvme or {})["promotions"] == 2  # one read for c[0]


@pytest.mark.parametrize("eviction", POLICIES)
async def test_a_prefetch_cancelled_during_its_read_leaves_a_hinted_key(
    tmp_path: Path, eviction: str
) -> None:
    layout = await _on_nvme(tmp_path)
    c = prefetch_chunks(2)
    async with kvtier.TransferEngine(layout, _policy_config(tmp_path, eviction)) as engine:
        call = asyncio.ensure_future(engine.prefetch([c[0].key]))
        for _ in range(200):  # until its read is in flight
            await asyncio.sleep(0)
            if engine.lookup([c[0].key]) == [kvtier.Residency.PENDING]:
                break
        assert engine.lookup([c[0].key]) == [kvtier.Residency.PENDING]
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(1000):  # reads already started complete
            if engine.lookup([c[0].key]) == [kvtier.Residency.CPU]:
                break
            await asyncio.sleep(0.001)
        assert engine.lookup([c[0].key]) == [kvtier.Residency.CPU]
        assert _hinted(engine, c[0].key) is True
        assert not (await engine.load([c[1]])).failed
        assert not (await engine.load([c[0]])).failed
        assert _hinted(engine, c[0].key) is False
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-0")
        assert engine.stats().hits == 1
        assert engine.stats().nvme_hits == 1


@pytest.mark.parametrize("eviction", POLICIES)
async def test_a_prefetch_cancelled_while_waiting_for_a_store_changes_nothing(
    tmp_path: Path, eviction: str
) -> None:
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    c = prefetch_chunks(1)
    async with kvtier.TransferEngine(layout, _policy_config(tmp_path, eviction)) as engine:
        store = asyncio.ensure_future(engine.store(c))
        call = asyncio.ensure_future(engine.prefetch([c[0].key]))
        after_iterations(1, call.cancel)
        with pytest.raises(asyncio.CancelledError):
            await call
        assert (await store).stored == (c[0].key,)
        await asyncio.sleep(0.01)
        assert _hinted(engine, c[0].key) is False
        assert _where(engine, c[0].key) == ("t1" if eviction == "arc" else "mru-0")
        assert not (await engine.load(c)).failed
        assert _where(engine, c[0].key) == ("t2" if eviction == "arc" else "mru-0")


@pytest.mark.parametrize("eviction", POLICIES)
def test_background_engine_prefetch_is_a_hint(tmp_path: Path, eviction: str) -> None:
    layout = asyncio.run(_on_nvme(tmp_path))
    c = prefetch_chunks(2)
    with kvtier.BackgroundEngine(layout, _policy_config(tmp_path, eviction)) as bg:
        assert bg.prefetch([c[0].key]).result(timeout=60).promoted == (c[0].key,)
        assert not bg.load([c[1]]).result(timeout=60).failed
        assert not bg.load([c[0]]).result(timeout=60).failed
        engine = bg.engine
        where = bg._submit(_async(lambda: (_where(engine, c[0].key), _hinted(engine, c[0].key))))
        assert where.result(timeout=60) == ("t1" if eviction == "arc" else "mru-0", False)
        assert not bg.load([c[0]]).result(timeout=60).failed
        where = bg._submit(_async(lambda: _where(engine, c[0].key)))
        assert where.result(timeout=60) == ("t2" if eviction == "arc" else "mru-0")
        assert bg.stats().hits == 2


async def _async(fn: Callable[[], Any]) -> Any:
    return fn()


@pytest.mark.parametrize("eviction", POLICIES)
async def test_a_key_stored_again_after_a_hinted_eviction_starts_unhinted(
    tmp_path: Path, eviction: str
) -> None:
    layout, _ = filled_layout((16, 8192), seed=5, name="a")
    nv = kvtier.NVMeConfig(
        root=tmp_path, capacity_bytes=1 << 20, namespace="leak", segment_nbytes=1 << 20
    )
    config = kvtier.EngineConfig(3 * layout.slot_nbytes(2), 2, nvme=nv, eviction=eviction)
    k0 = kvtier.Chunk(key("leak-0", 0), [0, 1])

    def batch(i: int) -> list[kvtier.Chunk]:
        return [kvtier.Chunk(key(f"filler-{i}-{j}", 0), [2 * j + 2, 2 * j + 3]) for j in range(3)]

    async with kvtier.TransferEngine(layout, config) as engine:
        assert (await engine.store([k0], durable=True)).stored == (k0.key,)
        assert (await engine.store(batch(0), durable=True)).stored  # k0 leaves the CPU slots
        assert engine.lookup([k0.key]) == [kvtier.Residency.NVME]
        assert (await engine.prefetch([k0.key])).promoted == (k0.key,)
        assert _hinted(engine, k0.key) is True
        for i in range(1, 40):  # k0 leaves the CPU slots, then NVMe
            await engine.store(batch(i), durable=True)
            if engine.lookup([k0.key]) == [kvtier.Residency.MISS]:
                break
        assert engine.lookup([k0.key]) == [kvtier.Residency.MISS]
        assert (await engine.store([k0])).stored == (k0.key,)
        assert _hinted(engine, k0.key) is False  # a new entry: no hint
        before = _where(engine, k0.key)
        assert not (await engine.load([k0])).failed  # a plain use
        assert _hinted(engine, k0.key) is False
        if eviction == "arc":
            assert _where(engine, k0.key) == "t2"  # stored, then used: T2 (from T1 or a ghost)
        else:
            assert before == _where(engine, k0.key) == "mru-0"
