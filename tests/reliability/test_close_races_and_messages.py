"""Close races, cancel and queries across threads, and the messages of open, inspect, remove.

Covered: ``aclose()`` racing ``start()`` (``_started`` / ``_close_requested``),
``BackgroundEngine`` close/cancel/queries from the engine thread and from
other threads, the "other formats" warning at open, ``kvtier inspect``'s
format line and "last written" time, ``kvtier remove``'s messages,
``KVLayout.from_tensors``' one-name-one-tensor rule, ``HostRegion.close``.

Faults only through real seams: ``NVMeConfig.row_io_wrapper`` (a real backend
underneath) and real filesystem entries. A test headed "Regression" guards
against a bug these once had; the others pin behaviour that holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import kvtier
from kvtier._slots import HostRegion
from kvtier.cli import main as cli_main
from kvtier.errors import (
    EngineClosedError,
    InvalidArgumentError,
    KVTierError,
    LayoutError,
    NamespaceLockedError,
)
from kvtier.io import inspect_root
from kvtier.io._inspect import folders_of, other_formats

from ..engine.helpers import filled_layout, key, same
from ..io.faults import DelegatingRowIO
from ._faultio import KeyFault, Wrapper
from .background_engines import (
    await_for,
    blocked_durable_store,
    closed_seen,
    engine_cfg,
    nvme_cfg,
    wait_for,
)

R = kvtier.Residency


def _other_format_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "other formats" in r.getMessage()]


# ====================================================================== aclose racing start


class _GatedOpenClose(DelegatingRowIO):
    """Blocks the scan's segment open, then the release's segment close, on class events."""

    open_entered = threading.Event()
    open_gate = threading.Event()
    close_entered = threading.Event()
    close_gate = threading.Event()

    @classmethod
    def reset(cls) -> None:
        for ev in (cls.open_entered, cls.open_gate, cls.close_entered, cls.close_gate):
            ev.clear()

    @classmethod
    def release_all(cls) -> None:
        cls.open_gate.set()
        cls.close_gate.set()

    def open(self, path: str | os.PathLike[str], create: bool) -> Any:
        type(self).open_entered.set()
        type(self).open_gate.wait(10)
        return self.inner.open(path, create)

    def close(self, handle: Any) -> None:
        type(self).close_entered.set()
        type(self).close_gate.wait(10)
        self.inner.close(handle)


async def _store_one_row(root: Path, ns: str = "races") -> kvtier.KVLayout:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    async with kvtier.TransferEngine(layout, engine_cfg(layout, 4, nvme_cfg(root, ns=ns))) as first:
        await first.store([kvtier.Chunk(key("k", 0), [0, 1])], durable=True)
    return layout


async def _namespace_is_free(layout: kvtier.KVLayout, root: Path) -> bool:
    other = kvtier.TransferEngine(layout, engine_cfg(layout, 4, nvme_cfg(root)))
    try:
        await other.start()
    except NamespaceLockedError:
        return False
    await other.aclose()
    return True


# Regression: a second aclose() while start() releases after an aclose-abort does not return at
# once (state is already 'closed'), before the NVMe namespace lock is released
async def test_second_aclose_during_an_aborted_start_waits_for_the_namespace_lock(
    tmp_path: Path,
) -> None:
    layout = await _store_one_row(tmp_path)
    _GatedOpenClose.reset()
    engine = kvtier.TransferEngine(
        layout, engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=_GatedOpenClose))
    )
    start = asyncio.ensure_future(engine.start())
    first = second = None
    free_when_second_returned: bool | None = None
    try:
        await await_for(_GatedOpenClose.open_entered.is_set, "the tier scan")
        first = asyncio.ensure_future(engine.aclose())  # asks start() to stop
        await asyncio.sleep(0.01)
        _GatedOpenClose.open_gate.set()  # start() opens the tier, then stops and releases
        await await_for(_GatedOpenClose.close_entered.is_set, "start() releasing the tier")
        second = asyncio.ensure_future(engine.aclose())
        await asyncio.wait([second], timeout=0.3)
        if second.done():
            # aclose() promises: it returns only once the namespace lock is released
            free_when_second_returned = await _namespace_is_free(layout, tmp_path)
    finally:
        _GatedOpenClose.release_all()
        for fut in (start, first, second):
            if fut is not None:
                with contextlib.suppress(BaseException):
                    await fut
    with pytest.raises(EngineClosedError):
        await start
    assert free_when_second_returned in (None, True), "aclose() returned with the lock held"
    assert await _namespace_is_free(layout, tmp_path)


async def test_aclose_during_start_leaves_no_thread_slot_or_lock_behind(tmp_path: Path) -> None:
    """Holds: start() raises EngineClosedError, every thread it made ends, the lock is free."""
    layout = await _store_one_row(tmp_path)
    before = set(threading.enumerate())
    _GatedOpenClose.reset()
    _GatedOpenClose.close_gate.set()
    engine = kvtier.TransferEngine(
        layout, engine_cfg(layout, 4, nvme_cfg(tmp_path, wrapper=_GatedOpenClose))
    )
    start = asyncio.ensure_future(engine.start())
    try:
        await await_for(_GatedOpenClose.open_entered.is_set, "the tier scan")
        closing = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0.01)
        assert not closing.done()  # waits for start's step in progress
        _GatedOpenClose.open_gate.set()
        await asyncio.wait_for(closing, 10)
        assert start.done()
        with pytest.raises(EngineClosedError):
            await start
    finally:
        _GatedOpenClose.release_all()
        with contextlib.suppress(BaseException):
            await start
    with pytest.raises(EngineClosedError):
        engine.lookup([key("k", 0)])
    with pytest.raises(EngineClosedError):
        await engine.start()
    await engine.aclose()  # idempotent
    st = engine.stats()
    assert st.slots_free == st.num_slots
    await await_for(
        lambda: not [t for t in set(threading.enumerate()) - before if t.name.startswith("kvtier")],
        "the engine's threads to end",
    )
    async with kvtier.TransferEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path))) as again:
        assert again.lookup([key("k", 0)]) == [R.NVME]


# ====================================================================== BackgroundEngine


# 1e10, a regression: cancel(timeout=1e10) must not pass validation, cancel the call, then have
# Future.result raise OverflowError (above threading.TIMEOUT_MAX): untyped, state changed
@pytest.mark.parametrize("timeout", [-1, float("nan"), True, "1", float("-inf"), 1e10])
def test_background_cancel_with_a_bad_timeout_cancels_nothing(tmp_path: Path, timeout: Any) -> None:
    with blocked_durable_store(tmp_path) as (bg, durable, slow):
        with pytest.raises(InvalidArgumentError):
            bg.cancel(durable, timeout=timeout)
        assert not durable.done()
    assert durable.result().stored == (slow,)


def test_background_calls_from_a_done_callback_query_or_refuse_without_side_effects() -> None:
    """Holds: on the engine thread, queries answer; cancel()/close() raise and change nothing."""
    layout, t = filled_layout((32, 4096), seed=71, name="a")
    a, b = key("a", 0), key("b", 0)
    bg = kvtier.BackgroundEngine(layout, engine_cfg(layout, 4))
    bg.start()
    got: dict[str, Any] = {}
    done = threading.Event()
    try:
        other = bg.store([kvtier.Chunk(b, [2, 3])])
        other.result(10)

        def callback(_: concurrent.futures.Future[Any]) -> None:
            try:
                got["lookup"] = bg.lookup([a, b])
                got["prefix"] = bg.prefix_hits([a, b])
                got["range"] = bg.stored_range(a)
                got["stats"] = bg.stats()
                pending = bg.load([kvtier.Chunk(b, [6, 7])])  # a submission works there too
                got["pending"] = pending
                for name, call in (
                    ("cancel", lambda: bg.cancel(pending)),
                    ("close", bg.close),
                    ("close_hard", lambda: bg.close(hard=True)),
                ):
                    try:
                        call()
                    except BaseException as exc:
                        got[name] = exc
            finally:
                done.set()

        fut = bg.store([kvtier.Chunk(a, [0, 1])])
        fut.add_done_callback(callback)
        assert done.wait(10)
        assert got["lookup"] == [R.CPU, R.CPU]
        assert got["prefix"] == 2
        assert got["range"] == (0, 2)
        assert got["stats"].slots_resident >= 2
        for name in ("cancel", "close", "close_hard"):
            assert isinstance(got[name], InvalidArgumentError), got[name]
        assert got["pending"].result(10).loaded == (b,)  # not cancelled
        assert same(t[6:8], t[2:4])
        assert bg.lookup([a]) == [R.CPU]  # not closed
    finally:
        bg.close()


def test_background_cancel_of_a_finished_future_returns_false_and_close_twice_returns() -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    bg = kvtier.BackgroundEngine(layout, engine_cfg(layout, 4))
    with bg:
        fut = bg.store([kvtier.Chunk(key("a", 0), [0, 1])])
        fut.result(10)
        assert bg.cancel(fut, timeout=0) is False
        assert bg.cancel(fut) is False
        with pytest.raises(InvalidArgumentError):
            bg.cancel(asyncio.Future)  # type: ignore[arg-type]
    bg.close()
    with pytest.raises(EngineClosedError):
        bg.cancel(fut)


# ====================================================================== KVLayout


# Regression: two sparse tensors under one name raise LayoutError, not RuntimeError
# (_check_names_are_unique must not call stride()/data_ptr() before the per-layer checks)
def test_one_name_for_two_sparse_tensors_is_a_layout_error() -> None:
    a = torch.zeros(4, 8).to_sparse()
    b = torch.ones(4, 8).to_sparse()
    with pytest.raises(LayoutError):  # as a single sparse layer does
        kvtier.KVLayout.from_tensors({0: {"x": a}, 1: {"x": b}})


def test_one_name_rule_holds_for_aliases_and_refuses_other_tensors() -> None:
    a = torch.zeros(4, 8)
    with pytest.raises(LayoutError):
        kvtier.KVLayout.from_tensors({0: {"x": torch.zeros(4, 8).to_sparse()}})
    layout = kvtier.KVLayout.from_tensors({0: {"x": a}, 1: {"x": a[:]}, 2: {"y": a}})
    assert list(layout.group_ids) == [0, 1, 2]
    for other in (a.view(torch.int32), a.clone(), a[1:], a.t().contiguous().t()):
        with pytest.raises(LayoutError, match="different tensors"):
            kvtier.KVLayout.from_tensors({0: {"x": a}, 1: {"x": other}})


# ====================================================================== HostRegion


def test_host_region_close_twice_and_with_a_view_alive() -> None:
    region = HostRegion(8192, pin=False)
    view = region.buffer(0, 4096)  # exports the mapping: close cannot unmap yet
    region.close()
    region.close()
    view.release()
    region.close()
    fresh = HostRegion(4096, pin=False)
    fresh.close()
    fresh.close()


# ====================================================================== other formats at open


async def test_open_warning_skips_odd_entries_and_names_only_real_other_formats(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Holds: FIFOs, non-UTF-8, non-object, deep or directory format.json, symlink loops."""
    old_layout, _ = filled_layout((32, 8192), seed=71, name="a")
    async with kvtier.TransferEngine(
        old_layout, engine_cfg(old_layout, 4, nvme_cfg(tmp_path))
    ) as old:
        await old.store([kvtier.Chunk(key("o", 0), [0, 1])], durable=True)
        old_name = old._nvme.directory.name
    odd = {
        "fifo-0123456789abcdef": "fifo",
        "latin-0123456789abcdef": b'{"namespace": "races", "x": "\xff"}',
        "list-0123456789abcdef": b'["races"]',
        "deep-0123456789abcdef": b"[" * 100_000,
        "dir-0123456789abcdef": "dir",
        "empty-0123456789abcdef": b"",
    }
    for name, content in odd.items():
        folder = tmp_path / name
        folder.mkdir()
        fmt = folder / "format.json"
        if content == "fifo":
            os.mkfifo(fmt)
        elif content == "dir":
            fmt.mkdir()
        else:
            assert isinstance(content, bytes)
            fmt.write_bytes(content)
    (tmp_path / "loop-0123456789abcdef").symlink_to("loop-0123456789abcdef")
    (tmp_path / "dangling-0123456789abcdef").symlink_to(tmp_path / "nowhere")
    os.mkfifo(tmp_path / "pipe-0123456789abcdef")
    layout, t = filled_layout((32, 4096), seed=71, name="a")
    with caplog.at_level(logging.WARNING, logger="kvtier.io"):
        engine = kvtier.TransferEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path)))
        await asyncio.wait_for(engine.start(), 30)
        try:
            await engine.store([kvtier.Chunk(key("n", 0), [0, 1])])
            assert (await engine.load([kvtier.Chunk(key("n", 0), [4, 5])])).loaded
        finally:
            await engine.aclose()
    assert same(t[4:6], t[0:2])
    (message,) = _other_format_records(caplog)
    assert old_name in message
    assert not any(name in message for name in odd)
    ours = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("races-"))
    assert len(ours) == 2
    assert folders_of(tmp_path, "races") == ours
    info = inspect_root(tmp_path)
    assert {n["directory"] for n in info["namespaces"]} >= {old_name, *odd}


