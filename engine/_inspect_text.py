"""What ``kvtier inspect`` prints: a namespace's formats and rows, the progress line, times.

The command itself (options, exit status) is :func:`kvtier.cli.inspect`; the
figures come from :func:`kvtier.io.inspect_root`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import click


def echo_namespace(ns: dict[str, Any], verify: bool) -> None:
    """Print one namespace of :func:`kvtier.io.inspect_root`'s result (``verify``: its counts)."""
    fmt = ns.get("format") or {}
    pid = ns.get("locked_by_pid")
    holder = "held by no engine" if pid is None else f"held by a live engine (pid {pid})"
    disk = ns.get("disk_nbytes", 0) / 2**20
    click.echo(
        f"- {ns['directory']}  namespace={fmt.get('namespace', '?')} "
        f"blocks_per_chunk={fmt.get('blocks_per_chunk', '?')}; {holder}; "
        f"{disk:.1f} MiB on disk"
    )
    valid = sum(grp.get("valid_rows", 0) for grp in ns["groups"].values())
    click.echo(f"    {format_summary(fmt, ns.get('last_written'), valid)}")
    if verify:
        t = ns["summary"]
        click.echo(
            f"    verified: {t['valid_rows']} valid, {t['corrupt_rows']} corrupt, "
            f"{t['torn_rows']} torn, {t['blank_rows']} blank rows; "
            f"{t['invalid_segments']} invalid segment file(s)"
        )
    for err in ns.get("errors", []):
        click.echo(f"    error: {err}")
    for g, grp in sorted(ns["groups"].items(), key=lambda kv: int(kv[0])):
        grows = (
            f"in {len(grp['segments'])} segment file(s) that can grow to {grp['rows']} rows "
            "(the tier adds files as it needs them)"
        )
        if verify:
            click.echo(
                f"    g{g}: {grp['allocated_rows']} rows allocated: {grp['valid_rows']} valid, "
                f"{grp['corrupt_rows']} corrupt, {grp['torn_rows']} torn, "
                f"{grp['blank_rows']} blank, {grows}"
            )
        else:
            click.echo(
                f"    g{g}: {grp['allocated_rows']} rows allocated, {grp['valid_rows']} valid, "
                f"{grp['invalid_rows']} invalid, {grows}"
            )
        for seg in grp["segments"]:
            name = seg.get("file", "?")
            if seg.get("error"):
                click.echo(f"      {name}: {seg['error']}")
                continue
            problems = seg.get("problems", [])
            for p in problems:
                click.echo(f"      {name}: row {p['row']}: {p['kind']}: {p['error']}")
            more = seg["invalid_rows"] - len(problems)
            if verify and more > 0:
                click.echo(f"      {name}: {more} more corrupt or torn row(s)")
            if not verify and seg.get("truncated"):
                click.echo(
                    f"      {name}: truncated: the file ends inside row {seg['allocated_rows']}"
                )


def no_line() -> None:
    """Nothing to clear: no progress line was drawn."""


def progress_line() -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    """A one-line progress display on stderr when it is a terminal, and its eraser.

    Returns:
        ``(show, clear)``: ``show(bytes_done, bytes_total)`` redraws the line
        (at most ten times a second, and at the end), ``clear()`` erases it.
        ``show`` is None when stderr is not a terminal (nothing is written).
    """
    stream = sys.stderr
    if not stream.isatty():
        return None, no_line
    last = -1.0
    width = 0

    def show(done: int, total: int) -> None:
        nonlocal last, width
        now = time.monotonic()
        if now - last < 0.1 and done < total:
            return
        last = now
        pct = 100 * done // total if total else 100
        text = f"kvtier inspect --verify: {pct:3d}% ({done / 2**20:.1f} of {total / 2**20:.1f} MiB)"
        width = max(width, len(text))
        stream.write("\r" + text.ljust(width))
        stream.flush()

    def clear() -> None:
        if width:
            stream.write("\r" + " " * width + "\r")
            stream.flush()

    return show, clear


def format_summary(fmt: dict[str, Any], last_written: float | None, valid_rows: int) -> str:
    """One line that tells formats of one namespace apart: per group, its layers and row size.

    Any ``format.json`` prints (fields of the wrong type show as ``?``). With
    no valid row, the segment files' time is only when they last changed
    (created or grown by an engine that wrote nothing, or rows invalidated).
    """
    rows, layout = fmt.get("row_nbytes"), fmt.get("layout")
    rows = rows if isinstance(rows, dict) else {}
    groups = layout.get("groups") if isinstance(layout, dict) else None
    parts = []
    for group in groups if isinstance(groups, list) else []:
        if not isinstance(group, dict):
            continue
        layers = group.get("layers")
        layers = [x for x in layers if isinstance(x, dict)] if isinstance(layers, list) else []
        kinds = sorted({f"{x.get('dtype', '?')} {x.get('page_shape', '?')}" for x in layers})
        g = group.get("group_id", "?")
        parts.append(
            f"g{g}: {len(layers)} x {' / '.join(kinds)}, rows of {rows.get(str(g), '?')} B"
        )
    when = (
        f"rows last written {utc(last_written)}"
        if valid_rows or last_written is None
        else f"no valid rows (segment files last changed {utc(last_written)})"
    )
    return f"format: {'; '.join(parts) or 'unknown'}; {when}"


def utc(seconds: float | None) -> str:
    """A Unix time as ``YYYY-MM-DD HH:MM:SS UTC`` (the number itself when out of range)."""
    if seconds is None:
        return "never"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):
        return f"{seconds!r} (Unix seconds)"
