"""``remove_namespace`` (``kvtier remove``): frees an old format's folder, never a live one."""

from __future__ import annotations

import os
import pathlib

import pytest

from kvtier.errors import InvalidArgumentError, NamespaceLockedError
from kvtier.io import NVMeTier, inspect_root, remove_namespace
from kvtier.io._inspect import REMOVING_PREFIX

from .conftest import GROUP_NBYTES, key, payload, tier_kwargs

OLD = {0: 3 * 4096 + 100, 1: 4096}  # another row size: another format, another folder


async def _tier_with_rows(root: pathlib.Path, slots, group_nbytes: dict[int, int]) -> NVMeTier:
    tier = NVMeTier(**tier_kwargs(root, group_nbytes=group_nbytes))
    await tier.open()
    buf = slots(3)
    rows = [(key(i), 0, 4, buf.fill(i, payload(key(i), group_nbytes[0]))) for i in range(3)]
    assert await tier.write_rows(rows) == [None] * 3
    await tier.flush()
    return tier


async def test_removes_an_old_format_and_leaves_the_current_one(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    old = await _tier_with_rows(root, slots, OLD)
    old_dir = old.directory
    await old.close()
    current = await _tier_with_rows(root, slots, GROUP_NBYTES)
    try:
        assert {ns["directory"] for ns in inspect_root(root)["namespaces"]} == {
            old_dir.name,
            current.directory.name,
        }
        freed = remove_namespace(root, old_dir.name)
        assert freed > 0
        assert not old_dir.exists()
        assert [ns["directory"] for ns in inspect_root(root)["namespaces"]] == [
            current.directory.name
        ]
        assert not [p for p in root.iterdir() if p.name.startswith(REMOVING_PREFIX)]
        # the live one still serves its rows
        out = slots(1)
        assert await current.read_rows([(key(1), out[0])]) == [(0, 4)]
        assert bytes(out[0][: GROUP_NBYTES[0]]) == payload(key(1), GROUP_NBYTES[0])
    finally:
        await current.close()
    # the removed format starts afresh when an engine opens it again
    again = NVMeTier(**tier_kwargs(root, group_nbytes=OLD))
    await again.open()
    try:
        assert again.directory == old_dir
        assert again.keys() == []
    finally:
        await again.close()


async def test_refuses_a_namespace_a_live_tier_holds(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    tier = await _tier_with_rows(root, slots, GROUP_NBYTES)
    name = tier.directory.name
    try:
        with pytest.raises(NamespaceLockedError, match=f"pid {os.getpid()}"):
            remove_namespace(root, name)
        assert tier.directory.is_dir()
    finally:
        await tier.close()
    reopened = NVMeTier(**tier_kwargs(root))
    await reopened.open()
    try:
        assert len(reopened.keys()) == 3  # nothing was deleted
    finally:
        await reopened.close()


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../nvme", "a/b", "missing-0123456789abcdef", "not-a-namespace"]
)
async def test_refuses_anything_but_a_namespace_folder_under_root(tmp_path, slots, name) -> None:
    root = tmp_path / "nvme"
    tier = await _tier_with_rows(root, slots, GROUP_NBYTES)
    await tier.close()
    (root / "not-a-namespace").mkdir()
    before = sorted(p.name for p in root.rglob("*"))
    with pytest.raises(InvalidArgumentError):
        remove_namespace(root, name)
    assert sorted(p.name for p in root.rglob("*")) == before


async def test_refuses_a_symlink_to_a_namespace(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    tier = await _tier_with_rows(root, slots, GROUP_NBYTES)
    await tier.close()
    link = root / "alias-0123456789abcdef"
    link.symlink_to(tier.directory)
    with pytest.raises(InvalidArgumentError, match="not a kvtier namespace"):
        remove_namespace(root, link.name)
    assert (tier.directory / "format.json").is_file()


async def test_an_interrupted_removal_is_finished_by_name(tmp_path, slots) -> None:
    root = tmp_path / "nvme"
    tier = await _tier_with_rows(root, slots, GROUP_NBYTES)
    await tier.close()
    # what a removal leaves if it dies between the rename and the deletion
    hidden = root / f"{REMOVING_PREFIX}12345-{tier.directory.name}"
    os.rename(tier.directory, hidden)
    assert inspect_root(root)["namespaces"] == []  # not listed as a namespace
    assert remove_namespace(root, hidden.name) > 0
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
async def test_refuses_a_lock_that_is_not_a_regular_file(tmp_path, slots, kind) -> None:
    root = tmp_path / "nvme"
    tier = await _tier_with_rows(root, slots, GROUP_NBYTES)
    await tier.close()
    lock = tier.directory / "lock"
    lock.unlink()
    outside = tmp_path / "outside"
    if kind == "symlink":
        lock.symlink_to(outside)  # O_CREAT would make a file outside the root
    elif kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(InvalidArgumentError, match="lock"):
        remove_namespace(root, tier.directory.name)
    assert (tier.directory / "format.json").is_file()
    assert not outside.exists()


async def test_freed_bytes_leave_out_files_linked_from_elsewhere(tmp_path, slots) -> None:
    """A segment hard-linked outside the namespace keeps its blocks: not counted as freed."""
    root = tmp_path / "nvme"
    tier = await _tier_with_rows(root, slots, GROUP_NBYTES)
    await tier.close()
    segments = sorted(p for p in tier.directory.rglob("*") if p.is_file() and p.stat().st_blocks)
    everything = sum(p.lstat().st_blocks * 512 for p in tier.directory.rglob("*") if p.is_file())
    kept = segments[0]
    kept_bytes = kept.stat().st_blocks * 512
    assert kept_bytes > 0
    outside = tmp_path / "backup.seg"
    os.link(kept, outside)
    assert len(segments) > 1
    os.link(segments[-1], segments[-1].with_name("again"))  # two links inside count once
    freed = remove_namespace(root, tier.directory.name)
    assert freed == everything - kept_bytes
    assert outside.stat().st_blocks * 512 == kept_bytes  # the blocks are still allocated


async def test_opening_a_namespace_names_its_folders_of_other_formats(
    tmp_path, slots, caplog
) -> None:
    """A changed layout starts cold: the log says so and names the unused folders."""
    root = tmp_path / "nvme"
    old = await _tier_with_rows(root, slots, OLD)
    await old.close()
    stranger = NVMeTier(**{**tier_kwargs(root, group_nbytes=OLD), "namespace": "other/label"})
    await stranger.open()
    await stranger.close()
    with caplog.at_level("WARNING", logger="kvtier.io"):
        current = NVMeTier(**tier_kwargs(root, group_nbytes=GROUP_NBYTES))
        await current.open()
        await current.close()
    (record,) = [r for r in caplog.records if "other formats" in r.getMessage()]
    message = record.getMessage()
    assert old.directory.name in message
    assert current.directory.name in message
    assert stranger.directory.name not in message  # another namespace label
    assert f"`kvtier remove {root} NAME`" in message
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvtier.io"):
        remove_namespace(root, old.directory.name)
        again = NVMeTier(**tier_kwargs(root, group_nbytes=GROUP_NBYTES))
        await again.open()
        await again.close()
    assert not [r for r in caplog.records if "other formats" in r.getMessage()]


async def test_a_namespace_label_instead_of_a_folder_name_gets_the_folder_names(
    tmp_path, slots
) -> None:
    root = tmp_path / "nvme"
    old = await _tier_with_rows(root, slots, OLD)
    await old.close()
    current = await _tier_with_rows(root, slots, GROUP_NBYTES)
    await current.close()
    label = tier_kwargs(root)["namespace"]  # "test/rank0": the NVMeConfig.namespace
    with pytest.raises(InvalidArgumentError, match="expected the name of a namespace") as info:
        remove_namespace(root, label)
    names = sorted([old.directory.name, current.directory.name])
    assert f"the folders of namespace {label!r} are: {', '.join(names)}" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="no folder 'gone-0123456789abcdef'"):
        remove_namespace(root, "gone-0123456789abcdef")
    assert old.directory.is_dir()  # nothing deleted
    assert current.directory.is_dir()
