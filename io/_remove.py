"""``kvtier remove ROOT NAME``: delete one namespace directory that no live engine holds.

Files of another format (an old layout, dtype, block size or row size) stay
on disk and are never reused; this is how an operator frees their space.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import secrets
import shutil
import stat

from kvtier.errors import InvalidArgumentError, NamespaceLockedError
from kvtier.io._files import same_file
from kvtier.io._inspect import REMOVING_PREFIX, folders_of, is_namespace

__all__ = ["remove_namespace"]

_NAME_MAX = 255  # bytes in one path component (Linux NAME_MAX)


def namespace_path(root: str | os.PathLike[str], name: str) -> pathlib.Path:
    """``root/name`` when it names a namespace directory that could be removed (blocks).

    The checks :func:`remove_namespace` makes before it takes the lock; the
    CLI runs them before it asks for confirmation. Deletes nothing.

    Raises:
        InvalidArgumentError: ``name`` is not a plain name (the message
            lists the folders of a namespace label given instead), there is
            no such folder, or it is not a namespace directory (a symlink
            is refused too).

    """
    base = pathlib.Path(root)
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\0" in name
        or len(os.fsencode(name)) > _NAME_MAX
    ):
        hint = _label_hint(base, name) if isinstance(name, str) else ""
        raise InvalidArgumentError(
            f"expected the name of a namespace directory (<namespace>-<16 hex digits>, as "
            f"`kvtier inspect {root}` lists it) under {root}, got {name!r:.300}{hint}"
        )
    path = base / name
    try:
        if not path.exists() and not path.is_symlink():
            raise InvalidArgumentError(
                f"no folder {name!r} under {root} (see `kvtier inspect {root}`)"
                + _label_hint(base, name)
            )
        listed = is_namespace(path) or name.startswith(REMOVING_PREFIX)
        if path.is_symlink() or not listed or not path.is_dir():
            raise InvalidArgumentError(
                f"{str(path)!r} is not a kvtier namespace directory (see `kvtier inspect {root}`)"
            )
    except OSError as exc:
        raise InvalidArgumentError(f"cannot look at {str(path)!r}: {exc}") from exc
    return path


def remove_namespace(root: str | os.PathLike[str], name: str) -> int:
    """Delete the namespace directory ``root/name`` and every row in it (blocks).

    Takes the namespace's lock first, as an engine opening it does, so the
    directory of a live engine is never touched. Holding the lock, it renames
    the directory to a hidden ``.kvtier-removing-<pid>-<random>-<name>`` under
    ``root`` (an engine that opens the namespace from then on starts a fresh,
    empty directory), then deletes that. A removal interrupted after the
    rename leaves the hidden directory; pass its name to finish it.

    Args:
        root: the NVMe root (``NVMeConfig.root``).
        name: the directory's name as ``kvtier inspect ROOT`` lists it
            (``<namespace>-<16 hex digits>``): a plain name, no path.

    Returns:
        The disk space freed, in bytes (``st_blocks * 512`` of each file
        whose hard links were all inside the directory).

    Raises:
        InvalidArgumentError: ``name`` is not a plain name, there is no
            ``root/name`` or it is not a namespace directory (a symlink is
            refused too; see :func:`namespace_path`), or its ``lock`` is not
            a regular file; nothing is deleted.
        NamespaceLockedError: a live engine holds the namespace; nothing is
            deleted.
        OSError: the rename or the deletion failed (what is left stays under
            the name the message gives).

    """
    path = namespace_path(root, name)
    base = path.parent
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path / "lock", flags, 0o644)
    except OSError as exc:  # a symlink, a directory...: not a lock an engine made
        raise InvalidArgumentError(f"cannot take the lock of {str(path)!r}: {exc}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device
        os.close(fd)
        raise InvalidArgumentError(f"{str(path / 'lock')!r} is not a regular file")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise NamespaceLockedError(
                f"{str(path)!r} is held by a live engine (pid {pid}); close it first"
            ) from exc
        if not same_file(fd, path / "lock"):
            raise InvalidArgumentError(
                f"{str(path)!r} was removed or recreated while this call locked it "
                f"(another removal, then an engine?): see `kvtier inspect {root}` again"
            )
        freed = _disk_bytes(path)
        if name.startswith(REMOVING_PREFIX):
            doomed = path
        else:
            doomed = base / f"{REMOVING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}"
            os.rename(path, doomed)
        try:
            shutil.rmtree(doomed)
        except OSError as exc:
            raise OSError(
                exc.errno, f"could not delete all of {str(doomed)!r} (rerun with that name): {exc}"
            ) from exc
        return freed
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _label_hint(root: pathlib.Path, name: str) -> str:
    """``"; the folders of namespace NAME are: ..."`` when ``name`` is a namespace label, else ''.

    For a user who passes the ``NVMeConfig.namespace`` instead of a folder
    name, or the folder name without its ``-<digest>`` part.
    """
    folders = folders_of(root, name)
    if folders:
        return f"; the folders of namespace {name!r} are: {', '.join(folders)}"
    digest_of = re.compile(re.escape(name) + r"-[0-9a-f]{16}")  # the name without its digest
    with contextlib.suppress(OSError):
        named = sorted(p.name for p in root.iterdir() if digest_of.fullmatch(p.name))
        if named:
            return f"; folders whose name starts so: {', '.join(named)}"
    return ""


def _disk_bytes(path: pathlib.Path) -> int:
    """Bytes of disk that deleting the files under ``path`` frees (links not followed).

    A file counts once, and only when every one of its hard links is under
    ``path``: a link kept elsewhere keeps its blocks allocated.
    """
    seen: dict[tuple[int, int], list[int]] = {}  # (dev, ino) -> [links here, nlink, blocks]
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                entry = seen.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_blocks])
                entry[0] += 1
    return sum(blocks * 512 for here, nlink, blocks in seen.values() if here >= nlink)