# Regression: the open warning does not say a folder of another format is 'not used' while a
# live engine holds it (other_formats checks the lock, as inspect's lock_holder does)
async def test_open_warning_does_not_call_a_live_engines_folder_unused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Blue/green on one host: the old server (old layout) still runs as the new one starts."""
    old_layout, _ = filled_layout((32, 8192), seed=71, name="a")
    new_layout, _ = filled_layout((32, 4096), seed=71, name="a")
    async with kvtier.TransferEngine(
        old_layout, engine_cfg(old_layout, 4, nvme_cfg(tmp_path))
    ) as old:
        await old.store([kvtier.Chunk(key("o", 0), [0, 1])], durable=True)
        live = old._nvme.directory.name
        with caplog.at_level(logging.WARNING, logger="kvtier.io"):
            async with kvtier.TransferEngine(
                new_layout, engine_cfg(new_layout, 4, nvme_cfg(tmp_path))
            ):
                pass
        assert old.lookup([key("o", 0)]) == [R.CPU]
        info = {n["directory"]: n for n in inspect_root(tmp_path)["namespaces"]}
        assert info[live]["locked_by_pid"] == os.getpid()
    for message in _other_format_records(caplog):
        assert not (live in message and "not used" in message), message


def test_other_formats_is_read_only_and_names_no_removing_folder(tmp_path: Path) -> None:
    own = tmp_path / "races-00000000000000aa"
    gone = tmp_path / ".kvtier-removing-1-ab-races-00000000000000bb"
    for folder in (own, gone, tmp_path / "races-00000000000000cc"):
        folder.mkdir()
        (folder / "format.json").write_text(json.dumps({"namespace": "races"}))
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert other_formats(tmp_path, own, "races") == ["races-00000000000000cc"]
    assert other_formats(tmp_path / "missing", own, "races") == []
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


# ====================================================================== kvtier inspect


# Regression: kvtier inspect does not crash (TypeError in format_summary,
# engine/_inspect_text.py) on a format.json whose
# layout.groups or a group's layers is not a list; inspect reports garbage, never raises
@pytest.mark.parametrize(
    "layout_json", [{"groups": 5}, {"groups": [{"group_id": 0, "layers": 7}]}, {"groups": True}]
)
def test_inspect_prints_a_format_json_with_odd_layout_fields(
    tmp_path: Path, layout_json: dict[str, Any]
) -> None:
    folder = tmp_path / "odd-0123456789abcdef"
    (folder / "g0").mkdir(parents=True)
    (folder / "format.json").write_text(
        json.dumps({"namespace": "odd", "digest": "00" * 32, "layout": layout_json})
    )
    assert inspect_root(tmp_path)["namespaces"][0]["format"]["layout"] == layout_json
    res = CliRunner().invoke(cli_main, ["inspect", str(tmp_path)])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "odd-0123456789abcdef" in res.output
    assert "last written" in res.output


def test_inspect_prints_odd_but_well_typed_format_json(tmp_path: Path) -> None:
    folder = tmp_path / "odd-0123456789abcdef"
    folder.mkdir()
    (folder / "format.json").write_bytes(
        json.dumps(
            {
                "namespace": "odd",
                "row_nbytes": [1, 2],
                "layout": {"groups": [3, {"layers": "abc"}, {"layers": [{"dtype": None}, 4]}]},
            }
        ).encode()
    )
    (tmp_path / "bin-0123456789abcdef").mkdir()
    (tmp_path / "bin-0123456789abcdef" / "format.json").write_bytes(b"\xff\xfe{")
    res = CliRunner().invoke(cli_main, ["inspect", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "format: g?: 0 x , rows of ? B; g?: 1 x None ?, rows of ? B" in res.output
    assert "format.json: unreadable" in res.output
    # no segment file: no rows were ever written (format.json's time does not count)
    assert "rows last written never" in res.output.split("odd-")[1]


def _tmpfs_root() -> Path | None:
    """A fresh folder on a filesystem that keeps a far-future mtime (tmpfs), or None."""
    if not os.path.isdir("/dev/shm"):
        return None
    root = Path(tempfile.mkdtemp(prefix="kvtier-far-future-mtime-", dir="/dev/shm"))
    probe = root / "probe"
    probe.write_bytes(b"")
    try:
        os.utime(probe, (0, 1e17))
        kept = probe.stat().st_mtime == 1e17
    except OSError:
        kept = False
    probe.unlink()
    if not kept:
        shutil.rmtree(root)
        return None
    return root


# Regression: kvtier inspect does not crash (OSError EOVERFLOW from time.gmtime in
# format_summary) when a file in a namespace folder has an mtime beyond the year range (tmpfs
# keeps it)
def test_inspect_survives_a_far_future_modification_time() -> None:
    root = _tmpfs_root()
    if root is None:
        pytest.skip("no tmpfs keeping far-future mtimes here")
    try:
        folder = root / "ns-0123456789abcdef"
        folder.mkdir()
        (folder / "format.json").write_text(json.dumps({"namespace": "ns"}))
        (folder / "g0").mkdir()
        (folder / "g0" / "0.seg").write_bytes(b"")
        os.utime(folder / "g0" / "0.seg", (0, 1e17))  # a bad clock, a restored archive
        assert inspect_root(root)["namespaces"][0]["last_written"] == 1e17
        res = CliRunner().invoke(cli_main, ["inspect", str(root)])
        assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
        assert "ns-0123456789abcdef" in res.output
    finally:
        shutil.rmtree(root)


# ====================================================================== kvtier remove


# Regression: without --yes, kvtier remove does not ask 'Delete ROOT/LABEL and every row in it?'
# for a folder that does not exist (answering no would hide the 'no folder' hint naming its
# folders)
async def test_remove_of_a_namespace_label_without_yes_says_no_folder(tmp_path: Path) -> None:
    await _store_one_row(tmp_path, ns="lbl")
    (folder,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("lbl-")]
    res = CliRunner().invoke(cli_main, ["remove", str(tmp_path), "lbl"], input="n\n")
    assert res.exit_code == 1
    assert (tmp_path / folder / "format.json").is_file()
    assert "Delete" not in res.output, res.output  # nothing to delete: no question
    assert f"no folder 'lbl' under {tmp_path}" in res.output
    assert f"the folders of namespace 'lbl' are: {folder}" in res.output


async def test_remove_messages_with_yes_and_nothing_removed_without_an_answer(
    tmp_path: Path,
) -> None:
    await _store_one_row(tmp_path, ns="lbl")
    (folder,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("lbl-")]
    runner = CliRunner()
    res = runner.invoke(cli_main, ["remove", "--yes", str(tmp_path), "lbl"])
    assert res.exit_code == 1
    assert f"the folders of namespace 'lbl' are: {folder}" in res.output
    for answer in ("", "n\n"):
        res = runner.invoke(cli_main, ["remove", str(tmp_path), folder], input=answer)
        assert res.exit_code == 1
        assert "nothing removed (answer y, or pass --yes)" in res.output
        assert (tmp_path / folder / "format.json").is_file()
    res = runner.invoke(cli_main, ["remove", str(tmp_path), folder], input="y\n")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / folder).exists()


# ====================================================================== stats / protect


async def test_a_rejected_promotion_by_a_load_is_counted_once_as_rejected(tmp_path: Path) -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    k, x = key("k", 0), key("x", 0)
    async with kvtier.TransferEngine(layout, engine_cfg(layout, 4, nvme_cfg(tmp_path))) as engine:
        await engine.store([kvtier.Chunk(k, [0, 1])], durable=True)
    fault = KeyFault("write", "block", hashes=frozenset({x.block_hash}))
    cfg = engine_cfg(layout, 1, nvme_cfg(tmp_path, wrapper=Wrapper(fault)))
    try:
        async with kvtier.TransferEngine(layout, cfg) as engine:
            await engine.store([kvtier.Chunk(x, [2, 3])])  # the only slot, pinned by its write
            await await_for(lambda: fault.hits == 1, "the blocked write")
            before = engine.stats()
            res = await engine.load([kvtier.Chunk(k, [4, 5])])
            st = engine.stats()
            fault.gate.set()
            assert isinstance(res.failed[k], KVTierError)
            assert st.rejected == before.rejected + 1
            assert st.failures == {}
            assert engine.lookup([k]) == [R.NVME]
    finally:
        fault.gate.set()


# ====================================================================== close, then a hard close


async def test_control_transfer_engine_hard_aclose_during_a_soft_aclose_drops_queued_rows(
    tmp_path: Path,
) -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    s1, s2, k3 = key("s1", 0), key("s2", 0), key("k3", 0)
    fault = KeyFault("write", "block", hashes=frozenset({s1.block_hash, s2.block_hash}))
    engine = kvtier.TransferEngine(
        layout, engine_cfg(layout, 8, nvme_cfg(tmp_path, wrapper=Wrapper(fault)))
    )
    await engine.start()
    try:
        for i, k in enumerate((s1, s2, k3)):
            await engine.store([kvtier.Chunk(k, [2 * i, 2 * i + 1])])
            await asyncio.sleep(0)
        await await_for(lambda: fault.hits == 2, "two blocked row writes")
        assert engine.stats().nvme["writes_queued"] == 1  # type: ignore[index]
        soft = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0.05)
        hard = asyncio.ensure_future(engine.aclose(hard=True))
        await asyncio.sleep(0.05)
    finally:
        fault.gate.set()
    await soft
    await hard
    async with kvtier.TransferEngine(layout, engine_cfg(layout, 8, nvme_cfg(tmp_path))) as again:
        assert again.lookup([s1, s2, k3]) == [R.NVME, R.NVME, R.MISS]


# Regression: BackgroundEngine.close(hard=True) while a soft close() runs escalates and drops
# the queued rows, as TransferEngine.aclose(hard=True) does, instead of only waiting for it
# (_close_done)
def test_background_hard_close_during_a_soft_close_drops_queued_rows(tmp_path: Path) -> None:
    layout, _ = filled_layout((32, 4096), seed=71, name="a")
    s1, s2, k3 = key("s1", 0), key("s2", 0), key("k3", 0)
    fault = KeyFault("write", "block", hashes=frozenset({s1.block_hash, s2.block_hash}))
    bg = kvtier.BackgroundEngine(
        layout, engine_cfg(layout, 8, nvme_cfg(tmp_path, wrapper=Wrapper(fault)))
    )
    bg.start()
    soft = threading.Thread(target=bg.close, name="soft-close")
    hard = threading.Thread(target=lambda: bg.close(hard=True), name="hard-close")
    try:
        for i, k in enumerate((s1, s2, k3)):
            bg.store([kvtier.Chunk(k, [2 * i, 2 * i + 1])]).result(10)
        wait_for(lambda: fault.hits == 2, "two blocked row writes")
        assert bg.stats().nvme["writes_queued"] == 1  # type: ignore[index]
        soft.start()
        wait_for(lambda: closed_seen(bg), "the soft close to begin")
        hard.start()
        threading.Event().wait(0.3)  # the hard close has been asked for
    finally:
        fault.gate.set()
        for th in (soft, hard):
            if th.ident is not None:
                th.join(20)
    with kvtier.BackgroundEngine(layout, engine_cfg(layout, 8, nvme_cfg(tmp_path))) as again:
        assert again.lookup([s1, s2]) == [R.NVME, R.NVME]
        assert again.lookup([k3]) == [R.MISS], "the hard close did not drop the queued row"
